"""The load client's HTTP side: one request to an OpenAI-compatible endpoint, streamed (SSE).

`pdserve bench --endpoint openai-completions|openai-chat` drives the router's HTTP API (or any
server with that API) through this instead of gRPC, timing each streamed token the same way, so
the two fronts can be compared at the same load.
"""

import asyncio
import json
import os
import time

import aiohttp

from pdserve.loadtest.stats import RequestResult
from pdserve.loadtest.workload import BenchRequest

ENDPOINTS = {"openai-completions": "/completions", "openai-chat": "/chat/completions"}
MAX_ERROR_LENGTH = 300
# The gRPC status names the report groups failures by, for the HTTP statuses the API uses.
HTTP_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def payload(endpoint: str, request: BenchRequest, temperature: float, ignore_eos: bool) -> dict:
    """The JSON body; ValueError for a chat request whose prompt is token ids, not text."""
    body: dict = {
        "max_tokens": request.max_tokens,
        "temperature": temperature,
        "seed": request.index,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "openai-chat":
        if not request.prompt:
            raise ValueError(
                "--endpoint openai-chat needs text prompts (--prompt-kind text or a dataset); "
                "use openai-completions for token-id prompts"
            )
        return body | {"messages": [{"role": "user", "content": request.prompt}]}
    return body | {"prompt": request.prompt or list(request.prompt_token_ids)}


def headers() -> dict:
    key = os.environ.get("PDSERVE_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def send_one_http(
    session: aiohttp.ClientSession,
    base_url: str,
    endpoint: str,
    body: dict,
    result: RequestResult,
    timeout: float,
) -> None:
    """Fills `result` from one streamed request; never raises for a failed call."""
    sent = time.perf_counter()
    last: float | None = None
    try:
        async with session.post(
            base_url.rstrip("/") + ENDPOINTS[endpoint],
            json=body,
            headers=headers(),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            if response.status != 200:
                result.status = HTTP_STATUS_NAMES.get(response.status, f"HTTP_{response.status}")
                result.error = (await response.text())[:MAX_ERROR_LENGTH]
                return
            async for event in _events(response):
                now = time.perf_counter()
                if _token_text(event) is not None:  # one event per token
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.output_tokens += 1
                _finish(event, result)
        result.e2e = time.perf_counter() - sent
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.status = "CLIENT_ERROR"
        result.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_LENGTH]


async def _events(response: aiohttp.ClientResponse):
    """Each `data:` event's JSON, until `data: [DONE]`."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _token_text(event: dict) -> str | None:
    """The text of a token chunk; None for the finish and usage chunks, and for error events."""
    choices = event.get("choices") or []
    if not choices or choices[0].get("finish_reason"):
        return None
    choice = choices[0]
    return choice["delta"].get("content") if "delta" in choice else choice.get("text")


def _finish(event: dict, result: RequestResult) -> None:
    if "error" in event:
        result.status, result.error = "STREAM_ERROR", str(event["error"])[:MAX_ERROR_LENGTH]
        return
    choices = event.get("choices") or []
    if choices and choices[0].get("finish_reason"):
        result.finish_reason = choices[0]["finish_reason"]
    if event.get("usage"):
        result.server = {
            "prompt_tokens": event["usage"]["prompt_tokens"],
            "completion_tokens": event["usage"]["completion_tokens"],
        }
