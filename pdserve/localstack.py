"""Real pdserve processes on free loopback ports: started, health-checked, stopped.

Used by the tests, the benchmarks and anything else that needs a local stack it controls.
"""

import os
import signal
import socket
import subprocess
import threading
import sys
import time
from dataclasses import dataclass

import grpc

from pdserve.client import check_health
from pdserve.rpc.tls import Tls, target_name_option

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0


_handed_out: set[int] = set()  # every port free_port() has answered in this process
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never answered before in this process: a port handed out
    may not be listened on yet, and the kernel can offer it again to the next caller."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


@dataclass
class Service:
    role: str
    port: int
    proc: subprocess.Popen
    log_path: str
    http_port: int = 0  # a router's (or colocated engine's) HTTP API; 0: none

    @property
    def http_url(self) -> str:
        """The base URL of a router's OpenAI-compatible API (what the openai SDK calls base_url)."""
        assert self.http_port, f"{self.role} on {self.address} serves no HTTP API"
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(
    role: str,
    *flags: str,
    tmp_dir: str,
    port: int | None = None,
    faults: str = "",
    ready: bool = True,
) -> Service:
    """Starts `pdserve serve ROLE` and waits (bounded) until its health check says SERVING, or,
    with ready=False, only until it accepts connections (a router whose backends it refuses).

    `faults` sets PDSERVE_FAULTS for this process only (see pdserve/faults.py). Without `port`,
    a free one; if another process takes it (or the router's HTTP port) before the service
    listens (free_port's answer is only true when given), the service exits saying so, and it
    starts again on others.
    """
    for attempt in range(1, BIND_TRIES + 1):
        try:
            return _start_service(role, flags, tmp_dir, port, faults, ready)
        except PortTaken:
            if port is not None or attempt == BIND_TRIES:
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


BIND_TRIES = 3


class PortTaken(RuntimeError):
    """The service exited at start-up because its port was taken."""


def _start_service(
    role: str, flags: tuple[str, ...], tmp_dir: str, port: int | None, faults: str, ready: bool
) -> Service:
    port = port or free_port()
    log_path = os.path.join(tmp_dir, f"{role}-{port}.log")
    http_port = 0
    if role == "router" and "--http-port" not in flags:  # never the fixed default: tests overlap
        http_port = free_port()
        flags = (*flags, "--http-port", str(http_port))
    elif "--http-port" in flags:
        http_port = int(flags[flags.index("--http-port") + 1])
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        role,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDSERVE_FAULTS=faults)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    service = Service(role, port, proc, log_path, http_port)
    channel = _health_channel(flags, role)
    up = (
        (lambda: check_health(service.address, 1.0, channel))
        if ready
        else (lambda: _listening(port))
    )
    wait_until(lambda: proc.poll() is not None or up(), START_TIMEOUT_SECONDS, f"{role} to serve")
    if proc.poll() is not None:
        logged = service.log()
        # Its gRPC port (pdserve.rpc.server's message) or its HTTP port was taken meanwhile.
        taken = (
            f"cannot listen on 127.0.0.1:{port}:" in logged or "address already in use" in logged
        )
        raise (PortTaken if taken else RuntimeError)(f"{role} exited during start-up:\n{logged}")
    return service


def _health_channel(flags, role: str):
    """How to reach the service's health check: with the TLS files its flags name, if any, and
    the server verified as `role` (prefill's and decode's certificates name no address)."""
    named = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--tls-")}
    tls = Tls.load(
        named.get("--tls-cert", ""), named.get("--tls-key", ""), named.get("--tls-ca", "")
    )
    if tls is None:
        return grpc.insecure_channel
    options = target_name_option(role) if role in ("router", "prefill", "decode") else None
    return lambda address: grpc.secure_channel(address, tls.channel_credentials(), options=options)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(condition, timeout: float, what: str, interval: float = 0.05):
    """Polls `condition` until it is truthy; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def start_router(
    prefills: list[Service],
    decodes: list[Service],
    *flags: str,
    tmp_dir: str,
    port: int | None = None,
) -> Service:
    return start_service(
        "router",
        "--prefill",
        *[p.address for p in prefills],
        "--decode",
        *[d.address for d in decodes],
        *flags,
        tmp_dir=tmp_dir,
        port=port,
    )


def start_pinned_disaggregated(model: str, tmp_dir: str) -> tuple[Service, list[Service]]:
    """The benchmarks' disaggregated placement on two CPUs: prefill on CPU 0, decode and the
    (light) router on CPU 1. Returns the router and every service started, router first."""
    flags = ("--model", model)
    decode = start_service("decode", *flags, "--cpus", "1", tmp_dir=tmp_dir)
    prefill = start_service("prefill", *flags, "--cpus", "0", tmp_dir=tmp_dir)
    router = start_router([prefill], [decode], *flags, "--cpus", "1", tmp_dir=tmp_dir)
    return router, [router, prefill, decode]
