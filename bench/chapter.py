"""The chapter comparison, repeated: disaggregated against colocated, interleaved, with the spread.

Each round starts a fresh disaggregated stack (`pdserve up`: router, prefill and decode, one torch
thread each for prefill and decode) and a fresh colocated engine (`pdserve serve colocated`,
torch's default threads), one after the other, and drives each with `pdserve bench --preset
chapter` (Poisson arrivals at 16 req/s, prompts 64-256, outputs 16-48, seed 7, 100 requests,
greedy). Configurations alternate round by round, so a change in machine load hits both. The
result gives, per metric, the median over the rounds and the min-max spread, and says a
difference only where the two spreads do not overlap.

  .venv/bin/python bench/chapter.py --rounds 5 --json bench/results/chapter_repeated.json
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import pdserve_bench  # bench/ is the script's directory
from pdserve.loadtest.report import cpu_conditions
from pdserve.localstack import free_port, start_service, wait_until

MODEL = "tinygpt"
# (label, what to read from a run's summary, scale, unit)
METRICS = [
    ("completed req/s", ("request_throughput",), 1, ""),
    ("output tokens/s", ("output_tokens_per_second",), 1, ""),
    ("TTFT p50", ("ttft_seconds", "p50"), 1e3, "ms"),
    ("TTFT p99", ("ttft_seconds", "p99"), 1e3, "ms"),
    ("TPOT p50", ("tpot_seconds", "p50"), 1e3, "ms"),
    ("ITL p50", ("itl_seconds", "p50"), 1e3, "ms"),
    ("ITL p99", ("itl_seconds", "p99"), 1e3, "ms"),
    ("E2E p50", ("e2e_seconds", "p50"), 1e3, "ms"),
    ("goodput req/s", ("goodput",), 1, ""),
]


def start(config: str, tmp: str):
    """The configuration's services, the address to drive, and how to stop them."""
    if config == "colocated":
        engine = start_service("colocated", "--model", MODEL, tmp_dir=tmp)
        return engine.address, [engine]
    port = free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--http-port",
            "0",
        ],
        stdout=open(os.path.join(tmp, "up.log"), "w"),
        stderr=subprocess.STDOUT,
    )
    wait_until(lambda: _serving(f"127.0.0.1:{port}"), 120, "pdserve up to serve")
    return f"127.0.0.1:{port}", [up]


def _serving(address: str) -> bool:
    health = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "health", address], capture_output=True
    )
    return health.returncode == 0


def stop(procs) -> None:
    for proc in procs:
        (proc.stop() if hasattr(proc, "stop") else _terminate(proc))


def _terminate(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_run(config: str, label: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        address, procs = start(config, tmp)
        try:
            summary = chapter_summary(address, tmp, label)
        finally:
            stop(procs)
    return {"summary": summary[0], "load_average_1m": summary[1]}


def chapter_summary(address: str, tmp: str, label: str = "", env=None) -> tuple[dict, object]:
    """`pdserve bench --preset chapter` against `address`: (its summary, its load averages)."""
    flags = ["--preset", "chapter", "--warmup", "2", "--address", address]
    run = pdserve_bench(flags + (["--label", label] if label else []), tmp, env=env)
    return run["summary"], run.get("load_average_1m")


def value(summary: dict, path: tuple) -> float:
    for key in path:
        summary = summary[key]
    return float(summary)


def compare(runs: dict) -> list[dict]:
    rows = []
    for label, path, scale, unit in METRICS:
        stats = {}
        for config, config_runs in runs.items():
            xs = [value(r["summary"], path) * scale for r in config_runs]
            stats[config] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        d, c = stats["disaggregated"], stats["colocated"]
        overlap = d["min"] <= c["max"] and c["min"] <= d["max"]
        rows.append(
            {
                "metric": label,
                "unit": unit,
                **stats,
                "verdict": "within spread"
                if overlap
                else ("disaggregated higher" if d["median"] > c["median"] else "colocated higher"),
            }
        )
    return rows


def table(rows: list[dict], rounds: int) -> str:
    lines = [
        f"| metric | disaggregated, median (min-max) | colocated, median (min-max) | "
        f"verdict ({rounds} rounds) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        cell = {
            k: f"{r[k]['median']:.1f} ({r[k]['min']:.1f}-{r[k]['max']:.1f}) {r['unit']}".strip()
            for k in ("disaggregated", "colocated")
        }
        lines.append(
            f"| {r['metric']} | {cell['disaggregated']} | {cell['colocated']} | {r['verdict']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list] = {"disaggregated": [], "colocated": []}
    for i in range(args.rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))  # alternate who goes first
        for config in order:
            runs[config].append(one_run(config, config))
            print(f"round {i + 1} {config}: load {runs[config][-1]['load_average_1m']}", flush=True)
    rows = compare(runs)
    print(table(rows, args.rounds))
    if args.json:
        doc = {
            "conditions": {
                "started": started,
                "model": "TinyGPT (random weights)",
                "workload": "--preset chapter: Poisson 16 req/s, prompts 64-256, outputs 16-48, "
                "seed 7, 100 requests, greedy, 2 warm-up",
                "disaggregated": "pdserve up (1 torch thread for prefill and for decode)",
                "colocated": "pdserve serve colocated (torch's default threads)",
                "rounds": args.rounds,
                "cpu": cpu_conditions(),
            },
            "rows": rows,
            "runs": runs,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
