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

from pdserve.core.shown import shown
from pdserve.core.block_pool import BlockPool, BlockTable, PoolExhausted
from pdserve.core.client_shares import ClientShares
from pdserve.core.config import ModelConfig
from pdserve.kv.wire import KvAssembly, KvRejected
from pdserve.core.request import GenerateSpec
from pdserve.engine.sequence import Emission, Sequence, Sink


class LeaseRejected(KvRejected):
    """The lease named is unknown, void, expired, committed already, or not this stream's."""


class PendingLimit(PoolExhausted):
    """Leases still waiting for their KV already hold the share of the pool they may hold."""


@dataclass(frozen=True)
class LeaseLimits:
    ttl: float  # seconds from grant to commit
    first_chunk: float  # seconds from grant to the first chunk
    pending_share: float  # of the pool's blocks, that uncommitted leases may hold together
    client_share: float = 1.0  # of the pool's blocks, that one client's leases may hold


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
    first_chunk_by: float  # time.monotonic(): a lease with no chunk by then is void
    assembly: KvAssembly
    state: LeaseState = LeaseState.GRANTED
    sequence: Sequence | None = None
    # (first token, chunk count, digest, request id, prompt digest) of the accepted commit
    commit_key: tuple[int, int, int, str, int] | None = None
    first_chunk_at: float | None = None
    transport: str = ""  # what carried its KV, once committed
    committed_at: float | None = None
    caller: str = ""  # who reserved it (pdserve/rpc/tls.py peer_identity), for the pending shares
    reserved_blocks: int = 0  # the whole reservation, every completion's room included

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
        # Every reservation's blocks by client, leases and prompts prefilled here alike.
        self.client_shares = ClientShares(pool.num_blocks)

    def reserve_local(self, spec: GenerateSpec, client_share: float) -> BlockTable:
        """Room for a prompt prefilled here (no lease, no KV to wait for), within its client's
        pool share as a lease's is. Raises ClientLimit over that share, PoolExhausted (or
        NeverFits) without room."""
        return self.client_shares.reserve(self.pool, spec, client_share)

    def grant(self, spec: GenerateSpec, limits: LeaseLimits, sink: Sink, caller: str = "") -> Lease:
        """Reserves room for the whole request. Raises PoolExhausted when there is none,
        PendingLimit when the caller's leases without KV would hold more than its share: a
        caller that reserves and never sends KV cannot take every block, nor lock out the
        others' reservations (see _over_share); and ClientLimit over the client's pool share
        (core/client_shares.py)."""
        wanted = self.pool.blocks_wanted(spec)
        refusal = self._over_share(caller, wanted, limits.pending_share)
        if refusal and not self._under_client_part(caller, spec.client, wanted, limits):
            raise PendingLimit(refusal)
        # With a prefix cache, the table starts with the prompt's longest cached prefix (its KV
        # is not sent again), and its blocks may stay cached once the KV is in.
        table = self.client_shares.reserve(self.pool, spec, limits.client_share)
        now = time.monotonic()
        lease = Lease(
            secrets.token_hex(16),
            spec,
            table,
            sink,
            now + limits.ttl,
            now + min(limits.first_chunk, limits.ttl),
            KvAssembly(self.config, spec.prompt_len, table.cached_tokens),
            caller=caller,
            reserved_blocks=wanted,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def _over_share(self, caller: str, wanted: int, pending_share: float) -> str:
        """Why `caller` may not reserve `wanted` more blocks now, or "" when it may.

        The pending cap (--max-pending-lease-share of the pool) is shared fairly between the
        callers that hold uncommitted leases right now, counted separately by identity: each
        may hold cap / n, n being those callers with this one. So one router alone may use the
        whole cap, as before; and whatever others hold, a caller below its own share is let in
        (the pool itself still decides), so callers that reserve and never send KV, or re-reserve
        as soon as their leases expire, can never take the router's share. They are stopped at
        theirs, and when a newcomer halves it they get no more until their own leases end. A
        caller's first reservation is let in whatever its size (or a large request could never
        run); one larger than the whole pool is left to reserve() to refuse for good. The
        total is the cap in the steady state, and at most the pool.
        """
        if wanted > self.pool.num_blocks:
            return ""
        pending = self._pending()
        held = sum(lease.reserved_blocks for lease in pending if lease.caller == caller)
        if not held:
            return ""
        share, callers = self._caller_share(caller, pending_share)
        if held + wanted <= share:
            return ""
        return (
            f"KV pool full for new leases from this caller: its leases waiting for their KV "
            f"hold {held} of {self.pool.num_blocks} blocks; this one needs {wanted}, over its "
            f"share of {share} blocks (the pending share of {pending_share:g}, "
            f"--max-pending-lease-share, split between {callers} callers)"
        )

    def _caller_share(self, caller: str, pending_share: float) -> tuple[int, int]:
        """The blocks `caller`'s uncommitted leases may hold, and the number of callers the
        pending cap is split between."""
        callers = len({lease.caller for lease in self._pending()} | {caller})
        return int(pending_share * self.pool.num_blocks) // callers, callers

    def _under_client_part(
        self, caller: str, client: str, wanted: int, limits: LeaseLimits
    ) -> bool:
        """Whether `client` of a `caller` over its pending share still holds less than its part
        of it: the caller's share split between its clients with uncommitted leases (the router
        names its clients). Otherwise one client's burst of leases waiting for their KV (for a
        prefill call, say) fills the router's share, and another client's request waits for
        them (bench/fairness.py). A caller's leases can so reach at most twice its share, and
        a caller that names many clients only splits its own share between them."""
        pending = [lease for lease in self._pending() if lease.caller == caller]
        clients = {lease.spec.client for lease in pending} | {client}
        held = sum(lease.reserved_blocks for lease in pending if lease.spec.client == client)
        share, _ = self._caller_share(caller, limits.pending_share)
        return held + wanted <= share // len(clients)

    def for_push(self, lease_id: str) -> Lease:
        """The lease a KV chunk or commit names, if it may still receive KV."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseRejected(f"unknown, expired or finished lease {shown(lease_id)}")
        if lease.state is LeaseState.COMMITTED:
            raise LeaseRejected(f"lease {shown(lease_id)} is already committed")
        why = _overdue(lease, time.monotonic())
        if why:
            self.void(lease, why)
            raise LeaseRejected(f"lease {shown(lease_id)} expired")
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
        """Voids every uncommitted lease past either deadline; returns how many."""
        now = time.monotonic()
        late = [(lease, why) for lease in self._pending() if (why := _overdue(lease, now))]
        for lease, why in late:
            self.void(lease, why)
        return len(late)

    def _pending(self) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.state is not LeaseState.COMMITTED]

    @property
    def pending(self) -> int:
        return len(self._pending())


def _overdue(lease: Lease, now: float) -> str:
    """Why an uncommitted lease is past its time, or "" while it is not."""
    if now > lease.expires_at:
        return "lease expired before its KV was committed"
    if lease.state is LeaseState.GRANTED and now > lease.first_chunk_by:
        return "lease expired: no KV chunk arrived in time (--lease-first-chunk-seconds)"
    return ""
