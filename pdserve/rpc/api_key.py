"""The API key that pdserve's own clients (generate, chat, health, bench) send to a router.

They read PDSERVE_API_KEY, the variable the router reads its keys from, and send its first key
as the metadata `authorization: Bearer <key>`, so one shell serves both sides.
"""

import collections
import os

import grpc


def api_key_metadata() -> tuple[tuple[str, str], ...]:
    key = os.environ.get("PDSERVE_API_KEY", "").split(",")[0].strip()
    return (("authorization", f"Bearer {key}"),) if key else ()


def _with_key(metadata) -> list[tuple[str, str]]:
    return [*(metadata or ()), *api_key_metadata()]


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class ApiKeyInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the key to every call of a blocking channel."""

    def _details(self, d):
        return _Details(
            d.method,
            d.timeout,
            _with_key(d.metadata),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def _aio_details(d) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        d.method, d.timeout, _with_key(d.metadata), d.credentials, d.wait_for_ready
    )


# grpc.aio files an interceptor under the first kind of call it implements only, so each kind
# needs an object of its own.
class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details), request)


def aio_api_key_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What adds the key to every call of an asyncio channel; none without a key."""
    return [_AioUnaryUnary(), _AioUnaryStream()] if api_key_metadata() else []
