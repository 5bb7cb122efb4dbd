"""How fast the stack recovers: a steady load, one event at a time, and the seconds until it is
whole again.

TinyGPT on loopback: a router over 2 prefill and 2 decode instances (one torch thread each).
--streams closed-loop clients keep requests in flight (prompts of 64-200 tokens, --tokens
output tokens, greedy). Each event, repeated --repeats times, with the load running:

  cancel-storm   --storm requests (200-token prompts, 200 tokens) sent at once, each cancelled
                 0-1.5 s later: mid-handoff and mid-decode
  kill-prefill   prefill 0 SIGKILLed mid-transfer, restarted on its port 1 s later
  kill-decode    decode 0 SIGKILLed mid-stream, restarted on its port 1 s later
                 (both restarts run beside the watch, which starts at the kill)
  stop-decode    decode 0 SIGSTOPped (it keeps its connections and reads nothing) for
                 --stop-seconds, then SIGCONTed
  nothing        the control: nothing happens, measured the same way. Its "throughput back"
                 is how long the 1 s windows take to land within 10% of the level twice
                 running on their own, the floor under every other event's figure

Before each event the stack settles (every decode answering, the clients' rate steady), then
its level is taken over BEFORE_SECONDS. Per event and repeat, measured from the event (for the
storm, from its last cancel):
  blocks_back_s      until the decodes' used blocks are back to at most their level before
                     the event (the median of the 5 s before, plus 10%), with every decode
                     answering; a killed decode counts none until its new process is up
  throughput_back_s  until the clients' tokens/s over 1 s windows is back within 10% of its
                     level before the event, for 2 windows running
  throughput_back_to_after_s  the same against the level of the watch's last AFTER_SECONDS
                     (20-30 s after the event): this VM's speed drifts by more than 10%
                     between minutes, which the level before cannot tell from the event
  after_over_before  that level after / the level before, so that a loss that lasts is seen
  restarted_s        for a kill, until the new process was up (for comparison)
  lost               requests of the steady load in flight during the event that ended with
                     neither all their tokens nor an error status
  missing, duplicated  tokens a completed request lacks or has extra
  changed            completed requests in flight during the event whose tokens differ from the
                     same request run again afterwards (RECHECK of them per event, run
                     together; greedy float32: identical)
Then p50 and p99 over the repeats, and at the end every block free within one lease TTL.

Goal (the reliability issue): every block free within one lease TTL, throughput back within 5 s.

  .venv/bin/python bench/recovery.py --repeats 5        # ~17 minutes on 2 vCPUs
"""

from __future__ import annotations

import argparse
import bisect
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common import write_results
from pdserve.loadtest.stats import percentile
from pdserve.localstack import Service, start_router, start_service
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

RESULTS = Path(__file__).resolve().parent / "results"
EVENTS = ("cancel-storm", "kill-prefill", "kill-decode", "stop-decode", "nothing")
BEFORE_SECONDS = 5.0  # the level an event is compared with
WATCH_SECONDS = 30.0  # the longest a recovery is waited for
AFTER_SECONDS = 10.0  # the level after an event: the watch's last seconds
RESTART_SECONDS = 120.0  # the longest a killed service may take to be up again
RESTART_DELAY_SECONDS = 1.0  # a killed service starts again this long after the kill
LEASE_TTL_SECONDS = 30.0  # decode's default --lease-ttl-seconds
# TinyGPT, as the docstring says: the figures are about the stack's recovery, not the model.
SERVICE_FLAGS = ("--torch-threads", "1", "--model", "tinygpt")
RECHECK = 8  # completed requests per event run again to compare their tokens


@dataclass
class Finished:
    prompt: list[int]
    max_tokens: int
    tokens: list[int]
    status: str  # "OK" or the gRPC status name
    started: float
    ended: float


@dataclass
class Load:
    """The steady clients: every token's arrival time, every finished request."""

    arrivals: list[float] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tokens_per_s(self, start: float, end: float) -> float:
        with self.lock:
            return sum(1 for t in self.arrivals if start <= t < end) / (end - start)


