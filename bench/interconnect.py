"""The handoff table, measured: prefill and decode on two hosts joined by a link of known speed.

Creates two network namespaces joined by a veth pair (addresses from 198.18.0.0/15, the range
RFC 2544 sets aside for benchmarks; they exist only inside these namespaces), shapes the link with
`tc` (a token bucket at each rate, both directions), runs the router and prefill in one namespace and
decode in the other, and sends prompts of several lengths one at a time. For each it records the
measured handoff latency (prefill side: first KV chunk sent to decode's commit reply) against the
prediction bytes / rate, and the time to first token against the prefill's compute time. (Only
the rate is shaped: this machine's kernel has no netem, so no delay is added; a veth round trip is
tens of microseconds.) All
traffic stays inside the namespaces; both are deleted on exit. Needs root and iproute2.

  sudo .venv/bin/python bench/interconnect.py --json bench/results/interconnect.json --plot bench/results/interconnect.png
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

from pdserve.core.config import ModelConfig
from pdserve.localstack import free_port

ADDR_A, ADDR_B = "198.18.0.1", "198.18.0.2"
RATES = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9, "unshaped": None}
# How prefill sends the KV: its flags. Decode offers its TCP data plane in every one.
VARIANTS = {
    "tcp": (),
    "grpc": ("--kv-transport", "grpc"),
    "tcp-int8": ("--kv-compression", "int8"),
}
START_TIMEOUT_SECONDS = 90.0


class Link:
    """Two namespaces and a shaped veth between them; removed by close()."""

    def __init__(self, tag: str) -> None:
        self.ns_a, self.ns_b = f"pdA{tag}", f"pdB{tag}"
        self.dev_a, self.dev_b = f"pdva{tag}", f"pdvb{tag}"
        for ns in (self.ns_a, self.ns_b):
            _run("ip", "netns", "add", ns)
            self.exec_in(ns, "ip", "link", "set", "lo", "up")
        _run(
            "ip",
            "link",
            "add",
            self.dev_a,
            "netns",
            self.ns_a,
            "type",
            "veth",
            "peer",
            "name",
            self.dev_b,
            "netns",
            self.ns_b,
        )
        for ns, dev, addr in ((self.ns_a, self.dev_a, ADDR_A), (self.ns_b, self.dev_b, ADDR_B)):
            self.exec_in(ns, "ip", "addr", "add", f"{addr}/30", "dev", dev)
            self.exec_in(ns, "ip", "link", "set", dev, "up")

    def exec_in(self, ns: str, *cmd: str) -> None:
        _run("ip", "netns", "exec", ns, *cmd)

    def shape(self, rate_bps: float | None) -> None:
        """A token bucket at `rate_bps` on both ends (None: unshaped)."""
        for ns, dev in ((self.ns_a, self.dev_a), (self.ns_b, self.dev_b)):
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
            )
            if rate_bps:
                # Burst of at least one timer tick's worth of bytes, or tbf cannot reach the rate.
                burst = max(int(rate_bps / 8 / 100), 64 * 1024)
                self.exec_in(
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{int(rate_bps)}bit",
                    "burst",
                    str(burst),
                    "latency",
                    "2s",
                )

    def close(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def start_in(
    ns: str, log_dir: str, role: str, port: int, *flags: str, log_name: str = ""
) -> subprocess.Popen:
    log = open(os.path.join(log_dir, f"{log_name or role}.log"), "w")
    cmd = [
        "ip",
        "netns",
        "exec",
        ns,
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        role,
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--torch-threads",
        "1",
        "--model",
        "tinygpt",  # what conditions() reports
        # Plaintext beyond loopback, on purpose: the link joins two namespaces this script made.
        "--insecure",
        *flags,
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_serving(ns: str, port: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a service exited during start-up")
        ok = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "pdserve.cli",
                "health",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"service on port {port} in {ns} not serving in time")


def probe(address: str, lengths: list[int], reps: int) -> list[dict]:
    """Runs inside namespace A: one request at a time, returns each one's server metrics."""
    import grpc

    from pdserve.v1 import pdserve_pb2 as pb
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        for n in lengths:
            for rep in range(reps + 1):  # the first of each length warms up and is dropped
                request = pb.GenerateRequest(
                    prompt_token_ids=[(i * 7 + rep) % 256 for i in range(n)],
                    sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True),
                )
                last = list(stub.Generate(request, timeout=300))[-1]
                if rep:
                    m = last.metrics
                    rows.append(
                        {
                            "prompt_tokens": n,
                            "handoff_bytes": m.handoff.bytes,
                            "wire_bytes": m.handoff.wire_bytes,
                            "transport": m.handoff.transport,
                            "handoff_s": m.handoff.seconds,
                            "exposed_s": m.handoff.exposed_seconds,
                            "ttft_s": m.time_to_first_token_seconds,
                            "prefill_s": m.prefill_seconds,
                        }
                    )
    return rows


