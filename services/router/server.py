"""The Router gRPC service.

A request's life in the router:
  validate -> reserve (a lease on some decode instance; waits, bounded, while every pool is full)
  -> prefill (on some prefill instance, which pushes the KV to that decode instance)
  -> relay tokens from decode to the client -> final response with usage and metrics.
The client's deadline bounds every outbound call; a client that leaves cancels both.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve import metrics

from pdserve.core.config import ModelConfig
from pdserve.core.request import GenerateSpec, InvalidRequest, validate
from pdserve.rpc import convert
from pdserve.rpc.server import Server, run_until_signalled
from pdserve.settings import RouterSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.router.backends import BackendSet, Instance

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
FIRST_BACKOFF_SECONDS = 0.005
MAX_BACKOFF_SECONDS = 0.1


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Reservation:
    call: grpc.aio.UnaryStreamCall
    lease: pb.LeaseGranted
    decode: Instance


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, config: ModelConfig, settings: RouterSettings) -> None:
        self.config, self.settings = config, settings
        self.prefills = BackendSet("prefill", settings.prefill, pb_grpc.PrefillStub)
        self.decodes = BackendSet("decode", settings.decode, pb_grpc.DecodeStub)
        self.waiting = 0

    async def Generate(self, request: pb.GenerateRequest, context):
        received = time.perf_counter()
        try:
            spec = validate(convert.spec_from_generate(request), self.config)
        except InvalidRequest as exc:
            metrics.record_request("router", "INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            async for response in self._generate(spec, context, received):
                yield response
        except RouterError as exc:
            log.info("request %s failed: %s %s", spec.request_id, exc.code.name, exc)
            metrics.record_request("router", exc.code.name)
            await context.abort(exc.code, str(exc))

    async def _generate(self, spec: GenerateSpec, context, received: float):
        reservation = await self._reserve(spec, context)
        prefill = self._pick_prefill()
        prefill_call = asyncio.ensure_future(prefill.stub.Prefill(pb.PrefillRequest(
            request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids,
            sampling=convert.sampling_to_pb(spec.sampling), lease_id=reservation.lease.lease_id,
            decode_address=reservation.decode.address), timeout=context.time_remaining()))
        # A failed prefill ends the token stream too, so the relay below never waits forever.
        prefill_call.add_done_callback(
            lambda call: call.cancelled() or call.exception() is None or reservation.call.cancel())
        try:
            async for response in self._relay(spec, reservation, prefill_call, prefill, received):
                yield response
        finally:
            reservation.call.cancel()
            prefill_call.cancel()

    async def _reserve(self, spec: GenerateSpec, context) -> Reservation:
        """A lease from the first decode instance with room, waiting (bounded) while none has."""
        if self.waiting >= self.settings.max_queue:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router queue is full ({self.settings.max_queue} waiting)")
        give_up = time.monotonic() + self.settings.queue_timeout_seconds
        backoff = FIRST_BACKOFF_SECONDS
        self.waiting += 1
        try:
            while True:
                for decode in self.decodes.ordered():
                    reservation = await self._try_reserve(decode, spec, context)
                    if reservation is not None:
                        return reservation
                if time.monotonic() + backoff > give_up:
                    raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"no decode instance had room for {spec.max_total_tokens} "
                                      f"tokens within {self.settings.queue_timeout_seconds:.1f} s")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
        finally:
            self.waiting -= 1

    async def _try_reserve(self, decode: Instance, spec: GenerateSpec, context
                           ) -> Reservation | None:
        call = decode.stub.Generate(pb.DecodeRequest(
            request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids,
            sampling=convert.sampling_to_pb(spec.sampling)), timeout=context.time_remaining())
        try:
            event = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.decodes.mark_down(decode)
            elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RouterError(exc.code(), "deadline passed while waiting for decode room")
            elif exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise RouterError(exc.code(), f"decode {decode.address}: {exc.details()}")
            return None
        if event is grpc.aio.EOF or not event.HasField("lease"):
            call.cancel()
            return None
        return Reservation(call, event.lease, decode)

    def _pick_prefill(self) -> Instance:
        ordered = self.prefills.ordered()
        if not ordered:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no prefill instance is known")
        return ordered[0]

    async def _relay(self, spec: GenerateSpec, reservation: Reservation,
                     prefill_call: asyncio.Future, prefill: Instance, received: float):
        first_token_at = None
        try:
            async for event in _rest_of(reservation.call):
                if event.HasField("tokens"):
                    first_token_at = first_token_at or time.perf_counter()
                    yield pb.GenerateResponse(request_id=spec.request_id,
                                              token_ids=event.tokens.token_ids,
                                              text=event.tokens.text)
                elif event.HasField("finished"):
                    first_token_at = first_token_at or time.perf_counter()
                    reply = await prefill_call
                    yield self._final(spec, event.finished, reply, reservation, received,
                                      first_token_at)
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc, reservation, prefill_call, prefill) from None
        raise RouterError(grpc.StatusCode.INTERNAL, "decode ended the token stream early")

    def _failure(self, exc: grpc.aio.AioRpcError, reservation: Reservation,
                 prefill_call: asyncio.Future, prefill: Instance) -> RouterError:
        """The most telling error: prefill's when it failed (decode was cancelled for it)."""
        if prefill_call.done() and not prefill_call.cancelled() and prefill_call.exception():
            err = prefill_call.exception()
            if isinstance(err, grpc.aio.AioRpcError):
                code = err.code()
                if code == grpc.StatusCode.UNAVAILABLE:
                    self.prefills.mark_down(prefill)
                return RouterError(code, f"prefill {prefill.address}: {err.details()}")
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.decodes.mark_down(reservation.decode)
        code = grpc.StatusCode.UNAVAILABLE if exc.code() == grpc.StatusCode.ABORTED else exc.code()
        return RouterError(code, f"decode {reservation.decode.address}: {exc.details()}")

    def _final(self, spec: GenerateSpec, finished: pb.DecodeFinished, reply: pb.PrefillReply,
               reservation: Reservation, received: float, first_token_at: float
               ) -> pb.GenerateResponse:
        now = time.perf_counter()
        metrics.record_request("router", "OK", first_token_at - received, now - received,
                               finished.usage.completion_tokens, finished.usage.prompt_tokens)
        metrics.record_handoff("router", reply.handoff_seconds, reply.handoff_bytes)
        return pb.GenerateResponse(
            request_id=spec.request_id, token_ids=finished.last.token_ids,
            text=finished.last.text, finish_reason=finished.finish_reason, usage=finished.usage,
            metrics=pb.RequestMetrics(
                time_to_first_token_seconds=first_token_at - received,
                end_to_end_seconds=now - received, handoff_bytes=reply.handoff_bytes,
                handoff_seconds=reply.handoff_seconds, prefill_seconds=reply.prefill_seconds,
                queue_seconds=reply.queue_seconds, prefill_instance=reply.instance,
                decode_instance=reservation.lease.instance, attempts=1))

    async def refresh_forever(self, server: Server) -> None:
        """Keeps the instance lists and the router's own health status current."""
        serving = None
        while True:
            await asyncio.gather(self.prefills.refresh(), self.decodes.refresh())
            now_serving = self.prefills.any_healthy and self.decodes.any_healthy
            if now_serving != serving:
                log.info("router %s", "serving" if now_serving else
                         "not serving: waiting for a healthy prefill and decode instance")
                await server.set_serving(now_serving)
                serving = now_serving
            await asyncio.sleep(REFRESH_SECONDS)


async def _rest_of(call: grpc.aio.UnaryStreamCall):
    """The stream's remaining messages (its first was read with read(); the two APIs can't mix)."""
    while (message := await call.read()) is not grpc.aio.EOF:
        yield message


async def serve(config: ModelConfig, settings: RouterSettings) -> None:
    server = Server(settings.common.host, settings.common.port)
    servicer = RouterServicer(config, settings)
    metrics.start(settings.common.metrics_port)
    metrics.QUEUE_DEPTH.labels("router").set_function(lambda: servicer.waiting)
    pb_grpc.add_RouterServicer_to_server(servicer, server.grpc)
    refresher = asyncio.create_task(servicer.refresh_forever(server))

    async def on_stop() -> None:
        refresher.cancel()
        await asyncio.gather(servicer.prefills.close(), servicer.decodes.close())

    await run_until_signalled(server, "router", settings.common.grace_seconds, on_stop,
                              serving_at_start=False)
