"""The prefill or decode instances a router can use, found by address and kept health-checked.

A target "host:port" whose host resolves to several addresses (a scaled compose service) yields
one instance per address; targets are re-resolved on every refresh, so replicas that appear or
vanish are picked up. An instance that serves another model than the router's is never used: its
KV would decode into fluent garbage.
"""

import asyncio
import logging
from dataclasses import dataclass
from typing import AbstractSet, Callable, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import metrics
from pdserve.rpc import model_info
from pdserve.rpc.discovery import resolve
from pdserve.rpc.server import channel_to
from pdserve.rpc.tls import Tls
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.policy import RoundRobin, Routed, RoutingPolicy
from pdserve.services.router.errors import RouterError

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_SECONDS = 1.0


# The generated gRPC stub an instance is called through (PrefillServiceStub or DecodeServiceStub).
StubT = TypeVar("StubT")


@dataclass
class Instance(Generic[StubT]):
    address: str
    channel: grpc.aio.Channel
    stub: StubT
    healthy: bool = False
    model_fingerprint: str = ""  # as the instance reported it, once asked
    mismatch: str = ""  # why the instance may not be used, when its model differs
    # Load, for the routing policy: decode's pool as last reported, and prefill's prompt tokens
    # that this router has sent and not yet seen answered.
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    queued_tokens: int = 0
    streams: int = 0  # decode: requests this router holds a reservation there for, now
    block_size: int = 0  # decode's KV block size, as last reported
    prefix_cache: bool = False  # decode keeps a prefix cache, as last reported


class BackendSet(Generic[StubT]):
    def __init__(
        self,
        role: str,
        targets: list[str],
        make_stub: Callable[[grpc.aio.Channel], StubT],
        model_fingerprint: str,
        model_identity: str,
        tls: Tls | None = None,
        policy: RoutingPolicy | None = None,
    ):
        self.role, self.targets, self._make_stub = role, targets, make_stub
        self._tls = tls
        self.model_fingerprint, self._model_identity = model_fingerprint, model_identity
        self.instances: dict[str, Instance[StubT]] = {}
        self._policy = policy or RoundRobin()

    def ordered(
        self, avoid: AbstractSet[str] = frozenset(), request: Routed | None = None
    ) -> list[Instance[StubT]]:
        """Healthy instances, rotated so that load spreads round-robin; those in `avoid` (which
        just failed this request) last. Unhealthy ones only when no instance is healthy. Raises
        RouterError when every instance serves another model."""
        same_model = [i for i in self.instances.values() if not i.mismatch]
        if not same_model and self.instances:
            mismatch = next(iter(self.instances.values())).mismatch
            raise RouterError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no {self.role} instance serves this router's model: {mismatch}",
            )
        pool = [i for i in same_model if i.healthy] or same_model
        return self._policy.order(pool, request, avoid)

    def load(self, waiting: int) -> metrics.Load:
        """Decode's load as this router sees it, for endpoint pickers that choose among routers:
        `waiting` requests, those holding a reservation here running, and the pools of the
        healthy instances as last reported (refreshed every second). The pools are summed in
        blocks: decode instances share one block size, which the prefix index assumes too."""
        pools = [i for i in self.instances.values() if i.healthy and i.total_blocks]
        return metrics.Load(
            waiting=waiting,
            running=sum(i.streams for i in self.instances.values()),
            used_blocks=sum(i.total_blocks - i.free_blocks for i in pools),
            total_blocks=sum(i.total_blocks for i in pools),
            block_size=min((i.block_size for i in pools), default=0),
        )

    @property
    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances.values())

    def mark_down(self, instance: Instance[StubT]) -> None:
        if instance.healthy:
            log.warning("%s instance %s is down", self.role, instance.address)
        instance.healthy = False

    async def refresh(self) -> None:
        """Re-resolves the targets and health-checks every instance."""
        addresses = set()
        for target in self.targets:
            addresses.update(await resolve(target))
        for gone in set(self.instances) - addresses:
            log.info("%s instance %s removed", self.role, gone)
            await self.instances.pop(gone).channel.close()
        for address in addresses - set(self.instances):
            channel = channel_to(address, self._tls, self.role)
            self.instances[address] = Instance(address, channel, self._make_stub(channel))
        await asyncio.gather(*(self._check(i) for i in list(self.instances.values())))

    async def _check(self, instance: Instance[StubT]) -> None:
        stub = health_pb2_grpc.HealthStub(instance.channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_SECONDS
            )
            healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            healthy = False
        if healthy and not instance.model_fingerprint:
            await self._check_model(instance)
        healthy = healthy and bool(instance.model_fingerprint) and not instance.mismatch
        if healthy and self.role == "decode":
            await self._read_pool(instance)
        if healthy != instance.healthy:
            log.info(
                "%s instance %s is %s", self.role, instance.address, "up" if healthy else "down"
            )
        instance.healthy = healthy

    async def _read_pool(self, instance: Instance[StubT]) -> None:
        """Decode's pool occupancy, for the routing policy; the last figures stay on failure."""
        try:
            stats = await pb_grpc.DecodeServiceStub(instance.channel).GetPoolStats(
                pb.GetPoolStatsRequest(), timeout=HEALTH_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError:
            return
        instance.free_blocks, instance.running = stats.free_blocks, stats.running
        instance.total_blocks = stats.total_blocks
        instance.block_size, instance.prefix_cache = stats.block_size, stats.prefix_cache

    async def _check_model(self, instance: Instance[StubT]) -> None:
        """Asks once which model the instance serves; a different one is never used."""
        try:
            info = await model_info.fetch(instance.channel, HEALTH_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "%s instance %s did not say which model it serves: %s",
                self.role,
                instance.address,
                exc.code().name,
            )
            return
        instance.model_fingerprint = info.fingerprint
        if info.fingerprint != self.model_fingerprint:
            instance.mismatch = (
                f"{self.role} {instance.address} serves {info.name} "
                f"({info.architecture}, {info.dtype}, fingerprint "
                f"{info.fingerprint}), the router {self._model_identity}"
            )
            log.error("refusing %s: it serves another model", instance.mismatch)

    async def close(self) -> None:
        for instance in self.instances.values():
            await instance.channel.close()
