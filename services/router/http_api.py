"""The router's OpenAI-compatible HTTP API, on its own port beside gRPC.

aiohttp, because it is an HTTP/1.1 server (not a parser of our own) that runs on the router's own
asyncio loop: a request goes through RouterServicer.generate, the same admission, reservation,
prefill and relay as a gRPC Generate call, with no thread or process hop and no copy of the
handoff logic. (An ASGI stack would need a second server and loop.) The colocated engine serves
the same API through its own `generate` (a Backend), so one client measures both.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a text prompt, or token ids
    GET  /v1/models             the served model and its context length
    GET  /health                200 while a prefill and a decode instance serve, else 503

A request's life: headers and body read (each bounded in size and in time) -> JSON -> fields
checked (openai_schema) -> generate -> one JSON reply, or server-sent events ending with
`data: [DONE]`. Streams wait for the first token before sending their headers, so that everything
which fails before it (bad input, a full queue, no backend) gets its own HTTP status. A client that disconnects cancels the request's
task, and with it the decode and prefill calls, so its KV blocks are freed at once.
"""

import asyncio
import contextlib
import functools
import json
import logging
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from pdserve import metrics
from pdserve.core.shown import shown
from pdserve.models.loading import ServedModel
from pdserve.core.request import GenerateSpec, validate
from pdserve.rpc.tls import Tls, check_plaintext_allowed
from pdserve.settings import CommonSettings
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router import openai_format as fmt
from pdserve.rpc.errors import RateLimitedLog, http_status, status_of
from pdserve.services.router.clients import ApiKeys
from pdserve.services.router.http_body import client_values, parsed_body
from pdserve.services.router.openai_schema import (
    MAX_BODY_BYTES,
    BadRequest,
    OpenAIRequest,
    UnknownModel,
    parse_chat,
    parse_completion,
)


