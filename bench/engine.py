"""The engine at the speed of the hardware: paged decode steps against the memory-bound limit,
for batches that mix context lengths, and prefill tokens/s as prompts grow.

A decode step must at least read every weight once and every sequence's own KV once, so its
floor is (weight bytes + the batch's KV bytes) / copy bandwidth, with the bandwidth measured in
the same run (a warm tensor copy of COPY_MIB). Measured here, per model and per mix:

  step      one `decode_paged` over a PagedCache holding the mix (median of --repeats, after a
            warm-up; the mixes interleaved repeat by repeat), with building the step's view
  limit     the floor above
  ratio     step / limit; the goal is <= 2
  and, for the mix with one long sequence, its step against the same batch without it plus the
  long sequence's own KV read at copy bandwidth (goal <= 1.3).
  prefill   tokens/s of `prefill_packed` for one prompt of 256, 1,024 and 3,000 tokens (goal: the
            3,000-token prompt at >= 0.6 of the 256-token rate).

  .venv/bin/python bench/engine.py                      # TinyGPT and SmolLM2, ~3 minutes
  .venv/bin/python bench/engine.py --models tinygpt --threads 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from pdserve.core.block_pool import BlockPool
from pdserve.engine.paged_cache import PagedCache
from pdserve.models.loading import load_served_model

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
COPY_MIB = 256
# name -> context lengths of the batch (tokens cached before the step)
MIXES = {
    "32x200": [200] * 32,
    "31x200+1x3000": [200] * 31 + [3000],
    "31x200": [200] * 31,
    "64x512": [512] * 64,
    "1x4000": [4000],
}
LONG_MIX, ITS_BASE, LONG = "31x200+1x3000", "31x200", 3000
PREFILL_LENGTHS = (256, 1024, 3000)


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a copy between two warm tensors (the best of a few)."""
    src = torch.ones(COPY_MIB << 18)  # float32: COPY_MIB MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best


