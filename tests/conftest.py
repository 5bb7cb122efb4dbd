"""Shared fixtures: one disaggregated stack and one colocated engine for the session.

Every test that uses the stack checks afterwards that the decode pool's free blocks are back where
they started (waiting, bounded, for cancellations to be processed).
"""

import os

import pytest

# Every service a test starts serves TinyGPT unless the test names another model: it is small and
# fast, and the reference comparisons use it. (The product's default is SmolLM2.)
os.environ["PDSERVE_MODEL"] = "tinygpt"

import reference  # noqa: E402

from procs import Stack, free_port, start_service, start_stack, wait_until

POOL_SETTLE_SECONDS = 15.0


def pytest_terminal_summary(terminalreporter):
    """How often a served token was accepted only as a near-tie with the reference's best."""
    totals = reference.TOTALS
    if totals["tokens"]:
        terminalreporter.write_line(
            f"reference comparison: {totals['tokens']} served tokens checked, "
            f"{totals['near_ties']} accepted as near-ties (top-two logits within "
            f"{reference.TOLERANCE})"
        )


@pytest.fixture(scope="session")
def _session_stack(tmp_path_factory) -> Stack:
    stack = start_stack(str(tmp_path_factory.mktemp("stack")))
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def colocated(tmp_path_factory):
    service = start_service(
        "colocated",
        "--torch-threads",
        "1",
        "--http-port",
        str(free_port()),
        tmp_dir=str(tmp_path_factory.mktemp("colocated")),
    )
    yield service
    service.stop()


@pytest.fixture
def stack(_session_stack: Stack) -> Stack:
    before = _session_stack.pool_stats()
    assert before.free_blocks == before.total_blocks, "a previous test leaked decode blocks"
    yield _session_stack
    wait_until(
        lambda: settled(_session_stack.pool_stats(), before.free_blocks),
        POOL_SETTLE_SECONDS,
        "decode pool free blocks to return to their start value, nothing running or pending",
    )


def settled(stats, free_blocks: int) -> bool:
    """All three figures at once: each is read in one GetPoolStats, so none lags another."""
    return stats.free_blocks == free_blocks and stats.running == 0 and stats.pending_leases == 0
