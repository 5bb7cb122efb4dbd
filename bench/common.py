"""What the benchmarks here share: running `pdserve bench` as a user would, and reading its run."""

import json
import os
import subprocess
import sys


def pdserve_bench(flags: list[str], tmp: str, name: str = "run", env=None) -> dict:
    """Runs `pdserve bench FLAGS --json ...` (bounded, failing loudly) and returns its one run:
    {"summary": ..., "load_average_1m": ..., ...}."""
    out = os.path.join(tmp, f"{name}.json")
    command = [sys.executable, "-m", "pdserve.cli", "bench", *flags, "--json", out]
    subprocess.run(command, check=True, capture_output=True, timeout=900, env=env)
    with open(out) as f:
        return json.load(f)["runs"][0]
