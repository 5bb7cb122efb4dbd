"""pdserve's own kernel for llama.cpp's blocks (pdserve/kernels/blocks_avx2.cpp), Q4_1 for the
layers and Q8_0 for the output head: its arithmetic, its invariance to the batch and the
threads, its refusals, and how --q4-kernel is decided."""

import pytest
import torch

from pdserve.kernels import native
from pdserve.models.onednn import reordered_bf16_here
from pdserve.models.quantized import (
    BF16_WIDE_ROWS,
    WIDE_ROWS,
    Int8Linear,
    Q4Linear,
    Q8Linear,
    int8_blocks,
    make_linear,
    output_head,
    q4_blocks,
    q8_0_from_block_bytes,
)


@pytest.fixture(scope="module")
def layer() -> Q4Linear:
    gen = torch.Generator().manual_seed(0)
    built = make_linear("q4", torch.randn(96, 160, generator=gen), None, q4_kernel="native")
    assert isinstance(built, Q4Linear) and built.kernel == "native"
    return built


def rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x in float32 as the native kernel sees it: each block of 32 rounded to int8 codes times
    its scale."""
    codes, scale = int8_blocks(x)
    return (codes * scale).view(x.shape)


def _dense(layer: Q4Linear) -> torch.Tensor:
    return layer.dense_weight().double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_8_bit_activations_by_the_4_bit_weights(layer, dtype):
    """Its result is (x rounded to int8 per block of 32) @ (code * scale + minimum).T, up to
    float rounding, and comes back in x's dtype."""
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (7, 96)
    expected = rounded_to_8_bits(x).double() @ _dense(layer).T
    bound = (1e-5 if dtype == torch.float32 else 1e-2) * expected.abs().max()
    assert (got.double() - expected).abs().max() < bound
    # Rounding the activations is what makes it differ from x @ W.T (about 1% of the result's
    # scale), and it is far from a wrong layout, whose error is the result's own size.
    plain = x.double() @ _dense(layer).T
    assert (got.double() - plain).abs().max() < 0.05 * plain.abs().max()


