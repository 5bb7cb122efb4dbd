"""Per-role autoscaling: the thresholds of deploy/k8s/overlays/autoscale, derived from measured
figures, and a replay of a ramping load against a simulated scaler that applies them.

The rule is the one KEDA's Prometheus scaler and the HPA apply to the overlay's ScaledObjects
(metricType AverageValue): a trigger asks for ceil(value / threshold) replicas, the HPA keeps the
current count while value / (threshold x current) is within 10 % of 1, takes the largest request
over the triggers, limits a scale-up to max(2x, +4) per 15 s, and a scale-down to the highest
request of the last `SCALE_DOWN_WINDOW_SECONDS`, one pod per `SCALE_DOWN_PERIOD_SECONDS`.

  prefill  queued prompt tokens (pdserve_prefill_queued_prompt_tokens, the prompt tokens waiting
           for a batch), against threshold = prefill tokens/s x QUEUE_WAIT_BUDGET_SECONDS;
  decode   running sequences (pdserve_running_sequences) against the sequences one instance
           decodes within ITL_GOAL_SECONDS, and KV-cache utilisation (vllm:kv_cache_usage_perc)
           against 1 - the share of the pool one instance can fill while another starts.

The replay starts router + 1 prefill + 1 decode (SmolLM2-135M-Instruct, the default model, 1
torch thread each: prefill on CPU 0, decode and router on CPU 1), sends a seeded load that ramps
prefill-heavy (long prompts, few output tokens), then decode-heavy (short prompts, many output
tokens), and reads the services' real /metrics every second. From them the scaler decides, every
`POLLING_INTERVAL_SECONDS`, the counts it would choose. The stack itself stays fixed: its
goodput is measured. The goodput with the chosen counts is modelled, not measured: a queueing
model of the same requests, with each added instance given the capacity the per-core figures
say (prefill tokens/s, decode step time by batch), closed-loop with the same scaler on the
model's own metrics. The model is also run at the fixed 1P1D, beside the measured figure, to
show how far it is from the real stack.

  .venv/bin/python bench/autoscale.py --json bench/results/autoscale.json \
      --plot bench/results/autoscale.png
"""

import argparse
import asyncio
import bisect
import json
import math
import pathlib
import random
import threading
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# --- the goals the thresholds are derived at (docs/kubernetes.md, "Per-role autoscaling") ---
ITL_GOAL_SECONDS = 0.100  # a decode step, i.e. the gap between two tokens of a stream
# A prompt should wait at most this long for its prefill batch: services/prefill/server.py's
# SLOW_QUEUE_SECONDS, past which prefill logs that it is the bottleneck.
QUEUE_WAIT_BUDGET_SECONDS = 1.0
POOL_TOKENS = 2048 * 16  # decode's default pool: --num-blocks 2048 of --block-size 16
BLOCK_SIZE = 16

# --- the ScaledObjects' scaling parameters, mirrored here ---
POLLING_INTERVAL_SECONDS = 10
TOLERANCE = 0.1  # the HPA's default --horizontal-pod-autoscaler-tolerance
SCALE_UP_PERIOD_SECONDS = 15  # the HPA's default scale-up policies: max(100 %, 4 pods) per 15 s
SCALE_DOWN_WINDOW_SECONDS = 60
SCALE_DOWN_PERIOD_SECONDS = 30  # one pod per period: decode drains one at a time
LIMITS = {"prefill": (1, 8), "decode": (1, 16)}
WARMUP_REQUESTS = 2
# A request still unfinished after this long has missed its objectives anyway (160 tokens at the
# ITL goal take 16 s); the bound keeps an overloaded replay within a few minutes.
REQUEST_TIMEOUT_SECONDS = 90.0


# ------------------------------------------------------------------ figures and thresholds


