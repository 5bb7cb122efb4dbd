"""Conditional disaggregation: short prompts prefilled on the decode instance itself.

The threshold's arithmetic is checked alone; end to end, a stack whose router sends prompts of
at most 16 tokens to decode must give the same tokens as a stack that hands every prompt off,
say in its final response which path each request took, and leave decode's pool whole.
"""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import REGISTRY

from procs import Stack, generate, greedy_request, start_router, start_service, wait_until
from pdserve.services.router.local_prefill import LOCAL_CAP_TOKENS, MIN_SAMPLES, LocalPrefill
from pdserve.v1 import pdserve_pb2 as pb


def reply(prompt_tokens: int, compute_ms_per_token: float, exposed_ms_per_token: float):
    return pb.PrefillResponse(
        prefill_seconds=prompt_tokens * compute_ms_per_token / 1e3,
        handoff=pb.Handoff(
            bytes=prompt_tokens * 1000,
            seconds=0.01,
            exposed_seconds=prompt_tokens * exposed_ms_per_token / 1e3,
        ),
    )


def test_the_threshold_follows_the_measured_costs():
    assert LocalPrefill("0").threshold() == 0 and not LocalPrefill("0").here(1)
    assert LocalPrefill("24").here(24) and not LocalPrefill("24").here(25)
    fast_link = LocalPrefill("auto")
    for _ in range(MIN_SAMPLES - 1):  # 0.1 ms/token compute, 0.02 exposed, 4 ms overhead
        fast_link.observe(100, 100, reply(100, 0.1, 0.02), ttft=0.004 + 0.010 + 0.002)
        assert fast_link.threshold() == 0  # too few measurements to move anything yet
    fast_link.observe(100, 100, reply(100, 0.1, 0.02), ttft=0.004 + 0.010 + 0.002)
    assert abs(fast_link.threshold() - 50) <= 1  # h / (c - e) = 4 ms / 0.08 ms per token
    slow_link = LocalPrefill("auto")
    for _ in range(MIN_SAMPLES):  # the link exposes more per token than compute costs
        slow_link.observe(100, 100, reply(100, 0.1, 0.5), ttft=0.004 + 0.010 + 0.050)
    assert slow_link.threshold() == LOCAL_CAP_TOKENS


def decisions(path: str, reason: str) -> float:
    labels = {"service": "router", "path": path, "reason": reason}
    return REGISTRY.get_sample_value("pdserve_prefill_decisions_total", labels) or 0.0


@pytest.mark.parametrize(
    "setting, prompt, cached, path, reason",
    [
        ("24", 24, 0, "decode", "below_threshold"),
        ("24", 40, 20, "decode", "prefix_cached"),
        ("24", 40, 0, "prefill", "above_threshold"),
        ("0", 3, 0, "prefill", "local_prefill_off"),
        ("auto", 3, 0, "prefill", "measuring"),
    ],
)
def test_each_decision_is_counted_with_its_reason(setting, prompt, cached, path, reason):
    before = decisions(path, reason)
    assert LocalPrefill(setting).decide(prompt, cached) == (path == "decode")
    assert decisions(path, reason) == before + 1


def test_auto_shows_the_rates_it_measured():
    local = LocalPrefill("auto")
    local.observe(100, 100, reply(100, 0.5, 0.02), ttft=0.1)  # 0.5 ms a token: 2,000 tokens/s
    rate = REGISTRY.get_sample_value(
        "pdserve_measured_prefill_tokens_per_second", {"service": "router"}
    )
    assert rate == pytest.approx(2000)
    handoff = REGISTRY.get_sample_value(
        "pdserve_measured_handoff_bytes_per_second", {"service": "router"}
    )
    assert handoff == pytest.approx(100 * 1000 / 0.01)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """One decode and one prefill, behind two routers: one sends prompts of at most 16 tokens to
    decode, the other hands every prompt off."""
    tmp = str(tmp_path_factory.mktemp("local-prefill"))
    decode = start_service("decode", "--torch-threads", "1", tmp_dir=tmp)
    prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
    local = start_router([prefill], [decode], "--local-prefill-tokens", "16", tmp_dir=tmp)
    remote = start_router([prefill], [decode], tmp_dir=tmp)
    pair = (Stack(local, [prefill], [decode]), Stack(remote, [prefill], [decode]))
    yield pair
    for service in (local, remote, prefill, decode):
        service.stop()


def seeded(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.9, seed=11, ignore_eos=True
        ),
    )


