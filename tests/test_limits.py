"""Limits no single caller can exhaust: prefill's bounds on calls, queued tokens and pushes."""

import contextlib
import select
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from procs import free_port, start_service, wait_until
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = load_served_model("tinygpt", weights=False).fingerprint


@pytest.fixture
def prefill_with(tmp_path):
    started = []

    def start(*flags):
        service = start_service("prefill", "--torch-threads", "1", *flags, tmp_dir=str(tmp_path))
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


def _request(tokens: int, port: int, data_port: int | None = None) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id="r",
        prompt_token_ids=[7] * tokens,
        sampling=pb.SamplingParams(max_tokens=1),
        lease_id="0" * 32,
        decode_address=f"127.0.0.1:{port}",
        model_fingerprint=MODEL,
        data_endpoints=[pb.DataEndpoint(transport="tcp", port=data_port or port)],
    )


@contextlib.contextmanager
def _decode_offering(data_port: int):
    """A stand-in for decode's control plane that offers `data_port` as its data plane, as
    prefill asks before it dials one (DecodeService.GetDataEndpoints); yields its gRPC port."""
    offered = pb.GetDataEndpointsResponse(
        data_endpoints=[pb.DataEndpoint(transport="tcp", port=data_port)]
    )
    handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: offered,
        request_deserializer=pb.GetDataEndpointsRequest.FromString,
        response_serializer=pb.GetDataEndpointsResponse.SerializeToString,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "pdserve.v1.DecodeService", {"GetDataEndpoints": handler}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)


def test_prompt_tokens_beyond_the_queue_bound_are_refused_by_name(prefill_with):
    prefill = prefill_with("--max-queued-prompt-tokens", "50")
    with grpc.insecure_channel(prefill.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillServiceStub(channel).Prefill(_request(60, 1), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-queued-prompt-tokens" in err.value.details()


def test_a_push_to_a_decode_that_never_reads_ends_by_the_servers_own_bound(prefill_with):
    """No caller deadline, and a "decode" that accepts the connection and never reads: the call
    ends at --push-timeout-seconds instead of holding its KV forever. While it hangs, a second
    call is refused at --max-concurrent-prefills."""
    prefill = prefill_with("--push-timeout-seconds", "3", "--max-concurrent-prefills", "1")
    listener = socket.create_server(("127.0.0.1", 0))  # never accept()ed, never read
    data_port = listener.getsockname()[1]
    try:
        with _decode_offering(data_port) as port, grpc.insecure_channel(prefill.address) as channel:
            stub = pb_grpc.PrefillServiceStub(channel)
            hanging = stub.Prefill.future(_request(3000, port, data_port))  # 36 MiB, no deadline
            # In flight once it has connected to the "decode": a connection waits in the backlog.
            assert select.select([listener], [], [], 20)[0], "the push never connected"
            with pytest.raises(grpc.RpcError) as busy:
                stub.Prefill(_request(10, port, data_port), timeout=10)
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-prefills" in busy.value.details()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                hanging.result(timeout=30)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 10
    finally:
        listener.close()


def test_calls_beyond_max_concurrent_rpcs_are_refused(tmp_path):
    decode = start_service(
        "decode", "--torch-threads", "1", "--max-concurrent-rpcs", "1", tmp_dir=str(tmp_path)
    )
    try:
        with grpc.insecure_channel(decode.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)

            def reservation():
                """A reservation: one call that stays open. The readiness probe's health check
                may still count as decode's one call for a moment after it answered (a busy
                machine widens that), and then this one is refused: it is tried again."""
                call = stub.Decode(
                    pb.DecodeRequest(
                        request_id="hold",
                        prompt_token_ids=[1, 2, 3],
                        sampling=pb.SamplingParams(max_tokens=2),
                        model_fingerprint=MODEL,
                    ),
                    timeout=30,
                )
                try:
                    next(call)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    return None
                return call

            held = wait_until(reservation, 10, "decode's one call to be free for a reservation")
            with pytest.raises(grpc.RpcError) as err:
                stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held.cancel()
    finally:
        decode.stop()


def test_prefill_dials_only_the_decodes_it_allows(prefill_with):
    """A Prefill call aimed at an address outside --decode-allow is refused, and nothing is
    dialled: a listener at that address sees no connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    prefill = prefill_with("--decode-allow", "127.0.0.1:1")
    try:
        with grpc.insecure_channel(prefill.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.PrefillServiceStub(channel).Prefill(_request(10, port), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--decode-allow" in err.value.details()
        assert not select.select([listener], [], [], 0.5)[0], "prefill connected anyway"
    finally:
        listener.close()


class _Recorder:
    """A loopback TCP port that accepts connections and keeps every byte sent to it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self.listener.accept()
                connection.settimeout(2)
                with connection, contextlib.suppress(OSError):
                    while chunk := connection.recv(65536):
                        self.received += chunk

    def close(self) -> None:
        # shutdown, not close alone: on Linux only shutdown wakes the thread blocked in accept.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(5)


def test_prefill_without_an_allow_list_sends_nothing_to_a_local_port_that_is_no_decode(
    prefill_with,
):
    """Without --decode-allow, a loopback address must answer as a decode before it gets any of
    the request: a port with nothing on it, a plain TCP service and a gRPC service of another
    kind get the same refusal, and the TCP service never sees the lease id."""
    prefill = prefill_with()
    recorder = _Recorder()
    lease = "5ec7e7" * 5 + "ab"
    targets = {"nothing": free_port(), "tcp": recorder.port, "grpc": prefill.port}
    answers = {}
    try:
        with grpc.insecure_channel(prefill.address) as channel:
            for kind, port in targets.items():
                request = _request(10, port)
                request.lease_id = lease
                del request.data_endpoints[:]  # KV would go by DecodeService.PushKv
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=20)
                answers[kind] = (err.value.code(), err.value.details().replace(str(port), "P"))
    finally:
        recorder.close()
    assert set(answers.values()) == {(grpc.StatusCode.UNAVAILABLE, answers["tcp"][1])}, answers
    assert "did not answer as a pdserve decode" in answers["tcp"][1]
    assert lease.encode() not in recorder.received


def test_prefill_without_an_allow_list_dials_loopback_only(prefill_with):
    prefill = prefill_with()
    with grpc.insecure_channel(prefill.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            request = _request(10, 50053)
            request.decode_address = "192.0.2.7:50053"  # TEST-NET-1: never routed
            pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not on loopback" in err.value.details()
