"""`n` completions of one prompt: one prefill and one handoff, the prompt's KV blocks shared on
decode, and completion i equal to a request of one completion with seed + i.

The block accounting of forked tables is checked alone; end to end through the official `openai`
SDK, on a stack that hands every prompt off, on a router over the same instances that prefills
every prompt on decode, and on the colocated engine.
"""

import asyncio
import contextlib

import openai
import pytest

from procs import Stack, free_port, start_router, start_stack, wait_until
from test_metrics import scrape
from pdserve.core.block_pool import BlockPool, NeverFits
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.core.client_shares import ClientLimit
from pdserve.kv.leases import LeaseLimits, LeaseTable
from pdserve.models.loading import load_served_model
from pdserve.services.router.merged import merged
from pdserve.v1 import pdserve_pb2 as pb

TIMEOUT = 60.0
PROMPT = "Disaggregated serving moves the KV cache of a prompt once"  # 58 bytes: 4 blocks of 16
SEED = 11
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=SEED, max_tokens=12)


# --- the pool: forked tables ---


def test_forks_share_the_prompt_blocks_and_all_come_back_in_any_order():
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        pool = BlockPool(num_blocks=40, block_size=4)
        prompt = list(range(10))  # blocks 0-1 full, block 2 holds the last token
        table = pool.reserve(14, prompt, choices=3)  # 4 blocks each; forks share 2
        assert pool.available_blocks == 40 - (4 + 2 * 2)
        table.ensure(10)
        table.prompt_written = True
        forks = [table.fork(), table.fork()]
        for fork in forks:
            assert fork.blocks[:2] == table.blocks[:2]  # shared, read only
            assert fork.blocks[2] not in table.blocks  # its own copy of the last token's block
        with pytest.raises(RuntimeError, match="no room"):
            table.fork()  # the reservation held room for two forks, not three
        for fork in forks:
            fork.ensure(14)
        tables = [table, *forks]
        for i in order:
            tables[i].release()
            if i != order[-1]:
                assert pool.available_blocks < 40
        assert pool.available_blocks == 40


def test_forked_prompt_blocks_stay_cached_once_the_last_table_is_released():
    pool = BlockPool(num_blocks=20, block_size=4, prefix_cache=True)
    prompt = list(range(8))  # two full blocks; the second holds the last token
    table = pool.reserve(12, prompt, choices=2)
    table.ensure(8)
    table.prompt_written = True
    fork = table.fork()
    table.release()  # the first completion ends first: its full prompt blocks wait for the fork
    assert pool.cached_blocks == 0
    fork.release()
    assert pool.cached_blocks == 2 and pool.available_blocks == 20
    again = pool.reserve(12, prompt + [99], reuse=True)
    assert again.cached_tokens == 8  # found again, parents before children
    again.release()


def test_a_request_whose_completions_do_not_fit_the_pool_never_fits():
    pool = BlockPool(num_blocks=10, block_size=4)
    pool.reserve(16, list(range(8)), choices=2).release()  # 4 + 3 blocks
    with pytest.raises(NeverFits, match="each of 4 completions"):
        pool.reserve(16, list(range(8)), choices=4)  # 4 + 3 * 3 blocks


def test_a_lease_for_n_completions_holds_and_counts_every_completion():
    """Decode's lease reserves every completion's room, and the per-client share counts it."""
    pool = BlockPool(num_blocks=64, block_size=4)
    leases = LeaseTable(pool, load_served_model("tinygpt", weights=False).config)
    limits = LeaseLimits(ttl=30, first_chunk=30, pending_share=1.0, client_share=0.25)
    spec = GenerateSpec("r", tuple(range(10)), SamplingSpec(max_tokens=6, n=4), client="a")
    lease = leases.grant(spec, limits, sink=lambda emission: None)
    assert lease.reserved_blocks == 4 + 3 * 2 == 64 - pool.available_blocks
    with pytest.raises(ClientLimit):  # 20 blocks, over the client's 16
        leases.grant(spec, limits, sink=lambda emission: None)
    leases.void(lease, "test over")
    assert pool.available_blocks == 64


def test_merged_streams_interleave_and_a_failure_closes_the_others():
    """The router's merge of moved completions: every item of every stream, and the first
    error ends the whole, closing the streams still open (their backend calls are cancelled)."""
    closed = []

    async def stream(name: str, items: int, fail: bool = False):
        try:
            for i in range(items):
                await asyncio.sleep(0)
                yield f"{name}{i}"
            if fail:
                raise RuntimeError("decode gone")
            await asyncio.Event().wait()  # an open stream: only a close ends it
        finally:
            closed.append(name)

    async def run(fail: bool) -> list:
        got = []
        streams = {0: stream("a", 3), 1: stream("b", 2, fail)}
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            async for key, item in merged(streams):
                got.append((key, item))
                if not fail and len(got) == 5:
                    break
        return got

    got = asyncio.run(run(fail=False))
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert sorted(closed) == ["a", "b"]
    closed.clear()
    asyncio.run(run(fail=True))
    assert sorted(closed) == ["a", "b"]


