"""pdserve's model code against transformers on the same checkpoint, on this CPU.

Both run SmolLM2-135M-Instruct from the same converted checkpoint (`served.source`: config.json +
model.safetensors), in the same dtype, in one process with the same torch thread count, and the
configurations are interleaved repeat by repeat so that a change in machine load hits both sides
of a comparison rather than one. Measured:

  prefill   one prompt of --prefill-len tokens: pdserve's `prefill_packed` against a transformers
            forward with `logits_to_keep=1` and `use_cache=True`, which is the work `generate`
            does for a prompt (last position's logits, KV kept), so neither side pays for
            logits the other skips.
  decode    --batches prompts of --prompt-len tokens, --new-tokens greedy tokens each: pdserve's
            real DecodeScheduler over a PagedCache (prompt KV written into the cache by one packed
            prefill, as a handoff lands it) against transformers' `generate` (greedy, left
            padding, min_new_tokens = max_new_tokens so EOS cannot cut it short). The headline
            figure is the decode phase alone: tokens after the first / time from the first token
            to the last. The end-to-end figure (prefill included) is recorded too.

Each configuration gets --warmup untimed runs, then --repeats timed ones; the report gives the
median and the min-max spread, and calls a difference only when the two spreads do not overlap.

  .venv/bin/python bench/models.py                      # bf16 then fp32, ~10 minutes
  .venv/bin/python bench/models.py --dtypes bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve.core.block_pool import BlockPool
from pdserve.engine.decode_scheduler import DecodeScheduler
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.paged_cache import PagedCache
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.engine.sampling import first_draw
from pdserve.models.decoder import parameter_count
from pdserve.models.loading import ServedModel, load_served_model

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16  # the decode service's default block size
# Random prompt ids start above SmolLM2's special tokens (0-16) and the byte-like low ids, so no
# prompt contains an end-of-sequence or chat-control token.
FIRST_PROMPT_ID = 256
# "Several times faster" at batch 16 is read as at least this ratio of medians.
SEVERAL = 3.0
IMPLS = ("pdserve", "transformers")


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    prefill_len: int = 512
    prompt_len: int = 128
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 16)
    seed: int = 0

    def cases(self) -> list[str]:
        """The measured shapes, in the order one repeat runs them."""
        return ["prefill"] + [f"decode-b{b}" for b in self.batches]


def random_prompts(seed: int, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """Seeded random token ids: the content does not change the arithmetic, only the length."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PROMPT_ID, vocab_size, (count, length), generator=g).tolist()


# --------------------------------------------------------------------------------------------
# One timed run of each side
# --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One timed run: tokens processed, seconds, and what the run produced (for the cross-check)."""

    tokens: int
    seconds: float
    total_seconds: float | None = None  # decode: prefill included
    total_tokens: int | None = None
    outputs: list[list[int]] = field(default_factory=list)
    load_1m: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def pdserve_prefill(served: ServedModel, prompt: list[int]) -> Sample:
    """The prefill service's model call; the per-layer KV callback does nothing here."""
    started = time.perf_counter()
    logits = served.model.prefill_packed([prompt], lambda layer, k, v: None)
    seconds = time.perf_counter() - started
    return Sample(len(prompt), seconds, outputs=[[int(logits[0].argmax())]])


def transformers_prefill(hf, prompt: list[int]) -> Sample:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        started = time.perf_counter()
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - started
    return Sample(len(prompt), seconds, outputs=[[int(out.logits[0, -1].argmax())]])


