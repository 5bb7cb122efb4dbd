"""What invariant numerics cost: a decode step and a long prompt's prefill, fast against invariant.

`--numerics invariant` keeps every q4 pass on the int4 kernel (no float32 pass from 128 rows) and
orders attention's sums by key position (pdserve/models/invariant_attention.py). This measures
both numerics on the same model in one process, configurations interleaved repeat by repeat:
- one decode_paged step at batch 1, 16 and 64, each sequence with --context tokens cached;
- one prefill_packed pass of a --prompt-tokens prompt.
The goal (the determinism issue): at most 10% slower, or invariant stays a setting.

  .venv/bin/python bench/invariance_cost.py              # ~5 minutes on 2 vCPUs
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from common import spread, write_results
from pdserve.core.block_pool import BlockPool
from pdserve.engine.paged_cache import PagedCache
from pdserve.models.loading import load_served_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
NUMERICS = ("fast", "invariant")


class Setup:
    def __init__(self, numerics: str, weights: str, batches: list[int], context: int) -> None:
        served = load_served_model(MODEL, weight_format=weights, numerics=numerics)
        self.model, self.config = served.built, served.config
        blocks = sum(batches) * -(-(context + 1) // BLOCK_SIZE)
        self.cache = PagedCache(served.config, blocks, BLOCK_SIZE)
        self.cache.kv.normal_()  # touched, as a serving pool's memory is
        pool = BlockPool(blocks, BLOCK_SIZE)
        self.tables = {b: [pool.reserve(context + 1) for _ in range(b)] for b in batches}
        for tables in self.tables.values():
            for table in tables:
                table.ensure(context + 1)
        self.context = context

    def step(self, batch: int) -> None:
        lengths = [self.context] * batch
        self.model.decode_paged(
            [5] * batch, lengths, self.cache.step_view(self.tables[batch], lengths)
        )

    def prefill(self, prompt: list[int]) -> None:
        self.model.prefill_packed([prompt], lambda layer, k, v: None)


def timed(fn, *args, inner: int = 1) -> float:
    times = []
    for _ in range(inner):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--weights", default="q4", help="the served format (q4 is the default's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (pdserve up: 1 each)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "invariance_cost.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    setups = {n: Setup(n, args.weights, args.batches, args.context) for n in NUMERICS}
    vocab = setups["fast"].config.vocab_size
    prompt = [random.Random(args.seed).randrange(1, vocab) for _ in range(args.prompt_tokens)]
    cases = [f"decode batch {b}" for b in args.batches] + [f"prefill {args.prompt_tokens} tokens"]
    ms: dict[tuple[str, str], list[float]] = {(c, n): [] for c in cases for n in NUMERICS}
    for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
        order = NUMERICS if repeat % 2 else NUMERICS[::-1]
        for numerics in order:
            s = setups[numerics]
            figures = [timed(s.step, b, inner=5) for b in args.batches] + [timed(s.prefill, prompt)]
            if repeat:
                for case, figure in zip(cases, figures):
                    ms[(case, numerics)].append(figure)
    rows = []
    for case in cases:
        fast, inv = ms[(case, "fast")], ms[(case, "invariant")]
        row = {
            "case": case,
            "fast_ms": spread(fast),
            "invariant_ms": spread(inv),
            "invariant_over_fast": spread(i / f for i, f in zip(inv, fast)),
        }
        rows.append(row)
        r = row["invariant_over_fast"]
        print(
            f"{case:>22}: fast {row['fast_ms']['median']:8.1f} ms, invariant "
            f"{row['invariant_ms']['median']:8.1f} ms, ratio {r['median']:.2f} "
            f"({r['min']:.2f}-{r['max']:.2f})"
        )
    conditions = {
        "model": MODEL,
        "weights": args.weights,
        "dtype": setups["fast"].config.dtype,
        "threads": args.threads,
        "context_tokens": args.context,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "torch": torch.__version__,
        "workload": "decode: median of 5 decode_paged steps per repeat; prefill: one "
        "prefill_packed pass per repeat; fast and invariant alternate first",
    }
    write_results(args.out, conditions, rows=rows)


if __name__ == "__main__":
    main()
