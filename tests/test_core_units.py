"""The shared core's pieces alone, without servers."""

import dataclasses
from pathlib import Path
import subprocess
import sys
import threading

import pytest
import torch

from pdserve.kv import wire as kv_wire
from pdserve.core.block_pool import BlockPool, PoolExhausted
from pdserve.core.config import ModelConfig
from pdserve.engine.output_text import OutputText
from pdserve.core.request import GenerateSpec, InvalidRequest, SamplingSpec, validate
from pdserve.models.tokenizer import ByteTokenizer

CONFIG = ModelConfig()


def test_block_pool_reserves_grows_and_releases():
    pool = BlockPool(num_blocks=8, block_size=4)
    table = pool.reserve(10)  # 3 blocks promised
    assert pool.available_blocks == 5
    table.ensure(5)
    assert len(table.blocks) == 2 and pool.available_blocks == 5
    assert table.slots(3, 6) == [
        table.blocks[0] * 4 + 3,
        table.blocks[1] * 4,
        table.blocks[1] * 4 + 1,
    ]
    with pytest.raises(ValueError):
        table.ensure(13)
    with pytest.raises(PoolExhausted):
        pool.reserve(4 * 6)
    table.release()
    table.release()  # twice is harmless
    assert pool.available_blocks == 8


def test_output_text_holds_back_a_stop_string_spread_over_tokens():
    text = OutputText(ByteTokenizer().detokenizer(()), stop=("END",))
    sent = "".join(text.feed(t) for t in b"abcEN")
    assert sent == "abc" and not text.stopped
    assert text.feed(ord("D")) == "" and text.stopped


def test_output_text_releases_a_false_stop_prefix():
    text = OutputText(ByteTokenizer().detokenizer(()), stop=("END",))
    sent = "".join(text.feed(t) for t in b"aENx")
    assert sent == "aENx" and not text.stopped


def test_output_text_assembles_utf8_across_tokens():
    text = OutputText(ByteTokenizer().detokenizer(()))
    pieces = [text.feed(t) for t in "é!".encode()]
    assert pieces == ["", "é", "!"]


def spec(tokens=(1, 2, 3), **sampling) -> GenerateSpec:
    return GenerateSpec("r", tuple(tokens), SamplingSpec(**sampling))


@pytest.mark.parametrize(
    "bad, words",
    [
        (spec(tokens=()), "no tokens"),
        (spec(tokens=(300,)), "outside the vocabulary"),
        (spec(max_tokens=0), "max_tokens"),
        (spec(temperature=float("nan")), "temperature"),
        (spec(top_p=0.0), "top_p"),
        (spec(top_k=-2), "top_k"),
        (spec(tokens=(1,) * 4090, max_tokens=10), "context length"),
        (spec(stop=("",)), "stop"),
    ],
)
def test_validation_names_the_problem(bad, words):
    with pytest.raises(InvalidRequest, match=words):
        validate(bad, CONFIG)


def test_kv_chunks_round_trip_and_reject_damage():
    k, v = torch.randn(40, CONFIG.kv_heads, CONFIG.head_dim), torch.randn(40, 4, 64)
    pieces = list(kv_wire.split_layer(k, v, tokens_per=16))
    assert [(p.token_start, p.token_end) for p in pieces] == [(0, 16), (16, 32), (32, 40)]
    start, end, payload = pieces[1].token_start, pieces[1].token_end, pieces[1].payload()
    assert pieces[1].crc32c == kv_wire.crc32c(payload)  # the CRC of the parts is the payload's
    header = kv_wire.ChunkHeader(1, 2, start, end, "float32", (2, 16, 4, 64), pieces[1].crc32c)
    k2, v2 = kv_wire.decode_chunk(header, payload, CONFIG, prompt_len=40)
    assert torch.equal(k2, k[16:32]) and torch.equal(v2, v[16:32])
    damaged = bytes([payload[0] ^ 1]) + payload[1:]
    with pytest.raises(kv_wire.KvRejected, match="CRC"):
        kv_wire.decode_chunk(header, damaged, CONFIG, prompt_len=40)
    with pytest.raises(kv_wire.KvRejected, match="shape"):
        kv_wire.decode_chunk(dataclasses.replace(header, shape=(2, 16, 8, 32)), payload, CONFIG, 40)
    with pytest.raises(kv_wire.KvRejected, match="outside"):
        kv_wire.decode_chunk(header, payload, CONFIG, prompt_len=20)


