"""Property-based fuzzing (hypothesis, a bounded number of examples) of the two ways in:
RouterService.Generate, and the KV ingest path that every transport shares.

Invariants: every call ends with a status from a fixed set, never a crash or a hang; the decode
pool is whole again afterwards; and the service still serves a normal request.
"""

import asyncio


import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from procs import generate, greedy_request, wait_until
from pdserve.core.block_pool import BlockPool
from pdserve.core.config import ModelConfig
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
        sink.commit(3)
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