class Backend(Protocol):
    """What serves the requests: the router (RouterServicer) or the colocated engine."""

    @property
    def serving(self) -> bool: ...

    def generate(
        self, make_spec: Callable[[], GenerateSpec], time_remaining: float | None, client: str
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The request's responses; raises what pdserve.rpc.errors maps to a status."""
        ...

    async def prompt_logprobs(
        self, make_spec: Callable[[], GenerateSpec], top: int, client: str
    ) -> list[pb.TokenLogprob]:
        """The prompt's own logprobs, one per token after the first (OpenAI's echo)."""
        ...


log = logging.getLogger(__name__)

CLIENT = web.RequestKey("client", str)  # who sent it (services/router/clients.py), set by _auth
RETRY_AFTER_SECONDS = 1  # told to a client refused as overloaded (429)
STOP_SECONDS = 1.0  # after the router's drain: how long open HTTP connections get to close
# A client can trigger a bug at will, so its traceback is logged at most once per interval.
BUG_LOG = RateLimitedLog(interval=10.0)
# Requests that aiohttp's parser refuses (a malformed header line): one line per interval, which
# never quotes the request (see _ParserLog).
REFUSED_LOG = RateLimitedLog(interval=10.0)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Deadlines:
    """How long a client may take to send a request, so that one that trickles its bytes (slow
    loris) cannot hold connections open. aiohttp's own default waits an hour for headers, and for
    a body forever."""

    # The whole request line and headers, counted from the moment the connection opens or its
    # last response ends; an idle keep-alive connection is closed after as long. It is longer
    # than the idle time of common clients' pools (httpx 5 s, aiohttp 15 s), so that they, not
    # the server, close idle connections, and a reused one is not closed under a request.
    headers: float = 20.0
    # The whole body, once the headers are in: MAX_BODY_BYTES (4 MiB) at 70 KB/s. Past it: 408.
    body: float = 60.0
    # After a reply that left the body unread (413, 408): how long aiohttp reads and discards the
    # rest, so that the client sees the reply rather than a reset. aiohttp's default.
    linger: float = 10.0


class HttpApi:
    def __init__(
        self, router: Backend, served: ServedModel, api_key: str, deadlines: Deadlines = Deadlines()
    ) -> None:
        self.router, self.served = router, served
        self._keys = ApiKeys(api_key)
        self._started = int(time.time())
        self.deadlines = deadlines

    def app(self) -> web.Application:
        # client_max_size bounds every body; a larger one is answered 413 before it is read.
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[self._errors, self._auth]
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    def runner(self) -> web.AppRunner:
        """The app with its connection options; the caller sets it up and adds a site."""
        # handler_cancellation: a client that disconnects cancels its handler (and so its
        # request); no access log: requests are counted in metrics, and a log line per token
        # stream is noise. keepalive_timeout is also the deadline for a request's headers.
        return _Runner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=STOP_SECONDS,
            keepalive_timeout=self.deadlines.headers,
            lingering_time=self.deadlines.linger,
            logger=_ParserLog(logging.getLogger("aiohttp.server"), {}),
        )

    # --- endpoints ---

    async def health(self, request: web.Request) -> web.Response:
        serving = self.router.serving
        return web.json_response(
            {"status": "serving" if serving else "not serving"}, status=200 if serving else 503
        )

    async def models(self, request: web.Request) -> web.Response:
        max_context = self.served.config.max_context
        source = self.served.source  # the checkpoint directory; TinyGPT has none
        root = str(source) if source is not None else self.served.name
        return web.json_response(fmt.models(self.served.name, max_context, self._started, root))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parse = functools.partial(parse_chat, model_name=self.served.name)
        return await self._complete(request, await parsed_body(request, self.deadlines.body, parse))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parse = functools.partial(parse_completion, model_name=self.served.name)
        return await self._complete(request, await parsed_body(request, self.deadlines.body, parse))

    async def _complete(self, request: web.Request, parsed: OpenAIRequest) -> web.StreamResponse:
        reply = fmt.Reply(
            parsed.kind,
            parsed.request_id,
            self.served.name,
            self.served.tokenizer.token_bytes,
            completions=parsed.sampling.get("n", 1),
        )
        tokenizer, max_context = self.served.tokenizer, self.served.config.max_context

        def make_spec() -> GenerateSpec:
            with client_values():  # tokenizing may meet what parsing let through
                return parsed.spec(tokenizer, max_context)

        if parsed.echo:
            spec = await asyncio.to_thread(make_spec)  # tokenizing: off the event loop
            return await self._echoed(request, parsed, reply, spec)
        # No client deadline over HTTP: --request-timeout-seconds bounds the request.
        responses = self.router.generate(make_spec, None, request[CLIENT])
        async with contextlib.aclosing(responses):
            if parsed.stream:
                return await _stream(request, reply, responses, parsed.include_usage)
            return await _whole(reply, responses)

    async def _echoed(
        self, request: web.Request, parsed: OpenAIRequest, reply: fmt.Reply, spec: GenerateSpec
    ) -> web.StreamResponse:
        """Completions that start with their prompt: the prompt's own logprobs when asked for
        (scored once, by a prefill, for every completion), then what each one generated, if
        max_tokens asked for any. Streamed, each completion's first chunk is its prompt."""
        validate(spec, self.served.config)  # before anything runs, even when nothing is asked
        client = request[CLIENT]
        scored = None
        if spec.sampling.logprobs:
            top = spec.sampling.top_logprobs
            scored = await self.router.prompt_logprobs(lambda: spec, top, client)
        echo = fmt.Echo(self._prompt_text(parsed, spec), spec.prompt_token_ids, scored)
        if parsed.generates:
            responses = self.router.generate(lambda: spec, None, client)
        else:
            responses = _nothing_generated(spec)
        async with contextlib.aclosing(responses):
            if parsed.stream:
                heads = [reply.echo_chunk(echo, index) for index in range(spec.sampling.n)]
                return await _stream(request, reply, responses, parsed.include_usage, heads)
            completions = await _collected(responses)
        return web.json_response(reply.echoed(echo, completions), dumps=_dumps)

    def _prompt_text(self, parsed: OpenAIRequest, spec: GenerateSpec) -> str:
        if isinstance(parsed.prompt, str):
            return parsed.prompt
        spelled = b"".join(map(self.served.tokenizer.token_bytes, spec.prompt_token_ids))
        return spelled.decode(errors="replace")

    # --- middlewares ---

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure in OpenAI's error shape; every request counted by endpoint and status."""
        endpoint = request.match_info.route.resource
        label = endpoint.canonical if endpoint is not None else "other"
        status = 499  # unless a response is made: the client left first
        try:
            response = await _answer(request, handler)
            status = response.status
            return response
        finally:
            metrics.record_http(label, status)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """With --api-key, /v1/* needs `Authorization: Bearer <key>`, compared in constant time.
        The key found, or else the peer's address, is the client for the per-client limits."""
        request[CLIENT] = request.remote or "unknown"
        if not self._keys.required or not request.path.startswith("/v1/"):
            return await handler(request)
        client = self._keys.client_of(request.headers.get("Authorization", ""))
        if client is None:
            return _error_response(
                401,
                fmt.error(
                    "a valid API key is required: Authorization: Bearer <key>",
                    "invalid_request_error",
                    code="invalid_api_key",
                ),
                {"WWW-Authenticate": "Bearer"},
            )
        request[CLIENT] = client
        return await handler(request)


