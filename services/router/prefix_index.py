"""Which instances hold which prompt prefixes, as far as this router knows.

After a request completes, its prompt's full-block keys (the hash chain of
pdserve.core.prefix_cache) are recorded against the decode instance that served it and the
prefill instance that computed it, each if it keeps a prefix cache: that instance now caches
those blocks, unless it has evicted them since. The index is the router's
belief, not the truth: a miss costs only the prefill that would have run anyway. It is bounded
(least recently used keys are forgotten), so memory does not grow with traffic.
"""

from collections import OrderedDict

from pdserve.core.prefix_cache import block_keys

MAX_KEYS = 200_000  # about 20 MB of keys and names


class PrefixIndex:
    def __init__(self, block_size: int, max_keys: int = MAX_KEYS) -> None:
        self.block_size, self.max_keys = block_size, max_keys
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def set_block_size(self, block_size: int) -> None:
        """Decode cuts its blocks at another size than assumed: what is recorded is useless."""
        self.block_size = block_size
        self._holders.clear()

    def keys(self, prompt: tuple[int, ...], salt: bytes = b"") -> list[bytes]:
        return block_keys(prompt, self.block_size, salt)

    def record(self, keys: list[bytes], instance: str) -> None:
        for key in keys:
            self._holders.setdefault(key, set()).add(instance)
            self._holders.move_to_end(key)
        while len(self._holders) > self.max_keys:
            self._holders.popitem(last=False)

    def cached_tokens(self, keys: list[bytes], instance: str) -> int:
        """How many of the prompt's leading tokens `instance` is believed to hold."""
        blocks = 0
        for key in keys:
            if instance not in self._holders.get(key, ()):
                break
            blocks += 1
        return blocks * self.block_size
