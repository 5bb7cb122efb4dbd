"""Cancels asked for by any thread, carried out by the engine thread alone.

A request is cancelled from a service's thread (its client left, its lease expired) while the
engine thread may be scheduling, prefilling or decoding it. Rather than a flag and a lock on every
request that both threads read and write, a cancel is a message: `ask` queues it from any thread,
and the engine thread `take`s the queue at the top of each step, between forward passes, where it
alone owns every request's state (its place in a queue, its blocks, its sequence). So each
cancellation state has one writer, and no pass ever sees a request change under it.
"""

import threading
from collections import deque
from typing import Generic, TypeVar

Item = TypeVar("Item")


class Cancellations(Generic[Item]):
    def __init__(self) -> None:
        self._asked: deque[Item] = deque()
        self._lock = threading.Lock()

    def ask(self, item: Item) -> None:
        """Any thread: cancel `item` at the engine's next step (the caller wakes the loop)."""
        with self._lock:
            self._asked.append(item)

    def take(self) -> list[Item]:
        """Engine thread: every cancel asked for since the last take, in order."""
        with self._lock:
            items = list(self._asked)
            self._asked.clear()
        return items

    @property
    def pending(self) -> bool:
        """Cancels are waiting: the loop must run a step to carry them out."""
        return bool(self._asked)
