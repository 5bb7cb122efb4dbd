"""The KV cache tensor of a decode pool, addressed by slot (block * block_size + offset).

Head-major, [layers, K/V, kv_heads, slots, head_dim]: gathering a batch's slots then yields
[kv_heads, batch, tokens, head_dim], whose leading dimensions merge into one batch for bmm, so
decode attention reads the gathered KV in place, with no transposing copy.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.core.block_pool import BlockTable
from pdserve.core.config import ModelConfig
from pdserve.models import invariant_attention

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PagedCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int) -> None:
        slots = num_blocks * block_size
        shape = (config.n_layers, 2, config.kv_heads, slots, config.head_dim)
        self.kv = torch.zeros(shape, dtype=TORCH_DTYPES[config.dtype])
        self.block_size = block_size
        self.attention = invariant_attention.kernels(config.numerics)  # fast or invariant sums
        # The native step op attends each sequence over its own blocks (dims in lanes of 8).
        self.fused_decode = config.step_ops == "native" and config.head_dim % 8 == 0
        self._scratch: dict[str, torch.Tensor] = {}

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reusable buffer for one decode step's gathered KV. A freshly allocated tensor of tens
        of MB is mapped page by page on first touch, which measured ~5x slower than copying into
        memory already mapped; so buffers are kept and only grow."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._scratch[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)

    def copy_block(self, source: int, target: int) -> None:
        """Copies one block's K and V in every layer: a further completion's own copy of the
        block its prompt ends in, which it goes on writing."""
        bs = self.block_size
        self.kv[..., target * bs : (target + 1) * bs, :].copy_(
            self.kv[..., source * bs : (source + 1) * bs, :]
        )

    def write(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores K and V [tokens, heads, dim] of one layer at the given slots.

        Where the slots form a few long runs, which is usual (the pool hands out ascending blocks
        and takes them back in an order that keeps them so), each run is one slice copy: measured
        3.7x (float32) and 7x (bfloat16) faster than index_copy_ on one core, which was the
        largest cost of taking in a handoff."""
        runs = contiguous_runs(slots)
        if len(runs) * MIN_TOKENS_PER_RUN > len(slots):
            index = torch.tensor(slots, dtype=torch.long)
            self.kv[layer, 0].index_copy_(1, index, k.transpose(0, 1))
            self.kv[layer, 1].index_copy_(1, index, v.transpose(0, 1))
            return
        for first_token, first_slot, length in runs:
            rows = slice(first_token, first_token + length)
            self.kv[layer, 0].narrow(1, first_slot, length).copy_(k[rows].transpose(0, 1))
            self.kv[layer, 1].narrow(1, first_slot, length).copy_(v[rows].transpose(0, 1))

    def step_view(
        self, tables: list[BlockTable], lengths: list[int], chunks: Sequence["PromptChunk"] = ()
    ) -> "DecodeStepKv":
        """The cache as one decode step sees it: each sequence's `lengths[i]` tokens, one new;
        then, for chunked prefill, prompt chunks whose rows follow the decode rows."""
        return DecodeStepKv(self, tables, lengths, list(chunks))


# Below this average run length, one index_copy_ beats a slice copy per run (measured equal at
# 16 tokens per run, where the per-call cost of the slices cancels their speed).
MIN_TOKENS_PER_RUN = 64


def contiguous_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first token, first slot, length) of each run of consecutive slots, in token order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, slots[start], i - start))
            start = i
    return runs


