"""Prefix reuse: a shared system prompt, with decode's prefix cache on and off.

Two 1P1D stacks on loopback, the same except for decode's --prefix-cache. Both routers use
--routing-policy prefix-aware and --local-prefill-tokens 256: with the cache on, a prompt whose
uncached part is at most 256 tokens is finished on decode from its cached prefix; with it off,
nothing is cached, so every prompt (over 1,024 tokens) goes through prefill and a handoff.

Workload: 80 % of the prompts are one 1,024-token system prompt plus a user part of 16-128
tokens; 20 % are unrelated prompts of 1,040-1,152 tokens. Poisson arrivals, 16 output tokens
each. Rounds alternate between the stacks, each round the same seeded workload. Reports TTFT p50
and p99 (client-side), handoff bytes per request and the hit rate (prompt tokens from the cache
over all prompt tokens), each as the median and range over rounds.

  .venv/bin/python bench/prefix_cache.py --json bench/results/prefix_cache.json
"""

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile

from common import drive_schedule, write_results  # bench/ is the script's directory
from pdserve.core.config import ModelConfig
from pdserve.loadtest.stats import percentile
from pdserve.localstack import start_router, start_service

SYSTEM_TOKENS = 1024
CONFIGS = {"cache on": "true", "cache off": "false"}


def workload(seed: int, requests: int, rate: float) -> list[tuple[float, list[int]]]:
    rng = random.Random(seed)
    system = [random.Random(0).randrange(1, 256) for _ in range(SYSTEM_TOKENS)]
    at, out = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        if rng.random() < 0.8:
            prompt = system + [rng.randrange(1, 256) for _ in range(rng.randint(16, 128))]
        else:
            prompt = [rng.randrange(1, 256) for _ in range(rng.randint(1040, 1152))]
        out.append((at, prompt))
    return out


def figures(rows: list[dict]) -> dict:
    ttft = [r["ttft_s"] * 1e3 for r in rows]
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "handoff_bytes_per_request": statistics.mean(r["handoff_bytes"] for r in rows),
        "hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "prefilled_on_decode": sum(r["path"] == "decode" for r in rows) / len(rows),
    }


def measure(args) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="pdserve-prefix-")
    services, routers = [], {}
    flags = ("--model", "tinygpt", "--torch-threads", "1")
    try:
        for name, cache in CONFIGS.items():
            decode = start_service("decode", *flags, "--prefix-cache", cache, tmp_dir=tmp)
            prefill = start_service("prefill", *flags, tmp_dir=tmp)
            router = start_router(
                [prefill],
                [decode],
                "--model",
                "tinygpt",
                "--routing-policy",
                "prefix-aware",
                "--local-prefill-tokens",
                "256",
                tmp_dir=tmp,
            )
            services += [decode, prefill, router]
            routers[name] = router.address
        for name in CONFIGS:  # warm-up, not measured: the cache holds the system prompt after
            asyncio.run(drive_schedule(routers[name], workload(1000, 10, args.rate), 16))
        rounds = []
        for r in range(args.rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                plan = workload(args.seed + r, args.requests, args.rate)
                rows = asyncio.run(drive_schedule(routers[name], plan, 16))
                rounds.append({"round": r, "config": name, "rows": rows, **figures(rows)})
                shown = ", ".join(f"{k} {v:.3g}" for k, v in figures(rows).items())
                print(f"round {r} {name}: {shown}", file=sys.stderr)
        return rounds
    finally:
        for service in services:
            service.stop()


def summarize(rounds: list[dict]) -> dict:
    out = {}
    for name in CONFIGS:
        mine = [r for r in rounds if r["config"] == name]
        out[name] = {
            key: {
                "median": statistics.median(r[key] for r in mine),
                "min": min(r[key] for r in mine),
                "max": max(r[key] for r in mine),
            }
            for key in ("ttft_p50_ms", "ttft_p99_ms", "handoff_bytes_per_request", "hit_rate")
        }
    return out


def conditions(args) -> dict:
    return {
        "model": "TinyGPT (random weights), float32 KV",
        "kv_bytes_per_token": ModelConfig().kv_bytes_per_token,
        "python": platform.python_version(),
        "stacks": "two 1P1D stacks on loopback, one torch thread per process; decode "
        "--prefix-cache true or false; router --routing-policy prefix-aware "
        "--local-prefill-tokens 256",
        "workload": f"{args.requests} requests per round, Poisson at {args.rate}/s; 80 % a "
        f"{SYSTEM_TOKENS}-token system prompt + 16-128 tokens, 20 % unrelated 1,040-1,152 "
        f"tokens; 16 output tokens; seed {args.seed} + round; 10 warm-up requests per stack",
        "rounds": f"{args.rounds} per configuration, alternating which goes first",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rounds = measure(args)
    summary = summarize(rounds)
    for name, figs in summary.items():
        print(
            name
            + ": "
            + ", ".join(
                f"{k} {v['median']:.3g} ({v['min']:.3g}-{v['max']:.3g})" for k, v in figs.items()
            )
        )
    if args.json:
        write_results(args.json, conditions(args), summary=summary, rounds=rounds)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
