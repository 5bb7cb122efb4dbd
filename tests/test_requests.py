"""Request handling through real servers: load, sampling, bad input, cancellation."""

import pathlib
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from procs import generate, greedy_request, wait_until
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc


def test_64_concurrent_mixed_requests_all_finish(stack):
    rng = random.Random(11)
    jobs = [
        ([rng.randrange(256) for _ in range(rng.randint(1, 300))], rng.randint(1, 40))
        for _ in range(64)
    ]
    stub = stack.router_stub()

    def one(job):
        prompt, max_tokens = job
        tokens, _, last = generate(stub, greedy_request(prompt, max_tokens), timeout=120)
        return len(tokens), max_tokens, last

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, jobs))
    for n, max_tokens, last in results:
        assert n == max_tokens
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == max_tokens
        assert last.metrics.handoff.bytes > 0


def test_final_response_reports_usage_and_handoff(stack):
    prompt = list(b"How many bytes does this prompt's KV cache take?")
    _, _, last = generate(stack.router_stub(), greedy_request(prompt, 5))
    assert last.usage.prompt_tokens == len(prompt)
    # KV bytes = 2 x layers x heads x head_dim x tokens x 4 bytes (fp32).
    assert last.metrics.handoff.bytes == 2 * 6 * 4 * 64 * len(prompt) * 4
    assert last.metrics.time_to_first_token_seconds > 0
    assert last.metrics.end_to_end_seconds >= last.metrics.time_to_first_token_seconds
    assert last.metrics.prefill_instance.startswith("prefill@")
    assert last.metrics.decode_instance.startswith("decode@")


def sampled(
    seed: int, prompt: str = "The same seed, the same tokens", **shaping
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(
            max_tokens=24,
            temperature=0.9,
            top_p=0.95,
            top_k=50,
            seed=seed,
            ignore_eos=True,
            **shaping,
        ),
    )


# Seeds 2 and 3 also shape the logits: what they read (the prompt, the output so far) must be
# the same on prefill, on decode and in the colocated engine.
SHAPING = {
    1: {},
    2: {"min_p": 0.05, "logit_bias": {101: 3.0}},
    3: {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
}


def test_seeded_sampling_is_identical_across_paths(stack, colocated):
    with grpc.insecure_channel(colocated.address) as channel:
        colocated_stub = pb_grpc.RouterServiceStub(channel)
        for seed, shaping in SHAPING.items():
            disaggregated, _, _ = generate(stack.router_stub(), sampled(seed, **shaping))
            again, _, _ = generate(stack.router_stub(), sampled(seed, **shaping))
            baseline, _, _ = generate(colocated_stub, sampled(seed, **shaping))
            assert disaggregated == again == baseline
    other, _, _ = generate(stack.router_stub(), sampled(4))
    assert other != disaggregated


def test_stop_string_ends_generation_without_it(stack):
    # Find what the model says greedily, then stop on a piece of it.
    prompt = "stop here"
    tokens, text, _ = generate(stack.router_stub(), greedy_request(list(prompt.encode()), 24))
    printable = [i for i, t in enumerate(tokens) if 32 <= t < 127]
    assert printable, "the model produced no ASCII token to stop on"
    at = printable[len(printable) // 2]
    stop = chr(tokens[at])
    request = pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True)
    )
    _, stopped_text, last = generate(stack.router_stub(), request)
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert stop not in stopped_text
    assert last.usage.completion_tokens <= at + 1


BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), "empty"),
    "both prompt and ids": (
        pb.GenerateRequest(
            prompt="a", prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=4)
        ),
        "not several",
    ),
    "token id too large": (
        pb.GenerateRequest(prompt_token_ids=[1, 99999], sampling=pb.SamplingParams(max_tokens=4)),
        "outside the vocabulary",
    ),
    "negative token id": (
        pb.GenerateRequest(prompt_token_ids=[-1], sampling=pb.SamplingParams(max_tokens=4)),
        "outside the vocabulary",
    ),
    "over the context": (
        pb.GenerateRequest(prompt_token_ids=[1] * 4000, sampling=pb.SamplingParams(max_tokens=200)),
        "context length",
    ),
    "max_tokens zero": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=0)),
        "max_tokens",
    ),
    # Refused before any work on the prompt: 2 million ids took the router's loop for 0.7 s.
    "2 million token ids": (
        pb.GenerateRequest(
            prompt_token_ids=[1] * 2_000_000, sampling=pb.SamplingParams(max_tokens=4)
        ),
        "2000000 token ids, over the context length",
    ),
    "a text far over the context": (
        pb.GenerateRequest(prompt="a" * 3_000_000, sampling=pb.SamplingParams(max_tokens=4)),
        "3000000 characters",
    ),
    "first_step set by a client": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=4, first_step=5)),
        "first_step is the router's",
    ),
    "max_tokens negative": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=-3)),
        "max_tokens",
    ),
    "temperature negative": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=4, temperature=-0.5)),
        "temperature",
    ),
    "top_p above one": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=4, top_p=1.5)),
        "top_p",
    ),
    "top_p negative": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=4, top_p=-0.1)),
        "top_p",
    ),
    "top_k negative": (
        pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=4, top_k=-1)),
        "top_k",
    ),
    "request_id forging a log line": (
        pb.GenerateRequest(
            request_id="r1\n2026-11-30 INFO router: forged",
            prompt="a",
            sampling=pb.SamplingParams(max_tokens=4),
        ),
        "printable ASCII",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_service_keeps_serving(stack, colocated, case):
    request, words = BAD_REQUESTS[case]
    with grpc.insecure_channel(colocated.address) as channel:
        for stub in (stack.router_stub(), pb_grpc.RouterServiceStub(channel)):
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in err.value.details()
            tokens, _, _ = generate(stub, greedy_request([1, 2, 3], 2), timeout=30)
            assert len(tokens) == 2


def test_client_cancel_mid_stream_frees_decode_blocks(stack):
    start = stack.pool_stats()
    call = stack.router_stub().Generate(greedy_request(list(range(200)), 2000), timeout=60)
    first = next(call)
    assert first.token_ids
    held = stack.pool_stats()
    assert held.free_blocks < start.free_blocks and held.running == 1
    call.cancel()
    wait_until(
        lambda: stack.pool_stats().free_blocks == start.free_blocks,
        10,
        "blocks to be freed after the client cancelled",
    )
    assert stack.pool_stats().running == 0


def test_deadline_is_propagated(stack):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.router_stub(), greedy_request(list(range(100)), 3000), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The stack fixture then checks that decode freed the blocks the request held.


# A field tag with wire type 7, which does not exist: no protobuf parser accepts these bytes.
UNDECODABLE = b"\x0f\xff\xff\xff"

UNDECODABLE_METHODS = {
    "router": ("/pdserve.v1.RouterService/Generate", "unary_stream"),
    "prefill": ("/pdserve.v1.PrefillService/Prefill", "unary_unary"),
    "decode": ("/pdserve.v1.DecodeService/GetPoolStats", "unary_unary"),
}


@pytest.mark.parametrize("role", list(UNDECODABLE_METHODS))
def test_undecodable_protobuf_is_invalid_argument_logged_once(stack, role):
    """Bytes that are not the method's message: INVALID_ARGUMENT with the message type named,
    never UNKNOWN, and 20 of them leave one log line, not 20 tracebacks."""
    service = {"router": stack.router, "prefill": stack.prefills[0], "decode": stack.decodes[0]}[
        role
    ]
    method, kind = UNDECODABLE_METHODS[role]
    # The stack is shared: only what this test's requests logged counts. (gRPC's own ERROR
    # with a traceback, "ExecuteBatchError raised in core", when a client cancels a stream as
    # its status goes out, was once in the log from an earlier test.)
    earlier = pathlib.Path(service.log_path).stat().st_size

    def logged() -> str:
        with open(service.log_path, "rb") as f:
            f.seek(earlier)
            return f.read().decode(errors="replace")

    with grpc.insecure_channel(service.address) as channel:
        call = getattr(channel, kind)(method)  # no serializer: the raw bytes go as they are
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as err:
                result = call(UNDECODABLE, timeout=10)
                list(result) if kind == "unary_stream" else result
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not a valid" in err.value.details() and "Request" in err.value.details()
    wait_until(lambda: "is not a valid" in logged(), 5, "the refusal in the log")
    log = logged()
    assert log.count("is not a valid") == 1, log
    assert "Traceback" not in log
    assert stack.pool_stats().free_blocks == stack.pool_stats().total_blocks
