"""`pdserve up`: prefill, decode and router as local processes on loopback.

Ctrl-C (or SIGTERM) stops all three: each gets SIGTERM and drains; any still running after the
grace period is killed.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from pdserve.client import check_health
from pdserve.localstack import free_port
from pdserve.settings import (
    DEFAULT_PORTS,
    CommonSettings,
    DecodeSettings,
    RouterSettings,
    add_flags,
    as_flags,
)

READY_TIMEOUT_SECONDS = 120.0


# Settings `pdserve up` hands on to every service it starts; their flags come from pdserve.settings.
SHARED_SETTINGS = ("model", "dtype", "weights", "numerics", "q4_kernel", "step_ops")
ROLES = ("prefill", "decode", "router")


def add_up(sub) -> None:
    p = sub.add_parser("up", help="run prefill, decode and router as local processes")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORTS["router"],
        help="router port, 0 picks a free one (default %(default)s)",
    )
    p.add_argument("--prefill-port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--decode-port", type=int, default=0, help="0 picks a free port")
    add_flags(
        p.add_argument_group("model", "handed on to every service"),
        CommonSettings,
        only=SHARED_SETTINGS,
    )
    add_flags(p, DecodeSettings, only=("num_blocks",))
    add_flags(p, RouterSettings, only=("http_port",))
    g = p.add_argument_group(
        "placement",
        "which CPUs each service runs on (Linux CPU lists, e.g. 0 or 0-1,3). By default prefill "
        "and decode get their own halves of the CPUs this command may use (decode the larger), "
        "and the router shares prefill's: a long prompt then never takes a core from the "
        "streams decoding. A flag given here replaces its role's default",
    )
    for role in ROLES:
        g.add_argument(f"--{role}-cpus", default="", help=f"CPUs of the {role} service")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch threads for prefill and for decode each; 0 (default): one per CPU "
        "the service runs on",
    )
    p.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        help="serve Prometheus metrics: router on this port, prefill on +1, decode on +2 (0: none)",
    )
    p.add_argument(
        "--demo",
        metavar="PROMPT",
        help="send this prompt once ready, print the reply, then stop everything",
    )
    p.add_argument(
        "--demo-tokens", type=int, default=48, help="reply length of the demo (default %(default)s)"
    )
    p.set_defaults(func=run_up)


def stack_commands(
    router_port: int,
    prefill_port: int,
    decode_port: int,
    num_blocks: int,
    torch_threads: int,
    metrics_base_port: int = 0,
    shared: Sequence[str] = (),
    cpus: dict[str, str] | None = None,
    router_flags: Sequence[str] = (),
) -> dict[str, list[str]]:
    """Each service's command line; `shared` (--model, --dtype) goes to all three, `cpus` maps a
    role to its CPU list, `router_flags` go to the router alone."""
    base = [sys.executable, "-m", "pdserve.cli", "serve"]
    loopback = ["--host", "127.0.0.1", *shared]
    cpus = cpus or {}

    def placed(role: str) -> list[str]:
        where = ["--cpus", cpus[role]] if cpus.get(role) else []
        return where + (["--torch-threads", str(torch_threads)] if role != "router" else [])

    def metrics(offset: int) -> list[str]:
        return ["--metrics-port", str(metrics_base_port + offset)] if metrics_base_port else []

    return {
        "decode": base
        + [
            "decode",
            *loopback,
            "--port",
            str(decode_port),
            *placed("decode"),
            "--num-blocks",
            str(num_blocks),
            *metrics(2),
        ],
        # Prefill sends KV to this stack's decode and nowhere else: without a list it would
        # dial any loopback port a Prefill call names, and any local user can call it.
        "prefill": base
        + ["prefill", *loopback, "--port", str(prefill_port), *placed("prefill"), *metrics(1)]
        + ["--decode-allow", f"127.0.0.1:{decode_port}"],
        "router": base
        + [
            "router",
            *loopback,
            "--port",
            str(router_port),
            *placed("router"),
            "--prefill",
            f"127.0.0.1:{prefill_port}",
            "--decode",
            f"127.0.0.1:{decode_port}",
            *metrics(0),
            *router_flags,
        ],
    }


def default_placement(cpus: set[int]) -> dict[str, str]:
    """Prefill on the lower half of `cpus`, decode on the rest, the router beside prefill; on a
    single CPU all three share it."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return {role: ",".join(map(str, ordered)) for role in ROLES}
    half = len(ordered) // 2
    prefill, decode = ordered[:half], ordered[half:]
    listed = {"prefill": prefill, "decode": decode, "router": prefill}
    return {role: ",".join(map(str, on)) for role, on in listed.items()}