def measured_figures(threads: int, results: pathlib.Path = RESULTS) -> dict:
    """Prefill tokens/s and decode step times (q4, by batch) of SmolLM2-135M-Instruct at
    `threads` torch threads, from the committed results, and the time a stack takes to start."""
    prefill = json.loads((results / "prefill_rate.json").read_text())
    (row,) = [r for r in prefill["rows"] if r["threads"] == threads]
    decode = json.loads((results / "decode_step.json").read_text())
    steps = {
        r["batch"]: r["step_ms"]["median"] / 1e3
        for r in decode["rows"]
        if r["format"] == "q4" and r["threads"] == threads
    }
    peers = json.loads((results / "peers.json").read_text())
    startup = peers["summary"]["pdserve disaggregated"]["startup_seconds"]["median"]
    return {
        "threads": threads,
        "prefill_tokens_per_s": row["prefill_tokens_per_s"]["median"],
        "decode_step_seconds": steps,
        "startup_seconds": startup,
        "sources": {
            "prefill_tokens_per_s": "bench/results/prefill_rate.json (prefill_tokens_per_s, "
            f"median, threads {threads}, 1,500-token prompt, q4)",
            "decode_step_seconds": "bench/results/decode_step.json (step_ms, median, q4, "
            f"threads {threads}, 150 cached tokens per sequence)",
            "startup_seconds": "bench/results/peers.json (summary, pdserve disaggregated, "
            "startup_seconds, median)",
        },
    }


