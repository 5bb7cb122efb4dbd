"""`n` completions of one prompt against as many requests of one: what the shared prefill saves.

A disaggregated stack on loopback (prefill on CPU 0; decode and the router on CPU 1, as
`bench/peers.py` places `pdserve serve`), SmolLM2-135M-Instruct unless --model says otherwise.
Per repeat, two ways to get N seeded completions of one prompt, in alternating order:

  n           one request with n = N;
  separate    N requests of one completion, sent at once, with seeds seed + i (the same tokens).

Each way gets a fresh prompt of its own (seeded words, --prompt-tokens long), so that neither
finds the other's in a prefix cache. The client times the first token and the last; prefill's
and decode's /metrics give the prompt tokens prefilled and the KV bytes handed off, and decode's
KV blocks in use, read every 20 ms meanwhile, give the most the way held at once.

  .venv/bin/python bench/choices.py --json bench/results/choices.json
"""

import argparse
import asyncio
from importlib.metadata import version
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import shown_spreads, spread, write_results  # noqa: E402

from pdserve.localstack import Service, free_port, start_router, start_service  # noqa: E402

WORDS = "the of and to in is was for on that with as by at from his her an be are".split()
WAYS = ("n", "separate")


def metric(port: int, name: str) -> float:
    """One sample's value from a service's /metrics (0 when it is not there yet)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


PREFILLED = 'pdserve_tokens_total{kind="prompt",service="prefill"}'
HANDED_OFF = 'pdserve_handoff_bytes_sum{service="decode"}'
BLOCKS_USED = 'pdserve_kv_blocks_used{service="decode"}'


class PeakBlocks:
    """The most KV blocks decode had reserved or in use at once, read every 20 ms."""

    def __init__(self, port: int) -> None:
        self.port, self.peak = port, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, metric(self.port, BLOCKS_USED))

    def __enter__(self) -> "PeakBlocks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def start(model: str, tmp: str) -> tuple[Service, list[Service], dict[str, int]]:
    ports = {"prefill": free_port(), "decode": free_port()}
    flags = ("--model", model)
    decode = start_service(
        "decode", *flags, "--cpus", "1", "--metrics-port", str(ports["decode"]), tmp_dir=tmp
    )
    prefill = start_service(
        "prefill", *flags, "--cpus", "0", "--metrics-port", str(ports["prefill"]), tmp_dir=tmp
    )
    router = start_router([prefill], [decode], *flags, "--cpus", "1", tmp_dir=tmp)
    return router, [router, prefill, decode], ports


def prompt(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of seeded words (SmolLM2 spells each of these as one token)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def completions(address: str, way: str, text: str, args) -> dict:
    """The N completions one way; the client's first-token and last-token times."""
    import grpc

    from pdserve.v1 import pdserve_pb2 as pb
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    def request(seed: int, n: int) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(
            max_tokens=args.output_tokens, temperature=0.8, seed=seed, n=n, ignore_eos=True
        )
        return pb.GenerateRequest(prompt=text, sampling=sampling)

    if way == "n":
        requests = [request(args.seed, args.n)]
    else:
        requests = [request(args.seed + i, 1) for i in range(args.n)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        sent, firsts, tokens = time.perf_counter(), [], 0

        async def one(r: pb.GenerateRequest) -> None:
            nonlocal tokens
            async for response in stub.Generate(r, timeout=600):
                if not firsts:
                    firsts.append(time.perf_counter())
                tokens += len(response.token_ids)

        await asyncio.gather(*(one(r) for r in requests))
        done = time.perf_counter()
    assert tokens == args.n * args.output_tokens, f"{way}: {tokens} tokens"
    return {"ttft_s": firsts[0] - sent, "all_done_s": done - sent}


def measure(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        router, services, ports = start(args.model, tmp)
        try:
            rng = random.Random(args.seed)
            # Warm-up, not measured: the first requests pay for lazy set-up in every service.
            for way in WAYS:
                asyncio.run(completions(router.address, way, prompt(rng, args.prompt_tokens), args))
            for r in range(args.repeats):
                for way in WAYS if r % 2 == 0 else reversed(WAYS):
                    before = [
                        metric(ports["prefill"], PREFILLED),
                        metric(ports["decode"], HANDED_OFF),
                    ]
                    text = prompt(rng, args.prompt_tokens)
                    with PeakBlocks(ports["decode"]) as blocks:
                        row = asyncio.run(completions(router.address, way, text, args))
                    row |= {
                        "peak_decode_blocks": blocks.peak,
                        "repeat": r,
                        "way": way,
                        "prefilled_tokens": metric(ports["prefill"], PREFILLED) - before[0],
                        "handoff_bytes": metric(ports["decode"], HANDED_OFF) - before[1],
                    }
                    print(row, file=sys.stderr)
                    rows.append(row)
        finally:
            for service in services:
                service.stop()
    return rows


def summarize(rows: list[dict]) -> dict:
    keys = ("ttft_s", "all_done_s", "prefilled_tokens", "handoff_bytes", "peak_decode_blocks")
    summary = {
        way: {k: spread(r[k] for r in rows if r["way"] == way) for k in keys} for way in WAYS
    }
    by_repeat = {(r["repeat"], r["way"]): r for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    summary["separate_over_n"] = {
        k: spread(by_repeat[i, "separate"][k] / by_repeat[i, "n"][k] for i in repeats)
        for k in ("ttft_s", "all_done_s")
    }
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--n", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", help="write the rows, summary and conditions here")
    args = p.parse_args(argv)
    rows = measure(args)
    summary = summarize(rows)
    for name, figures in summary.items():
        print(f"{name}: {shown_spreads(figures)}")
    if args.json:
        conditions = {
            "model": args.model,
            "placement": "prefill on CPU 0; decode and router on CPU 1; loopback",
            "workload": f"{args.n} completions of one prompt of about {args.prompt_tokens} tokens "
            f"(seeded words, a fresh prompt per way and repeat), {args.output_tokens} output "
            "tokens each, temperature 0.8, EOS ignored",
            "repeats": f"{args.repeats}, the two ways alternating which goes first, after one "
            "warm-up of each",
            "seed": args.seed,
            "python": sys.version.split()[0],
            "torch": version("torch"),
            "grpcio": version("grpcio"),
        }
        write_results(args.json, conditions, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
