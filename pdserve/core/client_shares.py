"""What each client's requests hold of a pool, for --max-pool-share-per-client.

A reservation is counted from when it is made until its table is released, whoever releases it
(the engine when a sequence ends, a voided lease, a cancel). So one client's burst cannot fill the
pool: what is left over is room that another client's request finds at once, instead of waiting
for the burst's first stream to end (bench/fairness.py). Used from one thread (an event loop);
tables may be released from another, which only sets their `released` flag.
"""

from dataclasses import dataclass

from pdserve.core.block_pool import BlockPool, BlockTable, PoolExhausted
from pdserve.core.request import GenerateSpec


class ClientLimit(PoolExhausted):
    """One client's requests already hold the share of the pool one client may hold."""


@dataclass(frozen=True)
class Reservation:
    client: str
    table: BlockTable
    blocks: int  # the whole reservation, every completion's room included


class ClientShares:
    def __init__(self, pool_blocks: int) -> None:
        self.pool_blocks = pool_blocks
        self._held: list[Reservation] = []

    def refusal(self, client: str, wanted: int, share: float) -> str:
        """Why `client` may not reserve `wanted` more blocks now, holding at most `share` of the
        pool, or "" when it may. A client's first reservation is let in whatever its size (or a
        large request could never run)."""
        if share >= 1:
            return ""  # the pool itself decides
        held = self.held_by(client)
        cap = int(share * self.pool_blocks)
        if not held or held + wanted <= cap:
            return ""
        return (
            f"KV pool full for this client: its requests hold {held} of {self.pool_blocks} "
            f"blocks; this one needs {wanted}, over one client's share of {cap} "
            f"(--max-pool-share-per-client {share:g})"
        )

    def reserve(self, pool: BlockPool, spec: GenerateSpec, share: float) -> BlockTable:
        """Room for `spec` in `pool`, counted in its client's share until released. Raises
        ClientLimit over that share, PoolExhausted (or NeverFits) without room."""
        wanted = pool.blocks_wanted(spec)
        refusal = self.refusal(spec.client, wanted, share)
        if refusal:
            raise ClientLimit(refusal)
        table = pool.reserve_for(spec)
        self._forget_released()  # whatever the share, so the list holds live tables only
        self._held.append(Reservation(spec.client, table, wanted))
        return table

    def held_by(self, client: str) -> int:
        """The blocks reserved for `client` by tables not yet released."""
        self._forget_released()
        return sum(r.blocks for r in self._held if r.client == client)

    @property
    def tracked(self) -> int:
        """Reservations remembered now (live ones, and any released since the last call)."""
        return len(self._held)

    def _forget_released(self) -> None:
        self._held = [r for r in self._held if not r.table.released]
