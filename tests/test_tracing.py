"""OpenTelemetry traces: one per request across router, prefill and decode, received by a real
OTLP/gRPC collector that the test starts; nothing of OpenTelemetry is loaded when it is off."""

import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from procs import free_port, generate, greedy_request, start_stack, wait_until

TILING = ("routing", "decode_room", "prefill_call", "prefill_queue", "prefill_compute")
TILING += ("transfer_after_compute", "relay", "streaming")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, with the service.name of its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = {
                    a.key: a.value.string_value for a in resource_spans.resource.attributes
                }
                for scope in resource_spans.scope_spans:
                    self.spans += [(attributes.get("service.name", ""), s) for s in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(service, s) for service, s in self.spans if s.name == name]


@pytest.fixture
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    received = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield received, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_one_trace_per_request_across_the_services_whose_phases_tile_it(
    collector, tmp_path, monkeypatch
):
    received, endpoint = collector
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 0.1 s, not every 5 s
    flags = ("--otlp-endpoint", endpoint)
    stack = start_stack(str(tmp_path), decode_flags=flags, prefill_flags=flags, router_flags=flags)
    try:
        _, _, last = generate(stack.router_stub(), greedy_request(list(range(200)), 6))
        wait_until(stack.pools_settled, 10, "decode's pool to be whole again")
    finally:
        stack.stop()  # each service flushes its spans as it stops
    ((router_service, root),) = wait_until(
        lambda: received.named("pdserve.request"), 30, "the router's request span"
    )
    trace = root.trace_id
    prefill = [s for _, s in received.named("pdserve.prefill") if s.trace_id == trace]
    decode = [s for _, s in received.named("pdserve.decode") if s.trace_id == trace]
    assert router_service == "pdserve-router"
    assert len(prefill) == 1 and prefill[0].parent_span_id == root.span_id
    assert len(decode) == 1 and decode[0].parent_span_id == root.span_id
    phases = sorted(
        (
            s
            for _, s in received.spans
            if s.trace_id == trace and s.parent_span_id == root.span_id and s.name in TILING
        ),
        key=lambda s: (s.start_time_unix_nano, s.end_time_unix_nano),  # zero-length ones first
    )
    assert [s.name for s in phases] == list(TILING)
    assert phases[0].start_time_unix_nano == root.start_time_unix_nano
    for earlier, later in zip(phases, phases[1:]):  # laid end to end, to the nanosecond
        assert abs(later.start_time_unix_nano - earlier.end_time_unix_nano) <= 1
    first_token_ns = root.start_time_unix_nano + last.metrics.time_to_first_token_seconds * 1e9
    relay_end = phases[-2].end_time_unix_nano  # at the first token, to 10 µs (or after it,
    if last.metrics.phases.relay_seconds > 0:  # where prefill's parts overlapped its way back)
        assert abs(relay_end - first_token_ns) < 1e4
    else:
        assert relay_end >= first_token_ns - 1e4
    assert phases[-1].end_time_unix_nano <= root.end_time_unix_nano


def test_without_an_endpoint_opentelemetry_is_never_loaded():
    code = (
        "import sys\n"
        "import pdserve.tracing as t, pdserve.services.router.server\n"
        "t.configure('', 'router')\n"
        "assert t.request_trace('r', 0.0) is None and t.outgoing(None) is None\n"
        "with t.server_span('x', ()):\n"
        "    pass\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_bad_endpoint_stops_the_service_at_start(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "router", "--otlp-endpoint", "collector"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--otlp-endpoint (PDSERVE_OTLP_ENDPOINT): 'collector' is not host:port" in done.stderr
