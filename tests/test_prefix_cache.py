"""The prefix cache: content-addressed blocks in the pool, prefix-aware routing, and outputs that
stay token-identical whether a prompt's prefix came from the cache or was computed."""

import hashlib
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procs import (
    Stack,
    free_port,
    generate,
    greedy_request,
    start_router,
    start_service,
    wait_until,
)
from pdserve.core.block_pool import BlockPool, PoolExhausted
from pdserve.core.prefix_cache import block_keys
from pdserve.models.loading import load_served_model
from pdserve.services.router.policy import DECODE_BALANCE_STREAMS, PrefixAware
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

BS = 4  # tokens per block in the unit tests


def finish(pool: BlockPool, prompt: list[int], reuse: bool = False, extra: int = 2):
    """A request's life: reserve, take its blocks, write the prompt, end."""
    table = pool.reserve(len(prompt) + extra, prompt, reuse)
    table.ensure(len(prompt) + extra)
    table.prompt_written = True
    table.release()
    return table


def test_keys_name_the_whole_prefix_and_only_full_blocks():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 0], BS)
    assert len(a) == 2 and len(b) == 2  # the ninth token is not a full block
    assert a[0] == b[0] and a[1] != b[1]
    assert block_keys([9, 2, 3, 4, 5, 6, 7, 8], BS)[1] != a[1]  # same block, other parent


def test_a_salt_keeps_prompts_apart():
    tokens = list(range(1, 9))
    assert block_keys(tokens, BS, b"alice") != block_keys(tokens, BS, b"bob")
    assert set(block_keys(tokens, BS, b"alice")).isdisjoint(block_keys(tokens, BS))
    pool = BlockPool(20, BS, prefix_cache=True)
    table = pool.reserve(10, tokens, salt=b"alice")
    table.ensure(10)
    table.prompt_written = True
    table.release()
    assert pool.reserve(10, tokens + [9], reuse=True, salt=b"bob").cached_tokens == 0
    assert pool.reserve(10, tokens + [9], reuse=True, salt=b"alice").cached_tokens == 8


def test_a_finished_prompt_is_found_again_but_never_its_last_token():
    pool = BlockPool(20, BS, prefix_cache=True)
    prompt = list(range(1, 13))  # three full blocks
    first = finish(pool, prompt)
    assert pool.cached_blocks == 3 and pool.available_blocks == 20
    again = pool.reserve(len(prompt) + 2, prompt, reuse=True)
    # Two blocks, not three: the last prompt token is computed again, for its logits.
    assert again.cached_tokens == 8 and again.blocks == first.blocks[:0] + again.blocks[:2]
    longer = pool.reserve(20, prompt + [99], reuse=True)
    assert longer.cached_tokens == 12 and longer.blocks[:3] == again.blocks[:2] + [longer.blocks[2]]
    again.release()
    longer.release()
    assert pool.available_blocks == 20


def test_kv_not_known_written_is_never_cached_and_leases_do_not_share():
    pool = BlockPool(20, BS, prefix_cache=True)
    prompt = list(range(1, 13))
    unwritten = pool.reserve(14, prompt)
    unwritten.ensure(14)
    unwritten.release()  # a voided lease: its blocks hold nothing trustworthy
    assert pool.cached_blocks == 0
    finish(pool, prompt)
    lease = pool.reserve(14, prompt)  # reuse=False: KV will arrive for every token
    assert lease.cached_tokens == 0 and lease.shared == 0
    lease.release()


