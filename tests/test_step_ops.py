"""pdserve's fused step ops (pdserve/kernels/step_ops.cpp): each against the torch code it
replaces, a row's result alone and in a batch, the refusals of bad input, and how --step-ops is
decided and named in the fingerprint."""

import pytest
import torch

from pdserve.core.block_pool import BlockPool
from pdserve.core.config import ModelConfig
from pdserve.engine.paged_cache import PagedCache, PromptChunk
from pdserve.kernels import native, step_ops
from pdserve.models.llama import RMSNorm
from pdserve.models.loading import load_served_model
from pdserve.models.quantized import BF16_WIDE_ROWS, bf16_gemm_here
from pdserve.models.onednn import reordered_bf16_here
from pdserve.models.rope import Rotary, inverse_frequencies

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert native.why_unavailable() is None, "scripts/install.sh builds the native library"
    step_ops.load()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rounds_as_the_module_does(dtype):
    x = (torch.randn(37, 576, generator=_gen(0)) * 3).to(dtype)
    torch_norm, fused_norm = RMSNorm(576, 1e-5), RMSNorm(576, 1e-5, fused=True)
    with torch.no_grad():
        weight = torch.randn(576, generator=_gen(1)).to(dtype)
        for norm in (torch_norm, fused_norm):
            norm.weight.data = weight
    with torch.inference_mode():
        expected, got = torch_norm(x), fused_norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the mean square summed in another order: at most one bf16 step, and rarely
        step = expected.float().abs() * 2**-7 + 1e-30
        off = (got.float() - expected.float()).abs()
        assert bool((off <= step).all()) and int((off > 0).sum()) < x.numel() // 100
    # A row alone gets the same bits as among 36 others.
    assert torch.equal(torch.ops.pdserve.rms_norm(x[5:6], weight, 1e-5), got[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_rope_py(dtype):
    """Bit for bit in bfloat16 (rounded where torch rounds); in float32 torch's addcmul may fuse
    its multiply and add, which ours does not, so there within a few ulps."""
    positions = torch.tensor([0, 3, 17, 400, 4095])
    inv_freq = inverse_frequencies(64, 10000.0, {})
    # q and k as views of one projection's output, as a layer splits them.
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64, generator=_gen(2)).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], -1)
    q, k = q.view(5, 9, 64), k.view(5, 3, 64)
    plain = Rotary(inv_freq, positions, dtype, fused=False)
    expected_q, expected_k = plain.apply(q), plain.apply(k)
    got_q, got_k = Rotary(inv_freq, positions, dtype, fused=True).apply_pair(q, k)
    if dtype == torch.bfloat16:
        assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    else:
        torch.testing.assert_close(got_q, expected_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_k, expected_k, rtol=1e-6, atol=1e-6)


def _cache(dtype: str, kv_heads: int = 3, heads: int = 9, head_dim: int = 64) -> PagedCache:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        d_model=heads * head_dim,
        n_heads=heads,
        n_kv_heads=kv_heads,
        n_layers=2,
        dtype=dtype,
        step_ops="native",
    )
    cache = PagedCache(config, num_blocks=40, block_size=16)
    cache.kv.normal_(generator=_gen(3))
    return cache


def _step(cache: PagedCache, tables, lengths, q, k, v, fused: bool):
    """One layer's decode attention, on the fused op or on torch's (the same cache, copied)."""
    cache.fused_decode = fused
    return cache.step_view(tables, lengths).attend(1, q, k, v)


