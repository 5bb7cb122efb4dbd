"""Fair admission: client B's time to first token while client A bursts, against B alone.

A local TinyGPT stack on loopback (one router, one prefill, one decode, 1 torch thread each),
with the router's default limits and two API keys, so that A and B are two clients. Each repeat:
B sends --b-requests requests one after another alone (idle), then A opens --burst streams at
once and, while they are in flight, B sends as many again (burst). A's streams still open when
B is done are cancelled, and the pool settles before the next repeat. B is a process of its own,
as another client would be: in the process that reads A's hundreds of streams, B's own reads
waited behind them (0.8 s of a 1.7 s TTFT, measured). Reported: B's TTFT and the time to B's
whole reply (--b-tokens tokens), p50 and p99 over every repeat, idle and during the burst, their
ratios (goal: TTFT p99 <= 3x idle), and what became of A's streams (served, refused and why).

  .venv/bin/python bench/fairness.py            # 5 repeats, about 2-3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import platform
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc

from common import write_results  # bench/ is the script's directory
from pdserve.loadtest.stats import percentile
from pdserve.localstack import start_router, start_service, wait_until
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("key-of-a", "key-of-b")


def request(rng: random.Random, prompt_len: int, tokens: int) -> pb.GenerateRequest:
    prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]
    sampling = pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


def metadata(key: str):
    return [("authorization", f"Bearer {key}")]


async def timed(stub, req: pb.GenerateRequest) -> tuple[float, float]:
    """B's time to its first token and to its last."""
    sent = time.perf_counter()
    first = None
    async for response in stub.Generate(req, timeout=60, metadata=metadata(KEYS[1])):
        if first is None and response.token_ids:
            first = time.perf_counter()
    assert first is not None, "no token came"
    return first - sent, time.perf_counter() - sent


async def b_series(address: str, seed: int, args) -> dict:
    """B's requests, one after another: each one's TTFT and whole time; a request that fails is
    counted by its reason."""
    rng = random.Random(seed)
    ttfts, totals, failures = [], [], collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        for _ in range(args.b_requests):
            try:
                first, whole = await timed(stub, request(rng, args.prompt, args.b_tokens))
                ttfts.append(first)
                totals.append(whole)
            except grpc.aio.AioRpcError as exc:
                failures[f"{exc.code().name}: {(exc.details() or '')[:100]}"] += 1
            await asyncio.sleep(args.b_gap)
    return {"ttft_s": ttfts, "whole_s": totals, "failed": dict(failures)}


def b_process(address: str, seed: int, args) -> dict:
    """b_series in the process of B's own (the executor's)."""
    return asyncio.run(b_series(address, seed, args))


async def a_stream(stub, req, outcome: collections.Counter) -> None:
    try:
        async for _ in stub.Generate(req, timeout=120, metadata=metadata(KEYS[0])):
            pass
        outcome["served"] += 1
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            outcome["cancelled after B was done"] += 1
        elif "--max-streams-per-client" in (exc.details() or ""):
            outcome["refused: --max-streams-per-client"] += 1
        elif "--max-queue-share-per-client" in (exc.details() or ""):
            outcome["refused: --max-queue-share-per-client"] += 1
        else:
            outcome[f"failed: {exc.code().name}"] += 1


async def one_repeat(address: str, rng: random.Random, args, b: ProcessPoolExecutor) -> dict:
    loop = asyncio.get_running_loop()
    idle = await loop.run_in_executor(b, b_process, address, rng.randrange(2**31), args)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        outcome: collections.Counter = collections.Counter()
        burst = [
            asyncio.ensure_future(a_stream(stub, request(rng, args.prompt, args.a_tokens), outcome))
            for _ in range(args.burst)
        ]
        await asyncio.sleep(args.b_after)
        during = await loop.run_in_executor(b, b_process, address, rng.randrange(2**31), args)
        for task in burst:
            task.cancel()
        await asyncio.gather(*burst, return_exceptions=True)
        if sum(outcome.values()) < args.burst:
            outcome["cancelled after B was done"] += args.burst - sum(outcome.values())
    return {
        "idle_ttft_s": idle["ttft_s"],
        "burst_ttft_s": during["ttft_s"],
        "idle_whole_s": idle["whole_s"],
        "burst_whole_s": during["whole_s"],
        "b_failed": {"idle": idle["failed"], "burst": during["failed"]},
        "a_streams": dict(outcome),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=300, help="A's streams, opened at once")
    parser.add_argument("--a-tokens", type=int, default=128, help="output tokens of A's")
    parser.add_argument("--b-requests", type=int, default=20, help="B's, per phase and repeat")
    parser.add_argument("--b-tokens", type=int, default=8)
    parser.add_argument("--b-gap", type=float, default=0.05, help="seconds between B's")
    parser.add_argument("--b-after", type=float, default=0.2, help="B starts this long into A's")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens, A's and B's")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", default=str(RESULTS / "fairness.json"))
    args = parser.parse_args()
    os.environ.setdefault("PDSERVE_MODEL", "tinygpt")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        decode = start_service("decode", "--torch-threads", "1", tmp_dir=tmp)
        prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
        router = start_router([prefill], [decode], "--api-key", ",".join(KEYS), tmp_dir=tmp)
        stats_channel = grpc.insecure_channel(decode.address)
        stats = pb_grpc.DecodeServiceStub(stats_channel)

        def settled() -> bool:
            s = stats.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
            return s.free_blocks == s.total_blocks and not s.running and not s.pending_leases

        repeats = []
        b = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            asyncio.run(one_repeat(router.address, random.Random(0), args, b))  # warm-up
            for i in range(args.repeats):
                wait_until(settled, 60, "the decode pool to settle")
                repeats.append(asyncio.run(one_repeat(router.address, rng, args, b)))
                print(f"repeat {i + 1}: {repeats[-1]['a_streams']}", flush=True)
        finally:
            b.shutdown()
            stats_channel.close()
            for service in (router, prefill, decode):
                service.stop()
    summary = summarize(repeats)
    print(table(summary, args))
    write_results(args.json, conditions(args), summary=summary, repeats=repeats)


