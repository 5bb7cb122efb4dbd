"""One client's leases hold at most --max-pool-share-per-client of decode's pool, so another
client's request finds room at once instead of waiting for the first one's streams to end. Over
real gRPC to a decode instance, the clients named as the router names them."""

import http.client
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from procs import Stack, free_port, greedy_request, router_queue_depth, start_router
from procs import start_service, wait_until
from test_metrics import scrape
from pdserve.core.block_pool import BlockPool
from pdserve.core.client_shares import ClientShares
from pdserve.core.request import GenerateSpec, SamplingSpec
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = load_served_model("tinygpt", weights=False).fingerprint
BLOCKS = 64  # of 16 tokens
BIG = 240  # output tokens: with a 16-token prompt, 16 blocks, a quarter of the pool


def test_client_shares_remember_only_tables_not_yet_released():
    """With no share kept back (1) the count is never asked for; released reservations must
    still be forgotten, or a long-running service keeps every table it ever reserved."""
    pool = BlockPool(64, 16)
    shares = ClientShares(64)
    spec = GenerateSpec("r", tuple(range(1, 17)), SamplingSpec(max_tokens=16, ignore_eos=True))
    for _ in range(100):
        shares.reserve(pool, spec, 1.0).release()
    assert shares.tracked <= 1
    assert pool.available_blocks == 64


def _decode(tmp_path, share: str, pending_share: str = "1", faults: str = ""):
    return start_service(
        "decode",
        "--torch-threads",
        "1",
        "--num-blocks",
        str(BLOCKS),
        "--prefix-cache",
        "false",
        "--max-pending-lease-share",
        pending_share,  # 1: these leases never get KV, and only the pool share is tested
        "--max-pool-share-per-client",
        share,
        tmp_dir=str(tmp_path),
        faults=faults,
    )


def _reserve_until_refused(stub, client: str, max_tokens: int, calls: list) -> grpc.RpcError:
    """Leases for `client` until decode refuses one; each call kept open in `calls`."""
    for i in range(BLOCKS):
        call, answer = _reserve(stub, client, f"{client}{i}", max_tokens)
        calls.append(call)
        if isinstance(answer, grpc.RpcError):
            return answer
    raise AssertionError("never refused")


def _cancel_and_settle(stub, calls: list) -> None:
    for call in calls:
        call.cancel()
    wait_until(
        lambda: stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5).free_blocks == BLOCKS,
        10,
        "every block back",
    )


