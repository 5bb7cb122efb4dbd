"""What the benchmarks here share: running `pdserve bench` as a user would, and reading its run."""

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterable


def spread(values: Iterable[float]) -> dict:
    """The median of repeated runs, with the min-max spread a difference must exceed."""
    xs = list(values)
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def shown_spreads(figures: dict[str, dict]) -> str:
    """Figures made by spread(), on one line: 'name median (min-max), ...'."""
    return ", ".join(
        f"{k} {v['median']:.3g} ({v['min']:.3g}-{v['max']:.3g})" for k, v in figures.items()
    )


def pdserve_bench(flags: list[str], tmp: str, name: str = "run", env=None) -> dict:
    """Runs `pdserve bench FLAGS --json ...` (bounded, failing loudly) and returns its one run:
    {"summary": ..., "load_average_1m": ..., ...}."""
    out = os.path.join(tmp, f"{name}.json")
    command = [sys.executable, "-m", "pdserve.cli", "bench", *flags, "--json", out]
    subprocess.run(command, check=True, capture_output=True, timeout=900, env=env)
    with open(out) as f:
        return json.load(f)["runs"][0]


async def drive_schedule(address: str, plan, output_tokens: int) -> list[dict]:
    """Sends each (arrival second, prompt) of `plan` to the router at `address` on schedule,
    greedy with `output_tokens` each; one row per request, with the client-side TTFT and what
    the final response says of its path."""
    import asyncio
    import time

    import grpc

    from pdserve.v1 import pdserve_pb2 as pb
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        start = time.perf_counter()

        async def one(at: float, prompt: list[int]) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            sampling = pb.SamplingParams(max_tokens=output_tokens, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            first, last = None, None
            async for response in stub.Generate(request, timeout=300):
                first = first or time.perf_counter()
                last = response
            assert first is not None and last is not None
            return {
                "prompt_tokens": len(prompt),
                "ttft_s": first - sent,
                "path": last.metrics.prefill_path,
                "handoff_bytes": last.metrics.handoff.bytes,
                "cached_tokens": last.metrics.prefix_cached_tokens,
                "prefill_cached_tokens": last.metrics.prefill_cached_tokens,
                "prefill_seconds": last.metrics.prefill_seconds,
            }

        return list(await asyncio.gather(*(one(at, prompt) for at, prompt in plan)))


def write_results(path: str, conditions: dict, **sections) -> None:
    """Writes a benchmark's results as JSON: its conditions, stamped with the date and the CPU,
    then each section (rows, runs, summary...) under its own name."""
    import datetime

    from pdserve.loadtest.report import cpu_conditions

    stamped = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **conditions,
        "cpu": cpu_conditions(),
    }
    with open(path, "w") as f:
        json.dump({"conditions": stamped, **sections}, f, indent=1)
