"""The decode service: leases, the KV they receive (over gRPC or the data plane), the tokens.

All lease bookkeeping happens on the event loop thread; the engine thread only decodes.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from pdserve import metrics, tracing
from pdserve.core.block_pool import BlockTable
from pdserve.core.picked import Pick
from pdserve.engine.chunked_prefill import Handle
from pdserve.core.request import GenerateSpec, validate
from pdserve.engine.completions import CompletionTally
from pdserve.kv.data_endpoints import data_endpoints_handler
from pdserve.kv.grpc_transport import IngestLimits, push_kv_handler
from pdserve.kv.leases import Lease, LeaseLimits, LeaseState, LeaseTable
from pdserve.kv.receiver import KvReceiver
from pdserve.kv.tcp_transport import DataPlaneLimits, DataPlaneServer
from pdserve.models.loading import ServedModel, check_same_model
from pdserve.rpc import convert, model_info
from pdserve.rpc.client_names import named_client
from pdserve.rpc.errors import ServiceError
from pdserve.rpc.server import (
    Admission,
    Server,
    admitted,
    emission_queue,
    instance_name,
    run_until_signalled,
)
from pdserve.rpc.tls import Tls, check_plaintext_allowed, peer_identity
from pdserve.settings import DecodeSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.decode.engine import DecodeEngine

log = logging.getLogger(__name__)

EXPIRY_CHECK_SECONDS = 0.1


class DecodeServicer:
    def __init__(self, served: ServedModel, settings: DecodeSettings, instance: str) -> None:
        self.served, self.config = served, served.config
        self.settings, self.instance = settings, instance
        self.engine = DecodeEngine(served, settings)
        self.leases = LeaseTable(self.engine.pool, self.config)
        self.receiver = KvReceiver(
            self.leases,
            self.engine.cache.write,
            self.config,
            served.fingerprint,
            self._committed,
            settings.common.faults,
        )
        self.admission = Admission()
        self.data_endpoints: list[pb.DataEndpoint] = []  # offered with every lease

    @admitted
    async def Decode(self, request: pb.DecodeRequest, context):
        metadata = context.invocation_metadata()
        with tracing.server_span("pdserve.decode", metadata, request_id=request.request_id):
            # Closed with this call, whichever way it ends, so that its blocks go back at once.
            responses = self._decode(request, peer_identity(context))
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response

    async def _decode(self, request: pb.DecodeRequest, caller: str):
        check_same_model(self.served, request.model_fingerprint, "the lease request")
        spec = validate(
            convert.spec_from_internal(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                request.cache_salt,
                named_client(caller, request.client),  # whose share of the batch it takes
            ),
            self.config,
        )
        if request.prefill_here:
            async for response in self._prefill_here(spec):
                yield response
            return
        events, sink = emission_queue()
        ttl = self.settings.lease_ttl_seconds
        if 0 < request.lease_ttl_seconds < ttl:  # a caller may shorten the lease, not lengthen it
            ttl = request.lease_ttl_seconds
        limits = LeaseLimits(
            ttl,
            self.settings.lease_first_chunk_seconds,
            self.settings.max_pending_lease_share,
            self.settings.max_pool_share_per_client,
        )
        # NeverFits, PoolExhausted: errors.py. The pending share is the caller's own, the pool
        # share the client's.
        lease = self.leases.grant(spec, limits, sink, caller)
        cached = self._looked_up(spec, lease.table)
        log.debug(
            "lease %s granted for request %s (%d blocks)",
            lease.lease_id,
            spec.request_id,
            lease.reserved_blocks,
        )
        try:
            yield pb.DecodeResponse(
                lease=pb.LeaseGranted(
                    lease_id=lease.lease_id,
                    blocks=lease.reserved_blocks,
                    instance=self.instance,
                    expires_at_unix=time.time() + ttl,
                    data_endpoints=self.data_endpoints,
                    cached_tokens=cached,
                )
            )
            async for event in self._events(lease, events):
                yield event
        finally:
            self._end(lease)

    def _looked_up(self, spec: GenerateSpec, table: BlockTable) -> int:
        """The prompt tokens a reservation found cached, counted where there is a cache."""
        if self.engine.pool.cache is not None:
            hit = table.cached_tokens
            metrics.record_prefix_lookup(
                "decode", spec.prompt_len, hit, hit * self.config.kv_bytes_per_token
            )
        return table.cached_tokens

    async def _prefill_here(self, spec: GenerateSpec):
        """The prompt is prefilled in this instance's own loop: room is reserved at once (the
        router's reservation line handles PoolExhausted as for a lease), the answer says so
        with a LeaseGranted that has no lease id, and the tokens follow."""
        events, sink = emission_queue()
        table = self.leases.reserve_local(spec, self.settings.max_pool_share_per_client)
        self._looked_up(spec, table)
        handle = Handle(spec, table, sink)
        try:
            yield pb.DecodeResponse(
                lease=pb.LeaseGranted(
                    blocks=self.engine.pool.blocks_wanted(spec),
                    instance=self.instance,
                    cached_tokens=table.cached_tokens,
                )
            )
            self.engine.prefill_here(handle)

            # The engine thread sets the sequence before its first emission (DecodeScheduler.start),
            # so it is there by the time an emission is read here.
            async for event in _events(events, spec):
                yield event
        finally:
            self.engine.abort_local(handle)

    async def _events(self, lease: Lease, events: asyncio.Queue):
        def handoff() -> tuple[float, int]:
            return lease.handoff_seconds, lease.assembly.bytes

        async for event in _events(events, lease.spec, handoff):
            yield event

    def _end(self, lease: Lease) -> None:
        """However the token stream ends, the lease's blocks go back."""
        if lease.state is LeaseState.COMMITTED and lease.sequence is not None:
            self.engine.abort(lease.sequence)
        else:
            self.leases.void(lease, "request ended before its KV was committed")
        self.leases.forget(lease)

    def _committed(self, lease: Lease, first: Pick) -> None:
        """The receiver accepted the lease's commit: the sequence starts decoding."""
        lease.table.prompt_written = True
        lease.sequence = self.engine.start_sequence(lease, first)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers DecodeService. PushKv reads its messages with pdserve.kv.frames rather than
        protobuf's parser (which would copy every payload twice), so the generated registration
        function, which would install protobuf's, is not used."""
        handlers = {
            "Decode": grpc.unary_stream_rpc_method_handler(
                self.Decode,
                request_deserializer=pb.DecodeRequest.FromString,
                response_serializer=pb.DecodeResponse.SerializeToString,
            ),
            "PushKv": push_kv_handler(self.receiver, self._ingest_limits()),
            # What prefill checks a lease's data endpoint against before dialling it.
            "GetDataEndpoints": data_endpoints_handler(lambda: self.data_endpoints, self.instance),
            "GetPoolStats": grpc.unary_unary_rpc_method_handler(
                self.GetPoolStats,
                request_deserializer=pb.GetPoolStatsRequest.FromString,
                response_serializer=pb.GetPoolStatsResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("pdserve.v1.DecodeService", handlers),)
        )

    def _ingest_limits(self) -> IngestLimits:
        """A stream lasts at most as long as a lease may wait for its commit."""
        s = self.settings
        return IngestLimits(s.kv_stream_limit, s.kv_first_frame_seconds, s.lease_ttl_seconds)

    async def GetPoolStats(self, request, context) -> pb.GetPoolStatsResponse:
        return pb.GetPoolStatsResponse(
            total_blocks=self.engine.pool.num_blocks,
            free_blocks=self.engine.pool.available_blocks,
            block_size=self.engine.pool.block_size,
            running=self.engine.scheduler.size,
            pending_leases=self.leases.pending,
            instance=self.instance,
            cached_blocks=self.engine.pool.cached_blocks,
            prefix_cache=self.engine.pool.cache is not None,
        )

    async def expire_leases_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_SECONDS)
            expired = self.leases.expire()
            if expired:
                log.warning("%d lease(s) expired uncommitted; their blocks are free again", expired)


