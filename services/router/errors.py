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