def measure(rates: list[str], lengths: list[int], reps: int, variants: list[str]) -> list[dict]:
    link = Link(str(os.getpid() % 100000))
    try:
        rows = []
        for variant in variants:
            rows += _measure_variant(link, variant, rates, lengths, reps)
        return rows
    finally:
        link.close()


def _measure_variant(
    link: Link, variant: str, rates: list[str], lengths: list[int], reps: int
) -> list[dict]:
    """A fresh stack with the variant's prefill flags, probed at every rate."""
    procs: list[subprocess.Popen] = []
    log_dir = os.environ.get("PDSERVE_BENCH_LOGS", "/tmp")
    try:
        decode_port, prefill_port = start_decode_and_prefill(
            link, log_dir, procs, *VARIANTS[variant]
        )
        router_port = free_port()
        procs.append(
            start_in(
                link.ns_a,
                log_dir,
                "router",
                router_port,
                "--prefill",
                f"127.0.0.1:{prefill_port}",
                "--decode",
                f"{ADDR_B}:{decode_port}",
            )
        )
        wait_serving(link.ns_a, router_port, procs)
        rows = []
        for name in rates:
            link.shape(RATES[name])
            for row in _probe_in(link, router_port, lengths, reps):
                rate = RATES[name]
                row.update(
                    variant=variant,
                    link=name,
                    rate_bps=rate,
                    predicted_s=row["wire_bytes"] * 8 / rate if rate else None,
                )
                rows.append(row)
        return rows
    finally:
        stop_all(procs)


def start_decode_and_prefill(
    link: Link, log_dir: str, procs: list[subprocess.Popen], *prefill_flags: str
) -> tuple[int, int]:
    """Decode on the far side of the link, prefill on this side allowed to send it KV; both
    appended to `procs` as they start. Returns (decode port, prefill port)."""
    decode_port, prefill_port = free_port(), free_port()
    procs.append(start_in(link.ns_b, log_dir, "decode", decode_port))
    allow = ("--decode-allow", f"{ADDR_B}:{decode_port}")
    procs.append(start_in(link.ns_a, log_dir, "prefill", prefill_port, *allow, *prefill_flags))
    return decode_port, prefill_port


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def _probe_in(link: Link, router_port: int, lengths: list[int], reps: int) -> list[dict]:
    out = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            link.ns_a,
            sys.executable,
            __file__,
            "--probe",
            f"127.0.0.1:{router_port}",
            "--lengths",
            *map(str, lengths),
            "--reps",
            str(reps),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return json.loads(out.stdout)


