"""Attention whose result for a query depends only on that query and its own keys.

The fast kernels in attention.py give the same query different results depending on what else
is computed with it: the fused prompt kernel splits the keys by the prompt's length, and a
decode bucket pads every member to its longest, which moves where the GEMM's long reduction is
blocked. In bfloat16 that difference is enough to change a token. Here every sum has an order
set by key positions alone:

- scores are one fp32 bmm over the head dimension with at least MIN_ROWS query rows (1 to 3
  rows take another kernel, with other results; on the AVX2 EPYC 4 rows sufficed, but on a Xeon
  with AMX a decode step padded to 4 rows and the same row in a prompt pass differed, and from
  16 they agree: tests/test_invariance.py);
- the softmax's max is exact, exp is elementwise;
- values and the denominator are summed per CHUNK of keys aligned to position 0 (measured: a
  bmm over 64 keys, zeros where a query may not look, gives a row the same result from 4 rows
  up; over a few hundred keys its inner blocking moves with the length), then across chunks
  with cumsum, which adds strictly in order.
  Keys past a query's span weigh exactly 0, so padding adds exact zeros and changes nothing.

Used for every path (prompt, chunked prompt, decode) when the model's numerics are
`invariant`, so a request's tokens do not depend on its batch, its path or a migration.
"""

import sys
from types import ModuleType

import torch

from pdserve.models import attention

CHUNK = 64
KEY_ALIGNMENT = CHUNK  # a decode bucket's width is a multiple of this, so it needs no padding
MIN_ROWS = 16  # an fp32 bmm gives a row the same bits from this many rows up
QUERY_TILE = 128  # prompt rows per pass: bounds the per-chunk partial sums' memory


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor):
    """q [B, M, dim]; keys and values [B, W, dim] (W a multiple of CHUNK, finite everywhere);
    allowed [B or 1, M, W], True where a query may see a key -> float32 [B, M, dim]."""
    batch, rows, dim = q.shape
    q, allowed = q.float(), allowed.expand(batch, rows, -1)
    if rows < MIN_ROWS:  # padded rows see every key; they are dropped before returning
        q = torch.cat([q, q.new_zeros(batch, MIN_ROWS - rows, dim)], 1)
        allowed = torch.cat(
            [allowed, allowed.new_ones(batch, MIN_ROWS - rows, allowed.shape[2])], 1
        )
    padded = q.shape[1]
    scores = torch.bmm(q, keys.float().transpose(1, 2)) * dim**-0.5
    scores.masked_fill_(~allowed, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp_()
    chunks = keys.shape[1] // CHUNK
    by_chunk = weights.view(batch, padded, chunks, CHUNK)
    denominator = by_chunk.sum(-1).cumsum(-1)[..., -1:]
    partial = torch.bmm(
        by_chunk.transpose(1, 2).reshape(batch * chunks, padded, CHUNK),
        values.float().reshape(batch * chunks, CHUNK, dim),
    )
    numerator = partial.view(batch, chunks, padded, dim).cumsum(1)[:, -1]
    return (numerator / denominator)[:, :rows]


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [tq, heads, dim] at positions offset.., k/v [tk, kv_heads, dim] from position 0
    (tk = offset + tq) -> [tq, heads, dim] in q's dtype. Query rows go QUERY_TILE at a time,
    each tile over only the chunks it can see."""
    tq, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    width = -(-k.shape[0] // CHUNK) * CHUNK
    keys = _padded(k, width)  # [kv_heads, width, dim] float32
    values = _padded(v, width)
    # [tq, heads, dim] -> [kv_heads, tq * group, dim]: each KV head with its query heads' rows.
    grouped = q.float().view(tq, kv_heads, group, dim).permute(1, 0, 2, 3)
    out = []
    for first in range(0, tq, QUERY_TILE):
        last = min(first + QUERY_TILE, tq)
        seen = -(-(offset + last) // CHUNK) * CHUNK
        positions = torch.arange(offset + first, offset + last).repeat_interleave(group)
        allowed = torch.arange(seen)[None, :] <= positions[:, None]
        tile = grouped[:, first:last].reshape(kv_heads, (last - first) * group, dim)
        attended = attend(tile, keys[:, :seen], values[:, :seen], allowed[None])
        out.append(attended.view(kv_heads, last - first, group, dim))
    joined = torch.cat(out, 1).permute(1, 0, 2, 3).reshape(tq, heads, dim)
    return joined.to(q.dtype)


def packed_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Causal attention within each prompt of a packed batch."""
    return attention.each_prompt(causal, q, k, v, lengths)


def padded_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """attention.padded_decode's contract (q [batch, heads, dim]; k/v [kv_heads, batch, ctx,
    dim]; mask [batch, ctx]) with this module's order of sums."""
    batch, heads, dim = q.shape
    kv_heads, _, ctx, _ = k.shape
    group = heads // kv_heads
    width = -(-ctx // CHUNK) * CHUNK
    if width != ctx:  # a block size that is not a multiple of CHUNK
        k, v = _pad_keys(k, width), _pad_keys(v, width)
        mask = torch.cat([mask, mask.new_zeros(batch, width - ctx)], 1)
    grouped = q.view(batch, kv_heads, group, dim).transpose(0, 1).reshape(-1, group, dim)
    allowed = mask.repeat(kv_heads, 1)[:, None, :]
    out = attend(grouped, k.reshape(-1, width, dim), v.reshape(-1, width, dim), allowed)
    return (
        out.view(kv_heads, batch, group, dim).transpose(0, 1).reshape(batch, heads, dim).to(q.dtype)
    )


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """[tokens, kv_heads, dim] -> float32 [kv_heads, width, dim], zeros after the tokens."""
    out = x.new_zeros(x.shape[1], width, x.shape[2], dtype=torch.float32)
    out[:, : x.shape[0]] = x.transpose(0, 1)
    return out


def _pad_keys(x: torch.Tensor, width: int) -> torch.Tensor:
    """[kv_heads, batch, ctx, dim] -> the same with zeros up to `width` keys."""
    pad = x.new_zeros(*x.shape[:2], width - x.shape[2], x.shape[3])
    return torch.cat([x, pad], 2)


def kernels(numerics: str) -> ModuleType:
    """The module whose causal, packed_causal and padded_decode a model with these numerics
    (ModelConfig.numerics) runs: attention.py's fast kernels, or this module's."""
    return sys.modules[__name__] if numerics == "invariant" else attention
