"""Model configuration: the one set of numbers every service must agree on.

Torch-free, so the router (which never imports torch) can validate requests against it. The
defaults describe TinyGPT, the small random-weight test model; checkpoints fill every field from
their config.json (pdserve.models.checkpoint).
"""

from dataclasses import dataclass

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# How the linear layers hold their weights (pdserve/models/quantized.py): the checkpoint's own in
# `dtype`, int8 per output row, or 4-bit groups (llama.cpp's Q4_1).
WEIGHT_FORMATS = ("dense", "int8", "q4")
# The --weights default: q4 for a bfloat16 model converted from a Q4_1 GGUF (its own blocks, so
# the model the file ships), dense otherwise (float32 stays the exact reference).
AUTO_WEIGHTS = "auto"
# How sums are ordered (--numerics): "fast" picks each pass's fastest kernels, whose results for a
# row depend on the batch and the path; "invariant" gives a row the same result in any batch, on
# any path (prompt, chunk, decode, migration), at a cost (pdserve/models/invariant_attention.py).
NUMERICS = ("fast", "invariant")
# The kernel that multiplies q4 layers (pdserve/kernels/native.py): torch's int4 kernel, or
# pdserve's own, computing as llama.cpp does; "" for the other formats. --q4-kernel auto picks
# the one measured faster on this kind of CPU.
Q4_KERNELS = ("torch", "native")
Q4_KERNEL_CHOICES = ("auto", *Q4_KERNELS)
# How a step's work besides the matrices runs (pdserve/kernels/step_ops.py): torch's own ops, or
# pdserve's fused ones (norms, RoPE, paged decode attention in one call each); --step-ops auto
# picks native where it can run. Fast numerics and float32 or bfloat16 only.
STEP_OPS = ("torch", "native")
STEP_OPS_CHOICES = ("auto", *STEP_OPS)


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of a decoder-only transformer, and the dtype its weights and KV are held in.

    TinyGPT's defaults give 5.91M parameters, the size of the chapter's reference model, with a
    byte-level vocabulary (256 bytes + end-of-sequence) and a 4096-token context.
    """

    architecture: str = "TinyGPT"
    vocab_size: int = 257
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    d_ff: int = 1024
    max_context: int = 4096
    dtype: str = "float32"
    seed: int = 1234  # TinyGPT only: its random weights are drawn from this seed
    n_kv_heads: int = 0  # 0: as many as query heads (no grouped-query attention)
    head_size: int = 0  # 0: d_model // n_heads
    rope_theta: float = 10000.0
    # Llama 3's frequency scaling as sorted (key, value) pairs, hashable; () for plain RoPE.
    rope_scaling: tuple = ()
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention_bias: bool = False  # biases on the q, k and v projections (Qwen2; Llama's option)
    output_bias: bool = False  # a bias on the attention output projection (Llama's option)
    mlp_bias: bool = False
    # Part of the model's identity (and so its fingerprint): KV computed with other weights differs.
    weights: str = "dense"
    # Also part of the identity: the two orders give (slightly) different KV and tokens.
    numerics: str = "fast"
    # Also part of the identity: the two q4 kernels round differently.
    q4_kernel: str = ""
    # Also part of the identity: the fused ops round their sums in another order than torch's.
    step_ops: str = "torch"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPE_SIZES)}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights {self.weights!r}: expected one of {', '.join(WEIGHT_FORMATS)}"
            )
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics {self.numerics!r}: expected one of {', '.join(NUMERICS)}")
        if self.q4_kernel not in (Q4_KERNELS if self.weights == "q4" else ("",)):
            raise ValueError(f"q4_kernel {self.q4_kernel!r} does not fit weights {self.weights}")
        if self.step_ops not in STEP_OPS:
            raise ValueError(f"step_ops {self.step_ops!r}: expected one of {', '.join(STEP_OPS)}")
        if self.step_ops == "native" and (
            self.numerics != "fast" or self.dtype not in ("float32", "bfloat16")
        ):
            raise ValueError(
                f"native step ops need fast numerics and float32 or bfloat16, not "
                f"{self.numerics} numerics in {self.dtype}"
            )
        if not self.head_size and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"{self.n_heads} query heads cannot share {self.kv_heads} KV heads evenly"
            )
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * self.bytes_per_element