def step_seconds(steps: dict[int, float], batch: float) -> float:
    """A decode step's time at `batch` sequences: piecewise linear through the measured batches,
    extended along the last segment."""
    xs = sorted(steps)
    if batch <= xs[0]:
        return steps[xs[0]]
    i = min(max(bisect.bisect_left(xs, batch), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return steps[x0] + (steps[x1] - steps[x0]) * (batch - x0) / (x1 - x0)


def sequences_at_itl(steps: dict[int, float], goal: float) -> int:
    """The most sequences one decode instance steps within `goal` seconds (0: not even one)."""
    b = 0
    while step_seconds(steps, b + 1) <= goal:
        b += 1
    return b


@dataclass(frozen=True)
class Thresholds:
    prefill_queued_tokens: int  # per prefill instance
    decode_running_sequences: int  # per decode instance
    decode_kv_usage: float  # per decode instance, in [0, 1]


def derive_thresholds(
    prefill_tokens_per_s: float,
    decode_steps: dict[int, float],
    startup_seconds: float,
    itl_goal: float = ITL_GOAL_SECONDS,
    wait_budget: float = QUEUE_WAIT_BUDGET_SECONDS,
    pool_tokens: int = POOL_TOKENS,
) -> Thresholds:
    """The arithmetic of docs/kubernetes.md:
    - prefill: Q queued tokens drain from n instances in Q / (n R) s; keeping that within the
      wait budget W needs n >= Q / (R W), which is the HPA's ceil(Q / threshold) with
      threshold = R W;
    - decode, sequences: the largest batch whose step fits the ITL goal;
    - decode, KV: while an added instance starts (L s), one instance's pool may fill at most at
      one prefill instance's rate plus its own S sequences' tokens, (R + S / ITL goal) L of its
      pool_tokens; the threshold leaves that room, rounded down to a hundredth."""
    sequences = sequences_at_itl(decode_steps, itl_goal)
    fill = (prefill_tokens_per_s + sequences / itl_goal) * startup_seconds / pool_tokens
    return Thresholds(
        prefill_queued_tokens=int(prefill_tokens_per_s * wait_budget),
        decode_running_sequences=sequences,
        decode_kv_usage=math.floor((1 - fill) * 100) / 100,
    )


# ------------------------------------------------------------------ the scaler's rule


def trigger_replicas(current: int, value: float, threshold: float) -> int:
    """What one AverageValue trigger asks for: ceil(value / threshold), or the current count
    while value / (threshold x current) is within the HPA's tolerance of 1."""
    if current > 0 and abs(value / (threshold * current) - 1.0) <= TOLERANCE:
        return current
    return math.ceil(value / threshold - 1e-9)


@dataclass
class RoleScaler:
    """One ScaledObject's HPA: the triggers' largest request, then its behavior."""

    role: str
    thresholds: dict[str, float]  # trigger name -> threshold
    replicas: int = 1
    history: list = field(default_factory=list)  # (t, recommendation)
    changes: list = field(default_factory=list)  # (t, replicas after the change)

    def decide(self, now: float, values: dict[str, float]) -> int:
        lo, hi = LIMITS[self.role]
        wanted = max(
            trigger_replicas(self.replicas, values[k], t) for k, t in self.thresholds.items()
        )
        wanted = min(max(wanted, lo), hi)
        self.history.append((now, wanted))
        self.history = [(t, r) for t, r in self.history if now - t < SCALE_DOWN_WINDOW_SECONDS]
        if wanted > self.replicas:
            base = min(
                [self.replicas] + [r for t, r in self.changes if now - t < SCALE_UP_PERIOD_SECONDS]
            )
            new = min(wanted, max(2 * base, base + 4))
        else:
            new = max(r for _, r in self.history)  # the stabilization window
            recent_down = [
                t
                for (t, r), (_, before) in zip(self.changes[1:], self.changes)
                if r < before and now - t < SCALE_DOWN_PERIOD_SECONDS
            ]
            if new < self.replicas:
                new = self.replicas if recent_down else self.replicas - 1
        if new != self.replicas:
            if not self.changes:
                self.changes.append((now, self.replicas))
            self.changes.append((now, new))
            self.replicas = new
        return self.replicas


def scalers(th: Thresholds) -> dict[str, RoleScaler]:
    return {
        "prefill": RoleScaler("prefill", {"queued_prompt_tokens": th.prefill_queued_tokens}),
        "decode": RoleScaler(
            "decode",
            {"running_sequences": th.decode_running_sequences, "kv_usage": th.decode_kv_usage},
        ),
    }


# ------------------------------------------------------------------ the metrics the queries read


def parse_metrics(text: str) -> dict[tuple, float]:
    """{(name, (label, value)...): value} of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float:
    """The sum of `name` over the series whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def prefill_value(now: dict) -> float:
    """The prefill trigger's query over one scrape of every prefill instance (`now`)."""
    return sample(now, "pdserve_prefill_queued_prompt_tokens", service="prefill")


def decode_values(now: dict) -> dict[str, float]:
    return {
        "running_sequences": sample(now, "pdserve_running_sequences", service="decode"),
        "kv_usage": sample(now, "vllm:kv_cache_usage_perc", service="decode"),
    }


# ------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Request:
    at: float
    prompt: int
    output: int
    phase: str


def workload(seed: int, phase_seconds: float) -> list[Request]:
    """Poisson arrivals whose rate ramps linearly within each phase: prefill-heavy (prompts
    256-768 tokens, outputs 4-8) at 0.1 -> 0.6 req/s, then decode-heavy (prompts 16-48, outputs
    96-160) at 0.2 -> 0.8 req/s."""
    rng = random.Random(seed)
    phases = [
        ("prefill-heavy", 0.1, 0.6, (256, 768), (4, 8)),
        ("decode-heavy", 0.2, 0.8, (16, 48), (96, 160)),
    ]
    out, start = [], 0.0
    for name, r0, r1, prompt, output in phases:
        t = 0.0
        while True:  # thinning of a Poisson process at the phase's peak rate
            t += rng.expovariate(max(r0, r1))
            if t >= phase_seconds:
                break
            if rng.random() < (r0 + (r1 - r0) * t / phase_seconds) / max(r0, r1):
                out.append(Request(start + t, rng.randint(*prompt), rng.randint(*output), name))
        start += phase_seconds
    return out


def meets(row: dict, slo_ttft: float, slo_tpot: float) -> bool:
    return row["ok"] and row["ttft"] <= slo_ttft and (row["tpot"] or 0.0) <= slo_tpot


# ------------------------------------------------------------------ the model


def model(
    requests: list[Request],
    prefill_tps: float,
    steps: dict[int, float],
    th: Thresholds,
    lead_seconds: float,
    scale: bool,
    dt: float = 0.01,
) -> tuple[list[dict], list[dict]]:
    """A fluid model of the stack: each prefill instance computes its FIFO queue's prompt tokens
    at prefill_tps, one prompt at a time; each decode instance steps all its sequences together,
    a step taking step_seconds(batch). A request goes to the prefill with the fewest queued
    tokens, then to the decode with the fewest sequences; its first token comes with its first
    decode step. With `scale`, the scaler runs every POLLING_INTERVAL_SECONDS on the model's own
    metrics (the same queries), and an added instance serves `lead_seconds` later."""
    pending = deque(sorted(requests, key=lambda r: r.at))
    pre: list[dict] = [{"queue": deque(), "busy": None, "left": 0.0, "ready": 0.0}]
    dec: list[dict] = [{"seqs": [], "clock": 0.0, "ready": 0.0}]
    rows: list[dict] = []
    sc = scalers(th)
    ticks: list[dict] = []
    t, next_tick, total = 0.0, 0.0, len(requests)
    while len(rows) < total and t < 3600:
        while pending and pending[0].at <= t:
            r = pending.popleft()
            live = [p for p in pre if p["ready"] <= t]
            p = min(live, key=lambda p: sum(x["prompt"] for x in p["queue"]) + p["left"])
            p["queue"].append({"req": r, "prompt": r.prompt})
        for p in pre:
            if p["ready"] > t:
                continue
            budget = prefill_tps * dt
            while budget > 0:
                if p["busy"] is None:
                    if not p["queue"]:
                        break
                    p["busy"] = p["queue"].popleft()
                    p["left"] = p["busy"]["prompt"]
                used = min(budget, p["left"])
                p["left"] -= used
                budget -= used
                if p["left"] <= 1e-9:
                    r = p["busy"]["req"]
                    live = [d for d in dec if d["ready"] <= t]
                    d = min(live, key=lambda d: len(d["seqs"]))
                    d["seqs"].append({"req": r, "made": 0, "first": None})
                    p["busy"] = None
        for d in dec:
            if d["ready"] > t or not d["seqs"]:
                d["clock"] = t
                continue
            batch = d["seqs"][:64]
            if t - d["clock"] >= step_seconds(steps, len(batch)):
                d["clock"] = t
                for s in batch:
                    s["made"] += 1
                    s["first"] = s["first"] if s["first"] is not None else t
                    if s["made"] >= s["req"].output:
                        r = s["req"]
                        tpot = (t - s["first"]) / (r.output - 1) if r.output > 1 else 0.0
                        rows.append(
                            {
                                "at": r.at,
                                "phase": r.phase,
                                "ok": True,
                                "ttft": s["first"] - r.at,
                                "tpot": tpot,
                            }
                        )
                d["seqs"] = [s for s in d["seqs"] if s["made"] < s["req"].output]
        if t >= next_tick:
            next_tick += POLLING_INTERVAL_SECONDS
            ready_dec = [d for d in dec if d["ready"] <= t]
            values = {
                "queued_prompt_tokens": float(sum(x["prompt"] for p in pre for x in p["queue"])),
                "running_sequences": float(sum(len(d["seqs"]) for d in ready_dec)),
                "kv_usage": sum(
                    sum(math.ceil((s["req"].prompt + s["made"]) / BLOCK_SIZE) for s in d["seqs"])
                    * BLOCK_SIZE
                    / POOL_TOKENS
                    for d in ready_dec
                ),
            }
            if scale:
                want_p = sc["prefill"].decide(t, values)
                want_d = sc["decode"].decide(t, values)
                while len(pre) < want_p:
                    pre.append(
                        {"queue": deque(), "busy": None, "left": 0.0, "ready": t + lead_seconds}
                    )
                while len(dec) < want_d:
                    dec.append({"seqs": [], "clock": t, "ready": t + lead_seconds})
                # A removed prefill takes no new prompts; a removed decode drains what it holds.
                _shrink(pre, want_p, lambda p: p["busy"] is None and not p["queue"])
                _shrink(dec, want_d, lambda d: not d["seqs"])
            ticks.append(
                {
                    "t": round(t, 2),
                    **{k: round(v, 3) for k, v in values.items()},
                    "prefill": len(pre),
                    "decode": len(dec),
                }
            )
        t += dt
    return rows, ticks


def _shrink(instances: list, want: int, idle) -> None:
    """Removes instances beyond `want`, idle ones only (a real one would drain first)."""
    while len(instances) > want:
        spare = [i for i in instances[1:] if idle(i)]
        if not spare:
            return
        instances.remove(spare[-1])


# ------------------------------------------------------------------ the real stack


class Scraper(threading.Thread):
    """Reads each /metrics URL every second and keeps (t, merged samples)."""

    def __init__(self, urls: list[str], start: float):
        super().__init__(daemon=True)
        self.urls, self.t0, self.samples = urls, start, []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            t = time.perf_counter() - self.t0
            merged: dict = {}
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=2) as reply:
                        merged.update(parse_metrics(reply.read().decode()))
                except OSError:
                    pass
            self.samples.append((t, merged))
            self.stopped.wait(1.0)

    def at(self, t: float) -> dict | None:
        """The last scrape at or before t."""
        found = None
        for ts, s in self.samples:
            if ts > t:
                break
            found = s
        return found


async def drive(address: str, requests: list[Request], seed: int, scraper: "Scraper") -> list[dict]:
    import grpc

    from pdserve.v1 import pdserve_pb2 as pb
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    rng = random.Random(seed + 1)
    prompts = [[rng.randint(100, 40000) for _ in range(r.prompt)] for r in requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        for _ in range(WARMUP_REQUESTS):  # one at a time, left out of the figures
            warm = pb.GenerateRequest(
                prompt_token_ids=prompts[0][:64],
                sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
            )
            async for _reply in stub.Generate(warm, timeout=REQUEST_TIMEOUT_SECONDS):
                pass
        start = scraper.t0 = time.perf_counter()
        scraper.start()

        async def one(r: Request, prompt: list[int]) -> dict:
            await asyncio.sleep(max(0.0, start + r.at - time.perf_counter()))
            sent = time.perf_counter()
            sampling = pb.SamplingParams(max_tokens=r.output, ignore_eos=True, temperature=0.0)
            first, tokens = None, 0
            try:
                async for reply in stub.Generate(
                    pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling),
                    timeout=REQUEST_TIMEOUT_SECONDS,
                ):
                    if reply.token_ids:
                        first = first or time.perf_counter()
                        tokens += len(reply.token_ids)
                ok = first is not None
            except grpc.aio.AioRpcError as exc:
                ok, code = False, exc.code().name
            end = time.perf_counter()
            row = {"at": r.at, "phase": r.phase, "prompt": r.prompt, "output": r.output, "ok": ok}
            row["ttft"] = (first - sent) if first else None
            row["tpot"] = (end - first) / (tokens - 1) if first and tokens > 1 else 0.0
            if not ok:
                row["code"] = locals().get("code", "NO_TOKENS")
            return row

        return list(await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts))))


