"""Model configuration: the one set of numbers every service must agree on."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """TinyGPT: a decoder-only transformer with random weights drawn from `seed`.

    The defaults give 5.91M parameters, the size of the chapter's reference model, with a byte-level
    vocabulary (256 bytes + end-of-sequence) and a 4096-token context.
    """

    vocab_size: int = 257
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    d_ff: int = 1024
    max_context: int = 4096
    seed: int = 1234
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.dtype != "float32":  # the wire format knows others; the model computes in fp32
            raise ValueError(f"dtype {self.dtype!r}: only float32 is implemented")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * self.bytes_per_element


DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
