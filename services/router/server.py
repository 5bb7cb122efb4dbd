"""The Router gRPC service.

A request's life in the router:
  validate -> reserve (a lease on some decode instance; waits, bounded, while every pool is full:
  reservation.py)
  -> prefill (on some prefill instance, which pushes the KV to that decode instance)
  -> relay tokens from decode to the client -> final response with usage and metrics.
A handoff that fails before any token reached the client is retried (bounded, with backoff) on
other instances; one that fails later moves to another pair from the tokens sent (migration,
bounded by --max-migrations), never a silent replay. The client's deadline bounds every outbound
call; a client that leaves cancels both.

The servicer here is who may call (API keys, per-client limits), admission, and the attempts of
one request (retries, migration); one attempt, from reservation to final response, is
attempt.py.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncGenerator, Callable

import grpc

from pdserve import metrics, tracing
from pdserve.core.request import GenerateSpec, InvalidRequest, validate
from pdserve.models.loading import ServedModel
from pdserve.rpc import convert, model_info, reflection
from pdserve.rpc.tls import Tls
from pdserve.rpc.server import Admission, Server, run_until_signalled
from pdserve.settings import RouterSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router import http_api
from pdserve.services.router.attempt import Attempts
from pdserve.services.router.backends import BackendSet
from pdserve.services.router.clients import (
    ApiKeys,
    CacheSalts,
    ClientLimits,
    grpc_peer_host,
    load_salt_secret,
)
from pdserve.services.router.local_prefill import LocalPrefill
from pdserve.services.router.merged import merged
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.services.router.scoring import score_prompt
from pdserve.services.router.errors import (
    HandoffFailed,
    RouterError,
    public_message,
)
from pdserve.services.router.policy import make_policy
from pdserve.services.router.prefill_slots import PrefillSlots
from pdserve.services.router.reservation import Inflight, ReservationLine

log = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
RETRY_BACKOFF_SECONDS = 0.05


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, served: ServedModel, settings: RouterSettings) -> None:
        self.served, self.config, self.settings = served, served.config, settings
        common = settings.common
        tls = Tls.load(common.tls_cert, common.tls_key, common.tls_ca)
        # Decode's block size is what the keys are cut by; corrected at the first pool report.
        self.prefix_index = PrefixIndex(block_size=16)
        self.prefills = BackendSet(
            "prefill",
            settings.prefill,
            pb_grpc.PrefillServiceStub,
            served.fingerprint,
            served.identity,
            tls,
            make_policy(settings.routing_policy, "prefill", self.prefix_index),
        )
        self.decodes = BackendSet(
            "decode",
            settings.decode,
            pb_grpc.DecodeServiceStub,
            served.fingerprint,
            served.identity,
            tls,
            make_policy(settings.routing_policy, "decode", self.prefix_index),
        )
        self.admission = Admission()
        self.line = ReservationLine(self.decodes, settings)
        self.api_keys = ApiKeys(settings.api_key)
        self.salts = CacheSalts(self.api_keys, load_salt_secret(settings.prefix_cache_secret_file))
        self.local_prefill = LocalPrefill(settings.local_prefill_tokens)
        self.clients = ClientLimits(
            settings.max_streams_per_client, settings.max_tokens_per_second_per_client
        )
        self.prefill_slots = PrefillSlots(settings)
        self.attempts = Attempts(
            served,
            self.prefills,
            self.decodes,
            self.line,
            self.local_prefill,
            self.prefix_index,
            self.prefill_slots,
        )

    @property
    def waiting(self) -> int:
        """Requests waiting in the router: for decode room, or for a prefill call."""
        return self.line.queued + self.prefill_slots.waiting

    async def Generate(self, request: pb.GenerateRequest, context):
        responses = self.generate(
            lambda: convert.spec_from_generate(
                request, self.served.tokenizer, self.config.max_context
            ),
            context.time_remaining(),
            self._client_of(context),
        )
        async with contextlib.aclosing(responses):  # a RouterError: pdserve.rpc.errors
            async for response in responses:
                yield response

    def _client_of(self, context) -> str:
        """The API key the call carries ('key #i'), or its address when the router has no keys.
        Raises RouterError UNAUTHENTICATED when keys are required and none of them came."""
        if not self.api_keys.required:
            return grpc_peer_host(context.peer())
        metadata = dict(context.invocation_metadata() or ())
        client = self.api_keys.client_of(str(metadata.get("authorization", "")))
        if client is None:
            metrics.record_request("router", "UNAUTHENTICATED")
            raise RouterError(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required: metadata 'authorization: Bearer <key>'",
            )
        return client

    async def generate(
        self, make_spec: Callable[[], GenerateSpec], time_remaining: float | None, client: str
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One request's whole life in the router, whichever front it came through (gRPC or
        HTTP): admission, validation, reservation, prefill, relay and retries.

        `make_spec` tokenizes the request: its InvalidRequest is reported like every other bad
        input. `time_remaining` is the client's deadline, if it set one. `client` is who sent it
        (services/router/clients.py), for the per-client limits. Raises RouterError; the
        caller must close the generator (contextlib.aclosing) so that a client who leaves
        cancels the backend calls at once.
        """
        if self.admission.draining:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE, "this instance is draining and takes no new requests"
            )
        with self.admission.track():
            inflight, code = None, "OK"
            try:
                # Tokenizing and checking a long prompt takes a while: not on the event loop,
                # which serves every other request meanwhile.
                inflight = await asyncio.to_thread(
                    self._inflight, make_spec, time_remaining, self._cache_salt(client)
                )
                inflight.client = client  # its line in the reservation queue
                with self.clients.admitted(client, inflight.spec.prompt_len) as spend:
                    async for response in self._with_retries(inflight):
                        spend(len(response.token_ids))
                        yield response
            except RouterError as exc:
                request_id = inflight.spec.request_id if inflight else "(invalid)"
                log.info("request %s failed: %s %s", request_id, exc.code.name, exc)
                metrics.record_request("router", exc.code.name)
                code = exc.code.name
                raise RouterError(exc.code, public_message(str(exc))) from None
            finally:
                if inflight is not None and inflight.trace is not None:
                    inflight.trace.end(time.perf_counter(), code=code)

    async def prompt_logprobs(
        self, make_spec: Callable[[], GenerateSpec], top: int, client: str
    ) -> list[pb.TokenLogprob]:
        """The prompt's own log-probabilities (OpenAI's echo), from a prefill instance: one per
        token after the first. Admitted, validated and counted as a request. Raises RouterError."""
        if self.admission.draining:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE, "this instance is draining and takes no new requests"
            )
        with self.admission.track():
            try:
                inflight = await asyncio.to_thread(self._inflight, make_spec, None, b"")
                with self.clients.admitted(client, inflight.spec.prompt_len):
                    scored = await score_prompt(
                        self.prefills,
                        self.served.fingerprint,
                        inflight.spec,
                        top,
                        self.settings.request_timeout_seconds,
                    )
            except RouterError as exc:
                metrics.record_request("router", exc.code.name)
                raise RouterError(exc.code, public_message(str(exc))) from None
            took = time.perf_counter() - inflight.received
            metrics.record_request("router", "OK", took, took, 0, inflight.spec.prompt_len)
            return scored

    def _cache_salt(self, client: str) -> bytes:
        """With --prefix-cache-scope client, the client's own salt (from its API key, else its
        address), so that its prompts find only its own cached prefixes; else none, and every
        client's are shared."""
        if self.settings.prefix_cache_scope == "shared":
            return b""
        return self.salts.of(client)

    def _inflight(
        self, make_spec: Callable[[], GenerateSpec], time_remaining: float | None, salt: bytes
    ) -> Inflight:
        received = time.perf_counter()
        try:
            spec = dataclasses.replace(validate(make_spec(), self.config), cache_salt=salt)
        except InvalidRequest as exc:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        budget = min(time_remaining or float("inf"), self.settings.request_timeout_seconds)
        trace = tracing.request_trace(spec.request_id, received)
        return self._routed(Inflight(spec, received, time.monotonic() + budget, trace=trace))

    def _routed(self, inflight: Inflight) -> Inflight:
        """With prefix-aware routing, the prompt's block keys, computed once per request."""
        if self.settings.routing_policy == "prefix-aware":
            spec = inflight.spec
            inflight.prefix_keys = self.prefix_index.keys(spec.prompt_token_ids, spec.cache_salt)
        return inflight

    @property
    def serving(self) -> bool:
        """A healthy prefill and decode instance are known, and this router is not draining."""
        return (
            self.prefills.any_healthy and self.decodes.any_healthy and not self.admission.draining
        )

    async def _with_retries(self, inflight: Inflight):
        """Retries a failed handoff elsewhere while no token has reached the client; after that,
        migrates: the same request continues on another pair from the tokens already sent."""
        async for response in self._moving(inflight, inflight, [], 0, set(), [0]):
            yield response

    async def _moving(
        self,
        original: Inflight,
        inflight: Inflight,
        sent: list[int],
        migrations: int,
        avoid: set[str],
        tries: list[int],
    ):
        """`original`'s responses from `inflight`: the request itself, or its continuation
        after `sent` (the token ids the client has received) and `migrations` moves. `avoid`
        holds the instances that just failed it; `tries` counts handoffs over every part."""
        by_completion: dict[int, list[int]] = {}  # of a request of n: what each one has sent
        ended: set[int] = set()
        while True:
            before = len(sent)
            part_sent: list[int] = []
            try:
                async for response in self._attempts(inflight, tries, part_sent, avoid):
                    sent.extend(response.token_ids)
                    by_completion.setdefault(response.index, []).extend(response.token_ids)
                    if response.finish_reason:
                        ended.add(response.index)
                    if response.finish_reason and migrations:
                        _as_one_request(response, original.spec, before)
                    yield response
                return
            except HandoffFailed as exc:
                if original.spec.sampling.n > 1:
                    moved = self._completions_moved(original, by_completion, ended, exc, tries)
                    async with contextlib.aclosing(moved):
                        async for response in moved:
                            yield response
                    return
                inflight = self._continuation(original, sent, exc, migrations)
                avoid = set(exc.instances)
                migrations += 1
                log.warning(
                    "request %s: decode failed after %d tokens (%s); continuing elsewhere "
                    "(migration %d)",
                    original.spec.request_id,
                    len(sent),
                    exc,
                    migrations,
                )

    async def _completions_moved(
        self,
        original: Inflight,
        sent: dict[int, list[int]],
        ended: set[int],
        exc: HandoffFailed,
        tries: list[int],
    ):
        """After tokens of a request of n completions went out, each one not yet ended moves on
        its own, as a request of one completion with its seed, from the tokens it has sent;
        their responses interleave, each with its index."""
        log.warning(
            "request %s: decode failed after %d tokens of %d completions (%s); moving the %d "
            "not ended, each on its own",
            original.spec.request_id,
            sum(map(len, sent.values())),
            original.spec.sampling.n,
            exc,
            original.spec.sampling.n - len(ended),
        )
        parts = {}
        for index in range(original.spec.sampling.n):
            if index in ended:
                continue
            one = _one_completion(original, index)
            so_far = list(sent.get(index, []))
            rest = self._continuation(one, so_far, exc, 0)
            parts[index] = self._moving(one, rest, so_far, 1, set(exc.instances), tries)
        async for index, response in merged(parts):
            response.index = index
            yield response

    def _continuation(
        self, original: Inflight, sent: list[int], exc: HandoffFailed, migrations: int
    ) -> Inflight:
        """The rest of the request as a request of its own: the prompt plus the tokens sent,
        generating what remains from the next step. Raises RouterError when it may not move."""
        remaining = original.spec.sampling.max_tokens - len(sent)
        if migrations >= self.settings.max_migrations or remaining <= 0:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE,
                f"{exc}; {len(sent)} tokens had reached the client and the request moved "
                f"{migrations} time(s) already (--max-migrations {self.settings.max_migrations})",
            )
        spec = original.spec
        sampling = dataclasses.replace(
            spec.sampling, max_tokens=remaining, first_step=spec.sampling.first_step + len(sent)
        )
        rest = dataclasses.replace(
            spec, prompt_token_ids=spec.prompt_token_ids + tuple(sent), sampling=sampling
        )
        return self._routed(
            Inflight(
                rest,
                original.received,
                original.deadline,
                trace=original.trace,
                client=original.client,
            )
        )

    async def _attempts(
        self, inflight: Inflight, tries: list[int], sent: list[int], avoid: set[str]
    ):
        """One handoff, retried on other instances while none of its tokens has been sent;
        `avoid` starts with the instances that just failed this request."""
        spec = inflight.spec
        for attempt in range(1, self.settings.max_attempts + 1):
            tries[0] += 1
            try:
                async for response in self.attempts.run(inflight, tries[0], avoid):
                    sent.extend(response.token_ids)
                    yield response
                return
            except HandoffFailed as exc:
                if sent:
                    raise  # tokens went out: the caller migrates
                if attempt == self.settings.max_attempts:
                    raise RouterError(
                        grpc.StatusCode.UNAVAILABLE, f"handoff failed {attempt} times; last: {exc}"
                    ) from None
                log.warning(
                    "request %s attempt %d failed (%s); retrying elsewhere",
                    spec.request_id,
                    attempt,
                    exc,
                )
                avoid |= exc.instances
                await asyncio.sleep(RETRY_BACKOFF_SECONDS * attempt)

    async def refresh_forever(self, server: Server) -> None:
        """Keeps the instance lists and the router's own health status current."""
        serving = None
        while True:
            await asyncio.gather(self.prefills.refresh(), self.decodes.refresh())
            sizes = {i.block_size for i in self.decodes.instances.values() if i.block_size}
            if sizes and self.prefix_index.block_size not in sizes:
                self.prefix_index.set_block_size(min(sizes))
            now_serving = self.serving
            if now_serving != serving:
                log.info(
                    "router %s",
                    "serving"
                    if now_serving
                    else "not serving: waiting for a healthy prefill and decode instance",
                )
                await server.set_serving(now_serving)
                serving = now_serving
            await asyncio.sleep(REFRESH_SECONDS)


