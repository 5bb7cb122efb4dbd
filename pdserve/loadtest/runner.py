"""The load generator: an asyncio gRPC client that sends a workload's requests at their arrival
times to any `pdserve.v1.Router` endpoint and records what it sees of each one.

Timing is client-side (time.perf_counter): TTFT runs from the call's start to the first token
received, end-to-end to the stream's close, and the inter-token latencies are the gaps between
token arrivals (a message carrying k tokens counts as k gaps of 1/k of its gap each, so the gaps
of a request sum to its last token's time minus its first's). The server's own view (its TTFT,
queue, prefill and handoff figures) comes from the last response's metrics.

Open loop by default: a request is sent at its arrival time whether or not earlier ones have
finished. With a concurrency cap a request waits for a free slot; the wait shows up as
`sent - scheduled` (client delay), and TTFT is measured from `sent`.
"""

import asyncio
import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import aiohttp
import grpc

from pdserve.loadtest import openai_client, scrape
from pdserve.loadtest.stats import RequestResult
from pdserve.loadtest.workload import BenchRequest, WorkloadSpec, iter_requests
from pdserve.rpc import model_info
from pdserve.rpc.tls import aio_client_channel
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

FINISH_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: "",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
}
CONNECT_TIMEOUT_SECONDS = 10.0
MAX_ERROR_LENGTH = 300


@dataclass(frozen=True)
class RunOptions:
    address: str
    num_requests: int | None = None
    duration: float | None = None  # seconds; no new request is sent after this
    concurrency: int | None = None  # most requests in flight at once; None for no cap
    timeout: float = 120.0  # per-request deadline, seconds
    temperature: float = 0.0
    ignore_eos: bool = True
    warmup: int = 0  # requests sent one at a time before the measured run, not recorded
    endpoint: str = "grpc"  # or openai-completions / openai-chat: the router's HTTP API
    http_url: str = "http://127.0.0.1:8000/v1"  # base URL of the HTTP API, for those
    metrics_urls: tuple[str, ...] = ()  # services' /metrics, read before and after each rate

    @property
    def target(self) -> str:
        """Where the requests go: the gRPC address, or the HTTP API's base URL."""
        return self.address if self.endpoint == "grpc" else self.http_url

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("give a number of requests or a duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the number of requests must be >= 1")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("the duration must be > 0 seconds")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("the concurrency cap must be >= 1")
        if self.timeout <= 0:
            raise ValueError("the timeout must be > 0 seconds")


@dataclass
class RunResult:
    spec: WorkloadSpec
    results: list[RequestResult]
    duration: float  # wall seconds from the first arrival to the last request's end
    started_at_unix: float
    warmup: int = 0
    notes: list[str] = field(default_factory=list)
    # 1-minute load average of the client's host before and after: other work on the machine
    # shows up here (None where the platform has no load average).
    load_before: float | None = None
    load_after: float | None = None
    # What the services' /metrics counters moved by over the run (scrape.deltas), or None.
    scraped: dict | None = None


class Progress:
    """A one-line progress bar on a stream, redrawn in place with carriage returns (a terminal),
    or a line at each tenth of the run (anything else)."""

    WIDTH = 30

    def __init__(
        self,
        label: str,
        total: int | None,
        duration: float | None,
        stream: TextIO | None = sys.stderr,
        enabled: bool = True,
    ) -> None:
        self.label, self.total, self.duration = label, total, duration
        self.stream = stream if enabled else None
        self.tty = bool(self.stream is not None and getattr(self.stream, "isatty", lambda: False)())
        self.started = time.perf_counter()
        self.done = self.ok = self.sent = 0
        self._last_draw = 0.0
        self._last_tenth = -1

    def on_sent(self) -> None:
        self.sent += 1
        self._draw()

    def on_done(self, ok: bool) -> None:
        self.done += 1
        self.ok += ok
        self._draw()

    def fraction(self) -> float:
        elapsed = time.perf_counter() - self.started
        if self.total:
            return self.done / self.total
        return min(elapsed / self.duration, 1.0) if self.duration else 0.0

    def line(self) -> str:
        frac = self.fraction()
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        failed = self.done - self.ok
        elapsed = time.perf_counter() - self.started
        return (
            f"{self.label} [{bar}] {count} done, {failed} failed, "
            f"{self.sent - self.done} in flight, {elapsed:.1f} s"
        )

    def _draw(self, force: bool = False) -> None:
        if self.stream is None:
            return
        if self.tty:
            now = time.perf_counter()
            if force or now - self._last_draw >= 0.1:
                self._last_draw = now
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()
            return
        tenth = int(self.fraction() * 10)
        if force or tenth > self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is None:
            return
        self._draw(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def to_pb(request: BenchRequest, request_id: str, options: RunOptions) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=pb.SamplingParams(
            max_tokens=request.max_tokens,
            temperature=options.temperature,
            seed=request.index,
            ignore_eos=options.ignore_eos,
        ),
    )


