"""What the HTTP front adds over gRPC: the same stack, the same load, interleaved.

Starts `pdserve up` (TinyGPT) once, then alternates `pdserve bench` runs against the gRPC
RouterService and against the OpenAI-compatible HTTP API (/v1/completions, SSE) of the same router:
--rounds of each, at --concurrency requests in flight (closed loop), 64-token prompts, 64 output
tokens, greedy. Reports ITL and TTFT (p50, p99) per front, median and min-max over the rounds,
and the HTTP/gRPC ratio of the medians.

  .venv/bin/python bench/http_overhead.py --json bench/results/http_overhead.json
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile

from common import pdserve_bench, spread, write_results  # bench/ is the script's directory
from pdserve.client import check_health
from pdserve.localstack import free_port, wait_until

FRONTS = {"grpc": [], "http": ["--endpoint", "openai-completions"]}
METRICS = [
    ("ITL p50", "itl_seconds", "p50"),
    ("ITL p99", "itl_seconds", "p99"),
    ("TTFT p50", "ttft_seconds", "p50"),
    ("TTFT p99", "ttft_seconds", "p99"),
]


def run(front: str, grpc_port: int, http_port: int, args, tmp: str) -> dict:
    flags = [
        "--address",
        f"127.0.0.1:{grpc_port}",
        "--http-url",
        f"http://127.0.0.1:{http_port}/v1",
    ]
    flags += [*FRONTS[front], "--num-requests", str(args.requests), "--rate", "inf"]
    flags += ["--concurrency", str(args.concurrency), "--prompt-len", "64", "--output-len", "64"]
    return pdserve_bench(flags + ["--seed", "7", "--warmup", "2"], tmp, front)["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    grpc_port, http_port = free_port(), free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            "tinygpt",
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    summaries: dict[str, list] = {front: [] for front in FRONTS}
    try:
        wait_until(lambda: check_health(f"127.0.0.1:{grpc_port}", 1.0), 120, "pdserve up")
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                order = list(FRONTS) if i % 2 == 0 else list(reversed(FRONTS))
                for front in order:
                    summaries[front].append(run(front, grpc_port, http_port, args, tmp))
                    print(f"round {i + 1} {front} done", flush=True)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(30)
    rows = []
    for label, key, q in METRICS:
        stats = {}
        for front, runs in summaries.items():
            xs = [r[key][q] * 1e3 for r in runs]
            stats[front] = spread(xs)
        rows.append(
            {
                "metric": label,
                **stats,
                "http_over_grpc": stats["http"]["median"] / stats["grpc"]["median"],
            }
        )
        g, h = stats["grpc"], stats["http"]
        print(
            f"{label}: gRPC {g['median']:.2f} ({g['min']:.2f}-{g['max']:.2f}) ms, HTTP "
            f"{h['median']:.2f} ({h['min']:.2f}-{h['max']:.2f}) ms, ratio "
            f"{rows[-1]['http_over_grpc']:.3f}"
        )
    if args.json:
        conditions = {
            "model": "TinyGPT (random weights), pdserve up, one torch thread each",
            "workload": f"closed loop, {args.concurrency} in flight, {args.requests} requests, "
            "64-token prompts, 64 output tokens, greedy, ignore_eos, 2 warm-up",
            "rounds": args.rounds,
        }
        write_results(args.json, conditions, rows=rows, runs=summaries)


if __name__ == "__main__":
    main()