def test_idle_blocks_are_evicted_oldest_first_and_pinned_ones_never():
    pool = BlockPool(10, BS, prefix_cache=True)
    old, new = [1] * 8, [2] * 8
    finish(pool, old + [0], extra=0)  # 3 blocks: 2 full ones stay cached, 1 freed
    finish(pool, new + [0], extra=0)
    assert pool.cached_blocks == 4 and pool.available_blocks == 10
    pinned = pool.reserve(9, new + [7], reuse=True)  # new's 2 blocks, and 1 of its own
    assert pinned.cached_tokens == 8
    big = pool.reserve(24)  # 6 blocks; 5 are free, so the oldest idle block goes: old's child
    found = pool.cache.take(block_keys(old, BS))
    assert len(found) == 1  # the parent, newer than its child, is still there, and reachable
    pool.cache.give_back(found)
    with pytest.raises(PoolExhausted):
        pool.reserve(8)  # 2 blocks: only old's parent is idle; new's blocks are pinned
    last = pool.reserve(4)  # 1 block: old's parent is evicted for it
    assert pool.cache.take(block_keys(old, BS)) == [] and pool.cached_blocks == 2
    for table in (big, last, pinned):
        table.release()
    assert pool.available_blocks == 10


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=14),  # prompts that share a lot
            st.booleans(),  # reuse
            st.booleans(),  # KV written before the end
            st.integers(0, 6),  # generated tokens
        ),
        max_size=25,
    ),
    st.integers(0, 24),
)
def test_any_interleaving_keeps_every_block_accounted_for(requests, hold):
    """Tables reserved, grown and released in any order: no block is ever both free and in a
    table, shared blocks are the cached prefix, and at the end the whole pool is available."""
    pool = BlockPool(16, BS, prefix_cache=True)
    live = []
    for i, (prompt, reuse, written, extra) in enumerate(requests):
        try:
            table = pool.reserve(len(prompt) + extra, prompt, reuse)
        except PoolExhausted:
            continue
        table.ensure(len(prompt) + extra)
        assert table.cached_tokens <= len(prompt) - 1
        table.prompt_written = written
        live.append(table)
        owned = [b for t in live for b in t.blocks[t.shared :]]
        assert len(owned) == len(set(owned))  # no block handed out twice
        if i % 3 == 2 or len(live) * 4 > hold + 8:
            live.pop(0).release()
    for table in live:
        table.release()
    assert pool.available_blocks == 16
    assert len(pool._free) + pool.cached_blocks == 16 and pool._promised == 0


@dataclass
class Fake:
    address: str
    free_blocks: int = 100
    running: int = 0
    queued_tokens: int = 0
    streams: int = 0


@dataclass
class Request:
    prefix_keys: list[bytes]


def test_prefix_aware_puts_the_holder_of_the_longest_prefix_first():
    index = PrefixIndex(BS)
    system = list(range(1, 13))
    index.record(index.keys(tuple(system)), "b")
    index.record(index.keys(tuple(system[:4])), "c")
    roomy_a, b, c = Fake("a", free_blocks=900), Fake("b"), Fake("c")
    request = Request(index.keys(tuple(system + [50, 51])))
    policy = PrefixAware("decode", index)
    assert [i.address for i in policy.order([roomy_a, b, c], request, ())] == ["b", "c", "a"]
    assert index.cached_tokens(request.prefix_keys, "b") == 12
    assert policy.order([roomy_a, b, c], request, {"b"})[-1].address == "b"  # b just failed
    assert policy.order([roomy_a, b, c], Request([]), ())[0].address == "a"  # least-loaded


def test_prefix_aware_weighs_the_prefix_against_load():
    """Prefill: the holder of a 12-token prefix wins while its queue is at most 12 tokens
    longer (it computes that much less). Decode: the holder wins until it has more than
    DECODE_BALANCE_STREAMS streams beyond the least busy instance."""
    index = PrefixIndex(BS)
    system = list(range(1, 13))
    index.record(index.keys(tuple(system)), "b")
    request = Request(index.keys(tuple(system + [50, 51])))
    prefill = PrefixAware("prefill", index)
    for b_queue, first in [(0, "b"), (10, "b"), (13, "a"), (5000, "a")]:
        order = prefill.order([Fake("a"), Fake("b", queued_tokens=b_queue)], request, ())
        assert order[0].address == first, b_queue
    decode = PrefixAware("decode", index)
    limit = DECODE_BALANCE_STREAMS
    for b_streams, first in [(0, "b"), (limit, "b"), (limit + 1, "a")]:
        order = decode.order([Fake("a", streams=1), Fake("b", streams=1 + b_streams)], request, ())
        assert order[0].address == first, b_streams


