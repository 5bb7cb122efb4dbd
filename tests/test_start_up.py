"""What a service does before it serves: every role that holds the model warms it up, and every
service keeps its start-up heap out of garbage collection (pdserve/rpc/start_up_heap.py), so
that neither a first wide pass nor a full collection stalls the streams it serves later."""

import gc
import re
import subprocess
import sys

FROZEN = re.compile(
    r"(\d+) objects from start-up kept out of garbage collection; a full collection "
    r"took ([\d.]+) ms with them, ([\d.]+) ms now"
)

# Start-up's garbage (here 20,000 lists in cycles, unreachable) is collected, not frozen with
# the rest: frozen, it would stay for the process's whole life.
GARBAGE_FIRST = """
import gc
from pdserve.rpc.start_up_heap import freeze_start_up_heap
gc.disable()
for _ in range(20_000):
    cycle = []
    cycle.append(cycle)
del cycle
alive = len(gc.get_objects())
freeze_start_up_heap("test")
frozen = gc.get_freeze_count()
print(alive, frozen, len(gc.get_objects()))
"""


def test_each_service_of_the_stack_froze_its_start_up_heap(stack):
    for service in (stack.router, *stack.prefills, *stack.decodes):
        with open(service.log_path, errors="replace") as f:
            found = FROZEN.search(f.read())
        assert found, f"{service.role} logged no frozen start-up heap"
        # the interpreter, grpc and torch alone leave tens of thousands of objects
        assert int(found.group(1)) > 10_000, found.group(0)


def test_each_role_that_holds_the_model_warms_it_up_before_it_serves(stack):
    for service in (*stack.prefills, *stack.decodes):
        with open(service.log_path, errors="replace") as f:
            logged = f.read()
        warmed, serving = logged.find("warmed up: a "), logged.find(" serving on port ")
        assert warmed != -1, f"{service.role} did not warm up"
        assert warmed < serving, f"{service.role} served before it warmed up"


def test_start_up_garbage_is_collected_before_the_heap_is_frozen():
    result = subprocess.run(
        [sys.executable, "-c", GARBAGE_FIRST], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    alive, frozen, tracked_after = map(int, result.stdout.split())
    assert frozen <= alive - 20_000, (alive, frozen)
    assert tracked_after < 1_000, "objects left in the collector's generations after freezing"
    assert gc.get_freeze_count() == 0, "the test process itself must not be frozen"
