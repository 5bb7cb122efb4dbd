"""Starting and stopping real pdserve processes on free loopback ports, for tests."""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc

from pdserve.client import check_health
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    role: str
    port: int
    proc: subprocess.Popen
    log_path: str

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


def start_service(role: str, *flags: str, tmp_dir: str, port: int | None = None,
                  faults: str = "") -> Service:
    """Starts `pdserve serve ROLE` and waits (bounded) until its health check says SERVING.

    `faults` sets PDSERVE_FAULTS for this process only (see pdserve/faults.py).
    """
    port = port or free_port()
    log_path = os.path.join(tmp_dir, f"{role}-{port}.log")
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", role, "--host", "127.0.0.1",
           "--port", str(port), *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PDSERVE_FAULTS=faults)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    service = Service(role, port, proc, log_path)
    wait_until(lambda: proc.poll() is not None or check_health(service.address, 1.0),
               START_TIMEOUT_SECONDS, f"{role} to serve")
    if proc.poll() is not None:
        raise RuntimeError(f"{role} exited during start-up:\n{service.log()}")
    return service


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


def start_router(prefills: list[Service], decodes: list[Service], *flags: str, tmp_dir: str,
                 port: int | None = None) -> Service:
    return start_service("router", "--prefill", *[p.address for p in prefills], "--decode",
                         *[d.address for d in decodes], *flags, tmp_dir=tmp_dir, port=port)


@dataclass
class Stack:
    """A router with its prefill and decode instances."""

    router: Service
    prefills: list[Service]
    decodes: list[Service]
    channels: dict = field(default_factory=dict)

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address)
        return self.channels[address]

    def router_stub(self) -> pb_grpc.RouterStub:
        return pb_grpc.RouterStub(self._channel(self.router.address))

    def decode_stub(self, i: int = 0) -> pb_grpc.DecodeStub:
        return pb_grpc.DecodeStub(self._channel(self.decodes[i].address))

    def pool_stats(self, i: int = 0) -> pb.PoolStats:
        return self.decode_stub(i).GetPoolStats(pb.PoolStatsRequest(), timeout=5)

    def pools_settled(self) -> bool:
        """Every live decode instance has all its blocks free and holds nothing."""
        for i, decode in enumerate(self.decodes):
            if decode.proc.poll() is None:
                stats = self.pool_stats(i)
                if stats.free_blocks != stats.total_blocks or stats.running or \
                        stats.pending_leases:
                    return False
        return True

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        for service in [self.router, *self.prefills, *self.decodes]:
            service.stop()


def start_stack(tmp_dir: str, decode_flags=(), prefill_flags=(), router_flags=(),
                decodes: int = 1) -> Stack:
    started: list[Service] = []
    try:
        decode_services = []
        for _ in range(decodes):
            decode_services.append(start_service("decode", "--torch-threads", "1", *decode_flags,
                                                 tmp_dir=tmp_dir))
            started.append(decode_services[-1])
        prefill = start_service("prefill", "--torch-threads", "1", *prefill_flags, tmp_dir=tmp_dir)
        started.append(prefill)
        router = start_service("router", "--prefill", prefill.address, "--decode",
                               *[d.address for d in decode_services], *router_flags,
                               tmp_dir=tmp_dir)
    except BaseException:
        for service in started:
            service.stop(signal.SIGKILL)
        raise
    return Stack(router, [prefill], decode_services)


def generate(stub: pb_grpc.RouterStub, request: pb.GenerateRequest, timeout: float = 60.0):
    """Sends one request; returns (all token ids, all text, the last response)."""
    tokens, text, last = [], [], None
    for response in stub.Generate(request, timeout=timeout):
        tokens.extend(response.token_ids)
        text.append(response.text)
        last = response
    return tokens, "".join(text), last


def greedy_request(prompt_ids: list[int], max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
