"""What mutual TLS costs: the chapter's workload on a plaintext stack and on an mTLS stack.

Each round starts a fresh stack of each kind, one after the other (the order alternating), both
on loopback: decode, prefill and router as separate processes with one torch thread each
(TinyGPT). The mTLS stack uses certificates from `pdserve certs`: TLS on every gRPC call and on
the KV data plane. `pdserve bench --preset chapter` drives each, over TLS to the TLS router.
Reports TTFT, ITL and the handoff's bandwidth (bytes / first chunk to commit): medians over the
rounds, with the min-max spread.

  .venv/bin/python bench/tls_cost.py --rounds 5 --json bench/results/tls_cost.json
"""

import argparse
import os
import tempfile
from pathlib import Path

from chapter import chapter_summary, value  # bench/ is the script's directory
from pdserve.certs import make_dev_certs, service_flags
from common import spread, write_results  # bench/ is the script's directory
from pdserve.localstack import start_router, start_service

METRICS = [
    ("TTFT p50 (ms)", ("ttft_seconds", "p50"), 1e3),
    ("TTFT p99 (ms)", ("ttft_seconds", "p99"), 1e3),
    ("ITL p50 (ms)", ("itl_seconds", "p50"), 1e3),
    ("ITL p99 (ms)", ("itl_seconds", "p99"), 1e3),
    ("handoff p50 (MB/s)", ("handoff_bytes_per_second", "p50"), 1e-6),
    ("output tokens/s", ("output_tokens_per_second",), 1.0),
]


def one_run(certs: Path | None, tmp: str) -> dict:
    common = ["--model", "tinygpt", "--torch-threads", "1"]
    decode = start_service("decode", *common, *service_flags(certs, "decode"), tmp_dir=tmp)
    prefill = start_service("prefill", *common, *service_flags(certs, "prefill"), tmp_dir=tmp)
    router = start_router(
        [prefill], [decode], "--model", "tinygpt", *service_flags(certs, "router"), tmp_dir=tmp
    )
    env = dict(os.environ)
    if certs is not None:
        env["PDSERVE_TLS_CA"] = str(certs / "ca.pem")
    try:
        return chapter_summary(router.address, tmp, env=env)[0]
    finally:
        for service in (router, prefill, decode):
            service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs: dict[str, list] = {"plaintext": [], "mtls": []}
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_dev_certs(Path(tmp) / "certs")
        for i in range(args.rounds):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))
            for kind in order:
                runs[kind].append(one_run(certs if kind == "mtls" else None, tmp))
                print(f"round {i + 1} {kind} done", flush=True)
    rows = []
    for label, path, scale in METRICS:
        stats = {}
        for kind, summaries in runs.items():
            xs = [value(s, path) * scale for s in summaries]
            stats[kind] = spread(xs)
        p, t = stats["plaintext"], stats["mtls"]
        overlap = p["min"] <= t["max"] and t["min"] <= p["max"]
        rows.append(
            {
                "metric": label,
                **stats,
                "mtls_over_plaintext": t["median"] / p["median"],
                "verdict": "within spread" if overlap else "differs",
            }
        )
        print(
            f"{label}: plaintext {p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}), mTLS "
            f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}), ratio "
            f"{rows[-1]['mtls_over_plaintext']:.3f}, {rows[-1]['verdict']}"
        )
    if args.json:
        conditions = {
            "model": "TinyGPT (random weights), one torch thread each for prefill and decode",
            "workload": "--preset chapter: Poisson 16 req/s, prompts 64-256, outputs 16-48, "
            "seed 7, 100 requests, greedy, 2 warm-up",
            "tls": "pdserve certs (ECDSA P-256): mTLS between services, TLS to the router, the "
            "KV data plane over TLS",
            "rounds": args.rounds,
        }
        write_results(args.json, conditions, rows=rows, runs=runs)


if __name__ == "__main__":
    main()
