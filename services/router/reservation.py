"""Getting room on a decode instance: a lease, or a bounded wait in line, shared fairly between
clients.

While no decode instance has room, requests wait in line, one line per client (its API key, else
its address: services/router/clients.py). Only one request polls decode (with backoff), so a
full pool is not hammered by every waiting request: the one whose turn it is
(pdserve/core/fair_lines.py: the client served least recently). So
clients take turns at the room that frees, and a client with a burst queued cannot make another
wait behind all of it; and each client may have only its share of the queue waiting
(--max-queue-share-per-client), so none can fill it.
"""

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import grpc

from pdserve import tracing
from pdserve.core.fair_lines import FairLines
from pdserve.core.request import GenerateSpec
from pdserve.rpc import convert
from pdserve.settings import RouterSettings
from pdserve.tracing import RequestTrace
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.backends import BackendSet, Instance
from pdserve.services.router.errors import RETRYABLE, RouterError

log = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.005
MAX_BACKOFF_SECONDS = 0.1
RESERVE_TIMEOUT_SECONDS = 5.0  # a healthy decode answers a reservation in about a millisecond


class _Unreachable(Exception):
    """A decode instance that could not be reached for a reservation (it was marked down)."""


@dataclass
class Inflight:
    """One request as the router carries it: what was asked, when, and until when."""

    spec: GenerateSpec
    received: float  # time.perf_counter()
    deadline: float  # time.monotonic(): the client's, capped by --request-timeout-seconds
    prefix_keys: list[bytes] = field(default_factory=list)  # for --routing-policy prefix-aware
    trace: RequestTrace | None = None  # with --otlp-endpoint (pdserve/tracing.py)
    client: str = ""  # who sent it (services/router/clients.py): its line while it waits

    def remaining(self) -> float:
        """The timeout for an outbound call: every call ends by the request's deadline."""
        return max(self.deadline - time.monotonic(), 0.001)


@dataclass
class Reservation:
    call: grpc.aio.UnaryStreamCall
    lease: pb.LeaseGranted
    decode: Instance[pb_grpc.DecodeServiceStub]
    # Set at decode's first token: the KV is committed and decode owns the sequence, so a
    # prefill that fails after this point (before its reply) no longer matters.
    streaming: bool = False


