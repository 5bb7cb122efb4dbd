"""Conditional disaggregation over a slow link: short prompts' time to first token, threshold on
and off.

Prefill (with two routers) in one network namespace, decode in another, joined by a veth pair
shaped to 100 Mbit/s both ways (bench/interconnect.py's Link). One router hands every prompt off
(--local-prefill-tokens 0); the other derives its threshold (auto) and sends prompts under it to
decode. The workload mixes short prompts (8-32 tokens, 80 %) with long ones (1,024-2,048 tokens,
20 %), Poisson arrivals, 16 output tokens each. Rounds alternate between the two routers, each
round the same seeded workload, so the comparison is interleaved. The auto router first learns
from long prompts (a warm-up that is not measured). All traffic stays inside the namespaces;
both are deleted on exit. Needs root and iproute2.

  sudo .venv/bin/python bench/local_prefill.py --json bench/results/local_prefill.json
"""

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import drive_schedule, spread  # noqa: E402
from interconnect import (  # noqa: E402
    ADDR_B,
    RATES,
    Link,
    _cpu,
    _version,
    start_decode_and_prefill,
    start_in,
    stop_all,
    wait_serving,
)

from pdserve.core.config import ModelConfig  # noqa: E402
from pdserve.loadtest.stats import percentile  # noqa: E402
from pdserve.localstack import free_port  # noqa: E402

ROUTERS = {"off": "0", "auto": "auto"}


def workload(seed: int, requests: int, rate: float) -> list[tuple[float, list[int]]]:
    """(arrival second, prompt) pairs: 80 % of 8-32 tokens, 20 % of 1,024-2,048."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        n = rng.randint(8, 32) if rng.random() < 0.8 else rng.randint(1024, 2048)
        out.append((at, [rng.randrange(1, 256) for _ in range(n)]))
    return out


def drive_in(link: Link, port: int, seed: int, args) -> list[dict]:
    out = subprocess.run(
        ["ip", "netns", "exec", link.ns_a, sys.executable, __file__, "--drive", str(port)]
        + ["--seed", str(seed), "--requests", str(args.requests), "--rate", str(args.rate)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode:
        raise RuntimeError(f"the load client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def threshold_of(log_path: str) -> int | None:
    with open(log_path, errors="replace") as f:
        found = re.findall(r"local prefill threshold now (\d+) tokens", f.read())
    return int(found[-1]) if found else None


def measure(args) -> dict:
    link = Link(str(os.getpid() % 100000))
    procs: list[subprocess.Popen] = []
    log_dir = os.environ.get("PDSERVE_BENCH_LOGS", "/tmp")
    try:
        decode_port, prefill_port = start_decode_and_prefill(link, log_dir, procs)
        ports = {}
        for name, setting in ROUTERS.items():
            ports[name] = free_port()
            procs.append(
                start_in(
                    link.ns_a,
                    log_dir,
                    "router",
                    ports[name],
                    "--prefill",
                    f"127.0.0.1:{prefill_port}",
                    "--decode",
                    f"{ADDR_B}:{decode_port}",
                    "--local-prefill-tokens",
                    setting,
                    "--http-port",
                    "0",
                    log_name=f"router-{name}",
                )
            )
        for port in ports.values():
            wait_serving(link.ns_a, port, procs)
        link.shape(RATES["100mbit"])
        # Warm-up, not measured: both routers see traffic; auto learns from the long prompts.
        for name in ROUTERS:
            drive_in(link, ports[name], 1000, argparse.Namespace(requests=20, rate=args.rate))
        rounds = []
        for r in range(args.rounds):
            order = list(ROUTERS) if r % 2 == 0 else list(reversed(ROUTERS))
            for name in order:
                rows = drive_in(link, ports[name], args.seed + r, args)
                rounds.append({"round": r, "router": name, "rows": rows})
                print(f"round {r} {name}: {summary_line(rows)}", file=sys.stderr)
        return {
            "rounds": rounds,
            "threshold_derived": threshold_of(os.path.join(log_dir, "router-auto.log")),
        }
    finally:
        stop_all(procs)
        link.close()


def short_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["prompt_tokens"] <= 32]


def summary_line(rows: list[dict]) -> str:
    short = [r["ttft_s"] * 1e3 for r in short_rows(rows)]
    long = [r["ttft_s"] * 1e3 for r in rows if r["prompt_tokens"] > 32]
    local = sum(r["path"] == "decode" for r in rows)
    return (
        f"short TTFT p50 {percentile(short, 50):.1f} ms p99 {percentile(short, 99):.1f} ms; "
        f"long TTFT p50 {percentile(long, 50):.0f} ms; {local}/{len(rows)} prefilled on decode"
    )


def summarize(result: dict) -> dict:
    out = {}
    for name in ROUTERS:
        mine = [r["rows"] for r in result["rounds"] if r["router"] == name]
        per_round = {
            "short_ttft_p50_ms": [
                percentile([x["ttft_s"] * 1e3 for x in short_rows(rows)], 50) for rows in mine
            ],
            "short_ttft_p99_ms": [
                percentile([x["ttft_s"] * 1e3 for x in short_rows(rows)], 99) for rows in mine
            ],
            "long_ttft_p50_ms": [
                percentile([x["ttft_s"] * 1e3 for x in rows if x["prompt_tokens"] > 32], 50)
                for rows in mine
            ],
            "handoff_bytes_per_request": [
                statistics.mean(x["handoff_bytes"] for x in rows) for rows in mine
            ],
            "prefilled_on_decode": [sum(x["path"] == "decode" for x in rows) for rows in mine],
        }
        out[name] = {key: {**spread(v), "runs": v} for key, v in per_round.items()}
    return out


def conditions(args) -> dict:
    return {
        "model": "TinyGPT (random weights), float32 KV",
        "kv_bytes_per_token": ModelConfig().kv_bytes_per_token,
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "grpcio": _version("grpcio"),
        "link": "veth between two namespaces, tc tbf 100 Mbit/s both ways; router and prefill on "
        "one side, decode on the other",
        "workload": f"{args.requests} requests per round, Poisson at {args.rate}/s, 80 % of 8-32 "
        "prompt tokens and 20 % of 1,024-2,048, 16 output tokens, seed "
        f"{args.seed} + round",
        "rounds": f"{args.rounds} per router, alternating which goes first",
        "routers": {name: f"--local-prefill-tokens {s}" for name, s in ROUTERS.items()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", help="write the rounds, summary and conditions here")
    p.add_argument("--drive", metavar="ROUTER_PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.drive:
        plan = workload(args.seed, args.requests, args.rate)
        print(json.dumps(asyncio.run(drive_schedule(f"127.0.0.1:{args.drive}", plan, 16))))
        return 0
    result = measure(args)
    summary = summarize(result)
    for name, figures in summary.items():
        shown = ", ".join(
            f"{key} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})" for key, v in figures.items()
        )
        print(f"{name}: {shown}")
    print(f"threshold derived by auto: {result['threshold_derived']} tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions(args), "summary": summary, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
