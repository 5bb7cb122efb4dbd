"""Starting and stopping a grpc.aio server the same way in every service."""

import asyncio
import logging
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

# Bounds every message: KV chunks are at most ~1 MiB, requests far smaller.
MAX_MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class Server:
    """A grpc.aio server with the standard health service; `set_serving` flips its status."""

    def __init__(self, host: str, port: int) -> None:
        self.grpc = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        result = self.health.set("", status)
        if asyncio.iscoroutine(result):
            await result


async def run_until_signalled(server: Server, name: str, grace: float,
                              on_stop: Callable[[], Awaitable[None]] | None = None,
                              serving_at_start: bool = True) -> None:
    """Serves until SIGTERM or SIGINT, then stops admitting and lets in-flight calls finish."""
    await server.grpc.start()
    if serving_at_start:
        await server.set_serving(True)
    log.info("%s serving on port %d", name, server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s stopping: draining for up to %.1f s", name, grace)
    await server.set_serving(False)
    await server.grpc.stop(grace)
    if on_stop is not None:
        await on_stop()
    log.info("%s stopped", name)