def test_kv_assembly_demands_order_and_completeness():
    assembly = kv_wire.KvAssembly(CONFIG, prompt_len=8)
    header = kv_wire.ChunkHeader(1, 0, 0, 8, "float32", (2, 8, 4, 64), 0)
    with pytest.raises(kv_wire.KvRejected, match="expected chunk 0"):
        assembly.check(header)
    with pytest.raises(kv_wire.KvRejected, match="commit says"):
        assembly.check_commit(3, 0)


def test_model_has_chapter_scale_and_identical_weights():
    from pdserve.models.decoder import parameter_count
    from pdserve.models.tinygpt import TinyGPT

    a, b = TinyGPT(CONFIG), TinyGPT(CONFIG)
    assert 5.5e6 < parameter_count(a) < 6.2e6
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert CONFIG.max_context >= 4096


def test_router_never_imports_torch():
    code = (
        "import sys, pdserve.services.router.server, pdserve.cli; "
        "from pdserve.models.loading import load_served_model; "
        "load_served_model('smollm2-135m-instruct', weights=False); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def imported_by(module: str) -> set[str]:
    """Every module a fresh interpreter holds after importing `module` alone."""
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_services_are_installed_under_the_project_name_only(tmp_path):
    """Outside the source tree, the services import as pdserve.services; a bare `services`
    package, a name that collides easily, does not exist."""
    code = (
        "import importlib.util as u, pdserve.services.router.server; "
        "print(u.find_spec('services') is None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=60, capture_output=True
    )
    assert out.stdout.strip() == b"True"


@pytest.mark.parametrize("service, other", [("prefill", "decode"), ("decode", "prefill")])
def test_prefill_and_decode_do_not_import_each_other(service, other):
    pulled = imported_by(f"pdserve.services.{service}.server")
    assert not [m for m in pulled if m.startswith(f"pdserve.services.{other}")]


def test_the_core_imports_nothing_above_it_and_no_torch():
    core = " ,".join(
        f"pdserve.core.{m.stem}"
        for m in sorted(Path(__file__).resolve().parents[1].glob("pdserve/core/*.py"))
        if m.stem != "__init__"
    )
    pulled = imported_by(core.replace(" ,", ", "))
    above = ("pdserve.services", "pdserve.v1", "grpc", "pdserve.models", "pdserve.engine")
    assert not [m for m in pulled if m.startswith(above) or m in ("pdserve.metrics", "torch")]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["serve", "router", "--help"],
        ["serve", "decode", "--help"],
        ["up", "--help"],
        ["generate", "--help"],
    ],
)
def test_cli_help_explains(args):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "usage: pdserve" in out and len(out) > 200


class AbortedDuringLeave:
    """A sequence aborted (from another thread) just after the scheduler first reads `done`."""

    def __init__(self, table):
        self.table, self.aborted, self.reads = table, False, 0

    @property
    def done(self) -> bool:
        self.reads += 1
        if self.reads == 2:
            self.aborted = True
        return self.aborted


def test_an_abort_racing_the_step_end_still_frees_the_blocks():
    from pdserve.engine.decode_scheduler import DecodeScheduler

    pool = BlockPool(num_blocks=8, block_size=4)
    table = pool.reserve(8)
    table.ensure(8)
    scheduler = DecodeScheduler(runner=None, tokenizer=ByteTokenizer(), max_batch=4)
    seq = AbortedDuringLeave(table)
    scheduler.running = [seq]
    for _ in range(3):
        scheduler._leave()
    assert scheduler.running == [] and table.released and pool.available_blocks == 8


def colocated_engine(chunk_tokens: int, step_prompt_tokens: int = 0):
    """TinyGPT's colocated engine; by default no step carries more prompt tokens than a chunk."""
    from pdserve.models.loading import load_served_model
    from pdserve.settings import ColocatedSettings, CommonSettings, DecodeSettings, PrefillSettings
    from pdserve.services.colocated.engine import ColocatedEngine

    common = CommonSettings()
    decode = DecodeSettings(common, num_blocks=64)
    return ColocatedEngine(
        load_served_model("tinygpt"),
        ColocatedSettings(
            common, decode, PrefillSettings(common), chunk_tokens, step_prompt_tokens
        ),
    )


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_a_cancel_from_another_thread_is_carried_out_by_the_engine_thread(chunk_tokens):
    """abort() only queues the cancel: the handle, its blocks and its place in a queue change
    only on the engine thread, at its next step, so no pass ever sees them change under it."""
    engine = colocated_engine(chunk_tokens)
    handle = engine.submit(
        GenerateSpec("r", tuple(range(40)), SamplingSpec(max_tokens=8)), lambda emission: None
    )
    caller = threading.Thread(target=engine.abort, args=(handle,))
    caller.start()
    caller.join(10)
    assert not handle.cancelled and not handle.table.released  # nothing changed yet
    assert engine.has_work()  # the loop wakes to carry the cancel out
    engine.step()
    assert handle.cancelled and handle.table.released and engine.pool.available_blocks == 64
    assert not engine.has_work()