def _server_view(last: pb.GenerateResponse) -> dict:
    m = last.metrics
    return {
        "prompt_tokens": last.usage.prompt_tokens,
        "completion_tokens": last.usage.completion_tokens,
        "time_to_first_token_seconds": m.time_to_first_token_seconds,
        "end_to_end_seconds": m.end_to_end_seconds,
        "handoff_bytes": m.handoff.bytes,
        "handoff_seconds": m.handoff.seconds,
        "handoff_exposed_seconds": m.handoff.exposed_seconds,
        "handoff_transport": m.handoff.transport,
        "handoff_chunks": m.handoff.num_chunks,
        "handoff_wire_bytes": m.handoff.wire_bytes,
        "prefill_seconds": m.prefill_seconds,
        "queue_seconds": m.queue_seconds,
        "prefill_instance": m.prefill_instance,
        "decode_instance": m.decode_instance,
        "attempts": m.attempts,
        "prefill_path": m.prefill_path,
        "prefix_cached_tokens": m.prefix_cached_tokens,
        "prefill_cached_tokens": m.prefill_cached_tokens,
        "phases": {f.name: getattr(m.phases, f.name) for f in m.phases.DESCRIPTOR.fields},
    }


async def send_one(
    stub: pb_grpc.RouterServiceStub,
    request: BenchRequest,
    request_id: str,
    options: RunOptions,
    t0: float,
    scheduled: float,
) -> RequestResult:
    """Sends one request and records its timing; never raises for a failed call."""
    result = RequestResult(
        index=request.index,
        request_id=request_id,
        prompt_tokens=request.prompt_len,
        max_tokens=request.max_tokens,
        scheduled=scheduled,
    )
    sent = time.perf_counter()
    result.sent = sent - t0
    last: float | None = None  # when the latest tokens came; None before the first
    last_response = None
    try:
        call = stub.Generate(to_pb(request, request_id, options), timeout=options.timeout)
        async for response in call:
            now = time.perf_counter()
            k = len(response.token_ids)
            if k:
                if last is None:
                    result.ttft = now - sent
                    result.itl.extend([0.0] * (k - 1))
                else:
                    result.itl.extend([(now - last) / k] * k)
                last = now
                result.output_tokens += k
            last_response = response
        result.e2e = time.perf_counter() - sent
    except grpc.aio.AioRpcError as exc:
        result.status = exc.code().name
        result.error = (exc.details() or "")[:MAX_ERROR_LENGTH]
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - one request's failure must not end the run
        result.status = "CLIENT_ERROR"
        result.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_LENGTH]
    if last_response is not None and last_response.finish_reason:
        result.finish_reason = FINISH_NAMES.get(last_response.finish_reason, "?")
        result.server = _server_view(last_response)
    if result.ok and not result.finish_reason:
        result.status, result.error = "CLIENT_ERROR", "the stream ended without a final response"
    return result


