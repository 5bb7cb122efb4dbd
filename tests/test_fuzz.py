"""Fuzzing of the three ways in: RouterService.Generate and the KV ingest path that every
transport shares (property-based, hypothesis, a bounded number of examples), and the HTTP JSON
front (2,000 mutated bodies from a fixed seed, sent to the session stack's router).

Invariants: every call ends with a status from a fixed set, never a crash or a hang; the decode
pool is whole again afterwards; and the service still serves a normal request.
"""

import asyncio
import collections
import copy
import json
import random
import time

import aiohttp
import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from procs import generate, greedy_request, wait_until
from pdserve.core.block_pool import BlockPool
from pdserve.core.config import ModelConfig
from pdserve.core.picked import Pick
from pdserve.engine.paged_cache import PagedCache
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.faults import Faults
from pdserve.kv import frames
from pdserve.kv.inproc import InProcessKvSink
from pdserve.kv.leases import LeaseLimits, LeaseState, LeaseTable
from pdserve.kv.receiver import KvReceiver, KvStream
from pdserve.kv.sink import KvTarget
from pdserve.kv.wire import KvRejected
from pdserve.v1 import pdserve_pb2 as pb

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,  # bad input, named
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # larger than the pool, or no room in time
    grpc.StatusCode.DEADLINE_EXCEEDED,  # the test's own bound on a long generation
}
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.integers(-5, 40),
    temperature=floats,
    top_p=floats,
    top_k=st.integers(-3, 300),
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=12), max_size=3),
    ignore_eos=st.booleans(),
)
requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=20),
    prompt=st.text(max_size=60),
    prompt_token_ids=st.lists(st.integers(-10, 300), max_size=40),
    sampling=sampling,
    messages=st.lists(
        st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "x"]), content=st.text()),
        max_size=2,
    ),
)


@FUZZ
@given(request=requests)
def test_generate_ends_with_an_allowed_status_and_leaves_the_pool_whole(stack, request):
    stub = stack.router_stub()
    code = grpc.StatusCode.OK
    try:
        for _ in stub.Generate(request, timeout=20):
            pass
    except grpc.RpcError as exc:
        code = exc.code()
    assert code in ALLOWED, (code, request)
    wait_until(stack.pools_settled, 10, "the decode pool to be whole again")


def test_the_stack_still_serves_after_the_fuzzing(stack):
    tokens, _, _ = generate(stack.router_stub(), greedy_request([5, 6, 7], 3))
    assert len(tokens) == 3


# ------------------------------------------------------------------------------ KV ingest

CONFIG = ModelConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=50, max_context=256)
PROMPT = tuple(range(1, 21))


def _decode_side():
    pool = BlockPool(8, 16)
    leases = LeaseTable(pool, CONFIG)
    cache = PagedCache(CONFIG, 8, 16)
    receiver = KvReceiver(
        leases, cache.write, CONFIG, "m", lambda lease, t: lease.table.release(), Faults()
    )
    return pool, leases, receiver


def _valid_messages(lease_id: str) -> list[bytes]:
    async def make():
        sink = InProcessKvSink(
            KvTarget(lease_id, "r", PROMPT, CONFIG, "m", 1 << 10), Faults(), receiver=None
        )  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(0)  # the same stream every example: hypothesis
        shape = (len(PROMPT), CONFIG.kv_heads, CONFIG.head_dim)  # replays draws by position
        for layer in range(CONFIG.n_layers):
            k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            sink.on_layer_kv(layer, k, v)
        await asyncio.sleep(0)
        sink.commit(Pick(3))
        return [frames.join_message(item) async for item in sink.items()]

    return asyncio.run(make())


