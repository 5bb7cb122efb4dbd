"""One handoff attempt: room on a decode instance, the prompt's prefill (on a prefill instance, or
on decode itself below --local-prefill-tokens), the tokens relayed, and the final response.

The servicer (server.py) owns what spans attempts: admission, retries and migration. An attempt
raises HandoffFailed, naming the instances to avoid next, when another instance might succeed.
Its relay yields typed events: Tokens as decode sends them, Ended as each completion but the
last ends (a request may ask for n), then one Finished.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve import metrics, tracing
from pdserve.models.loading import ServedModel
from pdserve.rpc import convert
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.backends import BackendSet, Instance
from pdserve.services.router.errors import RETRYABLE, HandoffFailed, RouterError
from pdserve.services.router.local_prefill import LocalPrefill
from pdserve.services.router.prefill_slots import PrefillSlots
from pdserve.services.router.phases import RoomWait, phase_items, request_phases
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.services.router.reservation import Inflight, Reservation, ReservationLine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tokens:
    """New tokens from decode, to pass on to the client."""

    event: pb.TokenEvent


@dataclass(frozen=True)
class Ended:
    """One of the request's completions ended, and others go on."""

    finished: pb.DecodeFinished


@dataclass(frozen=True)
class Finished:
    """Decode is done: its last event, prefill's reply, and when the first token came."""

    finished: pb.DecodeFinished
    reply: pb.PrefillResponse
    first_token_at: float  # time.perf_counter()


