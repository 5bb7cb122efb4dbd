"""Percentiles, throughput and goodput over the per-request records of one run.

Goodput follows DistServe (and vLLM's `--goodput`): the rate of requests that succeeded and met
every latency objective, TTFT <= slo_ttft, TPOT <= slo_tpot and E2EL <= slo_e2el (a request with
a single output token has no TPOT and is judged on TTFT and E2EL alone; an objective of None is
not applied).

SLO attainment, per request: the fraction of all requests (failed ones included, as misses) that
met every objective. Per token: the fraction of output tokens delivered on time, where a
request's first token is on time if its TTFT met the TTFT objective and each later token if its
gap from the one before (its ITL) met the TPOT objective; a failed request counts all the tokens
it asked for (max_tokens) as late. The E2EL objective judges requests only.

`vllm_metrics` gives the same figures under the keys of vLLM's `vllm bench serve --save-result`
JSON (vllm 0.32.0, vllm/benchmarks/serve.py: `calculate_metrics` and `benchmark`'s `result`
dict, whose `process_one_metric` writes `mean_/median_/std_/p{N}_{metric}_ms`), and `vllm_lists`
its per-request lists (`--save-detailed`).
"""

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

# Always in each describe() dict: the text report, the sweep table and the charts read them.
PERCENTILES = (50, 90, 99)
DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
# vLLM's metric names (`--percentile-metrics`) for the figures both clients measure.
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, offsets from the run's start)."""

    index: int
    request_id: str
    prompt_tokens: int
    max_tokens: int
    scheduled: float  # when the workload said it arrives
    sent: float = math.nan  # when the call started (later than scheduled under a concurrency cap)
    status: str = "OK"  # gRPC status code name, or CLIENT_ERROR
    error: str = ""
    ttft: float | None = None  # sent -> first token received
    e2e: float | None = None  # sent -> stream closed
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive tokens
    finish_reason: str = ""
    server: dict = field(default_factory=dict)  # the final response's usage and metrics

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tpot"] = self.tpot
        if isinstance(d["sent"], float) and math.isnan(d["sent"]):
            d["sent"] = None
        for key in ("scheduled", "sent", "ttft", "e2e", "tpot"):
            if isinstance(d[key], float):
                d[key] = round(d[key], 7)
        d["itl"] = [round(x, 7) for x in self.itl]  # 0.1 us: far below the clock's meaning
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default method); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_word(q: float) -> str:
    """How a percentile is named in keys, as vLLM names it: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(q)) if int(q) == q else str(q)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0): each in [0, 100], in the order given, once each."""
    out: list[float] = []
    for part in text.split(","):
        part = part.strip().lower().removeprefix("p")
        if not part:
            continue
        q = float(part)
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {part!r} is outside [0, 100]")
        if q not in out:
            out.append(q)
    if not out:
        raise ValueError(f"percentiles {text!r}: give at least one, e.g. 50,90,99")
    return tuple(out)


def _clean(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and not math.isnan(v)]


def describe(values: Iterable[float | None], percentiles: Sequence[float] = ()) -> dict:
    """count, mean, min, max, p50, p90, p99 and `percentiles` besides (as p{word}, see
    percentile_word) of the values (None where there are none); a None or NaN value is left
    out."""
    xs = _clean(values)
    qs = list(PERCENTILES) + [q for q in percentiles if q not in PERCENTILES]
    out: dict = {"count": len(xs)}
    if not xs:
        out.update(mean=None, min=None, max=None, **{f"p{percentile_word(q)}": None for q in qs})
        return out
    out.update(mean=sum(xs) / len(xs), min=min(xs), max=max(xs))
    out.update({f"p{percentile_word(q)}": percentile(xs, q) for q in qs})
    return out


def std(xs: Sequence[float]) -> float:
    """The population standard deviation (numpy's np.std, as vLLM reports it)."""
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def meets_slo(
    r: RequestResult,
    slo_ttft: float | None,
    slo_tpot: float | None,
    slo_e2el: float | None = None,
) -> bool:
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft is not None and r.ttft > slo_ttft:
        return False
    if slo_e2el is not None and (r.e2e is None or r.e2e > slo_e2el):
        return False
    tpot = r.tpot
    return slo_tpot is None or tpot is None or tpot <= slo_tpot


def goodput(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft: float | None,
    slo_tpot: float | None,
    slo_e2el: float | None = None,
) -> float:
    """Requests per second that succeeded within every objective."""
    if duration <= 0:
        return math.nan
    return sum(meets_slo(r, slo_ttft, slo_tpot, slo_e2el) for r in results) / duration