def pdserve_generate(served: ServedModel, prompts: list[list[int]], new_tokens: int) -> Sample:
    """Prefill every prompt in one packed pass straight into a paged cache, then run the decode
    service's own scheduler until every sequence has `new_tokens` tokens."""
    cache, tables = _paged_cache_for(served, prompts, new_tokens)
    slots = [s for table, p in zip(tables, prompts) for s in table.slots(0, len(p))]
    specs = [
        GenerateSpec(f"bench-{i}", tuple(p), SamplingSpec(max_tokens=new_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    runner = ModelRunner(served.built, cache, served.tokenizer.eos_token_ids)
    scheduler = DecodeScheduler(runner, served.tokenizer, max_batch=len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]

    started = time.perf_counter()
    logits = served.model.prefill_packed(
        prompts, lambda layer, k, v: cache.write(layer, slots, k, v)
    )
    first = runner.sample(logits, [first_draw(s) for s in specs])
    first_at = time.perf_counter()
    for i, (spec, table) in enumerate(zip(specs, tables)):
        scheduler.start(spec, table, _collector(outputs[i]), first[i])
    while scheduler.has_work:
        scheduler.step()
    ended = time.perf_counter()
    return _generate_sample(prompts, new_tokens, started, first_at, ended, outputs)


def _paged_cache_for(served: ServedModel, prompts: list[list[int]], new_tokens: int):
    """A pool just big enough for the batch, with each prompt's blocks already taken."""
    per_sequence = -(-(len(prompts[0]) + new_tokens) // BLOCK_SIZE)
    pool = BlockPool(per_sequence * len(prompts), BLOCK_SIZE)
    cache = PagedCache(served.config, pool.num_blocks, BLOCK_SIZE)
    tables = []
    for p in prompts:
        table = pool.reserve(len(p) + new_tokens)
        table.ensure(len(p))
        tables.append(table)
    return cache, tables


def _collector(into: list[int]):
    """A sequence's sink: keeps the token ids it emits (first token included)."""
    return lambda emission: into.extend(emission.token_ids)


class _StepClock:
    """A transformers streamer that only notes when each put() arrives: the first put is the
    prompt (before prefill), the second the first new token, the last the final token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_generate(hf, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Sample:
    ids, mask = left_pad(prompts, pad_id)
    clock = _StepClock()
    with torch.inference_mode():
        started = time.perf_counter()
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
            streamer=clock,
        )
        ended = time.perf_counter()
    outputs = out[:, ids.shape[1] :].tolist()
    return _generate_sample(prompts, new_tokens, started, clock.times[1], ended, outputs)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch padded on the left, as a decoder-only `generate` needs it, with its mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate_sample(prompts, new_tokens, started, first_at, ended, outputs) -> Sample:
    """Decode tokens/s counts the tokens after the first (the first comes from prefill)."""
    batch = len(prompts)
    return Sample(
        tokens=batch * (new_tokens - 1),
        seconds=ended - first_at,
        total_seconds=ended - started,
        total_tokens=batch * new_tokens,
        outputs=outputs,
    )


# --------------------------------------------------------------------------------------------
# The run: both sides loaded once per dtype, every case interleaved within each repeat
# --------------------------------------------------------------------------------------------


@dataclass
class Contenders:
    dtype: str
    served: ServedModel
    hf: object
    pad_id: int


def load(dtype: str) -> Contenders:
    from transformers import AutoModelForCausalLM

    served = load_served_model(MODEL, dtype=dtype, weights=True)
    hf = AutoModelForCausalLM.from_pretrained(served.source, dtype=getattr(torch, dtype)).eval()
    eos = hf.generation_config.eos_token_id
    pad_id = eos[0] if isinstance(eos, list) else eos  # SmolLM2 has no pad token
    return Contenders(dtype, served, hf, pad_id)


def run_case(c: Contenders, case: str, impl: str, w: Workload) -> Sample:
    gc.collect()  # garbage from the previous run is not collected inside this one
    if case == "prefill":
        prompt = random_prompts(w.seed, 1, w.prefill_len, c.served.config.vocab_size)[0]
        return (
            pdserve_prefill(c.served, prompt)
            if impl == "pdserve"
            else transformers_prefill(c.hf, prompt)
        )
    batch = int(case.removeprefix("decode-b"))
    prompts = random_prompts(w.seed + batch, batch, w.prompt_len, c.served.config.vocab_size)
    if impl == "pdserve":
        return pdserve_generate(c.served, prompts, w.new_tokens)
    return transformers_generate(c.hf, prompts, w.new_tokens, c.pad_id)


def measure_dtype(
    c: Contenders, w: Workload, repeats: int, warmup: int, log=print
) -> dict[str, dict[str, list[Sample]]]:
    """Every (case, impl) `warmup` times untimed, then `repeats` rounds. Each round runs every
    case on both sides back to back, and alternates which side goes first, so slow drift in the
    machine's load falls on both."""
    pairs = [(case, impl) for case in w.cases() for impl in IMPLS]
    for case, impl in pairs:
        for _ in range(warmup):
            run_case(c, case, impl, w)
    samples: dict[str, dict[str, list[Sample]]] = {
        case: {i: [] for i in IMPLS} for case in w.cases()
    }
    for r in range(repeats):
        for case in w.cases():
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]
            for impl in order:
                s = run_case(c, case, impl, w)
                s.load_1m = load_1m()
                samples[case][impl].append(s)
                log(
                    f"  {c.dtype} repeat {r + 1}/{repeats} {case:<10} {impl:<12} "
                    f"{s.tokens_per_second:8.1f} tok/s  (load {s.load_1m})"
                )
    return samples


# --------------------------------------------------------------------------------------------
# Statistics and verdicts
# --------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def compare(pd: dict, hf: dict) -> str:
    """'faster' or 'slower' only when the min-max ranges do not overlap; else 'within spread'."""
    if pd["min"] > hf["max"]:
        return "faster"
    if pd["max"] < hf["min"]:
        return "slower"
    return "within spread"


def agreement(pd: list[Sample], hf: list[Sample]) -> dict:
    """How far the two sides' greedy tokens match (first run of each). In bf16 they can part at
    a near-tie, since the two compute in different orders; a mismatch in fp32 would be a bug."""
    a, b = pd[0].outputs, hf[0].outputs
    same = sum(x == y for x, y in zip(a, b))
    first_diff = [
        next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)
    ]
    return {
        "sequences": len(a),
        "identical": same,
        "first_divergence": [d for d in first_diff if d is not None],
    }


def summarize(samples: dict[str, dict[str, list[Sample]]]) -> dict:
    out = {}
    for case, by_impl in samples.items():
        row = {
            impl: {
                "tokens_per_second": spread([s.tokens_per_second for s in ss]),
                "load_1m": [s.load_1m for s in ss],
            }
            for impl, ss in by_impl.items()
        }
        for impl, ss in by_impl.items():
            if ss[0].total_seconds is not None:  # decode: prefill-included rate as well
                row[impl]["end_to_end_tokens_per_second"] = spread(
                    [s.total_tokens / s.total_seconds for s in ss]
                )
        pd, hf = (row[i]["tokens_per_second"] for i in IMPLS)
        row["ratio_of_medians"] = pd["median"] / hf["median"]
        row["verdict"] = compare(pd, hf)
        row["greedy_agreement"] = agreement(by_impl["pdserve"], by_impl["transformers"])
        out[case] = row
    return out


def goals(results: dict, batches: tuple[int, ...]) -> list[dict]:
    """The issue's goals, per dtype: not slower at batch 1, >= SEVERAL x faster at batch 16."""
    out = []
    for dtype, cases in results.items():
        if 1 in batches:
            row = cases["decode-b1"]
            holds = row["verdict"] != "slower"
            out.append(
                {
                    "dtype": dtype,
                    "goal": "decode batch 1: pdserve not slower",
                    "holds": holds,
                    "ratio": row["ratio_of_medians"],
                    "verdict": row["verdict"],
                }
            )
        if 16 in batches:
            row = cases["decode-b16"]
            pd, hf = (row[i]["tokens_per_second"] for i in IMPLS)
            # Beyond the spread: even pdserve's slowest run is SEVERAL x transformers' fastest.
            holds = pd["min"] >= SEVERAL * hf["max"]
            out.append(
                {
                    "dtype": dtype,
                    "goal": f"decode batch 16: pdserve >= {SEVERAL:g}x",
                    "holds": holds,
                    "ratio": row["ratio_of_medians"],
                    "worst_case_ratio": pd["min"] / hf["max"],
                    "verdict": row["verdict"],
                }
            )
    return out


# --------------------------------------------------------------------------------------------
# Conditions and output
# --------------------------------------------------------------------------------------------


def load_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The flags that decide which bf16/fp32 kernels oneDNN can use."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((ln.partition(":")[2].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))


def conditions(args, w: Workload, contenders: list[Contenders]) -> dict:
    c0 = contenders[0]
    return {
        "model": {
            "name": MODEL,
            "identity": c0.served.identity,
            "source": str(c0.served.source),
            "parameters_pdserve": parameter_count(c0.served.model),
            "parameters_transformers": sum(p.numel() for p in c0.hf.parameters()),
            "transformers_attention": c0.hf.config._attn_implementation,
        },
        "cpu": {"model": cpu_model(), "logical_cpus": os.cpu_count(), "flags": cpu_flags()},
        "software": {
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "python": platform.python_version(),
        },
        "threads": torch.get_num_threads(),
        "dtypes": [c.dtype for c in contenders],
        "workload": {
            **asdict(w),
            "block_size": BLOCK_SIZE,
            "prompts": "seeded random token ids, all the same length (so left padding "
            "adds no pad tokens)",
        },
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": w.seed,
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }


def _cell(d: dict) -> str:
    return f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f})"


