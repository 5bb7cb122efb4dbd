"""Linear layers in fewer bytes: int8 weight-only and 4-bit groups (q4), on torch's own CPU kernels.

A decode step reads every weight once per step, so at small batches its time follows the bytes
read. Three formats (`--weights`):

  dense  the checkpoint's weights in --dtype (nn.Linear)
  int8   one int8 per weight and one scale per output row (symmetric), any checkpoint;
         torch._weight_int8pack_mm
  q4     4-bit codes in groups of 32 input columns, each group with a scale and a minimum, as
         llama.cpp's Q4_1 stores them: weight = code * scale + minimum. From a Q4_1 GGUF the
         blocks are read as they are (the model the file ships); from any other checkpoint they
         are computed from the dense weights. torch._weight_int4pack_mm_for_cpu

The int4 kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale. Its scales
are held in the activations' dtype: bfloat16 rounds Q4_1's fp16 scales to 8 significant bits.
A q4 layer whose shape the kernel refuses (output rows not a multiple of 16, input columns not a
multiple of 32) stays int8, and says so in the log.

A pass of many rows (a prompt's prefill) is bound by arithmetic, not by bytes, and the int4
kernel is then the slower way: on an AVX2 CPU at 1,500 rows it took 54-57 ms per SmolLM2 matrix
against 22-30 ms for a float32 GEMM (and 145-170 ms in bfloat16, which AVX2 has no instructions
for). So a q4 layer keeps its codes and, from WIDE_ROWS rows up, multiplies in float32 by the
same weights, dequantized once on first use (4 bytes per weight, only in a process that runs
such passes). The crossover measured there was 48-64 rows.
"""

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pdserve.models.invariant_attention import MIN_ROWS  # float32 GEMMs: invariant from here up

log = logging.getLogger(__name__)

Q4_GROUP = 32
Q4_ROWS_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement
WIDE_ROWS = 128  # from here up, a q4 layer multiplies in float32 (see the module's docstring)


class Int8Linear(nn.Module):
    codes: torch.Tensor  # buffers, declared for the type checker
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
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
        out = torch._weight_int8pack_mm(flat, self.codes, self.scale)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class Q4Linear(nn.Module):
    packed: torch.Tensor  # buffers, declared for the type checker
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
    ) -> None:
        """codes int [rows, columns] in 0..15; scales, minimums [rows, columns / 32]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        zeros = minimums.float() + 8 * scales.float()
        # The kernel's layout: [groups, rows, (scale, zero)].
        both = torch.stack([scales.float(), zeros], -1).transpose(0, 1).contiguous().to(dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", both)
        # The same codes two to a byte (the kernel's packing is its own), for the float32 copy.
        small = codes.to(torch.uint8)
        self.register_buffer("nibbles", small[:, 0::2] | (small[:, 1::2] << 4))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._wide: torch.Tensor | None = None
        # None keeps every pass on the int4 kernel, whose result for a row does not depend on
        # how many rows share the pass (invariant numerics); float32 from WIDE_ROWS would.
        self.wide_rows: int | None = WIDE_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.wide_rows is not None and flat.shape[0] >= self.wide_rows:
            out = torch.nn.functional.linear(flat.float(), self.wide_weight()).to(x.dtype)
        else:
            out = torch._weight_int4pack_mm_for_cpu(
                flat, self.packed, Q4_GROUP, self.scales_and_zeros
            )
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def wide_weight(self) -> torch.Tensor:
        """The float32 weights the kernel reads: (code - 8) * scale + zero, with its scales."""
        if self._wide is None:
            rows, columns = self.out_features, self.in_features
            codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).view(rows, -1, Q4_GROUP)
            held = self.scales_and_zeros.float().transpose(0, 1)  # [rows, groups, 2]
            scale, zero = held[..., 0:1], held[..., 1:2]
            self._wide = ((codes.float() - 8) * scale + zero).view(rows, columns)
        return self._wide


class PaddedRows(nn.Module):
    """A float32 dense layer that always multiplies at least MIN_ROWS rows (invariant numerics).

    Measured on this machine's torch: a float32 GEMM gives a row the same result from 4 rows up,
    whatever the batch or the threads, but 1 to 3 rows take another kernel with other results.
    So a decode step of one sequence is padded to 4 rows. The int8 and int4 kernels, and the
    bfloat16 GEMM, were measured row-invariant from one row, and are left as they are."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_min_rows(self.linear, x)


def with_min_rows(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = MIN_ROWS
) -> torch.Tensor:
    """layer(x) computed on at least `rows` rows (zeros added, their outputs dropped)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] >= rows:
        return layer(x)
    padded = torch.cat([flat, flat.new_zeros(rows - flat.shape[0], flat.shape[1])])
    return layer(padded)[: flat.shape[0]].view(*x.shape[:-1], -1)


Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, minimums


def q4_blocks(weight: torch.Tensor) -> Q4Blocks:
    """Q4_1-style blocks of a dense weight: per group of 32, the minimum and (max - min) / 15."""
    rows, columns = weight.shape
    groups = weight.detach().float().view(rows, columns // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.view(rows, columns).to(torch.uint8), scale, low


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
) -> nn.Module:
    """One linear layer in `fmt`; for q4, `blocks` are the file's own (else computed)."""
    if fmt == "dense":
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return linear
    if fmt == "q4" and fits_q4(*weight.shape):
        codes, scales, minimums = blocks if blocks is not None else q4_blocks(weight)
        return Q4Linear(codes, scales, minimums, bias, weight.dtype)
    if fmt == "q4":
        log.info("a %s linear layer does not fit the 4-bit kernel: int8", tuple(weight.shape))
    return Int8Linear(weight, bias)
