"""Peers that misbehave on purpose, over plaintext on loopback (issue 23): prefill must dial
only what it is allowed to, idle KV streams must not lock the router out of decode, and the data
plane must not let one peer take decode's memory or connections."""

import select
import signal
import socket
import threading
import time

import grpc
import pytest
import torch

from procs import start_service, wait_until
from pdserve.kv import wire as kv_wire
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = load_served_model("tinygpt", weights=False).fingerprint
# Small limits, so that a test reaches each of them with a handful of calls.
MAX_RPCS, MAX_KV_STREAMS, FIRST_FRAME_SECONDS, LEASE_TTL_SECONDS = 8, 4, 1.5, 3.0
MAX_CONNECTIONS, MAX_PER_PEER = 12, 8


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hostile"))
    decode = start_service(
        "decode",
        "--torch-threads",
        "1",
        "--prefix-cache",
        "false",
        "--max-concurrent-rpcs",
        str(MAX_RPCS),
        "--max-kv-streams",
        str(MAX_KV_STREAMS),
        "--kv-first-frame-seconds",
        str(FIRST_FRAME_SECONDS),
        "--lease-ttl-seconds",
        str(LEASE_TTL_SECONDS),
        "--max-kv-connections",
        str(MAX_CONNECTIONS),
        "--max-kv-connections-per-peer",
        str(MAX_PER_PEER),
        tmp_dir=tmp,
    )
    try:
        prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
    except BaseException:
        decode.stop(signal.SIGKILL)
        raise
    decode_channel, prefill_channel = (grpc.insecure_channel(s.address) for s in (decode, prefill))
    yield decode, pb_grpc.DecodeServiceStub(decode_channel), prefill_channel
    decode_channel.close()
    prefill_channel.close()
    prefill.stop(signal.SIGKILL)
    decode.stop(signal.SIGKILL)


@pytest.fixture(autouse=True)
def pool_returns(services):
    _, stub, _ = services
    before = _stats(stub)
    yield
    wait_until(
        lambda: _settled(_stats(stub), before.free_blocks),
        10,
        "decode's free blocks back at their start value, nothing pending",
    )


def _stats(stub) -> pb.GetPoolStatsResponse:
    return stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)


def _settled(stats: pb.GetPoolStatsResponse, free_blocks: int) -> bool:
    return stats.free_blocks == free_blocks and not stats.pending_leases and not stats.running


# --- Item 2: every address prefill dials is checked before it connects ---


def _prefill_request(decode_address: str, endpoint: pb.DataEndpoint) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id="r",
        prompt_token_ids=[7] * 10,
        sampling=pb.SamplingParams(max_tokens=1),
        lease_id="\r\nSET pwned 1\r\nQUIT\r\n",
        decode_address=decode_address,
        model_fingerprint=MODEL,
        data_endpoints=[endpoint],
    )


def _refusal(channel, request: pb.PrefillRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=10)
    return err.value


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("host", ["", "localhost"])
def test_a_data_endpoint_decode_does_not_offer_is_never_dialled(services, host):
    """An allowed decode address with a data endpoint of someone else's port (or another name
    for the host): PERMISSION_DENIED, and the listener there sees no connection. A closed port
    gets the very same answer, so the refusal tells nothing of what listens where."""
    decode, _, prefill_channel = services
    victim = socket.create_server(("127.0.0.1", 0))
    try:
        open_port, closed_port = victim.getsockname()[1], _closed_port()
        answers = []
        for port in (open_port, closed_port):
            endpoint = pb.DataEndpoint(transport="tcp", host=host, port=port)
            err = _refusal(prefill_channel, _prefill_request(decode.address, endpoint))
            answers.append((err.code(), err.details().replace(str(port), "PORT")))
        assert not select.select([victim], [], [], 0.2)[0], "prefill connected to the victim"
    finally:
        victim.close()
    assert answers[0] == answers[1], "the refusal differs with what listens there"
    code, details = answers[0]
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "data endpoint" in details and "before any connection" in details