class Stack:
    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.prefills = [start_service("prefill", *SERVICE_FLAGS, tmp_dir=tmp) for _ in range(2)]
        self.decodes = [start_service("decode", *SERVICE_FLAGS, tmp_dir=tmp) for _ in range(2)]
        self.router = start_router(self.prefills, self.decodes, "--model", "tinygpt", tmp_dir=tmp)
        self.channel = grpc.insecure_channel(self.router.address)
        self.stub = pb_grpc.RouterServiceStub(self.channel)
        self.dead: set[int] = set()  # pids killed whose new processes are not up yet
        self.restarting: threading.Thread | None = None
        self.restarted_after: float | None = None  # seconds from the last kill
        self.restart_failed: BaseException | None = None

    def kill_and_restart(self, group: list[Service], index: int) -> float:
        """SIGKILLs group[index] and returns when it died. It starts again on its port 1 s
        later, in a thread: the watch starts at the kill, not once the new process is up."""
        old = group[index]
        old.stop(signal.SIGKILL)
        at = time.monotonic()
        self.dead.add(old.proc.pid)
        self.restarted_after = None

        def restart() -> None:
            time.sleep(RESTART_DELAY_SECONDS)
            try:
                group[index] = start_service(
                    old.role, *SERVICE_FLAGS, tmp_dir=self.tmp, port=old.port
                )
                self.restarted_after = time.monotonic() - at
            except BaseException as exc:  # handed to wait_restarted, in the main thread
                self.restart_failed = exc
            finally:
                self.dead.discard(old.proc.pid)

        self.restarting = threading.Thread(target=restart, name="restart", daemon=True)
        self.restarting.start()
        return at

    def wait_restarted(self) -> None:
        """Until the last killed process is up again; raises if it could not start."""
        if self.restarting is not None:
            self.restarting.join(RESTART_SECONDS)
            if self.restarting.is_alive():
                raise RuntimeError(f"a killed service was not up {RESTART_SECONDS:g} s later")
            self.restarting = None
        if self.restart_failed is not None:
            raise self.restart_failed

    def used_blocks(self) -> int | None:
        """Blocks in use over both decodes; None while one does not answer. A killed decode
        whose new process is not up yet holds none: its memory went with it."""
        used = 0
        for decode in self.decodes:
            if decode.proc.pid in self.dead:
                continue
            try:
                with grpc.insecure_channel(decode.address) as channel:
                    stub = pb_grpc.DecodeServiceStub(channel)
                    s = stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=1)
            except grpc.RpcError:
                return None
            used += s.total_blocks - s.free_blocks
        return used

    def stop(self) -> None:
        if self.restarting is not None:
            self.restarting.join(RESTART_SECONDS)  # so that the process it starts is stopped
        self.channel.close()
        for service in (self.router, *self.prefills, *self.decodes):
            service.stop()


def request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


def run_one(stub, prompt: list[int], max_tokens: int, load: Load | None) -> Finished:
    started, tokens, status = time.monotonic(), [], "OK"
    try:
        for response in stub.Generate(request(prompt, max_tokens), timeout=120):
            tokens += response.token_ids
            if load is not None:
                with load.lock:
                    load.arrivals += [time.monotonic()] * len(response.token_ids)
    except grpc.RpcError as exc:
        status = exc.code().name
    return Finished(prompt, max_tokens, tokens, status, started, time.monotonic())


def client(stub, load: Load, tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    while not load.stop.is_set():
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(64, 200))]
        done = run_one(stub, prompt, tokens, load)
        with load.lock:
            load.finished.append(done)


def cancel_storm(stack: Stack, count: int, rng: random.Random) -> None:
    """`count` requests at once, each cancelled 0-1.5 s after it was sent."""
    calls = [stack.stub.Generate(request([rng.randrange(1, 256)] * 200, 200)) for _ in range(count)]
    sent = time.monotonic()
    delays = [rng.uniform(0, 1.5) for _ in calls]
    for delay, call in sorted(zip(delays, calls), key=lambda pair: pair[0]):
        time.sleep(max(0.0, sent + delay - time.monotonic()))
        call.cancel()


