"""`pdserve handoff-table`: its figures against arithmetic done by hand, and its CLI surfaces.

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

REPO = Path(__file__).resolve().parents[1]


def shape(name: str) -> ht.KvShape:
    return next(s for s in ht.SHAPES if s.name == name)


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


def test_tinygpt_mirrors_model_config():
    """The hard-coded TinyGPT shape must follow pdserve's ModelConfig defaults if they change."""
    from pdserve.core.config import ModelConfig
    cfg = ModelConfig()
    s = shape("TinyGPT")
    assert (s.layers, s.kv_heads, s.head_dim) == (cfg.n_layers, cfg.kv_heads, cfg.head_dim)
    assert s.bytes_per_element == cfg.bytes_per_element
    assert ht.kv_bytes_per_token(s) == cfg.kv_bytes_per_token


# --- rows, units, renderers -----------------------------------------------------------------


def test_default_rows_cover_every_model_token_and_link():
    rows = ht.build_rows()
    assert len(rows) == len(ht.SHAPES) * 4
    assert {r.tokens for r in rows} == {1024, 8192, 32768, 131072}
    assert all(set(r.seconds) == {lk.name for lk in ht.LINKS} for r in rows)
    assert all(s.source for s in ht.SHAPES) and all(lk.source for lk in ht.LINKS)


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
    assert [s.name for s in ht.select_shapes(["llama"])] == ["Llama-3.1-8B", "Llama-3.1-70B"]
    assert ht.select_shapes(["nope"]) == []


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
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    data = json.loads(proc.stdout)
    row = next(r for r in data["rows"] if r["model"] == "Llama-3.1-8B" and r["tokens"] == 32768)
    assert row["bytes_per_token"] == 131072
    assert row["kv_bytes"] == 4294967296
    assert row["seconds"]["100GbE"] == pytest.approx(4294967296 / 12.5e9)
    assert {m["name"] for m in data["models"]} >= {"TinyGPT", "DeepSeek-V3", "Mistral-7B"}
    assert all(lk["source"] for lk in data["links"])


def test_docs_table_is_current():
    """docs/handoff-table.md carries the generated table; regenerate it when figures change."""
    doc = REPO / "docs" / "handoff-table.md"
    table = ht.render_markdown(ht.build_rows()).split("\n\n", 1)[0]
    hint = "regenerate with: python -m pdserve.tools.handoff_table --markdown"
    assert table in doc.read_text(encoding="utf-8"), hint
