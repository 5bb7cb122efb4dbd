"""Least-loaded against round robin, with decode instances that are not alike.

One prefill, two decode instances: one with a full pool (--big-blocks), one with a small one
(--small-blocks). The router runs with each --routing-policy in turn, rounds interleaved, fresh
services every run. `pdserve bench` drives it: Poisson arrivals, prompts 128-512, outputs
64-128 (TinyGPT). Reports p99 TTFT and the requests refused for lack of room, per policy:
medians over the rounds with min-max.

  .venv/bin/python bench/routing.py --json bench/results/routing.json
"""

import argparse
import json
import tempfile

from common import pdserve_bench, spread, write_results  # bench/ is the script's directory
from pdserve.localstack import start_router, start_service
from pdserve.settings import ROUTING_POLICIES

POLICIES = ROUTING_POLICIES


def one_run(policy: str, args, tmp: str) -> dict:
    model = ("--model", "tinygpt")
    big = start_service("decode", *model, "--num-blocks", str(args.big_blocks), tmp_dir=tmp)
    small = start_service("decode", *model, "--num-blocks", str(args.small_blocks), tmp_dir=tmp)
    prefill = start_service("prefill", *model, tmp_dir=tmp)
    router = start_router(
        [prefill],
        [big, small],
        *model,
        "--routing-policy",
        policy,
        "--queue-timeout-seconds",
        "2",
        tmp_dir=tmp,
    )
    flags = ["--address", router.address, "--rate", str(args.rate), "--num-requests"]
    flags += [str(args.requests), "--prompt-len", "128-512", "--output-len", "64-128"]
    try:
        summary = pdserve_bench(flags + ["--seed", "7", "--warmup", "2"], tmp, policy)["summary"]
    finally:
        for service in (router, prefill, small, big):
            service.stop()
    return {
        "ttft_p99_ms": summary["ttft_seconds"]["p99"] * 1e3 if summary["ok"] else None,
        "ttft_p50_ms": summary["ttft_seconds"]["p50"] * 1e3 if summary["ok"] else None,
        "refused": summary["by_status"].get("RESOURCE_EXHAUSTED", 0),
        "ok": summary["ok"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=12.0)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--big-blocks", type=int, default=2048)
    parser.add_argument("--small-blocks", type=int, default=160)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs: dict[str, list] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for policy in POLICIES if i % 2 == 0 else tuple(reversed(POLICIES)):
                runs[policy].append(one_run(policy, args, tmp))
                print(f"round {i + 1} {policy}: {runs[policy][-1]}", flush=True)
    summary = {}
    for policy, results in runs.items():
        summary[policy] = {}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "refused", "ok"):
            xs = [r[key] for r in results if r[key] is not None]
            summary[policy][key] = spread(xs)
    print(json.dumps(summary, indent=1))
    if args.json:
        conditions = {
            "model": "TinyGPT (random weights)",
            "decode_blocks": [args.big_blocks, args.small_blocks],
            "workload": f"Poisson {args.rate} req/s, {args.requests} requests, prompts 128-512, "
            "outputs 64-128, seed 7, greedy, ignore_eos, 2 warm-up",
            "router": "--queue-timeout-seconds 2",
            "rounds": args.rounds,
        }
        write_results(args.json, conditions, summary=summary, runs=runs)


if __name__ == "__main__":
    main()