def test_one_clients_pending_leases_leave_another_its_part_of_the_callers_share(tmp_path):
    """One caller (as the router is), two clients. The pending cap is 32 blocks (0.5 of 64), all
    the caller's. A's 8-block leases that never get KV fill it (4), and a fifth is refused; B
    still gets its part of the caller's share, half of it between two clients: 2 leases, not a
    third. Split by caller only, B waited for A's leases to commit."""
    decode = _decode(tmp_path, "1", pending_share="0.5")
    calls: list = []
    try:
        with grpc.insecure_channel(decode.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            refusal = _reserve_until_refused(stub, "a", 112, calls)  # 128 tokens: 8 blocks
            assert len(calls) == 5 and "--max-pending-lease-share" in refusal.details()
            refusal = _reserve_until_refused(stub, "b", 112, calls)
            assert len(calls) == 5 + 3, "B's part of the caller's share is 2 leases of 8 blocks"
            assert "--max-pending-lease-share" in refusal.details()
            _cancel_and_settle(stub, calls)
    finally:
        decode.stop(signal.SIGKILL)


def _reserve(stub, client: str, name: str, max_tokens: int, prefill_here: bool = False):
    """The reservation call (kept open: closing it frees the lease) and its first answer."""
    call = stub.Decode(
        pb.DecodeRequest(
            request_id=name,
            prompt_token_ids=list(range(1, 17)),
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            model_fingerprint=MODEL,
            client=client,
            prefill_here=prefill_here,
        ),
        timeout=30,
    )
    try:
        return call, next(call)
    except grpc.RpcError as exc:
        return call, exc


@pytest.mark.parametrize("share, a_leases, b_finds_room", [("0.9", 3, True), ("1", 4, False)])
def test_one_clients_burst_leaves_room_for_another(tmp_path, share, a_leases, b_finds_room):
    """A reserves 16-block leases until refused: at 0.9 of 64 blocks it holds 3 (48; a fourth
    would make 64 > 57) and B's 2-block request is granted at once; with no share kept back A
    takes the whole pool and B is refused."""
    decode = _decode(tmp_path, share)
    calls = []
    try:
        with grpc.insecure_channel(decode.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            granted, refusal = 0, None
            for i in range(5):
                call, answer = _reserve(stub, "a", f"a{i}", BIG)
                calls.append(call)
                if isinstance(answer, grpc.RpcError):
                    refusal = answer
                    break
                granted += 1
            assert granted == a_leases and refusal is not None
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if b_finds_room:
                assert "--max-pool-share-per-client 0.9" in refusal.details()
            call, answer = _reserve(stub, "b", "b0", 8)
            calls.append(call)
            assert isinstance(answer, pb.DecodeResponse) is b_finds_room, answer
            for call in calls:
                call.cancel()
            wait_until(
                lambda: (
                    stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5).free_blocks == BLOCKS
                ),
                10,
                "every block back",
            )
    finally:
        decode.stop(signal.SIGKILL)


def test_prompts_prefilled_on_decode_count_in_their_clients_share(tmp_path):
    """As the leases above, for prompts that decode prefills itself (the router's
    --local-prefill-tokens): A's 16-block local requests, each decoding slowly (a 0.05 s step,
    so 240 tokens hold their room for 12 s), stop at 3 of 4 quarter-pool reservations at 0.9,
    and B's request is granted at once. Uncounted, A took the whole pool and B was refused."""
    decode = _decode(tmp_path, "0.9", faults="decode_step_seconds=0.05")
    calls: list = []
    try:
        with grpc.insecure_channel(decode.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            answers = []
            for i in range(4):
                call, answer = _reserve(stub, "a", f"a{i}", BIG, prefill_here=True)
                calls.append(call)
                answers.append(answer)
            assert [isinstance(a, pb.DecodeResponse) for a in answers] == [True] * 3 + [False]
            assert answers[3].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-pool-share-per-client 0.9" in answers[3].details()
            call, answer = _reserve(stub, "b", "b0", 8, prefill_here=True)
            calls.append(call)
            assert isinstance(answer, pb.DecodeResponse), answer
            _cancel_and_settle(stub, calls)
    finally:
        decode.stop(signal.SIGKILL)


def test_a_client_refused_its_share_does_not_hold_another_clients_request(tmp_path):
    """Through the router, with decode's default share (0.9 of 1,024 blocks). Alice's 3 long
    streams hold 768 blocks and her 4th waits in the router's line: decode refuses it her share.
    Bob's requests find room whenever they come. His second comes after his first was served,
    so Alice is the client served least recently, and her refused request polls decode first;
    a failed poll of a client that holds room passes the next poll to another client, so Bob's
    request is served at once. Otherwise it waited for one of Alice's streams to end."""
    tmp = str(tmp_path)
    decode = start_service("decode", "--torch-threads", "1", "--num-blocks", "1024", tmp_dir=tmp)
    prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
    metrics_port = free_port()
    router = start_router(
        [prefill],
        [decode],
        "--api-key",
        "key-a,key-b",
        "--metrics-port",
        str(metrics_port),
        tmp_dir=tmp,
    )
    stack = Stack(router, [prefill], [decode])
    alice, bob = ([("authorization", f"Bearer key-{who}")] for who in "ab")
    long_stream = greedy_request([9] * 8, 4088)  # 256 blocks, thousands of steps
    streams = []
    try:
        stub = stack.router_stub()
        for _ in range(3):
            streams.append(stub.Generate(long_stream, timeout=120, metadata=alice))
            next(streams[-1])  # its first token: it holds its room
        streams.append(stub.Generate(long_stream, timeout=120, metadata=alice))
        wait_until(lambda: router_queue_depth(metrics_port) == 1, 10, "Alice's 4th to wait in line")
        for _ in range(2):
            tokens = [
                t
                for response in stub.Generate(
                    greedy_request([1, 2, 3], 2), timeout=60, metadata=bob
                )
                for t in response.token_ids
            ]
            assert len(tokens) == 2
        assert not any(stream.done() for stream in streams), "Bob waited for Alice's streams"
    finally:
        for stream in streams:
            stream.cancel()
        wait_until(stack.pools_settled, 30, "the decode pool to be whole again")
        stack.stop()


def _completion(port: int, source: str, max_tokens: int, stream: bool):
    """An HTTP completion of a 16-token prompt sent from `source` (the client colocated tells
    apart by address); returns the connection and its response once the headers came (for a
    stream: once its first token was generated)."""
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=60, source_address=(source, 0)
    )
    body = {"model": "tinygpt", "prompt": "x" * 16, "max_tokens": max_tokens, "stream": stream}
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps(body | {"ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    return connection, connection.getresponse()


def test_colocated_keeps_room_for_another_client(tmp_path):
    """The colocated engine counts its clients' shares too. A (127.0.0.1) opens four streams
    of a quarter of the 512-block pool each: three start, the fourth waits for room (0.9 of the
    pool is 460 blocks), and B's request (127.0.0.2) is served meanwhile. Without the share,
    A's fourth started at once and B waited for one of A's streams to end."""
    http_port, metrics_port = free_port(), free_port()
    colocated = start_service(
        "colocated",
        *("--torch-threads", "1", "--num-blocks", "512", "--prefix-cache", "false"),
        *("--http-port", str(http_port), "--metrics-port", str(metrics_port)),
        tmp_dir=str(tmp_path),
    )
    opened: list = []
    try:
        with ThreadPoolExecutor(4) as pool:
            # 16 + 2032 tokens: 128 blocks each, thousands of steps.
            streams = [
                pool.submit(_completion, http_port, "127.0.0.1", 2032, True) for _ in range(4)
            ]
            wait_until(lambda: sum(s.done() for s in streams) >= 3, 30, "A's first three streams")
            started = [s.result() for s in streams if s.done()]
            opened += [connection for connection, _ in started]
            assert len(started) == 3 and all(r.status == 200 for _, r in started)
            connection, response = _completion(http_port, "127.0.0.2", 4, False)
            opened.append(connection)
            assert response.status == 200, response.read()
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
            (waiting,) = [s for s in streams if not s.done()]  # still without room
            for connection in opened:
                connection.close()  # A's streams end: the fourth gets its room and starts
            fourth, _ = waiting.result(timeout=60)
            fourth.close()
        free = 'pdserve_kv_blocks_free{service="colocated"}'
        wait_until(lambda: scrape(metrics_port)[free] == 512, 30, "every block back")
    finally:
        colocated.stop(signal.SIGKILL)
