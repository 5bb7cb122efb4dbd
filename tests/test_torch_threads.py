"""A served process forms one OpenMP team, its engine thread's (pdserve/engine/torch_threads.py).

Each case runs in a fresh interpreter, so that no earlier test's torch work has left a team
behind on the thread that counts them.
"""

import json
import subprocess
import sys

# The main thread reserves 2 threads and then runs torch, as a service's main thread loads a
# model and ingests KV; an EngineLoop then runs one step of torch work. A parallel region
# starts a team of workers for the thread that runs it, and the workers outlive the region.
ONE_TEAM = """
import json, os, threading, torch
from pdserve.engine import torch_threads
from pdserve.engine.engine_loop import EngineLoop

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
torch_threads.reserve_for_engine(2)
torch.ones(4_000_000).add_(1)  # big enough for torch to split it between threads
seen = {"main threads": torch.get_num_threads()}
stepped = threading.Event()

def step():
    torch.ones(4_000_000).add_(1)
    seen["engine threads"] = torch.get_num_threads()
    seen["threads started"] = threads() - before
    stepped.set()

loop = EngineLoop("engine", step, has_work=lambda: not stepped.is_set(), on_crash=print)
loop.start()
seen["stepped"] = stepped.wait(60)
loop.stop()
print(json.dumps(seen))
"""


def _run(script: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_only_the_engine_thread_runs_torch_on_the_reserved_threads():
    seen = _run(ONE_TEAM)
    assert seen["stepped"]
    assert seen["main threads"] == 1
    assert seen["engine threads"] == 2
    # The engine thread and the one worker of its team; a team of the main thread's would be
    # a third, and would make libgomp's workers sleep between regions (the module says why).
    assert seen["threads started"] == 2, seen


def test_threads_reserved_must_be_positive():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pdserve.engine import torch_threads; torch_threads.reserve_for_engine(0)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "torch threads must be at least 1, got 0" in result.stderr