async def serve(served: ServedModel, settings: RouterSettings) -> None:
    server = Server.for_settings(settings.common, internal=False, service=None)  # generate() counts
    servicer = RouterServicer(served, settings)
    pb_grpc.add_RouterServiceServicer_to_server(servicer, server.grpc)
    model_info.add_to_server(served, server.grpc)
    reflection.enable(server.grpc, "RouterService", "ModelInfoService")
    metrics.start(settings.common.metrics_port, settings.common.host)
    metrics.QUEUE_DEPTH.labels("router").set_function(lambda: servicer.waiting)
    metrics.watch_load("router", lambda: servicer.decodes.load(waiting=servicer.waiting))
    refresher = asyncio.create_task(servicer.refresh_forever(server))
    http = None
    if settings.http_port:
        http = await http_api.start(
            servicer, served, settings.common, settings.http_port, settings.api_key
        )

    async def on_stop() -> None:
        refresher.cancel()
        if http is not None:
            await http.cleanup()
        await asyncio.gather(servicer.prefills.close(), servicer.decodes.close())

    await run_until_signalled(
        server,
        "router",
        settings.common.grace_seconds,
        servicer.admission,
        on_stop,
        serving_at_start=False,
    )


def _one_completion(inflight: Inflight, index: int) -> Inflight:
    """Completion `index` of a request of n, as a request of one completion: its own seed,
    which gives the same tokens."""
    return dataclasses.replace(inflight, spec=inflight.spec.completion(index))


def _as_one_request(last: pb.GenerateResponse, spec: GenerateSpec, sent_before: int) -> None:
    """A migrated request's last response, counted as the client's one request: its own prompt,
    and every token it received, not only those of the last part."""
    last.usage.prompt_tokens = spec.prompt_len
    last.usage.completion_tokens += sent_before
