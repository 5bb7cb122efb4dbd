"""Prefix reuse: a shared system prompt, with the prefix caches on and off.

Three 1P1D stacks on loopback, the same except for the caches:
  cache off     decode --prefix-cache false, prefill --prefix-cache-tokens 0: nothing is reused;
  decode only   decode's cache only: a handoff moves only what decode lacks, but prefill computes
                every prompt whole (pdserve before prefill had a cache of its own);
  both          both caches (the defaults): prefill also computes only what it lacks.
Every router uses --routing-policy prefix-aware and --local-prefill-tokens N (--local-prefill,
default 0: every prompt goes through prefill and a handoff). With N = 256, a prompt whose
uncached part is at most 256 tokens is finished on decode from its cached prefix.

Workload: 80 % of the prompts are one 1,024-token system prompt plus a user part of 16-128
tokens; 20 % are unrelated prompts of 1,040-1,152 tokens. Poisson arrivals, 16 output tokens
each. Rounds alternate between the stacks, each round the same seeded workload. Reports TTFT p50
and p99 (client-side), handoff bytes per request and the hit rate (prompt tokens from the cache
over all prompt tokens), each as the median and range over rounds.

  .venv/bin/python bench/prefix_cache.py --json bench/results/prefix_cache_prefill.json
  .venv/bin/python bench/prefix_cache.py --local-prefill 256 --configs "cache off,decode only" \
      --json bench/results/prefix_cache.json
"""

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile

from common import drive_schedule, spread, write_results  # bench/ is the script's directory
from pdserve.core.config import ModelConfig
from pdserve.loadtest.stats import percentile
from pdserve.localstack import start_router, start_service

SYSTEM_TOKENS = 1024
# name: (decode --prefix-cache, prefill --prefix-cache-tokens)
CONFIGS = {
    "cache off": ("false", "0"),
    "decode only": ("true", "0"),
    "both": ("true", "16384"),
}


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
        "prefill_hit_rate": sum(r["prefill_cached_tokens"] for r in rows)
        / sum(r["prompt_tokens"] for r in rows),
        "prefill_ms_p50": percentile([r["prefill_seconds"] * 1e3 for r in rows], 50),
    }


def measure(args) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="pdserve-prefix-")
    services, routers = [], {}
    flags = ("--model", "tinygpt", "--torch-threads", "1")
    try:
        for name in args.configs:
            decode_cache, prefill_cache = CONFIGS[name]
            decode = start_service("decode", *flags, "--prefix-cache", decode_cache, tmp_dir=tmp)
            prefill = start_service(
                "prefill", *flags, "--prefix-cache-tokens", prefill_cache, tmp_dir=tmp
            )
            router = start_router(
                [prefill],
                [decode],
                "--model",
                "tinygpt",
                "--routing-policy",
                "prefix-aware",
                "--local-prefill-tokens",
                str(args.local_prefill),
                tmp_dir=tmp,
            )
            services += [decode, prefill, router]
            routers[name] = router.address
        for name in args.configs:  # warm-up, not measured: the cache holds the system prompt after
            asyncio.run(drive_schedule(routers[name], workload(1000, 10, args.rate), 16))
        rounds = []
        for r in range(args.rounds):
            order = args.configs if r % 2 == 0 else args.configs[::-1]
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


def summarize(rounds: list[dict], configs: list[str]) -> dict:
    out = {}
    for name in configs:
        mine = [r for r in rounds if r["config"] == name]
        out[name] = {
            key: spread(r[key] for r in mine)
            for key in (
                "ttft_p50_ms",
                "ttft_p99_ms",
                "handoff_bytes_per_request",
                "hit_rate",
                "prefill_hit_rate",
                "prefill_ms_p50",
            )
        }
    return out


def conditions(args) -> dict:
    return {
        "model": "TinyGPT (random weights), float32 KV",
        "kv_bytes_per_token": ModelConfig().kv_bytes_per_token,
        "python": platform.python_version(),
        "stacks": f"{len(args.configs)} 1P1D stacks on loopback ({', '.join(args.configs)}), "
        "one torch thread per process; decode --prefix-cache and prefill "
        "--prefix-cache-tokens per configuration: "
        + "; ".join(f"{n}: {CONFIGS[n][0]}, {CONFIGS[n][1]}" for n in args.configs)
        + f"; router --routing-policy prefix-aware --local-prefill-tokens {args.local_prefill}",
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
    p.add_argument("--local-prefill", type=int, default=0, help="the routers' threshold")
    p.add_argument(
        "--configs",
        type=lambda text: text.split(","),
        default=list(CONFIGS),
        help=f"comma-separated, of: {', '.join(CONFIGS)}",
    )
    p.add_argument("--json")
    args = p.parse_args(argv)
    if unknown := set(args.configs) - set(CONFIGS):
        p.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    rounds = measure(args)
    summary = summarize(rounds, args.configs)
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