@FUZZ
@given(data=st.data())
def test_kv_ingest_refuses_or_accepts_and_never_leaks(data):
    """A valid stream, with one message flipped, cut, dropped or replaced by random bytes."""
    pool, leases, receiver = _decode_side()
    lease = leases.grant(
        GenerateSpec("r", PROMPT, SamplingSpec(max_tokens=4)),
        LeaseLimits(30, 30, 1.0),
        lambda e: None,
    )
    messages = _valid_messages(lease.lease_id)
    i = data.draw(st.integers(0, len(messages) - 1))
    how = data.draw(st.sampled_from(["flip", "cut", "drop", "random", "none"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(messages[i]) - 1))
        damaged = bytearray(messages[i])
        damaged[at] ^= data.draw(st.integers(1, 255))
        messages[i] = bytes(damaged)
    elif how == "cut":
        messages[i] = messages[i][: data.draw(st.integers(0, len(messages[i]) - 1))]
    elif how == "drop":
        del messages[i]
    elif how == "random":
        messages[i] = data.draw(st.binary(max_size=200))
    stream = KvStream("fuzz")
    committed = None
    try:
        for message in messages:
            committed = frames.deliver(receiver, stream, frames.read_frame(message))
            if committed is not None:
                break
    except KvRejected as exc:
        receiver.refuse(stream, str(exc))
    if committed is None:
        receiver.refuse(stream, "stream over")
        leases.void(lease, "test over")
    assert lease.state in (LeaseState.COMMITTED, LeaseState.VOID)
    assert pool.available_blocks == pool.num_blocks  # committed ones were released at once
    assert how != "none" or committed is not None  # the undamaged stream commits


# ------------------------------------------------------------------------------ HTTP JSON front

HTTP_SEED = 20261201  # the bodies are the same on every run
HTTP_BODIES = 2_000
HTTP_CONCURRENCY = 8
# Every status a body may get: OK, bad input, another model, too large, too fast. Never 5xx.
HTTP_ALLOWED = {200, 400, 404, 413, 429}
HTTP_BASES = [
    {"model": "tinygpt", "prompt": "hi", "max_tokens": 2},
    {"prompt": [5, 6, 7], "max_tokens": 1, "ignore_eos": True, "seed": 3, "temperature": 0.7},
    {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    {"prompt": ["hi"], "max_tokens": 2, "top_p": 0.9, "top_k": 5, "stop": ["\n", "."]},
    {"model": "tinygpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "hi"}]}], "n": 1},
]
HTTP_FIELDS = sorted(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature"}
    | {"top_p", "top_k", "seed", "stop", "ignore_eos", "stream", "stream_options", "n"}
    | {"frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens"}
    | {"stop_token_ids", "logit_bias", "logprobs", "top_logprobs", "echo", "best_of"}
    | {"user", "metadata"}
)
HOSTILE_VALUES = [
    None, True, False, 0, 1, -1, 0.5, -0.0, 2**31, -(2**31), 2**63, 2**64, -(2**64),
    10**400, -(10**399), 1e308, -1e308, 5e-324, float("nan"), float("inf"), float("-inf"),
    "", "x", "NaN", "1", "tinygpt", "\ud800", "\udfff", "a\udc80b", "\U0001f600", "\u202e\u0000",
    "\x00", "é" * 3, "x" * 10_000, [], [1], [7] * 5_000, [300] * 10, ["x"], [None], [[[]]],
    [{"type": "text", "text": 1}], {}, {"a": 1}, {"include_usage": "yes"}, {"5": 1e400},
    {"99999999999": 1}, {"\ud800": 1},
]  # fmt: skip
ODD_NAMES = ["", "tools", "\ud800", "\U0001f600" * 3, "n" * 5_000, "model ", "MODEL", "\x00"]


def _hostile_value(rng):
    value = copy.deepcopy(rng.choice(HOSTILE_VALUES))  # a body may be mutated further
    for _ in range(rng.choice([0, 0, 0, 1, 3, 50])):  # now and then, nested
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def _mutate_fields(rng, body: dict) -> object:
    """One change to the body's fields: a field set, added, removed, or the whole replaced."""
    how = rng.choice(["set", "set", "set", "add", "remove", "replace", "message"])
    if how == "set":
        name = rng.choice(HTTP_FIELDS)
        value = _hostile_value(rng)
        if name in ("max_tokens", "max_completion_tokens") and value is None:
            value = 2  # unset, it means up to 1024 tokens: the test's time, not a finding
        body[name] = value
    elif how == "add":
        body[rng.choice(ODD_NAMES)] = _hostile_value(rng)
    elif how == "remove" and body:
        name = rng.choice(sorted(body))
        if name not in ("max_tokens", "max_completion_tokens"):
            del body[name]
    elif how == "replace":
        return _hostile_value(rng)
    elif how == "message":
        body["messages"] = [rng.choice([{"role": "user"}, {"content": "x"}, _hostile_value(rng)])]
    return body


def _mutate_bytes(rng, data: bytes) -> bytes:
    """One change to the body's bytes: cut, a byte flipped, junk, deep nesting, a raw escape."""
    at = rng.randrange(len(data) + 1)
    how = rng.choice(["cut", "flip", "junk", "nest", "escape", "digits"])
    if how == "cut":
        return data[:at]
    if how == "flip" and data:
        i = min(at, len(data) - 1)
        return data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1 :]
    if how == "junk":
        return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8))) + data[at:]
    if how == "nest":
        depth = rng.choice([100, 1_000, 100_000])
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'
    if how == "escape":
        escape = rng.choice([b"\\ud800", b"\\udc00\\ud800", b"\\u0000", b"\\uZZZZ", b"\\"])
        return data.replace(b'"hi"', b'"hi' + escape + b'"', 1)
    return data.replace(b"2", b"9" * rng.choice([20, 400, 5_000]), 1)  # "digits"


