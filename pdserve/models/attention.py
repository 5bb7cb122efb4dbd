"""Attention over unpadded prompts and over one sequence's cache, with grouped-query attention.

Shapes are token-major, as the KV cache stores them: q [tokens, heads, dim], k/v [tokens,
kv_heads, dim]. When kv_heads < heads each KV head serves heads // kv_heads query heads
(scaled_dot_product_attention's enable_gqa does that without copying K and V).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F


KEY_ALIGNMENT = 1  # any bucket width will do (invariant_attention needs whole chunks)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q at positions offset.., k/v from position 0; -> [tq, heads, dim]."""
    tq, tk = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    # A leading batch dimension: 3-D inputs take the slow unfused path on CPU (measured 2.3x).
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if offset == 0 and tq == tk:  # a whole prompt: the fused causal kernel, no T x T mask
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)[
            0
        ].transpose(0, 1)
    allowed = torch.arange(tk)[None, :] <= torch.arange(offset, offset + tq)[:, None]
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, enable_gqa=gqa)[
        0
    ].transpose(0, 1)


def packed_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Causal attention within each prompt of a packed batch."""
    return each_prompt(causal, q, k, v, lengths)


def each_prompt(
    causal_fn: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
) -> torch.Tensor:
    """causal_fn(q, k, v, 0) over each prompt's rows of a packed batch, joined."""
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        out.append(causal_fn(q[s], k[s], v[s], 0))
        start += n
    return torch.cat(out)


def padded_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """One new token per sequence: q [batch, heads, dim]; k/v [kv_heads, batch, ctx, dim], as
    gathered from a head-major cache; mask [batch, ctx] (True where a position is the sequence's
    own) -> [batch, heads, dim].

    Plain bmm rather than scaled_dot_product_attention: with one query per sequence and a mask,
    the CPU kernel measured 2-2.5x slower. K and V are read where the gather put them (bmm takes
    K transposed as a view). Softmax is in float32; a bf16 or fp16 cache is widened first so the
    scores keep full precision.
    """
    batch, heads, dim = q.shape
    kv_heads, _, ctx, _ = k.shape
    group = heads // kv_heads
    k, v = k.float(), v.float()  # no copy when the caller gathered them as float32
    # [batch, heads, dim] -> [kv_heads * batch, group, dim], matching K's merged batch order.
    grouped = q.float().view(batch, kv_heads, group, dim).transpose(0, 1).reshape(-1, group, dim)
    scores = torch.bmm(grouped, k.view(-1, ctx, dim).transpose(1, 2)) * dim**-0.5
    scores = scores.view(kv_heads, batch, group, ctx)
    weights = scores.masked_fill(~mask[None, :, None, :], float("-inf")).softmax(-1)
    out = torch.bmm(
        weights.view(-1, group, ctx), v.view(-1, ctx, dim)
    )  # [kv_heads*batch, group, dim]
    return (
        out.view(kv_heads, batch, group, dim).transpose(0, 1).reshape(batch, heads, dim).to(q.dtype)
    )