def tokens_on_time(
    r: RequestResult, slo_ttft: float | None, slo_tpot: float | None
) -> tuple[int, int]:
    """(output tokens on time, output tokens counted) of one request, as the per-token SLO
    attainment counts them (see the module's docstring)."""
    if not r.ok:
        return 0, max(r.max_tokens, r.output_tokens)
    if r.output_tokens == 0:
        return 0, 0
    first = slo_ttft is None or (r.ttft is not None and r.ttft <= slo_ttft)
    gaps = r.itl[: r.output_tokens - 1]
    later = sum(slo_tpot is None or gap <= slo_tpot for gap in gaps)
    unseen = r.output_tokens - 1 - len(gaps)  # no gap recorded (a non-streaming reply)
    return int(first) + later + (unseen if slo_tpot is None else 0), r.output_tokens


def token_attainment(
    results: Sequence[RequestResult], slo_ttft: float | None, slo_tpot: float | None
) -> float:
    """The fraction of output tokens delivered on time (NaN for no tokens)."""
    on_time = counted = 0
    for r in results:
        good, n = tokens_on_time(r, slo_ttft, slo_tpot)
        on_time += good
        counted += n
    return on_time / counted if counted else math.nan


def _distribution_ms(xs: list[float], name: str, percentiles: Sequence[float]) -> dict:
    """vLLM's mean_/median_/std_/p{N}_{name}_ms keys; None for no values (vLLM writes 0)."""
    out: dict = {}
    ms = [x * 1e3 for x in xs]
    out[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else None
    out[f"median_{name}_ms"] = percentile(ms, 50) if ms else None
    out[f"std_{name}_ms"] = std(ms) if ms else None
    for q in percentiles:
        out[f"p{percentile_word(q)}_{name}_ms"] = percentile(ms, q) if ms else None
    return out


def peaks(results: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s and max_concurrent_requests: output tokens per whole
    second after the first successful request's start (each token at start + TTFT + its ITLs),
    the busiest such second, and the most successful requests active in any one second."""
    spans = [
        (r.sent, r.ttft, r.e2e, r.itl)
        for r in results
        if r.ok and r.ttft is not None and r.e2e is not None
    ]
    if not spans:
        return 0.0, 0
    start = min(sent for sent, *_ in spans)
    seconds = int(math.ceil(max(sent + e2e for sent, _, e2e, _ in spans) - start)) + 1
    tokens = [0] * seconds
    active = [0] * seconds
    for sent, ttft, e2e, itl in spans:
        t = sent + ttft
        times = [t]
        for gap in itl:
            t += gap
            times.append(t)
        for when in times:
            bucket = int(when - start)
            if 0 <= bucket < seconds:
                tokens[bucket] += 1
        for second in range(int(sent - start), int(sent + e2e - start) + 1):
            active[second] += 1
    return float(max(tokens)), max(active)


def vllm_metrics(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    slo_e2el: float | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """The figures of vLLM's result JSON under its keys and in its units (ms; tokens; /s).

    As vLLM computes them: TTFT, ITL and E2EL over the successful requests, TPOT over those with
    more than one output token, `completed` the successful requests, `total_input_tokens` their
    prompt tokens; `duration` is the run's wall time. Where vLLM writes 0 for a figure with no
    values (every request failed), this writes None. `request_goodput` is None only when no
    objective is set (pdserve has default objectives, so it is a number unless they are
    removed).
    """
    ok = [r for r in results if r.ok]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    any_slo = any(x is not None for x in (slo_ttft, slo_tpot, slo_e2el))
    good = sum(meets_slo(r, slo_ttft, slo_tpot, slo_e2el) for r in ok)
    max_tokens_per_s, max_concurrent = peaks(results)
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good) if any_slo else None,
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
    }
    series: dict[str, list[float | None]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2e for r in ok],
        # vLLM writes these two with --max-concurrency; the client measures them always.
        "client_queue_time": [r.sent - r.scheduled for r in ok],
        "e2el_including_client_queue": [
            r.e2e + (r.sent - r.scheduled) for r in ok if r.e2e is not None
        ],
    }
    for name, values in series.items():
        out.update(_distribution_ms(_clean(values), name, percentiles))
    return out


def vllm_lists(results: Sequence[RequestResult]) -> dict:
    """vLLM's per-request lists (`--save-detailed`), in request order and in its units
    (seconds; a failed request has 0 output tokens, TTFT and latency 0, and its error).
    `start_times` are seconds from the run's start (vLLM's are perf_counter readings);
    `generated_texts` is not written: the client does not keep the generated text."""

    def r7(x: float) -> float:  # 0.1 us, as the records (to_dict) keep them
        return round(x, 7)

    return {
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "ttfts": [r7(r.ttft or 0.0) for r in results],
        "itls": [[r7(x) for x in r.itl] for r in results],
        "latencies": [r7(r.e2e) if r.ok and r.e2e is not None else 0.0 for r in results],
        "start_times": [None if math.isnan(r.sent) else r7(r.sent) for r in results],
        "queue_times": [
            None if math.isnan(r.sent) else r7(max(r.sent - r.scheduled, 0.0)) for r in results
        ],
        "errors": [r.error if not r.ok else "" for r in results],
    }


def _rate(hit: int, lookup: int) -> float | None:
    return hit / lookup if lookup else None


def roles(
    results: Sequence[RequestResult],
    duration: float,
    prefill_cores: float | None = None,
    decode_cores: float | None = None,
    scraped: dict | None = None,
) -> dict:
    """Prefix-cache hit rates and throughput per core of each role.

    From the final responses' metrics (gRPC only: the HTTP API does not carry them): decode's
    prefix hits are the prompt tokens decode found cached (`prefix_cached_tokens`) over the
    prompt tokens of every request; prefill's are the tokens it found cached
    (`prefill_cached_tokens`) over the prompt tokens of the requests prefilled there
    (`prefill_path` "prefill"). Prefill's throughput is the prompt tokens it computed (prompt
    minus its cache hits) per second, decode's the output tokens per second; per core divides by
    --prefill-cores / --decode-cores, the cores allotted (the client cannot see them).

    `scraped` (scrape.deltas over the run, from --metrics-url) adds, per role, what the services'
    /metrics counted: CPU seconds (so busy cores and tokens per CPU second) and their own prefix
    counters; those count every client's traffic, not only this run's.
    """
    ok = [r for r in results if r.ok and r.server]
    paths = [r.server.get("prefill_path", "") for r in ok]
    handed = [r for r, p in zip(ok, paths) if p == "prefill"]
    local = [r for r, p in zip(ok, paths) if p == "decode"]
    has_roles = bool(handed or local)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    out: dict = {}
    prefill_lookup = sum(r.prompt_tokens for r in handed)
    prefill_hit = sum(r.server.get("prefill_cached_tokens", 0) for r in handed)
    computed = prefill_lookup - prefill_hit
    prefill: dict = {
        "requests": len(handed),
        "prefix_cache": {
            "lookup_tokens": prefill_lookup if has_roles else None,
            "hit_tokens": prefill_hit if has_roles else None,
            "hit_rate": _rate(prefill_hit, prefill_lookup),
        },
        "prompt_tokens_computed": computed if has_roles else None,
        "tokens_per_second": per_s(computed) if has_roles else None,
        "cores": prefill_cores,
        "tokens_per_second_per_core": (
            per_s(computed) / prefill_cores if has_roles and prefill_cores else None
        ),
    }
    decode_lookup = sum(r.prompt_tokens for r in handed + local)
    decode_hit = sum(r.server.get("prefix_cached_tokens", 0) for r in handed + local)
    generated = sum(r.output_tokens for r in results if r.ok)
    decode: dict = {
        "requests": len(handed) + len(local),
        "prefilled_here": len(local),
        "prefix_cache": {
            "lookup_tokens": decode_lookup if has_roles else None,
            "hit_tokens": decode_hit if has_roles else None,
            "hit_rate": _rate(decode_hit, decode_lookup),
        },
        "output_tokens": generated,
        "tokens_per_second": per_s(generated),
        "cores": decode_cores,
        "tokens_per_second_per_core": per_s(generated) / decode_cores if decode_cores else None,
    }
    out = {"prefill": prefill, "decode": decode}
    if not has_roles:
        out["note"] = (
            "the target reported no prefill path (a colocated engine, or the HTTP API, whose "
            "responses carry no per-request metrics): prefix hit rates need the gRPC endpoint "
            "of a router, or --metrics-url"
        )
    for role, seen in (scraped or {}).get("roles", {}).items():
        figures = out.setdefault(role, {})
        cpu = seen.get("cpu_seconds")
        tokens = seen.get("prompt_tokens") if role == "prefill" else None
        if role in ("decode", "colocated"):
            tokens = generated
        figures["server_metrics"] = {
            **seen,
            "busy_cores": per_s(cpu) if cpu is not None else None,
            "prefix_hit_rate": (
                seen["prefix_hit_tokens"] / seen["prefix_lookup_tokens"]
                if seen.get("prefix_lookup_tokens")
                else None
            ),
            "tokens_per_cpu_second": tokens / cpu if tokens is not None and cpu else None,
        }
    return out


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    slo_e2el: float | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    prefill_cores: float | None = None,
    decode_cores: float | None = None,
    scraped: dict | None = None,
) -> dict:
    """The run's figures: counts by status, throughput, goodput and latency distributions,
    then the same under vLLM's keys (vllm_metrics), and each role's (roles).

    Latencies and token counts cover the successful requests only; `duration` is the wall time
    from the run's start to the last request's end.
    """
    ok = [r for r in results if r.ok]
    by_status: dict[str, int] = {}
    for r in results:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    met = [r for r in ok if meets_slo(r, slo_ttft, slo_tpot, slo_e2el)]
    handoff_bw = [
        r.server["handoff_bytes"] / r.server["handoff_seconds"]
        for r in ok
        if r.server.get("handoff_seconds", 0) > 0
    ]
    n = len(results)
    by_objective = {}
    for name, only in (
        ("ttft", (slo_ttft, None, None)),
        ("tpot", (None, slo_tpot, None)),
        ("e2el", (None, None, slo_e2el)),
    ):
        if any(x is not None for x in only):
            by_objective[name] = sum(meets_slo(r, *only) for r in ok) / n if n else math.nan
    pq = percentiles
    handed = [r for r in ok if r.server.get("handoff_bytes")]
    transports: dict[str, int] = {}
    paths: dict[str, int] = {}
    for r in ok:
        if r.server.get("handoff_transport"):
            t = r.server["handoff_transport"]
            transports[t] = transports.get(t, 0) + 1
        if r.server.get("prefill_path"):
            paths[r.server["prefill_path"]] = paths.get(r.server["prefill_path"], 0) + 1
    summary = {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "by_status": dict(sorted(by_status.items())),
        "duration_seconds": duration,
        "request_throughput": per_s(len(ok)),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_tokens_per_second": per_s(input_tokens),
        "output_tokens_per_second": per_s(output_tokens),
        "percentiles": list(pq),
        "slo_ttft_seconds": slo_ttft,
        "slo_tpot_seconds": slo_tpot,
        "slo_e2el_seconds": slo_e2el,
        "requests_meeting_slo": len(met),
        "slo_attainment": len(met) / n if n else math.nan,
        "slo_attainment_by_objective": by_objective,
        "slo_attainment_per_token": token_attainment(results, slo_ttft, slo_tpot),
        "goodput": per_s(len(met)),
        "output_token_goodput": per_s(sum(r.output_tokens for r in met)),
        "ttft_seconds": describe((r.ttft for r in ok), pq),
        "tpot_seconds": describe((r.tpot for r in ok), pq),
        "itl_seconds": describe((x for r in ok for x in r.itl), pq),
        "e2e_seconds": describe((r.e2e for r in ok), pq),
        "client_delay_seconds": describe((r.sent - r.scheduled for r in ok), pq),
        "server_ttft_seconds": describe(
            (r.server.get("time_to_first_token_seconds") for r in ok), pq
        ),
        "queue_seconds": describe((r.server.get("queue_seconds") for r in ok), pq),
        "prefill_seconds": describe((r.server.get("prefill_seconds") for r in ok), pq),
        "handoff_bytes": describe((r.server.get("handoff_bytes") for r in ok), pq),
        "handoff_seconds": describe((r.server.get("handoff_seconds") for r in handed), pq),
        "handoff_exposed_seconds": describe(
            (r.server.get("handoff_exposed_seconds") for r in handed), pq
        ),
        "handoff_bytes_per_second": describe(handoff_bw, pq),
        "handoff_transports": dict(sorted(transports.items())),
        "prefill_paths": dict(sorted(paths.items())),
        "retried": sum(r.server.get("attempts", 1) > 1 for r in ok),
    }
    summary.update(vllm_metrics(results, duration, slo_ttft, slo_tpot, slo_e2el, pq))
    # pdserve's own figures in vLLM's naming: the handoff columns and the server's phases.
    for name, values in (
        ("handoff", [r.server.get("handoff_seconds") for r in handed]),
        ("handoff_exposed", [r.server.get("handoff_exposed_seconds") for r in handed]),
        ("server_ttft", [r.server.get("time_to_first_token_seconds") for r in ok]),
        ("queue", [r.server.get("queue_seconds") for r in ok]),
        ("prefill", [r.server.get("prefill_seconds") for r in ok]),
    ):
        summary.update(_distribution_ms(_clean(values), name, pq))
    summary["roles"] = roles(results, duration, prefill_cores, decode_cores, scraped)
    return summary
