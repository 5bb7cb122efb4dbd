"""Prefill calls in progress at each prefill instance, held to what the instance admits.

A prefill instance refuses a Prefill call beyond its --max-concurrent-prefills with
RESOURCE_EXHAUSTED. Without a limit of its own, the router would pass that refusal on whenever
decode has room for more prompts than prefill has calls: a burst of 300 short requests lost 342
of 1,500 streams that way (bench/fairness.py). So the router keeps at most
--prefill-calls-per-instance calls in progress at each instance. A request over it waits in its
client's line (pdserve/core/fair_lines.py: clients take turns), bounded in time like the wait
for decode room, and takes the next place that frees there. It already holds its decode lease,
so the requests that wait are bounded in number by decode's pending-lease share.
"""

import asyncio
import time

import grpc

from pdserve.core.fair_lines import FairLines
from pdserve.settings import RouterSettings
from pdserve.services.router.errors import RouterError


class PrefillSlot:
    """One Prefill call's place at an instance, given back once (when the call ends, or when
    the attempt ends before making it)."""

    def __init__(self, slots: "PrefillSlots", address: str) -> None:
        self._slots, self._address, self._held = slots, address, True

    def give_back(self) -> None:
        if self._held:
            self._held = False
            self._slots.release(self._address)


class PrefillSlots:
    def __init__(self, settings: RouterSettings) -> None:
        self._settings = settings
        self._in_progress: dict[str, int] = {}  # per instance address
        self._lines: dict[str, FairLines[asyncio.Future]] = {}  # per instance address

    @property
    def waiting(self) -> int:
        """Requests waiting for a Prefill call at any instance."""
        return sum(len(lines) for lines in self._lines.values())

    def in_progress(self, address: str) -> int:
        return self._in_progress.get(address, 0)

    async def take(self, address: str, client: str, deadline: float) -> PrefillSlot:
        """A place for one Prefill call at `address`, at once if it has one free and nobody
        waits for it; else after a wait in `client`'s line, bounded by --queue-timeout-seconds
        and by `deadline` (time.monotonic()) -> RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED."""
        lines = self._lines.setdefault(address, FairLines())
        if not lines and self.in_progress(address) < self._settings.prefill_calls:
            self._in_progress[address] = self.in_progress(address) + 1
            lines.count_turn(client)
            return PrefillSlot(self, address)
        give_up = min(time.monotonic() + self._settings.queue_timeout_seconds, deadline)
        granted: asyncio.Future = asyncio.get_running_loop().create_future()
        lines.append(client, granted)
        self._hand_out(address)  # the line ahead may be only requests that have given up
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a result that came in
        # as the task was cancelled, and the cancellation is lost.
        try:
            async with asyncio.timeout(max(give_up - time.monotonic(), 0.0)):
                await granted
        except TimeoutError:
            if not _has_result(granted):
                raise self._timed_out(address, give_up >= deadline) from None
        except asyncio.CancelledError:
            if _has_result(granted):
                self.release(address)  # handed over just as the client left: pass it on
            raise
        finally:
            lines.remove(granted)  # if _hand_out() has not taken it out already
        return PrefillSlot(self, address)

    def release(self, address: str) -> None:
        """A call at `address` ended: its place goes to the next waiter's turn, if any."""
        self._in_progress[address] -= 1
        self._hand_out(address)

    def _hand_out(self, address: str) -> None:
        """Free places at `address` to the waiters whose turn it is."""
        lines = self._lines[address]
        while lines and self.in_progress(address) < self._settings.prefill_calls:
            _client, granted = lines.pop()  # its turn: granted now, unless it has given up
            if not granted.done():
                self._in_progress[address] += 1
                granted.set_result(None)

    def _timed_out(self, address: str, at_deadline: bool) -> RouterError:
        if at_deadline:
            return RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while waiting to prefill"
            )
        return RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"prefill {address} had no room for another call "
            f"(--prefill-calls-per-instance {self._settings.prefill_calls}) within "
            f"{self._settings.queue_timeout_seconds:.1f} s",
        )


def _has_result(granted: asyncio.Future) -> bool:
    return granted.done() and not granted.cancelled()
