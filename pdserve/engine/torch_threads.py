"""Which thread of a service runs torch's parallel regions: the engine's, and no other.

torch's CPU build runs its intra-op parallelism on libgomp. libgomp keeps a team of workers for
every thread that has run a parallel region, for as long as that thread lives, and counts the
workers of all teams together. Once they outnumber the CPUs it may use, a worker spins only
briefly between regions and then sleeps on a futex, so every region of a step pays a wake-up.
A service's main thread loads the model, warms it up and runs the asyncio loop (gRPC, HTTP, KV
ingest); when it ran torch with the service's threads too, it kept a second team, and the
engine's step paid that wake-up in each of its hundreds of regions.

Measured on a 2-vCPU AMD EPYC (AVX2), `pdserve serve colocated --weights dense`, SmolLM2 in
bfloat16, one stream, 2026-12-07: 44-51 ms between tokens (ITL p50) with two teams, its engine
thread switching out 2,400 times a second; 26-30 ms with the engine's team alone, about what the
same engine gives stepped in-process (28 ms a token). docs/measurements.md has the runs.

So a service gives its torch threads to its engine: `reserve_for_engine` on the main thread at
start makes the main thread's torch work serial (it never forms a team), and
`enter_engine_thread`, the engine thread's first act, gives that thread the threads reserved.
"""

import logging

import torch

log = logging.getLogger(__name__)

_reserved = 0  # threads for the engine's thread; 0: nothing reserved (tests, tools)


def reserve_for_engine(threads: int) -> None:
    """Called once, on the service's main thread, before it runs any torch: its torch work runs
    on this thread alone from now on, and an engine thread started later gets `threads`."""
    global _reserved
    if threads < 1:
        raise ValueError(f"torch threads must be at least 1, got {threads}")
    _reserved = threads
    torch.set_num_threads(1)


def enter_engine_thread() -> None:
    """The engine thread's first act: it takes the threads reserved for it (nothing when none
    were, as where an engine is built in-process by a test or a benchmark)."""
    if _reserved:
        torch.set_num_threads(_reserved)
        log.info("engine thread: torch on %d threads", torch.get_num_threads())
