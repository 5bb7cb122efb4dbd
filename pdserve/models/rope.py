"""Rotary position embeddings: each token's q and k rotated by angles set by its own position.

Frequencies follow the RoPE paper (Su et al., 2021): theta^(-2i/d) for i < d/2, laid out in two
halves (the Hugging Face layout, not llama.cpp's interleaved one). Llama 3.1's scaling divides
the low frequencies by `factor` and blends the middle band, as its reference config describes
(rope_type "llama3": factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings); "linear" divides every frequency by `factor`.
"""

import math

import torch

from pdserve.models.rope_types import SUPPORTED_TYPES  # noqa: F401  (re-exported)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv, scaling)
    return inv


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    # Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept as they are.
    scaled = torch.where(wavelength > old_context / low, inv / factor, inv)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return torch.where(middle, blended, scaled)


class Rotary:
    """cos and sin for a batch of positions, computed once per forward and shared by every layer."""

    def __init__(
        self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, fused: bool
    ) -> None:
        """`fused`: q and k rotated in place by one native step op (pdserve/kernels/step_ops.py)."""
        self.fused = fused
        angles = positions[:, None].float() * inv_freq[None, :]
        both = torch.cat((angles, angles), dim=-1)[:, None, :]  # [tokens, 1, head_dim]
        self.cos, sin = both.cos().to(dtype), both.sin()
        self.half = sin.shape[-1] // 2
        # Rotating half the dimensions against the other is (-x2, x1): x rolled by half, with the
        # first half's sign flipped. The flip goes into sin once, so that each apply is three
        # kernels (mul, roll, addcmul) rather than six, on every layer's q and k.
        self.sin_signed = torch.cat((-sin[..., : self.half], sin[..., self.half :]), -1).to(dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated at each token's position."""
        return torch.addcmul(x * self.cos, x.roll(self.half, -1), self.sin_signed)

    def apply_pair(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated; in place where fused (they are views of this step's projection)."""
        if self.fused:
            torch.ops.pdserve.rotary_(q, k, self.cos, self.sin_signed)
            return q, k
        return self.apply(q), self.apply(k)
