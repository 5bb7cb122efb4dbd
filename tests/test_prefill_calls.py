"""The router holds Prefill calls to what a prefill instance admits (--prefill-calls-per-instance)
instead of passing on its RESOURCE_EXHAUSTED, and the requests over it wait, clients taking
turns."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from procs import generate, greedy_request, start_stack, wait_until

from pdserve.services.router.errors import RouterError
from pdserve.services.router.prefill_slots import PrefillSlots
from pdserve.settings import CommonSettings, RouterSettings

ADDRESS = "prefill:1"


def _slots(calls: int, timeout: float = 30.0) -> PrefillSlots:
    return PrefillSlots(
        RouterSettings(CommonSettings(), prefill_calls=calls, queue_timeout_seconds=timeout)
    )


def test_calls_over_the_limit_wait_and_clients_take_turns():
    async def run() -> list[str]:
        slots, order = _slots(2), []
        held = [await slots.take(ADDRESS, "a", time.monotonic() + 60) for _ in range(2)]

        async def wait(client: str, name: str):
            slot = await slots.take(ADDRESS, client, time.monotonic() + 60)
            order.append(name)
            return slot

        waiters = [asyncio.create_task(wait("a", f"a{i}")) for i in range(3)]
        waiters.append(asyncio.create_task(wait("b", "b0")))
        await _until(lambda: slots.waiting == 4)  # every waiter is in its line
        assert slots.waiting == 4 and slots.in_progress(ADDRESS) == 2
        for served in range(1, 5):
            held.pop(0).give_back()
            # The place passes to the next waiter, never to one more.
            await _until(lambda: len(order) == served)
            assert sum(w.done() for w in waiters) == served and slots.in_progress(ADDRESS) == 2
            held.append(_newest(waiters, order))
        held[0].give_back()
        held[0].give_back()  # once only: a second give-back changes nothing
        assert slots.in_progress(ADDRESS) == 1
        for slot in held[1:]:
            slot.give_back()
        assert slots.in_progress(ADDRESS) == 0 and slots.waiting == 0
        return order

    # b came last, but a was served twice already: b's turn comes first.
    assert asyncio.run(run()) == ["b0", "a0", "a1", "a2"]


async def _until(condition, turns: int = 100) -> None:
    """Lets the event loop run until `condition` holds, for a bounded number of turns (no other
    work runs here, so a handover takes a few)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition did not come true")


def _newest(waiters: list[asyncio.Task], order: list[str]):
    """The slot of the waiter served last ("a1" is waiters[1], "b0" waiters[3])."""
    name = order[-1]
    return waiters[3 if name == "b0" else int(name[1:])].result()


def test_a_wait_is_bounded_and_a_request_that_left_passes_its_place_on():
    async def run() -> None:
        slots = _slots(1, timeout=0.2)
        held = await slots.take(ADDRESS, "a", time.monotonic() + 60)
        with pytest.raises(RouterError) as late:
            await slots.take(ADDRESS, "b", time.monotonic() + 60)
        assert late.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--prefill-calls-per-instance 1" in late.value.args[0]
        with pytest.raises(RouterError) as deadline:
            await slots.take(ADDRESS, "b", time.monotonic() + 0.05)
        assert deadline.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert slots.waiting == 0

        gone = asyncio.create_task(slots.take(ADDRESS, "c", time.monotonic() + 60))
        await _until(lambda: slots.waiting == 1)
        held.give_back()  # handed to c ...
        gone.cancel()  # ... as c's client leaves: the place is free again, not lost
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert slots.in_progress(ADDRESS) == 0
        (await slots.take(ADDRESS, "d", time.monotonic() + 60)).give_back()

    asyncio.run(run())


def test_a_burst_beyond_what_prefill_admits_completes(tmp_path):
    """Prefill admits 2 calls at once. 24 requests at once, with prompts long enough to keep
    prefill busy, all complete with the tokens one request alone gets; with the router's limit
    above prefill's, RESOURCE_EXHAUSTED reaches clients instead."""
    prompt = [(7 * i) % 250 + 1 for i in range(600)]
    for router_calls, expect_all in (("2", True), ("64", False)):
        stack = start_stack(
            str(tmp_path),
            prefill_flags=["--max-concurrent-prefills", "2"],
            router_flags=["--prefill-calls-per-instance", router_calls],
        )
        try:
            stub = stack.router_stub()
            alone, _, _ = generate(stub, greedy_request(prompt, 4))

            def one(i: int):
                try:
                    return generate(stub, greedy_request(prompt, 4, f"r{i}"))[0]
                except grpc.RpcError as exc:
                    return exc.code()

            with ThreadPoolExecutor(24) as pool:
                results = list(pool.map(one, range(24)))
            refused = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert all(r == alone for r in results if r not in refused), results
            if expect_all:
                assert not refused, f"{len(refused)} of 24 refused"
            else:
                assert refused, "prefill admitted every call: the burst did not test the limit"
            wait_until(stack.pools_settled, 30, "the decode pool to be whole again")
        finally:
            stack.stop()
