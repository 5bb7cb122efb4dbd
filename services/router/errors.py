"""How the router's failures are told apart: final ones, and those worth a try elsewhere."""

import re

import grpc

from pdserve.rpc.errors import ServiceError

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


class RouterError(ServiceError):
    """A request's final failure, with the status the client gets (pdserve.rpc.errors)."""


class HandoffFailed(RouterError):
    """A backend failed in a way another instance might not; `instances` are to be avoided."""

    def __init__(self, message: str, instances: set[str]) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.instances = instances


# Where an internal instance lives is for the router's log, not for the public client: IPv6 in
# brackets, IPv4, host:port (DNS names too) and unix: paths.
_INTERNAL_ADDRESS = re.compile(
    r"\[[0-9A-Fa-f:.]+\](?::\d+)?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"
    r"|\b[A-Za-z0-9][A-Za-z0-9.-]*:\d{2,5}\b"
    r"|\bunix:\S+"
)


def public_message(message: str) -> str:
    """The message with every internal address replaced, for the client to see."""
    return _INTERNAL_ADDRESS.sub("(internal address)", message)
