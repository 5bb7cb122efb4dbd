"""A bfloat16 weight reordered once into oneDNN's own layout, for wide passes.

`torch.nn.functional.linear` on a plain bf16 weight [out, in] runs oneDNN's matmul on that
plain matrix at every call. A weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`,
what torch's compiler uses when it freezes a CPU graph) and multiplied by
`torch.ops.mkldnn._linear_pointwise` cost less, with the same bits. Measured on a 2-vCPU Xeon
with AMX (torch 2.13.0+cpu, 2 threads, 2026-12-05), median of 50 calls, plain against reordered,
bit-equal in every case:

  SmolLM2 gate and up (3,072 x 576)   8 rows 172 / 123 us   64 rows 428 / 298 us
  down (576 x 1,536)                  8 rows  78 /  43 us   64 rows 235 / 192 us
  q, k and v (960 x 576)              8 rows  81 /  49 us   64 rows 136 /  98 us
  the head (49,152 x 576)             8 rows 2.97 / 1.68 ms 64 rows 7.07 / 4.12 ms
"""

import functools

import torch


@functools.cache
def reordered_bf16_here() -> bool:
    """Whether oneDNN can reorder a bf16 weight on this CPU. Asked once, of a tiny weight: a
    CPU build without oneDNN cannot, and oneDNN refuses on a CPU without AVX-512 (bw, vl, dq)
    or AVX-NE-CONVERT, which torch's build of it requires for the bf16 path."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


class ReorderedBF16:
    """weight [out, in] in bfloat16, reordered once; called with x [rows, in] in bfloat16."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self._weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), None)

    @property
    def weight(self) -> torch.Tensor:
        """The reordered weight, as oneDNN's linear takes it (decode_wide.cpp calls it too)."""
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._weight, None, "none", [], "")
