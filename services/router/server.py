"""The Router gRPC service.

A request's life in the router:
  validate -> reserve (a lease on some decode instance; waits, bounded, while every pool is full)
  -> prefill (on some prefill instance, which pushes the KV to that decode instance)
  -> relay tokens from decode to the client -> final response with usage and metrics.
A handoff that fails before any token reached the client is retried (bounded, with backoff) on
other instances; one that fails later ends with UNAVAILABLE, never a silent replay. The client's
deadline bounds every outbound call; a client that leaves cancels both.
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
from pdserve.rpc.server import Admission, Server, admitted, run_until_signalled
from pdserve.settings import RouterSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from services.router.backends import BackendSet, Instance

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
FIRST_BACKOFF_SECONDS = 0.005
MAX_BACKOFF_SECONDS = 0.1
RETRY_BACKOFF_SECONDS = 0.05
RESERVE_TIMEOUT_SECONDS = 5.0  # a healthy decode answers a reservation in about a millisecond
# A backend failing with these is worth another try elsewhere; the others are final.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS}


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class HandoffFailed(RouterError):
    """A backend failed in a way another instance might not; `instances` are to be avoided."""

    def __init__(self, message: str, instances: set[str]) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.instances = instances


@dataclass
class Inflight:
    """One request as the router carries it: what was asked, when, and until when."""

    spec: GenerateSpec
    received: float  # time.perf_counter()
    deadline: float  # time.monotonic(): the client's, capped by --request-timeout-seconds

    def remaining(self) -> float:
        """The timeout for an outbound call: every call ends by the request's deadline."""
        return max(self.deadline - time.monotonic(), 0.001)


