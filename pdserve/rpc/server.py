"""Starting and stopping a grpc.aio server the same way in every service."""

import asyncio
import contextlib
import functools
import logging
import signal
import socket
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.rpc.errors import ErrorInterceptor, ServiceError
from pdserve.rpc.start_up_heap import freeze_start_up_heap
from pdserve.rpc.tls import RoleInterceptor, Tls, check_plaintext_allowed, target_name_option

log = logging.getLogger(__name__)

# Bounds every message: KV chunks are at most ~1 MiB, requests far smaller.
MAX_MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect to a restarted instance within a second, not grpc's default of up to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# Connections that no caller uses are closed, and clients may not ping more often than every
# 10 s without calls: neither idle sockets nor ping floods can pile up on a server.
SERVER_ONLY_OPTIONS = [
    # gRPC sets SO_REUSEPORT by default, so a second server on a port already served binds it
    # too, silently, and the kernel then splits connections between the two (grpc/grpc#16005,
    # #10755): a service started on a taken port must fail, naming the port.
    ("grpc.so_reuseport", 0),
    ("grpc.max_connection_idle_ms", 5 * 60 * 1000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10 * 1000),
    ("grpc.http2.max_ping_strikes", 2),
]

# Calls already running on a connection past its age get this long to finish: longer than the
# router's default request deadline (600 s), so no stream within it is cut. One that is cut
# anyway ends UNAVAILABLE at the router, which retries or migrates it.
CONNECTION_AGE_GRACE_SECONDS = 900


def connection_age_options(max_age_seconds: float) -> list[tuple[str, int]]:
    """gRPC options that make clients reconnect after `max_age_seconds` (0: never), so that no
    connection, and no credentials checked when it was made, lives forever."""
    if max_age_seconds <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", int(max_age_seconds * 1000)),
        ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_SECONDS * 1000),
    ]


class Admission:
    """Counts requests in flight, and refuses new ones once draining has begun."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self):
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, "this instance is draining and takes no new requests"
            )

    async def drain(self, grace: float) -> bool:
        """Stops admitting and waits up to `grace` seconds for what is in flight; True if idle."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return True
        except asyncio.TimeoutError:
            return False


def instance_name(role: str, host: str, port: int) -> str:
    """role@host:port, naming the machine (a container's hostname) when bound to every address,
    so that replicas behind one service name tell themselves apart."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{role}@{host}:{port}"


class Server:
    """A grpc.aio server with the standard health service; `set_serving` flips its status.

    With `tls`, it listens with TLS; `internal` servers (prefill, decode) also demand a client
    certificate and check each internal method's caller role. Without, plaintext, which only
    loopback or --insecure allows."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: Tls | None,
        internal: bool,
        service: str | None,
        insecure: bool = False,
        max_concurrent_rpcs: int | None = None,
        max_connection_age: float = 0.0,
    ) -> None:
        # The role check runs first (outermost), so a peer without the role learns nothing more.
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor(service)]
        if tls and internal:
            interceptors.insert(0, RoleInterceptor())
        self.grpc = grpc.aio.server(
            options=CHANNEL_OPTIONS
            + SERVER_ONLY_OPTIONS
            + connection_age_options(max_connection_age),
            interceptors=interceptors,
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self.health = (
            health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        address = f"{host}:{port}"
        if tls is None:
            check_plaintext_allowed(host, insecure, f"gRPC port {address}")
        try:
            if tls is None:
                self.port = self.grpc.add_insecure_port(address)
            else:
                creds = tls.server_credentials(require_client_auth=internal)
                self.port = self.grpc.add_secure_port(address, creds)
        except RuntimeError:  # grpc's "Failed to bind": the port is taken (or not this host's)
            self.port = 0
        if self.port == 0:
            raise OSError(
                f"cannot listen on {address}: the port is in use (another process listens "
                "there) or the address is not this host's"
            )

    @classmethod
    def for_settings(cls, common, internal: bool, service: str | None) -> "Server":
        """`service` labels the failures the error table answers; None where the servicer
        counts its own (pdserve.rpc.errors.ErrorInterceptor)."""
        tls = Tls.load(common.tls_cert, common.tls_key, common.tls_ca)
        return cls(
            common.host,
            common.port,
            tls,
            internal,
            service,
            common.insecure,
            common.max_concurrent_rpcs,
            common.max_connection_age_seconds,
        )

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        result = self.health.set("", status)
        if asyncio.iscoroutine(result):
            await result


def channel_to(address: str, tls: Tls | None, role: str) -> grpc.aio.Channel:
    """A channel to an instance of `role`: mutual TLS when this service has certificates (the
    peer verified as `role`), plaintext when it has none."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + target_name_option(role)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def emission_queue() -> tuple[asyncio.Queue, Callable[[object], None]]:
    """A queue on the running event loop, and a sink that any thread (an engine) may feed."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def sink(item: object) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    return queue, sink


def admitted(handler):
    """A server-streaming handler of a servicer with an `admission`: refused while draining,
    counted as in flight while it runs."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        self.admission.refuse_if_draining()
        with self.admission.track():
            async for message in handler(self, request, context):
                yield message

    return wrapper


async def run_until_signalled(
    server: Server,
    name: str,
    grace: float,
    admission: Admission,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    serving_at_start: bool = True,
) -> None:
    """Serves until SIGTERM or SIGINT, then stops admitting and lets in-flight calls finish."""
    await server.grpc.start()
    freeze_start_up_heap(name)  # before health says SERVING: the collection stops the process
    if serving_at_start:
        await server.set_serving(True)
    log.info("%s serving on port %d", name, server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info(
        "%s draining: %d request(s) in flight, waiting up to %.1f s",
        name,
        admission.in_flight,
        grace,
    )
    await server.set_serving(False)
    if not await admission.drain(grace):
        log.warning(
            "%s: %d request(s) still in flight after %.1f s; cancelling them",
            name,
            admission.in_flight,
            grace,
        )
    await server.grpc.stop(1.0)
    if on_stop is not None:
        await on_stop()
    log.info("%s stopped", name)
