"""The Prefill gRPC service: queue the prompt for a batch, push its KV to decode, reply."""

import asyncio
import logging
import time
from typing import Callable

import grpc

from pdserve import metrics

from pdserve.core.engine_loop import EngineLoop
from pdserve.core.prefill_scheduler import PrefillJob, PrefillScheduler, PrefillTiming
from pdserve.core.request import InvalidRequest, validate
from pdserve.models.loading import ModelMismatch, ServedModel, check_same_model
from pdserve.rpc import convert
from pdserve.rpc.server import (
    CHANNEL_OPTIONS,
    Admission,
    Server,
    instance_name,
    run_until_signalled,
)
from pdserve.settings import PrefillSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.prefill.kv_sender import KvSender

log = logging.getLogger(__name__)

# Decode addresses come from the router; a bound keeps a stream of new ones from piling up.
MAX_DECODE_CHANNELS = 64


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, served: ServedModel, settings: PrefillSettings, instance: str) -> None:
        self.served, self.config = served, served.config
        self.settings, self.instance = settings, instance
        self.scheduler = PrefillScheduler(
            served.built, settings.max_batch_size, settings.max_batch_tokens
        )
        self.loop = EngineLoop(
            "prefill-engine", self._step, lambda: self.scheduler.has_work, self._crashed
        )
        self.steps = 0
        self.broken: str | None = None  # why the engine loop failed, once it has
        self.on_broken: Callable[[], None] = lambda: None
        self._decode_stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.DecodeStub]] = {}
        self.admission = Admission()

    def _step(self) -> None:
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
        self.scheduler.fail_all(message)
        self.on_broken()

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:
        if self.broken:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"this prefill instance's engine failed: {self.broken}"
            )
        await self.admission.refuse_if_draining(context)
        with self.admission.track():
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:
        try:
            check_same_model(self.served, request.model_fingerprint, "the prefill request")
            spec = validate(
                convert.spec_from_internal(
                    request.request_id, request.prompt_token_ids, request.sampling
                ),
                self.config,
            )
        except ModelMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.lease_id or not request.decode_address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "lease_id and decode_address are required"
            )
        loop = asyncio.get_running_loop()
        sender = KvSender(
            loop,
            request.lease_id,
            spec,
            self.served,
            self.settings.chunk_bytes,
            self.settings.common.faults,
        )
        done: asyncio.Future = loop.create_future()
        job = PrefillJob(
            spec,
            sender.on_layer_kv,
            on_done=lambda t, timing: _resolve(loop, done, (t, timing)),
            on_error=lambda msg: _resolve(loop, done, RuntimeError(msg)),
        )
        push = asyncio.ensure_future(
            self._stub(request.decode_address).PushKv(
                sender.pushes(), timeout=context.time_remaining()
            )
        )
        self.scheduler.add(job)
        self.loop.wake()
        try:
            first_token, timing = await _first_of(done, push)
            sender.commit(first_token)
            reply = await push
        except grpc.aio.AioRpcError as exc:
            metrics.REQUESTS.labels("prefill", "error", exc.code().name).inc()
            await context.abort(
                _push_status(exc.code()),
                f"KV push to decode {request.decode_address} failed: "
                f"{exc.code().name}: {exc.details()}",
            )
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            job.cancelled = True
            push.cancel()
        return self._reply(spec.request_id, first_token, timing, sender, reply)

    def _reply(
        self,
        request_id: str,
        first_token: int,
        timing: PrefillTiming,
        sender: KvSender,
        reply: pb.PushKvReply,
    ) -> pb.PrefillReply:
        now = time.perf_counter()
        handoff = now - sender.first_sent_at if sender.first_sent_at else 0.0
        metrics.record_handoff("prefill", handoff, reply.bytes)
        metrics.REQUESTS.labels("prefill", "ok", "OK").inc()
        return pb.PrefillReply(
            request_id=request_id,
            first_token_id=first_token,
            handoff_bytes=reply.bytes,
            handoff_seconds=handoff,
            prefill_seconds=timing.prefill_seconds,
            queue_seconds=timing.queue_seconds,
            num_chunks=sender.num_chunks,
            instance=self.instance,
            handoff_exposed_seconds=now - timing.finished_at,
        )

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return convert.model_info_to_pb(self.served)

    def _stub(self, address: str) -> pb_grpc.DecodeStub:
        if address not in self._decode_stubs:
            if len(self._decode_stubs) >= MAX_DECODE_CHANNELS:  # forget the oldest address
                oldest = next(iter(self._decode_stubs))
                channel, _ = self._decode_stubs.pop(oldest)
                asyncio.ensure_future(channel.close(grace=30))
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._decode_stubs[address] = (channel, pb_grpc.DecodeStub(channel))
        return self._decode_stubs[address][1]


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


def _push_status(code: grpc.StatusCode) -> grpc.StatusCode:
    """ABORTED: the handoff failed on the decode side (this prefill is fine); the details say why."""
    return code if code == grpc.StatusCode.DEADLINE_EXCEEDED else grpc.StatusCode.ABORTED


async def serve(served: ServedModel, settings: PrefillSettings) -> None:
    server = Server(settings.common.host, settings.common.port)
    instance = settings.common.instance or instance_name(
        "prefill", settings.common.host, server.port
    )
    servicer = PrefillServicer(served, settings, instance)
    metrics.start(settings.common.metrics_port)
    metrics.QUEUE_DEPTH.labels("prefill").set_function(lambda: servicer.scheduler.queue_depth)
    pb_grpc.add_PrefillServicer_to_server(servicer, server.grpc)
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
