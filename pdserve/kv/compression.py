"""Opt-in, lossy KV compression on the wire: int8 values with a float32 scale per row.

A row is one token's K (or V) in one KV head: head_dim values. Its scale is the row's largest
magnitude / 127, so every value maps to round(value / scale) in [-127, 127] and back to
int8 x scale, an error of at most scale / 2 per value. Keys and values of one head at one token
share a range far more than a whole layer does, which is why the scale is per row rather than
per block of tokens. The payload of a chunk of n tokens is the scales [2, n, kv_heads] as float32,
then the values [2, n, kv_heads, head_dim] as int8: 1 byte per value plus 8 / head_dim, against 2
for bf16 and 4 for fp32.

Only prompt KV handed from prefill to decode goes through this; what decode computes itself stays
exact. bench/kv_compression.py measures what it does to the output.
"""

import torch

_LEVELS = 127.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [..., heads] float32, values [..., heads, dim] int8) of x [..., heads, dim]."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / _LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
    values = torch.round(x / safe.unsqueeze(-1)).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return scales.contiguous(), values.contiguous()


def dequantize(scales: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def int8_payload_bytes(tokens: int, kv_heads: int, head_dim: int) -> int:
    rows = 2 * tokens * kv_heads
    return rows * 4 + rows * head_dim


def decode_int8(payload, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """K and V [2, tokens, heads, dim] in `dtype` from a payload whose length was checked."""
    two, tokens, heads, dim = shape
    rows = two * tokens * heads
    raw = torch.frombuffer(payload, dtype=torch.uint8)
    scales = raw[: rows * 4].view(torch.float32).view(two, tokens, heads)
    values = raw[rows * 4 :].view(torch.int8).view(two, tokens, heads, dim)
    return dequantize(scales, values, dtype)
