"""A Hugging Face-style checkpoint directory: its config, tokenizer, generation config and weights.

Reads config.json in both styles (older: top-level `rope_theta`, `rope_scaling`, `torch_dtype`;
newer: `rope_parameters`, `dtype`), tokenizer.json, generation_config.json (every EOS id),
the chat template (chat_template.jinja or tokenizer_config.json), and model.safetensors or its
shards with model.safetensors.index.json. Nothing is fetched: a missing or inconsistent file is a
CheckpointError that names the file and the field. Only `weights` imports torch.
"""

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.core.config import DTYPE_SIZES, ModelConfig
from pdserve.models.tokenizer import HfTokenizer

if TYPE_CHECKING:  # only for annotations: the router reads checkpoints without torch
    import torch

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
# Tensors some checkpoints carry that are derived from the config rather than loaded.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint file is missing or says something pdserve cannot serve."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON: {exc}") from None


def model_config(directory: Path, dtype: str = "") -> ModelConfig:
    path = directory / "config.json"
    raw = read_json(path)
    fields = _Fields(path, raw)
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architectures is {raw.get('architectures')!r}; pdserve "
            f"serves {', '.join(ARCHITECTURES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {raw['hidden_act']!r}; only silu is supported")
    heads = fields.int("num_attention_heads")
    rope_theta, rope_scaling = _rope(fields, raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=fields.int("vocab_size"),
        d_model=fields.int("hidden_size"),
        n_layers=fields.int("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=fields.int("num_key_value_heads", heads),
        head_size=fields.int("head_dim", 0),
        d_ff=fields.int("intermediate_size"),
        max_context=_context(fields, raw),
        dtype=dtype or _dtype(path, raw),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        output_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )


class _Fields:
    """Typed reads of config.json whose errors name the file and the field."""

    def __init__(self, path: Path, raw: dict) -> None:
        self.path, self.raw = path, raw

    def int(self, name: str, default: int | None = None) -> int:
        """The field's integer value; `default` when absent or null, an error when required."""
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise CheckpointError(f"{self.path}: field {name!r} is missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"{self.path}: field {name!r} is {value!r}, not an integer")
        return value


def _rope(fields: _Fields, raw: dict) -> tuple[float, tuple]:
    from pdserve.models.rope_types import SUPPORTED_TYPES

    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{fields.path}: rope type {kind!r} is not supported ({', '.join(SUPPORTED_TYPES)} are)"
        )
    params["rope_type"] = kind
    params.pop("type", None)
    if kind == "default":
        params = {}
    return float(theta), tuple(sorted(params.items()))


def _context(fields: _Fields, raw: dict) -> int:
    context = fields.int("max_position_embeddings")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", True)  # Qwen2 says so; Mistral has only the size
    if window and uses_window and window < context:
        log.warning(
            "%s: sliding_window %d is smaller than max_position_embeddings %d; pdserve "
            "attends over the whole context, so sequences are capped at %d tokens",
            fields.path,
            window,
            context,
            window,
        )
        return int(window)
    return context


def _dtype(path: Path, raw: dict) -> str:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{path}: dtype {dtype!r}; expected one of {', '.join(DTYPE_SIZES)}")
    return dtype


def eos_token_ids(directory: Path) -> frozenset[int]:
    """Every EOS id that config.json and generation_config.json name."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if path.exists():
            value = read_json(path).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if not ids:
        log.warning(
            "%s names no eos_token_id: replies end only at max_tokens or a stop string", directory
        )
    return frozenset(int(i) for i in ids)


def chat_template(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config = directory / "tokenizer_config.json"
    template = read_json(config).get("chat_template") if config.exists() else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def special_tokens(directory: Path) -> dict[str, str]:
    """bos_token and eos_token as text, for chat templates that write them."""
    config = directory / "tokenizer_config.json"
    raw = read_json(config) if config.exists() else {}
    out = {}
    for name in ("bos_token", "eos_token"):
        value = raw.get(name)
        out[name] = value.get("content", "") if isinstance(value, dict) else (value or "")
    return out


def tokenizer(directory: Path, config: ModelConfig) -> HfTokenizer:
    path = directory / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(
            f"{path}: file not found (pdserve needs the tokenizer.json of the `tokenizers` library)"
        )
    tok = HfTokenizer(
        path, eos_token_ids(directory), chat_template(directory), special_tokens(directory)
    )
    if tok.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: {tok.vocab_size} tokens, but config.json's vocab_size is {config.vocab_size}"
        )
    return tok


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files, in a fixed order (also what the fingerprint hashes)."""
    index = directory / SHARD_INDEX
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: field 'weight_map' is missing or empty")
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = [directory / SINGLE_FILE]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{missing[0]}: file not found")
    return files


def load_weights(directory: Path, expected: dict) -> dict:
    """Every tensor the model expects, checked by name and shape; `expected` maps name -> shape."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}  # the file of every tensor seen, loaded or not
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name.endswith(DERIVED_SUFFIXES) or name not in expected:
                        where.setdefault(name, path)
                        continue
                    tensors[name], where[name] = f.get_tensor(name), path
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
    _check_tensors(directory, tensors, expected, where)
    return tensors


def _check_tensors(directory: Path, tensors: dict, expected: dict, where: dict) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(
            f"{directory}: tensor {missing[0]!r} is missing from the "
            f"safetensors files ({len(missing)} missing); config.json "
            f"implies it"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} has shape "
                f"{list(tensors[name].shape)}, config.json implies "
                f"{list(shape)}"
            )
    unused = sorted(
        n
        for n in where
        if n not in expected and not n.endswith(DERIVED_SUFFIXES) and n != "lm_head.weight"
    )
    if unused:
        raise CheckpointError(
            f"{where[unused[0]]}: tensor {unused[0]!r} is not part of the "
            f"model config.json describes ({len(unused)} such tensors)"
        )