# --- end to end ---


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    """A stack with every service's metrics, and a second router over the same prefill and
    decode that prefills every prompt on decode itself."""
    tmp = str(tmp_path_factory.mktemp("n"))
    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    stack = start_stack(
        tmp,
        decode_flags=("--metrics-port", str(ports["decode"])),
        prefill_flags=("--metrics-port", str(ports["prefill"])),
        router_flags=("--metrics-port", str(ports["router"])),
    )
    local = start_router(
        stack.prefills, stack.decodes, "--local-prefill-tokens", "1000", tmp_dir=tmp
    )
    yield stack, ports, local
    local.stop()
    stack.stop()


@pytest.fixture
def served(metered):
    """The metered stack; afterwards decode's pool is whole again, nothing running or pending."""
    stack = metered[0]
    yield metered
    wait_until(stack.pools_settled, 15, "the decode pool to be whole again")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT)


def completions(url: str, **fields) -> openai.types.Completion:
    return client(url).completions.create(
        model="tinygpt", prompt=PROMPT, extra_body={"ignore_eos": True}, **(SAMPLED | fields)
    )


def one_by_one(url: str, n: int) -> list[str]:
    """Each completion as a request of its own, with seed + i."""
    return [completions(url, seed=SEED + i).choices[0].text for i in range(n)]


def handoffs(ports: dict) -> tuple[float, float]:
    """(prefill requests served, handoffs decode took in)."""
    prefill, decode = scrape(ports["prefill"]), scrape(ports["decode"])
    served = prefill['pdserve_requests_total{code="OK",outcome="ok",service="prefill"}']
    return served, decode['pdserve_handoff_seconds_count{service="decode"}']


def test_n_completions_take_one_prefill_and_one_handoff(served):
    stack, ports, _ = served
    url = stack.router.http_url
    expected = one_by_one(url, 4)
    assert len(set(expected)) == 4  # four seeds, four different completions
    before = handoffs(ports)
    reply = completions(url, n=4)
    after = handoffs(ports)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == expected
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert reply.usage.prompt_tokens == len(PROMPT.encode())  # the prompt counted once
    assert reply.usage.completion_tokens == 4 * 12


def test_n_echoed_completions_share_one_scored_prompt_and_one_handoff(served):
    """OpenAI's echo with n: every choice is the prompt, then completion i (as a request with
    seed + i); the prompt's logprobs are scored once and head each choice's own logprobs."""
    stack, ports, _ = served
    url = stack.router.http_url
    expected = [completions(url, seed=SEED + i, logprobs=1).choices[0] for i in range(3)]
    before = handoffs(ports)
    reply = completions(url, n=3, echo=True, logprobs=1)
    assert handoffs(ports)[1] - before[1] == 1  # the generating request's one handoff
    prompt_entries = len(PROMPT.encode())  # ASCII: a token per character
    first_prompt = reply.choices[0].logprobs
    for i, choice in enumerate(reply.choices):
        assert choice.index == i
        assert choice.text == PROMPT + expected[i].text
        logprobs = choice.logprobs
        assert logprobs.token_logprobs[0] is None
        scored = logprobs.token_logprobs[:prompt_entries]
        assert scored == first_prompt.token_logprobs[:prompt_entries]
        # Completion i's own tokens, and their logprobs to float32's rounding: a fork decodes
        # in a batch of n, the request of one completion alone.
        assert logprobs.tokens[prompt_entries:] == expected[i].logprobs.tokens
        generated = expected[i].logprobs.token_logprobs
        assert logprobs.token_logprobs[prompt_entries:] == pytest.approx(generated, abs=1e-4)
        assert logprobs.text_offset[prompt_entries] == len(PROMPT)  # each choice's own offsets
    assert reply.usage.prompt_tokens == len(PROMPT.encode())
    assert reply.usage.completion_tokens == 3 * 12


def test_n_echoes_of_no_tokens_are_the_prompt_counted_once(served):
    """max_tokens 0 (a log-likelihood request) with n: n copies of the scored prompt, nothing
    generated, nothing handed off."""
    stack, ports, _ = served
    before = handoffs(ports)
    reply = completions(stack.router.http_url, n=2, echo=True, logprobs=0, max_tokens=0)
    assert handoffs(ports)[1] == before[1]
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [PROMPT, PROMPT]
    assert reply.choices[0].logprobs == reply.choices[1].logprobs
    assert reply.choices[1].logprobs.text_offset == list(range(len(PROMPT)))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(PROMPT), 0)


