"""Waiting work in one line per client, taken in turns: the client served least recently first.

A burst from one client then delays another client's next item by at most one item per other
client with work waiting, not by the whole burst (the router's admission does the same for
decode room and for prefill calls: services/router/reservation.py, prefill_slots.py). Within a line, first come first served. Not
thread-safe: the caller holds its own lock.
"""

from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class FairLines(Generic[T]):
    def __init__(self) -> None:
        self._lines: dict[Hashable, deque[T]] = {}
        self._served: dict[Hashable, int] = {}  # when each client's item was last taken
        self._turn = 0
        self._count = 0

    def append(self, client: Hashable, item: T) -> None:
        self._lines.setdefault(client, deque()).append(item)
        self._count += 1

    def put_back(self, client: Hashable, item: T) -> None:
        """`item` first in its client's line again (a batch that could not start)."""
        self._lines.setdefault(client, deque()).appendleft(item)
        self._count += 1

    def _next_client(self, passing: Hashable | None = None) -> Hashable | None:
        # A client never served (or forgotten) goes first: its turn counts as 0.
        others = [c for c in self._lines if c != passing] or list(self._lines)
        return min(others, key=lambda c: self._served.get(c, 0), default=None)

    def peek(self, passing: Hashable | None = None) -> T | None:
        """The item whose turn it is, left in place; with `passing`, the next other client's
        (that client's own when no other waits)."""
        client = self._next_client(passing)
        return None if client is None else self._lines[client][0]

    def pop(self) -> tuple[Hashable, T]:
        """Takes the item whose turn it is (IndexError when none waits)."""
        client = self._next_client()
        if client is None:
            raise IndexError("pop from empty FairLines")
        return client, self.pop_from(client)

    def pop_from(self, client: Hashable) -> T:
        """Takes the first item of `client`'s line out of turn (KeyError when it has none); it
        counts as that client's turn."""
        line = self._lines[client]
        item = line.popleft()
        if not line:
            del self._lines[client]
        self._count -= 1
        self.count_turn(client)
        return item

    def count_turn(self, client: Hashable) -> None:
        """`client` was just served (also without waiting): the others go before it next."""
        self._turn += 1
        self._served[client] = self._turn
        self._forget_idle()

    def waiting_for(self, client: Hashable) -> int:
        return len(self._lines.get(client, ()))

    def clients(self) -> list[Hashable]:
        """The clients with work waiting."""
        return list(self._lines)

    def remove(self, item: T) -> bool:
        """Takes `item` out wherever it waits; True if it was waiting."""
        for client, line in self._lines.items():
            if item in line:
                line.remove(item)
                if not line:
                    del self._lines[client]
                self._count -= 1
                return True
        return False

    def clear(self) -> list[T]:
        """Every waiting item, taken out."""
        items = [item for line in self._lines.values() for item in line]
        self._lines.clear()
        self._count = 0
        return items

    def _forget_idle(self) -> None:
        # Turns are kept only for clients with work waiting, plus the most recent ones: a client
        # back after a long pause has waited longest anyway.
        if len(self._served) > 2 * len(self._lines) + 64:
            keep = sorted(self._served, key=self._served.__getitem__)[-64:]
            self._served = {c: self._served[c] for c in {*keep, *self._lines}}

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[T]:
        return (item for line in self._lines.values() for item in line)
