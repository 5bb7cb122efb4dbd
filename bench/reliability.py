"""Reliability under failure: a steady load while a decode instance is killed and restarted.

Runs router + prefill + two decode instances on loopback, sends Poisson arrivals for a fixed time,
and every --kill-every seconds SIGKILLs decode #0 and restarts it --down-for seconds later. Every
request ends in exactly one bucket: completed (all its tokens), failed with a clear status, hung
(no answer within its deadline plus a margin) or lost (never accounted for). Afterwards it checks
both decode pools for leaked blocks. Hung, lost and leaked must all be 0.

  .venv/bin/python bench/reliability.py --duration 60 --json bench/results/reliability.json
"""

import argparse
import datetime
import json
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import grpc

from pdserve.localstack import start_router, start_service, wait_until
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

DEADLINE_SECONDS = 30.0
HUNG_MARGIN_SECONDS = 10.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills")
    p.add_argument("--down-for", type=float, default=2.0, help="seconds a killed decode stays down")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", help="write the result here")
    return p.parse_args(argv)


class Outcomes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_status: dict[str, int] = {}
        self.completed = self.hung = self.sent = 0

    def add(self, outcome: str) -> None:
        with self.lock:
            if outcome == "OK":
                self.completed += 1
            elif outcome == "HUNG":
                self.hung += 1
            else:
                self.by_status[outcome] = self.by_status.get(outcome, 0) + 1


def one_request(stub, rng_seed: int, outcomes: Outcomes) -> None:
    rng = random.Random(rng_seed)
    prompt = [rng.randrange(256) for _ in range(rng.randint(64, 256))]
    max_tokens = rng.randint(16, 48)
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    started = time.monotonic()
    try:
        n = sum(len(r.token_ids) for r in stub.Generate(request, timeout=DEADLINE_SECONDS))
        outcomes.add("OK" if n == max_tokens else "SHORT")
    except grpc.RpcError as exc:
        late = time.monotonic() - started > DEADLINE_SECONDS
        outcomes.add(
            "HUNG" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or late else exc.code().name
        )


def kill_and_restart(decode, tmp_dir: str, args, stop: threading.Event, log: list) -> None:
    while not stop.wait(args.kill_every):
        decode[0].stop(signal.SIGKILL)
        log.append({"t": time.monotonic(), "event": "killed decode 0"})
        if stop.wait(args.down_for):
            return
        decode[0] = start_service(
            "decode", "--torch-threads", "1", tmp_dir=tmp_dir, port=decode[0].port
        )
        log.append({"t": time.monotonic(), "event": "restarted decode 0"})


def run(args) -> dict:
    tmp_dir = tempfile.mkdtemp(prefix="pdserve-reliability-")
    decodes = [start_service("decode", "--torch-threads", "1", tmp_dir=tmp_dir) for _ in range(2)]
    prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp_dir)
    router = start_router([prefill], decodes, tmp_dir=tmp_dir)
    victim = [decodes[0]]
    outcomes, events, stop = Outcomes(), [], threading.Event()
    killer = threading.Thread(
        target=kill_and_restart, args=(victim, tmp_dir, args, stop, events), daemon=True
    )
    channel = grpc.insecure_channel(router.address)
    stub = pb_grpc.RouterServiceStub(channel)
    rng = random.Random(args.seed)
    start = time.monotonic()
    try:
        killer.start()
        with ThreadPoolExecutor(256) as pool:
            futures = []
            next_at = start
            while next_at < start + args.duration:
                time.sleep(max(0.0, next_at - time.monotonic()))
                futures.append(pool.submit(one_request, stub, rng.randrange(1 << 30), outcomes))
                next_at += rng.expovariate(args.rate)
            stop.set()
            done, not_done = wait(futures, DEADLINE_SECONDS + HUNG_MARGIN_SECONDS)
        killer.join(60)
        leaked = leaked_blocks([victim[0], decodes[1]])
    finally:
        stop.set()
        channel.close()
        for service in (router, prefill, victim[0], decodes[1]):
            service.stop()
    sent = len(futures)
    failed = sum(outcomes.by_status.values())
    lost = sent - outcomes.completed - failed - outcomes.hung - len(not_done)
    return {
        "sent": sent,
        "completed": outcomes.completed,
        "failed_with_status": failed,
        "failed_by_status": outcomes.by_status,
        "hung": outcomes.hung + len(not_done),
        "lost": lost,
        "leaked_blocks": leaked,
        "kills": sum(1 for e in events if e["event"].startswith("killed")),
        "conditions": {
            "duration_s": args.duration,
            "rate_per_s": args.rate,
            "kill_every_s": args.kill_every,
            "down_for_s": args.down_for,
            "seed": args.seed,
            "deadline_s": DEADLINE_SECONDS,
            "workload": "Poisson, prompt 64-256 tokens, output 16-48, ignore_eos",
            "topology": "router + 1 prefill + 2 decode on loopback, decode 0 killed",
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
    }


def leaked_blocks(decodes) -> int:
    """Blocks still held once every request has ended (waiting, bounded, for them to settle)."""

    def held() -> int:
        total = 0
        for decode in [d for d in decodes if d.proc.poll() is None]:
            with grpc.insecure_channel(decode.address) as ch:
                s = pb_grpc.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
                total += s.total_blocks - s.free_blocks
        return total

    try:
        wait_until(lambda: held() == 0, 15, "pools to settle")
    except AssertionError:
        pass
    return held()


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = result["hung"] == 0 and result["lost"] == 0 and result["leaked_blocks"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
