"""One table from domain exceptions to gRPC status codes, and from those to HTTP statuses.

Servicers raise; they do not choose status codes case by case. ErrorInterceptor, installed on
every server, turns an exception found in the table (or a ServiceError, which names its own code)
into that status with the exception's message, and counts it. Anything else is a bug, and gRPC
answers it UNKNOWN as before.

The interceptor also reads every request with a deserializer that cannot raise: bytes that are
not the method's message get INVALID_ARGUMENT and one log line per interval, rather than
grpc's UNKNOWN and a traceback per request, which let a client fill the log with 10-byte calls.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve import metrics
from pdserve.core.block_pool import NeverFits, PoolExhausted
from pdserve.core.request import InvalidRequest
from pdserve.models.loading import ModelMismatch

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A refusal that names its own status: limits, draining, a failed backend."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# The status of each domain exception, looked up along its class hierarchy (so NeverFits finds
# its own entry before PoolExhausted's). A function computes it from the exception itself.
# KV refusals are not here: each KV transport answers them in its own protocol, with the codes
# pdserve.kv.receiver.status_name gives, because the data plane has no gRPC status to raise.
STATUS_BY_EXCEPTION: dict[type, grpc.StatusCode | Callable[[Any], grpc.StatusCode]] = {
    ServiceError: lambda exc: exc.code,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    NeverFits: grpc.StatusCode.OUT_OF_RANGE,  # waiting will not help
    PoolExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# The HTTP front's status for each final gRPC code, and the OpenAI error type that goes with it.
# Codes missing here are the router's own failures: 500.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    # Another model behind the router, no backend up, or this router draining: come back later.
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.ABORTED: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The table's status for `exc`, or None when it is not a domain exception."""
    for cls in type(exc).__mro__:
        entry = STATUS_BY_EXCEPTION.get(cls)
        if entry is not None:
            return entry if isinstance(entry, grpc.StatusCode) else entry(exc)
    return None


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for a final gRPC code."""
    return HTTP_STATUS.get(code, (500, "internal_error"))


class RateLimitedLog:
    """Logs a kind of event at most once per `interval` seconds, with the count it held back."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._held_back = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} more like it in the last {self.interval:.0f} s)"
        self._last, self._held_back = now, 0
        log.warning(message, *args)


UNDECODABLE_LOG = RateLimitedLog(interval=10.0)


@dataclass(frozen=True)
class Undecodable:
    """What the safe deserializer hands the handler in place of a message it could not read."""

    message_type: str
    problem: str


def safe_deserializer(deserialize: Callable | None) -> Callable | None:
    if deserialize is None:
        return None
    message_type = getattr(getattr(deserialize, "__self__", None), "__name__", "request")

    def read(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf's DecodeError, whose module path differs by backend
            return Undecodable(message_type, str(exc)[:200] or type(exc).__name__)

    return read


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers the table's exceptions with their status, and undecodable requests with
    INVALID_ARGUMENT, for every method of the server. Each such failure is counted in
    pdserve_requests_total under `service`, unless `service` is None: the router counts its
    requests itself, since its HTTP front does not pass through here."""

    def __init__(self, service: str | None) -> None:
        self.service = service

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        return _wrapped(handler, details.method, self.service)


def _wrapped(handler, method: str, service: str | None):
    async def answer(exc: BaseException, context) -> None:
        code = status_of(exc)
        if code is None:
            raise exc
        if service is not None:
            metrics.record_request(service, code.name)
        await context.abort(code, str(exc))

    def checked(request):
        if isinstance(request, Undecodable):
            UNDECODABLE_LOG.warning(
                "%s: refused a request that is not a valid %s: %s",
                method,
                request.message_type,
                request.problem,
            )
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request is not a valid {request.message_type}: {request.problem}",
            )
        return request

    async def checked_stream(requests):
        async for request in requests:
            yield checked(request)

    def wrap(behavior: Callable, streaming_request: bool, streaming_response: bool):
        if streaming_response:

            async def stream(request, context):
                try:
                    request = checked_stream(request) if streaming_request else checked(request)
                    async for item in behavior(request, context):
                        yield item
                except Exception as exc:
                    await answer(exc, context)

            return stream

        async def unary(request, context):
            try:
                request = checked_stream(request) if streaming_request else checked(request)
                return await behavior(request, context)
            except Exception as exc:
                await answer(exc, context)

        return unary

    kinds = [
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, False, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, True, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True, True),
    ]
    for attribute, make, streaming_request, streaming_response in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make(
                wrap(behavior, streaming_request, streaming_response),
                request_deserializer=safe_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
    return handler
