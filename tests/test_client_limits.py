"""The router's API keys on gRPC, and its per-client limits: no one client takes the others' share.

Each test starts its own router, with the flags under test, over one prefill and one decode.
"""

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from procs import Stack, free_port, generate, greedy_request, router_queue_depth, start_router
from procs import start_service, wait_until
from pdserve.rpc.tls import aio_client_channel
from pdserve.services.router.clients import ApiKeys, CacheSalts, load_salt_secret
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

KEYS = "key-of-alice,key-of-bob"
# A slow rate, so that a request of 63 tokens overdraws its client's bucket (2 s of the rate)
# unless it took over 10 s: the refusals below do not depend on this machine's speed.
RATE_PER_S = "5"


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("client-limits"))
    # The whole pool for one client: these tests fill it to test the router's own lines. Decode's
    # share per client, which keeps room back for another, is tests/test_pool_shares.py's.
    decode = start_service(
        "decode", "--torch-threads", "1", "--max-pool-share-per-client", "1", tmp_dir=tmp
    )
    prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
    yield prefill, decode, tmp
    prefill.stop()
    decode.stop()


@pytest.fixture
def router_with(backends):
    prefill, decode, tmp = backends
    started: list[Stack] = []

    def start(*flags: str) -> Stack:
        router = start_router([prefill], [decode], *flags, tmp_dir=tmp)
        started.append(Stack(router, [prefill], [decode]))
        return started[-1]

    yield start
    for stack in started:
        wait_until(stack.pools_settled, 30, "the decode pool to be whole again")
        stack.router.stop()
        stack.channels.clear()


