"""Tiny random checkpoints in the Hugging Face layout, built with transformers (test-only).

Each is a directory like a downloaded model: config.json, model.safetensors (or shards),
tokenizer.json (a byte-level BPE trained here by `tokenizers`), tokenizer_config.json with a chat
template, and generation_config.json with two EOS ids.
"""

import json
from pathlib import Path

import torch

VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = (
    "The quick brown fox jumps over the lazy dog. Disaggregated serving moves the KV cache "
    "from prefill to decode. Grüße, café, naïve, 日本語, emoji 🙂 and digits 0123456789. "
)

# name -> (transformers config class name, config kwargs)
SHAPES = {
    "llama-gqa-untied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": (
        "MistralConfig",
        dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None),
    ),
}
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=2,
)


def train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 50, trainer)
    tok.save(str(path))


def build(name: str, root: Path, old_style: bool = False, shards: int = 1) -> Path:
    """Saves checkpoint `name` under root; returns its directory."""
    import transformers

    cls_name, extra = SHAPES[name]
    torch.manual_seed(sum(map(ord, name)))
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if name == "qwen2-bias":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.5)
    directory = root / (
        name + ("-old" if old_style else "") + (f"-{shards}shards" if shards > 1 else "")
    )
    max_shard = f"{sum(p.numel() for p in model.parameters()) * 4 // shards // 1000 + 1}KB"
    model.save_pretrained(directory, max_shard_size=max_shard if shards > 1 else "5GB")
    train_tokenizer(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": "<|endoftext|>",
            }
        )
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    if old_style:
        _to_old_style(directory / "config.json")
    return directory


def _to_old_style(path: Path) -> None:
    """Rewrites config.json as transformers 4.x wrote it: top-level rope_theta and torch_dtype."""
    raw = json.loads(path.read_text())
    params = raw.pop("rope_parameters", None) or {}
    raw["rope_theta"] = params.pop("rope_theta", 10000.0)
    if params.get("rope_type", "default") != "default":
        raw["rope_scaling"] = params
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    path.write_text(json.dumps(raw, indent=2))


def reference(directory: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
