"""The chapter's interference result: long prompts arriving while other requests stream.

Streams with long outputs from short prompts run; in the "loaded" phase, long prompts arrive while
they stream. Three configurations on the same two CPUs, all up at once and measured in turn,
repeat by repeat (so machine load hits each alike):

  disaggregated      prefill pinned to CPU 0, decode and router to CPU 1
  colocated-chunked  one engine on CPUs 0-1, chunked prefill (--prefill-chunk-tokens 256)
  colocated-plain    one engine on CPUs 0-1, a whole prefill batch then a decode step

Reported per configuration (median over repeats, with the min-max spread): the streams'
inter-token latency p50 / p99 / max with and without the long prompts, the long prompts' TTFT,
and the loaded phase's output tokens/s; plus a chart of inter-token latency over time.

  .venv/bin/python bench/interference.py                 # TinyGPT, 5 repeats, ~5 minutes
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.loadtest.stats import percentile
from pdserve.localstack import Service, start_pinned_disaggregated, start_service
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("disaggregated", "colocated-chunked", "colocated-plain")


@dataclass
class Workload:
    streams: int = 8
    stream_prompt: int = 16
    stream_tokens: int = 256
    long_prompts: int = 4
    long_prompt: int = 2000
    long_tokens: int = 8
    first_long_after: float = 0.5  # seconds after the streams start
    long_gap: float = 0.4
    seed: int = 7


@dataclass
class Run:
    itl: list[tuple[float, float]] = field(default_factory=list)  # (time since start, gap s)
    long_ttft: list[float] = field(default_factory=list)
    long_arrivals: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0


def start_config(name: str, model: str, tmp: str) -> tuple[str, list[Service]]:
    if name == "disaggregated":
        router, services = start_pinned_disaggregated(model, tmp)
        return router.address, services
    chunk = "256" if name == "colocated-chunked" else "0"
    engine = start_service(
        "colocated", "--model", model, "--cpus", "0-1", "--prefill-chunk-tokens", chunk, tmp_dir=tmp
    )
    return engine.address, [engine]


def one_run(address: str, w: Workload, loaded: bool, rng: random.Random) -> Run:
    run, lock = Run(), threading.Lock()
    start = time.perf_counter()

    def stream(prompt: list[int]) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=w.stream_tokens, ignore_eos=True),
        )
        last = None
        for response in stub.Generate(request, timeout=300):
            now = time.perf_counter()
            with lock:
                run.output_tokens += len(response.token_ids)
                if last is not None:
                    run.itl.append((now - start, now - last))
            last = now

    def long_request(prompt: list[int], delay: float) -> None:
        time.sleep(delay)  # the arrival schedule, not a wait for a condition
        sent = time.perf_counter()
        request = pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=w.long_tokens, ignore_eos=True),
        )
        first = None
        for response in stub.Generate(request, timeout=300):
            first = first or time.perf_counter()
            with lock:
                run.output_tokens += len(response.token_ids)
        with lock:
            run.long_arrivals.append(sent - start)
            run.long_ttft.append(first - sent)

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        threads = [
            threading.Thread(target=stream, args=(_prompt(rng, w.stream_prompt),))
            for _ in range(w.streams)
        ]
        if loaded:
            threads += [
                threading.Thread(
                    target=long_request,
                    args=(_prompt(rng, w.long_prompt), w.first_long_after + i * w.long_gap),
                )
                for i in range(w.long_prompts)
            ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    run.seconds = time.perf_counter() - start
    return run


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def summarize(run: Run) -> dict:
    gaps = [g * 1e3 for _, g in run.itl]
    out = {
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "itl_max_ms": max(gaps),
        "output_tokens_per_s": run.output_tokens / run.seconds,
    }
    if run.long_ttft:
        out["long_ttft_median_ms"] = statistics.median(run.long_ttft) * 1e3
        out["long_ttft_max_ms"] = max(run.long_ttft) * 1e3
    return out


def aggregate(rows: list[dict]) -> dict:
    return {
        k: {
            "median": statistics.median(r[k] for r in rows),
            "min": min(r[k] for r in rows),
            "max": max(r[k] for r in rows),
        }
        for k in rows[0]
    }


def chart(samples: dict[str, Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(samples), 1, figsize=(9, 2.4 * len(samples)), sharex=True)
    for ax, (name, run) in zip(axes, samples.items()):
        ax.scatter([t for t, _ in run.itl], [g * 1e3 for _, g in run.itl], s=2)
        for arrival in run.long_arrivals:
            ax.axvline(arrival, color="red", lw=0.6)
        ax.set_yscale("log")
        ax.set_ylabel("ITL ms")
        ax.set_title(
            f"{name}: streams' inter-token latency (red: a long prompt arrives)", fontsize=9
        )
    axes[-1].set_xlabel("seconds since the streams started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tinygpt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "interference"))
    args = p.parse_args()
    w = Workload()
    rng = random.Random(w.seed)
    tmp = tempfile.mkdtemp(prefix="pdserve-interference-")
    started = {name: start_config(name, args.model, tmp) for name in CONFIGS}
    results: dict[str, dict[str, list[dict]]] = {n: {"quiet": [], "loaded": []} for n in CONFIGS}
    samples: dict[str, Run] = {}
    try:
        for name, (address, _) in started.items():  # warm-up
            one_run(address, w, True, rng)
        for _ in range(args.repeats):
            for name, (address, _) in started.items():
                for phase in ("quiet", "loaded"):
                    run = one_run(address, w, phase == "loaded", rng)
                    results[name][phase].append(summarize(run))
                    if phase == "loaded":
                        samples[name] = run
                    print(
                        name, phase, {k: round(v, 1) for k, v in summarize(run).items()}, flush=True
                    )
    finally:
        for _, services in started.values():
            for service in services:
                service.stop()
    report = {
        "conditions": conditions(args, w),
        "configs": {n: {ph: aggregate(rows) for ph, rows in r.items()} for n, r in results.items()},
        "runs": results,
    }
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    Path(args.out + ".md").write_text(markdown(report))
    chart(samples, Path(args.out + ".png"))
    print(markdown(report))
    return 0


def conditions(args, w: Workload) -> dict:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        "?",
    )
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "cpu": cpu,
        "cpus_used": "0-1",
        "torch": torch.__version__,
        "repeats": args.repeats,
        "workload": w.__dict__,
        "load_average": os.getloadavg(),
    }


def markdown(report: dict) -> str:
    c, w = report["conditions"], report["conditions"]["workload"]
    lines = [
        f"# Interference: long prompts arriving while streams decode ({c['date']})",
        "",
        f"{c['model']}, {c['cpu']}, CPUs {c['cpus_used']}, torch {c['torch']}; "
        f"{w['streams']} streams of {w['stream_tokens']} tokens from {w['stream_prompt']}-token "
        f"prompts; loaded: {w['long_prompts']} prompts of {w['long_prompt']} tokens "
        f"({w['long_tokens']} output tokens) arriving every {w['long_gap']} s from "
        f"{w['first_long_after']} s; seed {w['seed']}; median (min-max) of {c['repeats']} "
        f"interleaved repeats.",
        "",
        "| configuration | phase | ITL p50 ms | ITL p99 ms | ITL max ms | long TTFT ms "
        "(median) | output tok/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, phases in report["configs"].items():
        for phase, a in phases.items():
            ttft = _cell(a["long_ttft_median_ms"]) if "long_ttft_median_ms" in a else "-"
            lines.append(
                f"| {name} | {phase} | {_cell(a['itl_p50_ms'])} | "
                f"{_cell(a['itl_p99_ms'])} | {_cell(a['itl_max_ms'])} | {ttft} | "
                f"{_cell(a['output_tokens_per_s'])} |"
            )
    return "\n".join(lines) + "\n"


def _cell(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


if __name__ == "__main__":
    raise SystemExit(main())
