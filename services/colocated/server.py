"""The Router API served by the colocated engine, so one client and one benchmark drive both."""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable

import grpc

from pdserve import metrics

from pdserve.core.block_pool import NeverFits, PoolExhausted
from pdserve.core.request import GenerateSpec, validate
from pdserve.engine.completions import CompletionTally
from pdserve.engine.sequence import FinishReason
from pdserve.models.loading import ServedModel
from pdserve.rpc import convert, model_info
from pdserve.rpc.errors import ServiceError
from pdserve.rpc.tls import peer_host
from pdserve.rpc.server import (
    Admission,
    Server,
    emission_queue,
    instance_name,
    run_until_signalled,
)
from pdserve.settings import ColocatedSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.engine.chunked_prefill import Handle
from pdserve.services.colocated.engine import ColocatedEngine
from pdserve.services.router import http_api

log = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.005
MAX_BACKOFF_SECONDS = 0.1
QUEUE_TIMEOUT_SECONDS = 30.0


class ColocatedServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, served: ServedModel, settings: ColocatedSettings, instance: str) -> None:
        self.served, self.config, self.instance = served, served.config, instance
        self.engine = ColocatedEngine(served, settings)
        self.admission = Admission()

    async def Generate(self, request: pb.GenerateRequest, context):
        tokenizer = self.served.tokenizer
        responses = self.generate(
            lambda: convert.spec_from_generate(request, tokenizer, self.config.max_context),
            None,
            peer_host(context.peer()),  # as the router names a caller without an API key
        )
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    @property
    def serving(self) -> bool:
        return not self.admission.draining

    async def generate(
        self, make_spec: Callable[[], GenerateSpec], time_remaining: float | None, client: str
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One request, whichever front it came through (gRPC or HTTP); as the router's
        `generate`, so http_api serves both. Raises what pdserve.rpc.errors maps to a status."""
        self.admission.refuse_if_draining()
        with self.admission.track():
            # The client takes turns in the batch and holds at most its share of the pool.
            async for response in self._run(dataclasses.replace(make_spec(), client=client)):
                yield response

    async def prompt_logprobs(
        self, make_spec: Callable[[], GenerateSpec], top: int, client: str
    ) -> list[pb.TokenLogprob]:
        """The prompt's own log-probabilities (OpenAI's echo), scored between engine steps."""
        self.admission.refuse_if_draining()
        with self.admission.track():
            spec = validate(make_spec(), self.config)
            try:
                scored = await self.engine.scores.score(
                    spec.prompt_token_ids, top, self.engine.loop.wake
                )
            except RuntimeError as exc:
                raise ServiceError(grpc.StatusCode.INTERNAL, str(exc)) from None
            return convert.prompt_logprobs_to_pb(spec.prompt_token_ids, scored)

    async def _run(self, unchecked: GenerateSpec) -> AsyncGenerator[pb.GenerateResponse, None]:
        received = time.perf_counter()
        spec = validate(unchecked, self.config)
        events, sink = emission_queue()
        handle = await self._submit(spec, sink)
        tally = CompletionTally(spec.sampling.n)
        try:
            first_token_at = None
            while not tally.done:
                emission = await events.get()
                if emission.error is not None:
                    raise ServiceError(grpc.StatusCode.INTERNAL, emission.error)
                first_token_at = first_token_at or time.perf_counter()
                tally.add(emission)
                event = convert.token_event(emission)
                response = pb.GenerateResponse(
                    request_id=spec.request_id,
                    token_ids=event.token_ids,
                    text=event.text,
                    logprobs=event.logprobs,
                    index=emission.index,
                )
                if emission.finish_reason is not None:
                    self._finish(response, emission.finish_reason, tally, handle.spec.prompt_len)
                    self._finish_metrics(response, handle, first_token_at, received)
                    if tally.done:
                        self._record(response, tally)
                yield response
        finally:
            self.engine.abort(handle)

    async def _submit(self, spec: GenerateSpec, sink) -> Handle:
        """Queues the request once the pool has room, waiting (bounded) while it has none."""
        give_up = time.monotonic() + QUEUE_TIMEOUT_SECONDS
        backoff = FIRST_BACKOFF_SECONDS
        while True:
            try:
                return self.engine.submit(spec, sink)
            except NeverFits:
                raise  # waiting will not help
            except PoolExhausted:
                if time.monotonic() + backoff > give_up:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _finish(
        self,
        response: pb.GenerateResponse,
        finish_reason: FinishReason,
        tally: CompletionTally,
        prompt_len: int,
    ) -> None:
        """A completion's last response: why it ended and its usage."""
        response.finish_reason = convert.FINISH_TO_PB[finish_reason]
        response.usage.CopyFrom(
            pb.Usage(prompt_tokens=prompt_len, completion_tokens=tally.generated[response.index])
        )

    def _record(self, response: pb.GenerateResponse, tally: CompletionTally) -> None:
        """The request is done, every completion of it: counted once."""
        m = response.metrics
        metrics.record_request(
            "colocated",
            "OK",
            m.time_to_first_token_seconds,
            m.end_to_end_seconds,
            tally.total,
            response.usage.prompt_tokens,
        )

    def _finish_metrics(
        self, response: pb.GenerateResponse, handle: Handle, first_token_at: float, received: float
    ) -> None:
        timing, now = handle.timing, time.perf_counter()
        response.metrics.CopyFrom(
            pb.RequestMetrics(
                time_to_first_token_seconds=first_token_at - received,
                end_to_end_seconds=now - received,
                prefill_seconds=timing.prefill_seconds if timing else 0.0,
                queue_seconds=timing.queue_seconds if timing else 0.0,
                prefill_instance=self.instance,
                decode_instance=self.instance,
                attempts=1,
            )
        )


async def serve(served: ServedModel, settings: ColocatedSettings) -> None:
    server = Server.for_settings(settings.common, internal=False, service="colocated")
    instance = settings.common.instance or instance_name(
        "colocated", settings.common.host, server.port
    )
    servicer = ColocatedServicer(served, settings, instance)
    metrics.start(settings.common.metrics_port, settings.common.host)
    metrics.watch_pool(
        "colocated",
        lambda: servicer.engine.pool.available_blocks,
        settings.decode.num_blocks,
        lambda: servicer.engine.decode.size,
    )
    pb_grpc.add_RouterServiceServicer_to_server(servicer, server.grpc)
    model_info.add_to_server(served, server.grpc)
    servicer.engine.loop.start()
    http = None
    if settings.http_port:
        http = await http_api.start(servicer, served, settings.common, settings.http_port, "")

    async def on_stop() -> None:
        if http is not None:
            await http.cleanup()
        servicer.engine.loop.stop()

    await run_until_signalled(
        server, instance, settings.common.grace_seconds, servicer.admission, on_stop
    )
