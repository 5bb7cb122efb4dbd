"""Leases: who may write KV into which reserved blocks, and until when.

A lease's life:  granted --(chunks)--> receiving --(commit)--> committed --> ended
                      \\------------(expiry | bad chunk | broken stream | cancel)--> void
Void before commit: the partial KV is discarded and the blocks go back at once. After commit
the sequence belongs to the decode scheduler, which frees the blocks when it ends. A lease id is
random, single-use and bound to one request: once void or ended it is never valid again.
"""

import secrets
import time
from dataclasses import dataclass
from enum import Enum

from pdserve.core.block_pool import BlockPool, BlockTable
from pdserve.core.config import ModelConfig
from pdserve.kv.wire import KvAssembly, KvRejected
from pdserve.core.request import GenerateSpec
from pdserve.core.sequence import Emission, Sequence, Sink


class LeaseRejected(KvRejected):
    """The lease named is unknown, void, expired, committed already, or not this stream's."""


class LeaseState(Enum):
    GRANTED = "granted"
    RECEIVING = "receiving"
    COMMITTED = "committed"
    VOID = "void"


@dataclass
class Lease:
    lease_id: str
    spec: GenerateSpec
    table: BlockTable
    sink: Sink
    expires_at: float  # time.monotonic()
    assembly: KvAssembly
    state: LeaseState = LeaseState.GRANTED
    sequence: Sequence | None = None
    # (first token, chunk count, digest, request id, prompt digest) of the accepted commit
    commit_key: tuple[int, int, int, str, int] | None = None
    first_chunk_at: float | None = None
    transport: str = ""  # what carried its KV, once committed
    committed_at: float | None = None

    @property
    def handoff_seconds(self) -> float:
        if self.first_chunk_at is None or self.committed_at is None:
            return 0.0
        return self.committed_at - self.first_chunk_at


class LeaseTable:
    """Every live lease of one decode instance. Used from the event loop thread only."""

    def __init__(self, pool: BlockPool, config: ModelConfig) -> None:
        self.pool, self.config = pool, config
        self._leases: dict[str, Lease] = {}

    def grant(self, spec: GenerateSpec, ttl: float, sink: Sink) -> Lease:
        """Reserves room for the whole request; raises PoolExhausted when there is none."""
        table = self.pool.reserve(spec.max_total_tokens)
        lease = Lease(
            secrets.token_hex(16),
            spec,
            table,
            sink,
            time.monotonic() + ttl,
            KvAssembly(self.config, spec.prompt_len),
        )
        self._leases[lease.lease_id] = lease
        return lease

    def for_push(self, lease_id: str) -> Lease:
        """The lease a KV chunk or commit names, if it may still receive KV."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseRejected(f"unknown, expired or finished lease {lease_id!r}")
        if lease.state is LeaseState.COMMITTED:
            raise LeaseRejected(f"lease {lease_id!r} is already committed")
        if time.monotonic() > lease.expires_at:
            self.void(lease, "lease expired before its KV was committed")
            raise LeaseRejected(f"lease {lease_id!r} expired")
        return lease

    def committed(self, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.state is LeaseState.COMMITTED else None

    def void(self, lease: Lease, reason: str) -> None:
        """Ends an uncommitted lease: discards its KV, frees its blocks, tells its stream why."""
        if lease.state in (LeaseState.COMMITTED, LeaseState.VOID):
            return
        lease.state = LeaseState.VOID
        lease.table.release()
        self._leases.pop(lease.lease_id, None)
        lease.sink(Emission((), "", error=reason))

    def forget(self, lease: Lease) -> None:
        """Drops a lease whose request has ended (its blocks are freed by whoever owns them)."""
        self._leases.pop(lease.lease_id, None)

    def expire(self) -> int:
        """Voids every uncommitted lease past its expiry; returns how many."""
        now = time.monotonic()
        late = [
            lease
            for lease in self._leases.values()
            if lease.state is not LeaseState.COMMITTED and now > lease.expires_at
        ]
        for lease in late:
            self.void(lease, "lease expired before its KV was committed")
        return len(late)

    @property
    def pending(self) -> int:
        return sum(1 for lease in self._leases.values() if lease.state is not LeaseState.COMMITTED)