# --- Item 3: KV streams have their own limit and deadlines ---


def _idle_push(stub, release: threading.Event):
    """A PushKv call that sends nothing until `release` is set."""

    def nothing():
        release.wait(30)
        return
        yield  # a generator that yields no message

    return stub.PushKv.future(nothing(), timeout=30)


def _ended_with(call, code: grpc.StatusCode) -> bool:
    return call.done() and call.code() == code


def test_idle_kv_streams_cannot_lock_the_control_plane_out(services):
    """As many idle PushKv calls as decode runs calls at all: those beyond --max-kv-streams are
    refused at once, GetPoolStats and Decode still get through, and the admitted ones end at
    the first-frame deadline."""
    _, stub, _ = services
    release = threading.Event()
    calls = [_idle_push(stub, release) for _ in range(MAX_RPCS)]
    try:
        wait_until(
            lambda: sum(c.done() for c in calls) >= MAX_RPCS - MAX_KV_STREAMS,
            10,
            "the KV streams beyond --max-kv-streams to be refused",
        )
        refused = [c for c in calls if _ended_with(c, grpc.StatusCode.RESOURCE_EXHAUSTED)]
        assert len(refused) == MAX_RPCS - MAX_KV_STREAMS
        assert "--max-kv-streams" in refused[0].details()
        assert _stats(stub).total_blocks > 0  # the control plane is still served
        decode_call = stub.Decode(
            pb.DecodeRequest(
                request_id="control",
                prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=1),
                model_fingerprint=MODEL,
            ),
            timeout=10,
        )
        assert next(decode_call).lease.lease_id
        decode_call.cancel()
        wait_until(
            lambda: all(c.done() for c in calls),
            FIRST_FRAME_SECONDS + 5,
            "the idle KV streams to end at --kv-first-frame-seconds",
        )
        timed_out = [c for c in calls if c.code() == grpc.StatusCode.DEADLINE_EXCEEDED]
        assert len(timed_out) == MAX_KV_STREAMS
        assert "no KV message within" in timed_out[0].details()
    finally:
        release.set()
        for call in calls:
            call.cancel()


def _first_chunk(lease: pb.LeaseGranted, tokens: int) -> pb.PushKvRequest:
    """A chunk decode accepts for the lease: layer 0's KV of its first tokens (zeros)."""
    zeros = torch.zeros(tokens, 4, 64)
    piece = next(kv_wire.split_layer(zeros, zeros, tokens_per=tokens))
    return pb.PushKvRequest(
        data=piece.payload(),
        chunk=pb.KvChunk(
            lease_id=lease.lease_id,
            index=0,
            layer=0,
            token_start=0,
            token_end=tokens,
            dtype=pb.D_TYPE_FLOAT32,
            shape=[2, tokens, 4, 64],
            crc32c=piece.crc32c,
            model_fingerprint=MODEL,
        ),
    )


