"""Every Prometheus metric pdserve exports, with its help text. One process, one service label.

Names are in base units (seconds, bytes). Each service records what it sees: the router the
client's latencies, prefill the send side of the handoff, decode the receive side and the pool.
"""

import logging
from collections.abc import Iterable
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# 100 µs to 60 s, roughly x2.5 per bucket: a loopback handoff of a short prompt takes well under a
# millisecond, a 128k-token Llama-70B cache over 10 GbE takes tens of seconds (docs/handoff-table.md).
LATENCY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
)
BYTES_BUCKETS = tuple(float(1 << p) for p in range(10, 34, 2))  # 1 KiB .. 8 GiB
BANDWIDTH_BUCKETS = tuple(float(10**p) for p in range(6, 12)) + (4e11,)  # 1 MB/s .. 400 GB/s
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

HANDOFF_SECONDS = Histogram(
    "pdserve_handoff_seconds",
    "KV handoff latency: first chunk sent (prefill, router) or received (decode) to commit",
    ["service"],
    buckets=LATENCY_BUCKETS,
)
HANDOFF_BYTES = Histogram(
    "pdserve_handoff_bytes", "KV payload bytes per handoff", ["service"], buckets=BYTES_BUCKETS
)
HANDOFF_BANDWIDTH = Histogram(
    "pdserve_handoff_bandwidth_bytes_per_second",
    "Handoff bytes / handoff seconds",
    ["service"],
    buckets=BANDWIDTH_BUCKETS,
)
TTFT_SECONDS = Histogram(
    "pdserve_time_to_first_token_seconds",
    "Request received to first token sent",
    ["service"],
    buckets=LATENCY_BUCKETS,
)
TPOT_SECONDS = Histogram(
    "pdserve_time_per_output_token_seconds",
    "(end to end - time to first token) / (tokens - 1)",
    ["service"],
    buckets=LATENCY_BUCKETS,
)
E2E_SECONDS = Histogram(
    "pdserve_e2e_request_latency_seconds",
    "Request received to last token sent",
    ["service"],
    buckets=LATENCY_BUCKETS,
)
REQUESTS = Counter(
    "pdserve_requests_total", "Requests by outcome and gRPC status", ["service", "outcome", "code"]
)
TOKENS = Counter(
    "pdserve_tokens_total",
    "Tokens processed: prompt (on prefill, those computed: a prefix-cache hit is counted in "
    "pdserve_prefix_cache_hit_tokens_total instead) and generated",
    ["service", "kind"],
)
KV_TRANSFERS = Counter(
    "pdserve_kv_transfers_total",
    "Committed KV handoffs by the transport that carried them (tcp, grpc, inproc)",
    ["service", "transport"],
)
QUEUE_DEPTH = Gauge(
    "pdserve_queue_depth",
    "Requests waiting (router: for decode room; prefill: for a batch)",
    ["service"],
)
RUNNING = Gauge("pdserve_running_sequences", "Sequences held by the decode engine", ["service"])
KV_BLOCKS_USED = Gauge("pdserve_kv_blocks_used", "KV blocks reserved or in use", ["service"])
KV_BLOCKS_FREE = Gauge("pdserve_kv_blocks_free", "KV blocks free for new reservations", ["service"])
PREFILL_BATCH = Histogram(
    "pdserve_prefill_batch_size", "Prompts per prefill batch", ["service"], buckets=BATCH_BUCKETS
)
DECODE_BATCH = Histogram(
    "pdserve_decode_batch_size", "Sequences per decode step", ["service"], buckets=BATCH_BUCKETS
)
QUEUE_SECONDS = Histogram(
    "pdserve_queue_wait_seconds",
    "How long a prompt waited for its prefill batch: growing waits mean prefill is the "
    "bottleneck (too few prefill cores for the arrival of long prompts)",
    ["service"],
    buckets=LATENCY_BUCKETS,
)
PHASE_SECONDS = Histogram(
    "pdserve_request_phase_seconds",
    "A request's time to first token in phases (routing, decode_room, prefill_queue, "
    "prefill_compute, transfer_after_compute, relay), and first_decode_step after it; see "
    "RequestPhases in proto/pdserve/v1",
    ["service", "phase"],
    buckets=LATENCY_BUCKETS,
)
STEP_SECONDS = Histogram(
    "pdserve_engine_step_seconds",
    "One prefill batch or decode step",
    ["service", "phase"],
    buckets=LATENCY_BUCKETS,
)


def start(port: int, host: str = "127.0.0.1") -> None:
    """Serves /metrics over HTTP on host:port (0: no endpoint): the service's own address, so a
    service kept on loopback keeps its metrics there too."""
    if port:
        start_http_server(port, addr=host)
        log.info("metrics on http://%s:%d/metrics", host, port)


