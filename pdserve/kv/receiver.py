"""Decode's side of a KV handoff: every check a chunk or commit must pass, whatever carried it.

A transport (a PushKv call, a data-plane connection, the in-process fake) opens one KvStream per
incoming stream and hands the receiver each chunk's header and payload, then the commit. The
receiver binds the stream to the one lease its first chunk names, writes accepted KV into that
lease's blocks, and on commit turns the lease into a running sequence. A stream that breaks or is
refused before its commit voids its lease: the partial KV is dropped and the blocks go back.
Used from the event loop thread only, like the lease table.
"""

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve import metrics
from pdserve.core.config import ModelConfig
from pdserve.core.picked import Pick, TokenLogprobs
from pdserve.faults import Faults
from pdserve.kv.leases import Lease, LeaseRejected, LeaseState, LeaseTable
from pdserve.kv.wire import ChunkHeader, KvRejected, decode_chunk, prompt_digest

log = logging.getLogger(__name__)

# (layer, slots, k, v): stores one chunk's K and V [tokens, heads, dim] in the pool.
KvWriter = Callable[[int, list[int], torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class CommitRecord:
    """The last item of a KV stream: hands the lease's KV to decode."""

    lease_id: str
    first_token_id: int
    num_chunks: int
    digest: int
    request_id: str
    prompt_digest: int
    first_logprobs: TokenLogprobs | None = None  # when the request asked for them

    @property
    def first(self) -> Pick:
        return Pick(self.first_token_id, self.first_logprobs)

    @property
    def key(self) -> tuple[int, int, int, str, int]:
        """What a retried commit must repeat exactly to be accepted again."""
        return (
            self.first_token_id,
            self.num_chunks,
            self.digest,
            self.request_id,
            self.prompt_digest,
        )


@dataclass(frozen=True)
class Committed:
    """Decode's answer to a commit."""

    lease_id: str
    bytes: int
    newly_committed: bool  # False: the same commit had been accepted already (a retry)


class KvStream:
    """One incoming stream. It carries one lease: the one its first chunk (or commit) names."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.lease: Lease | None = None
        self.chunks = 0


class KvReceiver:
    def __init__(
        self,
        leases: LeaseTable,
        write: KvWriter,
        config: ModelConfig,
        model_fingerprint: str,
        on_commit: Callable[[Lease, Pick], None],
        faults: Faults,
    ) -> None:
        self.leases, self._write, self.config = leases, write, config
        self._fingerprint, self._on_commit, self._faults = model_fingerprint, on_commit, faults
        self.chunks_received = 0

    def accept(self, stream: KvStream, header: ChunkHeader, payload) -> None:
        """Checks one chunk and writes it into its lease's blocks. Raises KvRejected (or its
        LeaseRejected) with the reason; the caller then calls refuse()."""
        lease = self._stream_lease(stream, header.lease_id)
        if self._faults.refuses_chunk(self.chunks_received + 1):
            raise KvRejected(f"fault: decode refuses chunk {self.chunks_received + 1}")
        lease.assembly.check(header)
        k, v = decode_chunk(header, payload, self.config, lease.spec.prompt_len, self._fingerprint)
        lease.table.ensure(header.token_end)
        self._write(header.layer, lease.table.slots(header.token_start, header.token_end), k, v)
        lease.assembly.accepted(header, memoryview(payload).nbytes)
        stream.chunks += 1
        self.chunks_received += 1
        self._faults.after_chunk_received(self.chunks_received)
        if lease.state is LeaseState.GRANTED:
            lease.state, lease.first_chunk_at = LeaseState.RECEIVING, time.perf_counter()

    def commit(self, stream: KvStream, record: CommitRecord) -> Committed:
        """Accepts the commit that ends a stream; a retry of an accepted commit is answered
        again, unchanged. Raises KvRejected when the commit does not match what arrived."""
        done = self.leases.committed(record.lease_id)
        if done is not None:
            if stream.lease is not None and stream.lease is not done:
                raise LeaseRejected("one KV stream carries one lease")
            if done.commit_key != record.key:
                raise LeaseRejected(f"lease {record.lease_id!r} was committed with other contents")
            return Committed(done.lease_id, done.assembly.bytes, newly_committed=False)
        lease = self.leases.for_push(record.lease_id)
        if stream.lease is not lease and (
            stream.lease is not None or lease.state is LeaseState.RECEIVING
        ):
            raise LeaseRejected("a commit must come on the stream that carried the lease's KV")
        stream.lease = lease  # from here a refusal voids the lease, even with no chunk before it
        if record.request_id != lease.spec.request_id or record.prompt_digest != prompt_digest(
            lease.spec.prompt_token_ids
        ):
            raise LeaseRejected(f"lease {lease.lease_id!r} belongs to another request or prompt")
        self._check_logprobs(record.first_logprobs, lease)
        lease.assembly.check_commit(record.num_chunks, record.digest)
        if not 0 <= record.first_token_id < self.config.vocab_size:
            raise KvRejected(f"first token {record.first_token_id} outside the vocabulary")
        lease.state, lease.commit_key = LeaseState.COMMITTED, record.key
        lease.committed_at = time.perf_counter()
        lease.transport = stream.transport
        metrics.record_handoff("decode", lease.handoff_seconds, lease.assembly.bytes)
        metrics.KV_TRANSFERS.labels("decode", stream.transport).inc()
        self._on_commit(lease, record.first)
        return Committed(lease.lease_id, lease.assembly.bytes, newly_committed=True)

    def _check_logprobs(self, logprobs: TokenLogprobs | None, lease: Lease) -> None:
        """The first token's log-probabilities come from prefill and go to the client as they
        are: only what the request asked for, token ids of this vocabulary, and no NaN."""
        sampling = lease.spec.sampling
        if (logprobs is not None) != sampling.logprobs:
            raise KvRejected("the commit's logprobs do not match what the request asked for")
        if logprobs is None:
            return
        if len(logprobs.top) != sampling.top_logprobs:
            raise KvRejected(
                f"the commit has {len(logprobs.top)} top logprobs, not {sampling.top_logprobs}"
            )
        if not all(0 <= t < self.config.vocab_size for t, _ in logprobs.top):
            raise KvRejected("a top logprob's token is outside the vocabulary")
        if any(math.isnan(v) or v > 0 for v in (logprobs.logprob, *(v for _, v in logprobs.top))):
            raise KvRejected("a logprob is NaN or positive")

    def refuse(self, stream: KvStream, reason: str) -> None:
        """The stream broke, or was refused, before its commit: its lease is void."""
        if stream.lease is not None:
            self.leases.void(stream.lease, reason)

    def _stream_lease(self, stream: KvStream, lease_id: str) -> Lease:
        """The lease this stream writes to: the one its first chunk named, and no other."""
        lease = self.leases.for_push(lease_id)
        if stream.lease is None and lease.state is not LeaseState.GRANTED:
            raise LeaseRejected(f"lease {lease_id!r} is already receiving on another stream")
        if stream.lease is not None and lease is not stream.lease:
            raise LeaseRejected("one KV stream carries one lease")
        stream.lease = lease
        return lease


def status_name(exc: KvRejected) -> str:
    """The gRPC status, by name, that a refusal gets on every transport: FAILED_PRECONDITION for
    a lease problem, INVALID_ARGUMENT for KV that fails its checks."""
    return "FAILED_PRECONDITION" if isinstance(exc, LeaseRejected) else "INVALID_ARGUMENT"