def run_stack(requests: list[Request], th: Thresholds, args, tmp: str) -> dict:
    from pdserve.localstack import free_port, start_router, start_service

    flags = ("--model", args.model, "--torch-threads", "1")
    services, ports = [], {"prefill": free_port(), "decode": free_port()}
    began = time.perf_counter()
    try:
        decode = start_service(
            "decode", *flags, "--cpus", "1", "--metrics-port", str(ports["decode"]), tmp_dir=tmp
        )
        services.append(decode)
        decode_up = time.perf_counter() - began
        began = time.perf_counter()
        prefill = start_service(
            "prefill",
            *flags,
            "--cpus",
            "0",
            "--metrics-port",
            str(ports["prefill"]),
            tmp_dir=tmp,
        )
        services.append(prefill)
        prefill_up = time.perf_counter() - began
        router = start_router(
            [prefill], [decode], "--model", args.model, "--cpus", "1", tmp_dir=tmp
        )
        services.append(router)
        pids = {s.role: s.proc.pid for s in services}
        print(
            "stack up:", pids, f"decode {decode_up:.1f} s, prefill {prefill_up:.1f} s", flush=True
        )
        urls = [f"http://127.0.0.1:{p}/metrics" for p in ports.values()]
        scraper = Scraper(urls, 0.0)  # started, and its clock set, when the replay starts
        rows = asyncio.run(drive(router.address, requests, args.seed, scraper))
        scraper.stopped.set()
        scraper.join()
    finally:
        for s in reversed(services):
            s.stop()
    # The scaler, every polling interval, on what the scrapes showed (open loop: the stack
    # stays fixed, so later decisions see a stack that was not scaled).
    sc, decisions = scalers(th), []
    end = scraper.samples[-1][0] if scraper.samples else 0.0
    t = 0.0
    while t <= end:
        now = scraper.at(t)
        if now:
            values = {
                "queued_prompt_tokens": prefill_value(now),
                **decode_values(now),
            }
            decisions.append(
                {
                    "t": t,
                    **{k: round(v, 3) for k, v in values.items()},
                    "prefill": sc["prefill"].decide(t, values),
                    "decode": sc["decode"].decide(t, values),
                }
            )
        t += POLLING_INTERVAL_SECONDS
    return {
        "rows": rows,
        "decisions": decisions,
        "startup_seconds": {"decode": decode_up, "prefill": prefill_up},
        "pids": pids,
        "ports": ports,
    }


