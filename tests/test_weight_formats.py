"""Weight formats (--weights dense|int8|q4): each is token-exact against its own reference, the
GGUF's 4-bit blocks are read as llama.cpp stores them, and the format is part of the model's
identity."""

import numpy as np
import pytest
import torch

import tiny_checkpoints as tc
from test_models import paged_decode_against_reference, prompts
from pdserve.models.gguf_import import ensure_converted, q4_1_tensors, smollm2_gguf_path
from pdserve.models.loading import load_served_model
from pdserve.engine.model_runner import WARM_UP_TOKENS, warm_up
from pdserve.models.quantized import (
    WIDE_ROWS,
    Int8Linear,
    Q4Linear,
    WidePass,
    bf16_gemm_here,
    make_linear,
    q4_blocks,
)
from pdserve.settings import CommonSettings

TOLERANCE = 1e-4
# (--weights, --q4-kernel): each q4 kernel is its own format, token-exact against itself.
FORMATS = [("int8", "torch"), ("q4", "native"), ("q4", "torch")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tc.build("llama-gqa-untied", tmp_path_factory.mktemp("formats"))


@pytest.mark.parametrize(("fmt", "kernel"), FORMATS)
def test_each_format_is_token_exact_against_its_own_reference(checkpoint, fmt, kernel):
    """Packed prefill and paged decode equal the plain contiguous forward of the same weights."""
    served = load_served_model(str(checkpoint), weight_format=fmt, q4_kernel=kernel)
    model = served.built
    linears = [m for m in model.modules() if isinstance(m, (Int8Linear, Q4Linear))]
    assert linears, "no layer was converted"
    q4 = [m for m in linears if isinstance(m, Q4Linear)]
    assert all(m.kernel == kernel for m in q4) and bool(q4) == (fmt == "q4")
    batch = prompts()
    packed = model.prefill_packed(batch, lambda *kv: None)
    for prompt, logits in zip(batch, packed):
        assert (logits - model.forward_contiguous(prompt, [])[-1]).abs().max() < TOLERANCE
    worst = paged_decode_against_reference(
        served, lambda s: model.forward_contiguous(s, [])[-1], batch, steps=4
    )
    assert worst < TOLERANCE


@pytest.mark.parametrize(("fmt", "kernel"), FORMATS)
def test_quantized_logits_stay_near_dense(checkpoint, fmt, kernel):
    dense = load_served_model(str(checkpoint)).built
    quantized = load_served_model(str(checkpoint), weight_format=fmt, q4_kernel=kernel).built
    prompt = prompts()[3]
    ref, got = dense.forward_contiguous(prompt, []), quantized.forward_contiguous(prompt, [])
    # Random tiny weights are the worst case for 4 bits; a wrong layout gives errors of the
    # logits' own size (about 1 here), not hundredths.
    bound = 0.05 if fmt == "int8" else 0.3
    assert (got - ref).abs().max() < bound * ref.abs().max()


def test_q4_layer_computes_code_times_scale_plus_minimum():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=gen).to(torch.bfloat16)
    codes, scales, minimums = q4_blocks(weight)
    dequantized = (codes.float().view(48, 3, 32) * scales[..., None] + minimums[..., None]).view(
        48, 96
    )
    assert (dequantized - weight.float()).abs().max() <= scales.max() / 2 + 1e-6  # half a step
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    layer = make_linear("q4", weight, None)
    assert isinstance(layer, Q4Linear)
    # The kernel reads (code - 8) * scale + zero with its scales held in bfloat16.
    held = layer.scales_and_zeros.float()  # [groups, rows, 2]
    scale, zero = held[..., 0].T[..., None], held[..., 1].T[..., None]
    as_held = ((codes.float().view(48, 3, 32) - 8) * scale + zero).view(48, 96)
    expected = x.float() @ as_held.T
    assert (layer(x).float() - expected).abs().max() < 0.01 * expected.abs().max()


def test_a_q4_pass_of_many_rows_multiplies_by_the_same_weights_in_float32():
    """From WIDE_ROWS rows up the layer uses a float32 copy of its weights: the kernel's own."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    layer = make_linear("q4", weight, None)
    assert isinstance(layer, Q4Linear)
    layer.bf16_gemm = False  # as on a CPU without bf16 dot products
    x = torch.randn(WIDE_ROWS, 64, generator=gen).to(torch.bfloat16)
    by_kernel = torch.cat([layer(row[None]) for row in x])  # one row at a time: the kernel
    many = layer(x)
    assert many.dtype == torch.bfloat16 and layer.wide_weight(torch.float32).dtype == torch.float32
    assert (many.float() - by_kernel.float()).abs().max() < 0.01 * by_kernel.float().abs().max()
    codes, _, _ = q4_blocks(weight)
    held = layer.scales_and_zeros.float()
    scale, zero = held[..., 0].T[..., None], held[..., 1].T[..., None]
    as_held = ((codes.float().view(32, 2, 32) - 8) * scale + zero).view(32, 64)
    assert torch.equal(layer.wide_weight(torch.float32), as_held)


def test_a_warm_up_makes_the_wide_pass_weights_before_the_first_request(checkpoint):
    """What a service that prefills runs at start: after it, every quantized layer that a
    prompt of WARM_UP_TOKENS rows takes wide holds its dense copy (none did before)."""
    model = load_served_model(str(checkpoint), "bfloat16", weight_format="q4").built
    layers = [m for m in model.modules() if isinstance(m, WidePass)]
    wide = [m for m in layers if m.wide_dtype(WARM_UP_TOKENS, torch.bfloat16) is not None]
    assert layers and all(m._reordered is None and not m._wide for m in layers)
    assert warm_up(model) > 0
    assert all(m._reordered is not None or m._wide for m in wide)
    if bf16_gemm_here():  # a CPU with bf16 dot products takes 16 rows of bf16 wide
        assert len(wide) == len(layers)


def test_a_shape_the_4_bit_kernel_refuses_falls_back_to_int8():
    layer = make_linear("q4", torch.randn(40, 64), None)  # 40 rows: not a multiple of 16
    assert isinstance(layer, Int8Linear)


def test_the_gguf_4_bit_blocks_are_the_converted_weights():
    """codes * scale + minimum, in Hugging Face row order, is exactly what the converter
    dequantized (before its rounding to bfloat16), for every Q4_1 tensor checked."""
    from safetensors.torch import load_file

    directory = ensure_converted(smollm2_gguf_path())
    blocks = q4_1_tensors(directory)
    assert len(blocks) == 30 * 7  # every projection of every layer
    converted = load_file(str(directory / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        codes, scales, minimums = blocks[name]
        rows, columns = codes.shape
        weight = (
            codes.astype(np.float32).reshape(rows, -1, 32) * scales[..., None] + minimums[..., None]
        ).reshape(rows, columns)
        ours = torch.from_numpy(weight).to(torch.bfloat16)
        assert torch.equal(ours, converted[name]), name


def test_the_format_is_part_of_the_fingerprint(checkpoint):
    prints = {
        (f, k): load_served_model(str(checkpoint), weights=False, weight_format=f, q4_kernel=k)
        for f, k in FORMATS
    }
    dense = load_served_model(str(checkpoint), weights=False)
    assert len({dense.fingerprint, *(s.fingerprint for s in prints.values())}) == 4


def test_bad_formats_are_refused_clearly():
    with pytest.raises(ValueError, match=r"--weights \(PDSERVE_WEIGHTS\) must be one of.*got 'q3'"):
        CommonSettings(weights="q3")
    with pytest.raises(ValueError, match="needs a Llama-family checkpoint"):
        load_served_model("tinygpt", weight_format="int8")