async def _events(
    events: asyncio.Queue,
    spec: GenerateSpec,
    handoff: Callable[[], tuple[float, int]] = lambda: (0.0, 0),
):
    """A request's DecodeResponses from its emissions: one DecodeFinished per completion, the
    stream ending after the last. `handoff` gives (receive seconds, bytes) of the KV that came
    in; (0, 0) when decode prefilled it."""
    arrivals: list[float] = []  # of the first two emissions: the first token, then decode's own
    tally = CompletionTally(spec.sampling.n)
    while not tally.done:
        emission = await events.get()
        if emission.error is not None:
            raise ServiceError(grpc.StatusCode.ABORTED, emission.error)
        if len(arrivals) < 2:
            arrivals.append(time.perf_counter())
        tally.add(emission)
        tokens = convert.token_event(emission)
        if emission.finish_reason is None:
            yield pb.DecodeResponse(tokens=tokens)
            continue
        seconds, received = handoff()
        if tally.done:
            metrics.REQUESTS.labels("decode", "ok", "OK").inc()
        yield pb.DecodeResponse(
            finished=pb.DecodeFinished(
                last=tokens,
                finish_reason=convert.FINISH_TO_PB[emission.finish_reason],
                usage=pb.Usage(
                    prompt_tokens=spec.prompt_len,
                    completion_tokens=tally.generated[emission.index],
                ),
                handoff_receive_seconds=seconds,
                handoff_bytes=received,
                first_decode_step_seconds=arrivals[1] - arrivals[0] if len(arrivals) == 2 else 0,
                index=emission.index,
            )
        )