@pytest.mark.parametrize("make", [greedy_request, seeded], ids=["greedy", "seeded"])
def test_short_prompts_are_prefilled_on_decode_with_the_same_tokens(stacks, make):
    local, remote = stacks
    short, long = make(list(range(3, 15)), 20), make(list(range(3, 40)), 20)
    here, _, last = generate(local.router_stub(), short)
    assert last.metrics.prefill_path == "decode"
    assert last.metrics.handoff.bytes == 0 and last.metrics.prefill_instance == ""
    assert last.usage.prompt_tokens == 12 and last.usage.completion_tokens == 20
    handed_off, _, last = generate(remote.router_stub(), short)
    assert last.metrics.prefill_path == "prefill" and last.metrics.handoff.bytes > 0
    assert here == handed_off
    _, _, last = generate(local.router_stub(), long)  # over the threshold: handed off
    assert last.metrics.prefill_path == "prefill"
    wait_until(local.pools_settled, 10, "decode's pool to be whole")


def test_local_prefills_beside_running_streams_all_match(stacks):
    """24 requests at once, short and long mixed, through both routers: every output is the
    same whichever path its prompt took."""
    local, remote = stacks
    prompts = [[(7 * i + j) % 200 + 1 for j in range(4 + (i * 5) % 40)] for i in range(24)]

    def run(stack: Stack):
        with ThreadPoolExecutor(24) as pool:
            return list(
                pool.map(lambda p: generate(stack.router_stub(), greedy_request(p, 16)), prompts)
            )

    through_local, through_remote = run(local), run(remote)
    paths = [last.metrics.prefill_path for _, _, last in through_local]
    assert paths.count("decode") == sum(len(p) <= 16 for p in prompts) > 0
    assert [tokens for tokens, _, _ in through_local] == [t for t, _, _ in through_remote]
    wait_until(local.pools_settled, 10, "decode's pool to be whole")


def test_a_client_that_leaves_a_locally_prefilled_stream_frees_its_blocks_at_once(stacks):
    """The cancel frees the blocks, not the request's end: the pool is whole again in a small
    part of the time the rest of the request would take at the rate measured here."""
    local, _ = stacks
    wanted, before_cancel = 4000, 20
    call = local.router_stub().Generate(greedy_request(list(range(1, 13)), wanted), timeout=300)
    received, first_at = 0, None
    for response in call:
        first_at = first_at or time.monotonic()
        received += len(response.token_ids)
        if received >= before_cancel:
            break
    assert first_at is not None and received < wanted
    assert last_metrics_path(local) == "decode"
    seconds_per_token = (time.monotonic() - first_at) / (received - 1)
    call.cancel()
    cancelled_at = time.monotonic()
    with pytest.raises(grpc.RpcError):
        list(call)
    rest = (wanted - received) * seconds_per_token
    wait_until(local.pools_settled, max(60.0, rest), "decode's pool to be whole after the cancel")
    freed_after = time.monotonic() - cancelled_at
    assert freed_after < rest / 4, f"freed {freed_after:.1f} s after the cancel; rest {rest:.1f} s"


def last_metrics_path(stack: Stack) -> str:
    """Where a short prompt is prefilled through this router: a 2-token request's answer."""
    _, _, last = generate(stack.router_stub(), greedy_request(list(range(1, 13)), 2))
    return last.metrics.prefill_path


def test_auto_derives_a_threshold_from_handed_off_requests(stacks, tmp_path):
    """With auto, the router learns from requests that went through prefill, logs the threshold
    it derived, and then sends prompts up to it to decode and longer ones to prefill."""
    local, _ = stacks
    prefill, decode = local.prefills[0], local.decodes[0]
    router = start_router(
        [prefill], [decode], "--local-prefill-tokens", "auto", tmp_dir=str(tmp_path)
    )
    try:
        stack = Stack(router, [prefill], [decode])
        for i in range(MIN_SAMPLES):
            _, _, last = generate(stack.router_stub(), greedy_request([i + 1] * 600, 2))
            assert last.metrics.prefill_path == "prefill"  # nothing learnt yet, or too long
        found = wait_until(
            lambda: re.findall(r"local prefill threshold now (\d+) tokens", router.log()),
            10,
            "the router to log the threshold it derived",
        )
        threshold = int(found[-1])
        assert 0 < threshold <= LOCAL_CAP_TOKENS
        _, _, last = generate(stack.router_stub(), greedy_request([5] * threshold, 2))
        assert last.metrics.prefill_path == "decode"
        if threshold < LOCAL_CAP_TOKENS:
            _, _, last = generate(stack.router_stub(), greedy_request([5] * (threshold + 40), 2))
            assert last.metrics.prefill_path == "prefill"
        wait_until(stack.pools_settled, 10, "decode's pool to be whole")
    finally:
        router.stop()


def test_a_one_token_reply_prefilled_on_decode_counts_its_token(stacks):
    """The first token is also the last: its emission reaches the stream while the engine thread
    is still recording the sequence, and the usage must count it all the same."""
    local, _ = stacks
    for i in range(40):
        tokens, _, last = generate(local.router_stub(), greedy_request([i + 1, 2, 3], 1))
        assert last.metrics.prefill_path == "decode"
        assert len(tokens) == 1 and last.usage.completion_tokens == 1