def placement(args) -> dict[str, str]:
    """Each role's CPU list: its --ROLE-cpus flag, else the default split."""
    split = default_placement(os.sched_getaffinity(0))
    return {role: getattr(args, f"{role}_cpus") or split[role] for role in ROLES}


def _ports(*given: int) -> list[int]:
    """Each given port as it is, and for each 0 a free port that none of the others is: a port
    free now (given, or chosen, but not yet listened on) may come back from free_port()."""
    ports: list[int] = []
    for port in given:
        while not port:
            candidate = free_port()
            if candidate not in given and candidate not in ports:
                port = candidate
        ports.append(port)
    return ports


def _interrupt(signum, frame) -> None:
    """SIGTERM to `pdserve up` stops the stack the way Ctrl-C does."""
    raise KeyboardInterrupt


def run_up(args) -> int:
    # A bad --model or --dtype is one error here (exit 2), not three failed start-ups; a GGUF is
    # converted here once rather than by three services at the same time.
    shared = {name: getattr(args, name) for name in SHARED_SETTINGS}
    CommonSettings(**shared)
    from pdserve.kernels import native
    from pdserve.models.loading import load_served_model

    served = load_served_model(
        args.model,
        args.dtype,
        weights=False,
        weight_format=args.weights,
        numerics=args.numerics,
        q4_kernel=args.q4_kernel,
        step_ops=args.step_ops,
    )
    if "native" in (served.config.q4_kernel, served.config.step_ops):
        native.ensure_built()  # here once, not by two services at the same time
    print(f"model: {served.identity}", flush=True)
    args.port, args.prefill_port, args.decode_port = _ports(
        args.port, args.prefill_port, args.decode_port
    )
    cpus = placement(args)
    threads = args.torch_threads or "one per CPU"
    where = ", ".join(f"{role} on CPUs {cpus[role]}" for role in ROLES)
    print(f"placement: {where}; torch threads: {threads}", flush=True)
    commands = stack_commands(
        args.port,
        args.prefill_port,
        args.decode_port,
        args.num_blocks,
        args.torch_threads,
        args.metrics_base_port,
        as_flags(CommonSettings, args, SHARED_SETTINGS),
        cpus,
        as_flags(RouterSettings, args, ("http_port",)),
    )
    procs = {name: subprocess.Popen(cmd) for name, cmd in commands.items()}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if not _wait_ready(f"127.0.0.1:{args.port}", procs):
            return 1
        http = f", OpenAI API on http://127.0.0.1:{args.http_port}/v1" if args.http_port else ""
        print(f"pdserve is up: router on 127.0.0.1:{args.port}{http} (Ctrl-C stops it)", flush=True)
        if args.demo:
            return _demo(args, chat=served.tokenizer.has_chat_template)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        print("a service exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(procs)


def _wait_ready(address: str, procs: dict[str, subprocess.Popen]) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            print(f"{', '.join(dead)} exited during start-up", file=sys.stderr)
            return False
        if check_health(address, timeout=1.0):
            return True
        time.sleep(0.2)
    print(f"router not serving after {READY_TIMEOUT_SECONDS:.0f} s", file=sys.stderr)
    return False


def _demo(args, chat: bool) -> int:
    """One greedy request; a chat turn where the model has a chat template."""
    from pdserve.client import run_generate

    print(f"demo {'question' if chat else 'prompt'}: {args.demo!r}", flush=True)
    demo = argparse.Namespace(
        prompt=args.demo,
        chat=chat,
        system=None,
        address=f"127.0.0.1:{args.port}",
        max_tokens=args.demo_tokens,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        stop=[],
        ignore_eos=False,
        timeout=120.0,
    )
    return run_generate(demo)


def stop_all(procs: dict[str, subprocess.Popen], grace: float = 15.0) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