def streamed_choices(url: str, **fields) -> tuple[list[dict], list]:
    """A streamed reply put back together by completion: each one's text, finish reason and
    logprob lists; and the chunks, the usage chunk last."""
    chunks = list(completions(url, stream=True, stream_options={"include_usage": True}, **fields))
    merged: dict[int, dict] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        entry = merged.setdefault(choice.index, {"text": "", "finish": None, "logprobs": {}})
        entry["text"] += choice.text
        entry["finish"] = choice.finish_reason or entry["finish"]
        for key, values in (choice.logprobs.model_dump() if choice.logprobs else {}).items():
            entry["logprobs"].setdefault(key, []).extend(values)
    return [merged[i] for i in sorted(merged)], chunks


def test_a_streamed_echo_is_the_whole_echo_in_chunks(served):
    """stream with echo and n: each completion's first chunk is the prompt with its scored
    logprobs; put together, each completion equals the non-streamed echo's, offsets included."""
    stack, ports, _ = served
    url = stack.router.http_url
    whole = completions(url, n=2, echo=True, logprobs=1)
    before = handoffs(ports)
    streamed, chunks = streamed_choices(url, n=2, echo=True, logprobs=1)
    assert handoffs(ports)[1] - before[1] == 1
    heads = [c.choices[0] for c in chunks[:2]]
    assert [(h.index, h.text) for h in heads] == [(0, PROMPT), (1, PROMPT)]
    assert len(heads[1].logprobs.tokens) == len(PROMPT.encode())  # the prompt's, no more
    for expected, got in zip(whole.choices, streamed, strict=True):
        assert got["text"] == expected.text and got["finish"] == expected.finish_reason
        lists, want = got["logprobs"], expected.logprobs
        assert lists["tokens"] == want.tokens and lists["text_offset"] == want.text_offset
        assert lists["token_logprobs"][0] is None
        assert lists["token_logprobs"][1:] == pytest.approx(want.token_logprobs[1:], abs=1e-4)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_streamed_echo_of_no_tokens_is_the_prompt_then_its_end(served):
    stack, ports, _ = served
    before = handoffs(ports)
    streamed, chunks = streamed_choices(stack.router.http_url, n=2, echo=True, max_tokens=0)
    assert handoffs(ports) == before  # nothing generated: no prefill call, no handoff
    assert [(c["text"], c["finish"], c["logprobs"]) for c in streamed] == [
        (PROMPT, "length", {}),
        (PROMPT, "length", {}),
    ]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        len(PROMPT),
        0,
    )


def test_streamed_n_completions_interleave_by_index(served):
    stack, _, _ = served
    url = stack.router.http_url
    whole = [c.text for c in completions(url, n=3).choices]
    chunks = list(completions(url, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished.append(choice.index)
    assert texts == whole
    assert sorted(finished) == [0, 1, 2]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 3 * 12
    assert chunks[-1].usage.prompt_tokens == len(PROMPT.encode())


def test_n_completions_prefilled_on_decode_equal_the_handed_off_ones(served):
    stack, ports, local = served
    expected = one_by_one(stack.router.http_url, 3)
    before = handoffs(ports)
    reply = completions(local.http_url, n=3)
    assert [c.text for c in reply.choices] == expected
    assert handoffs(ports) == before  # no prefill call, no handoff


def test_greedy_n_completions_are_alike_and_end_on_their_own(served):
    """Greedy, every completion is the same; each one ends at its own stop, and max_tokens 1
    ends the first at prefill's token while the others still take their decode step."""
    stack, _, _ = served
    url = stack.router.http_url
    reply = completions(url, n=3, temperature=0, max_tokens=6)
    assert len({c.text for c in reply.choices}) == 1
    short = completions(url, n=5, temperature=0, max_tokens=1)
    assert [len(c.text.encode()) for c in short.choices] == [1] * 5
    assert short.usage.completion_tokens == 5


def test_a_stream_of_n_completions_left_early_frees_every_block(served):
    stack, _, _ = served
    stream = completions(stack.router.http_url, n=4, max_tokens=400, stream=True)
    for _, _chunk in zip(range(6), stream):
        pass
    stream.close()  # the served fixture then waits for the pool to be whole


def test_colocated_serves_n_completions_from_one_prefill(colocated):
    url = colocated.http_url
    expected = one_by_one(url, 3)
    reply = completions(url, n=3)
    assert [c.text for c in reply.choices] == expected
    assert reply.usage.completion_tokens == 3 * 12


def test_grpc_responses_carry_their_completion_index(served):
    stack: Stack = served[0]
    request = pb.GenerateRequest(
        prompt=PROMPT,
        sampling=pb.SamplingParams(max_tokens=5, temperature=0.9, seed=SEED, n=2, ignore_eos=True),
    )
    tokens: dict[int, list[int]] = {0: [], 1: []}
    ends = []
    for response in stack.router_stub().Generate(request, timeout=TIMEOUT):
        tokens[response.index].extend(response.token_ids)
        if response.finish_reason:
            ends.append((response.index, response.usage.completion_tokens))
    assert sorted(ends) == [(0, 5), (1, 5)]
    assert all(len(t) == 5 for t in tokens.values())