class _ParserLog(logging.LoggerAdapter):
    """aiohttp's server log, minus the request's bytes. A request its parser refuses (a header
    with a control character, say) is logged by aiohttp with the offending line quoted, and that
    line may be `Authorization: Bearer <key>`: the docs promise that no key is ever logged. Such
    a refusal is logged as one line that names only its kind; everything else passes through."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if exc is True:
            exc = sys.exc_info()[1]
        elif isinstance(exc, tuple):  # (type, value, traceback), as logging also takes it
            exc = exc[1]
        if isinstance(exc, HttpProcessingError):
            args = ("HTTP API: refused a malformed request (%s, %d)", type(exc).__name__, exc.code)
            if level < logging.WARNING:  # aiohttp's choice: non-HTTP bytes on the port are noise
                log.debug(*args)
            else:
                REFUSED_LOG.warning(*args)
            return
        super().log(level, msg, *args, **kwargs)


class _RefusingHandler(RequestHandler):
    """aiohttp's connection handler, but a request its parser refuses is answered without its
    bytes. aiohttp's own 400 quotes the offending line back, and that line may be
    `Authorization: Bearer <key>`: it would reach every proxy and log between the client and
    us. The answer names only the kind of refusal, as the log line does (_ParserLog)."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            message = f"malformed HTTP request ({type(exc).__name__}); its bytes are not echoed"
        return super().handle_error(request, status, exc, message)


class _Runner(web.AppRunner):
    """AppRunner whose connections are handled by _RefusingHandler. aiohttp offers no option
    for its parser's error page, so the server it makes is rebuilt with our handler class;
    tests/test_http_hostile.py fails if a newer aiohttp stops honouring it."""

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _RefusingServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )


class _RefusingServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _RefusingHandler(self, loop=self._loop, **self._kwargs)


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's response, or the error response its exception stands for."""
    try:
        return await handler(request)
    except UnknownModel as exc:
        return _error_response(
            404, fmt.error(str(exc), "invalid_request_error", exc.param, "model_not_found")
        )
    except BadRequest as exc:
        return _error_response(400, fmt.error(str(exc), "invalid_request_error", exc.param))
    except web.HTTPException as exc:  # aiohttp's own: 404, 405, 413; ours: 408, 415
        if exc.status < 400:
            raise
        message = exc.text if exc.status != 413 else f"the body is over {MAX_BODY_BYTES} bytes"
        return _error_response(
            exc.status, fmt.error(message or exc.reason, "invalid_request_error")
        )
    except ConnectionError:  # the client left: there is no one to answer
        raise
    except Exception as exc:  # a domain failure has a status; anything else is a bug
        status, body = _domain_error(exc, request)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 429 else {}
        return _error_response(status, body, headers)