async def serve(served: ServedModel, settings: DecodeSettings) -> None:
    server = Server.for_settings(settings.common, internal=True, service="decode")
    instance = settings.common.instance or instance_name(
        "decode", settings.common.host, server.port
    )
    servicer = DecodeServicer(served, settings, instance)
    metrics.start(settings.common.metrics_port, settings.common.host)
    metrics.watch_pool(
        "decode",
        lambda: servicer.engine.pool.available_blocks,
        settings.num_blocks,
        lambda: servicer.engine.scheduler.size,
    )
    pool = servicer.engine.pool  # waiting: reservations whose KV is not yet committed
    metrics.watch_load(
        "decode",
        lambda: metrics.Load.of_pool(servicer.leases.pending, servicer.engine.scheduler.size, pool),
    )
    servicer.add_to_server(server.grpc)
    model_info.add_to_server(served, server.grpc)
    data_plane = await _start_data_plane(servicer, settings)
    servicer.engine.start()
    expiry = asyncio.create_task(servicer.expire_leases_forever())

    async def on_stop() -> None:
        expiry.cancel()
        if data_plane is not None:
            await data_plane.stop()
        servicer.engine.stop()

    await run_until_signalled(
        server, instance, settings.common.grace_seconds, servicer.admission, on_stop
    )


async def _start_data_plane(
    servicer: DecodeServicer, settings: DecodeSettings
) -> DataPlaneServer | None:
    """The TCP data plane, offered with every lease; None when --kv-data-port is -1."""
    if settings.kv_data_port < 0:
        log.info("KV data plane off: KV arrives over DecodeService.PushKv only")
        return None
    # A connection lives at most as long as a lease may wait for its commit.
    limits = DataPlaneLimits(
        stream_seconds=settings.lease_ttl_seconds,
        max_connections=settings.max_kv_connections,
        max_per_peer=settings.max_kv_connections_per_peer,
    )
    plane = DataPlaneServer(servicer.receiver, limits)
    common = settings.common
    tls = Tls.load(common.tls_cert, common.tls_key, common.tls_ca)
    if tls is None:
        check_plaintext_allowed(common.host, common.insecure, "KV data plane")
    ssl_context = tls.server_context() if tls else None
    port = await plane.start(common.host, settings.kv_data_port, ssl_context)
    servicer.data_endpoints = [pb.DataEndpoint(transport="tcp", port=port)]
    log.info("KV data plane (tcp) listening on %s:%d", settings.common.host, port)
    return plane
