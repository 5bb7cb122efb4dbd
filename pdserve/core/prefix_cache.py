"""Full, immutable KV blocks of finished requests, found again by the tokens they hold.

A block is named by a hash chain, as in vLLM and SGLang: block i's key is a digest of block
i-1's key and block i's own tokens, so a key stands for the whole prefix up to that block, and two
prompts share a key exactly when they share that prefix. BLAKE2b (16 bytes) rather than Python's
hash(): a collision would hand one prompt another prompt's KV, and the router computes the same
keys in another process.

Blocks in use by a running sequence are pinned; idle ones are kept in least-recently-used order
and evicted, oldest first, when the pool needs room. A block's parent is used whenever the block
is, and blocks are given back last-first, so a parent is never older than its children and
eviction never strands a child behind a missing parent. Plain Python, no torch; the pool's lock
guards every call.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def block_keys(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The key of every full block of `tokens`, in order. The salt starts the chain, so prompts
    with different salts never share a key."""
    keys: list[bytes] = []
    parent = salt
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in block))
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self) -> None:
        self._idle: OrderedDict[bytes, int] = OrderedDict()  # key -> block, oldest first
        self._pinned: dict[bytes, tuple[int, int]] = {}  # key -> (block, users)
        self._key_of: dict[int, bytes] = {}  # block -> key

    @property
    def idle_blocks(self) -> int:
        """Blocks that eviction could give back now."""
        return len(self._idle)

    @property
    def blocks(self) -> int:
        return len(self._key_of)

    def take(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `keys`, pinned for one more user."""
        found: list[int] = []
        for key in keys:
            block = self._idle.pop(key, None)
            if block is not None:
                self._pinned[key] = (block, 1)
            elif key in self._pinned:
                block, users = self._pinned[key]
                self._pinned[key] = (block, users + 1)
            else:
                break
            found.append(block)
        return found

    def give_back(self, blocks: list[int]) -> None:
        """One user fewer for each of these cached blocks; idle ones become the newest."""
        for block in reversed(blocks):
            key = self._key_of[block]
            _, users = self._pinned[key]
            if users > 1:
                self._pinned[key] = (block, users - 1)
            else:
                del self._pinned[key]
                self._idle[key] = block

    def add(self, key: bytes, block: int) -> bool:
        """Keeps a block no one uses any more under its key; False when the key is cached
        already (the caller frees its copy)."""
        if key in self._idle or key in self._pinned:
            return False
        self._idle[key] = block
        self._key_of[block] = key
        return True

    def evict(self, count: int) -> list[int]:
        """Up to `count` idle blocks, oldest first, forgotten and handed back for reuse."""
        freed: list[int] = []
        while self._idle and len(freed) < count:
            key, block = self._idle.popitem(last=False)
            del self._key_of[block]
            freed.append(block)
        return freed