def conditions(args) -> dict:
    config = ModelConfig()
    return {
        "model": "TinyGPT (random weights)",
        "kv_bytes_per_token": config.kv_bytes_per_token,
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "grpcio": _version("grpcio"),
        "link": "veth between two network namespaces, tc tbf rate both ways, no added delay",
        "prompt_lengths": args.lengths,
        "reps": args.reps,
        "variants": {name: list(VARIANTS[name]) for name in args.variants},
        "output_tokens": 2,
        "requests": "one at a time",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.machine()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def summarize(rows: list[dict]) -> str:
    lines = [
        f"{'variant':>8} {'link':>9} {'tokens':>6} {'KV MiB':>7} {'wire MiB':>8} "
        f"{'predicted':>10} {'measured':>10} "
        f"{'ratio':>6} {'prefill':>8} {'exposed':>8} {'TTFT':>8}"
    ]
    for r in rows:
        pred = f"{r['predicted_s'] * 1e3:8.1f}ms" if r["predicted_s"] else f"{'-':>10}"
        ratio = f"{r['handoff_s'] / r['predicted_s']:6.2f}" if r["predicted_s"] else f"{'-':>6}"
        lines.append(
            f"{r.get('variant', 'tcp'):>8} {r['link']:>9} {r['prompt_tokens']:>6} "
            f"{r['handoff_bytes'] / 2**20:7.2f} {r.get('wire_bytes', r['handoff_bytes']) / 2**20:8.2f} "
            f"{pred} {r['handoff_s'] * 1e3:8.1f}ms {ratio} "
            f"{r['prefill_s'] * 1e3:6.1f}ms {r['exposed_s'] * 1e3:6.1f}ms "
            f"{r['ttft_s'] * 1e3:6.1f}ms"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    first = rows[0].get("variant", "tcp")  # one variant per chart: the first measured
    rows = [r for r in rows if r.get("variant", "tcp") == first]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for color, name in zip(("C0", "C1", "C2", "C3"), dict.fromkeys(r["link"] for r in rows)):
        sel = [r for r in rows if r["link"] == name]
        mib = [r["handoff_bytes"] / 2**20 for r in sel]
        left.plot(
            mib,
            [r["handoff_s"] * 1e3 for r in sel],
            "o",
            color=color,
            label=f"{name}: first chunk to commit",
        )
        left.plot(
            mib,
            [r["exposed_s"] * 1e3 for r in sel],
            "x",
            color=color,
            label=f"{name}: exposed (after compute)",
        )
        if sel[0]["predicted_s"]:
            left.plot(
                mib,
                [r["predicted_s"] * 1e3 for r in sel],
                "-",
                color=color,
                alpha=0.5,
                label=f"{name}: bytes / rate",
            )
        right.plot(
            [r["prefill_s"] * 1e3 for r in sel],
            [r["ttft_s"] * 1e3 for r in sel],
            "o",
            color=color,
            label=name,
        )
    left.set(
        xscale="log",
        yscale="log",
        xlabel="KV cache per request (MiB)",
        ylabel="handoff latency (ms)",
        title="Handoff: measured vs bytes / link rate",
    )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="prefill compute (ms)",
        ylabel="time to first token (ms)",
        title="A slow link turns prefill into a stall",
    )
    lims = [min(r["prefill_s"] for r in rows) * 1e3, max(r["ttft_s"] for r in rows) * 1e3]
    right.plot(lims, lims, "k--", alpha=0.3, label="TTFT = prefill")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", nargs="+", default=list(RATES), choices=list(RATES))
    p.add_argument("--lengths", nargs="+", type=int, default=[64, 256, 1024, 2048])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["tcp"], choices=list(VARIANTS))
    p.add_argument("--json", help="write rows and conditions here")
    p.add_argument("--plot", help="write a PNG chart here")
    p.add_argument("--probe", metavar="ROUTER", help=argparse.SUPPRESS)
    p.add_argument("--replot", metavar="JSON", help="only redraw --plot from a saved --json")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["rows"], args.plot)
        return 0
    if args.probe:
        print(json.dumps(probe(args.probe, args.lengths, args.reps)))
        return 0
    rows = measure(args.rates, args.lengths, args.reps, args.variants)
    print(summarize(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions(args), "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
