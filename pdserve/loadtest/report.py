"""What a bench run reports: the summary text, the JSON document with the run's conditions, and
PNG charts (matplotlib, imported only when a chart is asked for).

The JSON document (schema "pdserve.loadtest/1"):
  conditions  model as the target reports it (GetModelInfo: name, architecture, dtype,
              fingerprint, shapes, KV bytes per token) and its parameter count where the client
              can count it, CPU, torch/Python/gRPC versions, target, workload, seed, rates,
              objectives, date, command line
  runs        one per rate: {"rate", "started_at", "summary" (see stats.summarize: pdserve's
              own keys, vLLM's result keys beside them, "roles"), "requests" (one record per
              request, see stats.RequestResult, with "meets_slo"), vLLM's per-request lists
              (stats.vllm_lists: "input_lens", "output_lens", "ttfts", "itls", "latencies",
              "start_times", "queue_times", "errors"), "server_metrics" (what --metrics-url
              read, or null), "notes"}
"""

import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import sys
from pathlib import Path

from pdserve.loadtest.runner import RunOptions, RunResult
from pdserve.loadtest.stats import DEFAULT_PERCENTILES, meets_slo, percentile_word, summarize
from pdserve.loadtest.stats import vllm_lists
from pdserve.loadtest.workload import WorkloadSpec, format_rate
from pdserve.core.config import STEP_OPS, ModelConfig

SCHEMA = "pdserve.loadtest/1"
METRICS = (
    ("ttft_seconds", "TTFT"),
    ("tpot_seconds", "TPOT"),
    ("itl_seconds", "ITL"),
    ("e2e_seconds", "E2E"),
)


# ---------------------------------------------------------------------------------- conditions


def parameter_count(c: ModelConfig) -> int:
    """TinyGPT's parameters, counted from its shapes (pdserve.models.tinygpt.TinyGPT): token and
    position embeddings, per block two LayerNorms (weight and bias), qkv, proj, up and down
    (no biases), the final LayerNorm and an untied output head."""
    d = c.d_model
    block = 2 * (2 * d) + 3 * d * d + d * d + 2 * d * c.d_ff
    return c.vocab_size * d + c.max_context * d + c.n_layers * block + 2 * d + d * c.vocab_size


def model_conditions(info: dict | None, unavailable: str = "") -> dict:
    """The model as the target reports it (GetModelInfo), plus a parameter count where the
    client can prove it holds the same model; or, without a report, an explicit unknown."""
    if info is None:
        return {
            "name": None,
            "parameters": None,
            "reported_by": None,
            "note": f"model unknown: {unavailable or 'the target was not asked'}",
        }
    parameters, how = local_parameter_count(info)
    return {
        "name": info["name"],
        "architecture": info["architecture"],
        "dtype": info["dtype"],
        "fingerprint": info["fingerprint"],
        "kv_bytes_per_token": info["kv_bytes_per_token"],
        "parameters": parameters,
        "parameters_note": how,
        "reported_by": "the target's GetModelInfo",
        "server": dict(info),
    }


def local_parameter_count(info: dict) -> tuple[int | None, str]:
    """The server does not report a parameter count, so the client counts one only for a model
    it can load itself with the same fingerprint (same shapes, dtype and weights)."""
    from pdserve.models import loading  # torch-free unless weights are built (never here)

    # The step ops change how a step is computed, not the weights: either may match.
    if info["architecture"] == "TinyGPT":
        for ops in STEP_OPS:
            config = ModelConfig(dtype=info["dtype"], step_ops=ops)
            if loading.fingerprint(config, []) == info["fingerprint"]:
                return parameter_count(config), "counted from ModelConfig(); fingerprint matches"
        return None, "a TinyGPT with other shapes than ModelConfig()'s defaults"
    try:
        local = loading.load_served_model(
            info["name"], dtype=info["dtype"], weights=False, step_ops="torch"
        )
        if local.fingerprint != info["fingerprint"]:
            local = loading.load_served_model(info["name"], dtype=info["dtype"], weights=False)
    except Exception as exc:  # noqa: BLE001 - a missing local copy only costs the count
        return None, f"not counted: no local copy of {info['name']!r} ({type(exc).__name__})"
    if local.fingerprint != info["fingerprint"]:
        return None, (
            f"not counted: the local {info['name']!r} has fingerprint "
            f"{local.fingerprint}, the server's is {info['fingerprint']}"
        )
    from pdserve.models import checkpoint

    assert local.source is not None  # only TinyGPT has no checkpoint, and it was counted above
    count = sum(safetensors_elements(f) for f in checkpoint.weight_files(local.source))
    return count, "counted from the local checkpoint's tensor shapes; fingerprint matches"


