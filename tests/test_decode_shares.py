"""Decode's batch shared between clients (pdserve/engine/decode_scheduler.py): a burst of one
client's streams does not hold every slot while another client's stream waits to join."""

import pytest

from pdserve.core.block_pool import BlockPool
from pdserve.core.picked import Pick
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.engine.decode_scheduler import DecodeScheduler
from pdserve.models.tokenizer import ByteTokenizer

SLOTS = 4


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=64, block_size=4)


def started(scheduler: DecodeScheduler, pool: BlockPool, client: str, n: int) -> list:
    sequences = []
    for i in range(n):
        spec = GenerateSpec(
            f"{client}-{i}", (65, 66), SamplingSpec(max_tokens=8, ignore_eos=True), client=client
        )
        table = pool.reserve(spec.max_total_tokens)
        table.ensure(2)
        sequences.append(scheduler.start(spec, table, lambda emission: None, Pick(67)))
    return sequences


def clients_running(scheduler: DecodeScheduler) -> list[str]:
    return sorted(s.spec.client for s in scheduler.schedule())


def test_a_lone_client_has_every_slot(pool):
    scheduler = DecodeScheduler(runner=None, tokenizer=ByteTokenizer(), max_batch=SLOTS)
    started(scheduler, pool, "a", 6)
    assert clients_running(scheduler) == ["a"] * SLOTS


def test_a_client_that_waits_gets_its_share_of_a_full_batch(pool):
    """A holds every slot; B's stream joins at the next step, in A's newest one's place, and A's
    paused stream keeps its blocks and rejoins when a slot frees."""
    scheduler = DecodeScheduler(runner=None, tokenizer=ByteTokenizer(), max_batch=SLOTS)
    a = started(scheduler, pool, "a", 5)
    assert [s.spec.request_id for s in scheduler.schedule()] == ["a-0", "a-1", "a-2", "a-3"]
    started(scheduler, pool, "b", 1)
    free = pool.available_blocks
    assert clients_running(scheduler) == ["a", "a", "a", "b"]
    assert a[3] not in scheduler.running and not a[3].table.released
    assert pool.available_blocks == free
    assert scheduler.size == 6  # the paused one is still counted, waiting
    # B's second stream takes a second slot (its share is 2 of 4), a third does not.
    started(scheduler, pool, "b", 2)
    assert clients_running(scheduler) == ["a", "a", "b", "b"]
    # A slot frees: the client whose turn it is (A, served less recently) takes it.
    scheduler.abort(scheduler.running[0])
    assert clients_running(scheduler) == ["a", "a", "b", "b"]


def test_shares_do_not_churn_once_even(pool):
    scheduler = DecodeScheduler(runner=None, tokenizer=ByteTokenizer(), max_batch=SLOTS)
    started(scheduler, pool, "a", 6)
    started(scheduler, pool, "b", 6)
    first = scheduler.schedule()
    assert sorted(s.spec.client for s in first) == ["a", "a", "b", "b"]
    again = list(first)
    assert scheduler.schedule() == again  # the same sequences step on: nothing paused
