"""The Llama family: Llama 2/3 (incl. Llama 3.1 RoPE scaling), Mistral and Qwen2.

RMSNorm, RoPE at each token's position, grouped-query attention, SwiGLU MLP, tied or untied output
head, optional biases (Qwen2 has them on q, k and v). Parameter names are the Hugging Face
checkpoints' own, so a safetensors state dict loads as it is.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.models.decoder import DecoderOnly
from pdserve.models.rope import Rotary, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean square in float32 even for bf16 weights: a bf16 sum over 4096 squares is coarse.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.n_heads, c.kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=c.output_bias)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.d_ff, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.d_model, c.d_ff, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.d_ff, c.d_model, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = MLP(c)

    def qkv(self, x: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, ...]:
        """x [tokens, d_model] -> q [tokens, heads, dim], k and v [tokens, kv_heads, dim]."""
        a, h = self.self_attn, self.input_layernorm(x)
        q = a.q_proj(h).view(x.shape[0], a.heads, a.head_dim)
        k = a.k_proj(h).view(x.shape[0], a.kv_heads, a.head_dim)
        v = a.v_proj(h).view(x.shape[0], a.kv_heads, a.head_dim)
        return rotary.apply(q), rotary.apply(k), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model, c.norm_eps)


class LlamaForCausalLM(DecoderOnly):
    """Also Mistral and Qwen2: their differences are in the config (biases, context), not code."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: it is derived from the config, never loaded.
        self._inv_freq = inverse_frequencies(
            config.head_dim, config.rope_theta, dict(config.rope_scaling)
        )

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return Rotary(self._inv_freq, positions, self.model.embed_tokens.weight.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)