def cause(stack: Stack, event: str, args, rng: random.Random) -> float:
    """Makes the event happen; returns when it happened (time.monotonic)."""
    if event == "nothing":
        return time.monotonic()
    if event == "cancel-storm":
        cancel_storm(stack, args.storm, rng)
        return time.monotonic()
    if event == "stop-decode":
        victim = stack.decodes[0].proc.pid
        os.kill(victim, signal.SIGSTOP)
        at = time.monotonic()
        time.sleep(args.stop_seconds)
        os.kill(victim, signal.SIGCONT)
        return at
    return stack.kill_and_restart(stack.prefills if event == "kill-prefill" else stack.decodes, 0)


def first_time(condition, start: float, limit: float) -> float | None:
    """Seconds from `start` until `condition()` holds, polled; None if not within `limit`."""
    while time.monotonic() - start < limit:
        if condition():
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def settle(stack: Stack, load: Load) -> None:
    """Before an event's level is taken: every decode answering and two 1 s windows of the
    clients' tokens/s within 10% of each other, so that the last event (a restarted process
    warming up, requests moved by a migration) no longer weighs on the level."""
    windows: list[float] = []

    def steady() -> bool:
        time.sleep(1.0)
        t = time.monotonic()
        windows.append(load.tokens_per_s(t - 1.0, t))
        a, b = windows[-2:] if len(windows) >= 2 else (0.0, 1.0)
        return stack.used_blocks() is not None and abs(a - b) <= 0.1 * max(a, b)

    first_time(steady, time.monotonic(), WATCH_SECONDS)


def one_event(stack: Stack, load: Load, event: str, args, rng) -> dict:
    stack.wait_restarted()  # the last event's killed process
    settle(stack, load)
    time.sleep(BEFORE_SECONDS)
    now = time.monotonic()
    level = load.tokens_per_s(now - BEFORE_SECONDS, now)
    used = [u for _ in range(10) if (u := stack.used_blocks()) is not None]
    blocks_limit = statistics.median(used) * 1.1 + 1
    at = cause(stack, event, args, rng)
    blocks = first_time(
        lambda: (u := stack.used_blocks()) is not None and u <= blocks_limit, at, WATCH_SECONDS
    )
    time.sleep(max(0.0, at + WATCH_SECONDS - time.monotonic()))  # the watch, whole
    rates = Rates(load, at)
    after = rates.per_s(at + WATCH_SECONDS - AFTER_SECONDS, at + WATCH_SECONDS)
    stack.wait_restarted()
    return {
        "at": at,
        "level_tokens_per_s": level,
        "level_after_tokens_per_s": after,
        "after_over_before": after / level if level else None,
        "blocks_back_s": blocks,
        "throughput_back_s": rates.back_within_10_percent_of(level),
        "throughput_back_to_after_s": rates.back_within_10_percent_of(after),
        # how long the killed process took to be up again, for comparison
        "restarted_s": stack.restarted_after if event.startswith("kill-") else None,
    }


class Rates:
    """The clients' tokens/s over the watch after an event, from their tokens' arrival times."""

    def __init__(self, load: Load, at: float) -> None:
        self.at = at
        with load.lock:  # sorted: the clients' threads append them nearly, not exactly, in order
            self.times = sorted(t for t in load.arrivals if at - 1.0 <= t <= at + WATCH_SECONDS)

    def per_s(self, start: float, end: float) -> float:
        return (bisect.bisect_left(self.times, end) - bisect.bisect_left(self.times, start)) / (
            end - start
        )

    def back_within_10_percent_of(self, level: float) -> float | None:
        """Seconds from the event until two 1 s windows running are within 10% of `level`
        (the first window starting at the event at the earliest), in 0.1 s steps; None if
        not within the watch."""
        for step in range(20, int(WATCH_SECONDS * 10) + 1):
            t = self.at + step / 10
            if all(abs(self.per_s(t - w - 1.0, t - w) - level) <= 0.1 * level for w in (0, 1)):
                return step / 10
        return None