def as_client(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_generate_over_grpc_needs_one_of_the_api_keys(router_with):
    stack = router_with("--api-key", KEYS)
    stub, request = stack.router_stub(), greedy_request([1, 2, 3], 4)
    for metadata in ([], as_client("key-of-eve"), [("authorization", "key-of-bob")]):
        err = refusal(lambda: list(stub.Generate(request, timeout=10, metadata=metadata)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in err.details() and "key-of" not in err.details()
    for key in KEYS.split(","):
        responses = list(stub.Generate(request, timeout=30, metadata=as_client(key)))
        assert sum(len(r.token_ids) for r in responses) == 4
    assert "key-of" not in stack.router.log()


def test_pdserves_own_clients_send_the_key_from_the_environment(router_with, monkeypatch):
    """`pdserve generate` (a blocking channel) and the load client's asyncio channel send
    PDSERVE_API_KEY's first key; without it the router refuses them."""
    stack = router_with("--api-key", KEYS)
    command = [sys.executable, "-m", "pdserve.cli", "generate", "hi", "--max-tokens", "3"]
    command += ["--address", stack.router.address]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stdout + refused.stderr
    env["PDSERVE_API_KEY"] = "key-of-bob,unused"
    served = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert served.returncode == 0, served.stdout + served.stderr

    monkeypatch.setenv("PDSERVE_API_KEY", "key-of-alice")

    async def over_asyncio() -> int:
        async with aio_client_channel(stack.router.address) as channel:
            call = pb_grpc.RouterServiceStub(channel).Generate(
                greedy_request([1, 2], 3), timeout=30
            )
            return sum([len(r.token_ids) async for r in call])

    assert asyncio.run(over_asyncio()) == 3


def test_streams_beyond_the_per_client_limit_are_refused_by_name(router_with):
    """Alice holds her 2 streams open; her third is refused, naming the limit, while Bob is
    served. Once one of hers ends, she is served again."""
    stack = router_with("--api-key", KEYS, "--max-streams-per-client", "2")
    stub, long = stack.router_stub(), greedy_request([1, 2, 3], 400)
    open_streams = [stub.Generate(long, timeout=60, metadata=as_client("key-of-alice"))]
    open_streams.append(stub.Generate(long, timeout=60, metadata=as_client("key-of-alice")))
    for stream in open_streams:
        next(stream)  # admitted, and streaming
    short = greedy_request([4, 5], 3)
    err = refusal(lambda: generate_as(stub, short, "key-of-alice"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-streams-per-client 2" in err.details() and "key #1" in err.details()
    assert len(generate_as(stub, short, "key-of-bob")) == 3
    open_streams[0].cancel()
    assert len(wait_until(lambda: served_as(stub, short, "key-of-alice"), 10, "room again")) == 3
    open_streams[1].cancel()


def test_a_client_over_its_token_rate_waits_and_the_others_do_not(router_with):
    """5 tokens/s, so a bucket of 10: a request of 3 + 60 tokens overdraws it unless it took
    over 10 s (RATE_PER_S). Alice's next request is refused with the time to wait; Bob's is
    served; after that wait, Alice's too."""
    stack = router_with("--api-key", KEYS, "--max-tokens-per-second-per-client", RATE_PER_S)
    stub = stack.router_stub()
    assert len(generate_as(stub, greedy_request([1, 2, 3], 60), "key-of-alice")) == 60
    err = refusal(lambda: generate_as(stub, greedy_request([1], 2), "key-of-alice"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"--max-tokens-per-second-per-client {RATE_PER_S}" in err.details()
    assert "try again" in err.details()
    assert len(generate_as(stub, greedy_request([1], 2), "key-of-bob")) == 2
    request = greedy_request([1], 2)
    assert wait_until(lambda: served_as(stub, request, "key-of-alice"), 30, "Alice's bucket")


def test_without_keys_a_client_is_its_address_and_http_shares_the_limits(router_with):
    """No keys: every caller here is 127.0.0.1, one client, over gRPC and HTTP alike. HTTP
    answers the refusal 429 in OpenAI's error shape, naming the limit."""
    http_port = free_port()
    stack = router_with(
        "--http-port", str(http_port), "--max-tokens-per-second-per-client", RATE_PER_S
    )
    stub = stack.router_stub()
    assert len(generate(stub, greedy_request([1, 2, 3], 60))[0]) == 60
    body = json.dumps({"model": "tinygpt", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 429
    assert "--max-tokens-per-second-per-client" in json.load(err.value)["error"]["message"]


def test_over_http_a_client_with_a_key_is_its_key_not_its_address(router_with):
    """Alice and Bob call from the same address with their own keys. Alice overdraws her token
    rate over HTTP: her next request is refused, over HTTP and gRPC alike, while Bob's is
    served. Counted by address, Bob would be refused too."""
    http_port = free_port()
    stack = router_with(
        "--api-key",
        KEYS,
        "--http-port",
        str(http_port),
        "--max-tokens-per-second-per-client",
        RATE_PER_S,
    )
    assert http_completion(http_port, "key-of-alice", 60) == 200
    assert http_completion(http_port, "key-of-alice", 2) == 429
    err = refusal(lambda: generate_as(stack.router_stub(), greedy_request([1], 2), "key-of-alice"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_completion(http_port, "key-of-bob", 2) == 200


def http_completion(port: int, key: str, max_tokens: int) -> int:
    """The HTTP status of one /v1/completions call with `key`, its body read to the end."""
    body = {"model": "tinygpt", "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def generate_as(stub: pb_grpc.RouterServiceStub, request, key: str) -> list[int]:
    tokens = []
    for response in stub.Generate(request, timeout=30, metadata=as_client(key)):
        tokens.extend(response.token_ids)
    return tokens


def served_as(stub, request, key: str) -> list[int] | None:
    """The tokens, or None while the router refuses the client for a limit."""
    try:
        return generate_as(stub, request, key)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None


@pytest.mark.parametrize("scope", ["client", "shared"])
def test_a_client_reuses_only_its_own_cached_prefixes_unless_the_scope_is_shared(
    router_with, scope
):
    """With --prefix-cache-scope client (the default), bob's prompt does not find the prefix
    that alice's left in either cache, so his time to first token cannot tell him what she
    sent; with shared, it does. The tokens are the same either way."""
    stack = router_with(
        "--api-key", KEYS, "--routing-policy", "prefix-aware", "--prefix-cache-scope", scope
    )
    stub = stack.router_stub()
    system = [(i * 31 + len(scope)) % 250 + 1 for i in range(120)]  # 7 full blocks, per scope

    def ask(key: str, own: int):
        request = greedy_request(system + [own] * 10, 6)
        responses = list(stub.Generate(request, timeout=30, metadata=as_client(key)))
        return [t for r in responses for t in r.token_ids], responses[-1].metrics

    ask("key-of-alice", 1)
    alice, again = ask("key-of-alice", 2)
    assert again.prefix_cached_tokens >= 112 and again.prefill_cached_tokens >= 112
    bob, other = ask("key-of-bob", 2)
    assert bob == alice
    if scope == "client":
        assert other.prefix_cached_tokens == 0 and other.prefill_cached_tokens == 0
    else:
        assert other.prefix_cached_tokens >= 112 and other.prefill_cached_tokens >= 112


def test_a_keys_cache_salt_follows_the_key_not_its_place_in_the_list():
    """Reordering --api-key renames the keys ('key #i') but must not hand one client's cached
    prefixes to another: the salt comes from the key itself."""
    before, after = ApiKeys("key-of-alice,key-of-bob"), ApiKeys("key-of-bob,key-of-alice")
    salts_before, salts_after = CacheSalts(before, b"s" * 32), CacheSalts(after, b"t" * 32)
    alice_before = salts_before.of(before.client_of("Bearer key-of-alice") or "")
    alice_after = salts_after.of(after.client_of("Bearer key-of-alice") or "")
    bob_after = salts_after.of(after.client_of("Bearer key-of-bob") or "")
    assert alice_before == alice_after != bob_after
    assert len(alice_before) == 16


def test_an_address_salt_needs_the_routers_secret(tmp_path):
    """A client known by its address gets a salt keyed by the routers' secret: no one without
    it can compute the salt (it was blake2b of the address, which anyone could), two routers
    with one --prefix-cache-secret-file agree, and a router without one makes its own."""
    shared = tmp_path / "secret"
    shared.write_bytes(b"0123456789abcdef-shared")
    a, b = (CacheSalts(ApiKeys(""), load_salt_secret(str(shared))) for _ in range(2))
    assert a.of("10.0.0.1") == b.of("10.0.0.1") != a.of("10.0.0.2")
    unkeyed = hashlib.blake2b(b"10.0.0.1", digest_size=16, person=b"pdserve-addr").digest()
    assert a.of("10.0.0.1") != unkeyed
    fresh = CacheSalts(ApiKeys(""), load_salt_secret(""))
    assert fresh.of("10.0.0.1") not in (a.of("10.0.0.1"), unkeyed)
    (tmp_path / "short").write_bytes(b"too short")
    with pytest.raises(ValueError, match="at least 16 secret bytes"):
        load_salt_secret(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="No such file"):
        load_salt_secret(str(tmp_path / "missing"))


def test_a_clients_burst_cannot_fill_the_queue_nor_make_another_wait_behind_it(router_with):
    """Under the defaults. Alice's 8 streams of 4,096 tokens fill the decode pool, and her burst
    of more waits in the router's queue: past her share of it (half of --max-queue) she is
    refused, naming the flag. Bob's request waits too, but in his own line; when one stream
    ends, the room goes to him (the client served least recently), not to the head of Alice's
    burst. In one first-come-first-served line he would wait behind all of it."""
    metrics_port = free_port()
    stack = router_with("--api-key", KEYS, "--metrics-port", str(metrics_port))
    share = 128  # --max-queue-share-per-client 0.5 of --max-queue 256
    long, short = greedy_request([9] * 8, 4088), greedy_request([1, 2, 3], 12)  # 256 blocks, 1

    def queued() -> int:
        return router_queue_depth(metrics_port)

    async def until(condition, timeout: float, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not await asyncio.to_thread(condition):
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(stack.router.address) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            alice = as_client("key-of-alice")
            running = [stub.Generate(long, timeout=60, metadata=alice) for _ in range(8)]
            burst, reads = [], []
            try:
                for call in running:
                    await call.read()  # its first token: it holds its room
                assert stack.pool_stats().free_blocks == 0
                burst = [stub.Generate(long, timeout=60, metadata=alice) for _ in range(share + 4)]
                reads = [asyncio.ensure_future(call.read()) for call in burst]
                await until(lambda: queued() == share, 15, "Alice's share of the queue to fill")
                await until(lambda: sum(r.done() for r in reads) == 4, 5, "4 refusals")
                refused = [call for call, r in zip(burst, reads) if r.done()]
                for call in refused:
                    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-queue-share-per-client 0.5" in await call.details()
                bob = stub.Generate(short, timeout=30, metadata=as_client("key-of-bob"))
                await until(lambda: queued() == share + 1, 5, "Bob's request to wait in line")
                running[0].cancel()  # one room frees
                first = await asyncio.wait_for(bob.read(), 5)
                # While Bob's stream holds its block, the room left is one block short of
                # Alice's next: none of her burst went before him. (Once his stream ends, her
                # next one may take the room at once.)
                assert queued() == share
                tokens = list(first.token_ids)
                while (response := await asyncio.wait_for(bob.read(), 5)) is not grpc.aio.EOF:
                    tokens.extend(response.token_ids)
                assert len(tokens) == 12
            finally:
                for call in running + burst:
                    call.cancel()
                await asyncio.gather(*reads, return_exceptions=True)

    asyncio.run(scenario())
