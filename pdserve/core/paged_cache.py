"""The KV cache tensor of a decode pool, addressed by slot (block * block_size + offset)."""

import torch

from pdserve.core.block_pool import BlockTable
from pdserve.core.config import ModelConfig
from pdserve.models import attention

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PagedCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int) -> None:
        slots = num_blocks * block_size
        shape = (config.n_layers, 2, slots, config.kv_heads, config.head_dim)
        self.kv = torch.zeros(shape, dtype=TORCH_DTYPES[config.dtype])
        self.block_size = block_size

    def write(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores K and V [tokens, heads, dim] of one layer at the given slots."""
        index = torch.tensor(slots, dtype=torch.long)
        self.kv[layer, 0].index_copy_(0, index, k)
        self.kv[layer, 1].index_copy_(0, index, v)

    def step_view(self, tables: list[BlockTable], lengths: list[int]) -> "DecodeStepKv":
        """The cache as one decode step sees it: each sequence's `lengths[i]` tokens, one new."""
        return DecodeStepKv(self, tables, lengths)


class DecodeStepKv:
    """Implements pdserve.models.protocol.PagedKv for one batched decode step.

    Sequence i has lengths[i] tokens cached before the step; the step writes its new token at
    position lengths[i] and attends over positions [0, lengths[i]].

    The cost follows the sum of the context lengths, not batch x longest: sequences are grouped
    into buckets of similar length (lengths.py), and each bucket is gathered and padded only to its
    own longest member. One long request therefore costs its own KV read, not a 30x slowdown of
    every short stream beside it. Slot indices are built with tensor ops, once per step.
    """

    def __init__(self, cache: PagedCache, tables: list[BlockTable], lengths: list[int]) -> None:
        self._cache = cache
        block_size = cache.block_size
        self._new = torch.tensor([t.blocks[n // block_size] * block_size + n % block_size
                                  for t, n in zip(tables, lengths, strict=True)], dtype=torch.long)
        self.buckets = [_Bucket(members, [tables[i] for i in members],
                                [lengths[i] + 1 for i in members], block_size)
                        for members in buckets_by_length(lengths)]
        self._order = torch.tensor([i for b in self.buckets for i in b.members]).argsort()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        keys, values = self._cache.kv[layer, 0], self._cache.kv[layer, 1]
        keys.index_copy_(0, self._new, k)
        values.index_copy_(0, self._new, v)
        outs = [attention.padded_decode(q[b.index], keys[b.slots], values[b.slots], b.mask)
                for b in self.buckets]
        return torch.cat(outs)[self._order]


class _Bucket:
    """Sequences attended together: their slots padded to the bucket's longest, and the mask."""

    def __init__(self, members: list[int], tables: list[BlockTable], spans: list[int],
                 block_size: int) -> None:
        self.members = members
        self.index = torch.tensor(members, dtype=torch.long)
        width = max(spans)
        blocks_needed = -(-width // block_size)
        # Each sequence's first blocks_needed blocks (its own blocks, padded with its first one).
        rows = [t.blocks[:blocks_needed] + [t.blocks[0]] * (blocks_needed - len(t.blocks))
                for t in tables]
        blocks = torch.tensor(rows, dtype=torch.long)
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
        self.slots = slots[:, :width]  # [sequences, width]; positions past a span are masked
        self.mask = torch.arange(width)[None, :] < torch.tensor(spans)[:, None]


def buckets_by_length(lengths: list[int], slack: float = 0.25, min_pad: int = 64
                      ) -> list[list[int]]:
    """Indices grouped so that padding each group to its longest wastes at most `slack` of the
    longest, or `min_pad` tokens, per sequence: longest first, a new group when the next one is
    shorter than that."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] - lengths[i] <= max(slack * lengths[groups[-1][0]],
                                                                 min_pad):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
