"""Correct to the token: served greedy output equals a plain single-sequence reference."""

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from procs import generate, greedy_request, start_service
import reference
from reference import check_against_reference, greedy_generate
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

PROMPT_LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 64, 100, 128, 200, 255, 256, 384, 512]
MAX_TOKENS = 24


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


def run_all(stub, concurrent: bool) -> list[list[int]]:
    def one(i_prompt):
        i, prompt = i_prompt
        tokens, _, last = generate(stub, greedy_request(prompt, MAX_TOKENS, f"c{i}"))
        # Every token arrived, counted as received (not only as the server reports it).
        assert len(tokens) == last.usage.completion_tokens == MAX_TOKENS
        return tokens

    if not concurrent:
        return [one(p) for p in enumerate(prompts())]
    with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
        return list(pool.map(one, enumerate(prompts())))


def assert_matches_reference(outputs: list[list[int]]) -> None:
    """Every served token is the reference's choice or a near-tie; with no near-tie, the whole
    output equals the reference's own greedy generation."""
    for prompt, served in zip(prompts(), outputs, strict=True):
        if check_against_reference(prompt, served).near_ties == 0:
            assert served == greedy_generate(prompt, MAX_TOKENS)


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-at-a-time", "concurrent"])
def test_disaggregated_matches_reference(stack, concurrent):
    assert_matches_reference(run_all(stack.router_stub(), concurrent))


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-at-a-time", "concurrent"])
def test_colocated_matches_reference(colocated, concurrent):
    with grpc.insecure_channel(colocated.address) as channel:
        assert_matches_reference(run_all(pb_grpc.RouterServiceStub(channel), concurrent))


@pytest.mark.parametrize("chunk_tokens", ["0", "48"], ids=["plain-loop", "48-token-chunks"])
def test_colocated_schedules_match_reference(tmp_path, chunk_tokens):
    """The plain prefill-then-decode loop, and chunks so small that every long prompt spans many
    steps that also carry decodes (the default chunk size is covered by the tests above)."""
    service = start_service(
        "colocated",
        "--torch-threads",
        "1",
        "--prefill-chunk-tokens",
        chunk_tokens,
        "--step-prompt-tokens",  # small chunks in steps without decodes too
        chunk_tokens,
        tmp_dir=str(tmp_path),
    )
    try:
        with grpc.insecure_channel(service.address) as channel:
            assert_matches_reference(run_all(pb_grpc.RouterServiceStub(channel), concurrent=True))
    finally:
        service.stop()


def test_concurrent_equals_sequential(stack):
    stub = stack.router_stub()
    sequential = run_all(stub, concurrent=False)
    concurrent = run_all(stub, concurrent=True)
    for prompt, a, b in zip(prompts(), sequential, concurrent, strict=True):
        if a != b:  # only a near-tie may split them; the reference check says whether it is one
            assert (
                check_against_reference(prompt, a).near_ties
                or check_against_reference(prompt, b).near_ties
            ), "runs differ without a near-tie"


def test_colocated_serves_the_openai_api_with_the_same_tokens(colocated):
    """`pdserve serve colocated --http-port` answers /v1/completions as the router does: a
    streamed greedy completion of token ids has the text of the gRPC Generate of the same
    prompt, and bad input gets its HTTP status."""
    import openai

    prompt = prompts()[8]
    with grpc.insecure_channel(colocated.address) as channel:
        _, expected, _ = generate(
            pb_grpc.RouterServiceStub(channel), greedy_request(prompt, MAX_TOKENS)
        )
    sdk = openai.OpenAI(base_url=colocated.http_url, api_key="k", max_retries=0, timeout=60)
    with sdk:
        stream = sdk.completions.create(
            model="tinygpt",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        with pytest.raises(openai.BadRequestError):  # past the context: 400, as the router
            sdk.completions.create(model="tinygpt", prompt=prompt, max_tokens=10**6)
        # It scores a prompt (echo) between its steps, as prefill does for the router.
        scored = (
            sdk.completions.create(
                model="tinygpt", prompt=prompt, max_tokens=0, echo=True, logprobs=1
            )
            .choices[0]
            .logprobs
        )
    assert text == expected and text
    reference_logits = reference.model().forward_contiguous(prompt, [])
    expected_logprobs = torch.log_softmax(reference_logits.double(), -1)
    assert scored.token_logprobs[0] is None and len(scored.token_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(scored.token_logprobs[i] - float(expected_logprobs[i - 1, prompt[i]])) < 1e-4
