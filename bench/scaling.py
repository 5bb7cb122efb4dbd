"""Scale-out: 1P1D, 2P1D, 1P2D and 2P2D as local processes, under two workloads.

Each configuration is a fresh set of services on loopback (TinyGPT, one torch thread each, the
router least-loaded), driven by `pdserve bench` with Poisson arrivals:

  chapter        the chapter's workload: 16 req/s, prompts 64-256 tokens, outputs 16-48;
  decode-heavy   short prompts and long outputs, offered faster than one decode keeps up
                 with: 40 req/s, prompts 16-64, outputs 128-256;
  prefill-heavy  long prompts and short outputs: 6 req/s, prompts 1,024-2,048, outputs 2-8.

Reports request throughput and goodput (requests meeting TTFT <= 500 ms and TPOT <= 50 ms, per
second), and TTFT/TPOT p50, per configuration and workload: medians and ranges over rounds, the
configurations interleaved within each round. Every configuration runs on the same 2 vCPUs, so a
second instance adds a process, not a core: read the ratios with that in mind.

  .venv/bin/python bench/scaling.py --json bench/results/scaling.json
"""

import argparse
import tempfile

# bench/ is the script's directory
from common import pdserve_bench, shown_spreads, spread, write_results
from pdserve.localstack import start_router, start_service

CONFIGS = {"1P1D": (1, 1), "2P1D": (2, 1), "1P2D": (1, 2), "2P2D": (2, 2)}
WORKLOADS = {
    "chapter": ["--rate", "16", "--prompt-len", "64-256", "--output-len", "16-48"],
    "decode-heavy": ["--rate", "40", "--prompt-len", "16-64", "--output-len", "128-256"],
    "prefill-heavy": ["--rate", "6", "--prompt-len", "1024-2048", "--output-len", "2-8"],
}


def one_run(config: str, workload: str, args, tmp: str) -> dict:
    prefills_n, decodes_n = CONFIGS[config]
    flags = ("--model", "tinygpt", "--torch-threads", "1")
    decodes = [start_service("decode", *flags, tmp_dir=tmp) for _ in range(decodes_n)]
    prefills = [start_service("prefill", *flags, tmp_dir=tmp) for _ in range(prefills_n)]
    router = start_router(
        prefills, decodes, "--model", "tinygpt", "--routing-policy", "least-loaded", tmp_dir=tmp
    )
    bench = ["--address", router.address, "--num-requests", str(args.requests), "--seed", "7"]
    bench += ["--warmup", "2", "--no-progress", *WORKLOADS[workload]]
    try:
        s = pdserve_bench(bench, tmp, f"{config}-{workload}")["summary"]
    finally:
        for service in (router, *prefills, *decodes):
            service.stop()
    return {
        "throughput_rps": s["request_throughput"],
        "goodput_rps": s["goodput"],
        "ttft_p50_ms": s["ttft_seconds"]["p50"] * 1e3,
        "tpot_p50_ms": s["tpot_seconds"]["p50"] * 1e3,
        "failed": s["failed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for workload in WORKLOADS:
                order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
                for config in order:
                    result = one_run(config, workload, args, tmp)
                    runs.append({"round": r, "workload": workload, "config": config, **result})
                    print(r, workload, config, result, flush=True)
    summary: dict = {}
    for workload in WORKLOADS:
        for config in CONFIGS:
            mine = [x for x in runs if x["workload"] == workload and x["config"] == config]
            summary.setdefault(workload, {})[config] = {
                key: spread(x[key] for x in mine)
                for key in ("throughput_rps", "goodput_rps", "ttft_p50_ms", "tpot_p50_ms")
            }
    for workload, by_config in summary.items():
        for config, figs in by_config.items():
            print(f"{workload:>13} {config}: {shown_spreads(figs)}")
    if args.json:
        conditions = {
            "model": "TinyGPT (random weights)",
            "services": "local processes on loopback, one torch thread each, router "
            "least-loaded; fresh services every run",
            "workloads": {name: " ".join(flags) for name, flags in WORKLOADS.items()},
            "requests_per_run": args.requests,
            "slo": "TTFT <= 500 ms, TPOT <= 50 ms (pdserve bench's defaults)",
            "rounds": f"{args.rounds}, configurations interleaved (order reversed every round)",
        }
        write_results(args.json, conditions, summary=summary, runs=runs)


if __name__ == "__main__":
    main()
