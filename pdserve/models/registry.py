"""Architecture name (config.json's `architectures[0]`) -> the class that runs it, and the one
place a model is built with its weights."""

import logging
import time
from pathlib import Path

import torch

from pdserve.core.config import ModelConfig
from pdserve.models import checkpoint
from pdserve.models.decoder import DecoderOnly, parameter_count
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.tinygpt import TinyGPT

log = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[DecoderOnly]] = {
    "TinyGPT": TinyGPT,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build(config: ModelConfig, source: Path | None) -> DecoderOnly:
    """The model in eval mode, in config.dtype; weights from `source` (TinyGPT draws its own)."""
    cls = ARCHITECTURES[config.architecture]
    if source is None:
        return cls(config).eval()
    started = time.perf_counter()
    with torch.device("meta"):  # no memory and no random init for weights about to be replaced
        model = cls(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    tensors = checkpoint.load_weights(source, expected)
    dtype = getattr(torch, config.dtype)
    model.load_state_dict({n: t.to(dtype) for n, t in tensors.items()}, strict=True, assign=True)
    log.info(
        "loaded %s from %s: %.1fM parameters in %s, %.1f s",
        config.architecture,
        source,
        parameter_count(model) / 1e6,
        config.dtype,
        time.perf_counter() - started,
    )
    return model.eval()