def safetensors_elements(path: str | Path) -> int:
    """Elements stored in a .safetensors file, from its JSON header alone (no tensor is read).
    Tied weights are stored once, so this is the model's parameter count."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


# The vector extensions that decide which CPU kernels torch runs (bf16 and int8 GEMMs are several
# times faster with AVX-512 than with AVX2 alone), so results from two CPUs can be told apart.
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_conditions(cpuinfo: str = "/proc/cpuinfo") -> dict:
    model, flags = None, set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor", "cpu model"):
                    model = model or value.strip()
                if key.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {
        "model": model or platform.processor() or None,
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "machine": platform.machine(),
        "load_average_at_start": load,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def conditions(
    spec: WorkloadSpec,
    rates: list[float],
    options: RunOptions,
    *,
    model_info: dict | None = None,
    model_unavailable: str = "",
    label: str = "",
    preset: str | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    started: dt.datetime | None = None,
    argv: list[str] | None = None,
    slo_e2el: float | None = None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    prefill_cores: float | None = None,
    decode_cores: float | None = None,
) -> dict:
    """`model_info` is the target's GetModelInfo answer (runner.fetch_model_info); without it,
    `model_unavailable` says why, and the model is recorded as unknown."""
    started = started or dt.datetime.now(dt.timezone.utc)
    return {
        "model": model_conditions(model_info, model_unavailable),
        "cpu": cpu_conditions(),
        "host_note": "CPU and versions are the bench client's host; they describe the servers "
        "only when the servers run on the same machine",
        "software": {
            "torch": _version("torch"),
            "python": platform.python_version(),
            "grpcio": _version("grpcio"),
            "pdserve": _version("pdserve"),
            "os": platform.platform(),
        },
        "target": {"address": options.target, "label": label},
        # How the target was measured: its front, the /metrics read, the cores it was given.
        "measured": {
            "endpoint": options.endpoint,
            "metrics_urls": list(options.metrics_urls),
            "prefill_cores": prefill_cores,
            "decode_cores": decode_cores,
        },
        "workload": {
            **spec.to_dict(),
            "preset": preset,
            "num_requests": options.num_requests,
            "duration_seconds": options.duration,
            "concurrency": options.concurrency,
            "warmup_requests": options.warmup,
            "temperature": options.temperature,
            "ignore_eos": options.ignore_eos,
            "timeout_seconds": options.timeout,
        },
        "seed": spec.seed,
        "rates": [None if math.isinf(r) else r for r in rates],
        "slo": {"ttft_seconds": slo_ttft, "tpot_seconds": slo_tpot, "e2el_seconds": slo_e2el},
        "percentiles": list(percentiles),
        "date": started.isoformat(timespec="seconds"),
        "command": _command(argv if argv is not None else sys.argv),
    }


def _command(argv: list[str]) -> str:
    if argv and argv[0].endswith(("__main__.py", "cli.py")):
        argv = ["python", "-m", "pdserve.loadtest", *argv[1:]]
    elif argv and Path(argv[0]).name == "pdserve":
        argv = ["pdserve", *argv[1:]]
    return " ".join(argv)


def document(
    conds: dict,
    runs: list[RunResult],
    slo_ttft: float | None,
    slo_tpot: float | None,
    slo_e2el: float | None = None,
    percentiles: tuple[float, ...] | None = None,
) -> dict:
    """The JSON document; the percentiles (unless given) and the cores per role come from
    `conds`."""
    pq = tuple(percentiles or conds.get("percentiles") or DEFAULT_PERCENTILES)
    measured = conds.get("measured", {})

    def one(run: RunResult) -> dict:
        summary = summarize(
            run.results,
            run.duration,
            slo_ttft,
            slo_tpot,
            slo_e2el,
            pq,
            measured.get("prefill_cores"),
            measured.get("decode_cores"),
            run.scraped,
        )
        requests = [
            {**r.to_dict(), "meets_slo": meets_slo(r, slo_ttft, slo_tpot, slo_e2el)}
            for r in run.results
        ]
        return {
            "rate": None if math.isinf(run.spec.rate) else run.spec.rate,
            "started_at": dt.datetime.fromtimestamp(run.started_at_unix, dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "summary": summary,
            "requests": requests,
            **vllm_lists(run.results),
            "server_metrics": run.scraped,
            "load_average_1m": {"before": run.load_before, "after": run.load_after},
            "notes": run.notes,
        }

    return finite({"schema": SCHEMA, "conditions": conds, "runs": [one(run) for run in runs]})


def write_json(doc: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(obj):
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _finite(doc):
    """NaN and infinities become None, so the JSON is strict."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_finite(v) for v in doc]
    return doc


