"""The two q4 kernels (--q4-kernel torch | native) on one decode step's linear layers.

Each kernel multiplies SmolLM2-135M's four fused matrices of a layer (q/k/v, o, gate/up, down)
for each of its 30 layers, as one decode step does (without the head, int8 in both), at each
batch size and thread count. Every layer has weights of its own (53 MB in all, more than the
32 MB L3 of the EPYCs measured), so they are read from memory as a step reads
them, not 30 times from one layer's 1.8 MB in the cache. The layers are Q4Linear modules built
from the same random weights, so both read the same Q4_1 blocks: torch's through
torch._weight_int4pack_mm_for_cpu, pdserve's own through pdserve/kernels/blocks_avx2.cpp. Each
repeat times one kernel and then the other (interleaved); reported are each kernel's median
time and the per-repeat ratio torch / native, median (min-max).

  .venv/bin/python bench/q4_kernels.py --threads 1 2 --batches 1 16 64 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import spread, write_results
from pdserve.kernels import native
from pdserve.models.quantized import make_linear

RESULTS = Path(__file__).resolve().parent / "results"
# SmolLM2-135M: d_model 576, d_ff 1536, 9 heads and 3 KV heads of 64; fused as pdserve fuses them.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
KERNELS = ("torch", "native")


def step_time(layers: list, inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for layer in layers:
            layer(inputs[layer.in_features])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "q4_kernels.json"))
    args = p.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    shapes = list(SHAPES.values()) * LAYERS
    weights = [torch.randn(*shape, generator=gen).bfloat16() for shape in shapes]
    layers = {k: [make_linear("q4", w, None, q4_kernel=k) for w in weights] for k in KERNELS}
    widths = {columns for _, columns in shapes}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batches:
            inputs = {w: torch.randn(batch, w, generator=gen).bfloat16() for w in widths}
            for k in KERNELS:
                step_time(layers[k], inputs)  # warm-up
            times: dict[str, list[float]] = {k: [] for k in KERNELS}
            for _ in range(args.repeats):
                for k in KERNELS:
                    times[k].append(step_time(layers[k], inputs))
            ratio = spread(t / n for t, n in zip(times["torch"], times["native"]))
            rows.append(
                {
                    "threads": threads,
                    "batch": batch,
                    **{f"{k}_ms": spread(times[k]) for k in KERNELS},
                    "torch_over_native": ratio,
                }
            )
            print(
                f"threads {threads} batch {batch:>2}: torch {statistics.median(times['torch']):6.1f}"
                f" ms, native {statistics.median(times['native']):6.1f} ms, torch/native "
                f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})",
                flush=True,
            )
    conditions = {
        "what": "SmolLM2-135M's four fused q4 matrices in each of 30 layers, each layer its own "
        "random weights (one decode step's linears, no head, read from memory), bfloat16 "
        "activations; one timing per kernel per repeat, interleaved",
        "shapes": SHAPES,
        "repeats": args.repeats,
        "seed": args.seed,
        "torch": torch.__version__,
        "native_library": native.library_path().name,
    }
    write_results(args.out, conditions, rows=rows)


if __name__ == "__main__":
    main()