def record_handoff(service: str, seconds: float, nbytes: int) -> None:
    HANDOFF_SECONDS.labels(service).observe(seconds)
    HANDOFF_BYTES.labels(service).observe(nbytes)
    if seconds > 0:
        HANDOFF_BANDWIDTH.labels(service).observe(nbytes / seconds)


def record_phases(service: str, phases: Iterable[tuple[str, float]]) -> None:
    for phase, seconds in phases:
        PHASE_SECONDS.labels(service, phase).observe(seconds)


def record_request(
    service: str,
    code: str,
    ttft: float | None = None,
    e2e: float | None = None,
    completion_tokens: int = 0,
    prompt_tokens: int = 0,
) -> None:
    """One finished request (code "OK") or failed one (its gRPC status name)."""
    REQUESTS.labels(service, "ok" if code == "OK" else "error", code).inc()
    if code != "OK":
        return
    assert ttft is not None and e2e is not None, "a successful request has both latencies"
    TTFT_SECONDS.labels(service).observe(ttft)
    E2E_SECONDS.labels(service).observe(e2e)
    if completion_tokens > 1:
        TPOT_SECONDS.labels(service).observe((e2e - ttft) / (completion_tokens - 1))
    TOKENS.labels(service, "prompt").inc(prompt_tokens)
    TOKENS.labels(service, "generated").inc(completion_tokens)


def watch_pool(
    service: str, free: Callable[[], int], total: int, running: Callable[[], int]
) -> None:
    """Pool gauges read at scrape time, so they are never stale."""
    KV_BLOCKS_FREE.labels(service).set_function(free)
    KV_BLOCKS_USED.labels(service).set_function(lambda: total - free())
    RUNNING.labels(service).set_function(running)


PREFILL_PATH = Counter(
    "pdserve_prefill_path_total",
    "Completed requests by where their prompt was prefilled: 'prefill' (a prefill instance and "
    "a KV handoff) or 'decode' (the decode instance itself, --local-prefill-tokens)",
    ["service", "path"],
)
LOCAL_PREFILL_THRESHOLD = Gauge(
    "pdserve_local_prefill_threshold_tokens",
    "Prompts of at most this many tokens are prefilled on decode (--local-prefill-tokens)",
    ["service"],
)
PREFILL_DECISIONS = Counter(
    "pdserve_prefill_decisions_total",
    "Where each attempt's prompt was sent to be prefilled, and why: path decode (below_threshold, "
    "or prefix_cached: only decode's cached prefix brought it under) or prefill "
    "(above_threshold, local_prefill_off: --local-prefill-tokens 0, or measuring: auto has too "
    "few handed-off requests yet)",
    ["service", "path", "reason"],
)
MEASURED_PREFILL_RATE = Gauge(
    "pdserve_measured_prefill_tokens_per_second",
    "--local-prefill-tokens auto's input: prompt tokens a prefill instance computes per second, "
    "from the replies of handed-off requests (a moving average; 0 before the first)",
    ["service"],
)
MEASURED_HANDOFF_RATE = Gauge(
    "pdserve_measured_handoff_bytes_per_second",
    "--local-prefill-tokens auto's input: KV bytes per second of the handoffs, as above",
    ["service"],
)
PREFIX_LOOKUP_TOKENS = Counter(
    "pdserve_prefix_cache_lookup_tokens_total",
    "Prompt tokens of the requests that looked in the prefix cache",
    ["service"],
)
PREFIX_HIT_TOKENS = Counter(
    "pdserve_prefix_cache_hit_tokens_total",
    "Prompt tokens whose KV came from the service's prefix cache rather than being computed (on "
    "decode, nor handed off either)",
    ["service"],
)
PREFIX_SAVED_BYTES = Counter(
    "pdserve_prefix_cache_saved_handoff_bytes_total",
    "KV bytes of the prefix-cache hits: what a handoff of those tokens would have moved",
    ["service"],
)


def record_prefix_lookup(
    service: str, prompt_tokens: int, hit_tokens: int, saved_handoff_bytes: int = 0
) -> None:
    PREFIX_LOOKUP_TOKENS.labels(service).inc(prompt_tokens)
    PREFIX_HIT_TOKENS.labels(service).inc(hit_tokens)
    if saved_handoff_bytes:
        PREFIX_SAVED_BYTES.labels(service).inc(saved_handoff_bytes)


HTTP_REQUESTS = Counter(
    "pdserve_http_requests_total",
    "Requests to the router's HTTP API, by endpoint (its route; 'other' for unknown paths) and "
    "HTTP status (499: the client left before the reply ended)",
    ["service", "endpoint", "status"],
)


def record_http(endpoint: str, status: int) -> None:
    HTTP_REQUESTS.labels("router", endpoint, str(status)).inc()