def accounting(stack: Stack, load: Load, rows: list[dict]) -> None:
    """Adds each event's lost, missing, duplicated and changed requests to its row."""
    for row in rows:
        during = [f for f in load.finished if f.started <= row["at"] + 1.0 and f.ended >= row["at"]]
        ok = [f for f in during if f.status == "OK"]
        row["in_flight"] = len(during)
        row["failed_with_status"] = len(during) - len(ok)
        row["lost"] = sum(1 for f in ok if len(f.tokens) < f.max_tokens)
        row["missing"] = sum(max(0, f.max_tokens - len(f.tokens)) for f in ok)
        row["duplicated"] = sum(max(0, len(f.tokens) - f.max_tokens) for f in ok)
        with ThreadPoolExecutor(RECHECK) as pool:  # run again together: one batch, not 24 waits
            again = list(
                pool.map(lambda f: run_one(stack.stub, f.prompt, f.max_tokens, None), ok[:RECHECK])
            )
        row["changed"] = sum(1 for f, a in zip(ok, again) if f.tokens != a.tokens)
        row["rechecked"] = len(again)


def summary(rows: list[dict]) -> dict:
    out = {}
    for event in EVENTS:
        mine = [r for r in rows if r["event"] == event]
        out[event] = {"repeats": len(mine)}
        for key in ("blocks_back_s", "throughput_back_s", "throughput_back_to_after_s"):
            values = [r[key] for r in mine if r[key] is not None]
            out[event][key] = {
                "p50": percentile(values, 50),
                "p99": percentile(values, 99),
                "not_back": len(mine) - len(values),
            }
        kept = [r["after_over_before"] for r in mine if r["after_over_before"] is not None]
        out[event]["after_over_before"] = {
            "min": min(kept, default=None),
            "median": statistics.median(kept) if kept else None,
            "max": max(kept, default=None),
        }
        for key in ("lost", "missing", "duplicated", "changed", "failed_with_status"):
            out[event][key] = sum(r[key] for r in mine)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--storm", type=int, default=200)
    p.add_argument("--stop-seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS / "recovery.json"))
    args = p.parse_args()
    stack, load, rng = (
        Stack(tempfile.mkdtemp(prefix="pdserve-recovery-")),
        Load(),
        random.Random(args.seed),
    )
    pool = ThreadPoolExecutor(args.streams)
    rows: list[dict] = []
    try:
        for i in range(args.streams):
            pool.submit(client, stack.stub, load, args.tokens, args.seed + i)
        # Warm: as many requests finished as there are clients, before any level is taken.
        first_time(lambda: len(load.finished) >= args.streams, time.monotonic(), 120)
        for repeat in range(args.repeats):
            for event in EVENTS:
                row = {"event": event, "repeat": repeat, **one_event(stack, load, event, args, rng)}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "at"}, flush=True)
        load.stop.set()
        pool.shutdown(wait=True)
        accounting(stack, load, rows)
        free_at_end = first_time(
            lambda: stack.used_blocks() == 0, time.monotonic(), LEASE_TTL_SECONDS
        )
    finally:
        load.stop.set()
        stack.stop()
    result = summary(rows)
    print(result, f"every block free {free_at_end} s after the load stopped")
    conditions = {
        "model": "tinygpt (float32)",
        "topology": "router + 2 prefill + 2 decode on loopback, 1 torch thread each",
        "streams": args.streams,
        "output_tokens": args.tokens,
        "prompt_tokens": "64-200",
        "storm": args.storm,
        "stop_seconds": args.stop_seconds,
        "repeats": args.repeats,
        "seed": args.seed,
        "before_seconds": BEFORE_SECONDS,
        "watch_seconds": WATCH_SECONDS,
        "after_seconds": AFTER_SECONDS,
        "restart_delay_seconds": RESTART_DELAY_SECONDS,
    }
    for row in rows:
        row.pop("at")
    write_results(args.out, conditions, summary=result, rows=rows, free_at_end_seconds=free_at_end)


if __name__ == "__main__":
    main()
