"""Test helpers over pdserve.localstack: a stack of services and request shortcuts."""

import signal
import urllib.request
from dataclasses import dataclass, field

import grpc

# Re-exported for the tests, which import their helpers from here.
from pdserve.localstack import (  # noqa: F401
    Service,
    free_port,
    start_router,
    start_service,
    wait_until,
)
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc


@dataclass
class Stack:
    """A router with its prefill and decode instances."""

    router: Service
    prefills: list[Service]
    decodes: list[Service]
    channels: dict = field(default_factory=dict)
    # TLS credentials for every channel (the router role's, which decode's GetPoolStats needs);
    # None: plaintext.
    credentials: grpc.ChannelCredentials | None = None

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            # Over TLS, each server verified as its role: prefill's and decode's certificates
            # name no address (pdserve/certs.py).
            role = next(
                s.role for s in [self.router, *self.prefills, *self.decodes] if s.address == address
            )
            self.channels[address] = (
                grpc.secure_channel(
                    address, self.credentials, options=[("grpc.ssl_target_name_override", role)]
                )
                if self.credentials
                else grpc.insecure_channel(address)
            )
        return self.channels[address]

    def router_stub(self) -> pb_grpc.RouterServiceStub:
        return pb_grpc.RouterServiceStub(self.router_channel())

    def router_channel(self) -> grpc.Channel:
        return self._channel(self.router.address)

    def decode_stub(self, i: int = 0) -> pb_grpc.DecodeServiceStub:
        return pb_grpc.DecodeServiceStub(self._channel(self.decodes[i].address))

    def pool_stats(self, i: int = 0) -> pb.GetPoolStatsResponse:
        return self.decode_stub(i).GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)

    def pools_settled(self) -> bool:
        """Every live decode instance has all its blocks free and holds nothing."""
        for i, decode in enumerate(self.decodes):
            if decode.proc.poll() is None:
                stats = self.pool_stats(i)
                if stats.free_blocks != stats.total_blocks or stats.running or stats.pending_leases:
                    return False
        return True

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        for service in [self.router, *self.prefills, *self.decodes]:
            service.stop()


def start_stack(
    tmp_dir: str,
    decode_flags=(),
    prefill_flags=(),
    router_flags=(),
    decodes: int = 1,
    decode_faults: str = "",
) -> Stack:
    started: list[Service] = []
    try:
        decode_services = []
        for _ in range(decodes):
            decode_services.append(
                start_service(
                    "decode",
                    "--torch-threads",
                    "1",
                    *decode_flags,
                    tmp_dir=tmp_dir,
                    faults=decode_faults,
                )
            )
            started.append(decode_services[-1])
        prefill = start_service("prefill", "--torch-threads", "1", *prefill_flags, tmp_dir=tmp_dir)
        started.append(prefill)
        router = start_service(
            "router",
            "--prefill",
            prefill.address,
            "--decode",
            *[d.address for d in decode_services],
            *router_flags,
            tmp_dir=tmp_dir,
        )
    except BaseException:
        for service in started:
            service.stop(signal.SIGKILL)
        raise
    return Stack(router, [prefill], decode_services)


def generate(stub: pb_grpc.RouterServiceStub, request: pb.GenerateRequest, timeout: float = 60.0):
    """Sends one request; returns (all token ids, all text, the last response)."""
    tokens, text, last = [], [], None
    for response in stub.Generate(request, timeout=timeout):
        tokens.extend(response.token_ids)
        text.append(response.text)
        last = response
    return tokens, "".join(text), last


def greedy_request(
    prompt_ids: list[int], max_tokens: int, request_id: str = ""
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def router_queue_depth(metrics_port: int) -> int:
    """The router's pdserve_queue_depth (requests waiting for decode room or a prefill call),
    read from its /metrics; -1 when it is not there."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('pdserve_queue_depth{service="router"}'):
                return int(float(line.split()[-1]))
    return -1