@pytest.mark.parametrize("cancel_after_chunks", [0, 1, 3])
def test_chunked_prefill_cancelled_at_any_point_frees_the_reservation(cancel_after_chunks):
    """A 40-token prompt in 16-token chunks (3 steps), cancelled before its first chunk, midway,
    or once it is decoding: its blocks come back at the next step boundary at the latest."""
    engine = colocated_engine(chunk_tokens=16)
    emissions = []
    handle = engine.submit(
        GenerateSpec("r", tuple(range(40)), SamplingSpec(max_tokens=8)), emissions.append
    )
    for _ in range(cancel_after_chunks):
        engine.step()
    assert (handle.sequence is not None) == (cancel_after_chunks == 3)
    engine.abort(handle)
    for _ in range(3):
        engine.step()
    assert handle.table.released and engine.pool.available_blocks == 64
    assert not engine.has_work()


def run_until_idle(engine, steps: int = 40) -> None:
    for _ in range(steps):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and engine.pool.available_blocks == 64


def test_a_step_without_decodes_takes_a_whole_long_prompt_and_one_with_them_a_chunk():
    """16-token chunks, 64-token steps: a 40-token prompt alone is prefilled in one step; the
    same prompt arriving while it decodes takes three, so the stream waits at most a chunk."""
    engine = colocated_engine(chunk_tokens=16, step_prompt_tokens=64)
    spec = SamplingSpec(max_tokens=8, ignore_eos=True)  # the first decodes through all 3 steps
    first = engine.submit(GenerateSpec("a", tuple(range(40)), spec), lambda emission: None)
    engine.step()
    assert first.sequence is not None  # its whole prompt in the first step
    second = engine.submit(GenerateSpec("b", tuple(range(50, 90)), spec), lambda emission: None)
    steps = 0
    while second.sequence is None:
        engine.step()
        steps += 1
        assert steps <= 3
    assert steps == 3  # 16 + 16 + 8 prompt tokens beside the first one's decodes
    run_until_idle(engine)


def test_beside_decodes_short_prompts_go_whole_and_long_ones_share_one_chunk():
    """16-token chunks, 64-token steps, one stream decoding. Four 12-token prompts and two
    40-token prompts arrive: the short ones start in the first step (48 tokens, none split);
    the long ones take 16 tokens between them per step, so they never hold the stream longer
    than a chunk does."""
    engine = colocated_engine(chunk_tokens=16, step_prompt_tokens=64)
    spec = SamplingSpec(max_tokens=12, ignore_eos=True)
    running = engine.submit(GenerateSpec("a", tuple(range(8)), spec), lambda emission: None)
    engine.step()
    assert running.sequence is not None
    long_ones = [
        engine.submit(GenerateSpec(f"l{i}", tuple(range(40 + i, 80 + i)), spec), lambda e: None)
        for i in range(2)
    ]
    short_ones = [
        engine.submit(GenerateSpec(f"s{i}", tuple(range(i, 12 + i)), spec), lambda e: None)
        for i in range(4)
    ]
    pieces = []
    engine.chunked.chunks.take = recorded(engine.chunked.chunks.take, pieces)
    engine.step()
    assert all(h.sequence is not None for h in short_ones)
    assert all(h.sequence is None for h in long_ones)
    first_step = {c.handle.spec.request_id: c.end - c.start for c in pieces[0]}
    assert first_step == {"l0": 16, "s0": 12, "s1": 12, "s2": 12, "s3": 12}
    while any(h.sequence is None for h in long_ones):
        engine.step()
        long_tokens = sum(c.end - c.start for c in pieces[-1] if c.handle in long_ones)
        assert long_tokens <= 16
    assert len(pieces) == 5  # 80 long tokens, 16 a step
    run_until_idle(engine)


def recorded(take, pieces: list):
    """`take`, noting the pieces each step got."""

    def noted(*args):
        chunks = take(*args)
        pieces.append(chunks)
        return chunks

    return noted