def http_bodies(seed: int = HTTP_SEED, count: int = HTTP_BODIES) -> list[bytes]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        body: object = copy.deepcopy(rng.choice(HTTP_BASES))
        for _ in range(rng.choice([1, 1, 2, 3])):
            body = _mutate_fields(rng, body) if isinstance(body, dict) else body
        data = json.dumps(body).encode()  # NaN, Infinity and lone surrogates as Python writes
        if rng.random() < 0.3:
            data = _mutate_bytes(rng, data)
        bodies.append(data)
    return bodies


async def _post_all(url: str, bodies: list[bytes]) -> list[tuple[int, bytes, bytes]]:
    """(status, reply, body) for each body, HTTP_CONCURRENCY at a time."""
    limit = asyncio.Semaphore(HTTP_CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def post(data: bytes) -> tuple[int, bytes, bytes]:
            path = "/chat/completions" if b'"messages"' in data else "/completions"
            async with limit:
                headers = {"Content-Type": "application/json"}
                async with session.post(url + path, data=data, headers=headers) as reply:
                    return reply.status, await reply.read(), data

        return await asyncio.gather(*(post(data) for data in bodies))


def _well_formed(status: int, reply: bytes) -> bool:
    """An error in OpenAI's shape, or a reply; a stream with no internal error in its events
    (after its headers, a failure can only be an event)."""
    if status != 200:
        return set(json.loads(reply)["error"]) == {"message", "type", "param", "code"}
    return b'"internal_error"' not in reply


def test_http_bodies_never_get_a_500_and_leave_the_pool_whole(stack):
    bodies = http_bodies()
    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(_post_all(stack.router.http_url, bodies), 240))
    took = time.monotonic() - started
    statuses = collections.Counter(status for status, _, _ in results)
    wrong = [(s, r[:300], b[:200]) for s, r, b in results if s not in HTTP_ALLOWED]
    assert not wrong, (statuses, wrong[:5])
    malformed = [(s, r[:300], b[:200]) for s, r, b in results if not _well_formed(s, r)]
    assert not malformed, malformed[:5]
    assert statuses[200] > 50 and statuses[400] > 500, statuses  # both kinds were exercised
    wait_until(stack.pools_settled, 15, "the decode pool to be whole after the HTTP fuzzing")
    tokens, _, _ = generate(stack.router_stub(), greedy_request([5, 6, 7], 3))
    assert len(tokens) == 3, f"still serving after {len(bodies)} bodies in {took:.1f} s"


def test_http_bodies_are_the_same_on_every_run():
    assert http_bodies(count=200) == http_bodies(count=200)
    assert len(set(http_bodies())) > HTTP_BODIES * 0.6  # mostly different bodies
