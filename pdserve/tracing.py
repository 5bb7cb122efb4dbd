"""OpenTelemetry traces, one per request across router, prefill and decode; off by default.

With --otlp-endpoint (an OTLP/gRPC collector, host:port) a service exports its spans there;
without it nothing is imported and every call here returns at once, so tracing costs nothing
when it is off. The trace context travels in gRPC metadata as W3C `traceparent`.

  router   "pdserve.request" from receipt to the last token, and under it the phases of the time
           to first token laid end to end (routing, decode_room, prefill_call, prefill_queue,
           prefill_compute, transfer_after_compute, relay; services/router/phases.py), then
           "streaming"
  prefill  "pdserve.prefill": its Prefill call
  decode   "pdserve.decode": its Decode call, from the reservation to the last token

The router's phase spans are placed from the durations each service measured (its phases), on
the router's clock: they tile the time to first token exactly, as the response's phases do.
"""

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

log = logging.getLogger(__name__)

_tracer = None  # an opentelemetry Tracer once configure() was given an endpoint
_provider = None  # its TracerProvider, flushed by shutdown()
_propagator = None
# perf_counter() -> the epoch nanoseconds spans are stamped with.
_EPOCH_NS = time.time_ns() - time.perf_counter_ns()


def configure(endpoint: str, service: str) -> None:
    """Exports this process's spans to the OTLP/gRPC collector at `endpoint` ("" for none)."""
    global _tracer, _provider, _propagator
    if not endpoint:
        return
    # Imported here so that a service without --otlp-endpoint never loads them.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint, insecure=True)))
    _provider, _propagator = provider, TraceContextTextMapPropagator()
    _tracer = provider.get_tracer("pdserve")
    log.info("tracing: exporting spans to %s (OTLP/gRPC)", endpoint)


def shutdown() -> None:
    """Flushes the spans not yet exported (at the end of a service)."""
    if _provider is not None:
        _provider.shutdown()


def _ns(perf: float) -> int:
    return _EPOCH_NS + int(perf * 1e9)


class RequestTrace:
    """The router's trace of one request: its root span, open until the request ends."""

    def __init__(self, request_id: str, received: float) -> None:
        assert _tracer is not None
        self._root = _tracer.start_span(
            "pdserve.request", start_time=_ns(received), attributes={"request_id": request_id}
        )
        from opentelemetry import trace

        self._context = trace.set_span_in_context(self._root)

    def metadata(self) -> list[tuple[str, str]]:
        """gRPC metadata that carries this trace to a prefill or decode call."""
        carrier: dict[str, str] = {}
        assert _propagator is not None
        _propagator.inject(carrier, context=self._context)
        return list(carrier.items())

    def phases(self, start: float, items: Sequence[tuple[str, float]]) -> None:
        """Child spans laid end to end from `start` (perf_counter), one per (name, seconds)."""
        assert _tracer is not None
        at = start
        for name, seconds in items:
            span = _tracer.start_span(name, context=self._context, start_time=_ns(at))
            at += seconds
            span.end(end_time=_ns(at))

    def end(self, ended: float, **attributes) -> None:
        self._root.set_attributes(attributes)
        self._root.end(end_time=_ns(ended))


def request_trace(request_id: str, received: float) -> RequestTrace | None:
    """A trace for one router request, or None when tracing is off."""
    return RequestTrace(request_id, received) if _tracer is not None else None


def outgoing(trace: RequestTrace | None) -> list[tuple[str, str]] | None:
    """The metadata for a call made on behalf of `trace` (None: no metadata)."""
    return trace.metadata() if trace is not None else None


@contextlib.contextmanager
def server_span(name: str, metadata, **attributes) -> Iterator[None]:
    """A span around a call this service serves, under the caller's trace if it sent one."""
    if _tracer is None:
        yield
        return
    assert _propagator is not None
    parent = _propagator.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})
    # Not made the current span: a streaming handler yields inside it, and the current span
    # lives in a context variable that must not be left set across those yields.
    span = _tracer.start_span(name, context=parent, attributes=attributes)
    try:
        yield
    finally:
        span.end()
