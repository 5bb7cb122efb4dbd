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

A request with several completions (n) reserves room for all of them at once. Once its prompt's
KV is written, `BlockTable.fork` gives each further completion a table that shares the blocks
before the prompt's last token, read only (they go back when the last table sharing them does),
and has the rest of its room of its own.
"""

import threading
from collections.abc import Sequence

from pdserve.core.prefix_cache import PrefixCache, block_keys
from pdserve.core.request import GenerateSpec


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

    def shared_by_forks(self, prompt_len: int) -> int:
        """Blocks that the completions of one prompt share: those before its last token's,
        which every completion writes again (its first step runs that token)."""
        return (prompt_len - 1) // self.block_size

    def blocks_for_choices(self, tokens: int, prompt_len: int, choices: int) -> int:
        """Blocks for `choices` completions of `tokens` tokens each, from one prompt."""
        each = self.blocks_for(tokens)
        return each + (choices - 1) * (each - self.shared_by_forks(prompt_len))

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

    def blocks_wanted(self, spec: GenerateSpec) -> int:
        """Blocks a request reserves: room for every completion of it."""
        return self.blocks_for_choices(spec.max_total_tokens, spec.prompt_len, spec.sampling.n)

    def reserve_for(self, spec: GenerateSpec) -> "BlockTable":
        """A request's reservation: every completion's room, starting from the longest prefix
        of its prompt cached under its salt."""
        return self.reserve(
            spec.max_total_tokens,
            spec.prompt_token_ids,
            reuse=True,
            salt=spec.cache_salt,
            choices=spec.sampling.n,
        )

    def reserve(
        self,
        tokens: int,
        prompt: Sequence[int] = (),
        reuse: bool = False,
        salt: bytes = b"",
        choices: int = 1,
    ) -> "BlockTable":
        """A table with room for `tokens` tokens, or PoolExhausted. With a prefix cache,
        `prompt` names the blocks the table may leave cached when released, and `reuse` starts
        the table with the cached blocks of the prompt's longest cached prefix (never its last
        token, whose logits give the first output token): `cached_tokens` says how many. Only
        blocks cached under the same `salt` are found. `choices` > 1 also reserves the room
        that the table's forks (the prompt's further completions) will take."""
        each = self.blocks_for(tokens)
        need = self.blocks_for_choices(tokens, len(prompt), choices)
        if need > self.num_blocks:
            raise NeverFits(
                f"request larger than the KV pool: it needs {need} blocks ({tokens} tokens"
                f"{f' for each of {choices} completions' if choices > 1 else ''}); "
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
        table = BlockTable(self, each, shared, keys, len(prompt))
        table.fork_promise = need - each
        return table

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
        """`blocks` hold a table's positions from 0. Shared blocks go back to the cache; owned
        full prompt blocks whose KV is written (`keys` names them) become cached; the rest are
        free again."""
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


class _ForkedBlocks:
    """A prompt's blocks that several completions' tables read: whoever releases last gives
    them back, as the first table would have given them back alone."""

    def __init__(self, blocks: list[int], shared: int, keys: list[bytes]) -> None:
        self.blocks, self.shared, self.keys = blocks, shared, keys
        self.kept: list[int] = []  # the first table's full prompt blocks after these
        self.holders = 1


class BlockTable:
    """The blocks of one sequence, in token order, within a reservation of `capacity_blocks`.

    The first `shared` blocks come from the prefix cache, already holding the prompt's first
    `cached_tokens` tokens of KV; they are read, never written. Set `prompt_written` once the
    whole prompt's KV is in, so that release may leave its full blocks cached. `fork_promise`
    is the room reserved for the table's forks, not yet handed to one."""

    def __init__(
        self,
        pool: BlockPool,
        capacity_blocks: int,
        shared: list[int] | None = None,
        keys: list[bytes] | None = None,
        prompt_len: int = 0,
    ) -> None:
        self._pool = pool
        self.capacity_blocks = capacity_blocks
        self.blocks: list[int] = list(shared or [])
        self.shared = len(self.blocks)
        self.cached_tokens = self.shared * pool.block_size
        self._keys = keys or []
        self._prompt_len = prompt_len
        self.prompt_written = False
        self.released = False
        self.fork_promise = 0
        self._forked: _ForkedBlocks | None = None  # the blocks it shares with its forks

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

    def fork(self) -> "BlockTable":
        """A table for another completion of this prompt, whose KV is written: it shares the
        blocks before the prompt's last token and has room for the rest of its own, taken from
        `fork_promise`. It holds the last token's block already; the caller copies that block's
        KV into it."""
        if self.released or not self.prompt_written:
            raise RuntimeError("only a live table whose prompt is written can be forked")
        pool, first_own = self._pool, self._pool.shared_by_forks(self._prompt_len)
        own = self.capacity_blocks - first_own
        if own > self.fork_promise:
            raise RuntimeError("the reservation has no room left for another completion")
        if self._forked is None:
            self._forked = _ForkedBlocks(self.blocks[:first_own], self.shared, self._keys)
        self._forked.holders += 1
        self.fork_promise -= own
        child = BlockTable(pool, self.capacity_blocks, prompt_len=self._prompt_len)
        child.blocks, child._forked = list(self._forked.blocks), self._forked
        child.ensure(self._prompt_len)
        return child

    def release(self) -> None:
        """Returns every block and the unused part of the reservation; safe to call twice."""
        if self.released:
            return
        self.released = True
        unused = self.capacity_blocks - len(self.blocks) + self.fork_promise
        forked, self.fork_promise = self._forked, 0
        if forked is None:
            keys = self._keys if self.prompt_written else []
            self._pool._give_back(self.blocks, unused, self.shared, keys)
        else:
            self._release_forked(forked, unused)
        self.blocks = []

    def _release_forked(self, forked: _ForkedBlocks, unused: int) -> None:
        """The blocks past the shared ones go back now, except full prompt blocks that may stay
        cached: those join the shared ones, so that all go back in order, parents after
        children, when the last table holding them is released."""
        own = self.blocks[len(forked.blocks) :]
        keys = self._keys if self.prompt_written else []  # a fork's table has none
        keyed = max(0, min(len(keys), len(self.blocks)) - len(forked.blocks))
        forked.kept += own[:keyed]
        self._pool._give_back(own[keyed:], unused, 0, [])
        forked.holders -= 1
        if forked.holders == 0:
            blocks = forked.blocks + forked.kept
            self._pool._give_back(blocks, 0, forked.shared, forked.keys)