async def fetch_model_info(
    address: str, timeout: float = CONNECT_TIMEOUT_SECONDS
) -> tuple[dict | None, str]:
    """What the target says it serves (GetModelInfo, every field), or None and why not.

    Asked once before a run so the results record the server's model rather than an assumed one;
    a target without the call (an older server, another implementation of the Router API) still
    gets benchmarked, and the reason goes into the conditions instead.
    """
    async with aio_client_channel(address) as channel:
        try:
            info = await model_info.fetch(channel, timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None, f"the target at {address} does not implement GetModelInfo"
            return None, (
                f"GetModelInfo at {address} failed: {exc.code().name} {exc.details() or ''}".strip()
            )
    return {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields}, ""


async def _connect(channel: grpc.aio.Channel, address: str) -> None:
    try:
        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        raise ConnectionError(
            f"could not connect to {address} within {CONNECT_TIMEOUT_SECONDS:.0f} s"
        ) from None


async def run_rate(
    spec: WorkloadSpec,
    options: RunOptions,
    label: str = "",
    progress_stream: TextIO | None = sys.stderr,
    show_progress: bool = True,
) -> RunResult:
    """Runs the workload at spec.rate: one open-loop pass over its requests."""
    if options.num_requests is None and math.isinf(spec.rate) and options.concurrency is None:
        raise ValueError("an infinite rate for a duration needs a concurrency cap")
    tag = f"bench-s{spec.seed}-r{spec.rate:g}"
    async with _sender(options) as send:
        notes = []
        for request in list(_take(spec, options.warmup, None)):
            warm = await send(request, f"{tag}-warmup-{request.index}", time.perf_counter(), 0.0)
            if not warm.ok:
                notes.append(f"warm-up request {request.index} failed: {warm.status} {warm.error}")
        progress = Progress(
            label or f"rate {spec.rate:g}",
            options.num_requests,
            options.duration,
            progress_stream,
            show_progress,
        )
        slots = asyncio.Semaphore(options.concurrency) if options.concurrency else None
        before = await scrape.snapshot(options.metrics_urls) if options.metrics_urls else None
        load_before = _load()
        started_unix = time.time()
        t0 = time.perf_counter()

        async def one(request: BenchRequest) -> RequestResult:
            try:
                r = await send(request, f"{tag}-{request.index}", t0, request.arrival)
            finally:
                if slots is not None:
                    slots.release()
            progress.on_done(r.ok)
            return r

        tasks = []
        try:
            for request in _take(spec, options.num_requests, options.duration):
                delay = t0 + request.arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if slots is not None:
                    await slots.acquire()
                if options.duration is not None and time.perf_counter() - t0 >= options.duration:
                    if slots is not None:
                        slots.release()
                    break
                tasks.append(asyncio.create_task(one(request)))
                progress.on_sent()
                if slots is None:
                    await asyncio.sleep(0)  # let the new call start before the next one
            results = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            progress.close()
        duration = time.perf_counter() - t0
    load_after = _load()
    scraped = None
    if before is not None:
        scraped = scrape.deltas(before, await scrape.snapshot(options.metrics_urls))
        notes += [f"metrics not read: {e}" for e in scraped["errors"]]
    return RunResult(
        spec,
        results,
        duration,
        started_unix,
        options.warmup,
        notes,
        load_before,
        load_after,
        scraped,
    )


@contextlib.asynccontextmanager
async def _sender(options: RunOptions):
    """send(request, request_id, t0, scheduled) -> RequestResult, over gRPC or the HTTP API."""
    if options.endpoint == "grpc":
        async with aio_client_channel(options.address) as channel:
            await _connect(channel, options.address)
            stub = pb_grpc.RouterServiceStub(channel)
            yield lambda request, rid, t0, at: send_one(stub, request, rid, options, t0, at)
        return
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0)  # the workload, not the client, caps concurrency
    ) as session:

        async def send(request, request_id, t0, scheduled) -> RequestResult:
            result = RequestResult(
                request.index, request_id, request.prompt_len, request.max_tokens, scheduled
            )
            result.sent = time.perf_counter() - t0
            body = openai_client.payload(
                options.endpoint, request, options.temperature, options.ignore_eos
            )
            await openai_client.send_one_http(
                session, options.http_url, options.endpoint, body, result, options.timeout
            )
            if result.ok and not result.finish_reason:
                result.status, result.error = "CLIENT_ERROR", "the stream ended without finishing"
            return result

        yield send


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _take(spec: WorkloadSpec, count: int | None, duration: float | None):
    for request in iter_requests(spec):
        if count is not None and request.index >= count:
            return
        if duration is not None and request.arrival >= duration:
            return
        yield request


async def run_sweep(
    spec: WorkloadSpec,
    rates: list[float],
    options: RunOptions,
    pause: float = 1.0,
    show_progress: bool = True,
    on_run: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Runs the same workload (same seed, so the same requests) at each rate in turn; the warm-up
    requests go before the first rate only."""
    runs = []
    for i, rate in enumerate(rates):
        if i:
            await asyncio.sleep(pause)
        opts = options if i == 0 else dataclasses.replace(options, warmup=0)
        label = f"rate {rate:g} ({i + 1}/{len(rates)})" if len(rates) > 1 else f"rate {rate:g}"
        run = await run_rate(spec.with_rate(rate), opts, label, show_progress=show_progress)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return runs