class Setup:
    """One model with a pool big enough for every mix, and each mix's block tables."""

    def __init__(self, name: str) -> None:
        self.served = load_served_model(name)
        self.config = self.served.config
        blocks = max(sum(-(-(n + 1) // BLOCK_SIZE) for n in m) for m in MIXES.values())
        self.cache = PagedCache(self.config, blocks, BLOCK_SIZE)
        self.cache.kv.normal_()  # touched, as a serving pool's memory is
        self.weight_bytes = sum(
            p.numel() * p.element_size() for p in self.served.model.parameters()
        )

    def step_seconds(self, lengths: list[int]) -> float:
        pool = BlockPool(self.cache.kv.shape[3] // BLOCK_SIZE, BLOCK_SIZE)
        tables = [pool.reserve(n + 1) for n in lengths]
        for table, n in zip(tables, lengths):
            table.ensure(n + 1)
        tokens = [5] * len(lengths)
        start = time.perf_counter()
        self.served.model.decode_paged(tokens, lengths, self.cache.step_view(tables, lengths))
        return time.perf_counter() - start

    def kv_bytes(self, lengths: list[int]) -> int:
        return sum(n + 1 for n in lengths) * self.config.kv_bytes_per_token


def measure(setup: Setup, repeats: int, bandwidth: float) -> dict:
    for lengths in MIXES.values():  # warm-up, and the scratch buffers grow to size
        setup.step_seconds(lengths)
    times: dict[str, list[float]] = {name: [] for name in MIXES}
    for _ in range(repeats):
        for name, lengths in MIXES.items():
            times[name].append(setup.step_seconds(lengths))
    rows = {}
    for name, lengths in MIXES.items():
        limit = (setup.weight_bytes + setup.kv_bytes(lengths)) / bandwidth
        median = statistics.median(times[name])
        rows[name] = {
            "step_ms": median * 1e3,
            "min_ms": min(times[name]) * 1e3,
            "max_ms": max(times[name]) * 1e3,
            "limit_ms": limit * 1e3,
            "ratio_to_limit": median / limit,
            "kv_bytes": setup.kv_bytes(lengths),
        }
    long_read = setup.kv_bytes([LONG]) / bandwidth  # a sequence of LONG cached tokens
    expected = rows[ITS_BASE]["step_ms"] / 1e3 + long_read
    return {
        "weight_bytes": setup.weight_bytes,
        "mixes": rows,
        "long_mix_vs_base_plus_its_kv": rows[LONG_MIX]["step_ms"] / 1e3 / expected,
        "prefill": prefill_rates(setup, repeats),
    }


def prefill_rates(setup: Setup, repeats: int) -> dict:
    """Tokens/s of one prompt per length, median of `repeats` interleaved runs."""
    gen = torch.Generator().manual_seed(0)
    prompts = {
        n: torch.randint(3, setup.config.vocab_size, (n,), generator=gen).tolist()
        for n in PREFILL_LENGTHS
    }
    rates: dict[int, list[float]] = {n: [] for n in PREFILL_LENGTHS}
    for round_ in range(repeats + 1):
        for n, prompt in prompts.items():
            start = time.perf_counter()
            setup.served.model.prefill_packed([prompt], lambda *kv: None)
            if round_:  # the first round warms up
                rates[n].append(n / (time.perf_counter() - start))
    rows = {
        str(n): {"tokens_per_s": statistics.median(r), "min": min(r), "max": max(r)}
        for n, r in rates.items()
    }
    rows["ratio_3000_to_256"] = rows["3000"]["tokens_per_s"] / rows["256"]["tokens_per_s"]
    return rows


def conditions(args) -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "block_size": BLOCK_SIZE,
        "load_average": os.getloadavg(),
        "workload": "one decode step over batches of the listed context lengths, token 5",
    }


def markdown(result: dict) -> str:
    c = result["conditions"]
    lines = [
        f"# Decode step against the memory-bound limit ({c['date']})",
        "",
        f"{c['cpu']}, {c['threads']} torch thread(s), torch {c['torch']}, block size "
        f"{c['block_size']}, median of {c['repeats']} interleaved runs (min-max). Copy "
        f"bandwidth measured in the run: {result['copy_gb_s']:.1f} GB/s.",
        "",
    ]
    for model, r in result["models"].items():
        lines += [
            f"## {model} ({r['dtype']}, weights {r['weight_bytes'] / 2**20:.0f} MiB)",
            "",
            "| batch | step ms | limit ms | step / limit |",
            "|---|---:|---:|---:|",
        ]
        for name, row in r["mixes"].items():
            lines.append(
                f"| {name} | {row['step_ms']:.1f} ({row['min_ms']:.1f}-"
                f"{row['max_ms']:.1f}) | {row['limit_ms']:.1f} | "
                f"{row['ratio_to_limit']:.2f} |"
            )
        lines += [
            "",
            f"31x200+1x3000 against 31x200 plus the long sequence's own KV read: "
            f"{r['long_mix_vs_base_plus_its_kv']:.2f}x (goal <= 1.3)",
            "",
            "| prefill, one prompt | tokens/s |",
            "|---|---:|",
        ]
        pre = r["prefill"]
        for n in PREFILL_LENGTHS:
            row = pre[str(n)]
            lines.append(
                f"| {n} tokens | {row['tokens_per_s']:.0f} ({row['min']:.0f}-{row['max']:.0f}) |"
            )
        lines += ["", f"3,000 against 256 tokens: {pre['ratio_3000_to_256']:.2f} (goal >= 0.6)", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tinygpt,smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS / "engine"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {"conditions": conditions(args), "models": {}}
    result["copy_gb_s"] = copy_bandwidth() / 1e9
    for name in args.models.split(","):
        setup = Setup(name)
        result["models"][name] = {
            "dtype": setup.config.dtype,
            **measure(setup, args.repeats, result["copy_gb_s"] * 1e9),
        }
        del setup
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    Path(args.out + ".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