class ReservationLine:
    def __init__(
        self, decodes: BackendSet[pb_grpc.DecodeServiceStub], settings: RouterSettings
    ) -> None:
        self._decodes, self._settings = decodes, settings
        self._lines: FairLines[asyncio.Event] = FairLines()
        self._poller: asyncio.Event | None = None  # the one waiting request that polls
        self._backoff = FIRST_BACKOFF_SECONDS  # the line's: between one poll and the next
        self._holding: collections.Counter[str] = collections.Counter()  # reservations, by client

    @property
    def queued(self) -> int:
        """Requests waiting in line for decode room, every client's."""
        return len(self._lines)

    async def reserve(
        self, inflight: Inflight, avoid: set[str], prefill_here: bool = False
    ) -> Reservation:
        """A lease from the first decode instance with room (with `prefill_here`, room for the
        decode instance to prefill the prompt itself, and a LeaseGranted with no lease id). While
        none has room, requests wait in their client's line, bounded in number (in all, and per
        client) and time; clients take turns at the room (see the module's docstring). When no
        decode instance can be reached at all there is nothing to wait for: UNAVAILABLE."""
        client = inflight.client
        if self.queued == 0:
            reservation = await self._try_all(inflight, avoid, prefill_here)
            if reservation is not None:
                self._lines.count_turn(client)
                return reservation
        if self.queued >= self._settings.max_queue:
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router queue is full ({self._settings.max_queue} waiting)",
            )
        if (waiting := self._lines.waiting_for(client)) >= self._settings.max_queue_per_client:
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client!r} has {waiting} requests waiting for decode room, the most "
                f"one client may have (--max-queue-share-per-client "
                f"{self._settings.max_queue_share_per_client:g} of --max-queue "
                f"{self._settings.max_queue})",
            )
        give_up = min(time.monotonic() + self._settings.queue_timeout_seconds, inflight.deadline)
        me = asyncio.Event()
        self._lines.append(client, me)
        self._choose_poller()
        try:
            reservation = await self._wait_and_poll(me, inflight, avoid, give_up, prefill_here)
            self._backoff = FIRST_BACKOFF_SECONDS
            self._lines.count_turn(client)
            return reservation
        finally:
            self._lines.remove(me)
            self._choose_poller()

    def _choose_poller(self, failed: str | None = None) -> None:
        """Wakes the request that polls next: the one whose turn it is. After a poll of client
        `failed` found no room, another client's, if `failed` holds room already: decode may
        have refused it its share of the pool (--max-pool-share-per-client), which another
        client's request would be granted. (A client that holds none was refused because
        the pool is full, which no other client's poll changes.)"""
        passing = failed if failed is not None and self._holding[failed] else None
        self._poller = self._lines.peek(passing)
        if self._poller is not None:
            self._poller.set()

    async def _wait_and_poll(
        self,
        me: asyncio.Event,
        inflight: Inflight,
        avoid: set[str],
        give_up: float,
        prefill_here: bool,
    ) -> Reservation:
        """Waits while another request polls; polls while this one is the poller, and after each
        poll that finds no room, waits the line's backoff and chooses the next poller (which
        may be another client's request: _choose_poller; without that, one client refused its
        share held another's request for 3 s, bench/fairness.py)."""
        while True:
            if self._poller is not me:
                me.clear()
                try:
                    await asyncio.wait_for(me.wait(), max(give_up - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    raise self._no_room(inflight, give_up) from None
                continue
            reservation = await self._try_all(inflight, avoid, prefill_here)
            if reservation is not None:
                return reservation
            if time.monotonic() + self._backoff > give_up:
                raise self._no_room(inflight, give_up)
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_SECONDS)
            self._choose_poller(failed=inflight.client)

    async def _try_all(
        self, inflight: Inflight, avoid: set[str], prefill_here: bool
    ) -> Reservation | None:
        """A reservation, or None while every instance reached is full. UNAVAILABLE when none
        could be reached: waiting in line for room would then only delay the failure."""
        instances = self._decodes.ordered(avoid, inflight)
        unreachable = 0
        for decode in instances:
            try:
                reservation = await self._try_reserve(decode, inflight, prefill_here)
            except _Unreachable:
                unreachable += 1
                continue
            if reservation is not None:
                return reservation
        if unreachable == len(instances):
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE,
                f"no decode instance is up ({len(instances)} known, none could be reached)",
            )
        return None

    def _no_room(self, inflight: Inflight, give_up: float) -> RouterError:
        if give_up >= inflight.deadline:
            return RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while waiting for decode room"
            )
        return RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no decode instance had room for {inflight.spec.max_total_tokens} "
            f"tokens within {self._settings.queue_timeout_seconds:.1f} s",
        )

    async def _try_reserve(
        self, decode: Instance[pb_grpc.DecodeServiceStub], inflight: Inflight, prefill_here: bool
    ) -> Reservation | None:
        spec = inflight.spec
        call = decode.stub.Decode(
            pb.DecodeRequest(
                request_id=spec.request_id,
                prompt_token_ids=spec.prompt_token_ids,
                sampling=convert.sampling_to_pb(spec.sampling),
                model_fingerprint=self._decodes.model_fingerprint,
                prefill_here=prefill_here,
                cache_salt=spec.cache_salt,
                client=inflight.client,
            ),
            timeout=inflight.remaining(),
            metadata=tracing.outgoing(inflight.trace),
        )
        try:
            # Bounded: a decode instance that accepts the call but stalls must not hold up the
            # line (the head of the line waits here).
            event = await asyncio.wait_for(
                call.read(), min(inflight.remaining(), RESERVE_TIMEOUT_SECONDS)
            )
        except asyncio.CancelledError:
            call.cancel()  # the client left while we waited for the lease
            raise
        except asyncio.TimeoutError:
            call.cancel()
            if time.monotonic() >= inflight.deadline:
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "deadline passed while waiting for decode room",
                ) from None
            log.warning(
                "decode %s did not answer a reservation in %.0f s",
                decode.address,
                RESERVE_TIMEOUT_SECONDS,
            )
            self._decodes.mark_down(decode)
            return None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RouterError(exc.code(), "deadline passed while waiting for decode room")
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # will never fit: say so at once
                raise RouterError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode {decode.address}: {exc.details()}"
                )
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._decodes.mark_down(decode)
                raise _Unreachable() from None
            if exc.code() not in RETRYABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED}:
                raise RouterError(exc.code(), f"decode {decode.address}: {exc.details()}")
            return None  # full, down or failing: try the next instance
        if event is grpc.aio.EOF or not event.HasField("lease"):
            call.cancel()
            return None
        decode.streams += 1  # load for prefix-aware routing, counted until the call ends
        client = inflight.client
        self._holding[client] += 1

        def ended(_call) -> None:
            decode.streams -= 1
            self._holding[client] -= 1
            if not self._holding[client]:
                del self._holding[client]

        call.add_done_callback(ended)
        return Reservation(call, event.lease, decode)
