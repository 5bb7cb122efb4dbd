"""KV block accounting for a paged cache: a free list, reservations, per-sequence block tables.

Plain Python (no torch) so it can be tested alone. A reservation promises room for a number of
tokens; physical blocks are taken from the free list as the sequence grows into that room, and
all of them come back when the reservation is released. Thread-safe: the gRPC threads reserve and
release while the engine thread grows sequences.
"""

import threading


class PoolExhausted(Exception):
    """Not enough unreserved blocks for the reservation asked for."""


class NeverFits(PoolExhausted):
    """The reservation is larger than the whole pool: waiting will not help."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._promised = 0  # blocks reserved but not yet taken from the free list
        self._lock = threading.Lock()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def available_blocks(self) -> int:
        """Blocks that a new reservation could still get."""
        with self._lock:
            return len(self._free) - self._promised

    def reserve(self, tokens: int) -> "BlockTable":
        """A table with room for `tokens` tokens, or PoolExhausted."""
        need = self.blocks_for(tokens)
        if need > self.num_blocks:
            raise NeverFits(
                f"request larger than the KV pool: it needs {need} blocks ({tokens} tokens); "
                f"the whole pool has {self.num_blocks}"
            )
        with self._lock:
            if need > len(self._free) - self._promised:
                raise PoolExhausted(
                    f"KV pool full: need {need} blocks, {len(self._free) - self._promised} of "
                    f"{self.num_blocks} free"
                )
            self._promised += need
        return BlockTable(self, need)

    def _take(self) -> int:
        with self._lock:
            self._promised -= 1
            return self._free.pop()

    def _give_back(self, blocks: list[int], unused_promise: int) -> None:
        with self._lock:
            self._free.extend(reversed(blocks))
            self._promised -= unused_promise


class BlockTable:
    """The blocks of one sequence, in token order, within a reservation of `capacity_blocks`."""

    def __init__(self, pool: BlockPool, capacity_blocks: int) -> None:
        self._pool = pool
        self.capacity_blocks = capacity_blocks
        self.blocks: list[int] = []
        self.released = False

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self._pool.block_size

    def ensure(self, tokens: int) -> None:
        """Takes blocks from the reservation until `tokens` tokens fit."""
        if self.released:
            raise RuntimeError("block table used after release")
        need = self._pool.blocks_for(tokens)
        if need > self.capacity_blocks:
            raise ValueError(f"{tokens} tokens exceed the reservation of {self.capacity_tokens}")
        while len(self.blocks) < need:
            self.blocks.append(self._pool._take())

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slot (block * block_size + offset) of every token position in [start, end)."""
        bs = self._pool.block_size
        return [self.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def release(self) -> None:
        """Returns every block and the unused part of the reservation; safe to call twice."""
        if self.released:
            return
        self.released = True
        self._pool._give_back(self.blocks, self.capacity_blocks - len(self.blocks))
        self.blocks = []
