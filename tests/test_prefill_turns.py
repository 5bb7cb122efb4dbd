"""Prefill's queue takes turns by client: one client's burst delays another client's prompt by
one turn, not by the whole burst. In process, on the scheduler the prefill service runs."""

from pdserve.core.fair_lines import FairLines
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.engine.prefill_scheduler import PrefillJob, PrefillScheduler
from test_prefill_prefix import CountingModel


def test_lines_take_turns_and_keep_each_clients_order():
    lines: FairLines[str] = FairLines()
    for i in range(4):
        lines.append("a", f"a{i}")
    lines.append("b", "b0")
    lines.append("b", "b1")
    assert len(lines) == 6 and lines.peek() == "a0"
    taken = [lines.pop()[1] for _ in range(6)]
    # a first (it came first), then turns while both wait, then what a has left, in order.
    assert taken == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert len(lines) == 0 and lines.peek() is None


def test_a_client_that_comes_later_goes_before_one_just_served():
    lines: FairLines[str] = FairLines()
    lines.append("a", "a0")
    lines.append("a", "a1")
    assert lines.pop() == ("a", "a0")
    lines.append("c", "c0")  # never served: its turn comes first
    assert lines.pop() == ("c", "c0")
    assert lines.remove("a1") and not lines.remove("a1") and len(lines) == 0


def _job(client: str, name: str, done: list[str]) -> PrefillJob:
    spec = GenerateSpec(name, tuple(range(1, 33)), SamplingSpec())
    return PrefillJob(
        spec,
        lambda layer, k, v: None,
        on_done=lambda pick, timing: done.append(name),
        on_error=lambda message: done.append(f"{name}: {message}"),
        client=client,
    )


def test_a_burst_of_one_client_does_not_queue_another_behind_it():
    scheduler = PrefillScheduler(CountingModel(), 2, 4096, frozenset())
    done: list[str] = []
    for i in range(10):
        scheduler.add(_job("alice", f"a{i}", done))
    scheduler.add(_job("bob", "b0", done))
    assert scheduler.queue_depth == 11 and scheduler.queued_tokens == 11 * 32
    scheduler.step()
    assert done == ["a0", "b0"]  # FIFO would have run a0 and a1, and b0 after five batches
    while scheduler.has_work:
        scheduler.step()
    assert done == ["a0", "b0", *(f"a{i}" for i in range(1, 10))]
    assert scheduler.queue_depth == 0
