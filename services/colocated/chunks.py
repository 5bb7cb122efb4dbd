"""Prompts waiting for chunked prefill, first come first served, each with its progress.

`take` (engine thread) hands out the next prompt positions within a token budget: the head
prompt's next piece, then the following prompts', so a long prompt is spread over several steps
and never holds back the decodes beside it. `remove` (any thread) takes back a prompt that has
not had any chunk yet; once a chunk has been taken, the engine thread owns the prompt's blocks.
"""

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine imports this module
    from pdserve.services.colocated.engine import Handle


@dataclass
class Waiting:
    handle: "Handle"
    prompt_len: int
    done: int = 0  # prompt positions already prefilled (or handed out this step)


@dataclass(frozen=True)
class Chunk:
    handle: "Handle"
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == self.handle.spec.prompt_len


class ChunkQueue:
    def __init__(self) -> None:
        self._waiting: deque[Waiting] = deque()
        self._lock = threading.Lock()

    def add(self, handle: "Handle", prompt_len: int) -> None:
        with self._lock:
            self._waiting.append(Waiting(handle, prompt_len))

    def remove(self, handle: "Handle") -> bool:
        """True when the prompt was waiting with no chunk taken (the caller frees its blocks)."""
        with self._lock:
            for item in self._waiting:
                if item.handle is handle and item.done == 0:
                    self._waiting.remove(item)
                    return True
            return False

    def drop(self, handle: "Handle") -> None:
        """Forgets a prompt however far it got (engine thread, on cancel or failure)."""
        with self._lock:
            for item in [i for i in self._waiting if i.handle is handle]:
                self._waiting.remove(item)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting)

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def take(self, budget: int) -> list[Chunk]:
        """The next prompt pieces, at most `budget` tokens in all; a completed prompt leaves."""
        chunks: list[Chunk] = []
        with self._lock:
            for item in list(self._waiting):
                if budget <= 0:
                    break
                end = min(item.prompt_len, item.done + budget)
                chunks.append(Chunk(item.handle, item.done, end))
                budget -= end - item.done
                item.done = end
                if end == item.prompt_len:
                    self._waiting.remove(item)
        return chunks
