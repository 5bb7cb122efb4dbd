"""The model seam: what the engines call, and what a paged cache offers a decode step.

Every architecture implements the same three ways to run (pdserve.models.decoder does it once for
all of them):
  prefill_packed     several prompts of different lengths in one pass (tokens packed, no padding),
                     handing each layer's K and V to a callback as soon as the layer is done;
  decode_paged       one new token for each of many sequences whose KV lives in a paged cache;
  forward_contiguous one sequence with a plain contiguous cache: the reference.
Schedulers see only this protocol, never a model class.
"""

from typing import Callable, Protocol

import torch

from pdserve.core.config import ModelConfig

# Called once per layer during prefill with the packed K and V of every token:
# (layer, K [tokens, kv_heads, head_dim], V [tokens, kv_heads, head_dim]), in the KV dtype.
LayerKvCallback = Callable[[int, torch.Tensor, torch.Tensor], None]

# One sequence's cache for forward_contiguous: per layer (K, V), each [tokens, kv_heads, head_dim].
ContiguousKv = list[tuple[torch.Tensor, torch.Tensor]]


class PagedKv(Protocol):
    """One decode step's view of a paged cache (pdserve.engine.paged_cache.DecodeStepKv)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stores the step's new K/V [rows, kv_heads, dim] and attends q [rows, heads, dim]
        over each sequence's own cached tokens plus the new ones; returns [rows, heads, dim]."""
        ...


class CausalLM(Protocol):
    config: ModelConfig

    def prefill_packed(self, prompts: list[list[int]], on_layer: LayerKvCallback) -> torch.Tensor:
        """Last position's logits of each prompt, float32 [batch, vocab]."""
        ...

    def decode_paged(
        self,
        tokens: list[int],
        positions: list[int],
        cache: PagedKv,
        logits_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """One step for many sequences, float32 logits [batch, vocab]. With a chunked-prefill
        view the rows also hold prompt chunks; `logits_rows` then picks the rows that need
        logits (each decoding sequence, and the last token of each prompt that completes)."""
        ...

    def forward_contiguous(self, tokens: list[int], cache: ContiguousKv) -> torch.Tensor:
        """Appends tokens to one sequence (cache grown in place); float32 logits [tokens, vocab]."""
        ...
