"""Served throughput against the engine's own ceiling.

The disaggregated stack (prefill on CPU 0, decode and router on CPU 1) is driven at saturation:
--batch concurrent streams of --tokens output tokens from short prompts, so decode holds a full
batch. Its output tokens/s (all streams' tokens after their first, over the time from the last
first token to the last token, when every stream is decoding) is compared with a plain loop that
calls the model's batched decode step at the same batch size and mid-run context length, on the
same CPU (1) with the same single thread: the most that decode could serve. Goal: >= 0.7.
Repeats are interleaved; median (min-max).

  .venv/bin/python bench/throughput.py            # TinyGPT, ~2 minutes
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch

from pdserve.localstack import start_pinned_disaggregated
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from engine import Setup  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = 16


def served(address: str, batch: int, tokens: int, rng: random.Random) -> float:
    firsts, lasts, counts, lock = [], [], [], threading.Lock()

    def stream() -> None:
        prompt = [rng.randrange(256) for _ in range(PROMPT)]
        request = pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        times = []
        with grpc.insecure_channel(address) as channel:
            for response in pb_grpc.RouterServiceStub(channel).Generate(request, timeout=600):
                times += [time.perf_counter()] * len(response.token_ids)
        with lock:
            firsts.append(times[0])
            lasts.append(times[-1])
            counts.append(sum(1 for t in times if t > max(firsts)))

    threads = [threading.Thread(target=stream) for _ in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window_start, window_end = max(firsts), max(lasts)
    # Tokens that arrived while every stream was decoding (after the last first token).
    return sum(counts) / (window_end - window_start)


def ceiling(setup: Setup, batch: int, tokens: int) -> float:
    lengths = [PROMPT + tokens // 2] * batch
    setup.step_seconds(lengths)
    return batch / statistics.median(setup.step_seconds(lengths) for _ in range(9))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tinygpt")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "throughput"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdserve-throughput-")
    router, stack = start_pinned_disaggregated(args.model, tmp)
    os.sched_setaffinity(0, {1})  # the ceiling runs where decode runs, with one thread
    torch.set_num_threads(1)
    setup = Setup(args.model)
    rng = random.Random(7)
    rows = {"served": [], "ceiling": []}
    try:
        served(router.address, args.batch, 32, rng)  # warm-up
        for _ in range(args.repeats):
            rows["served"].append(served(router.address, args.batch, args.tokens, rng))
            rows["ceiling"].append(ceiling(setup, args.batch, args.tokens))
            print({k: round(v[-1], 1) for k, v in rows.items()}, flush=True)
    finally:
        for service in stack:
            service.stop()
    ratios = [s / c for s, c in zip(rows["served"], rows["ceiling"])]
    report = {
        "conditions": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": args.model,
            "batch": args.batch,
            "output_tokens": args.tokens,
            "prompt_tokens": PROMPT,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "placement": "prefill CPU 0; decode, router and the ceiling loop CPU 1; 1 thread",
            "load_average": os.getloadavg(),
        },
        "served_tokens_per_s": rows["served"],
        "ceiling_tokens_per_s": rows["ceiling"],
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    r = report["ratio"]
    print(f"served / ceiling: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}); goal >= 0.7")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
