"""Linear layers in fewer bytes: int8 weight-only and 4-bit groups (q4).

A decode step reads every weight once per step, so at small batches its time follows the bytes
read. Three formats (`--weights`):

  dense  the checkpoint's weights in --dtype (nn.Linear)
  int8   one int8 per weight and one scale per output row (symmetric), any checkpoint;
         torch._weight_int8pack_mm
  q4     4-bit codes in groups of 32 input columns, each group with a scale and a minimum, as
         llama.cpp's Q4_1 stores them: weight = code * scale + minimum. From a Q4_1 GGUF the
         blocks are read as they are (the model the file ships); from any other checkpoint they
         are computed from the dense weights.

q4 layers multiply on one of two kernels (--q4-kernel, pdserve/kernels/native.py):

  native  pdserve's AVX2 kernel, on llama.cpp's own block_q4_1 bytes (fp16 scale and minimum,
          then the codes: 20 bytes per 32 weights), interleaved by 8 output rows (the same
          bytes rearranged, q4_1_interleaved): each row of activations is rounded to int8 per
          block of 32, with integer dot products against the codes, as llama.cpp computes.
  torch   torch._weight_int4pack_mm_for_cpu, which computes (code - 8) * scale + zero, so
          zero = minimum + 8 * scale. Its scales are held in the activations' dtype: bfloat16
          rounds Q4_1's fp16 scales to 8 significant bits.

A q4 layer whose shape does not fit (output rows not a multiple of 16, as torch's packing needs,
or input columns not a multiple of 32) stays int8, and says so in the log.

A pass of many rows (a prompt's prefill, a decode step of many sequences) is bound by
arithmetic, not by bytes, and the 4- and 8-bit kernels, which cost about a row's time per row,
are then the slower way. So a quantized layer keeps its codes and, from some number of rows up
(a "wide" pass), multiplies by the same weights as a dense copy, made once on first use and held
only in a process that runs such passes. Which dtype, and from how many rows, depends on the CPU
(wide_pass_here):

  bfloat16 from BF16_WIDE_ROWS rows, every quantized layer of a bfloat16 model, where oneDNN
          has bf16 dot products (AVX512_BF16 or AMX). On a 2-vCPU Xeon with AMX (2026-12-05, 2 threads) a bf16 GEMM
          of a SmolLM2 matrix cost about the same from 1 to 16 rows (50-100 us), while torch's
          int4 kernel cost 2.2-2.6x as much at 8 rows, 4.4x at 64; the 49,152-row int8 head
          cost 2.0x at 8 rows and 11x at 64. The crossover was 4-8 rows.
  float32 from WIDE_ROWS rows, q4 layers on torch's kernel only, otherwise (and for a float32
          model anywhere): on an AVX2 CPU at 1,500 rows torch's int4 kernel took 54-57 ms per
          SmolLM2 matrix against 22-30 ms for a float32 GEMM (and 145-170 ms in bfloat16, which
          AVX2 has no instructions for); the crossover was 48-64 rows. The native kernel never
          goes float32: interleaved (blocks_avx2.h) it was faster than the float32 pass at
          every count measured, 1.6x at 128 rows, 1.16x at 1,024 and 2,048 (AVX2 EPYC, 2
          threads, a SmolLM2 layer's 4 matrices, bench/native_vs_wide.py, 2026-12-06), and a row's result then does not depend on
          how many rows share its pass, prefill or decode.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pdserve.kernels import native
from pdserve.models.onednn import ReorderedBF16, reordered_bf16_here

log = logging.getLogger(__name__)

Q4_GROUP = 32
Q8_0_BLOCK_BYTES = 34  # llama.cpp's block_q8_0: an fp16 scale, then 32 signed codes
Q4_ROWS_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement
Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, minimums
WIDE_ROWS = 128  # q4 on torch's kernel multiplies in float32 from here up (bf16 may go sooner)
BF16_WIDE_ROWS = 8  # with bf16 dot products, a layer of bf16 activations goes bf16 from here up


def bf16_gemm_here() -> bool:
    """Whether oneDNN has bf16 dot-product instructions here (AVX512_BF16, or AMX with it)."""
    return bool(torch.cpu._is_avx512_bf16_supported())


class WidePass(nn.Module):
    """A quantized layer that multiplies a pass of many rows by a dense copy of its weights
    (dense_weight, made on first use, one per dtype), as the module's docstring says:

      bfloat16 activations, where `bf16_gemm` (this CPU has bf16 dot products): in bfloat16,
               from BF16_WIDE_ROWS rows;
      else, where `float32_wide` (q4 on torch's kernel): in float32, from WIDE_ROWS rows.

    Float32 activations never go to bfloat16: a float32 model keeps its precision. `widens`
    False keeps every pass on the layer's own kernel, whose result for a row does not depend on
    how many rows share the pass (invariant numerics sets it so); a wide pass's result would."""

    def __init__(self, float32_wide: bool) -> None:
        super().__init__()
        self.float32_wide, self.widens, self.bf16_gemm = float32_wide, True, bf16_gemm_here()
        self._wide: dict[torch.dtype, torch.Tensor] = {}
        self._reordered: ReorderedBF16 | None = None

    def wide_dtype(self, rows: int, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype a pass of `rows` rows of `dtype` multiplies in; None: the layer's kernel."""
        if not self.widens:
            return None
        if dtype == torch.bfloat16 and self.bf16_gemm and rows >= BF16_WIDE_ROWS:
            return torch.bfloat16
        return torch.float32 if self.float32_wide and rows >= WIDE_ROWS else None

    def wide(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """flat [rows, in] by the dense copy in `dtype`, returned in the input's dtype. In
        bfloat16 (from bf16 activations) the copy is held reordered for oneDNN where torch
        can, which computes the same bits in less time (pdserve/models/onednn.py)."""
        if dtype == torch.bfloat16 and flat.dtype == torch.bfloat16 and reordered_bf16_here():
            return self.reordered_bf16()(flat.contiguous())
        out = torch.nn.functional.linear(self.wide_input(flat, dtype), self.wide_weight(dtype))
        return out.to(flat.dtype)

    def reordered_bf16(self) -> ReorderedBF16:
        """The dense copy in bfloat16, reordered for oneDNN (made once; the plain copy is not
        kept beside it)."""
        if self._reordered is None:
            self._reordered = ReorderedBF16(self.dense_weight())
        return self._reordered

    def wide_input(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return flat.to(dtype)

    def wide_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights the layer's kernel reads, dense, in `dtype` (made once)."""
        if dtype not in self._wide:
            self._wide[dtype] = self.dense_weight().to(dtype)
        return self._wide[dtype]

    def dense_weight(self) -> torch.Tensor:
        """The layer's weights as its kernel reads them, float32 [out, in]."""
        raise NotImplementedError


class Int8Linear(WidePass):
    codes: torch.Tensor  # buffers, declared for the type checker
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(float32_wide=False)
        self.in_features = weight.shape[1]
        wide = weight.detach().float()
        scale = wide.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer(
            "codes", (wide / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scale", scale.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        wide = self.wide_dtype(flat.shape[0], flat.dtype)
        if wide is not None:
            out = self.wide(flat, wide)
        else:
            out = torch._weight_int8pack_mm(flat, self.codes, self.scale)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias

    def dense_weight(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]


class Q8Linear(WidePass):
    """Codes in -127..127 per group of 32 input columns, each group with one scale: llama.cpp's
    Q8_0 (weight = code * scale), multiplied by the native kernel (pdserve/kernels/
    blocks_avx2.cpp) with activations rounded to int8 per block, as llama.cpp computes it.
    Held in llama.cpp's block_q8_0 bytes (per group the fp16 scale, then the 32 codes),
    interleaved by 8 output rows as the kernel reads them (q8_0_interleaved). Computed
    from the bf16 weights, they are SmolLM2's GGUF's own Q8_0 bytes again, every one of them
    (tests/test_native_kernel.py): the bf16 rounding moves no weight by half a code.

    The output head of a q4 model on the native kernel: the largest matrix (SmolLM2's 49,152
    rows), which the GGUF ships in Q8_0. On the AVX2-only EPYC (2 threads, 2026-12-03) a
    one-sequence decode step ran 1.17x faster with it than with torch._weight_int8pack_mm's
    head (Int8Linear), 1.12-1.14x at 16 and 64 (docs/measurements.md, "The output head in
    Q8_0")."""

    interleaved: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(float32_wide=False)
        native.load()
        self.out_features, self.in_features = weight.shape
        if self.out_features % 8 or self.in_features % Q4_GROUP:
            raise ValueError(
                f"Q8_0 on the native kernel needs output rows in groups of 8 and input columns "
                f"in blocks of 32, not {self.out_features} x {self.in_features}"
            )
        self.register_buffer("interleaved", q8_0_interleaved(q8_0_block_bytes(weight)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        wide = self.wide_dtype(flat.shape[0], flat.dtype)
        if wide is not None:
            out = self.wide(flat, wide)
        else:
            out = torch.ops.pdserve.q8_0_linear(flat, self.interleaved)
        return out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return q8_0_from_block_bytes(self.block_bytes())

    def block_bytes(self) -> torch.Tensor:
        """The weights as llama.cpp stores them (block_q8_0, row by row)."""
        return q8_0_from_interleaved(self.interleaved)


def q8_0_block_bytes(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's block_q8_0 bytes of a dense weight, [rows, groups * 34]: per group of 32 the
    scale as fp16, then the codes as signed bytes (int8_blocks)."""
    rows = weight.shape[0]
    codes, scale = int8_blocks(weight)
    held = scale.to(torch.float16).view(torch.uint8)
    as_bytes = codes.clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([held, as_bytes], -1).reshape(rows, -1).contiguous()


def q8_0_interleaved(blocks: torch.Tensor) -> torch.Tensor:
    """The native kernel's layout (pdserve/kernels/blocks_avx2.h) of block_q8_0 bytes [rows,
    groups * 34]: 8 output rows side by side, [rows / 8, groups * 272]. Per 8 rows and group:
    their scales as fp16, then 8 x 32 bytes where byte 4t + j of the c-th is row t's code
    4c + j."""
    rows = blocks.shape[0]
    grouped = blocks.view(rows // 8, 8, -1, Q8_0_BLOCK_BYTES)  # [row groups, 8 rows, groups, 34]
    scales = grouped[..., :2].permute(0, 2, 1, 3)  # [row groups, groups, 8 rows, 2]
    codes = grouped[..., 2:].unflatten(-1, (8, 4)).permute(0, 2, 3, 1, 4)  # [.., c, 8 rows, j]
    both = [scales.flatten(2), codes.flatten(2)]
    return torch.cat(both, -1).reshape(rows // 8, -1).contiguous()


def q8_0_from_interleaved(interleaved: torch.Tensor) -> torch.Tensor:
    """q8_0_interleaved's inverse: block_q8_0 bytes [rows, groups * 34]."""
    row_groups = interleaved.shape[0]
    grouped = interleaved.view(row_groups, -1, 8 * Q8_0_BLOCK_BYTES)
    scales = grouped[..., :16].unflatten(-1, (8, 2)).permute(0, 2, 1, 3)  # [.., 8 rows, groups, 2]
    codes = grouped[..., 16:].unflatten(-1, (8, 8, 4)).permute(0, 3, 1, 2, 4).flatten(3)
    return torch.cat([scales, codes], -1).reshape(row_groups * 8, -1).contiguous()


def q8_0_from_block_bytes(blocks: torch.Tensor) -> torch.Tensor:
    """The dense float32 weights that q8_0_block_bytes' bytes hold: code * fp16 scale."""
    grouped = blocks.view(blocks.shape[0], -1, Q8_0_BLOCK_BYTES)
    scale = grouped[..., 0:2].contiguous().view(torch.float16).float()  # [rows, groups, 1]
    codes = grouped[..., 2:].contiguous().view(torch.int8).float()
    return (codes * scale).view(blocks.shape[0], -1)


class Q4Linear(WidePass):
    """4-bit groups multiplied by one of two kernels (`kernel`, pdserve/kernels/native.py):
    torch's int4 kernel, or pdserve's own, which computes as llama.cpp does."""

    # Buffers, declared for the type checker: `interleaved` on the native kernel; `packed`,
    # `scales_and_zeros` and `nibbles` on torch's.
    interleaved: torch.Tensor
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    nibbles: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        minimums: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "torch",
    ) -> None:
        """codes int [rows, columns] in 0..15; scales, minimums [rows, columns / 32]."""
        super().__init__(float32_wide=kernel == "torch")
        self.out_features, self.in_features = codes.shape
        self.kernel = kernel
        if kernel == "native":
            native.load()
            self.register_buffer("interleaved", q4_1_interleaved(codes, scales, minimums))
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            zeros = minimums.float() + 8 * scales.float()
            # torch's layout: [groups, rows, (scale, zero)], in the activations' dtype.
            both = torch.stack([scales.float(), zeros], -1).transpose(0, 1).contiguous()
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", both.to(dtype))
            # The codes again, two to a byte, for the float32 copy (torch's packing is its own).
            self.register_buffer("nibbles", _nibbles(codes))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        wide = self.wide_dtype(flat.shape[0], flat.dtype)
        if wide is not None:
            out = self.wide(flat, wide)
        elif self.kernel == "native":
            out = torch.ops.pdserve.q4_1_linear(flat.contiguous(), self.interleaved)
        else:
            out = torch._weight_int4pack_mm_for_cpu(
                flat, self.packed, Q4_GROUP, self.scales_and_zeros
            )
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The weights the 4-bit kernel reads, with that kernel's own scales."""
        if self.kernel == "native":
            codes, scale, minimum = q4_1_from_interleaved(self.interleaved)
            weight = codes.float() * scale[..., None] + minimum[..., None]
        else:
            codes = _codes(self.nibbles)
            held = self.scales_and_zeros.float().transpose(0, 1)  # [rows, groups, 2]
            weight = (codes.float() - 8) * held[..., 0:1] + held[..., 1:2]
        return weight.view(self.out_features, self.in_features)

    def block_bytes(self) -> torch.Tensor:
        """The native kernel's weights as llama.cpp stores them (block_q4_1, row by row)."""
        return q4_1_block_bytes(*q4_1_from_interleaved(self.interleaved))


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, groups, 16] bytes: byte i of a group holds code i (low) and code i + 16 (high)."""
    halves = codes.to(torch.uint8).view(codes.shape[0], -1, 2, Q4_GROUP // 2)
    return halves[:, :, 0] | (halves[:, :, 1] << 4)


def _codes(nibbles: torch.Tensor) -> torch.Tensor:
    """_nibbles' inverse: [rows, groups, 32] codes."""
    return torch.cat([nibbles & 15, nibbles >> 4], -1)


def q4_1_block_bytes(
    codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor
) -> torch.Tensor:
    """llama.cpp's block_q4_1 bytes, [rows, groups * 20]: per group the scale and the minimum
    as fp16, then the 16 bytes of codes (the native kernel's input)."""
    rows = codes.shape[0]
    halves = [
        t.to(torch.float16).reshape(rows, -1, 1).view(torch.uint8) for t in (scales, minimums)
    ]
    return torch.cat([*halves, _nibbles(codes)], -1).reshape(rows, -1).contiguous()


def q4_1_interleaved(
    codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor
) -> torch.Tensor:
    """The native kernel's layout (pdserve/kernels/blocks_avx2.h): llama.cpp's Q4_1 blocks of
    8 output rows side by side, [rows / 8, groups * 160]. Per 8 rows and group: their scales and
    minimums as fp16, then 4 x 32 bytes where byte 4t + j of the i-th holds row t's code 8i + j
    (low nibble) and 8i + 4 + j (high)."""
    rows, columns = codes.shape
    groups = columns // Q4_GROUP
    # [row groups, 8 rows, groups, i, low|high, j] -> bytes [row groups, groups, i, 8 rows, j]
    split = codes.to(torch.uint8).view(rows // 8, 8, groups, 4, 2, 4)
    packed = (split[:, :, :, :, 0] | (split[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
    halves = [
        t.to(torch.float16)
        .view(rows // 8, 8, groups)
        .transpose(1, 2)
        .contiguous()
        .view(torch.uint8)
        for t in (scales, minimums)
    ]
    codes_bytes = packed.reshape(rows // 8, groups, 128)
    return torch.cat([*halves, codes_bytes], -1).reshape(rows // 8, -1).contiguous()


def q4_1_from_interleaved(interleaved: torch.Tensor) -> Q4Blocks:
    """q4_1_interleaved's inverse: codes [rows, groups, 32], scales and minimums [rows, groups]
    (float32, from their fp16)."""
    row_groups = interleaved.shape[0]
    grouped = interleaved.view(row_groups, -1, 160)
    groups = grouped.shape[1]

    def halves(at: int) -> torch.Tensor:  # [row groups, groups, 8] fp16 -> [rows, groups]
        held = grouped[..., at : at + 16].contiguous().view(torch.float16).float()
        return held.transpose(1, 2).reshape(row_groups * 8, groups)

    packed = grouped[..., 32:].reshape(row_groups, groups, 4, 8, 4).permute(0, 3, 1, 2, 4)
    codes = torch.stack([packed & 15, packed >> 4], -2)  # [.., 8 rows, groups, i, low|high, j]
    return codes.reshape(row_groups * 8, groups, 32), halves(0), halves(16)


def int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of 32 of x's rows as llama.cpp rounds it to 8 bits, in float32: the codes
    round(x / scale) [rows, groups, 32] and the scale max|block| / 127 [rows, groups, 1]. The
    native kernel rounds its activations so, and Q8_0 its weights."""
    blocks = x.float().reshape(-1, x.shape[-1] // Q4_GROUP, Q4_GROUP)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(blocks * inverse), scale


class PaddedRows(nn.Module):
    """A dense layer that multiplies exactly TILE_ROWS rows at a time (invariant numerics).

    A GEMM's kernel and blocking depend on how many rows it multiplies, and so does the order
    of a row's sums. Measured with torch 2.13's CPU build on a 2-vCPU Xeon with AMX
    (2026-12-05): a float32 GEMM of SmolLM2's shapes gave a row other bits at 16 rows than at 4,
    and at 4 rows other bits on 2 threads than on 1; a bfloat16 GEMM gave other bits from 33
    rows up. (On the AVX2 and AVX-512 EPYCs before it, float32 was the same from 4 rows up.)
    At a fixed 16 rows, a row got the same bits in every tile position and beside any other
    rows, in both dtypes; but TinyGPT's float32 down projection (1,024 inputs, 256 outputs) got
    other bits on 2 threads than on 1. So every pass is cut into tiles of 16, the last padded
    with zeros, and multiplied on one thread. The int8 and int4 kernels were measured
    row-invariant from one row and on any threads, and are left as they are."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_tiles(self.linear, x)


TILE_ROWS = 16


def in_tiles(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """layer(x) computed TILE_ROWS rows at a time (the last tile padded with zeros, whose
    outputs are dropped) on one thread, so that every GEMM it runs has the same shape and the
    same split of its sums."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padding = -rows % TILE_ROWS
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding, flat.shape[1])])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = torch.cat([layer(tile) for tile in flat.split(TILE_ROWS)])
    finally:
        torch.set_num_threads(threads)
    return out[:rows].view(*x.shape[:-1], -1)


@dataclass(frozen=True)
class Q4Source:
    """What q4 layers are built from: a GGUF's own blocks by Hugging Face weight name (empty:
    computed from the dense weights) and the kernel that multiplies them (native or torch)."""

    blocks: dict[str, Q4Blocks] = field(default_factory=dict)
    kernel: str = "torch"


def q4_blocks(weight: torch.Tensor) -> Q4Blocks:
    """Q4_1-style blocks of a dense weight: per group of 32, the minimum and (max - min) / 15."""
    rows, columns = weight.shape
    groups = weight.detach().float().view(rows, columns // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.view(rows, columns).to(torch.uint8), scale, low


def output_head(fmt: str, weight: torch.Tensor, q4_kernel: str) -> nn.Module:
    """The output head of a model whose layers are in `fmt` (int8 or q4): Q8_0 on the native
    kernel (where its rows come in whole groups of 8 and its columns in blocks of 32), else int8
    per row. Either way 8 bits, as llama.cpp keeps its own head."""
    rows, columns = weight.shape
    if fmt == "q4" and q4_kernel == "native" and rows % 8 == 0 and columns % Q4_GROUP == 0:
        return Q8Linear(weight)
    return Int8Linear(weight, None)


def fits_q4(rows: int, columns: int) -> bool:
    return rows % Q4_ROWS_MULTIPLE == 0 and columns % Q4_GROUP == 0


def stacked(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Rows of several layers' tensors as one (their biases: all or none)."""
    if any(p is None for p in parts):
        return None
    return torch.cat([p for p in parts if p is not None])


def make_linear(
    fmt: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: Q4Blocks | None = None,
    q4_kernel: str = "torch",
) -> nn.Module:
    """One linear layer in `fmt`; for q4, `blocks` are the file's own (else computed), and
    `q4_kernel` the kernel that multiplies them (native or torch)."""
    if fmt == "dense":
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return linear
    if fmt == "q4" and fits_q4(*weight.shape):
        codes, scales, minimums = blocks if blocks is not None else q4_blocks(weight)
        return Q4Linear(codes, scales, minimums, bias, weight.dtype, q4_kernel)
    if fmt == "q4":
        log.info("a %s linear layer does not fit the 4-bit kernel: int8", tuple(weight.shape))
    return Int8Linear(weight, bias)
