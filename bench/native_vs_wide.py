"""The native q4 kernel against the float32 wide pass, per SmolLM2 layer, at many rows.

A q4 layer on torch's kernel multiplies a pass of WIDE_ROWS rows or more by a float32 copy of its
weights (pdserve/models/quantized.py), because that kernel costs about a row's time per row. This
measures whether the native kernel (Q4_1 interleaved by 8 rows, pdserve/kernels/blocks_avx2.h)
still loses to that float32 pass: one SmolLM2-135M layer's four matrices (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; random weights), each pass timed on the kernel (`widens`
False) and in float32 (`widens` True, with WIDE_ROWS forced to 1 so every row count goes wide),
interleaved repeat by repeat. Reported per row count: each one's median (min-max) and the
per-repeat ratio float32 / kernel.

  .venv/bin/python bench/native_vs_wide.py --threads 2 --rows 16 64 128 256 512 1024 --repeats 5
"""

import argparse
import json
import platform
import statistics
import time

import torch

from pdserve.models import quantized
from pdserve.models.quantized import Q4Linear, make_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's fused matrices


def layer_ms(layers: list[Q4Linear], xs: list[torch.Tensor], float32: bool, calls: int) -> float:
    for layer in layers:
        layer.widens, layer.float32_wide, layer.bf16_gemm = float32, float32, False
    for layer, x in zip(layers, xs):  # warm: the float32 copy is made on first use
        layer(x)
    started = time.perf_counter()
    for _ in range(calls):
        for layer, x in zip(layers, xs):
            layer(x)
    return (time.perf_counter() - started) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantized.WIDE_ROWS = 1  # every pass of the float32 configuration goes wide
    gen = torch.Generator().manual_seed(args.seed)
    layers = [
        make_linear("q4", torch.randn(n, k, generator=gen) * 0.05, None, q4_kernel="native")
        for n, k in SHAPES
    ]
    results = []
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=gen) for _, k in SHAPES]
        kernel, wide = [], []
        for _ in range(args.repeats):
            kernel.append(layer_ms(layers, xs, False, 3))  # type: ignore[arg-type]
            wide.append(layer_ms(layers, xs, True, 3))  # type: ignore[arg-type]
        ratios = [w / k for k, w in zip(kernel, wide)]
        row = {
            "rows": rows,
            "kernel_ms": spread(kernel),
            "float32_ms": spread(wide),
            "float32_over_kernel": spread(ratios),
        }
        results.append(row)
        print(
            f"rows {rows:5d}: kernel {row['kernel_ms']['median']:.2f} ms, float32 "
            f"{row['float32_ms']['median']:.2f} ms, float32/kernel "
            f"{row['float32_over_kernel']['median']:.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            flush=True,
        )
    conditions = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"conditions": conditions, "rows": results}, f, indent=1)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    main()
