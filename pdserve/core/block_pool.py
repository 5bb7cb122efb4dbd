"""KV block accounting for a paged cache: a free list, reservations, per-sequence block tables.

Plain Python (no torch) so it can be tested alone. A reservation promises room for a number of
tokens; physical blocks are taken from the free list as the sequence grows into that room, and
all of them come back when the reservation is released. Thread-safe: the gRPC threads reserve and
release while the engine thread grows sequences.

With a prefix cache (pdserve/core/prefix_cache.py), a released table's full prompt blocks stay
cached instead of going back, once their KV is known to be written (`prompt_written`); a
reservation may start with the cached blocks of its prompt's longest cached prefix (`reuse`),
shared read-only; and idle cached blocks are evicted, oldest first, when a reservation needs
room. They count as available all along.
"""

import threading
from collections.abc import Sequence

from pdserve.core.prefix_cache import PrefixCache, block_keys


class PoolExhausted(Exception):
    """Not enough unreserved blocks for the reservation asked for."""


class NeverFits(PoolExhausted):
    """The reservation is larger than the whole pool: waiting will not help."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._promised = 0  # blocks reserved but not yet taken from the free list
        self._lock = threading.Lock()
        self.cache = PrefixCache() if prefix_cache else None

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def available_blocks(self) -> int:
        """Blocks that a new reservation could still get (idle cached ones included)."""
        with self._lock:
            return self._room()

    @property
    def cached_blocks(self) -> int:
        with self._lock:
            return self.cache.blocks if self.cache else 0

    def _room(self) -> int:
        return len(self._free) - self._promised + (self.cache.idle_blocks if self.cache else 0)

    def reserve(
        self, tokens: int, prompt: Sequence[int] = (), reuse: bool = False, salt: bytes = b""
    ) -> "BlockTable":
        """A table with room for `tokens` tokens, or PoolExhausted. With a prefix cache,
        `prompt` names the blocks the table may leave cached when released, and `reuse` starts
        the table with the cached blocks of the prompt's longest cached prefix (never its last
        token, whose logits give the first output token): `cached_tokens` says how many. Only
        blocks cached under the same `salt` are found."""
        need = self.blocks_for(tokens)
        if need > self.num_blocks:
            raise NeverFits(
                f"request larger than the KV pool: it needs {need} blocks ({tokens} tokens); "
                f"the whole pool has {self.num_blocks}"
            )
        keys = block_keys(prompt, self.block_size, salt) if self.cache is not None else []
        with self._lock:
            shared = self._shared_prefix(keys, len(prompt)) if reuse else []
            new = need - len(shared)
            if new > self._room():
                if shared and self.cache is not None:
                    self.cache.give_back(shared)
                raise PoolExhausted(
                    f"KV pool full: need {new} blocks, {self._room()} of {self.num_blocks} free"
                )
            short = new - (len(self._free) - self._promised)
            if short > 0 and self.cache is not None:
                self._free.extend(self.cache.evict(short))
            self._promised += new
        return BlockTable(self, need, shared, keys)

    def _shared_prefix(self, keys: list[bytes], prompt_len: int) -> list[int]:
        if self.cache is None or prompt_len == 0:
            return []
        return self.cache.take(keys[: (prompt_len - 1) // self.block_size])

    def _take(self) -> int:
        with self._lock:
            self._promised -= 1
            return self._free.pop()

    def _give_back(
        self, blocks: list[int], unused_promise: int, shared: int, keys: list[bytes]
    ) -> None:
        """Shared blocks go back to the cache; owned full prompt blocks whose KV is written
        (`keys` names them) become cached; the rest are free again."""
        with self._lock:
            freed = blocks[shared:]
            if self.cache is not None:
                self.cache.give_back(blocks[:shared])
                owned = list(enumerate(freed, start=shared))
                # Last first, so that parents are the newest idle blocks (prefix_cache.py).
                kept = {
                    b for i, b in reversed(owned) if i < len(keys) and self.cache.add(keys[i], b)
                }
                freed = [b for b in freed if b not in kept]
            self._free.extend(reversed(freed))
            self._promised -= unused_promise


class BlockTable:
    """The blocks of one sequence, in token order, within a reservation of `capacity_blocks`.

    The first `shared` blocks come from the prefix cache, already holding the prompt's first
    `cached_tokens` tokens of KV; they are read, never written. Set `prompt_written` once the
    whole prompt's KV is in, so that release may leave its full blocks cached."""

    def __init__(
        self,
        pool: BlockPool,
        capacity_blocks: int,
        shared: list[int] | None = None,
        keys: list[bytes] | None = None,
    ) -> None:
        self._pool = pool
        self.capacity_blocks = capacity_blocks
        self.blocks: list[int] = list(shared or [])
        self.shared = len(self.blocks)
        self.cached_tokens = self.shared * pool.block_size
        self._keys = keys or []
        self.prompt_written = False
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
        keys = self._keys if self.prompt_written else []
        unused = self.capacity_blocks - len(self.blocks)
        self._pool._give_back(self.blocks, unused, self.shared, keys)
        self.blocks = []