def test_a_kv_stream_that_stalls_ends_at_the_lease_ttl(services):
    """One accepted chunk, then nothing: the stream itself is ended (DEADLINE_EXCEEDED, by
    decode) once it has lasted --lease-ttl-seconds, not left open for its caller's deadline."""
    _, stub, _ = services
    lease_call = stub.Decode(
        pb.DecodeRequest(
            request_id="stall",
            prompt_token_ids=list(range(40, 56)),
            sampling=pb.SamplingParams(max_tokens=1),
            model_fingerprint=MODEL,
        ),
        timeout=30,
    )
    lease, release = next(lease_call).lease, threading.Event()

    def stalled():
        yield _first_chunk(lease, 16)
        release.wait(30)

    started = time.monotonic()
    push = stub.PushKv.future(stalled(), timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as err:
            push.result(timeout=LEASE_TTL_SECONDS + 10)
    finally:
        release.set()
        lease_call.cancel()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took longer than" in err.value.details()
    assert time.monotonic() - started < LEASE_TTL_SECONDS + 5


# --- Item 1: the data plane bounds what one peer holds ---


def _data_port(decode) -> int:
    with grpc.insecure_channel(decode.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        return stub.GetDataEndpoints(pb.GetDataEndpointsRequest(), timeout=5).data_endpoints[0].port


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    sock.settimeout(5)
    return sock


def _reply(sock: socket.socket, within: float) -> pb.DataPlaneReply | None:
    """Decode's one reply frame, or None when none came within `within` seconds."""
    if not select.select([sock], [], [], within)[0]:
        return None
    head = sock.recv(4, socket.MSG_WAITALL)
    return pb.DataPlaneReply.FromString(
        sock.recv(int.from_bytes(head, "little"), socket.MSG_WAITALL)
    )


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_frame_length_alone_takes_no_memory(services):
    """Connections that each announce a 64 MiB frame and send one byte of it (the issue's
    attack) grow decode's memory by what arrived, not by what they announced; a frame whose
    start names no lease is refused once that start is in."""
    decode, _, _ = services
    port = _data_port(decode)
    before = _rss_bytes(decode.proc.pid)
    socks = [_connect(port) for _ in range(MAX_PER_PEER)]
    try:
        for sock in socks:
            sock.sendall((64 << 20).to_bytes(4, "little") + b"x")
        # Answered once decode's loop has read what came before it on the other connections.
        assert _refused_unbound(port, "127.0.0.2")
        grown = _rss_bytes(decode.proc.pid) - before
    finally:
        for sock in socks:
            sock.close()
    assert grown < 64 << 20, f"decode grew {grown >> 20} MiB for {len(socks)} bytes"


def test_a_byte_now_and_then_does_not_keep_a_connection(services):
    """One byte every 0.3 s: the connection is closed at its stream deadline (the lease TTL),
    where an idle timer would have been re-armed by every byte."""
    decode, _, _ = services
    started = time.monotonic()
    with _connect(_data_port(decode)) as sock:
        sock.sendall((1 << 10).to_bytes(4, "little"))
        reply = None
        while reply is None and time.monotonic() - started < LEASE_TTL_SECONDS + 5:
            sock.sendall(b"x")
            reply = _reply(sock, 0.3)
    assert reply is not None, "the dripping connection outlived its deadline"
    assert reply.error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], reply.error_message
    assert "took longer than" in reply.error_message


def test_connections_are_capped_per_peer_and_in_total(services):
    """MAX_PER_PEER connections from one address fill its share; another address may still
    connect, up to MAX_CONNECTIONS in all. Each refusal is RESOURCE_EXHAUSTED, naming its cap."""
    decode, _, _ = services
    port = _data_port(decode)
    held = [_connect(port) for _ in range(MAX_PER_PEER)]
    try:
        with _connect(port) as extra:
            reply = _reply(extra, 2.0)
        assert reply is not None and "--max-kv-connections-per-peer" in reply.error_message
        assert reply.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        held += [_connect(port, "127.0.0.2") for _ in range(MAX_CONNECTIONS - MAX_PER_PEER)]
        assert all(_reply(sock, 0) is None for sock in held), "a connection within the caps"
        with _connect(port, "127.0.0.3") as extra:
            reply = _reply(extra, 2.0)
        assert reply is not None and "--max-kv-connections)" in reply.error_message
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _refused_unbound(port), 5, "closed connections to count no more")


def _refused_unbound(port: int, source: str = "127.0.0.1") -> bool:
    """A fresh connection's frame whose start names no lease is refused for that (not for a
    cap), without a buffer for more than that start."""
    with _connect(port, source) as sock:
        sock.sendall((8192).to_bytes(4, "little") + bytes(8192))
        reply = _reply(sock, 2.0)
    return reply is not None and "names no lease" in reply.error_message