def _domain_error(exc: Exception, request: web.Request) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of a failure. One the error table does not know is
    a bug: 500, its traceback in the log (at most once per interval), nothing of it in the reply."""
    code = status_of(exc)
    if code is None:
        BUG_LOG.warning(
            "HTTP API: %s %s failed, a bug: %s",
            request.method,
            shown(request.path),
            "".join(traceback.format_exception(exc)),
        )
        return 500, fmt.error("internal error; the server's log has the details", "internal_error")
    status, kind = http_status(code)
    return status, fmt.error(str(exc), kind, code=code.name)


def _error_response(status: int, body: dict, headers: dict | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


async def _whole(reply: fmt.Reply, responses: AsyncIterator[pb.GenerateResponse]) -> web.Response:
    return web.json_response(reply.whole(await _collected(responses)), dumps=_dumps)


async def _nothing_generated(spec: GenerateSpec) -> AsyncGenerator[pb.GenerateResponse, None]:
    """The last responses of an echo of max_tokens 0, one per completion: no text, the prompt
    in the usage."""
    for index in range(spec.sampling.n):
        yield pb.GenerateResponse(
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=spec.prompt_len),
            index=index,
        )


async def _collected(responses: AsyncIterator[pb.GenerateResponse]) -> list[fmt.Completion]:
    """The whole reply, by completion: each one's text, last response (finish reason, usage)
    and logprobs."""
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[pb.TokenLogprob]] = {}
    lasts: dict[int, pb.GenerateResponse] = {}
    async for response in responses:
        texts.setdefault(response.index, []).append(response.text)
        logprobs.setdefault(response.index, []).extend(response.logprobs)
        lasts[response.index] = response
    return [fmt.Completion("".join(texts[i]), lasts[i], logprobs[i]) for i in sorted(lasts)]


async def _stream(
    request: web.Request,
    reply: fmt.Reply,
    responses: AsyncIterator[pb.GenerateResponse],
    include_usage: bool,
    heads: Sequence[dict] = (),
) -> web.StreamResponse:
    """The reply as server-sent events: `heads` (an echo's prompts) first, then the responses'."""
    first = await anext(responses)  # before the headers: a refusal still gets its status
    stream = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await stream.prepare(request)
    try:
        for head in heads:
            await _send(stream, head)
        await _events(stream, reply, first, responses, include_usage)
    except ConnectionError:  # the client left: no one to tell
        raise
    except Exception as exc:  # after the headers: the failure becomes the last event
        await _send(stream, _domain_error(exc, request)[1])
        return stream
    await stream.write(b"data: [DONE]\n\n")
    return stream


async def _events(
    stream: web.StreamResponse,
    reply: fmt.Reply,
    first: pb.GenerateResponse,
    rest: AsyncIterator[pb.GenerateResponse],
    include_usage: bool,
) -> None:
    """One chunk per token, a finish chunk as each completion ends, then (if asked) the usage
    chunk."""
    response: pb.GenerateResponse | None = first
    started: set[int] = set()  # completions whose first chunk went out
    while response is not None:
        if response.token_ids or response.text:
            await _send(stream, reply.token_chunk(response, response.index not in started))
            started.add(response.index)
        if response.finish_reason:
            await _send(stream, reply.finish_chunk(response))
        response = await anext(rest, None)
    if include_usage:
        await _send(stream, reply.usage_chunk())


async def _send(stream: web.StreamResponse, event: dict) -> None:
    # One write per event, whole: a multi-byte character is never split across events, since
    # the router's text already holds complete characters only.
    await stream.write(b"data: " + _dumps(event).encode() + b"\n\n")


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def start(
    router: Backend, served: ServedModel, common: CommonSettings, http_port: int, api_key: str
) -> web.AppRunner:
    """Serves the API on --host:--http-port; the caller stops it with `runner.cleanup()`."""
    runner = HttpApi(router, served, api_key).runner()
    # HTTPS with the router's own certificate when it has one; plaintext only where gRPC
    # plaintext would be allowed too (loopback, or --insecure).
    tls = Tls.load(common.tls_cert, common.tls_key, common.tls_ca)
    if tls is None:
        check_plaintext_allowed(common.host, common.insecure, f"HTTP API port {http_port}")
    await runner.setup()
    site = web.TCPSite(
        runner, common.host, http_port, ssl_context=tls.https_context() if tls else None
    )
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    log.info(
        "HTTP API (OpenAI-compatible) on %s://%s:%d%s",
        "https" if tls else "http",
        common.host,
        http_port,
        ", API key required on /v1/*" if api_key else "",
    )
    return runner
