"""The Prefill gRPC service: queue the prompt for a batch, push its KV to decode, reply."""

import asyncio
import logging
import math
import time
from typing import Callable

import grpc

from pdserve import metrics, tracing

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.prefill_prefix import PrefixCachedPrefill
from pdserve.engine.prefill_scheduler import PrefillJob, PrefillScheduler, PrefillTiming
from pdserve.engine.prompt_scoring import ScoreQueue
from pdserve.core.request import validate
from pdserve.kv.grpc_transport import GrpcKvSink
from pdserve.kv.receiver import Committed
from pdserve.kv.sink import KvSink, KvTarget, KvTransferFailed
from pdserve.kv.tcp_transport import TcpKvSink
from pdserve.models.loading import ServedModel, check_same_model
from pdserve.rpc import convert, model_info
from pdserve.rpc.client_names import named_client
from pdserve.rpc.errors import RateLimitedLog, ServiceError
from pdserve.rpc.server import (
    Admission,
    Server,
    channel_to,
    instance_name,
    run_until_signalled,
)
from pdserve.rpc.tls import Tls, peer_host
from pdserve.settings import PREFILL_BLOCK_TOKENS, PrefillSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.prefill.dial_policy import DialPolicy

log = logging.getLogger(__name__)
# A prompt that waited longer than this for its batch is logged (at most every 10 s): prefill is
# then the bottleneck, and its TTFT grows with every long prompt that arrives.
SLOW_QUEUE_SECONDS = 1.0
_slow_queue = RateLimitedLog(10.0)

