"""Decode attention in AVX-512 registers against the AVX2 kernel, on a CPU that has both.

pdserve/kernels/attend_avx512.h computes the same bits as the AVX2 kernel in fewer instructions;
torch.ops.pdserve.set_wide_attention picks between them in one process, so the two run
interleaved, repeat by repeat, on the same data:
  - the attention op alone (torch.ops.pdserve.paged_decode: one SmolLM2 layer's attention, bf16
    KV, each sequence with --context tokens cached);
  - a whole served decode step (q4 weights on the native kernel, bench/decode_step.py's Setup).
Each figure is the median over --repeats with its min-max spread; `avx2/wide` is the ratio of
their times repeat by repeat. Before timing, the two kernels' outputs are compared bit for bit.

  .venv/bin/python bench/attention_isa.py           # ~1 minute on 2 vCPUs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import spread, write_results
from decode_step import BLOCK_SIZE, MODEL, Setup
from pdserve.kernels import native

RESULTS = Path(__file__).resolve().parent / "results"
INNER = 10  # calls per timing
HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention


class AttentionOp:
    """One layer's paged_decode over `batch` sequences of `context` cached tokens, blocks shuffled
    through the pool as a serving pool's are."""

    def __init__(self, batch: int, context: int) -> None:
        per_sequence = -(-(context + 1) // BLOCK_SIZE)
        blocks = batch * per_sequence
        bf16 = torch.bfloat16
        self.keys = torch.randn(KV_HEADS, blocks * BLOCK_SIZE, DIM).to(bf16)
        self.values = torch.randn(KV_HEADS, blocks * BLOCK_SIZE, DIM).to(bf16)
        self.table = torch.randperm(blocks).view(batch, per_sequence)
        self.lengths = torch.full((batch,), context + 1)
        last = self.table[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
        self.slots = last.contiguous()
        self.q = torch.randn(batch, HEADS, DIM).to(bf16)
        self.k = torch.randn(batch, KV_HEADS, DIM).to(bf16)
        self.v = torch.randn(batch, KV_HEADS, DIM).to(bf16)

    def __call__(self) -> torch.Tensor:
        return torch.ops.pdserve.paged_decode(
            self.q,
            self.k,
            self.v,
            self.keys,
            self.values,
            self.slots,
            self.table,
            self.lengths,
            BLOCK_SIZE,
        )


def timed(fn) -> float:
    start = time.perf_counter()
    for _ in range(INNER):
        fn()
    return (time.perf_counter() - start) / INNER * 1e3


def with_kernel(wide: bool, fn):
    torch.ops.pdserve.set_wide_attention(wide)
    try:
        return fn()
    finally:
        torch.ops.pdserve.set_wide_attention(True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    p.add_argument("--context", type=int, default=150, help="tokens cached per sequence")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "attention_isa.json"))
    args = p.parse_args()
    native.load()
    torch.set_num_threads(args.threads)
    setup = Setup("q4:native", args.batches, args.context, "auto")
    subjects = {}
    for batch in args.batches:
        op = AttentionOp(batch, args.context)
        same = torch.equal(with_kernel(True, op), with_kernel(False, op))
        subjects[("attention op", batch)] = (op, same)
        subjects[("decode step", batch)] = (lambda b=batch: setup.step(b), None)
    times = {(s, wide): [] for s in subjects for wide in (True, False)}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for subject, (fn, _) in subjects.items():
                for wide in (repeat % 2 == 0, repeat % 2 == 1):  # alternate which goes first
                    ms = with_kernel(wide, lambda: timed(fn))
                    if repeat:
                        times[(subject, wide)].append(ms)
    rows = []
    for (what, batch), (_, same) in subjects.items():
        wide, avx2 = times[((what, batch), True)], times[((what, batch), False)]
        r = {
            "what": what,
            "batch": batch,
            "wide_ms": spread(wide),
            "avx2_ms": spread(avx2),
            "avx2_over_wide": spread(a / w for a, w in zip(avx2, wide)),
        }
        if same is not None:
            r["bits_identical"] = same
        rows.append(r)
        print(
            f"{what:>12} batch {batch:>2}: AVX-512 {r['wide_ms']['median']:6.2f} ms, "
            f"AVX2 {r['avx2_ms']['median']:6.2f} ms, avx2/wide {r['avx2_over_wide']['median']:.2f} "
            f"({r['avx2_over_wide']['min']:.2f}-{r['avx2_over_wide']['max']:.2f})"
            + (f", bits identical: {same}" if same is not None else "")
        )
    conditions = {
        "model": MODEL,
        "kv_dtype": "bfloat16",
        "weights": "q4 (native kernel)",
        "context_tokens": args.context,
        "threads": args.threads,
        "repeats": args.repeats,
        "inner_calls": INNER,
        "torch": torch.__version__,
        "workload": "attention op: one layer's paged_decode; decode step: a whole served step",
    }
    write_results(args.out, conditions, rows=rows)


if __name__ == "__main__":
    main()