class DecodeStepKv:
    """Implements pdserve.models.protocol.PagedKv for one batched decode step.

    Sequence i has lengths[i] tokens cached before the step; the step writes its new token at
    position lengths[i] and attends over positions [0, lengths[i]].

    The cost follows the sum of the context lengths, not batch x longest: sequences are grouped
    into buckets of similar length (lengths.py), and each bucket is gathered and padded only to its
    own longest member. One long request therefore costs its own KV read, not a 30x slowdown of
    every short stream beside it. Slot indices are built with tensor ops, once per step. With
    the native step ops (PagedCache.fused_decode) one call per layer writes the new K and V and
    attends each sequence over its own blocks, so no buckets are built at all.
    """

    def __init__(
        self,
        cache: PagedCache,
        tables: list[BlockTable],
        lengths: list[int],
        chunks: Sequence["PromptChunk"] = (),
    ) -> None:
        self._cache = cache
        block_size = cache.block_size
        self._decodes = len(lengths)
        new = [
            t.blocks[n // block_size] * block_size + n % block_size
            for t, n in zip(tables, lengths, strict=True)
        ]
        self._chunks = [_ChunkView(c, block_size) for c in chunks]
        self._new = torch.tensor(
            new + [s for c in chunks for s in c.table.slots(c.start, c.end)], dtype=torch.long
        )
        # The native op attends each sequence over its own blocks: no buckets to gather.
        fused = cache.fused_decode and bool(lengths)
        self._fused = _FusedDecode(tables, lengths, block_size) if fused else None
        self.buckets = [] if fused else self._bucketed(tables, lengths, block_size)
        members = [i for b in self.buckets for i in b.members]
        # None where one bucket holds the sequences in batch order (sequences about as long as
        # each other, the usual case): no gather of q and no reordering of the output.
        in_order = len(self.buckets) == 1 and members == list(range(len(members)))
        self._order = None if in_order or not members else torch.tensor(members).argsort()

    def _bucketed(
        self, tables: list[BlockTable], lengths: list[int], block_size: int
    ) -> list["_Bucket"]:
        # Invariant attention sums whole chunks of keys: a bucket gathers that many blocks.
        align = max(1, self._cache.attention.KEY_ALIGNMENT // block_size)
        return [
            _Bucket(
                members,
                [tables[i] for i in members],
                [lengths[i] + 1 for i in members],
                block_size,
                align,
            )
            for members in buckets_by_length(lengths)
        ]

    @property
    def decode_only(self) -> bool:
        """Every row is a decode that the native paged_decode attends: a model may then run
        all its layers natively, with step_operands (pdserve/kernels/decode_layer.cpp)."""
        return self._fused is not None and not self._chunks

    def step_operands(self) -> tuple:
        """What decode_layers takes of the cache: all layers' K and V, and the step's slots,
        blocks and lengths as paged_decode takes them."""
        f = self._fused
        assert f is not None, "step_operands of a step that is not decode_only"
        return (self._cache.kv, self._new, f.blocks, f.spans, f.block_size)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self._cache.kv[layer, 0], self._cache.kv[layer, 1]
        outs = []
        if self._fused is not None:  # writes every new row's K and V, attends the decodes
            outs.append(self._fused.attend(q[: self._decodes], k, v, keys, values, self._new))
        else:
            keys.index_copy_(1, self._new, k.transpose(0, 1))
            values.index_copy_(1, self._new, v.transpose(0, 1))
        if self.buckets:
            decode_out = [
                self._cache.attention.padded_decode(
                    q[: self._decodes] if self._order is None else q[b.index],
                    b.gather(keys, self._cache, "k"),
                    b.gather(values, self._cache, "v"),
                    b.mask,
                )
                for b in self.buckets
            ]
            ordered = decode_out[0] if self._order is None else torch.cat(decode_out)[self._order]
            outs.append(ordered)
        row = self._decodes
        for chunk in self._chunks:
            rows = slice(row, row + chunk.tokens)
            outs.append(
                self._cache.attention.causal(
                    q[rows], chunk.gather(keys), chunk.gather(values), chunk.start
                )
            )
            row += chunk.tokens
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass(frozen=True)
class PromptChunk:
    """Prompt positions [start, end) of one sequence, prefilled in a chunked-prefill step."""

    table: BlockTable
    start: int
    end: int


class _FusedDecode:
    """The decodes of a step for the native paged_decode op: each sequence's blocks, padded to
    the longest table (never read past its own length), and its length with the new token."""

    def __init__(self, tables: list[BlockTable], lengths: list[int], block_size: int) -> None:
        spans = [n + 1 for n in lengths]
        width = max(-(-n // block_size) for n in spans)
        rows = [t.blocks[:width] + [0] * (width - min(width, len(t.blocks))) for t in tables]
        self.blocks = torch.tensor(rows, dtype=torch.long)
        self.spans = torch.tensor(spans, dtype=torch.long)
        self.block_size = block_size

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_slots: torch.Tensor,
    ) -> torch.Tensor:
        """q [decodes, heads, dim]; k, v [every new row, kv_heads, dim], written at new_slots."""
        return torch.ops.pdserve.paged_decode(
            q, k, v, keys, values, new_slots, self.blocks, self.spans, self.block_size
        )


class _ChunkView:
    """One prompt chunk: attends causally over the prompt's cached prefix and itself."""

    def __init__(self, chunk: PromptChunk, block_size: int) -> None:
        self.start, self.tokens = chunk.start, chunk.end - chunk.start
        blocks = -(-chunk.end // block_size)
        self._blocks = torch.tensor(chunk.table.blocks[:blocks], dtype=torch.long)
        self._block_size, self._end = block_size, chunk.end

    def gather(self, layer_kv: torch.Tensor) -> torch.Tensor:
        """[kv_heads, slots, dim] -> this prompt's [0, end) as [tokens, kv_heads, dim]."""
        heads, slots, dim = layer_kv.shape
        by_block = layer_kv.view(heads, slots // self._block_size, self._block_size, dim)
        picked = by_block.index_select(1, self._blocks).flatten(1, 2)[:, : self._end]
        return picked.transpose(0, 1)


class _Bucket:
    """Sequences attended together: their blocks padded to the bucket's longest, and the mask."""

    def __init__(
        self,
        members: list[int],
        tables: list[BlockTable],
        spans: list[int],
        block_size: int,
        align: int = 1,
    ) -> None:
        self.members = members
        self.index = torch.tensor(members, dtype=torch.long)
        self.block_size = block_size
        width = -(-max(spans) // (block_size * align)) * align  # blocks, a multiple of `align`
        # Each sequence's own blocks, padded with its first one (masked) up to the bucket's width.
        rows = [t.blocks[:width] + [t.blocks[0]] * (width - len(t.blocks)) for t in tables]
        self.blocks = torch.tensor(rows, dtype=torch.long)  # [sequences, blocks]
        self.mask = torch.arange(width * block_size)[None, :] < torch.tensor(spans)[:, None]

    def gather(self, layer_kv: torch.Tensor, cache: PagedCache, name: str) -> torch.Tensor:
        """[kv_heads, slots, dim] -> float32 [kv_heads, sequences, tokens, dim], whole blocks at a
        time (block_size x head_dim contiguous values, rather than one token's row per copy)."""
        heads, slots, dim = layer_kv.shape
        by_block = layer_kv.view(heads, slots // self.block_size, self.block_size * dim)
        flat = self.blocks.flatten()
        picked = cache.scratch(name, (heads, len(flat), self.block_size * dim), layer_kv.dtype)
        # index_select copies whole rows; advanced indexing measured 3-5x slower here.
        torch.index_select(by_block, 1, flat, out=picked)
        if layer_kv.dtype != torch.float32:  # scores and softmax in float32 (attention.py)
            wide = cache.scratch(name + "32", picked.shape, torch.float32)
            picked = wide.copy_(picked)
        return picked.view(heads, self.blocks.shape[0], -1, dim)


def buckets_by_length(
    lengths: list[int], slack: float = 0.25, min_pad: int = 64
) -> list[list[int]]:
    """Indices grouped so that padding each group to its longest wastes at most `slack` of the
    longest, or `min_pad` tokens, per sequence: longest first, a new group when the next one is
    shorter than that."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] - lengths[i] <= max(
            slack * lengths[groups[-1][0]], min_pad
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