# (query heads, KV heads, head width): SmolLM2's shape (3 query heads a KV head, width 64, which
# the kernel attends a group at a time), 2 and 4 a group, one, and widths it takes a head at a
# time (128 with its width fixed, 32 on the generic loop).
SHAPES = [(9, 3, 64), (4, 2, 64), (8, 2, 64), (4, 4, 64), (4, 2, 128), (6, 2, 32)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_decode_matches_the_torch_path_and_writes_the_same_cache(
    dtype, heads, kv_heads, head_dim
):
    torch_dtype = getattr(torch, dtype)
    pool = BlockPool(40, 16)
    lengths = [0, 5, 16, 31, 150, 47]  # an empty context, part of a block, whole blocks
    tables = [pool.reserve(n + 1) for n in lengths]
    for table, n in zip(tables, lengths):
        table.ensure(n + 1)
    tables[2].blocks.reverse()  # blocks out of order: each position's block is looked up
    q = torch.randn(6, heads, head_dim, generator=_gen(4)).to(torch_dtype)
    k = torch.randn(6, kv_heads, head_dim, generator=_gen(5)).to(torch_dtype)
    v = torch.randn(6, kv_heads, head_dim, generator=_gen(6)).to(torch_dtype)
    shape = (kv_heads, heads, head_dim)
    fused_cache, torch_cache = _cache(dtype, *shape), _cache(dtype, *shape)
    got = _step(fused_cache, tables, lengths, q, k, v, fused=True)
    expected = _step(torch_cache, tables, lengths, q, k, v, fused=False)
    assert got.dtype == torch_dtype and got.shape == (6, heads, head_dim)
    assert torch.equal(fused_cache.kv, torch_cache.kv)  # the new K and V at the same slots
    tolerance = 2e-6 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    # Each sequence alone gets the bits it got in the batch.
    for i in (0, 4):
        alone = _cache(dtype, *shape)
        one = _step(
            alone,
            tables[i : i + 1],
            lengths[i : i + 1],
            q[i : i + 1],
            k[i : i + 1],
            v[i : i + 1],
            fused=True,
        )
        assert torch.equal(one, got[i : i + 1])


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_in_avx512_registers_gives_the_avx2_kernels_bits(
    dtype, heads, kv_heads, head_dim
):
    """attend_avx512.h promises the AVX2 kernel's bits, so that a sequence's tokens do not depend
    on which of the two a machine runs. (Without AVX-512 both calls run the AVX2 kernel.)
    Planted bug: the AVX-512 pass over V summing a block's tokens last to first fails 7 of these
    12 cases (width 32 takes neither kernel), and none of the comparisons with torch above."""
    torch_dtype = getattr(torch, dtype)
    pool = BlockPool(40, 16)
    lengths = [0, 5, 16, 31, 150, 47, 8, 9]
    tables = [pool.reserve(n + 1) for n in lengths]
    for table, n in zip(tables, lengths):
        table.ensure(n + 1)
    tables[4].blocks.reverse()
    shape = (kv_heads, heads, head_dim)
    q = torch.randn(8, heads, head_dim, generator=_gen(7)).to(torch_dtype)
    k = torch.randn(8, kv_heads, head_dim, generator=_gen(8)).to(torch_dtype)
    v = torch.randn(8, kv_heads, head_dim, generator=_gen(9)).to(torch_dtype)
    outputs = []
    for wide in (True, False):
        before = torch.ops.pdserve.set_wide_attention(wide)
        try:
            outputs.append(_step(_cache(dtype, *shape), tables, lengths, q, k, v, fused=True))
        finally:
            torch.ops.pdserve.set_wide_attention(before)
    assert torch.ops.pdserve.set_wide_attention(True) is True  # the default, left as found
    assert torch.equal(outputs[0], outputs[1])


def test_paged_decode_refuses_what_would_read_or_write_outside_the_cache():
    cache = _cache("float32")
    keys, values = cache.kv[0, 0], cache.kv[0, 1]
    q, kv = torch.zeros(1, 9, 64), torch.zeros(1, 3, 64)
    blocks, length = torch.tensor([[0, 1]]), torch.tensor([20])
    op = torch.ops.pdserve.paged_decode
    before = cache.kv.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(q, kv, kv, keys, values, torch.tensor([640]), blocks, length, 16)
    with pytest.raises(RuntimeError, match="block out of range"):
        op(q, kv, kv, keys, values, torch.tensor([3]), torch.tensor([[0, 40]]), length, 16)
    with pytest.raises(RuntimeError, match="does not fit its blocks"):
        op(q, kv, kv, keys, values, torch.tensor([3]), blocks, torch.tensor([33]), 16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q, kv.bfloat16(), kv, keys, values, torch.tensor([3]), blocks, length, 16)
    with pytest.raises(RuntimeError, match="share a dtype"):  # q is read in the cache's dtype
        op(q.bfloat16(), kv, kv, keys, values, torch.tensor([3]), blocks, length, 16)
    with pytest.raises(RuntimeError, match="do not agree"):
        op(torch.zeros(1, 8, 64), kv, kv, keys, values, torch.tensor([3]), blocks, length, 16)
    assert torch.equal(cache.kv, before)  # refused before anything was written


def test_step_ops_are_decided_and_named_in_the_fingerprint():
    assert step_ops.resolve("auto", "fast", "bfloat16") == "native"  # this machine runs them
    assert step_ops.resolve("auto", "invariant", "bfloat16") == "torch"
    assert step_ops.resolve("auto", "fast", "float16") == "torch"
    with pytest.raises(ValueError, match="needs --numerics fast"):
        step_ops.resolve("native", "invariant", "float32")
    with pytest.raises(ValueError, match="--step-ops must be one of"):
        step_ops.resolve("fused", "fast", "float32")
    native_model = load_served_model("tinygpt", weights=False, step_ops="auto")
    torch_model = load_served_model("tinygpt", weights=False, step_ops="torch")
    assert native_model.config.step_ops == "native" and torch_model.config.step_ops == "torch"
    assert native_model.fingerprint != torch_model.fingerprint


def test_a_served_step_on_either_ops_gives_the_same_greedy_tokens():
    """TinyGPT in float32: five decode steps of four sequences, native against torch ops."""
    tokens = {}
    for ops in ("native", "torch"):
        model = load_served_model("tinygpt", step_ops=ops)
        cache, pool = PagedCache(model.config, 32, 16), BlockPool(32, 16)
        prompts = [[(7 * i + 13 * j) % 250 for j in range(n)] for i, n in enumerate([3, 40, 90])]
        tables = [pool.reserve(len(p) + 6) for p in prompts]
        for table, prompt in zip(tables, prompts):
            table.ensure(len(prompt) + 6)

            def keep(layer, k, v, table=table, prompt=prompt):
                cache.write(layer, table.slots(0, len(prompt)), k, v)

            model.built.prefill_packed([prompt], keep)
        lengths, step_tokens, out = [len(p) for p in prompts], [1, 2, 3], []
        for _ in range(5):
            logits = model.built.decode_paged(
                step_tokens, lengths, cache.step_view(tables, lengths)
            )
            step_tokens = logits.argmax(-1).tolist()
            out.append(step_tokens)
            lengths = [n + 1 for n in lengths]
        tokens[ops] = out
    assert tokens["native"] == tokens["torch"]


def test_the_layers_in_one_native_call_are_bit_identical_to_the_ops_one_by_one():
    """decode_layer.cpp runs every layer of a decode-only q4 step in one call: the logits and
    the K and V it writes are exactly those of llama.py's layer, op by op, at any batch; a step
    with a prompt chunk keeps to the ops one by one."""
    served = load_served_model("smollm2-135m-instruct", weight_format="q4", q4_kernel="native")
    model = served.built
    assert model._one_call(1) == "q4" and model._one_call(3) == "q4"
    lengths = [150, 3, 47]
    tables = _tables(lengths, 64)
    try:
        for batch in (1, 3):
            whole = _decode_step(model, "_whole_layers", True, tables, lengths[:batch], 64)
            ops = _decode_step(model, "_whole_layers", False, tables, lengths[:batch], 64)
            assert torch.equal(whole[0], ops[0]) and torch.equal(whole[1], ops[1])
    finally:
        model._whole_layers = True
    cache = PagedCache(served.config, 64, 16)
    chunk = PromptChunk(tables[1], 0, 4)
    assert not cache.step_view(tables[:1], lengths[:1], [chunk]).decode_only


def test_the_layers_call_refuses_operands_that_do_not_agree():
    """Checked before the threads start, with a message naming what is wrong: a thread that
    failed inside the region would leave the others waiting."""
    served = load_served_model("smollm2-135m-instruct", weight_format="q4", q4_kernel="native")
    model = served.built
    pool = BlockPool(64, 16)
    table = pool.reserve(4)
    table.ensure(4)
    cache = PagedCache(served.config, 64, 16)
    view = cache.step_view([table], [3])
    x = torch.zeros(1, served.config.d_model, dtype=cache.kv.dtype)
    rotary = model.rotary(torch.tensor([3]))
    norms, post_norms, qkv, o, gate_up, down = model._layer_operands
    call = torch.ops.pdserve.decode_layers
    common = (served.config.norm_eps,)
    shape = (9, 3, 64, rotary.cos, rotary.sin_signed)
    with pytest.raises(RuntimeError, match="one norm pair and four matrices per layer"):
        call(
            x, norms, post_norms, *common, qkv, o[:-1], gate_up, down, *shape, *view.step_operands()
        )
    with pytest.raises(RuntimeError, match="kv must be"):
        operands = view.step_operands()
        call(
            x,
            norms,
            post_norms,
            *common,
            qkv,
            o,
            gate_up,
            down,
            *shape,
            operands[0][:2],
            *operands[1:],
        )
    with pytest.raises(RuntimeError, match="o must be Q4_1 blocks"):
        call(x, norms, post_norms, *common, qkv, qkv, gate_up, down, *shape, *view.step_operands())
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        odd_heads = (8, 3, 64, rotary.cos, rotary.sin_signed)
        call(
            x, norms, post_norms, *common, qkv, o, gate_up, down, *odd_heads, *view.step_operands()
        )


@pytest.mark.parametrize("weights,kernel", [("q4", "native"), ("q4", "torch"), ("int8", "torch")])
def test_a_wide_step_in_one_native_call_is_bit_identical_to_the_ops_one_by_one(weights, kernel):
    """decode_wide.cpp runs every layer of a decode-only step whose matrices multiply a bf16
    wide pass (from BF16_WIDE_ROWS rows, where the CPU has bf16 dot products): the logits and
    the K and V it writes are exactly those of llama.py's layer, op by op. Where the CPU has no
    bf16 dot products, no step takes it."""
    served = load_served_model("smollm2-135m-instruct", weight_format=weights, q4_kernel=kernel)
    model = served.built
    if not bf16_gemm_here():
        assert not model._wide_layers
        assert all(model._one_call(rows) != "wide" for rows in (BF16_WIDE_ROWS, 16, 64))
        return
    assert model._one_call(BF16_WIDE_ROWS - 1) in ("q4", None)
    assert model._one_call(BF16_WIDE_ROWS) == "wide" and model._one_call(64) == "wide"
    lengths = [150, 3, 47, 16, 15, 200, 33, 1, 99, 120, 7, 5, 80]
    tables = _tables(lengths, 128)
    try:
        for batch in (BF16_WIDE_ROWS, len(lengths)):
            wide = _decode_step(model, "_wide_layers", True, tables, lengths[:batch], 128)
            ops = _decode_step(model, "_wide_layers", False, tables, lengths[:batch], 128)
            assert torch.equal(wide[0], ops[0]) and torch.equal(wide[1], ops[1])
    finally:
        model._wide_layers = True


def test_the_wide_layers_call_refuses_operands_that_do_not_agree():
    """A wrong list, dtype or matrix is a Python error that names it, not a crash. Where oneDNN
    cannot reorder bf16 weights (no AVX-512), dense bf16 copies stand in: the list and dtype
    checks come before any product, and the product itself is then oneDNN's error."""
    served = load_served_model("smollm2-135m-instruct", weight_format="q4", q4_kernel="torch")
    model = served.built
    pool = BlockPool(64, 16)
    tables = [pool.reserve(4) for _ in range(BF16_WIDE_ROWS)]
    for table in tables:
        table.ensure(4)
    cache = PagedCache(served.config, 64, 16)
    view = cache.step_view(tables, [3] * BF16_WIDE_ROWS)
    x = torch.zeros(BF16_WIDE_ROWS, served.config.d_model, dtype=torch.bfloat16)
    rotary = model.rotary(torch.tensor([3] * BF16_WIDE_ROWS))
    norms, post_norms = model._layer_operands[:2]
    qkv, o, gate_up, down = _wide_matrices(model)
    call = torch.ops.pdserve.decode_layers_wide
    shape = (9, 3, 64, rotary.cos, rotary.sin_signed)
    eps = served.config.norm_eps
    with pytest.raises(RuntimeError, match="one norm pair and four matrices per layer"):
        call(x, norms, post_norms, eps, qkv, o[:-1], gate_up, down, *shape, *view.step_operands())
    with pytest.raises(RuntimeError, match="x must be a dense .* in bfloat16"):
        call(
            x.float(), norms, post_norms, eps, qkv, o, gate_up, down, *shape, *view.step_operands()
        )
    wrong_width = "o's matrix gives 960 columns, not 576"
    # Without bf16 dot products oneDNN may emulate the product (AVX-512) or refuse it (AVX2).
    with pytest.raises(
        RuntimeError, match=wrong_width if bf16_gemm_here() else wrong_width + "|primitive"
    ):
        call(x, norms, post_norms, eps, qkv, qkv, gate_up, down, *shape, *view.step_operands())


def _wide_matrices(model) -> tuple[list[torch.Tensor], ...]:
    """The wide call's four matrices per layer: reordered where this CPU's oneDNN can reorder
    bf16, else dense bf16 copies of the same shapes."""
    if reordered_bf16_here():
        return model.wide_matrices()
    layers = list(model.layers)
    return tuple(
        [layer._matrices()[i].dense_weight().to(torch.bfloat16) for layer in layers]
        for i in range(4)
    )


def _tables(lengths: list[int], blocks: int) -> list:
    """A block table per sequence, each holding its length and one token more."""
    pool = BlockPool(blocks, 16)
    tables = [pool.reserve(n + 1) for n in lengths]
    for table, n in zip(tables, lengths):
        table.ensure(n + 1)
    return tables


def _decode_step(model, flag: str, on: bool, tables, lengths, blocks: int):
    """One decode-only step of len(lengths) sequences over a seeded cache, with the model's
    one-call `flag` set to `on`: (logits, the cache's K and V after it)."""
    cache = PagedCache(model.config, blocks, 16)
    cache.kv.normal_(generator=_gen(11))
    setattr(model, flag, on)
    view = cache.step_view(tables[: len(lengths)], lengths)
    assert view.decode_only
    tokens = [(5 + 997 * i) % model.config.vocab_size for i in range(len(lengths))]
    return model.decode_paged(tokens, lengths, view), cache.kv