def test_the_weights_are_the_q4_1_blocks_as_given():
    """The layer holds llama.cpp's block_q4_1 bytes; its weights are code * scale + minimum
    with the fp16 scale and minimum those bytes hold."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 64, generator=gen)
    codes, scales, minimums = q4_blocks(weight)
    layer = make_linear("q4", weight, None, q4_kernel="native")
    assert isinstance(layer, Q4Linear)
    blocks = layer.block_bytes()
    assert blocks.shape == (32, 2 * 20) and blocks.dtype == torch.uint8
    first = blocks[0, :20]
    assert first[:2].view(torch.float16).item() == scales[0, 0].half().item()
    assert first[2:4].view(torch.float16).item() == minimums[0, 0].half().item()
    assert first[4] == codes[0, 0] | (codes[0, 16] << 4)
    scale, minimum = scales.half().float(), minimums.half().float()
    expected = codes.float().view(32, 2, 32) * scale[..., None] + minimum[..., None]
    assert torch.equal(layer.dense_weight(), expected.view(32, 64))


def test_the_kernel_reads_the_blocks_interleaved_by_8_rows_as_its_header_lays_them_out():
    """Per 8 output rows and group of 32 columns: 8 fp16 scales, 8 fp16 minimums, then byte
    32 + 32i + 4t + j holds row t's code 8i + j (low nibble) and 8i + 4 + j (high)."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    codes, scales, minimums = q4_blocks(weight)
    layer = make_linear("q4", weight, None, q4_kernel="native")
    assert isinstance(layer, Q4Linear)
    held = layer.interleaved
    assert held.shape == (16 // 8, 2 * 160) and held.dtype == torch.uint8
    second_group, second_block = held[1, 160:320], (8, 32)  # rows 8-15, columns 32-63
    row, column = second_block
    for t in range(8):
        assert second_group[2 * t : 2 * t + 2].view(torch.float16) == scales[row + t, 1].half()
        assert (
            second_group[16 + 2 * t : 18 + 2 * t].view(torch.float16) == minimums[row + t, 1].half()
        )
        for i in range(4):
            for j in range(4):
                low, high = (
                    codes[row + t, column + 8 * i + j],
                    codes[row + t, column + 8 * i + 4 + j],
                )
                assert second_group[32 + 32 * i + 4 * t + j] == low | (high << 4)


def test_the_q8_0_head_is_read_interleaved_by_8_rows_as_its_header_lays_them_out():
    """Per 8 output rows and group of 32 columns: 8 fp16 scales, then byte 16 + 32c + 4t + j
    holds row t's code 4c + j."""
    head = Q8Linear(torch.randn(16, 64, generator=torch.Generator().manual_seed(7)))
    held, blocks = head.interleaved, head.block_bytes().view(16, 2, 34)
    assert held.shape == (16 // 8, 2 * 272) and held.dtype == torch.uint8
    second_group = held[1, 272:]  # rows 8-15, columns 32-63
    for t in range(8):
        assert torch.equal(second_group[2 * t : 2 * t + 2], blocks[8 + t, 1, :2])
        for c in range(8):
            codes = blocks[8 + t, 1, 2 + 4 * c : 2 + 4 * c + 4]
            assert torch.equal(second_group[16 + 32 * c + 4 * t : 16 + 32 * c + 4 * t + 4], codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", ["q4_1", "q8_0"])
def test_a_row_gets_the_same_result_in_any_batch_and_on_any_threads(dtype, block):
    """Up to 4 rows take tiles held in registers, more take another loop; 112 output rows leave
    each thread's share a remainder that the smaller tiles take. Every one sums as the others."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(112, 1536, generator=gen)
    layer = (
        make_linear("q4", weight, None, q4_kernel="native") if block == "q4_1" else Q8Linear(weight)
    )
    layer.widens = False  # the kernel's own loops at every row count, never a GEMM
    x = torch.randn(33, 1536, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(row[None]) for row in x])
        torch.set_num_threads(2)
        for rows in (2, 3, 4, 5, 33):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
    finally:
        torch.set_num_threads(threads)


def _native_q4(seed: int) -> Q4Linear:
    gen = torch.Generator().manual_seed(seed)
    built = make_linear("q4", torch.randn(96, 160, generator=gen), None, q4_kernel="native")
    assert isinstance(built, Q4Linear)
    return built


@pytest.mark.parametrize("bits", ["q4_1", "q8_0"])
def test_a_pass_of_many_rows_stays_on_the_kernel_and_gives_each_row_its_own_bits(bits):
    """Without bf16 dot products the native kernel never multiplies a dense float32 copy (it is
    the faster way at every row count measured), so a prompt's prefill computes each row as a
    decode step of that row alone would, to the bit."""
    gen = torch.Generator().manual_seed(4)
    layer = Q8Linear(torch.randn(96, 160, generator=gen)) if bits == "q8_0" else _native_q4(0)
    layer.bf16_gemm = False  # as on an AVX2 CPU
    for dtype in (torch.float32, torch.bfloat16):
        assert layer.wide_dtype(16 * WIDE_ROWS, dtype) is None
    x = torch.randn(WIDE_ROWS + 3, 160, generator=gen)
    alone = torch.cat([layer(row[None]) for row in x])
    assert torch.equal(layer(x), alone)


@pytest.mark.parametrize("head", [False, True])
def test_a_bf16_wide_pass_multiplies_by_the_kernels_weights_in_bf16(head):
    """With bf16 dot products, from BF16_WIDE_ROWS rows up a q4 layer or the Q8_0 head
    multiplies in bfloat16 by its kernel's own weights: a bf16 GEMM's result, not the kernel's
    8-bit activations, and the weights the kernel reads, rounded to bf16 (and made once)."""
    gen = torch.Generator().manual_seed(5)
    layer = Q8Linear(torch.randn(64, 160, generator=gen)) if head else _native_q4(6)
    layer.bf16_gemm = True  # as on such a CPU (elsewhere torch multiplies bf16 too, slower)
    x = torch.randn(BF16_WIDE_ROWS, 160, generator=gen).to(torch.bfloat16)
    assert layer.wide_dtype(BF16_WIDE_ROWS - 1, torch.bfloat16) is None
    assert layer.wide_dtype(BF16_WIDE_ROWS, torch.float32) is None  # float32 keeps its precision
    wide = layer(x)
    if reordered_bf16_here():  # held reordered for oneDNN, once: the same bits as a plain GEMM
        assert layer.reordered_bf16() is layer.reordered_bf16()
    held = layer.wide_weight(torch.bfloat16)
    assert held.dtype == torch.bfloat16 and held is layer.wide_weight(torch.bfloat16)
    assert torch.equal(held, layer.dense_weight().to(torch.bfloat16))
    assert torch.equal(wide, torch.nn.functional.linear(x, held))
    by_kernel = torch.cat([layer(row[None]) for row in x]).float()  # 1 row: the kernel's path
    assert (wide.float() - by_kernel).abs().max() < 0.05 * by_kernel.abs().max()


def test_bad_arguments_are_refused_with_a_message(layer):
    op = torch.ops.pdserve.q4_1_linear
    x = torch.randn(2, 160)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        op(x.double(), layer.interleaved)
    with pytest.raises(RuntimeError, match="x's columns / 32 blocks of 160 bytes"):
        op(torch.randn(2, 128), layer.interleaved)
    with pytest.raises(RuntimeError, match="contiguous matrix"):
        op(torch.randn(160, 2).T, layer.interleaved)
    with pytest.raises(RuntimeError, match="uint8 matrix of Q4_1 blocks interleaved by 8 rows"):
        op(x, layer.interleaved.float())
    with pytest.raises(RuntimeError, match="blocks of 160 bytes"):  # llama.cpp's rows as stored
        op(x, layer.block_bytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_q8_0_kernel_multiplies_8_bit_activations_by_the_8_bit_weights(dtype):
    """(x rounded to int8 per block of 32) @ (code * scale).T, up to float rounding; negative
    codes included (maddubs takes one unsigned operand, so the kernel moves the signs)."""
    gen = torch.Generator().manual_seed(5)
    head = Q8Linear(torch.randn(80, 192, generator=gen))
    x = torch.randn(6, 192, generator=gen).to(dtype)
    got = head(x)
    assert got.dtype == dtype and got.shape == (6, 80)
    expected = rounded_to_8_bits(x).double() @ q8_0_from_block_bytes(head.block_bytes()).double().T
    bound = (1e-5 if dtype == torch.float32 else 1e-2) * expected.abs().max()
    assert (got.double() - expected).abs().max() < bound
    assert head(-x).neg().allclose(got, rtol=0, atol=float(bound))


def test_q8_0_blocks_are_llama_cpps_and_give_back_a_q8_0_weight_exactly():
    """block_q8_0: the fp16 scale max|w| / 127 of each 32 weights, then round(w / scale) as
    signed bytes. A weight that already is Q8_0 (codes times an fp16 scale, in float32, as a
    GGUF's Q8_0 head dequantises) gives back its own codes and scales."""
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(-127, 128, (16, 64), generator=gen, dtype=torch.int8)
    codes[:, 0] = 127  # each block's largest code sets its scale
    codes[:, 32] = -127
    scales = (torch.rand(16, 2, generator=gen) / 50).half()
    weight = (codes.float().view(16, 2, 32) * scales.float()[..., None]).view(16, 64)
    blocks = Q8Linear(weight).block_bytes()
    assert blocks.shape == (16, 2 * 34) and blocks.dtype == torch.uint8
    grouped = blocks.view(16, 2, 34)
    assert torch.equal(grouped[..., :2].contiguous().view(torch.float16)[..., 0], scales)
    assert torch.equal(grouped[..., 2:].contiguous().view(torch.int8), codes.view(16, 2, 32))
    assert torch.equal(q8_0_from_block_bytes(blocks), weight)


def test_the_real_models_head_is_the_files_own_q8_0_blocks():
    """SmolLM2's GGUF ships its embedding (the tied head) in Q8_0. q4 on the native kernel
    computes its head's blocks from the checkpoint's bf16 weights, and gets the file's own bytes
    back, every one: it multiplies the head llama.cpp multiplies."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader

    from pdserve.models.gguf_import import smollm2_gguf_path
    from pdserve.models.loading import load_served_model

    served = load_served_model("smollm2-135m-instruct", weight_format="q4", q4_kernel="native")
    embedding = next(
        t for t in GGUFReader(smollm2_gguf_path()).tensors if t.name == "token_embd.weight"
    )
    assert embedding.tensor_type == GGMLQuantizationType.Q8_0
    head = served.built.lm_head
    assert isinstance(head, Q8Linear)
    raw = np.asarray(embedding.data).reshape(head.out_features, -1)
    assert torch.equal(head.block_bytes(), torch.from_numpy(raw.copy()))


def test_a_q4_model_on_the_native_kernel_has_a_q8_0_head():
    weight = torch.randn(64, 96)
    assert isinstance(output_head("q4", weight, "native"), Q8Linear)
    assert isinstance(output_head("q4", weight, "torch"), Int8Linear)
    assert isinstance(output_head("int8", weight, "native"), Int8Linear)
    with pytest.raises(RuntimeError, match="uint8 matrix of Q8_0 blocks"):
        torch.ops.pdserve.q8_0_linear(torch.randn(2, 96), weight)


def test_native_is_refused_clearly_where_it_cannot_be_built(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert native.require("torch") == "torch"
    with pytest.raises(native.KernelUnavailable, match="no C.. compiler"):
        native.require("native")
    with pytest.raises(ValueError, match="must be one of auto, torch, native"):
        native.require("avx2")
    # auto falls back to torch's kernel where the native one cannot be built, on any CPU.
    assert native.require("auto") == "torch"


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "fma", "f16c"}, "native"),  # AVX2 only: torch runs its AVX2 code
        # torch runs its AVX-512 int4 code here, and the native kernel was faster there too
        ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "native"),
        ({"avx2", "f16c"}, "torch"),  # no FMA: the native kernel cannot run
        ({"sse4_2"}, "torch"),
    ],
)
def test_auto_picks_the_native_kernel_wherever_it_runs(monkeypatch, flags, expected):
    """docs/measurements.md, "Which q4 kernel on AVX-512, again": the native kernel was the
    faster on the AVX2-only EPYC and on the AVX-512 one."""
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    assert native.require("auto") == expected


def test_install_built_the_library_for_this_source_and_torch():
    assert native.library_path().is_file(), "scripts/install.sh builds the kernel"
    assert native.require("native") == "native"


def test_the_kernel_is_part_of_the_fingerprint():
    """A decode on torch's kernel is another model to a prefill on the native one."""
    from pdserve.models.loading import load_served_model

    ours = load_served_model(
        "smollm2-135m-instruct", weights=False, weight_format="q4", q4_kernel="native"
    )
    theirs = load_served_model(
        "smollm2-135m-instruct", weights=False, weight_format="q4", q4_kernel="torch"
    )
    assert ours.config.q4_kernel == "native" and theirs.config.q4_kernel == "torch"
    assert ours.fingerprint != theirs.fingerprint
