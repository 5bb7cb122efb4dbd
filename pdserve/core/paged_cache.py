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
    """

    def __init__(self, cache: PagedCache, tables: list[BlockTable], lengths: list[int]) -> None:
        self._cache = cache
        width = max(lengths) + 1
        new_slots, gather_slots = [], []
        for table, n in zip(tables, lengths, strict=True):
            slots = table.slots(0, n + 1)
            new_slots.append(slots[-1])
            gather_slots.append(slots + [slots[-1]] * (width - n - 1))  # padding is masked out
        self._new = torch.tensor(new_slots, dtype=torch.long)
        self._gather = torch.tensor(gather_slots, dtype=torch.long)
        self.mask = torch.arange(width)[None, :] <= torch.tensor(lengths)[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        self._cache.kv[layer, 0].index_copy_(0, self._new, k)
        self._cache.kv[layer, 1].index_copy_(0, self._new, v)
        keys = self._cache.kv[layer, 0][self._gather]
        values = self._cache.kv[layer, 1][self._gather]
        return attention.masked_batch(q, keys, values, self.mask)