def finite(doc: dict) -> dict:
    return _finite(doc)


def load_json(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a pdserve bench result (schema {doc.get('schema')!r})")
    return doc


# ---------------------------------------------------------------------------------- text


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def conditions_line(conds: dict) -> str:
    m, cpu, w = conds["model"], conds["cpu"], conds["workload"]
    arrival = f"gamma (burstiness {w['burstiness']:g})" if w["arrival"] == "gamma" else w["arrival"]
    prompts = (
        f"dataset {Path(w['dataset']).name}" if w.get("dataset") else f"prompt {w['prompt_len']}"
    )
    cpus = cpu.get("usable_cpus") or cpu.get("logical_cpus")
    rates = ", ".join("inf" if r is None else f"{r:g}" for r in conds["rates"])
    rates = f"arrival rate{'s' if len(conds['rates']) > 1 else ''} {rates}/s"
    return (
        f"Conditions: {_model_words(m)}, {cpus}x {cpu['model']}, "
        f"torch {conds['software']['torch']}, {arrival}, {prompts}, output {w['output_len']}, "
        f"seed {conds['seed']}, {rates}, measured {conds['date']}"
    )


def _model_words(m: dict) -> str:
    """'smollm2-135m-instruct (LlamaForCausalLM, bfloat16, 134,515,008 params)' or 'model unknown'."""
    if m.get("name") is None:
        return "model unknown"
    params = [f"{m['parameters']:,} params"] if m.get("parameters") else []
    return f"{m['name']} ({', '.join([m['architecture'], m['dtype'], *params])})"


def summary_text(conds: dict, run: dict) -> str:
    s = run["summary"]
    rate = format_rate(math.inf if run["rate"] is None else run["rate"])
    target = conds["target"]
    who = f"{target['label']} at {target['address']}" if target.get("label") else target["address"]
    lines = [f"pdserve bench: {who}, rate {rate}"]
    status = ", ".join(f"{n} {k}" for k, n in s["by_status"].items() if k != "OK")
    lines.append(
        f"  requests      {s['ok']} ok, {s['failed']} failed"
        + (f" ({status})" if status else "")
        + f" in {s['duration_seconds']:.2f} s; {_num(s['request_throughput'])} req/s"
    )
    lines.append(
        f"  tokens/s      input {_num(s['input_tokens_per_second'], 1)}, "
        f"output {_num(s['output_tokens_per_second'], 1)} "
        f"({s['input_tokens']} in, {s['output_tokens']} out)"
    )
    columns = ["mean"] + [f"p{percentile_word(q)}" for q in s.get("percentiles", (50, 90, 99))]
    lines.append("  latency (ms)  " + "".join(f"{c:>9}" for c in columns))
    for key, name in METRICS + (
        ("server_ttft_seconds", "TTFT@srv"),
        ("client_delay_seconds", "send lag"),
    ):
        d = s[key]
        lines.append(f"    {name:<10}" + "".join(f"{_ms(d.get(k)):>9}" for k in columns))
    slo = []
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL")):
        if s.get(f"slo_{key}_seconds") is not None:
            slo.append(f"{name} <= {s[f'slo_{key}_seconds'] * 1e3:g} ms")
    lines.append(
        f"  goodput       {_num(s['goodput'])} req/s: {s['requests_meeting_slo']} of "
        f"{s['requests']} requests met " + (" and ".join(slo) or "no objective")
    )
    if "slo_attainment_per_token" in s:
        lines.append(
            f"  attainment    {_pct(s['slo_attainment'])} of requests, "
            f"{_pct(s['slo_attainment_per_token'])} of output tokens on time; "
            f"{_num(s['output_token_goodput'], 1)} output tokens/s within the objectives"
        )
    hb, hs, bw = s["handoff_bytes"], s["handoff_seconds"], s["handoff_bytes_per_second"]
    hx = s.get("handoff_exposed_seconds") or {"p50": None, "p90": None, "p99": None}
    if hb["count"] and hb["max"]:
        lines.append(
            f"  handoff       {hb['mean'] / 1024:.1f} KiB/request mean "
            f"({hb['p50'] / 1024:.1f} p50, {hb['max'] / 1024:.1f} max); "
            f"{(bw['p50'] or 0) / 1e6:.1f} MB/s p50 (bytes / latency)"
        )
        lines.append(
            f"    latency ms  first chunk -> commit p50 {_ms(hs['p50'])}, "
            f"p90 {_ms(hs['p90'])}, p99 {_ms(hs['p99'])}; exposed (after prefill "
            f"compute) p50 {_ms(hx['p50'])}, p90 {_ms(hx['p90'])}, p99 {_ms(hx['p99'])}"
        )
        if s.get("retried"):
            lines.append(f"    {s['retried']} requests needed more than one handoff attempt")
    else:
        lines.append("  handoff       none reported (a colocated engine moves no KV)")
    lines += _roles_lines(s.get("roles"))
    for note in run.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _roles_lines(roles: dict | None) -> list[str]:
    """Prefix hit rates and throughput per core, for the roles the run has figures of."""
    if not roles:
        return []
    lines = []
    for role in ("prefill", "decode"):
        r = roles.get(role) or {}
        prefix = r.get("prefix_cache") or {}
        srv = r.get("server_metrics") or {}
        parts = []
        if prefix.get("hit_rate") is not None:
            parts.append(f"prefix hits {_pct(prefix['hit_rate'])}")
        elif srv.get("prefix_hit_rate") is not None:
            parts.append(f"prefix hits {_pct(srv['prefix_hit_rate'])} (its /metrics)")
        if r.get("tokens_per_second") is not None:
            what = "prompt tokens computed" if role == "prefill" else "output tokens"
            parts.append(f"{_num(r['tokens_per_second'], 1)} {what}/s")
        if r.get("tokens_per_second_per_core") is not None:
            parts.append(f"{_num(r['tokens_per_second_per_core'], 1)}/s per core ({r['cores']:g})")
        if srv.get("busy_cores") is not None:
            parts.append(f"{srv['busy_cores']:.2f} cores busy")
        if srv.get("tokens_per_cpu_second") is not None:
            parts.append(f"{_num(srv['tokens_per_cpu_second'], 1)} per CPU second")
        if parts:
            lines.append(f"  {role:<13} " + ", ".join(parts))
    return lines


def sweep_table(conds: dict, runs: list[dict]) -> str:
    head = (
        f"{'rate':>8} {'ok':>5} {'fail':>5} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'E2E p99':>9} "
        f"{'goodput':>8}"
    )
    lines = ["rate sweep (latencies in ms):", head]
    for run in runs:
        s = run["summary"]
        rate = "inf" if run["rate"] is None else f"{run['rate']:g}"
        lines.append(
            f"{rate:>8} {s['ok']:>5} {s['failed']:>5} {_num(s['request_throughput']):>7} "
            f"{_num(s['output_tokens_per_second'], 1):>10} "
            f"{_ms(s['ttft_seconds']['p50']):>9} {_ms(s['ttft_seconds']['p99']):>9} "
            f"{_ms(s['tpot_seconds']['p50']):>9} {_ms(s['tpot_seconds']['p99']):>9} "
            f"{_ms(s['e2e_seconds']['p99']):>9} {_num(s['goodput']):>8}"
        )
    return "\n".join(lines)


def report_text(doc: dict) -> str:
    parts = [summary_text(doc["conditions"], run) for run in doc["runs"]]
    if len(doc["runs"]) > 1:
        parts.append(sweep_table(doc["conditions"], doc["runs"]))
    parts.append(conditions_line(doc["conditions"]))
    return "\n".join(parts)


def _num(x, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------------- charts


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(docs: list[tuple[str, dict]], path: str | Path) -> Path:
    """A sweep (any document with more than one rate): latency percentiles against rate.
    Otherwise: latency CDFs of each document's single run. Several documents share the axes."""
    if any(len(doc["runs"]) > 1 for _, doc in docs):
        return plot_sweep(docs, path)
    return plot_cdfs(docs, path)


def _caption(docs: list[tuple[str, dict]]) -> str:
    import textwrap

    line = conditions_line(docs[0][1]["conditions"])
    if len(docs) > 1:  # each run's own date
        line = (
            line.rsplit(", measured ", 1)[0]
            + ", measured "
            + "; ".join(f"{name} {doc['conditions']['date']}" for name, doc in docs)
        )
    return textwrap.fill(line, 150)


def plot_sweep(docs: list[tuple[str, dict]], path: str | Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, doc) in enumerate(docs):
        runs = [r for r in doc["runs"] if r["rate"] is not None]
        rates = [r["rate"] for r in runs]
        color = colors[i % len(colors)]
        for ax, (key, title) in zip(axes.flat, METRICS):
            for q, style in styles.items():
                ys = [_ms_or_nan(r["summary"][key][q]) for r in runs]
                ax.plot(rates, ys, style, marker="o", color=color, label=f"{name} {q}")
            ax.set_title(f"{title} percentiles")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel("ms")
        ax = axes.flat[4]
        ax.plot(
            rates,
            [r["summary"]["request_throughput"] for r in runs],
            "-o",
            color=color,
            label=f"{name} throughput",
        )
        ax.plot(
            rates,
            [r["summary"]["goodput"] for r in runs],
            "--s",
            color=color,
            label=f"{name} goodput",
        )
        ax = axes.flat[5]
        ax.plot(
            rates,
            [r["summary"]["output_tokens_per_second"] for r in runs],
            "-o",
            color=color,
            label=f"{name}",
        )
    axes.flat[4].set_title("requests/s: completed and within SLO")
    axes.flat[4].set_xlabel("arrival rate (req/s)")
    axes.flat[5].set_title("output tokens/s")
    axes.flat[5].set_xlabel("arrival rate (req/s)")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_caption(docs), fontsize=9)
    return _save(fig, plt, path)


def plot_cdfs(docs: list[tuple[str, dict]], path: str | Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for name, doc in docs:
        run = doc["runs"][0]
        ok = [r for r in run["requests"] if r["status"] == "OK"]
        series = {
            "ttft_seconds": [r["ttft"] for r in ok],
            "tpot_seconds": [r["tpot"] for r in ok],
            "itl_seconds": [x for r in ok for x in r["itl"]],
            "e2e_seconds": [r["e2e"] for r in ok],
        }
        rate = format_rate(math.inf if run["rate"] is None else run["rate"])
        for ax, (key, title) in zip(axes.flat, METRICS):
            xs = sorted(x * 1e3 for x in series[key] if x is not None)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            p = run["summary"][key]
            ax.step(
                xs,
                ys,
                where="post",
                label=f"{name} @ {rate}: p50 {_ms(p['p50'])}, p99 {_ms(p['p99'])} ms",
            )
            ax.set_title(f"{title} CDF")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of " + ("tokens" if key == "itl_seconds" else "requests"))
            if key == "itl_seconds" and xs[-1] > 20 * max(xs[len(xs) // 2], 1e-3):
                ax.set_xscale("log")  # a long tail would squash the body of the curve
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(_caption(docs), fontsize=9)
    return _save(fig, plt, path)


def _ms_or_nan(x) -> float:
    return math.nan if x is None else x * 1e3


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