@dataclass
class Reservation:
    call: grpc.aio.UnaryStreamCall
    lease: pb.LeaseGranted
    decode: Instance
    # Set at decode's first token: the KV is committed and decode owns the sequence, so a
    # prefill that fails after this point (before its reply) no longer matters.
    streaming: bool = False


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, config: ModelConfig, settings: RouterSettings) -> None:
        self.config, self.settings = config, settings
        self.prefills = BackendSet("prefill", settings.prefill, pb_grpc.PrefillStub)
        self.decodes = BackendSet("decode", settings.decode, pb_grpc.DecodeStub)
        self.admission = Admission()
        self.queued = 0  # requests waiting in line for decode room
        self._head_of_line = asyncio.Lock()  # FIFO: the waiting request allowed to poll

    @admitted
    async def Generate(self, request: pb.GenerateRequest, context):
        received = time.perf_counter()
        try:
            spec = validate(convert.spec_from_generate(request), self.config)
        except InvalidRequest as exc:
            metrics.record_request("router", "INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        budget = min(context.time_remaining() or float("inf"),
                     self.settings.request_timeout_seconds)
        inflight = Inflight(spec, received, time.monotonic() + budget)
        try:
            async for response in self._with_retries(inflight):
                yield response
        except RouterError as exc:
            log.info("request %s failed: %s %s", spec.request_id, exc.code.name, exc)
            metrics.record_request("router", exc.code.name)
            await context.abort(exc.code, str(exc))

    async def _with_retries(self, inflight: Inflight):
        spec = inflight.spec
        avoid: set[str] = set()
        sent = 0
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                async for response in self._attempt(inflight, attempt, avoid):
                    sent += 1
                    yield response
                return
            except HandoffFailed as exc:
                if sent:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"{exc}; tokens had already reached the client, so the "
                                      f"request is not replayed") from None
                if attempt == self.settings.max_attempts:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"handoff failed {attempt} times; last: {exc}") from None
                log.warning("request %s attempt %d failed (%s); retrying elsewhere",
                            spec.request_id, attempt, exc)
                avoid |= exc.instances
                await asyncio.sleep(RETRY_BACKOFF_SECONDS * attempt)

    async def _attempt(self, inflight: Inflight, attempt: int, avoid: set[str]):
        spec = inflight.spec
        prefill = self._pick_prefill(avoid)  # first: a reservation must never be left behind
        reservation = await self._reserve(inflight, avoid)
        prefill_call = asyncio.ensure_future(prefill.stub.Prefill(pb.PrefillRequest(
            request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids,
            sampling=convert.sampling_to_pb(spec.sampling), lease_id=reservation.lease.lease_id,
            decode_address=reservation.decode.address), timeout=inflight.remaining()))
        # A prefill that fails before the commit ends the token stream too, so the relay below
        # never waits forever; after the commit, decode owns the sequence and carries on.
        prefill_call.add_done_callback(
            lambda call: _failed(call) and not reservation.streaming and reservation.call.cancel())
        try:
            async for event in self._relay(reservation, prefill_call, prefill):
                if isinstance(event, pb.TokenEvent):
                    yield pb.GenerateResponse(request_id=spec.request_id,
                                              token_ids=event.token_ids, text=event.text)
                else:
                    finished, reply, first_token_at = event
                    yield self._final(spec, finished, reply, reservation, inflight.received,
                                      first_token_at, attempt)
        finally:
            reservation.call.cancel()
            prefill_call.cancel()

    async def _reserve(self, inflight: Inflight, avoid: set[str]) -> Reservation:
        """A lease from the first decode instance with room. While none has room, requests wait
        in line, first come first served, bounded in number and time; only the head of the
        line polls decode, so a full pool is not hammered by every waiting request."""
        if self.queued == 0:
            reservation = await self._try_all(inflight, avoid)
            if reservation is not None:
                return reservation
        if self.queued >= self.settings.max_queue:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router queue is full ({self.settings.max_queue} waiting)")
        give_up = min(time.monotonic() + self.settings.queue_timeout_seconds, inflight.deadline)
        self.queued += 1
        try:
            try:
                await asyncio.wait_for(self._head_of_line.acquire(),
                                       max(give_up - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise self._no_room(inflight, give_up) from None
            try:
                return await self._poll_until_room(inflight, avoid, give_up)
            finally:
                self._head_of_line.release()
        finally:
            self.queued -= 1

    async def _poll_until_room(self, inflight: Inflight, avoid: set[str], give_up: float
                               ) -> Reservation:
        backoff = FIRST_BACKOFF_SECONDS
        while True:
            reservation = await self._try_all(inflight, avoid)
            if reservation is not None:
                return reservation
            if time.monotonic() + backoff > give_up:
                raise self._no_room(inflight, give_up)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    async def _try_all(self, inflight: Inflight, avoid: set[str]) -> Reservation | None:
        for decode in self.decodes.ordered(avoid):
            reservation = await self._try_reserve(decode, inflight)
            if reservation is not None:
                return reservation
        return None

    def _no_room(self, inflight: Inflight, give_up: float) -> RouterError:
        if give_up >= inflight.deadline:
            return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "deadline passed while waiting for decode room")
        return RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"no decode instance had room for {inflight.spec.max_total_tokens} "
                           f"tokens within {self.settings.queue_timeout_seconds:.1f} s")

    async def _try_reserve(self, decode: Instance, inflight: Inflight) -> Reservation | None:
        spec = inflight.spec
        call = decode.stub.Generate(pb.DecodeRequest(
            request_id=spec.request_id, prompt_token_ids=spec.prompt_token_ids,
            sampling=convert.sampling_to_pb(spec.sampling)), timeout=inflight.remaining())
        try:
            # Bounded: a decode instance that accepts the call but stalls must not hold up the
            # line (the head of the line waits here).
            event = await asyncio.wait_for(call.read(), min(inflight.remaining(),
                                                            RESERVE_TIMEOUT_SECONDS))
        except asyncio.CancelledError:
            call.cancel()  # the client left while we waited for the lease
            raise
        except asyncio.TimeoutError:
            call.cancel()
            if time.monotonic() >= inflight.deadline:
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "deadline passed while waiting for decode room") from None
            log.warning("decode %s did not answer a reservation in %.0f s", decode.address,
                        RESERVE_TIMEOUT_SECONDS)
            self.decodes.mark_down(decode)
            return None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RouterError(exc.code(), "deadline passed while waiting for decode room")
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # will never fit: say so at once
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"decode {decode.address}: {exc.details()}")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.decodes.mark_down(decode)
            elif exc.code() not in RETRYABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED}:
                raise RouterError(exc.code(), f"decode {decode.address}: {exc.details()}")
            return None  # full, down or failing: try the next instance
        if event is grpc.aio.EOF or not event.HasField("lease"):
            call.cancel()
            return None
        return Reservation(call, event.lease, decode)

    def _pick_prefill(self, avoid: set[str]) -> Instance:
        ordered = self.prefills.ordered(avoid)
        if not ordered:
            raise HandoffFailed("no prefill instance is known", set())
        return ordered[0]

    async def _relay(self, reservation: Reservation, prefill_call: asyncio.Future,
                     prefill: Instance):
        """Token events, then (finished, prefill reply, first token time) once decode is done."""
        first_token_at = None
        try:
            while (event := await reservation.call.read()) is not grpc.aio.EOF:
                reservation.streaming = True
                first_token_at = first_token_at or time.perf_counter()
                if event.HasField("tokens"):
                    yield event.tokens
                elif event.HasField("finished"):
                    yield event.finished, await _reply_or_empty(prefill_call), first_token_at
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._failure(exc.code(), exc.details(), reservation, prefill_call,
                                prefill) from None
        except asyncio.CancelledError:
            if not _failed(prefill_call) or asyncio.current_task().cancelling():
                raise  # the client left
            # The prefill's failure cancelled the decode call (see _attempt).
            raise self._failure(grpc.StatusCode.CANCELLED, "cancelled", reservation,
                                prefill_call, prefill) from None
        raise HandoffFailed(f"decode {reservation.decode.address} ended the token stream early",
                            {reservation.decode.address})

    def _failure(self, code: grpc.StatusCode, details: str, reservation: Reservation,
                 prefill_call: asyncio.Future, prefill: Instance) -> RouterError:
        """The most telling error: prefill's when it failed (decode was cancelled for it)."""
        where, culprit = f"decode {reservation.decode.address}", reservation.decode
        if _failed(prefill_call) and isinstance(prefill_call.exception(), grpc.aio.AioRpcError):
            err = prefill_call.exception()
            code, details, where = err.code(), err.details(), f"prefill {prefill.address}"
            # ABORTED: prefill is fine, its push to decode failed; anything else is prefill's own.
            culprit = reservation.decode if code == grpc.StatusCode.ABORTED else prefill
        if code not in RETRYABLE:
            return RouterError(code, f"{where}: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            (self.prefills if culprit is prefill else self.decodes).mark_down(culprit)
        return HandoffFailed(f"{where}: {code.name}: {details}", {culprit.address})

    def _final(self, spec: GenerateSpec, finished: pb.DecodeFinished, reply: pb.PrefillReply,
               reservation: Reservation, received: float, first_token_at: float, attempt: int
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
                decode_instance=reservation.lease.instance, attempts=attempt,
                handoff_exposed_seconds=reply.handoff_exposed_seconds))

    async def refresh_forever(self, server: Server) -> None:
        """Keeps the instance lists and the router's own health status current."""
        serving = None
        while True:
            await asyncio.gather(self.prefills.refresh(), self.decodes.refresh())
            now_serving = (self.prefills.any_healthy and self.decodes.any_healthy
                           and not self.admission.draining)
            if now_serving != serving:
                log.info("router %s", "serving" if now_serving else
                         "not serving: waiting for a healthy prefill and decode instance")
                await server.set_serving(now_serving)
                serving = now_serving
            await asyncio.sleep(REFRESH_SECONDS)


async def _reply_or_empty(prefill_call: asyncio.Future) -> pb.PrefillReply:
    """Prefill's reply; empty (no handoff figures) if prefill failed after decode's commit."""
    try:
        return await prefill_call
    except grpc.aio.AioRpcError as exc:
        log.warning("prefill failed after the commit (%s); the request completes without its "
                    "handoff figures", exc.code().name)
        return pb.PrefillReply()


def _failed(call: asyncio.Future) -> bool:
    return call.done() and not call.cancelled() and call.exception() is not None


async def serve(config: ModelConfig, settings: RouterSettings) -> None:
    server = Server(settings.common.host, settings.common.port)
    servicer = RouterServicer(config, settings)
    pb_grpc.add_RouterServicer_to_server(servicer, server.grpc)
    metrics.start(settings.common.metrics_port)
    metrics.QUEUE_DEPTH.labels("router").set_function(lambda: servicer.queued)
    refresher = asyncio.create_task(servicer.refresh_forever(server))

    async def on_stop() -> None:
        refresher.cancel()
        await asyncio.gather(servicer.prefills.close(), servicer.decodes.close())

    await run_until_signalled(server, "router", settings.common.grace_seconds, servicer.admission,
                              on_stop, serving_at_start=False)
