"""`pdserve bench`: the load-test client (see `pdserve bench --help`).

pdserve/cli.py registers it with `add_bench(subparsers)`; `python -m pdserve.loadtest` runs it alone.
"""

import argparse
import asyncio
import datetime as dt
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

from pdserve.settings import env

DESCRIPTION = """\
Load-test any pdserve.v1.Router endpoint (the disaggregated stack's router or the colocated
engine): send a seeded workload at its arrival times, then print requests ok and failed by
status, input and output tokens/s, TTFT, TPOT, inter-token and end-to-end latency at
p50/p90/p99 (or --percentiles), goodput and SLO attainment under the TTFT, TPOT and E2EL
objectives, the server-reported handoff bytes and latency per request, and each role's prefix
hit rate and throughput (per core with --prefill-cores/--decode-cores).

--json writes, per rate, pdserve's figures and beside them the keys of vLLM's `vllm bench serve
--save-result` JSON with the same meaning and units (completed, request_goodput,
output_throughput, mean_ttft_ms, p99_itl_ms, ...; latencies in ms), vLLM's per-request lists
(input_lens, ttfts, itls, ...) and one record per request.

Arrivals: poisson, or gamma with --burstiness B (gamma shape B, same mean rate; B < 1 is burstier
than Poisson, B = 1 is Poisson). --rate takes one rate, a comma list or START:STOP:STEP for a
sweep; the same seed sends the same requests at every rate (only the gaps scale). Requests use
ignore_eos, so each generates exactly its output length.

Timing is client-side: TTFT from sending the call to the first token, TPOT = (E2E - TTFT) /
(tokens - 1), ITL = gaps between token arrivals. A progress bar goes to stderr."""

EPILOG = """\
presets:
  chapter   the chapter's workload: poisson 16 req/s, prompt 64-256 tokens, output 16-48,
            seed 7, 100 requests (any flag given explicitly overrides the preset)

examples:
  pdserve bench --preset chapter --address 127.0.0.1:50051 --json out.json --plot out.png
  pdserve bench --rate 2,4,8,16 --num-requests 50 --slo-ttft 200ms --slo-tpot 50ms --plot sweep.png
  pdserve bench --rate 8 --goodput ttft:500 tpot:100 --percentiles 50,90,99,99.9 --json out.json
  pdserve up --metrics-base-port 9100 &
  pdserve bench --metrics-url http://127.0.0.1:9101/metrics http://127.0.0.1:9102/metrics \\
      --prefill-cores 1 --decode-cores 1 --json out.json
  pdserve bench --arrival gamma --burstiness 0.25 --rate 8 --duration 30 --concurrency 32
  pdserve bench --dataset prompts.jsonl --rate inf --num-requests 20 --concurrency 4
  pdserve bench --from-json disagg.json colocated.json --plot compare.png"""

# Built-in defaults; a preset replaces some; an explicit flag beats both. Values: each flag's type.
DEFAULTS: dict[str, Any] = {
    "arrival": "poisson",
    "rate": "4",
    "burstiness": 1.0,
    "prompt_len": "64-256",
    "output_len": "16-48",
    "prompt_kind": "tokens",
    "dataset": None,
    "seed": 0,
    "num_requests": 100,
    "duration": None,
    "concurrency": None,
    "warmup": 0,
    "slo_ttft": 0.5,
    "slo_tpot": 0.05,
}
PRESETS = {
    "chapter": {
        "arrival": "poisson",
        "rate": "16",
        "burstiness": 1.0,
        "prompt_len": "64-256",
        "output_len": "16-48",
        "prompt_kind": "tokens",
        "dataset": None,
        "seed": 7,
        "num_requests": 100,
    },
}
MAX_RATES = 64


def seconds(text: str) -> float:
    """'0.2', '0.2s', '200ms' or '200us' -> seconds."""
    t = text.strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if t.endswith(suffix):
            value = float(t[: -len(suffix)]) * scale
            break
    else:
        value = float(t)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: need a positive time")
    return value


def parse_rates(text: str) -> list[float]:
    """'16', 'inf', '2,4,8' or '2:16:2' (inclusive) -> rates in requests per second."""
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if part.count(":") == 2:
            start, stop, step = (float(x) for x in part.split(":"))
            if not (step > 0 and stop >= start):
                raise ValueError(f"rate range {part!r}: need START <= STOP and STEP > 0")
            n = int(math.floor((stop - start) / step + 1e-9)) + 1
            if n > MAX_RATES:
                raise ValueError(f"rate range {part!r} has {n} rates, over {MAX_RATES}")
            rates += [round(start + i * step, 9) for i in range(n)]
        else:
            rates.append(math.inf if part in ("inf", "max") else float(part))
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates {text!r}: each must be > 0 (or inf)")
    if len(rates) > MAX_RATES:
        raise ValueError(f"{len(rates)} rates, over {MAX_RATES}")
    return rates


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 1")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need an integer >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: need a number > 0")
    return value


