"""Clients as an internal service tells them apart: the caller, with the client it names.

The router names its clients in PrefillRequest.client and DecodeRequest.client ("key #2", or an
address); prefill takes turns by that name and decode shares its batch by it. Keyed together with
the caller, a direct caller cannot pass for one of the router's clients: it is another caller.
"""

import grpc

from pdserve.rpc.errors import ServiceError

MAX_CLIENT_NAME_BYTES = 256


def named_client(caller: str, name: str) -> str:
    """`caller` (an address or a certificate's identity) with the client it names; a name over
    MAX_CLIENT_NAME_BYTES is refused with INVALID_ARGUMENT."""
    if len(name.encode()) > MAX_CLIENT_NAME_BYTES:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"client is longer than {MAX_CLIENT_NAME_BYTES} bytes",
        )
    return f"{caller} {name}"
