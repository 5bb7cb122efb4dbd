"""How the router's failures are told apart: final ones, and those worth a try elsewhere."""

import grpc

# A backend failing with these is worth another try elsewhere; the others are final.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS,
}


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class HandoffFailed(RouterError):
    """A backend failed in a way another instance might not; `instances` are to be avoided."""

    def __init__(self, message: str, instances: set[str]) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.instances = instances


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


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for a RouterError's code."""
    return HTTP_STATUS.get(code, (500, "internal_error"))
