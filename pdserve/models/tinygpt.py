"""TinyGPT: a small decoder-only transformer with random weights from a fixed seed, for tests.

Every service builds it from the same ModelConfig and gets bit-identical weights. Learned
position embeddings, LayerNorm, GELU MLP, no RoPE and no grouped-query attention.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.models.decoder import DecoderOnly


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv_proj = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.up = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.down = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.n_heads, self.head_dim = c.n_heads, c.head_dim

    def qkv(self, x: torch.Tensor, rotary=None) -> tuple[torch.Tensor, ...]:
        """x [tokens, d_model] -> q, k, v, each [tokens, heads, head_dim]."""
        q, k, v = self.qkv_proj(self.ln1(x)).split(self.n_heads * self.head_dim, dim=-1)
        shape = (x.shape[0], self.n_heads, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and MLP after attention; attn [tokens, heads, head_dim]."""
        x = x + self.proj(attn.reshape(x.shape[0], -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(DecoderOnly):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights(config.seed)
        self.to(getattr(torch, config.dtype))

    @property
    def layers(self) -> nn.ModuleList:
        return self.blocks

    def _init_weights(self, seed: int) -> None:
        # Drawn in float32 in a fixed order from one generator, so the weights depend only on the
        # config (and a lower dtype is a rounding of the same weights).
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

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))