class Attempts:
    """What every attempt needs: the instances, the reservation line, the prefill calls' limit,
    the placement rules."""

    def __init__(
        self,
        served: ServedModel,
        prefills: BackendSet[pb_grpc.PrefillServiceStub],
        decodes: BackendSet[pb_grpc.DecodeServiceStub],
        line: ReservationLine,
        local_prefill: LocalPrefill,
        prefix_index: PrefixIndex,
        prefill_slots: PrefillSlots,
    ) -> None:
        self.served, self.prefills, self.decodes, self.line = served, prefills, decodes, line
        self.local_prefill, self.prefix_index = local_prefill, prefix_index
        self.prefill_slots = prefill_slots

    async def run(self, inflight: Inflight, attempt: int, avoid: set[str]):
        """One attempt's responses: the tokens as they come, then the final response."""
        spec = inflight.spec
        here = self.local_prefill.decide(spec.prompt_len, self._cached_on_first(inflight, avoid))
        asked_for_room = time.perf_counter()
        if here:  # conditional disaggregation: decode prefills the prompt, no handoff
            prefill = None
            reservation = await self.line.reserve(inflight, avoid, prefill_here=True)
            prefill_call: asyncio.Future = asyncio.get_running_loop().create_future()
            prefill_call.set_result(pb.PrefillResponse())
            room = RoomWait(
                asked_for_room - inflight.received, time.perf_counter() - asked_for_room
            )
        else:
            prefill = self._pick_prefill(inflight, avoid)  # before a reservation is held
            reservation = await self.line.reserve(inflight, avoid)
            got_room = time.perf_counter()
            # Then a place among the prefill's calls: the lease waits for it as it would wait
            # in prefill's own queue, and holding a place while waiting for decode room would
            # keep it from requests that have their room.
            try:
                slot = await self.prefill_slots.take(
                    prefill.address, inflight.client, inflight.deadline
                )
            except BaseException:
                reservation.call.cancel()
                raise
            prefill_call = self._start_prefill(inflight, prefill, reservation)
            prefill_call.add_done_callback(lambda _call: slot.give_back())
            room = RoomWait(
                asked_for_room - inflight.received,
                got_room - asked_for_room,
                time.perf_counter() - got_room,
            )
        completion_tokens = 0  # of the completions that ended, for the request's count
        try:
            async for event in self._relay(reservation, prefill_call, prefill, spec.sampling.n):
                if isinstance(event, Tokens):
                    yield pb.GenerateResponse(
                        request_id=spec.request_id,
                        token_ids=event.event.token_ids,
                        text=event.event.text,
                        logprobs=event.event.logprobs,
                        index=event.event.index,
                    )
                    continue
                completion_tokens += event.finished.usage.completion_tokens
                if isinstance(event, Ended):
                    yield _completion_end(spec.request_id, event.finished)
                    continue
                reply = event.reply
                if not here:
                    ttft = event.first_token_at - inflight.received
                    sent = spec.prompt_len - reservation.lease.cached_tokens
                    self.local_prefill.observe(spec.prompt_len, sent, reply, ttft)
                self._learn_prefix(inflight, reservation, prefill if reply.prefix_cache else None)
                path = "decode" if here else "prefill"
                yield self._final(
                    inflight, event, reservation, attempt, path, room, completion_tokens
                )
        finally:
            reservation.call.cancel()
            prefill_call.cancel()

    def _learn_prefix(
        self, inflight: Inflight, reservation: Reservation, caching_prefill: Instance | None
    ) -> None:
        """The served prompt's full blocks are now cached where it ran (whatever of them had
        been evicted was computed again): on its decode instance if that keeps a cache, and on
        `caching_prefill`, the prefill instance that computed it if that keeps one."""
        if not inflight.prefix_keys:
            return
        if reservation.decode.prefix_cache:
            self.prefix_index.record(inflight.prefix_keys, reservation.decode.address)
        if caching_prefill is not None:
            self.prefix_index.record(inflight.prefix_keys, caching_prefill.address)

    def _cached_on_first(self, inflight: Inflight, avoid: set[str]) -> int:
        """Prompt tokens the decode instance tried first is believed to hold: with a prefix
        cached there, only the rest counts against --local-prefill-tokens."""
        if not inflight.prefix_keys:
            return 0
        first = next(iter(self.decodes.ordered(avoid, inflight)), None)
        return self.prefix_index.cached_tokens(inflight.prefix_keys, first.address) if first else 0

    def _start_prefill(
        self,
        inflight: Inflight,
        prefill: Instance[pb_grpc.PrefillServiceStub],
        reservation: Reservation,
    ) -> asyncio.Future:
        """The Prefill call that sends the prompt's KV to the reserved decode instance."""
        spec = inflight.spec
        # Load for --routing-policy least-loaded: this prompt is in flight at that prefill.
        prefill.queued_tokens += spec.prompt_len
        prefill_call = asyncio.ensure_future(
            prefill.stub.Prefill(
                pb.PrefillRequest(
                    request_id=spec.request_id,
                    prompt_token_ids=spec.prompt_token_ids,
                    sampling=convert.sampling_to_pb(spec.sampling),
                    lease_id=reservation.lease.lease_id,
                    decode_address=reservation.decode.address,
                    model_fingerprint=self.served.fingerprint,
                    data_endpoints=reservation.lease.data_endpoints,
                    cached_tokens=reservation.lease.cached_tokens,
                    cache_salt=spec.cache_salt,
                    client=inflight.client,
                ),
                timeout=inflight.remaining(),
                metadata=tracing.outgoing(inflight.trace),
            )
        )
        # A prefill that fails before the commit ends the token stream too, so the relay never
        # waits forever; after the commit, decode owns the sequence and carries on.
        prefill_call.add_done_callback(
            lambda call: _failed(call) and not reservation.streaming and reservation.call.cancel()
        )

        def prompt_answered(_call) -> None:
            prefill.queued_tokens -= spec.prompt_len

        prefill_call.add_done_callback(prompt_answered)
        return prefill_call

    def _pick_prefill(
        self, inflight: Inflight, avoid: set[str]
    ) -> Instance[pb_grpc.PrefillServiceStub]:
        ordered = self.prefills.ordered(avoid, inflight)
        if not ordered:
            raise HandoffFailed("no prefill instance is known", set())
        return ordered[0]

    async def _relay(
        self,
        reservation: Reservation,
        prefill_call: asyncio.Future,
        prefill: Instance[pb_grpc.PrefillServiceStub] | None,
        completions: int,
    ):
        """Tokens as decode sends them, Ended as each of the `completions` but the last ends,
        then Finished once all are done."""
        first_token_at, ended = None, 0
        try:
            while (event := await reservation.call.read()) is not grpc.aio.EOF:
                reservation.streaming = True
                first_token_at = first_token_at or time.perf_counter()
                if event.HasField("tokens"):
                    yield Tokens(event.tokens)
                elif event.HasField("finished"):
                    ended += 1
                    if ended < completions:
                        yield Ended(event.finished)
                        continue
                    reply = await _reply_or_empty(prefill_call)
                    yield Finished(event.finished, reply, first_token_at)
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._failure(
                exc.code(), exc.details(), reservation, prefill_call, prefill
            ) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None  # an async generator's body runs inside a task
            if not _failed(prefill_call) or task.cancelling():
                raise  # the client left
            # The prefill's failure cancelled the decode call (see _attempt).
            raise self._failure(
                grpc.StatusCode.CANCELLED, "cancelled", reservation, prefill_call, prefill
            ) from None
        raise HandoffFailed(
            f"decode {reservation.decode.address} ended the token stream early",
            {reservation.decode.address},
        )

    def _failure(
        self,
        code: grpc.StatusCode,
        details: str,
        reservation: Reservation,
        prefill_call: asyncio.Future,
        prefill: Instance[pb_grpc.PrefillServiceStub] | None,
    ) -> RouterError:
        """The most telling error: prefill's when it failed (decode was cancelled for it)."""
        decode = reservation.decode
        where = f"decode {decode.address}"
        culprit: Instance[pb_grpc.PrefillServiceStub] | Instance[pb_grpc.DecodeServiceStub] = decode
        err = prefill_call.exception() if _failed(prefill_call) else None
        if isinstance(err, grpc.aio.AioRpcError) and prefill is not None:
            code, details, where = err.code(), err.details(), f"prefill {prefill.address}"
            # ABORTED: prefill is fine, its push to decode failed; anything else is prefill's own.
            culprit = decode if code == grpc.StatusCode.ABORTED else prefill
        if code not in RETRYABLE:
            return RouterError(code, f"{where}: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            if culprit is prefill:
                self.prefills.mark_down(prefill)
            else:
                self.decodes.mark_down(decode)
        return HandoffFailed(f"{where}: {code.name}: {details}", {culprit.address})

    def _final(
        self,
        inflight: Inflight,
        done: Finished,
        reservation: Reservation,
        attempt: int,
        prefill_path: str,
        room: RoomWait,
        completion_tokens: int,
    ) -> pb.GenerateResponse:
        """The last completion's last response, with the request's metrics; `completion_tokens`
        counts every completion's."""
        finished, reply, first_token_at = done.finished, done.reply, done.first_token_at
        spec, received, now = inflight.spec, inflight.received, time.perf_counter()
        phases = request_phases(first_token_at - received, room, reply, finished)
        metrics.record_phases("router", phase_items(phases))
        if inflight.trace is not None:
            tiling = phase_items(phases)[:-1]  # first_decode_step is decode's, after the TTFT
            inflight.trace.phases(received, [*tiling, ("streaming", now - first_token_at)])
        metrics.PREFILL_PATH.labels("router", prefill_path).inc()
        metrics.record_request(
            "router",
            "OK",
            first_token_at - received,
            now - received,
            completion_tokens,
            spec.prompt_len,
        )
        metrics.record_handoff("router", reply.handoff.seconds, reply.handoff.bytes)
        response = _completion_end(spec.request_id, finished)
        response.metrics.CopyFrom(
            pb.RequestMetrics(
                time_to_first_token_seconds=first_token_at - received,
                end_to_end_seconds=now - received,
                handoff=reply.handoff,
                prefill_seconds=reply.prefill_seconds,
                queue_seconds=reply.queue_seconds,
                prefill_instance=reply.instance,
                decode_instance=reservation.lease.instance,
                attempts=attempt,
                prefill_path=prefill_path,
                prefix_cached_tokens=reservation.lease.cached_tokens,
                prefill_cached_tokens=reply.cached_tokens,
                phases=phases,
            )
        )
        return response


def _completion_end(request_id: str, finished: pb.DecodeFinished) -> pb.GenerateResponse:
    """A completion's last response: its last tokens, why it ended, and its usage."""
    return pb.GenerateResponse(
        request_id=request_id,
        token_ids=finished.last.token_ids,
        text=finished.last.text,
        logprobs=finished.last.logprobs,
        finish_reason=finished.finish_reason,
        usage=finished.usage,
        index=finished.index,
    )


async def _reply_or_empty(prefill_call: asyncio.Future) -> pb.PrefillResponse:
    """Prefill's reply; empty (no handoff figures) if prefill failed after decode's commit."""
    try:
        return await prefill_call
    except grpc.aio.AioRpcError as exc:
        log.warning(
            "prefill failed after the commit (%s); the request completes without its "
            "handoff figures",
            exc.code().name,
        )
        return pb.PrefillResponse()


def _failed(call: asyncio.Future) -> bool:
    return call.done() and not call.cancelled() and call.exception() is not None