# ------------------------------------------------------------------ report


def windows(rows, width, end, slo):
    out = []
    for w0 in range(0, int(end), width):
        mine = [r for r in rows if w0 <= r["at"] < w0 + width]
        good = sum(meets(r, *slo) for r in mine)
        out.append({"from": w0, "offered": len(mine) / width, "goodput": good / width})
    return out


def count_at(ticks: list[dict], t: float, role: str) -> int:
    found = 1
    for tick in ticks:
        if tick["t"] > t:
            break
        found = tick[role]
    return found


def main() -> None:
    import platform
    import tempfile

    from common import write_results  # bench/ is the script's directory

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--phase-seconds", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--window", type=int, default=20, help="seconds per table row")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()

    one_core = measured_figures(threads=1)
    th = derive_thresholds(
        one_core["prefill_tokens_per_s"],
        one_core["decode_step_seconds"],
        one_core["startup_seconds"],
    )
    pod = measured_figures(threads=2)
    th_pod = derive_thresholds(
        pod["prefill_tokens_per_s"], pod["decode_step_seconds"], pod["startup_seconds"]
    )
    print("thresholds, 1 core per instance (the replay):", th)
    print("thresholds, 2 cores per instance (the overlay's pods):", th_pod)
    requests = workload(args.seed, args.phase_seconds)
    slo_ttft = QUEUE_WAIT_BUDGET_SECONDS + 768 / one_core["prefill_tokens_per_s"]
    slo = (slo_ttft, ITL_GOAL_SECONDS)
    print(f"{len(requests)} requests; SLO TTFT <= {slo_ttft:.2f} s, TPOT <= {slo[1]} s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        real = run_stack(requests, th, args, tmp)
    lead = max(real["startup_seconds"].values())
    steps, tps = one_core["decode_step_seconds"], one_core["prefill_tokens_per_s"]
    fixed_rows, fixed_ticks = model(requests, tps, steps, th, lead, scale=False)
    scaled_rows, scaled_ticks = model(requests, tps, steps, th, lead, scale=True)

    end = 2 * args.phase_seconds
    measured = windows(real["rows"], args.window, end, slo)
    mod_fixed = windows(fixed_rows, args.window, end, slo)
    mod_scaled = windows(scaled_rows, args.window, end, slo)
    table = []
    for i, w in enumerate(measured):
        t_mid = w["from"] + args.window - 1
        table.append(
            {
                "from_s": w["from"],
                "to_s": w["from"] + args.window,
                "offered_rps": round(w["offered"], 3),
                "scaler_on_real_metrics": {
                    "prefill": count_at(real["decisions"], t_mid, "prefill"),
                    "decode": count_at(real["decisions"], t_mid, "decode"),
                },
                "measured_goodput_fixed_1p1d": round(w["goodput"], 3),
                "modelled_goodput_fixed_1p1d": round(mod_fixed[i]["goodput"], 3),
                "modelled_scaled": {
                    "prefill": count_at(scaled_ticks, t_mid, "prefill"),
                    "decode": count_at(scaled_ticks, t_mid, "decode"),
                },
                "modelled_goodput_scaled": round(mod_scaled[i]["goodput"], 3),
            }
        )

    def total(rows):
        return sum(meets(r, *slo) for r in rows) / end

    summary = {
        "requests": len(requests),
        "measured_fixed": {
            "completed": sum(r["ok"] for r in real["rows"]),
            "goodput_rps": total(real["rows"]),
            "met_slo": sum(meets(r, *slo) for r in real["rows"]),
        },
        "modelled_fixed": {
            "goodput_rps": total(fixed_rows),
            "met_slo": sum(meets(r, *slo) for r in fixed_rows),
        },
        "modelled_scaled": {
            "goodput_rps": total(scaled_rows),
            "met_slo": sum(meets(r, *slo) for r in scaled_rows),
            "max_prefill": max(x["prefill"] for x in scaled_ticks),
            "max_decode": max(x["decode"] for x in scaled_ticks),
            "instance_seconds": {
                role: sum(x[role] for x in scaled_ticks) * POLLING_INTERVAL_SECONDS
                for role in ("prefill", "decode")
            },
        },
        "scaler_on_real_metrics_max": {
            role: max(x[role] for x in real["decisions"]) for role in ("prefill", "decode")
        },
    }
    print(
        f"{'window':>9} {'offered':>7} {'real P/D':>8} {'meas fixed':>10} {'mod fixed':>9} "
        f"{'mod P/D':>7} {'mod scaled':>10}"
    )
    for row in table:
        real_pd = "{prefill}/{decode}".format(**row["scaler_on_real_metrics"])
        mod_pd = "{prefill}/{decode}".format(**row["modelled_scaled"])
        print(
            f"{row['from_s']:>4}-{row['to_s']:<4} {row['offered_rps']:>7.2f} {real_pd:>8} "
            f"{row['measured_goodput_fixed_1p1d']:>10.2f} "
            f"{row['modelled_goodput_fixed_1p1d']:>9.2f} {mod_pd:>7} "
            f"{row['modelled_goodput_scaled']:>10.2f}"
        )
    print(json.dumps(summary, indent=1))

    if args.plot:
        _plot(args.plot, table, real, scaled_ticks)
    if args.json:
        import grpc
        import prometheus_client
        import torch

        conditions = {
            "model": f"{args.model} (q4 weights, the default), 1 torch thread per service",
            "stack": "pdserve serve decode (CPU 1), prefill (CPU 0), router (CPU 1) on loopback, "
            "--metrics-port on prefill and decode; fixed 1P1D throughout",
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "grpcio": grpc.__version__,
                "prometheus_client": getattr(prometheus_client, "__version__", "unknown"),
            },
            "workload": "Poisson with linearly ramping rate, seeded: prefill-heavy "
            f"{args.phase_seconds:g} s at 0.1->0.6 req/s, prompts 256-768 tokens, outputs 4-8; "
            f"then decode-heavy {args.phase_seconds:g} s at 0.2->0.8 req/s, prompts 16-48, "
            "outputs 96-160; greedy, ignore_eos, random token ids",
            "seed": args.seed,
            "slo": {
                "ttft_seconds": slo_ttft,
                "tpot_seconds": ITL_GOAL_SECONDS,
                "ttft_derivation": "queue-wait budget 1 s + the longest prompt (768) at the "
                "measured prefill tokens/s",
            },
            "thresholds_replay_1_core": asdict(th),
            "thresholds_overlay_2_cores": asdict(th_pod),
            "figures_1_core": {
                **one_core,
                "decode_step_seconds": {str(k): v for k, v in steps.items()},
            },
            "figures_2_cores": {
                **pod,
                "decode_step_seconds": {str(k): v for k, v in pod["decode_step_seconds"].items()},
            },
            "scaler": {
                "polling_interval_s": POLLING_INTERVAL_SECONDS,
                "tolerance": TOLERANCE,
                "scale_down_window_s": SCALE_DOWN_WINDOW_SECONDS,
                "scale_down_one_pod_per_s": SCALE_DOWN_PERIOD_SECONDS,
                "scale_up": "max(2x, +4) per 15 s (HPA default)",
                "limits": LIMITS,
            },
            "lead_seconds_modelled": lead,
            "what_is_measured": "the fixed 1P1D stack's requests and its /metrics, and the "
            "scaler's decisions on those metrics (open loop: the stack was not scaled)",
            "what_is_modelled": "goodput with the scaler's counts: a fluid model with each "
            "instance at the 1-core figures on a core of its own, closed loop with the same "
            "scaler on the model's metrics; and the same model at a fixed 1P1D, for comparison "
            "with the measured stack",
            "machine": "whatever else ran on these CPUs shows in cpu.load_average_at_start",
        }
        write_results(
            args.json,
            conditions,
            summary=summary,
            table=table,
            real_decisions=real["decisions"],
            modelled_scaled_ticks=scaled_ticks,
            measured_requests=real["rows"],
            startup_seconds=real["startup_seconds"],
        )


