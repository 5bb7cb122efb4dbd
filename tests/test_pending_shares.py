"""Decode's pending-lease share is kept per caller: callers that reserve and never send KV, and
re-reserve as soon as they can, cannot lock the router out (issue 23, item 4).

Plaintext on loopback: without TLS a caller is the host it connects from, so decode listens on
`localhost` (127.0.0.1 and ::1), the router dials 127.0.0.1 and the hostile callers ::1.
"""

import socket
import threading
import time

import grpc
import pytest

from procs import Stack, generate, greedy_request, start_router, start_service, wait_until
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = load_served_model("tinygpt", weights=False).fingerprint
BLOCKS = 256  # so the pending cap (0.5, the default) is 128 blocks
HOSTILE_LEASE_TOKENS = 512  # 32 blocks: four such leases fill the cap
CALLERS = 8


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not _ipv6_loopback():
        pytest.skip("needs ::1 to tell a second caller from the router on one machine")
    tmp = str(tmp_path_factory.mktemp("pending-shares"))
    flags = ("--host", "localhost", "--num-blocks", str(BLOCKS), "--prefix-cache", "false")
    decode = start_service("decode", "--torch-threads", "1", *flags, tmp_dir=tmp)
    prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
    router = start_router([prefill], [decode], tmp_dir=tmp)
    stack = Stack(router, [prefill], [decode])
    yield stack
    stack.stop()


class Hoarders:
    """CALLERS threads on ::1, each reserving big leases it never sends KV for, and trying
    again every few milliseconds whenever decode refuses one."""

    def __init__(self, port: int) -> None:
        self.channels = [grpc.insecure_channel(f"[::1]:{port}") for _ in range(CALLERS)]
        self.calls: list[grpc.Call] = []
        self.refusals: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._hoard, args=(c,)) for c in self.channels]
        self.lock = threading.Lock()

    def _hoard(self, channel: grpc.Channel) -> None:
        stub = pb_grpc.DecodeServiceStub(channel)
        request = pb.DecodeRequest(
            request_id="hoard",
            prompt_token_ids=[7] * 100,
            sampling=pb.SamplingParams(max_tokens=HOSTILE_LEASE_TOKENS - 100, ignore_eos=True),
            model_fingerprint=MODEL,
        )
        while not self.stop.is_set():
            call = stub.Decode(request, timeout=60)
            try:
                next(call)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                with self.lock:
                    self.refusals.append(exc.details())
                self.stop.wait(0.02)
                continue
            with self.lock:
                self.calls.append(call)

    def __enter__(self) -> "Hoarders":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()


def test_callers_that_hoard_reservations_cannot_lock_the_router_out(stack: Stack):
    """Eight callers on ::1 hold the whole pending cap with leases they never send KV for, and
    re-reserve as soon as decode lets them. Counted as one cap for all, the router's
    reservations would be refused until they gave up (0 of 5 in 40 s in the review); with a
    share per caller, the router's first lease is let in at once, and the hoarders are held to
    their share. Each of 5 router requests is served within a few seconds."""
    before = stack.pool_stats()
    assert before.free_blocks == before.total_blocks == BLOCKS
    cap_blocks = BLOCKS // 2
    with Hoarders(stack.decodes[0].port) as hoarders:
        wait_until(
            lambda: stack.pool_stats().free_blocks <= BLOCKS - cap_blocks and hoarders.refusals,
            15,
            "the hoarders to hold the whole pending cap and be refused more",
        )
        assert "--max-pending-lease-share" in hoarders.refusals[0]
        started = time.monotonic()
        for i in range(5):
            tokens, _, _ = generate(stack.router_stub(), greedy_request([1, 2, 3, i + 4], 4), 8)
            assert len(tokens) == 4
        assert time.monotonic() - started < 10
        # Held to their share: while the router reserved, they took no more than they had.
        assert stack.pool_stats().pending_leases <= cap_blocks // (HOSTILE_LEASE_TOKENS // 16)
    wait_until(
        lambda: stack.pool_stats().free_blocks == BLOCKS,
        15,
        "the hoarded blocks to come back once the hoarders leave",
    )
