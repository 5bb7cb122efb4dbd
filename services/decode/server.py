"""The Decode gRPC service: leases, the KV push stream and the token stream.

All lease bookkeeping happens on the event loop thread; the engine thread only decodes.
"""

import asyncio
import logging
import time

import grpc

from pdserve import metrics
from pdserve.core.block_pool import NeverFits, PoolExhausted
from pdserve.core.kv_wire import ChunkHeader, KvRejected, decode_chunk, prompt_digest
from pdserve.core.request import InvalidRequest, validate
from pdserve.models.loading import ModelMismatch, ServedModel, check_same_model
from pdserve.rpc import convert
from pdserve.rpc.server import (
    Admission,
    Server,
    admitted,
    emission_queue,
    instance_name,
    run_until_signalled,
)
from pdserve.settings import DecodeSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.decode.engine import DecodeEngine
from services.decode.leases import Lease, LeaseRejected, LeaseState, LeaseTable

log = logging.getLogger(__name__)

DTYPE_FROM_PB = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT16: "float16",
    pb.DTYPE_BFLOAT16: "bfloat16",
}
EXPIRY_CHECK_SECONDS = 0.1


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, served: ServedModel, settings: DecodeSettings, instance: str) -> None:
        self.served, self.config = served, served.config
        self.settings, self.instance = settings, instance
        self.engine = DecodeEngine(served, settings)
        self.leases = LeaseTable(self.engine.pool, self.config)
        self.admission = Admission()
        self.chunks_received = 0

    @admitted
    async def Generate(self, request: pb.DecodeRequest, context):
        try:
            check_same_model(self.served, request.model_fingerprint, "the lease request")
            spec = validate(
                convert.spec_from_internal(
                    request.request_id, request.prompt_token_ids, request.sampling
                ),
                self.config,
            )
        except ModelMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        events, sink = emission_queue()
        ttl = self.settings.lease_ttl_seconds
        if 0 < request.lease_ttl_seconds < ttl:  # a caller may shorten the lease, not lengthen it
            ttl = request.lease_ttl_seconds
        try:
            lease = self.leases.grant(spec, ttl, sink)
        except NeverFits as exc:
            metrics.REQUESTS.labels("decode", "error", "OUT_OF_RANGE").inc()
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE, f"request larger than the pool: {exc}"
            )
        except PoolExhausted as exc:
            metrics.REQUESTS.labels("decode", "error", "RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode pool full: {exc}")
        log.debug(
            "lease %s granted for request %s (%d blocks)",
            lease.lease_id,
            spec.request_id,
            lease.table.capacity_blocks,
        )
        try:
            yield pb.DecodeEvent(
                lease=pb.LeaseGranted(
                    lease_id=lease.lease_id,
                    blocks=lease.table.capacity_blocks,
                    instance=self.instance,
                    expires_at_unix=time.time() + ttl,
                )
            )
            async for event in self._events(lease, events, context):
                yield event
        finally:
            self._end(lease)

    async def _events(self, lease: Lease, events: asyncio.Queue, context):
        while True:
            emission = await events.get()
            if emission.error is not None:
                metrics.REQUESTS.labels("decode", "error", "ABORTED").inc()
                await context.abort(grpc.StatusCode.ABORTED, emission.error)
            tokens = pb.TokenEvent(token_ids=emission.token_ids, text=emission.text)
            if emission.finish_reason is None:
                yield pb.DecodeEvent(tokens=tokens)
            else:
                seq = lease.sequence
                metrics.REQUESTS.labels("decode", "ok", "OK").inc()
                yield pb.DecodeEvent(
                    finished=pb.DecodeFinished(
                        last=tokens,
                        finish_reason=convert.FINISH_TO_PB[emission.finish_reason],
                        usage=pb.Usage(
                            prompt_tokens=lease.spec.prompt_len,
                            completion_tokens=seq.generated if seq else 0,
                        ),
                        handoff_receive_seconds=lease.handoff_seconds,
                        handoff_bytes=lease.assembly.bytes,
                    )
                )
                return

    def _end(self, lease: Lease) -> None:
        """However the token stream ends, the lease's blocks go back."""
        if lease.state is LeaseState.COMMITTED and lease.sequence is not None:
            self.engine.abort(lease.sequence)
        else:
            self.leases.void(lease, "request ended before its KV was committed")
        self.leases.forget(lease)

    async def PushKv(self, request_iterator, context) -> pb.PushKvReply:
        lease = None
        try:
            async for push in request_iterator:
                if push.HasField("chunk"):
                    lease = self._stream_lease(push.chunk.lease_id, lease)
                    self._accept_chunk(push.chunk, lease)
                elif push.HasField("commit"):
                    return self._commit(push.commit, lease)
                else:
                    raise KvRejected("a KV push with neither chunk nor commit")
            raise KvRejected("KV stream ended without a commit")
        except KvRejected as exc:
            if lease is not None:
                self.leases.void(lease, f"KV transfer rejected: {exc}")
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if isinstance(exc, LeaseRejected)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(exc))
            raise AssertionError("unreachable: context.abort raises")
        except BaseException:
            if lease is not None:  # the stream broke or was cancelled before its commit
                self.leases.void(lease, "KV stream broke before its commit")
            raise

    def _stream_lease(self, lease_id: str, current: Lease | None) -> Lease:
        """The lease this stream writes to: the one its first chunk named, and no other."""
        lease = self.leases.for_push(lease_id)
        if current is None and lease.state is not LeaseState.GRANTED:
            raise LeaseRejected(f"lease {lease_id!r} is already receiving on another stream")
        if current is not None and lease is not current:
            raise LeaseRejected("one KV stream carries one lease")
        return lease

    def _accept_chunk(self, chunk: pb.KvChunk, lease: Lease) -> None:
        payload = chunk.data  # read once: every access copies
        header = ChunkHeader(
            chunk.index,
            chunk.layer,
            chunk.token_start,
            chunk.token_end,
            DTYPE_FROM_PB.get(chunk.dtype, "unspecified"),
            tuple(chunk.shape),
            chunk.crc32,
            chunk.model_fingerprint,
        )
        lease.assembly.check(header)
        k, v = decode_chunk(
            header, payload, self.config, lease.spec.prompt_len, self.served.fingerprint
        )
        lease.table.ensure(header.token_end)
        self.engine.cache.write(
            header.layer, lease.table.slots(header.token_start, header.token_end), k, v
        )
        lease.assembly.accepted(header, len(payload))
        self.chunks_received += 1
        self.settings.common.faults.after_chunk_received(self.chunks_received)
        if lease.state is LeaseState.GRANTED:
            lease.state, lease.first_chunk_at = LeaseState.RECEIVING, time.perf_counter()

    def _commit(self, commit: pb.KvCommit, current: Lease | None) -> pb.PushKvReply:
        key = (
            commit.first_token_id,
            commit.num_chunks,
            commit.digest,
            commit.request_id,
            commit.prompt_digest,
        )
        done = self.leases.committed(commit.lease_id)
        if done is not None:
            if current is not None and current is not done:
                raise LeaseRejected("one KV stream carries one lease")
            if done.commit_key != key:
                raise LeaseRejected(f"lease {commit.lease_id!r} was committed with other contents")
            return pb.PushKvReply(
                lease_id=done.lease_id, bytes=done.assembly.bytes, newly_committed=False
            )
        lease = self.leases.for_push(commit.lease_id)
        if current is not lease and (current is not None or lease.state is LeaseState.RECEIVING):
            raise LeaseRejected("a commit must come on the stream that carried the lease's KV")
        if commit.request_id != lease.spec.request_id or commit.prompt_digest != prompt_digest(
            lease.spec.prompt_token_ids
        ):
            raise LeaseRejected(f"lease {lease.lease_id!r} belongs to another request or prompt")
        lease.assembly.check_commit(commit.num_chunks, commit.digest)
        if not 0 <= commit.first_token_id < self.config.vocab_size:
            raise KvRejected(f"first token {commit.first_token_id} outside the vocabulary")
        lease.state, lease.commit_key = LeaseState.COMMITTED, key
        lease.committed_at = time.perf_counter()
        metrics.record_handoff("decode", lease.handoff_seconds, lease.assembly.bytes)
        lease.sequence = self.engine.start_sequence(lease, commit.first_token_id)
        return pb.PushKvReply(
            lease_id=lease.lease_id, bytes=lease.assembly.bytes, newly_committed=True
        )

    async def GetPoolStats(self, request, context) -> pb.PoolStats:
        return pb.PoolStats(
            total_blocks=self.engine.pool.num_blocks,
            free_blocks=self.engine.pool.available_blocks,
            block_size=self.engine.pool.block_size,
            running=self.engine.scheduler.size,
            pending_leases=self.leases.pending,
            instance=self.instance,
        )

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return convert.model_info_to_pb(self.served)

    async def expire_leases_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_SECONDS)
            expired = self.leases.expire()
            if expired:
                log.warning("%d lease(s) expired uncommitted; their blocks are free again", expired)


async def serve(served: ServedModel, settings: DecodeSettings) -> None:
    server = Server(settings.common.host, settings.common.port)
    instance = settings.common.instance or instance_name(
        "decode", settings.common.host, server.port
    )
    servicer = DecodeServicer(served, settings, instance)
    metrics.start(settings.common.metrics_port)
    metrics.watch_pool(
        "decode",
        lambda: servicer.engine.pool.available_blocks,
        settings.num_blocks,
        lambda: servicer.engine.scheduler.size,
    )
    pb_grpc.add_DecodeServicer_to_server(servicer, server.grpc)
    servicer.engine.start()
    expiry = asyncio.create_task(servicer.expire_leases_forever())

    async def on_stop() -> None:
        expiry.cancel()
        servicer.engine.stop()

    await run_until_signalled(
        server, instance, settings.common.grace_seconds, servicer.admission, on_stop
    )