def _percentiles(text: str) -> tuple[float, ...]:
    from pdserve.loadtest.stats import parse_percentiles

    try:
        return parse_percentiles(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """vLLM's --goodput syntax: ["ttft:500", "tpot:100"] -> {"ttft": 0.5, "tpot": 0.1} (the
    values in milliseconds, returned in seconds). A pair may also hold several, comma-separated."""
    out: dict[str, float] = {}
    for pair in (p for text in pairs for p in text.replace(",", " ").split()):
        name, sep, value = pair.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_KEYS:
            raise ValueError(
                f"--goodput {pair!r}: give KEY:VALUE pairs, KEY one of {', '.join(GOODPUT_KEYS)} "
                "and VALUE in milliseconds (e.g. ttft:500 tpot:100)"
            )
        ms = float(value)
        if not (ms >= 0 and math.isfinite(ms)):
            raise ValueError(f"--goodput {pair!r}: the objective must be >= 0 ms")
        out[name] = ms / 1e3
    return out


def _wrap(text: str) -> str:
    """A group's description, filled by hand (the raw formatter keeps its line breaks)."""
    return textwrap.fill(text, 76)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        default=env("ADDRESS", "127.0.0.1:50051"),
        help="Router (or colocated engine) host:port (PDSERVE_ADDRESS; default %(default)s)",
    )
    p.add_argument(
        "--endpoint",
        choices=["grpc", "openai-completions", "openai-chat"],
        default="grpc",
        help="what to drive: the gRPC RouterService at --address (default), or the router's "
        "OpenAI-compatible HTTP API at --http-url (PDSERVE_API_KEY, if set, is sent as the key)",
    )
    p.add_argument(
        "--http-url",
        metavar="URL",
        default=env("HTTP_URL", "http://127.0.0.1:8000/v1"),
        help="base URL of the HTTP API (PDSERVE_HTTP_URL; default %(default)s)",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named workload (see below)")
    p.add_argument(
        "--label",
        metavar="NAME",
        default="",
        help="name of the target in the report, JSON and "
        "chart legends (e.g. disaggregated, colocated)",
    )

    w = p.add_argument_group("workload")
    w.add_argument(
        "--arrival",
        choices=["poisson", "gamma"],
        help=f"arrival process (default {DEFAULTS['arrival']})",
    )
    w.add_argument(
        "--rate",
        metavar="RATE[,RATE|A:B:STEP]",
        help="requests/s: one rate, 'inf' (all at once), a comma list or "
        f"START:STOP:STEP for a sweep (default {DEFAULTS['rate']})",
    )
    w.add_argument(
        "--burstiness",
        metavar="B",
        type=float,
        help="gamma shape: 1 is Poisson, below 1 "
        f"burstier, above 1 smoother (default {DEFAULTS['burstiness']:g})",
    )
    w.add_argument(
        "--prompt-len",
        metavar="N|LO-HI",
        help=f"prompt tokens: a fixed value or a uniform range (default {DEFAULTS['prompt_len']})",
    )
    w.add_argument(
        "--output-len",
        metavar="N|LO-HI",
        help="tokens to generate: a fixed value "
        f"or a uniform range (default {DEFAULTS['output_len']})",
    )
    w.add_argument(
        "--prompt-kind",
        choices=["tokens", "text"],
        help="random byte-level token ids 32..126 sent as prompt_token_ids, or the "
        f"same bytes as text (default {DEFAULTS['prompt_kind']})",
    )
    w.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        help="prompts from a JSONL file, one "
        '{"prompt": ..., "max_tokens": ...} per line (max_tokens optional: '
        "--output-len otherwise), in a seeded shuffled order",
    )
    w.add_argument(
        "--seed",
        metavar="N",
        type=int,
        help="the same seed gives the same arrival times, "
        f"lengths and prompts (default {DEFAULTS['seed']})",
    )

    r = p.add_argument_group("run")
    r.add_argument(
        "--num-requests",
        "-n",
        metavar="N",
        type=_positive_int,
        help=f"requests per rate (default {DEFAULTS['num_requests']}, or none when "
        "--duration is given)",
    )
    r.add_argument(
        "--duration",
        metavar="SECONDS",
        type=seconds,
        help="send requests for this long per rate (with --num-requests too, whichever ends first)",
    )
    r.add_argument(
        "--concurrency",
        metavar="N",
        type=_positive_int,
        help="most requests in flight; a request waits for a slot (default: no cap, open loop)",
    )
    r.add_argument(
        "--warmup",
        metavar="N",
        type=_nonneg_int,
        help="requests sent one at a time before the "
        f"measured run, not counted (default {DEFAULTS['warmup']})",
    )
    r.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=seconds,
        default=120.0,
        help="per-request deadline (default %(default)s s)",
    )
    r.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=0.0,
        help="0 is greedy (default %(default)s)",
    )
    r.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at end-of-sequence (output lengths no longer exact)",
    )
    r.add_argument(
        "--sweep-pause",
        metavar="SECONDS",
        type=float,
        default=1.0,
        help="seconds between the rates of a sweep (default %(default)s)",
    )

    o = p.add_argument_group(
        "objectives",
        _wrap(
            "goodput (JSON goodput and vLLM's request_goodput) counts the requests per second that "
            "succeeded and met every objective. SLO attainment per request (slo_attainment) is the "
            "fraction of all requests that did (a failed request misses); per token "
            "(slo_attainment_per_token), the fraction of output tokens on time: a request's first "
            "if its TTFT met the TTFT objective, each later one if its gap from the one before (its "
            "ITL) met the TPOT objective; a failed request's max_tokens all count as late. "
            "output_token_goodput is the output tokens/s of the requests that met every objective"
        ),
    )
    o.add_argument(
        "--slo-ttft",
        metavar="TIME",
        type=seconds,
        help=f"TTFT objective, e.g. 0.5 or 500ms (default {DEFAULTS['slo_ttft'] * 1e3:g}ms)",
    )
    o.add_argument(
        "--slo-tpot",
        metavar="TIME",
        type=seconds,
        help=f"TPOT objective, e.g. 0.05 or 50ms (default {DEFAULTS['slo_tpot'] * 1e3:g}ms)",
    )
    o.add_argument(
        "--slo-e2el",
        metavar="TIME",
        type=seconds,
        help="end-to-end latency objective, e.g. 2s (default: none)",
    )
    o.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="the objectives in vLLM's syntax instead: KEY:VALUE pairs, KEY one of ttft, tpot, "
        "e2el and VALUE in milliseconds, e.g. --goodput ttft:500 tpot:100. Only the keys given "
        "apply (as in vLLM: the default TTFT and TPOT objectives are dropped); not with "
        "--slo-ttft/--slo-tpot/--slo-e2el",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--percentiles",
        "--metric-percentiles",
        dest="percentiles",
        metavar="P[,P...]",
        type=_percentiles,
        default=(50.0, 90.0, 99.0),
        help="the percentiles reported, e.g. 50,90,99,99.9: the text's columns and, in the "
        "JSON, vLLM's p{P}_{ttft,tpot,itl,e2el}_ms keys and p{P} in pdserve's distributions "
        "(which always keep p50, p90 and p99). --metric-percentiles is vLLM's name for it "
        "(default 50,90,99; vLLM's own default is 99)",
    )
    out.add_argument(
        "--prefill-cores",
        metavar="N",
        type=_positive_float,
        help="cores allotted to the prefill instances together (e.g. pdserve up --prefill-cpus, "
        "or the pods' CPU): the JSON's roles.prefill.tokens_per_second_per_core is the prompt "
        "tokens prefill computed per second divided by this (the client cannot see the cores)",
    )
    out.add_argument(
        "--decode-cores",
        metavar="N",
        type=_positive_float,
        help="cores allotted to the decode instances together: roles.decode."
        "tokens_per_second_per_core is the output tokens per second divided by this",
    )
    out.add_argument(
        "--metrics-url",
        nargs="+",
        default=[],
        metavar="URL",
        help="the services' Prometheus endpoints (e.g. pdserve up --metrics-base-port B: "
        "router B, prefill B+1, decode B+2, at http://127.0.0.1:PORT/metrics), read before and "
        "after each rate: each role's CPU seconds (busy cores, tokens per CPU second) and its "
        "own prefix-cache counters go into roles.<role>.server_metrics. They count all traffic, "
        "not only the bench's",
    )
    out.add_argument(
        "--json",
        metavar="PATH",
        help="write every request and the summary with "
        "the run's conditions (the model as the target reports it, parameters, "
        "CPU, torch, workload, seed, rates, date) here; each rate's summary also holds "
        "vLLM's result keys (see above), and the run vLLM's per-request lists",
    )
    out.add_argument(
        "--plot",
        metavar="PATH.png",
        help="write a PNG chart: latency "
        "percentiles against rate for a sweep, latency CDFs for one rate",
    )
    out.add_argument(
        "--from-json",
        nargs="+",
        metavar="PATH",
        help="run nothing: print the "
        "summaries of saved results and, with --plot, chart them together",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="load-test a Router endpoint (Poisson/gamma "
        "arrivals, rate sweeps, SLO goodput, JSON and charts)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run_bench)
    return p


def resolve(args: argparse.Namespace) -> dict:
    """Flag values with the preset's and the built-in defaults filled in."""
    preset = PRESETS.get(args.preset, {}) if args.preset else {}
    out = {}
    for key, default in DEFAULTS.items():
        value = getattr(args, key)
        out[key] = value if value is not None else preset.get(key, default)
    if args.duration is not None and args.num_requests is None:
        out["num_requests"] = None  # a duration alone
    out["slo_e2el"] = args.slo_e2el
    if args.goodput:
        if args.slo_ttft is not None or args.slo_tpot is not None or args.slo_e2el is not None:
            raise ValueError("give the objectives with --goodput or with --slo-*, not both")
        slos = parse_goodput(args.goodput)
        out.update({f"slo_{key}": slos.get(key) for key in GOODPUT_KEYS})
    return out


def build(args: argparse.Namespace):
    from pdserve.loadtest.runner import RunOptions
    from pdserve.loadtest.workload import LengthRange, WorkloadSpec

    v = resolve(args)
    rates = parse_rates(str(v["rate"]))
    spec = WorkloadSpec(
        arrival=v["arrival"],
        rate=rates[0],
        burstiness=v["burstiness"],
        prompt_len=LengthRange.parse(v["prompt_len"]),
        output_len=LengthRange.parse(v["output_len"]),
        prompt_kind=v["prompt_kind"],
        dataset=v["dataset"],
        seed=v["seed"],
    )
    options = RunOptions(
        args.address,
        v["num_requests"],
        v["duration"],
        v["concurrency"],
        args.timeout,
        args.temperature,
        args.ignore_eos,
        v["warmup"],
        args.endpoint,
        args.http_url,
        tuple(args.metrics_url),
    )
    if (
        options.num_requests is None
        and any(math.isinf(r) for r in rates)
        and options.concurrency is None
    ):
        raise ValueError("--rate inf with --duration and no --num-requests needs --concurrency")
    return spec, rates, options, v


def run_bench(args: argparse.Namespace) -> int:
    from pdserve.loadtest import report

    if args.from_json:
        loaded = [(Path(p), report.load_json(p)) for p in args.from_json]
        docs = [(doc["conditions"]["target"].get("label") or p.stem, doc) for p, doc in loaded]
        for _, doc in docs:
            print(report.report_text(doc))
        if args.plot:
            print(f"chart: {report.plot(docs, args.plot)}", file=sys.stderr)
        return 0
    try:
        spec, rates, options, v = build(args)
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    from pdserve.loadtest.runner import fetch_model_info, run_sweep

    started = dt.datetime.now(dt.timezone.utc)
    info, unavailable = asyncio.run(fetch_model_info(args.address))
    if info is None:
        print(
            f"pdserve bench: {unavailable}; the results will record the model as unknown",
            file=sys.stderr,
            flush=True,
        )
    conds = report.conditions(
        spec,
        rates,
        options,
        model_info=info,
        model_unavailable=unavailable,
        label=args.label,
        preset=args.preset,
        slo_ttft=v["slo_ttft"],
        slo_tpot=v["slo_tpot"],
        slo_e2el=v["slo_e2el"],
        started=started,
        percentiles=args.percentiles,
        prefill_cores=args.prefill_cores,
        decode_cores=args.decode_cores,
    )
    slos = (v["slo_ttft"], v["slo_tpot"], v["slo_e2el"])
    done = []

    def on_run(run) -> None:
        done.append(run)
        doc = report.document(conds, [run], *slos)
        print(report.summary_text(conds, doc["runs"][0]), flush=True)
        if args.json:  # rewritten after each rate, so a cut-short sweep keeps what it measured
            report.write_json(report.document(conds, done, *slos), args.json)

    print(
        f"pdserve bench: {spec.describe()}"
        + (f" (sweep {', '.join(f'{r:g}' for r in rates)})" if len(rates) > 1 else "")
        + f"; {options.num_requests or 'unbounded'} requests"
        + (f" or {options.duration:g} s" if options.duration else "")
        + f" per rate -> {options.target}",
        file=sys.stderr,
        flush=True,
    )
    try:
        asyncio.run(
            run_sweep(
                spec,
                rates,
                options,
                args.sweep_pause,
                show_progress=not args.no_progress,
                on_run=on_run,
            )
        )
    except ConnectionError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 1
    doc = report.document(conds, done, *slos)
    if len(done) > 1:
        print(report.sweep_table(conds, doc["runs"]))
    print(report.conditions_line(conds))
    if args.json:
        print(f"results: {args.json}", file=sys.stderr)
    if args.plot:
        label = args.label or "bench"
        print(f"chart: {report.plot([(label, doc)], args.plot)}", file=sys.stderr)
    return 0 if any(r.ok for run in done for r in run.results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_bench(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
