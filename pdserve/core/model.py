"""TinyGPT: the reference decoder-only transformer, with random weights from a fixed seed.

Every service builds it from the same ModelConfig and gets bit-identical weights. Three ways to run
it share the same layers:
  prefill_packed   several prompts of different lengths in one pass (tokens packed, no padding),
                   handing each layer's K and V to a callback as soon as the layer is done;
  decode_paged     one new token for each of many sequences whose KV lives in a paged cache;
  forward_contiguous  one sequence with a plain contiguous cache: the reference.
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.config import ModelConfig

# Called once per layer during prefill with the packed K and V of every token: [tokens, heads, dim].
LayerKvCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.up = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.down = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.n_heads, self.head_dim = c.n_heads, c.head_dim

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, d_model] -> q, k, v, each [tokens, heads, head_dim]."""
        q, k, v = self.qkv(self.ln1(x)).split(self.n_heads * self.head_dim, dim=-1)
        shape = (x.shape[0], self.n_heads, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and MLP after attention; attn [tokens, heads, head_dim]."""
        x = x + self.proj(attn.reshape(x.shape[0], -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights(config.seed)

    def _init_weights(self, seed: int) -> None:
        # Drawn in a fixed order from one generator, so the weights depend only on the config.
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                # Unit-scale activations everywhere, so attention and every layer move the output
                # (small GPT-2-style init makes a random model copy its input token).
                std = 1.0 if name.startswith(("tok", "pos")) else p.shape[1] ** -0.5
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))

    @torch.inference_mode()
    def prefill_packed(self, prompts: list[list[int]], on_layer: LayerKvCallback) -> torch.Tensor:
        """Runs the prompts in one pass; returns the last position's logits, [batch, vocab]."""
        lengths = [len(p) for p in prompts]
        tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        x = self.tok(tokens) + self.pos(positions)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv_heads(x)
            on_layer(layer, k, v)
            x = block.finish(x, _packed_causal_attention(q, k, v, lengths))
        last = torch.tensor(lengths).cumsum(0) - 1
        return self.logits(x[last])

    @torch.inference_mode()
    def decode_paged(self, tokens: list[int], positions: list[int], cache: "PagedKv") -> torch.Tensor:
        """One step for many sequences; `cache` knows where each one's KV lives. [batch, vocab]."""
        pos = torch.tensor(positions, dtype=torch.long)
        x = self.tok(torch.tensor(tokens, dtype=torch.long)) + self.pos(pos)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv_heads(x)
            cache.write_new(layer, k, v)
            keys, values, mask = cache.gather(layer)  # [batch, ctx, heads, dim], [batch, ctx]
            x = block.finish(x, _masked_attention(q, keys, values, mask))
        return self.logits(x)

    @torch.inference_mode()
    def forward_contiguous(self, tokens: list[int], cache: list[tuple[torch.Tensor, torch.Tensor]]
                           ) -> torch.Tensor:
        """Appends `tokens` to one sequence whose per-layer K/V are in `cache` (grown in place).

        Returns the logits of every new position, [tokens, vocab].
        """
        start = cache[0][0].shape[0] if cache else 0
        x = self.tok(torch.tensor(tokens)) + self.pos(torch.arange(start, start + len(tokens)))
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv_heads(x)
            if len(cache) <= layer:
                cache.append((k[:0], v[:0]))
            keys, values = (torch.cat([cache[layer][0], k]), torch.cat([cache[layer][1], v]))
            cache[layer] = (keys, values)
            x = block.finish(x, _causal_attention(q, keys, values, start))
        return self.logits(x)


class PagedKv:
    """What decode_paged needs from a paged cache (implemented in pdserve.core.paged_cache)."""

    def write_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [tq, heads, dim] at positions offset.., k/v [tk, heads, dim] from 0; -> [tq, heads, dim]."""
    tq, tk = q.shape[0], k.shape[0]
    if offset == 0 and tq == tk:  # a whole prompt: the fused causal kernel, no T x T mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)
    allowed = torch.arange(tk)[None, :] <= torch.arange(offset, offset + tq)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed)
    return out.transpose(0, 1)


def _packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             lengths: list[int]) -> torch.Tensor:
    """Causal attention within each prompt of a packed batch."""
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        out.append(_causal_attention(q[s], k[s], v[s], 0))
        start += n
    return torch.cat(out)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """q [batch, heads, dim]; k/v [batch, ctx, heads, dim]; mask [batch, ctx] -> [batch, heads, dim]."""
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :])
    return out[:, :, 0, :]


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