def test_a_sequence_whose_blocks_are_back_is_not_counted_as_running():
    """Pool stats read at any instant agree: when the last emission arrives (its blocks are back
    before it), the sequence is no longer counted, though the step has not yet ended."""
    engine = colocated_engine(chunk_tokens=16)
    seen = []

    def sink(emission) -> None:
        if emission.finish_reason is not None:  # what GetPoolStats would read right now
            seen.append((engine.pool.available_blocks, engine.decode.size))

    engine.submit(GenerateSpec("r", tuple(range(20)), SamplingSpec(max_tokens=4)), sink)
    for _ in range(8):
        engine.step()
    assert seen == [(64, 0)]
    assert not engine.has_work()


def test_decode_buckets_bound_the_padding():
    from pdserve.engine.paged_cache import buckets_by_length

    lengths = [200] * 31 + [3000]
    groups = buckets_by_length(lengths)
    assert sorted(map(len, groups)) == [1, 31] and groups[0] == [31]
    spread = [1, 5, 40, 63, 64, 100, 130, 400, 450, 500, 1000, 2999, 3000, 3100]
    for group in buckets_by_length(spread):
        longest = max(spread[i] for i in group)
        assert all(longest - spread[i] <= max(0.25 * longest, 64) for i in group)
    assert sorted(i for g in buckets_by_length(spread) for i in g) == list(range(len(spread)))


def test_a_retry_never_goes_first_to_an_instance_that_just_failed():
    """BackendSet.ordered puts the instances a request must avoid last, whatever the rotation."""
    from pdserve.services.router.backends import BackendSet, Instance

    backends = BackendSet("prefill", [], lambda channel: None, "f", "model")
    for address in ("a:1", "b:1", "c:1"):
        backends.instances[address] = Instance(
            address, None, None, healthy=True, model_fingerprint="f"
        )
    for _ in range(6):  # every rotation
        order = [i.address for i in backends.ordered({"a:1", "c:1"})]
        assert order[0] == "b:1" and set(order[1:]) == {"a:1", "c:1"}
    backends.instances["b:1"].mismatch = "serves another model"
    assert "b:1" not in [i.address for i in backends.ordered()]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_write_by_runs_stores_what_index_copy_stores(dtype):
    """The slice-copy fast path of PagedCache.write must put every token where the slot says,
    whether the blocks are in order, reversed, shuffled, or short and long runs mixed."""
    from pdserve.engine.paged_cache import PagedCache, contiguous_runs

    config = ModelConfig(
        n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=50, max_context=4096
    )
    config = dataclasses.replace(config, dtype=dtype)
    block, blocks = 16, 64
    gen = torch.Generator().manual_seed(5)
    orders = {
        "ascending": list(range(0, 40)),
        "reversed": list(range(39, -1, -1)),
        "shuffled": torch.randperm(blocks, generator=gen)[:40].tolist(),
        "runs": list(range(10, 30)) + [2, 3] + list(range(40, 58)),
    }
    for name, order in orders.items():
        slots = [order[p // block] * block + p % block for p in range(len(order) * block)]
        k = torch.randn(len(slots), 2, 16, generator=gen).to(getattr(torch, dtype))
        v = torch.randn(len(slots), 2, 16, generator=gen).to(getattr(torch, dtype))
        cache = PagedCache(config, blocks, block)
        cache.write(1, slots, k, v)
        index = torch.tensor(slots)
        assert torch.equal(cache.kv[1, 0][:, index].transpose(0, 1), k), name
        assert torch.equal(cache.kv[1, 1][:, index].transpose(0, 1), v), name
        assert cache.kv[0].abs().sum() == 0, name  # nothing written into another layer
        written = torch.zeros(blocks * block, dtype=torch.bool)
        written[index] = True
        assert cache.kv[1][:, :, ~written].abs().sum() == 0, name  # nor into another slot
    assert contiguous_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert contiguous_runs([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_any_nan_or_infinity(dtype):
    """The ingest check uses min and max, which propagate NaN: it must see a single bad value
    wherever it sits, in tensors of sizes that do and do not fill a vector register."""
    for n in (1, 7, 8, 15, 16, 17, 63, 64, 65, 1000, 4097):
        clean = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        assert kv_wire.all_finite(clean)
        for position in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                spoiled = clean.clone()
                spoiled[position] = bad
                assert not kv_wire.all_finite(spoiled), (n, position, bad)
