"""Every Prometheus metric pdserve exports, with its help text. One process, one service label.

Names are in base units (seconds, bytes). Each service records what it sees: the router the
client's latencies, prefill the send side of the handoff, decode the receive side and the pool.
"""

import asyncio
import concurrent.futures
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

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
    "Requests waiting (router: for decode room or a prefill call; prefill: for a batch)",
    ["service"],
)
PREFILL_QUEUED_TOKENS = Gauge(
    "pdserve_prefill_queued_prompt_tokens",
    "Prompt tokens waiting for a prefill batch: what prefill autoscaling reads (a queue's tokens "
    "drain at the measured prefill tokens/s)",
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
    "A request's time to first token in phases (routing, decode_room, prefill_call, "
    "prefill_queue, prefill_compute, transfer_after_compute, relay), and first_decode_step "
    "after it; see "
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


# --- The model-server protocol of the Gateway API Inference Extension ---
# Its endpoint pickers scrape these names by default (the EPP's --total-queued-requests-metric,
# --total-running-requests-metric, --kv-cache-usage-percentage-metric and --cache-info-metric
# flags); the semantics are in its docs/proposals/003-model-server-protocol. The table of what
# each one counts on router and decode is in README.md ("Metrics").
PROTOCOL_WAITING = "vllm:num_requests_waiting"
PROTOCOL_RUNNING = "vllm:num_requests_running"
PROTOCOL_KV_USAGE = "vllm:kv_cache_usage_perc"
PROTOCOL_CACHE_INFO = "vllm:cache_config_info"
# A scrape that finds the event loop this busy reports nothing for the service rather than hang:
# an endpoint picker treats the endpoint's figures as stale, which they would be.
LOAD_READ_SECONDS = 1.0


class _Pool(Protocol):
    @property
    def num_blocks(self) -> int: ...
    @property
    def available_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True)
class Load:
    """A service's load as an endpoint picker reads it: requests waiting and running, and the
    KV pool behind it in blocks (used counts reserved and in use; idle prefix-cache blocks, which
    a reservation evicts as it needs room, count as free, as in GetPoolStats and in vLLM)."""

    waiting: int
    running: int
    used_blocks: int
    total_blocks: int  # 0: no pool known yet (a router before its first decode report)
    block_size: int

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @classmethod
    def of_pool(cls, waiting: int, running: int, pool: _Pool) -> "Load":
        used = pool.num_blocks - pool.available_blocks
        return cls(waiting, running, used, pool.num_blocks, pool.block_size)


class _ProtocolCollector:
    """Builds the protocol metrics at scrape time from each watched service's Load, so they are
    never stale. One collector per process: a second registration of the names would fail."""

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], Load]] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily(
            PROTOCOL_WAITING,
            "Requests waiting: router, admitted and waiting for decode room; decode, "
            "reservations whose KV is not yet committed (pdserve_queue_depth on the router)",
            labels=["service"],
        )
        running = GaugeMetricFamily(
            PROTOCOL_RUNNING,
            "Requests running: router, those holding a decode reservation; decode, sequences "
            "being decoded (pdserve_running_sequences)",
            labels=["service"],
        )
        usage = GaugeMetricFamily(
            PROTOCOL_KV_USAGE,
            "KV-cache utilisation in [0, 1]: used blocks / total blocks of decode's pool (on the "
            "router, of every healthy decode instance it sees, as last reported)",
            labels=["service"],
        )
        info = GaugeMetricFamily(
            PROTOCOL_CACHE_INFO,
            "The KV pool's configuration, in labels: block_size (tokens per block) and "
            "num_gpu_blocks (blocks in the pool; on the router, summed over its decodes)",
            labels=["service", "block_size", "num_gpu_blocks"],
        )
        for service, read in list(self.sources.items()):
            load = _read_or_none(service, read)
            if load is None:
                continue
            waiting.add_metric([service], load.waiting)
            running.add_metric([service], load.running)
            usage.add_metric([service], load.kv_usage)
            if load.total_blocks:  # no configuration to tell before a pool is known
                info.add_metric([service, str(load.block_size), str(load.total_blocks)], 1)
        yield from (waiting, running, usage, info)


def _read_or_none(service: str, read: Callable[[], Load]) -> Load | None:
    try:
        return read()
    except Exception as exc:  # a scrape must not fail for every metric because of these
        log.debug("no protocol metrics for %s this scrape: %r", service, exc)
        return None


_PROTOCOL = _ProtocolCollector()


def watch_load(service: str, read: Callable[[], Load]) -> None:
    """Serves the protocol metrics of `service` from `read`, called at scrape time on the event
    loop this is called from: the figures it reads (lease tables, instance lists) change on that
    loop, and are read there in one go, as GetPoolStats reads them."""
    loop = asyncio.get_running_loop()
    if not _PROTOCOL.sources:
        REGISTRY.register(_PROTOCOL)
    _PROTOCOL.sources[service] = lambda: _on_loop(loop, read)


def _on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], Load]) -> Load:
    """`read()` run on `loop`, from the scrape thread."""
    done: concurrent.futures.Future[Load] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(read())
        except Exception as exc:
            done.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return done.result(LOAD_READ_SECONDS)
