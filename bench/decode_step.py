"""A decode step against the floor of its own linear layers, in each weight format.

The step is one `decode_paged` over a PagedCache (SmolLM2, each sequence with --context tokens
cached), building the step's view included. Its floor is the same model's linear layers alone,
called with inputs of the batch's size: every layer's fused q/k/v, o, fused gate/up and down
projections, and the output head, in the format being served (so q4's floor is q4's kernel).
What the step spends beyond the floor is per-op overhead, RoPE, norms and attention.

q4 runs on either kernel (q4:torch, q4:native; pdserve/kernels/native.py); each is its own floor.
--step-ops torch native runs each format with torch's ops and with the fused native step ops
(pdserve/kernels/step_ops.py) for the rest of the step, interleaved, and gives their ratio.
--layers whole ops runs the step with all its layers in one native call (what serving runs:
pdserve/kernels/decode_layer.cpp on the q4 kernel below 8 rows, decode_wide.cpp on a bf16 wide
pass from there) and with its ops called one by one from Python, interleaved, and gives their
ratio.
--head served int8 runs each format with the output head it serves (Q8_0 on the native q4
kernel, quantized.output_head) and with the int8-per-row head (torch._weight_int8pack_mm) that
every quantized format served before, interleaved, and gives their ratio.

Goal (the engine issue): step <= 1.3 x floor at batch 1, 16 and 64. Configurations (format x
threads x batch) are interleaved repeat by repeat; each figure is the median over --repeats, with
the min-max spread. The dense bf16 step is the baseline the other formats are compared with.

  .venv/bin/python bench/decode_step.py                # ~4 minutes on 2 vCPUs
  .venv/bin/python bench/decode_step.py --formats q4 --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from common import spread, write_results
from pdserve.core.block_pool import BlockPool
from pdserve.engine.paged_cache import PagedCache
from pdserve.models.loading import load_served_model
from pdserve.models.quantized import Int8Linear, Q4Linear, Q8Linear

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
INNER = 5  # steps per timing; their median is one repeat's figure
# --weights, and for q4 the kernel (--q4-kernel) after a colon.
FORMATS = ["dense", "int8", "q4:torch", "q4:native"]


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """Every linear layer of the model with its input width."""
    found = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, Int8Linear, Q4Linear, Q8Linear)):
            found.append((module, module.in_features))
    return found


class Setup:
    """One served format: the model, a pool and each batch's block tables."""

    def __init__(
        self,
        fmt: str,
        batches: list[int],
        context: int,
        step_ops: str,
        layers: str = "whole",
        head: str = "served",
    ) -> None:
        weights, _, kernel = fmt.partition(":")  # q4:native, q4:torch
        self.served = load_served_model(
            MODEL, weight_format=weights, q4_kernel=kernel or "torch", step_ops=step_ops
        )
        self.model = self.served.built
        if layers == "ops":  # each layer's ops one by one from Python, as before one native call
            self.model._whole_layers = False  # type: ignore[attr-defined]
            self.model._wide_layers = False  # type: ignore[attr-defined]
        if head == "int8" and isinstance(self.model.lm_head, Q8Linear):
            # SmolLM2's head is tied: the embedding's weights, as the int8 head was made from.
            self.model.lm_head = Int8Linear(self.model.model.embed_tokens.weight, None)
        self.linears = linear_layers(self.model)
        tied = getattr(self.model, "lm_head", None) is None
        self.tied_head = self.model.model.embed_tokens.weight if tied else None
        blocks = sum(batches) * -(-(context + 1) // BLOCK_SIZE)
        self.cache = PagedCache(self.served.config, blocks, BLOCK_SIZE)
        self.cache.kv.normal_()  # touched, as a serving pool's memory is
        pool = BlockPool(blocks, BLOCK_SIZE)
        self.tables = {}
        for batch in batches:
            self.tables[batch] = [pool.reserve(context + 1) for _ in range(batch)]
            for table in self.tables[batch]:
                table.ensure(context + 1)
        self.context = context

    def step(self, batch: int) -> None:
        lengths = [self.context] * batch
        view = self.cache.step_view(self.tables[batch], lengths)
        self.model.decode_paged([5] * batch, lengths, view)

    def floor(self, batch: int) -> None:
        dtype = getattr(torch, self.served.config.dtype)
        with torch.inference_mode():
            inputs = {w: torch.randn(batch, w, dtype=dtype) for w in {w for _, w in self.linears}}
            for module, width in self.linears:
                module(inputs[width])
            if self.tied_head is not None:
                torch.nn.functional.linear(inputs[self.tied_head.shape[1]], self.tied_head)


def timed(fn, batch: int) -> float:
    times = []
    for _ in range(INNER):
        start = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=150, help="tokens cached per sequence")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-ops", nargs="+", default=["auto"], choices=["auto", "torch", "native"])
    p.add_argument(
        "--layers",
        nargs="+",
        default=["whole"],
        choices=["whole", "ops"],
        help="whole: a decode-only native q4 step runs its layers in one call; ops: op by op",
    )
    p.add_argument(
        "--head",
        nargs="+",
        default=["served"],
        choices=["served", "int8"],
        help="served: the format's own output head; int8: int8 per row, as before Q8_0",
    )
    p.add_argument("--out", default=str(RESULTS / "decode_step.json"))
    args = p.parse_args()
    setups = {
        (fmt, ops, layers, head): Setup(fmt, args.batches, args.context, ops, layers, head)
        for fmt in args.formats
        for ops in args.step_ops
        for layers in args.layers
        for head in args.head
    }
    configs = [
        (f, o, layers, head, t, b)
        for t in args.threads
        for b in args.batches
        for f in args.formats
        for o in args.step_ops
        for layers in args.layers
        for head in args.head
    ]
    step: dict[tuple, list[float]] = {c: [] for c in configs}
    floor: dict[tuple, list[float]] = {c: [] for c in configs}
    for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
        for config in configs:
            fmt, ops, layers, head, threads, batch = config
            torch.set_num_threads(threads)
            setup = setups[(fmt, ops, layers, head)]
            s, f = timed(setup.step, batch), timed(setup.floor, batch)
            if repeat:
                step[config].append(s)
                floor[config].append(f)
    rows = [row(c, step, floor) for c in configs]
    for r in rows:
        print(
            f"{r['format']:>9} {r['step_ops']:>6} ops, {r['layers']} layers, {r['head']} head, "
            f"threads "
            f"{r['threads']} batch {r['batch']:>2}: step "
            f"{r['step_ms']['median']:6.1f} ms, linear floor {r['floor_ms']['median']:6.1f} ms, "
            f"step/floor {r['step_over_floor']['median']:.2f} "
            f"({r['step_over_floor']['min']:.2f}-{r['step_over_floor']['max']:.2f})"
            + (
                f", dense/this {r['dense_over_this']['median']:.2f}"
                if "dense_over_this" in r
                else ""
            )
            + (
                f", torch ops/this {r['torch_ops_over_this']['median']:.2f} "
                f"({r['torch_ops_over_this']['min']:.2f}-{r['torch_ops_over_this']['max']:.2f})"
                if "torch_ops_over_this" in r
                else ""
            )
            + (
                f", q4:torch/this {r['q4_torch_over_this']['median']:.2f} "
                f"({r['q4_torch_over_this']['min']:.2f}-{r['q4_torch_over_this']['max']:.2f})"
                if "q4_torch_over_this" in r
                else ""
            )
            + (
                f", ops/whole {r['ops_over_whole']['median']:.2f} "
                f"({r['ops_over_whole']['min']:.2f}-{r['ops_over_whole']['max']:.2f})"
                if "ops_over_whole" in r
                else ""
            )
            + (
                f", int8 head/this {r['int8_head_over_this']['median']:.2f} "
                f"({r['int8_head_over_this']['min']:.2f}-{r['int8_head_over_this']['max']:.2f})"
                if "int8_head_over_this" in r
                else ""
            )
        )
    conditions = {
        "model": MODEL,
        "dtype": next(iter(setups.values())).served.config.dtype,
        "step_ops": {f"{f}/{o}": s.served.config.step_ops for (f, o, _, _), s in setups.items()},
        "layers": args.layers,
        "heads": args.head,
        "context_tokens": args.context,
        "repeats": args.repeats,
        "inner_steps": INNER,
        "torch": torch.__version__,
        "workload": "one decode_paged step per timing; floor = the model's linear layers alone",
    }
    write_results(args.out, conditions, rows=rows)


def row(config: tuple, step: dict, floor: dict) -> dict:
    fmt, ops, layers, head, threads, batch = config
    ratios = [s / f for s, f in zip(step[config], floor[config])]
    out = {
        "format": fmt,
        "step_ops": ops,
        "layers": layers,
        "head": head,
        "threads": threads,
        "batch": batch,
        "step_ms": spread(step[config]),
        "floor_ms": spread(floor[config]),
        "step_over_floor": spread(ratios),
    }
    for key, other, applies in (
        ("dense_over_this", ("dense", ops, layers, head, threads, batch), True),
        ("torch_ops_over_this", (fmt, "torch", layers, head, threads, batch), True),
        ("q4_torch_over_this", ("q4:torch", ops, layers, head, threads, batch), fmt == "q4:native"),
        ("ops_over_whole", (fmt, ops, "ops", head, threads, batch), True),
        ("int8_head_over_this", (fmt, ops, layers, "int8", threads, batch), True),
    ):
        if applies and other != config and other in step:
            out[key] = spread(o / s for o, s in zip(step[other], step[config]))
    return out


if __name__ == "__main__":
    main()
