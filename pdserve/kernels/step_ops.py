"""The fused step ops (step_ops.cpp), built into the native library beside the q4 kernel.

A decode step of a small model spends more time in the many small ATen calls around its matrices
(norms, RoPE, gathering the paged KV, widening it, attention) than in the matrices at one
stream. `--step-ops native` runs each of those as one call per layer:
  rms_norm       RMSNorm of [rows, width], rounded where the torch module rounds
  rotary_        RoPE on q and k in place
  paged_decode   the step's K and V written to their slots, then each sequence attended over its
                 own blocks in the cache's dtype: no gather, no float32 copy of the context
Where a step holds decodes alone and every matrix is native Q4_1, all its layers run in one
call over these ops and the q4 kernel (decode_layer.cpp, llama.py's decode_layers).
`auto` (the default) picks native where the library runs (x86-64 Linux with AVX2, FMA, F16C) for
fast numerics in float32 or bfloat16, and torch otherwise: invariant numerics sum attention in
fixed chunks of keys that these ops do not.
"""

from pdserve.core.config import STEP_OPS_CHOICES
from pdserve.kernels import native


def resolve(choice: str, numerics: str, dtype: str) -> str:
    """--step-ops checked and `auto` resolved for a model with these numerics and dtype."""
    if choice not in STEP_OPS_CHOICES:
        raise ValueError(f"--step-ops must be one of {', '.join(STEP_OPS_CHOICES)}, got {choice!r}")
    fits = numerics == "fast" and dtype in ("float32", "bfloat16")
    if choice == "auto":
        return "native" if fits and native.why_unavailable() is None else "torch"
    if choice == "native":
        if not fits:
            raise ValueError(
                f"--step-ops native needs --numerics fast and float32 or bfloat16 weights, "
                f"not {numerics} numerics in {dtype}"
            )
        reason = native.why_unavailable()
        if reason is not None:
            raise native.KernelUnavailable(f"--step-ops native cannot run here: {reason}")
    return choice


def load() -> None:
    """Registers torch.ops.pdserve.rms_norm, rotary_ and paged_decode (one library with q4's)."""
    native.load()
