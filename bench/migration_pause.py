"""The pause a migration adds: the longest gap between two tokens of a request whose decode dies
mid-stream, against the same request's gaps when nothing fails.

Two decode instances, one of which exits after --crash-after decode steps; greedy requests of
--tokens tokens from a --prompt-tokens prompt (TinyGPT), sent one at a time until one meets the
failing decode. Reports that request's largest inter-token gap (the migration: a new lease, a
prefill of prompt plus tokens sent, the handoff, the first step) and the median gap of the
requests that did not move.

  .venv/bin/python bench/migration_pause.py --json bench/results/migration_pause.json
"""

import argparse
import datetime
import json
import statistics
import tempfile
import time

import grpc

from pdserve.loadtest.report import cpu_conditions
from pdserve.localstack import start_router, start_service
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc


def gaps(stub, prompt: list[int], tokens: int) -> tuple[list[float], int]:
    """Inter-token gaps (s) of one streamed request, and how many handoffs it took."""
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    times, last = [], None
    for response in stub.Generate(request, timeout=120):
        times += [time.perf_counter()] * len(response.token_ids)
        last = response
    assert last is not None
    return [b - a for a, b in zip(times, times[1:])], last.metrics.attempts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--crash-after", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    pauses, normal = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            healthy = start_service("decode", "--model", "tinygpt", tmp_dir=tmp)
            faulty = start_service(
                "decode",
                "--model",
                "tinygpt",
                tmp_dir=tmp,
                faults=f"decode_crash_after_steps={args.crash_after}",
            )
            prefill = start_service("prefill", "--model", "tinygpt", tmp_dir=tmp)
            router = start_router([prefill], [faulty, healthy], "--model", "tinygpt", tmp_dir=tmp)
            try:
                with grpc.insecure_channel(router.address) as channel:
                    stub = pb_grpc.RouterServiceStub(channel)
                    for i in range(4):
                        prompt = [(7 * j + i) % 250 + 1 for j in range(args.prompt_tokens)]
                        request_gaps, attempts = gaps(stub, prompt, args.tokens)
                        if attempts > 1:
                            pauses.append(max(request_gaps))
                            break
                        normal.extend(request_gaps)
            finally:
                for service in (router, prefill, faulty, healthy):
                    service.stop()
        print(f"pause {pauses[-1] * 1e3:.1f} ms" if pauses else "no migration", flush=True)
    result = {
        "pause_ms": [round(p * 1e3, 1) for p in pauses],
        "pause_ms_median": round(statistics.median(pauses) * 1e3, 1),
        "normal_gap_ms_median": round(statistics.median(normal) * 1e3, 2),
        "conditions": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": "TinyGPT (random weights), fp32",
            "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens,
            "crash_after_steps": args.crash_after,
            "repeats": args.repeats,
            "cpu": cpu_conditions(),
        },
    }
    print(json.dumps({k: v for k, v in result.items() if k != "conditions"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