def markdown(doc: dict) -> str:
    c = doc["conditions"]
    lines = [
        "# pdserve vs transformers on SmolLM2-135M (bench/models.py)",
        "",
        "tokens/s, median (min-max) over the repeats; a difference is called only when "
        "the ranges do not overlap.",
        "",
        "| dtype | case | pdserve | transformers | pdserve / transformers | verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    for dtype, cases in doc["results"].items():
        for case, row in cases.items():
            label = {"prefill": f"prefill {c['workload']['prefill_len']} tokens"}.get(
                case, f"decode, batch {case.removeprefix('decode-b')}"
            )
            lines.append(
                f"| {dtype} | {label} | {_cell(row['pdserve']['tokens_per_second'])} | "
                f"{_cell(row['transformers']['tokens_per_second'])} | "
                f"{row['ratio_of_medians']:.2f}x | {row['verdict']} |"
            )
    lines += [
        "",
        "End to end (prefill of the batch included), tokens/s:",
        "",
        "| dtype | case | pdserve | transformers |",
        "|---|---|---:|---:|",
    ]
    for dtype, cases in doc["results"].items():
        for case, row in cases.items():
            if "end_to_end_tokens_per_second" in row["pdserve"]:
                lines.append(
                    f"| {dtype} | {case} | "
                    f"{_cell(row['pdserve']['end_to_end_tokens_per_second'])} | "
                    f"{_cell(row['transformers']['end_to_end_tokens_per_second'])} |"
                )
    lines += [
        "",
        "Cross-check, greedy tokens of the first timed run (same work on both sides; "
        "bf16 may part at near-ties, fp32 should not):",
        "",
    ]
    for dtype, cases in doc["results"].items():
        parts = [
            f"{case} {row['greedy_agreement']['identical']}/"
            f"{row['greedy_agreement']['sequences']} identical"
            for case, row in cases.items()
        ]
        lines.append(f"- {dtype}: " + ", ".join(parts))
    lines += ["", "Goals:", ""]
    for g in doc["goals"]:
        extra = f", worst case {g['worst_case_ratio']:.2f}x" if "worst_case_ratio" in g else ""
        lines.append(
            f"- {g['dtype']}, {g['goal']}: **{'holds' if g['holds'] else 'does not hold'}**"
            f" (median ratio {g['ratio']:.2f}x{extra}; {g['verdict']})"
        )
    w = c["workload"]
    lines += [
        "",
        "Conditions:",
        "",
        f"- checkpoint {c['model']['identity']} (float32 runs upcast its weights); "
        f"{c['model']['parameters_pdserve']:,} parameters; transformers attention: "
        f"{c['model']['transformers_attention']}",
        f"- {c['cpu']['logical_cpus']}x {c['cpu']['model']} "
        f"({', '.join(c['cpu']['flags']) or 'no AVX flags read'})",
        f"- torch {c['software']['torch']}, transformers {c['software']['transformers']}, "
        f"Python {c['software']['python']}, {c['threads']} torch threads",
        f"- prefill {w['prefill_len']} tokens; decode prompts {w['prompt_len']} tokens, "
        f"{w['new_tokens']} new tokens (decode rate counts the {w['new_tokens'] - 1} after "
        f"the first), batches {', '.join(map(str, w['batches']))}; {w['prompts']}",
        f"- {c['repeats']} repeats after {c['warmup']} warm-up per configuration, "
        f"interleaved; seed {c['seed']}",
        f"- {c['date']}, {c['wall_seconds']:.0f} s; 1-minute load average "
        f"{c['load_1m_before']} before, {c['load_1m_after']} after (the benchmark's own "
        f"{c['threads']} busy threads count toward it; per-run figures in the JSON)",
        f"- `{c['command']}`",
    ]
    for note in c.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per configuration first")
    p.add_argument("--threads", type=int, default=2, help="torch threads (both sides)")
    p.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="comma list, run in order (default %(default)s)",
    )
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,16", help="decode batch sizes (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--budget",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="skip a later dtype when the run so far says it would end past this",
    )
    p.add_argument(
        "--quiet-below",
        type=float,
        default=None,
        metavar="LOAD",
        help="before starting, wait (up to --quiet-wait s) for the 1-minute load "
        "average to drop below LOAD: the machine is shared",
    )
    p.add_argument("--quiet-wait", type=float, default=600.0, metavar="SECONDS")
    p.add_argument(
        "--out",
        default=str(RESULTS / "models"),
        metavar="PREFIX",
        help="writes PREFIX.json and PREFIX.md (default bench/results/models)",
    )
    p.add_argument(
        "--render",
        metavar="PATH.json",
        help="measure nothing: rewrite the .md table next to a saved result",
    )
    args = p.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2:
        p.error("need --repeats >= 1 and --new-tokens >= 2")
    return args


