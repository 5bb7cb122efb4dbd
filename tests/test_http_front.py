"""The HTTP front alone, over a scripted router: the statuses that a real stack rarely produces
(overload, draining, a failure after the first token), each as the openai SDK sees it."""

import asyncio

import grpc
import openai
import pytest
from aiohttp.test_utils import TestServer

from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.errors import RouterError
from pdserve.services.router.http_api import HttpApi
from pdserve.services.router.openai_schema import DEFAULT_MAX_TOKENS

SERVED = load_served_model("tinygpt", weights=False)


class ScriptedRouter:
    """Stands in for RouterServicer: yields `responses`, then raises `error` if one is set."""

    serving = True

    def __init__(self, responses=(), error: RouterError | None = None) -> None:
        self.responses, self.error = list(responses), error
        self.specs: list = []

    async def generate(self, make_spec, time_remaining, client):
        self.specs.append(make_spec())
        for response in self.responses:
            yield response
        if self.error is not None:
            raise self.error


def run(router: ScriptedRouter, call, api_key: str = ""):
    """Serves the front on a free loopback port and runs `call(client)` against it."""

    async def main():
        async with TestServer(HttpApi(router, SERVED, api_key).app(), host="127.0.0.1") as server:
            sdk = openai.AsyncOpenAI(
                base_url=str(server.make_url("/v1")), api_key="k", max_retries=0, timeout=10
            )
            async with sdk:
                return await call(sdk)

    return asyncio.run(asyncio.wait_for(main(), 30))


def tokens(*texts: str) -> list[pb.GenerateResponse]:
    """Scripted responses: one per token, the last one finished by length."""
    replies = [pb.GenerateResponse(token_ids=[1], text=t) for t in texts]
    replies[-1].finish_reason = pb.FINISH_REASON_LENGTH
    replies[-1].usage.prompt_tokens, replies[-1].usage.completion_tokens = 2, len(texts)
    return replies


def completion(sdk: openai.AsyncOpenAI, **fields):
    return sdk.completions.create(model="tinygpt", prompt="hi", **fields)


def test_overload_is_429_with_retry_after():
    router = ScriptedRouter(error=RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    with pytest.raises(openai.RateLimitError) as err:
        run(router, lambda sdk: completion(sdk, max_tokens=2))
    assert err.value.status_code == 429
    assert err.value.response.headers["Retry-After"] == "1"
    assert err.value.body == {
        "message": "queue full",
        "type": "rate_limit_error",
        "param": None,
        "code": "RESOURCE_EXHAUSTED",
    }


def test_draining_is_503():
    router = ScriptedRouter(error=RouterError(grpc.StatusCode.UNAVAILABLE, "draining"))
    with pytest.raises(openai.InternalServerError) as err:
        run(router, lambda sdk: completion(sdk, stream=True))
    assert err.value.status_code == 503  # a stream refused before its first token: a status


def test_failure_after_the_first_token_ends_the_stream_with_an_error_event():
    router = ScriptedRouter(
        [pb.GenerateResponse(token_ids=[1], text="a")],
        RouterError(grpc.StatusCode.UNAVAILABLE, "decode died"),
    )

    async def read(sdk):
        seen = []
        with pytest.raises(openai.APIError) as err:
            async for chunk in await completion(sdk, stream=True):
                seen.append(chunk.choices[0].text)
        return seen, err.value

    seen, err = run(router, read)
    assert seen == ["a"] and "decode died" in err.message


def test_eos_finishes_as_stop_and_usage_is_reported():
    router = ScriptedRouter(tokens("a", "b"))
    router.responses[-1].finish_reason = pb.FINISH_REASON_EOS
    reply = run(router, lambda sdk: completion(sdk, max_tokens=5))
    assert reply.choices[0].text == "ab" and reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2, 2)


def test_fields_reach_the_spec():
    router = ScriptedRouter(tokens("x"))
    fields = dict(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n", "."])
    run(router, lambda sdk: completion(sdk, **fields, extra_body={"top_k": 4, "ignore_eos": True}))
    s = router.specs[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (7, 0.5, 0.9, 3, ("\n", "."))
    assert (s.top_k, s.ignore_eos) == (4, True)
    assert router.specs[0].prompt_token_ids == tuple(b"hi")


def test_max_tokens_defaults_to_the_rest_of_the_context_capped():
    router = ScriptedRouter(tokens("x"))
    run(router, lambda sdk: completion(sdk))
    assert router.specs[0].sampling.max_tokens == DEFAULT_MAX_TOKENS
    long = ScriptedRouter(tokens("x"))
    prompt = [1] * (SERVED.config.max_context - 10)
    run(long, lambda sdk: sdk.completions.create(model="tinygpt", prompt=prompt))
    assert long.specs[0].sampling.max_tokens == 10


def test_max_completion_tokens_and_max_tokens_must_agree():
    router = ScriptedRouter(tokens("x"))
    messages = [{"role": "user", "content": "hi"}]

    def chat(**fields):
        return lambda sdk: sdk.chat.completions.create(model="tinygpt", messages=messages, **fields)

    with pytest.raises(openai.BadRequestError) as err:
        run(router, chat(max_tokens=3, max_completion_tokens=4))
    assert err.value.body["param"] == "max_completion_tokens"
