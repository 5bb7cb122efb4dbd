"""The Llama family: Llama 2/3 (incl. Llama 3.1 RoPE scaling), Mistral and Qwen2.

RMSNorm, RoPE at each token's position, grouped-query attention, SwiGLU MLP, tied or untied output
head, optional biases (Qwen2 has them on q, k and v). Parameter names are the Hugging Face
checkpoints' own, so a safetensors state dict loads as it is.
"""

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.models.decoder import DecoderOnly
from pdserve.models.quantized import (
    Int8Linear,
    Q4Linear,
    Q8Linear,
    Q4Source,
    WidePass,
    make_linear,
    output_head,
    stacked,
)
from pdserve.models.onednn import reordered_bf16_here
from pdserve.models.rope import Rotary, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        """`fused`: one call of the native step op (pdserve/kernels/step_ops.py) per norm."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.fused = eps, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.pdserve.rms_norm(x, self.weight, self.eps)
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
        self.o_proj: nn.Module = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=c.output_bias)
        self.sizes = [c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim]
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matrix, once fused

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.qkv_proj is None:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return self.qkv_proj(h).split(self.sizes, -1)

    def fuse(self, fmt: str, q4: Q4Source, prefix: str) -> None:
        """One matrix for q, k and v (one read of the input, one kernel call), in `fmt`."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_proj = _stacked_linear(fmt, parts, q4, [prefix + n for n in ("q", "k", "v")])
        self.o_proj = _stacked_linear(fmt, [self.o_proj], q4, [prefix + "o"])
        del self.q_proj, self.k_proj, self.v_proj


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.d_ff, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.d_model, c.d_ff, bias=c.mlp_bias)
        self.down_proj: nn.Module = nn.Linear(c.d_ff, c.d_model, bias=c.mlp_bias)
        self.d_ff = c.d_ff
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matrix, once fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).split(self.d_ff, -1)
        return self.down_proj(F.silu(gate) * up)

    def fuse(self, fmt: str, q4: Q4Source, prefix: str) -> None:
        parts = [self.gate_proj, self.up_proj]
        self.gate_up_proj = _stacked_linear(fmt, parts, q4, [prefix + "gate", prefix + "up"])
        self.down_proj = _stacked_linear(fmt, [self.down_proj], q4, [prefix + "down"])
        del self.gate_proj, self.up_proj


def _stacked_linear(
    fmt: str, parts: Sequence[nn.Module], q4: Q4Source, names: list[str]
) -> nn.Module:
    """The linear layers `parts` (named by `names` in `q4`) as one, their rows stacked."""
    linears = cast(list[nn.Linear], list(parts))
    weight = torch.cat([p.weight for p in linears])
    bias = stacked([p.bias for p in linears])
    blocks = [q4.blocks.get(f"{n}_proj.weight") for n in names]
    own = None
    if all(b is not None for b in blocks):
        own = tuple(torch.cat([b[i] for b in blocks if b is not None]) for i in range(3))
    return make_linear(fmt, weight, bias, own, q4.kernel)  # type: ignore[arg-type]


class Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        fused = c.step_ops == "native"
        self.input_layernorm = RMSNorm(c.d_model, c.norm_eps, fused)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.norm_eps, fused)
        self.mlp = MLP(c)

    def qkv(self, x: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, ...]:
        """x [tokens, d_model] -> q [tokens, heads, dim], k and v [tokens, kv_heads, dim]."""
        a = self.self_attn
        q, k, v = a.project(self.input_layernorm(x))
        q = q.view(x.shape[0], a.heads, a.head_dim)
        k = k.view(x.shape[0], a.kv_heads, a.head_dim)
        v = v.view(x.shape[0], a.kv_heads, a.head_dim)
        q, k = rotary.apply_pair(q, k)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(attn.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def runs_whole(self) -> bool:
        """Its matrices are native Q4_1 without biases and its norms native: decode_layers.cpp
        then runs exactly what qkv() and finish() run."""
        native = all(
            isinstance(m, Q4Linear) and m.kernel == "native" and m.bias is None
            for m in self._matrices()
        )
        return native and self.input_layernorm.fused and self.post_attention_layernorm.fused

    def runs_wide(self) -> bool:
        """Its matrices are quantized without biases and multiply a bfloat16 wide pass by
        oneDNN on a reordered copy, and its norms are native: decode_wide.cpp then runs exactly
        what qkv() and finish() run on that many rows."""
        matrices = self._matrices()
        wide = all(isinstance(m, WidePass) and m.bias is None and m.bf16_gemm for m in matrices)
        fused = self.input_layernorm.fused and self.post_attention_layernorm.fused
        return wide and fused and reordered_bf16_here()

    def _matrices(self) -> list[nn.Module]:
        a, mlp = self.self_attn, self.mlp
        return [cast(nn.Module, m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]


def layer_operands(layers: list[Layer]) -> tuple[list[torch.Tensor], ...]:
    """What decode_layers takes of the layers' weights, listed once: the norms' weights and,
    where every layer runs_whole, each matrix's Q4_1 blocks interleaved by 8 rows (else no
    matrices)."""
    norms: list[torch.Tensor] = [layer.input_layernorm.weight for layer in layers]
    post_norms: list[torch.Tensor] = [layer.post_attention_layernorm.weight for layer in layers]
    if not all(layer.runs_whole() for layer in layers):
        return norms, post_norms, [], [], [], []
    attention = [layer.self_attn for layer in layers]
    mlp = [layer.mlp for layer in layers]
    return (
        norms,
        post_norms,
        [cast(Q4Linear, a.qkv_proj).interleaved for a in attention],
        [cast(Q4Linear, a.o_proj).interleaved for a in attention],
        [cast(Q4Linear, m.gate_up_proj).interleaved for m in mlp],
        [cast(Q4Linear, m.down_proj).interleaved for m in mlp],
    )


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model, c.norm_eps, c.step_ops == "native")


class LlamaForCausalLM(DecoderOnly):
    """Also Mistral and Qwen2: their differences are in the config (biases, context), not code."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: it is derived from the config, never loaded.
        self._inv_freq = inverse_frequencies(
            config.head_dim, config.rope_theta, dict(config.rope_scaling)
        )
        self._whole_layers = False  # set by use_weights where every layer runs_whole
        self._wide_layers = False  # set by use_weights where every layer runs_wide
        self._layer_operands: tuple[list[torch.Tensor], ...] = ()  # set by use_weights too
        self._wide_matrices: tuple[list[torch.Tensor], ...] = ()  # made by the first wide step

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        dtype = self.model.embed_tokens.weight.dtype
        return Rotary(self._inv_freq, positions, dtype, self.config.step_ops == "native")

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)

    def head_is_row_invariant(self) -> bool:
        """The int8 and Q8_0 kernels are, from one row (quantized.PaddedRows says how it was
        measured; blocks_avx2.cpp sums in one fixed order)."""
        return isinstance(self.lm_head, (Int8Linear, Q8Linear))

    def whole_layers(self, rows: int) -> bool:
        return self._one_call(rows) is not None

    def _one_call(self, rows: int) -> str | None:
        """Which native call runs every layer of a decode step of `rows` rows: "q4" where every
        layer runs_whole and a q4 matrix would run its 4-bit kernel (decode_layer.cpp), "wide"
        where every layer runs_wide and a matrix would multiply a bf16 wide pass
        (decode_wide.cpp); None where neither (the ops one by one)."""
        if not (self._whole_layers or self._wide_layers):
            return None
        first = cast(WidePass, cast(Layer, self.layers[0]).self_attn.qkv_proj)
        wide = first.wide_dtype(rows, self.model.embed_tokens.weight.dtype)
        if self._whole_layers and wide is None:
            return "q4"
        if self._wide_layers and wide == torch.bfloat16:
            return "wide"
        return None

    def use_weights(self, fmt: str, q4: Q4Source) -> None:
        """Fuses each layer's projections and holds every linear layer in `fmt` (quantized.py);
        `q4` holds a GGUF's own 4-bit blocks, where there are any, and the q4 kernel. The
        output head, the largest matrix, is 8-bit in both quantized formats (output_head), as
        llama.cpp keeps its own."""
        for index, layer in enumerate(cast(list[Layer], list(self.layers))):
            prefix = f"model.layers.{index}."
            layer.self_attn.fuse(fmt, q4, prefix + "self_attn.")
            layer.mlp.fuse(fmt, q4, prefix + "mlp.")
        if fmt != "dense":
            head: torch.Tensor = self.model.embed_tokens.weight
            if self.lm_head is not None:
                head = cast(nn.Linear, self.lm_head).weight
            self.lm_head = output_head(fmt, head, q4.kernel)
        layers = cast(list[Layer], list(self.layers))
        self._whole_layers = all(layer.runs_whole() for layer in layers)
        bf16 = self.model.embed_tokens.weight.dtype == torch.bfloat16
        self._wide_layers = bf16 and all(layer.runs_wide() for layer in layers)
        self._wide_matrices = ()
        self._layer_operands = layer_operands(cast(list[Layer], list(self.layers)))

    def decode_layers(self, x: torch.Tensor, rotary: Rotary, cache_operands: tuple) -> torch.Tensor:
        """qkv() then finish() of every layer of a decode step in one native call
        (decode_layer.cpp, or decode_wide.cpp where _one_call says "wide"), the same ops in the
        same order. `cache_operands`: the paged cache's
        (PagedCache.step_operands)."""
        norms, post_norms, qkv, o, gate_up, down = self._layer_operands
        call = torch.ops.pdserve.decode_layers
        if self._one_call(x.shape[0]) == "wide":
            qkv, o, gate_up, down = self.wide_matrices()
            call = torch.ops.pdserve.decode_layers_wide
        attention = cast(Layer, self.layers[0]).self_attn
        return call(
            x,
            norms,
            post_norms,
            self.config.norm_eps,
            qkv,
            o,
            gate_up,
            down,
            attention.heads,
            attention.kv_heads,
            attention.head_dim,
            rotary.cos,
            rotary.sin_signed,
            *cache_operands,
        )

    def wide_matrices(self) -> tuple[list[torch.Tensor], ...]:
        """Each layer's four matrices as decode_wide.cpp takes them: the bf16 copies reordered
        for oneDNN that the layers' wide passes multiply by (made once, shared with them)."""
        if not self._wide_matrices:
            layers = cast(list[Layer], list(self.layers))
            self._wide_matrices = tuple(
                [cast(WidePass, layer._matrices()[i]).reordered_bf16().weight for layer in layers]
                for i in range(4)
            )
        return self._wide_matrices
