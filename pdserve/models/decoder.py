"""The three ways to run a decoder-only transformer, written once for every architecture.

An architecture subclasses DecoderOnly and provides:
  embed(tokens, positions)  -> x [tokens, d_model]
  rotary(positions)         -> whatever its layers need to place tokens (RoPE's cos/sin), or None
  layers                    each with qkv(x, rotary) -> q, k, v and finish(x, attn) -> x
  head(x)                   -> logits
"""

from typing import Any, Iterable, Protocol, cast

import torch
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.models import attention, invariant_attention
from pdserve.models.quantized import in_tiles
from pdserve.models.protocol import ContiguousKv, LayerKvCallback, PagedKv


class DecoderLayer(Protocol):
    """What each of an architecture's `layers` does (rotary: what its `rotary()` returned)."""

    def qkv(self, x: torch.Tensor, rotary: Any) -> tuple[torch.Tensor, ...]: ...

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor: ...


class DecoderOnly(nn.Module):
    config: ModelConfig  # set by each architecture's __init__

    # What each architecture provides (see the module docstring).
    @property
    def layers(self) -> nn.ModuleList:
        """The DecoderLayers, in order."""
        raise NotImplementedError

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def prefill_packed(self, prompts: list[list[int]], on_layer: LayerKvCallback) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        x, rotary = self.embed(tokens, positions), self.rotary(positions)
        kernels = invariant_attention.kernels(self.config.numerics)
        for index, layer in enumerate(self._decoder_layers()):
            q, k, v = layer.qkv(x, rotary)
            on_layer(index, k, v)
            x = layer.finish(x, kernels.packed_causal(q, k, v, lengths))
        last = torch.tensor(lengths).cumsum(0) - 1
        return self.logits(x[last])

    @torch.inference_mode()
    def decode_paged(
        self,
        tokens: list[int],
        positions: list[int],
        cache: PagedKv,
        logits_rows: list[int] | None = None,
    ) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long)
        x, rotary = self.embed(torch.tensor(tokens, dtype=torch.long), pos), self.rotary(pos)
        # A step of decodes alone (the paged cache's decode_only; a view that wraps it has
        # none), where the architecture runs whole layers natively: one call for all of them.
        if getattr(cache, "decode_only", False) and self.whole_layers(len(tokens)):
            x = self.decode_layers(x, rotary, cache.step_operands())  # type: ignore[attr-defined]
            return self.logits(x if logits_rows is None else x[logits_rows])
        for index, layer in enumerate(self._decoder_layers()):
            q, k, v = layer.qkv(x, rotary)
            x = layer.finish(x, cache.attend(index, q, k, v))
        return self.logits(x if logits_rows is None else x[logits_rows])

    def whole_layers(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows may run its layers in one native call."""
        return False

    def decode_layers(self, x: torch.Tensor, rotary, cache_operands: tuple) -> torch.Tensor:
        """Every layer of a decode step in one native call, where whole_layers says it may."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward_contiguous(self, tokens: list[int], cache: ContiguousKv) -> torch.Tensor:
        start = cache[0][0].shape[0] if cache else 0
        pos = torch.arange(start, start + len(tokens))
        x, rotary = self.embed(torch.tensor(tokens, dtype=torch.long), pos), self.rotary(pos)
        for index, layer in enumerate(self._decoder_layers()):
            q, k, v = layer.qkv(x, rotary)
            if len(cache) <= index:
                cache.append((k[:0], v[:0]))
            keys, values = torch.cat([cache[index][0], k]), torch.cat([cache[index][1], v])
            cache[index] = (keys, values)
            x = layer.finish(x, attention.causal(q, keys, values, start))
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 whatever the weights' dtype, so sampling sees the same numbers everywhere.
        Invariant numerics run a dense head in tiles of 16 rows, as PaddedRows does the other
        layers (a tied head is no module for it to wrap); an 8-bit head needs none."""
        if self.config.numerics == "invariant" and not self.head_is_row_invariant():
            return in_tiles(self.head, x).float()
        return self.head(x).float()

    def head_is_row_invariant(self) -> bool:
        """Whether the head gives a row the same logits however many rows share its pass."""
        return False

    def rotary(self, positions: torch.Tensor):
        return None

    def _decoder_layers(self) -> Iterable[DecoderLayer]:
        # nn.ModuleList is not generic: it types its items as Module, whatever they are.
        return cast(Iterable[DecoderLayer], self.layers)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
