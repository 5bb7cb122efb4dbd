"""Prefill against plain GEMMs: a 1,500-token prompt's tokens/s beside the rate of the same
linear layers as plain matrix products on the same cores.

For --tokens prompt tokens, SmolLM2's prefill (`prefill_packed`, the format served) is timed,
and so are its 30 layers' matrices (fused q/k/v, o, fused gate/up, down) as plain GEMMs of
--tokens rows: one layer's four products timed, times the layer count (every layer has the same
shapes), in bfloat16 and in float32. The engine issue's goal is prefill >= 0.6 x the bf16 GEMM's
tokens/s. Configurations (threads x what is timed) are interleaved repeat by repeat; median and
min-max over --repeats.

  .venv/bin/python bench/prefill_rate.py                   # ~3 minutes on 2 vCPUs
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from common import spread, write_results
from pdserve.models.loading import load_served_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"


def layer_shapes(config) -> list[tuple[int, int]]:
    """(output rows, input columns) of one layer's fused products."""
    d, ff = config.d_model, config.d_ff
    kv = config.kv_heads * config.head_dim
    return [(d + 2 * kv, d), (d, d), (2 * ff, d), (d, ff)]


def gemm_seconds(shapes, tokens: int, dtype: torch.dtype, layers: int) -> float:
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes]
    inputs = [torch.randn(tokens, k, dtype=dtype) for _, k in shapes]
    start = time.perf_counter()
    for x, w in zip(inputs, weights):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) * layers


def prefill_seconds(model, prompt: list[int]) -> float:
    start = time.perf_counter()
    model.prefill_packed([prompt], lambda *kv: None)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--weights", default="q4")
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "prefill_rate.json"))
    args = p.parse_args()
    served = load_served_model(MODEL, weight_format=args.weights)
    config, model = served.config, served.built
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.tokens)]
    shapes = layer_shapes(config)
    timed = {
        "prefill": lambda: prefill_seconds(model, prompt),
        "gemm_bf16": lambda: gemm_seconds(shapes, args.tokens, torch.bfloat16, config.n_layers),
        "gemm_fp32": lambda: gemm_seconds(shapes, args.tokens, torch.float32, config.n_layers),
    }
    seconds: dict[tuple[int, str], list[float]] = {(t, k): [] for t in args.threads for k in timed}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for threads in args.threads:
                torch.set_num_threads(threads)
                for name, run in timed.items():
                    took = run()
                    if repeat:
                        seconds[(threads, name)].append(took)
    rows = []
    for threads in args.threads:
        rate = {k: [args.tokens / s for s in seconds[(threads, k)]] for k in timed}
        row = {
            "threads": threads,
            **{f"{k}_tokens_per_s": spread(v) for k, v in rate.items()},
            "prefill_over_gemm_bf16": spread(
                a / b for a, b in zip(rate["prefill"], rate["gemm_bf16"])
            ),
            "prefill_over_gemm_fp32": spread(
                a / b for a, b in zip(rate["prefill"], rate["gemm_fp32"])
            ),
        }
        rows.append(row)
        print(
            f"threads {threads}: prefill {statistics.median(rate['prefill']):.0f} tok/s, "
            f"bf16 GEMM {statistics.median(rate['gemm_bf16']):.0f}, fp32 GEMM "
            f"{statistics.median(rate['gemm_fp32']):.0f}; prefill / bf16 GEMM "
            f"{row['prefill_over_gemm_bf16']['median']:.2f} (goal >= 0.6), / fp32 GEMM "
            f"{row['prefill_over_gemm_fp32']['median']:.2f}"
        )
    conditions = {
        "model": MODEL,
        "weights": args.weights,
        "prompt_tokens": args.tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "workload": "one prefill_packed of a random-token prompt; GEMM = one layer's four "
        "fused products of prompt-token rows, times the layer count",
    }
    write_results(args.out, conditions, rows=rows)


if __name__ == "__main__":
    main()