def _plot(path: str, table: list[dict], real: dict, ticks: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ts = [x["t"] for x in ticks]
    a.step(ts, [x["prefill"] for x in ticks], where="post", label="prefill (modelled, scaled)")
    a.step(ts, [x["decode"] for x in ticks], where="post", label="decode (modelled, scaled)")
    rt = [x["t"] for x in real["decisions"]]
    a.step(
        rt,
        [x["prefill"] for x in real["decisions"]],
        "--",
        where="post",
        label="prefill (scaler on real metrics)",
    )
    a.step(
        rt,
        [x["decode"] for x in real["decisions"]],
        "--",
        where="post",
        label="decode (scaler on real metrics)",
    )
    a.set_ylabel("instances")
    a.legend(fontsize=7)
    mids = [(r["from_s"] + r["to_s"]) / 2 for r in table]
    b.plot(
        mids, [r["measured_goodput_fixed_1p1d"] for r in table], "o-", label="measured, fixed 1P1D"
    )
    b.plot(
        mids, [r["modelled_goodput_fixed_1p1d"] for r in table], "x--", label="modelled, fixed 1P1D"
    )
    b.plot(mids, [r["modelled_goodput_scaled"] for r in table], "s-", label="modelled, scaled")
    b.plot(mids, [r["offered_rps"] for r in table], ":", label="offered")
    b.set_ylabel("req/s (by arrival)")
    b.set_xlabel("seconds")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