def wait_for_quiet(below: float, limit: float) -> str:
    """Sleeps until the 1-minute load average is under `below`; says how it went."""
    waited, t0 = 0.0, time.monotonic()
    while (load := load_1m()) is not None and load >= below and waited < limit:
        time.sleep(10)
        waited = time.monotonic() - t0
    state = "reached" if load is not None and load < below else "not reached"
    return f"waited {waited:.0f} s for a 1-minute load average below {below:g}: {state} ({load})"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        saved = Path(args.render)
        saved.with_suffix(".md").write_text(markdown(json.loads(saved.read_text())))
        return 0
    torch.set_num_threads(args.threads)
    quiet = wait_for_quiet(args.quiet_below, args.quiet_wait) if args.quiet_below else ""
    if quiet:
        print(quiet, flush=True)
    w = Workload(
        args.prefill_len,
        args.prompt_len,
        args.new_tokens,
        tuple(int(b) for b in args.batches.split(",")),
        args.seed,
    )
    started_at, load_before, t0 = dt.datetime.now(dt.timezone.utc), load_1m(), time.monotonic()
    results, contenders, notes = {}, [], [quiet] if quiet else []
    for dtype in args.dtypes.split(","):
        elapsed = time.monotonic() - t0
        if results and elapsed + elapsed / len(results) > args.budget:
            notes.append(
                f"{dtype} skipped: the run had taken {elapsed:.0f} s and one more "
                f"dtype would pass the {args.budget:.0f} s budget"
            )
            print(notes[-1], flush=True)
            continue
        print(f"{dtype}: loading", flush=True)
        c = load(dtype)
        contenders.append(c)
        results[dtype] = summarize(
            measure_dtype(c, w, args.repeats, args.warmup, log=lambda m: print(m, flush=True))
        )
    conds = conditions(args, w, contenders)
    conds.update(
        date=started_at.isoformat(timespec="seconds"),
        wall_seconds=time.monotonic() - t0,
        load_1m_before=load_before,
        load_1m_after=load_1m(),
        notes=notes,
    )
    doc = {
        "schema": "pdserve.loadtest.models/1",
        "conditions": conds,
        "results": results,
        "goals": goals(results, w.batches),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