SYSTEM = [(i * 13) % 250 + 1 for i in range(200)]  # a 200-token system prompt
METRICS_PORTS = (free_port(), free_port())  # the cached decodes' /metrics


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """Two prefills and two decodes with their caches behind a prefix-aware router that prefills
    up to 64 uncached tokens on decode; and, for reference, a prefill and a decode without
    caches behind a plain router."""
    tmp = str(tmp_path_factory.mktemp("prefix"))
    flags = ("--torch-threads", "1")
    cached = [
        start_service("decode", *flags, "--metrics-port", str(port), tmp_dir=tmp)
        for port in METRICS_PORTS
    ]
    plain = start_service("decode", *flags, "--prefix-cache", "false", tmp_dir=tmp)
    prefills = [start_service("prefill", *flags, tmp_dir=tmp) for _ in range(2)]
    plain_prefill = start_service("prefill", *flags, "--prefix-cache-tokens", "0", tmp_dir=tmp)
    on = start_router(
        prefills,
        cached,
        "--routing-policy",
        "prefix-aware",
        "--local-prefill-tokens",
        "64",
        tmp_dir=tmp,
    )
    off = start_router([plain_prefill], [plain], tmp_dir=tmp)
    yield Stack(on, prefills, cached), Stack(off, [plain_prefill], [plain])
    for service in (on, off, plain_prefill, plain, *prefills, *cached):
        service.stop()