# Decode addresses come from the router; a bound keeps a stream of new ones from piling up.
MAX_DECODE_CHANNELS = 64
# A data plane that does not accept a connection this fast is taken as absent (auto: gRPC).
DATA_PLANE_CONNECT_SECONDS = 2.0


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, served: ServedModel, settings: PrefillSettings, instance: str) -> None:
        self.served, self.config = served, served.config
        self.settings, self.instance = settings, instance
        self.prefix = (
            PrefixCachedPrefill(
                served.built, self.config, settings.prefix_cache_tokens, PREFILL_BLOCK_TOKENS
            )
            if settings.prefix_cache_tokens
            else None
        )
        self.scheduler = PrefillScheduler(
            served.built,
            settings.max_batch_size,
            settings.max_batch_tokens,
            served.tokenizer.eos_token_ids,
            self.prefix,
        )
        self.scores = ScoreQueue(served.built)  # echo's prompt logprobs, between batches
        self.loop = EngineLoop(
            "prefill-engine",
            self._step,
            lambda: self.scheduler.has_work or self.scores.pending,
            self._crashed,
        )
        self.steps = 0
        self.broken: str | None = None  # why the engine loop failed, once it has
        self.on_broken: Callable[[], None] = lambda: None
        self._decode_channels: dict[str, grpc.aio.Channel] = {}
        common = settings.common
        self.tls = Tls.load(common.tls_cert, common.tls_key, common.tls_ca)
        self.dial = DialPolicy(settings.decode_allow, self._channel)
        self.admission = Admission()

    def _step(self) -> None:
        self.scores.run_next()
        if not self.scheduler.has_jobs:  # only cancels wait: carry them out, no step to count
            self.scheduler.apply_cancels()
            return
        self.steps += 1
        self.settings.common.faults.before_prefill_step(self.steps)
        timing = self.scheduler.step()
        if timing is not None:
            metrics.PREFILL_BATCH.labels("prefill").observe(timing.batch_size)
            metrics.STEP_SECONDS.labels("prefill", "prefill").observe(timing.prefill_seconds)
            metrics.TOKENS.labels("prefill", "prompt").inc(timing.batch_tokens)

    def _crashed(self, message: str) -> None:
        """From the engine thread: the loop failed outside the model call, so its state is not to
        be trusted. Every job fails now, and the instance says NOT_SERVING so routers stop."""
        log.error("prefill engine failed: %s; failing its jobs and leaving service", message)
        self.broken = message
        self.scores.fail_all(message)
        self.scheduler.fail_all(message)
        self.on_broken()

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        client = named_client(peer_host(context.peer()), request.client)
        self._refuse_unless_serving(request)
        with self.admission.track():
            metadata = context.invocation_metadata()
            with tracing.server_span("pdserve.prefill", metadata, request_id=request.request_id):
                return await self._prefill(request, context, client)

    async def ScorePrompt(self, request: pb.ScorePromptRequest, context) -> pb.ScorePromptResponse:
        """The prompt's own logprobs, computed between batches. Under the same limits as
        Prefill calls: a score holds the engine for about one prefill of its prompt."""
        self._refuse_unless_serving(request)
        with self.admission.track():
            check_same_model(self.served, request.model_fingerprint, "the score request")
            spec = validate(
                convert.spec_from_internal(
                    request.request_id,
                    request.prompt_token_ids,
                    pb.SamplingParams(
                        max_tokens=1, logprobs=True, top_logprobs=request.top_logprobs
                    ),
                ),
                self.config,
            )
            try:
                scored = await self.scores.score(
                    spec.prompt_token_ids, spec.sampling.top_logprobs, self.loop.wake
                )
            except RuntimeError as exc:
                raise ServiceError(grpc.StatusCode.INTERNAL, str(exc)) from None
            return pb.ScorePromptResponse(
                logprobs=convert.prompt_logprobs_to_pb(spec.prompt_token_ids, scored)
            )

    def _refuse_unless_serving(self, request: pb.PrefillRequest | pb.ScorePromptRequest) -> None:
        """UNAVAILABLE once the engine failed or while draining; else the limits below."""
        if self.broken:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"this prefill instance's engine failed: {self.broken}"
            )
        self.admission.refuse_if_draining()
        self._refuse_beyond_limits(request)

    def _refuse_beyond_limits(self, request: pb.PrefillRequest | pb.ScorePromptRequest) -> None:
        """RESOURCE_EXHAUSTED, naming the limit, rather than a queue that grows without bound."""
        s = self.settings
        if self.admission.in_flight >= s.max_concurrent_prefills:
            why = (
                f"{self.admission.in_flight} Prefill calls in progress (--max-concurrent-prefills)"
            )
        elif self.scheduler.queued_tokens + len(request.prompt_token_ids) > (
            s.max_queued_prompt_tokens
        ):
            why = (
                f"{self.scheduler.queued_tokens} prompt tokens already wait for a batch "
                f"(--max-queued-prompt-tokens {s.max_queued_prompt_tokens})"
            )
        else:
            return
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill is full: {why}")

    async def _prefill(
        self, request: pb.PrefillRequest, context, client: str
    ) -> pb.PrefillResponse:
        check_same_model(self.served, request.model_fingerprint, "the prefill request")
        spec = validate(
            convert.spec_from_internal(
                request.request_id, request.prompt_token_ids, request.sampling, request.cache_salt
            ),
            self.config,
        )
        if not request.lease_id or not request.decode_address:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, "lease_id and decode_address are required"
            )
        if not 0 <= request.cached_tokens < spec.prompt_len:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cached_tokens {request.cached_tokens} outside [0, {spec.prompt_len})",
            )
        await self.dial.check_decode(request.decode_address)
        try:
            sink = await self._open_sink(request, spec, await self._data_plane(request))
        except KvTransferFailed as exc:
            raise _push_failed(request, exc, "tcp") from None
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        job = PrefillJob(
            spec,
            sink.on_layer_kv,
            on_done=lambda t, timing: _resolve(loop, done, (t, timing)),
            on_error=lambda msg: _resolve(loop, done, RuntimeError(msg)),
            send_from=request.cached_tokens,
            client=client,
        )
        # Never unbounded: a decode that stops reading must not hold this call (and its KV) forever.
        deadline = min(context.time_remaining() or math.inf, self.settings.push_timeout_seconds)
        push = asyncio.ensure_future(sink.send(deadline))
        self.scheduler.add(job)
        self.loop.wake()
        try:
            first, timing = await _first_of(done, push)
            sink.commit(first)
            committed = await push
        except KvTransferFailed as exc:
            raise _push_failed(request, exc, sink.transport) from None
        except RuntimeError as exc:
            raise ServiceError(grpc.StatusCode.INTERNAL, str(exc)) from None
        finally:
            self.scheduler.cancel(job)  # carried out by the engine thread
            self.loop.wake()
            push.cancel()
        return self._reply(spec.request_id, first.token, timing, sink, committed)

    async def _data_plane(self, request: pb.PrefillRequest) -> tuple[str, int] | None:
        """Where the lease's TCP data plane is, checked by the dial policy, when it is to be
        used; None for gRPC."""
        endpoint = next((e for e in request.data_endpoints if e.transport == "tcp"), None)
        if self.settings.kv_transport == "grpc" or endpoint is None:
            return None
        return await self.dial.data_plane(request.decode_address, endpoint)

    async def _open_sink(
        self, request: pb.PrefillRequest, spec, data_plane: tuple[str, int] | None
    ) -> KvSink:
        """The lease's TCP data plane at `data_plane` when decode offers one (and --kv-transport
        allows it), else DecodeService.PushKv. An unreachable data plane falls back to gRPC
        under auto."""
        target = KvTarget(
            request.lease_id,
            spec.request_id,
            spec.prompt_token_ids,
            self.config,
            self.served.fingerprint,
            self.settings.chunk_bytes,
            self.settings.kv_compression,
            request.cached_tokens,
        )
        faults, mode = self.settings.common.faults, self.settings.kv_transport
        if data_plane is not None:
            host, port = data_plane
            sink = TcpKvSink(
                target, faults, host, port, self.tls.client_context() if self.tls else None
            )
            try:
                await sink.connect(DATA_PLANE_CONNECT_SECONDS)
                return sink
            except (OSError, TimeoutError) as exc:
                why = f"data plane {sink.address} unreachable: {exc or type(exc).__name__}"
                if mode == "tcp":
                    raise KvTransferFailed("UNAVAILABLE", why) from None
                log.warning("%s; sending request %s's KV over gRPC", why, spec.request_id)
        elif mode == "tcp":
            raise KvTransferFailed(
                "FAILED_PRECONDITION", "decode offers no TCP data plane and --kv-transport is tcp"
            )
        return GrpcKvSink(target, faults, self._channel(request.decode_address))

    def _reply(
        self,
        request_id: str,
        first_token: int,
        timing: PrefillTiming,
        sink: KvSink,
        committed: Committed,
    ) -> pb.PrefillResponse:
        now = time.perf_counter()
        handoff = now - sink.first_sent_at if sink.first_sent_at else 0.0
        metrics.record_handoff("prefill", handoff, committed.bytes)
        metrics.KV_TRANSFERS.labels("prefill", sink.transport).inc()
        metrics.REQUESTS.labels("prefill", "ok", "OK").inc()
        metrics.QUEUE_SECONDS.labels("prefill").observe(timing.queue_seconds)
        if timing.queue_seconds > SLOW_QUEUE_SECONDS:
            _slow_queue.warning(
                "prefill is the bottleneck: request %s waited %.1f s for its batch, %d more "
                "waiting (more prefill cores or instances would shorten this)",
                request_id,
                timing.queue_seconds,
                self.scheduler.queue_depth,
            )
        if self.prefix is not None:
            metrics.record_prefix_lookup(
                "prefill", len(sink.target.prompt_token_ids), timing.cached_tokens
            )
        return pb.PrefillResponse(
            request_id=request_id,
            first_token_id=first_token,
            handoff=pb.Handoff(
                bytes=sink.bytes,
                wire_bytes=committed.bytes,
                seconds=handoff,
                exposed_seconds=now - timing.finished_at,
                num_chunks=sink.num_chunks,
                transport=sink.transport,
            ),
            prefill_seconds=timing.prefill_seconds,
            queue_seconds=timing.queue_seconds,
            instance=self.instance,
            cached_tokens=timing.cached_tokens,
            prefix_cache=self.prefix is not None,
        )

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._decode_channels:
            if len(self._decode_channels) >= MAX_DECODE_CHANNELS:  # forget the oldest address
                oldest = self._decode_channels.pop(next(iter(self._decode_channels)))
                asyncio.ensure_future(oldest.close(grace=30))
            self._decode_channels[address] = channel_to(address, self.tls, "decode")
        return self._decode_channels[address]


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    """Completes `future` from the engine thread (with a result, or an exception instance)."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    loop.call_soon_threadsafe(settle)


async def _first_of(done: asyncio.Future, push: asyncio.Future):
    """The prefill result; if the push ends first it has failed, so its error is raised."""
    await asyncio.wait({done, push}, return_when=asyncio.FIRST_COMPLETED)
    if not done.done():
        push.result()  # raises the push's error
        raise RuntimeError("decode accepted the KV stream before its commit")
    return done.result()


def _push_failed(request: pb.PrefillRequest, exc: KvTransferFailed, transport: str):
    """ABORTED: the handoff failed on the decode side (this prefill is fine); the details say why.
    A push that ran out of time stays DEADLINE_EXCEEDED."""
    code = (
        grpc.StatusCode.DEADLINE_EXCEEDED
        if exc.code == "DEADLINE_EXCEEDED"
        else grpc.StatusCode.ABORTED
    )
    return ServiceError(
        code,
        f"KV push to decode {request.decode_address} over {transport} failed: "
        f"{exc.code}: {exc.message}",
    )


async def serve(served: ServedModel, settings: PrefillSettings) -> None:
    server = Server.for_settings(settings.common, internal=True, service="prefill")
    instance = settings.common.instance or instance_name(
        "prefill", settings.common.host, server.port
    )
    servicer = PrefillServicer(served, settings, instance)
    if servicer.prefix is not None:
        tokens = servicer.prefix.pool.num_blocks * PREFILL_BLOCK_TOKENS
        log.info(
            "prefix cache: %d tokens of KV (%.0f MiB), in blocks of %d",
            tokens,
            tokens * served.config.kv_bytes_per_token / (1 << 20),
            PREFILL_BLOCK_TOKENS,
        )
    metrics.start(settings.common.metrics_port, settings.common.host)
    metrics.QUEUE_DEPTH.labels("prefill").set_function(lambda: servicer.scheduler.queue_depth)
    metrics.PREFILL_QUEUED_TOKENS.labels("prefill").set_function(
        lambda: servicer.scheduler.queued_tokens
    )
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server.grpc)
    model_info.add_to_server(served, server.grpc)
    loop = asyncio.get_running_loop()

    def on_broken() -> None:
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(server.set_serving(False)))

    servicer.on_broken = on_broken
    servicer.loop.start()

    async def on_stop() -> None:
        servicer.loop.stop()

    await run_until_signalled(
        server, instance, settings.common.grace_seconds, servicer.admission, on_stop
    )
