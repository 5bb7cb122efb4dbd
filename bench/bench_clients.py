"""`vllm bench serve` and `pdserve bench` against the same `pdserve up`, side by side.

Both clients drive the stack's OpenAI API (/v1/completions, streaming) with one workload: random
prompts of --input-len tokens, --output-len output tokens, EOS ignored, --num-prompts requests
all sent at once with at most --concurrency in flight. vLLM's client turns random token ids into
text, pdserve's sends token ids: the same lengths, other tokens. The clients alternate, --rounds
times, on one stack started once (its pid recorded, stopped by it, its ports checked free
after); each figure is the median of the rounds with their min-max. A difference between the
clients is claimed only where their ranges do not overlap.

  .venv/bin/python bench/bench_clients.py --vllm-python /work/peers/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import pdserve_bench, spread, write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# The figures both clients write under the same vLLM key, in the same unit.
KEYS = (
    "completed",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)
PORTS = (50051, 8000)  # `pdserve up`'s router and HTTP API


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def start_stack(log: Path) -> subprocess.Popen:
    if not all(port_free(p) for p in PORTS):
        sys.exit(f"ports {PORTS} must be free before the stack starts")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up"],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if answers_one_token():
            return proc
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(f"pdserve up did not serve within 180 s; see {log}")


def answers_one_token() -> bool:
    """The stack serves a completion (its HTTP API is up before the router's backends are)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        "http://127.0.0.1:8000/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status == 200
    except OSError:
        return False


def stop_stack(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while not all(port_free(p) for p in PORTS):
        if time.monotonic() > deadline:
            sys.exit(f"ports {PORTS} still taken after the stack stopped")
        time.sleep(0.5)


def run_vllm(args, seed: int, tmp: str) -> dict:
    name = f"vllm-{seed}.json"
    command = [
        args.vllm_python,
        str(ROOT / "bench" / "vllm_bench_serve.py"),
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        "http://127.0.0.1:8000",
        "--dataset-name",
        "random",
        f"--random-input-len={args.input_len}",
        f"--random-output-len={args.output_len}",
        f"--num-prompts={args.num_prompts}",
        f"--max-concurrency={args.concurrency}",
        f"--seed={seed}",
        "--ignore-eos",
        "--save-result",
        f"--result-dir={tmp}",
        f"--result-filename={name}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
    return json.loads(Path(tmp, name).read_text())


def run_pdserve(args, seed: int, tmp: str) -> dict:
    flags = [
        "--endpoint",
        "openai-completions",
        "--http-url",
        "http://127.0.0.1:8000/v1",
        "--rate",
        "inf",
        f"--prompt-len={args.input_len}",
        f"--output-len={args.output_len}",
        f"--num-requests={args.num_prompts}",
        f"--concurrency={args.concurrency}",
        f"--seed={seed}",
        "--warmup=0",
        "--no-progress",
    ]
    return pdserve_bench(flags, tmp, f"pdserve-{seed}")["summary"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "bench_clients.json"))
    args = p.parse_args()
    figures: dict[str, dict[str, list[float]]] = {"vllm": {}, "pdserve": {}}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp, "stack.log"))
        try:
            run_pdserve(args, 10_000, tmp)  # a warm-up round, not counted
            for r in range(args.rounds):
                order = ("vllm", "pdserve") if r % 2 == 0 else ("pdserve", "vllm")
                for client in order:
                    load.append(os.getloadavg()[0])
                    run = run_vllm if client == "vllm" else run_pdserve
                    got = run(args, r, tmp)
                    for key in KEYS:
                        figures[client].setdefault(key, []).append(got[key])
                    print(client, r, {k: round(got[k], 1) for k in KEYS}, flush=True)
        finally:
            stop_stack(stack)
    summary = {c: {k: spread(v) for k, v in f.items()} for c, f in figures.items()}
    for key in KEYS:
        v, d = summary["vllm"][key], summary["pdserve"][key]
        apart = v["max"] < d["min"] or d["max"] < v["min"]
        print(
            f"{key:>18}: vllm bench {v['median']:8.1f} ({v['min']:.1f}-{v['max']:.1f})  "
            f"pdserve bench {d['median']:8.1f} ({d['min']:.1f}-{d['max']:.1f})"
            f"{'  DIFFERENT' if apart else ''}"
        )
    conditions = {
        "stack": "pdserve up (SmolLM2-135M-Instruct, q4, its default placement), started once",
        "workload": {
            "endpoint": "/v1/completions, streaming",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
            "ignore_eos": True,
            "seeds": list(range(args.rounds)),
        },
        "rounds": args.rounds,
        "order": "alternating, vLLM's client first in even rounds; one warm-up round first",
        "load_average_1m_before_each_run": load,
    }
    write_results(args.out, conditions, runs=figures, summary=summary)


if __name__ == "__main__":
    main()