def seeded(prompt: list[int], n: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=n, temperature=0.8, seed=5, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


@pytest.mark.parametrize("make", [greedy_request, seeded], ids=["greedy", "seeded"])
def test_a_shared_system_prompt_is_reused_and_outputs_are_token_identical(stacks, make):
    on, off = stacks
    prompts = [SYSTEM + [7 + i] * (10 + 3 * i) for i in range(6)]
    results = [generate(on.router_stub(), make(p, 12)) for p in prompts]
    reference = [generate(off.router_stub(), make(p, 12)) for p in prompts]
    assert [r[0] for r in results] == [r[0] for r in reference]
    first, later = results[0][2].metrics, [r[2].metrics for r in results[1:]]
    assert first.prefill_path == "prefill" or first.prefix_cached_tokens > 0
    # After the first, each finds the system prompt's 12 full blocks where the router sent it.
    assert all(m.prefill_path == "decode" and m.prefix_cached_tokens >= 192 for m in later)
    assert len({m.decode_instance for m in later}) == 1
    assert all(r[2].metrics.prefix_cached_tokens == 0 for r in reference)
    wait_until(on.pools_settled, 10, "both decode pools whole (cached blocks count as free)")
    assert sum(on.pool_stats(i).cached_blocks for i in range(2)) >= 12


def test_no_one_without_the_routers_secret_finds_a_clients_cached_prefixes(stacks):
    """A direct Decode call with the salt that anyone could compute for a client known by its
    address (blake2b of 127.0.0.1, what the router used) is told of no cached prefix, though
    that client's prompt is cached there: the salt now needs the routers' secret."""
    on, _ = stacks
    prompt = SYSTEM + [5] * 20
    generate(on.router_stub(), greedy_request(prompt, 2))
    _, _, last = generate(on.router_stub(), greedy_request(prompt, 2))
    assert last.metrics.prefix_cached_tokens >= 192  # cached, under the client's salt
    guessed = hashlib.blake2b(b"127.0.0.1", digest_size=16, person=b"pdserve-addr").digest()
    fingerprint = load_served_model("tinygpt", weights=False).fingerprint
    for decode in on.decodes:
        with grpc.insecure_channel(decode.address) as channel:
            call = pb_grpc.DecodeServiceStub(channel).Decode(
                pb.DecodeRequest(
                    request_id="probe",
                    prompt_token_ids=prompt,
                    sampling=pb.SamplingParams(max_tokens=2),
                    model_fingerprint=fingerprint,
                    cache_salt=guessed,
                ),
                timeout=10,
            )
            lease = next(call).lease
            call.cancel()
        assert lease.cached_tokens == 0
    wait_until(on.pools_settled, 10, "both decode pools whole after the probes")


def test_hits_and_saved_bytes_are_counted(stacks):
    on, _ = stacks
    generate(on.router_stub(), greedy_request(SYSTEM + [3] * 20, 4))  # populates, if not yet
    before = _counters()
    _, _, last = generate(on.router_stub(), greedy_request(SYSTEM + [4] * 20, 4))
    after = _counters()
    hit = last.metrics.prefix_cached_tokens
    assert hit >= 192
    assert after["hit"] - before["hit"] == hit
    assert after["lookup"] - before["lookup"] == len(SYSTEM) + 20
    assert after["saved"] - before["saved"] == hit * 12288  # TinyGPT's KV bytes per token


def _counters() -> dict[str, float]:
    """The decode instances' prefix-cache counters, summed, from their /metrics."""
    import urllib.request

    names = {
        "hit": "pdserve_prefix_cache_hit_tokens_total",
        "lookup": "pdserve_prefix_cache_lookup_tokens_total",
        "saved": "pdserve_prefix_cache_saved_handoff_bytes_total",
    }
    totals = dict.fromkeys(names, 0.0)
    for port in METRICS_PORTS:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            for short, name in names.items():
                if line.startswith(name + "{"):
                    totals[short] += float(line.rsplit(" ", 1)[1])
    return totals


def test_prefix_aware_expects_nothing_of_a_decode_without_the_cache(stacks, tmp_path):
    """A decode with --prefix-cache false says so in GetPoolStats: a prefix-aware router never
    counts on it holding a prefix, so long prompts keep going through prefill."""
    _, off = stacks
    router = start_router(
        off.prefills,
        off.decodes,
        "--routing-policy",
        "prefix-aware",
        "--local-prefill-tokens",
        "64",
        tmp_dir=str(tmp_path),
    )
    try:
        stack = Stack(router, off.prefills, off.decodes)
        paths = [
            generate(stack.router_stub(), greedy_request(SYSTEM + [9] * (10 + i), 4))[2]
            for i in range(4)
        ]
        assert [m.metrics.prefill_path for m in paths] == ["prefill"] * 4
    finally:
        router.stop()


def test_a_handoff_sends_only_what_decode_does_not_hold(stacks, tmp_path):
    """Through prefill (no local prefill at all), a prompt whose system prompt the chosen
    prefill and decode hold is computed, and sent, from the first uncached token on: the
    handoff is that much smaller, prefill computes only the rest, and the tokens are the
    same."""
    on, off = stacks
    router = start_router(
        on.prefills, on.decodes, "--routing-policy", "prefix-aware", tmp_dir=str(tmp_path)
    )
    try:
        stack = Stack(router, on.prefills, on.decodes)
        prompts = [SYSTEM + [11 + i] * (40 + i) for i in range(3)]
        results = [generate(stack.router_stub(), greedy_request(p, 8)) for p in prompts]
        reference = [generate(off.router_stub(), greedy_request(p, 8)) for p in prompts]
        assert [r[0] for r in results] == [r[0] for r in reference]
        for prompt, (_, _, last) in zip(prompts[1:], results[1:], strict=True):
            m = last.metrics
            assert m.prefill_path == "prefill" and m.prefix_cached_tokens >= 192
            assert m.prefill_cached_tokens >= 192  # prefix-aware routing met prefill's cache
            assert m.handoff.bytes == (len(prompt) - m.prefix_cached_tokens) * 12288
        assert len({r[2].metrics.prefill_instance for r in results}) == 1
        assert all(r[2].metrics.prefill_cached_tokens == 0 for r in reference)
        wait_until(stack.pools_settled, 10, "the decode pools whole")
    finally:
        router.stop()