def summarize(repeats: list[dict]) -> dict:
    idle = [x for r in repeats for x in r["idle_ttft_s"]]
    burst = [x for r in repeats for x in r["burst_ttft_s"]]
    idle_whole = [x for r in repeats for x in r["idle_whole_s"]]
    burst_whole = [x for r in repeats for x in r["burst_whole_s"]]
    a: collections.Counter = collections.Counter()
    b_failed: dict[str, collections.Counter] = {
        "idle": collections.Counter(),
        "burst": collections.Counter(),
    }
    for r in repeats:
        a.update(r["a_streams"])
        for phase, counts in r["b_failed"].items():
            b_failed[phase].update(counts)
    out = {
        "idle_p50_s": percentile(idle, 50),
        "idle_p99_s": percentile(idle, 99),
        "burst_p50_s": percentile(burst, 50),
        "burst_p99_s": percentile(burst, 99),
        "burst_max_s": max(burst),
        "idle_whole_p50_s": percentile(idle_whole, 50),
        "idle_whole_p99_s": percentile(idle_whole, 99),
        "burst_whole_p50_s": percentile(burst_whole, 50),
        "burst_whole_p99_s": percentile(burst_whole, 99),
        "b_requests": {"idle": len(idle), "burst": len(burst)},  # served
        "b_failed": {k: dict(v) for k, v in b_failed.items()},
        "a_streams": dict(a),
    }
    out["p99_ratio"] = out["burst_p99_s"] / out["idle_p99_s"]
    out["goal_p99_within_3x_idle"] = out["burst_p99_s"] <= 3 * out["idle_p99_s"]
    return out


def table(s: dict, args) -> str:
    ms = lambda x: f"{x * 1000:.0f}"  # noqa: E731
    return "\n".join(
        [
            "| B's TTFT | p50 (ms) | p99 (ms) | max (ms) | requests |",
            "|---|---:|---:|---:|---:|",
            f"| alone | {ms(s['idle_p50_s'])} | {ms(s['idle_p99_s'])} | | {s['b_requests']['idle']} |",
            f"| during A's burst of {args.burst} | {ms(s['burst_p50_s'])} | "
            f"{ms(s['burst_p99_s'])} | {ms(s['burst_max_s'])} | {s['b_requests']['burst']} |",
            f"| B's requests failed, alone / during the burst | "
            f"{sum(s['b_failed']['idle'].values())} | {sum(s['b_failed']['burst'].values())} | | |",
            f"| ratio, burst / alone | {s['burst_p50_s'] / s['idle_p50_s']:.1f}x | "
            f"{s['p99_ratio']:.1f}x | | |",
            f"| B's whole reply ({args.b_tokens} tokens), alone | {ms(s['idle_whole_p50_s'])} | "
            f"{ms(s['idle_whole_p99_s'])} | | |",
            f"| B's whole reply, during A's burst | {ms(s['burst_whole_p50_s'])} | "
            f"{ms(s['burst_whole_p99_s'])} | | |",
        ]
    )


def conditions(args) -> dict:
    import torch

    return {
        "model": "tinygpt (float32)",
        "stack": "router + 1 prefill + 1 decode on loopback, 1 torch thread each, default "
        "limits (--max-queue 256, --max-queue-share-per-client 0.5, --max-streams-per-client "
        "256, 2048 blocks of 16 tokens), two API keys: A and B",
        "workload": {k: v for k, v in vars(args).items() if k != "json"},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "load_average_1m": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()
