"""Architecture name (config.json's `architectures[0]`) -> the class that runs it, and the one
place a model is built with its weights."""

import logging
import time
from pathlib import Path

import torch
from torch import nn

from pdserve.core.config import ModelConfig
from pdserve.kernels import step_ops
from pdserve.models import checkpoint
from pdserve.models.decoder import DecoderOnly, parameter_count
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.quantized import PaddedRows, WidePass, Q4Source
from pdserve.models.tinygpt import TinyGPT

log = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[DecoderOnly]] = {
    "TinyGPT": TinyGPT,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build(config: ModelConfig, source: Path | None, gguf: Path | None = None) -> DecoderOnly:
    """The model in eval mode, in config.dtype and config.weights; weights from `source` (TinyGPT
    draws its own), 4-bit blocks from `gguf` where it has them."""
    cls = ARCHITECTURES[config.architecture]
    if config.step_ops == "native":
        step_ops.load()
    if source is None:
        if config.weights != "dense":
            raise ValueError(f"--weights {config.weights} needs a Llama-family checkpoint")
        return with_numerics(cls(config), config.numerics).eval()
    started = time.perf_counter()
    with torch.device("meta"):  # no memory and no random init for weights about to be replaced
        model = cls(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    tensors = checkpoint.load_weights(source, expected)
    dtype = getattr(torch, config.dtype)
    model.load_state_dict({n: t.to(dtype) for n, t in tensors.items()}, strict=True, assign=True)
    count = parameter_count(model)
    if isinstance(model, LlamaForCausalLM):
        q4 = (
            Q4Source(_q4_blocks(source, gguf), config.q4_kernel)
            if config.weights == "q4"
            else Q4Source()
        )
        model.use_weights(config.weights, q4)
    with_numerics(model, config.numerics)
    log.info(
        "loaded %s from %s: %.1fM parameters in %s, linear layers %s%s, %s numerics, %s step "
        "ops, %.1f s",
        config.architecture,
        source,
        count / 1e6,
        config.dtype,
        config.weights,
        f" on the {config.q4_kernel} kernel" if config.q4_kernel else "",
        config.numerics,
        config.step_ops,
        time.perf_counter() - started,
    )
    return model.eval()


def with_numerics(model: DecoderOnly, numerics: str) -> DecoderOnly:
    """Invariant numerics: every quantized pass on its layer's kernel, every dense layer given at least 4
    rows (quantized.py says why); fast numerics change nothing. Attention reads the
    setting from the config (attention.kernels)."""
    if numerics != "invariant":
        return model
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, WidePass):
                child.widens = False
            elif isinstance(child, nn.Linear):
                setattr(parent, name, PaddedRows(child))
    return model


def _q4_blocks(converted: Path, gguf: Path | None) -> dict:
    """The GGUF's own Q4_1 blocks as tensors, kept beside its conversion; none where the
    checkpoint did not come from one (its 4-bit blocks are then computed from the dense
    weights)."""
    if gguf is None:
        return {}
    from pdserve.models.gguf_import import q4_1_tensors

    return {
        name: tuple(torch.from_numpy(part) for part in parts)
        for name, parts in q4_1_tensors(converted).items()
    }
