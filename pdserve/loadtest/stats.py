"""Percentiles, throughput and goodput over the per-request records of one run.

Goodput follows DistServe: the rate of requests that succeeded and met both latency objectives,
TTFT <= slo_ttft and TPOT <= slo_tpot (a request with a single output token has no TPOT and is
judged on TTFT alone; an objective of None is not applied).
"""

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)


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


def describe(values: Iterable[float | None]) -> dict:
    """count, mean, min, max and the PERCENTILES of the values (None where there are none); a
    None or NaN value is left out."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    out: dict = {"count": len(xs)}
    if not xs:
        out.update(mean=None, min=None, max=None, **{f"p{q}": None for q in PERCENTILES})
        return out
    out.update(mean=sum(xs) / len(xs), min=min(xs), max=max(xs))
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    return out


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft is not None and r.ttft > slo_ttft:
        return False
    tpot = r.tpot
    return slo_tpot is None or tpot is None or tpot <= slo_tpot


def goodput(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft: float | None,
    slo_tpot: float | None,
) -> float:
    """Requests per second that succeeded within both objectives."""
    if duration <= 0:
        return math.nan
    return sum(meets_slo(r, slo_ttft, slo_tpot) for r in results) / duration


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict:
    """The run's figures: counts by status, throughput, goodput and latency distributions.

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
    good = sum(meets_slo(r, slo_ttft, slo_tpot) for r in ok)
    handoff_bw = [
        r.server["handoff_bytes"] / r.server["handoff_seconds"]
        for r in ok
        if r.server.get("handoff_seconds", 0) > 0
    ]
    return {
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
        "slo_ttft_seconds": slo_ttft,
        "slo_tpot_seconds": slo_tpot,
        "requests_meeting_slo": good,
        "slo_attainment": good / len(results) if results else math.nan,
        "goodput": per_s(good),
        "ttft_seconds": describe(r.ttft for r in ok),
        "tpot_seconds": describe(r.tpot for r in ok),
        "itl_seconds": describe(x for r in ok for x in r.itl),
        "e2e_seconds": describe(r.e2e for r in ok),
        "client_delay_seconds": describe(r.sent - r.scheduled for r in ok),
        "server_ttft_seconds": describe(r.server.get("time_to_first_token_seconds") for r in ok),
        "queue_seconds": describe(r.server.get("queue_seconds") for r in ok),
        "prefill_seconds": describe(r.server.get("prefill_seconds") for r in ok),
        "handoff_bytes": describe(r.server.get("handoff_bytes") for r in ok),
        "handoff_seconds": describe(
            r.server.get("handoff_seconds") for r in ok if r.server.get("handoff_bytes")
        ),
        "handoff_exposed_seconds": describe(
            r.server.get("handoff_exposed_seconds") for r in ok if r.server.get("handoff_bytes")
        ),
        "handoff_bytes_per_second": describe(handoff_bw),
        "retried": sum(r.server.get("attempts", 1) > 1 for r in ok),
    }
