"""Failure handling, proven by injecting faults into real processes.

Every test builds its own small stack, bounds every wait, and ends with every live decode pool
holding nothing (Stack.pools_settled).

Each test runs over one transport: mutual TLS where a service is killed or replaced and its peers
must reconnect (a new handshake), plaintext where what fails is the same whatever the channel
(bursts, refusals, drains, corrupted or dropped KV). Running every test over both cost about
three minutes of the CI's budget and checked the same code twice.
"""

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.certs import make_dev_certs, service_flags
from procs import Stack, generate, greedy_request, start_router, start_service, wait_until
from pdserve.v1 import pdserve_pb2 as pb

SETTLE_SECONDS = 15.0
STALL = "stall_after_chunks=1,stall_seconds=3"
THREADS = ("--torch-threads", "1")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


# Each test names its transport with one of these (the fixture's param, set indirectly).
PLAINTEXT = pytest.mark.parametrize("services", ["plaintext"], indirect=True)
MTLS = pytest.mark.parametrize("services", ["mtls"], indirect=True)


@pytest.fixture
def services(request, tmp_path, certs):
    """Starts services on demand and stops every one of them at the end of the test: in
    plaintext, or with every service and client on mutual TLS (request.param)."""
    started = []
    mtls = request.param == "mtls"

    def start(role, *flags, faults="", port=None):
        flags = (*THREADS, *service_flags(certs if mtls else None, role), *flags)
        service = start_service(role, *flags, tmp_dir=str(tmp_path), faults=faults, port=port)
        started.append(service)
        return service

    def router(prefills, decodes, *flags, port=None):
        flags = (*service_flags(certs if mtls else None, "router"), *flags)
        service = start_router(prefills, decodes, *flags, tmp_dir=str(tmp_path), port=port)
        started.append(service)
        return service

    # As the router: its certificate opens the router's port and decode's GetPoolStats alike.
    credentials = (
        grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(),
            (certs / "router-key.pem").read_bytes(),
            (certs / "router.pem").read_bytes(),
        )
        if mtls
        else None
    )

    def channel(address: str) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(address)
        # The server verified as its role: prefill's and decode's certificates name no address.
        role = next(s.role for s in started if s.address == address)
        options = [("grpc.ssl_target_name_override", role)]
        return grpc.secure_channel(address, credentials, options=options)

    start.router = router
    start.channel = channel
    start.stack = lambda router, prefills, decodes: Stack(
        router, prefills, decodes, credentials=credentials
    )
    yield start
    for service in started:
        service.stop(signal.SIGKILL)


def settled(stack: Stack) -> None:
    wait_until(stack.pools_settled, SETTLE_SECONDS, "every decode pool to be empty again")


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


@PLAINTEXT
def test_burst_of_200_into_a_small_pool_finishes_or_is_refused(services):
    decode = services("decode", "--num-blocks", "24")  # 384 tokens: three requests at a time
    prefill = services("prefill")
    router = services.router(
        [prefill], [decode], "--max-queue", "40", "--queue-timeout-seconds", "3"
    )
    stack = services.stack(router, [prefill], [decode])
    stub = stack.router_stub()

    def one(i):
        try:
            tokens, _, last = generate(stub, greedy_request([i % 256] * (40 + i % 80), 8), 60)
            return "ok" if len(tokens) == 8 and last.usage.completion_tokens == 8 else "short"
        except grpc.RpcError as exc:
            return exc.code().name

    with ThreadPoolExecutor(200) as pool:
        outcomes = list(pool.map(one, range(200)))
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    assert set(counts) <= {"ok", "RESOURCE_EXHAUSTED"}, counts
    assert counts.get("ok", 0) + counts.get("RESOURCE_EXHAUSTED", 0) == 200
    assert counts.get("ok", 0) > 0 and counts.get("RESOURCE_EXHAUSTED", 0) > 0, counts
    settled(stack)


@PLAINTEXT
def test_request_larger_than_the_pool_is_refused_at_once(services):
    decode = services("decode", "--num-blocks", "24")  # 384 tokens in all
    prefill = services("prefill")
    stack = services.stack(services.router([prefill], [decode]), [prefill], [decode])
    err = rpc_error(lambda: generate(stack.router_stub(), greedy_request([1] * 300, 200), 10))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "whole pool" in err.details()
    # The router's log names the decode that refused; the client's status names no address.
    assert str(decode.port) not in err.details() and "127.0.0.1" not in err.details()
    wait_until(lambda: str(decode.port) in stack.router.log(), 5, "the router to log it")
    tokens, _, _ = generate(stack.router_stub(), greedy_request([1] * 30, 5))
    assert len(tokens) == 5
    settled(stack)


def pending_on(stack: Stack) -> int:
    """Index of the decode instance holding an uncommitted lease (mid-transfer)."""
    return (
        next(
            (
                i
                for i in range(len(stack.decodes))
                if stack.decodes[i].proc.poll() is None and stack.pool_stats(i).pending_leases
            ),
            -1,
        )
        + 1
    )


@MTLS
def test_decode_killed_mid_transfer_request_completes_on_the_other(services):
    decodes = [services("decode"), services("decode")]
    prefill = services("prefill", faults=STALL)
    stack = services.stack(services.router([prefill], decodes), [prefill], decodes)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(generate, stack.router_stub(), greedy_request(list(range(200)), 6))
        victim = wait_until(lambda: pending_on(stack), 10, "a lease mid-transfer") - 1
        decodes[victim].stop(signal.SIGKILL)
        tokens, _, last = reply.result(timeout=30)
    assert len(tokens) == 6 and last.metrics.attempts == 2
    assert last.metrics.decode_instance.endswith(f":{decodes[1 - victim].port}")
    tokens, _, _ = generate(stack.router_stub(), greedy_request([1, 2, 3], 4))
    assert len(tokens) == 4
    settled(stack)


def _migrated_request(sampling: dict) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=[5, 9, 14, 3] * 5,
        sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True, **sampling),
    )


@pytest.mark.parametrize(
    "services, sampling",
    [
        ("mtls", {}),
        # Penalties too: after the move they must count the tokens sent before it as output.
        (
            "plaintext",
            {
                "temperature": 0.9,
                "top_k": 40,
                "seed": 1234,
                "repetition_penalty": 1.2,
                "frequency_penalty": 0.4,
                "presence_penalty": 0.2,
            },
        ),
    ],
    ids=["mtls-greedy", "plaintext-seeded"],
    indirect=["services"],
)
def test_decode_killed_mid_stream_the_request_moves_and_ends_token_identical(services, sampling):
    """Decode dies after the client has tokens: the router prefills the prompt plus the tokens
    sent on the other pair and continues from the next step. The client sees every token of an
    uninterrupted run, in order, and one request's usage."""
    decodes = [services("decode"), services("decode", faults="decode_crash_after_steps=20")]
    prefill = services("prefill")
    # The uninterrupted run, through a router that knows only the healthy decode.
    alone = services.stack(services.router([prefill], decodes[:1]), [prefill], decodes[:1])
    uninterrupted, _, _ = generate(alone.router_stub(), _migrated_request(sampling), 60)
    stack = services.stack(services.router([prefill], decodes), [prefill], decodes)
    migrated = expected = None
    for _ in range(4):  # round robin: within a few requests one lands on the faulty decode
        tokens, _, last = generate(stack.router_stub(), _migrated_request(sampling), 60)
        if last.metrics.attempts > 1:
            migrated, expected = (tokens, last), uninterrupted
            break
        assert tokens == uninterrupted
    assert migrated is not None, "no request met the failing decode"
    tokens, last = migrated
    assert tokens == expected  # token for token, across the move
    assert last.usage.completion_tokens == 60 and last.usage.prompt_tokens == 20
    assert last.metrics.decode_instance.endswith(f":{decodes[0].port}")
    settled(stack)


def _by_completion(stub, request: pb.GenerateRequest) -> tuple[dict, dict, int]:
    """Each completion's token ids and last response, by index; and the handoffs attempted."""
    tokens: dict[int, list[int]] = {}
    last: dict[int, pb.GenerateResponse] = {}
    attempts = 0
    for response in stub.Generate(request, timeout=60):
        tokens.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason:
            last[response.index] = response
            attempts = max(attempts, response.metrics.attempts)
    return tokens, last, attempts


@PLAINTEXT
def test_decode_killed_mid_stream_each_of_n_completions_moves_token_identical(services):
    """A request of three seeded completions whose decode dies: each completion moves on its
    own, from the tokens it had sent, and ends as the uninterrupted run's."""
    decodes = [services("decode"), services("decode", faults="decode_crash_after_steps=20")]
    prefill = services("prefill")
    request = _migrated_request({"temperature": 0.9, "seed": 77, "n": 3, "frequency_penalty": 0.5})
    alone = services.stack(services.router([prefill], decodes[:1]), [prefill], decodes[:1])
    uninterrupted, _, _ = _by_completion(alone.router_stub(), request)
    assert len({tuple(t) for t in uninterrupted.values()}) == 3
    stack = services.stack(services.router([prefill], decodes), [prefill], decodes)
    for _ in range(4):  # round robin: within a few requests one lands on the faulty decode
        tokens, last, attempts = _by_completion(stack.router_stub(), request)
        assert tokens == uninterrupted  # token for token, moved or not
        if attempts > 1:
            break
    assert attempts > 1, "no request met the failing decode"
    for index in range(3):
        assert last[index].usage.completion_tokens == 60 and last[index].usage.prompt_tokens == 20
        assert last[index].metrics.decode_instance.endswith(f":{decodes[0].port}")
    settled(stack)


@PLAINTEXT
def test_migration_off_ends_with_unavailable(services):
    decodes = [services("decode"), services("decode")]
    prefill = services("prefill")
    stack = services.stack(
        services.router([prefill], decodes, "--max-migrations", "0"), [prefill], decodes
    )
    call = stack.router_stub().Generate(greedy_request([5] * 20, 3000), timeout=60)
    assert next(call).token_ids
    victim = next(i for i in range(2) if stack.pool_stats(i).running)
    decodes[victim].stop(signal.SIGKILL)
    err = rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "--max-migrations 0" in err.details()
    settled(stack)


@MTLS
def test_prefill_killed_mid_transfer_then_replaced(services):
    decode = services("decode")
    prefill = services("prefill", faults=STALL)
    stack = services.stack(services.router([prefill], [decode]), [prefill], [decode])
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(generate, stack.router_stub(), greedy_request(list(range(200)), 6))
        wait_until(lambda: pending_on(stack), 10, "a lease mid-transfer")
        prefill.stop(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            reply.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "prefill" in err.value.details()
    settled(stack)
    # A new prefill on the same port: the router resumes once its health check passes.
    services("prefill", port=prefill.port)
    tokens = wait_until(lambda: _try_generate(stack), 20, "the router to use the new prefill")
    assert len(tokens) == 4
    settled(stack)


def _try_generate(stack: Stack):
    try:
        return generate(stack.router_stub(), greedy_request([1, 2, 3], 4), timeout=10)[0]
    except grpc.RpcError:
        return None


@PLAINTEXT
def test_kv_stream_dropped_midway_is_retried_on_a_good_prefill(services):
    decode = services("decode")
    prefills = [services("prefill", faults="drop_after_chunks=2"), services("prefill")]
    stack = services.stack(services.router(prefills, [decode]), prefills, [decode])
    attempts = []
    for i in range(4):
        tokens, _, last = generate(stack.router_stub(), greedy_request([i + 1] * 100, 5))
        assert len(tokens) == 5
        attempts.append(last.metrics.attempts)
        # Every request ends on the good prefill: a retry never goes back to the one that failed.
        assert last.metrics.prefill_instance.endswith(f":{prefills[1].port}")
    assert 2 in attempts and set(attempts) <= {1, 2}
    settled(stack)


@PLAINTEXT  # routing, not transport
def test_a_retry_avoids_the_decode_that_failed_even_when_it_is_still_preferred(services):
    """A decode that refuses KV but stays healthy is not marked down, and least-loaded routing
    puts it first on every try (it has twice the free blocks). Only the router's `avoid` set
    sends the retry elsewhere; without it every attempt would go back to the same decode."""
    failing = services("decode", "--num-blocks", "512", faults="decode_refuse_chunks_from=1")
    good = services("decode", "--num-blocks", "256")
    prefill = services("prefill")
    flags = ("--routing-policy", "least-loaded")
    stack = services.stack(
        services.router([prefill], [failing, good], *flags), [prefill], [failing, good]
    )

    def retried() -> bool:
        return generate(stack.router_stub(), greedy_request([9] * 40, 4))[2].metrics.attempts == 2

    # Before the router's first pool reports (each second) least-loaded has no preference, and a
    # request may go straight to the good decode: wait until the preference shows.
    wait_until(retried, 15, "the router to put the decode with more free blocks first")
    for i in range(3):
        tokens, _, last = generate(stack.router_stub(), greedy_request([i + 1] * 40, 4))
        assert len(tokens) == 4
        assert last.metrics.decode_instance.endswith(f":{good.port}")
        assert last.metrics.attempts == 2  # the first try, on the preferred decode, failed
    settled(stack)


@PLAINTEXT
def test_corrupted_chunk_is_refused_and_reported(services):
    decode = services("decode")
    prefill = services("prefill", faults="corrupt_chunk=1")
    stack = services.stack(services.router([prefill], [decode]), [prefill], [decode])
    err = rpc_error(lambda: generate(stack.router_stub(), greedy_request([7] * 100, 5)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "CRC-32" in err.details() and "3 times" in err.details()
    settled(stack)


@MTLS
def test_router_killed_while_decode_holds_leases_blocks_return(services):
    decode = services("decode")
    prefill = services("prefill", faults=STALL)
    router = services.router([prefill], [decode])
    stack = services.stack(router, [prefill], [decode])
    calls = [
        stack.router_stub().Generate(greedy_request([9] * 150, 5), timeout=30) for _ in range(3)
    ]
    # One GetPoolStats for both figures: a second read could come after the leases moved on.
    stats = wait_until(lambda: _with_pending(stack.pool_stats(), 3), 10, "three leases")
    assert stats.free_blocks < stats.total_blocks
    router.stop(signal.SIGKILL)
    for call in calls:
        call.cancel()
    settled(stack)
    stack.router = services.router([prefill], [decode], port=router.port)
    stack.channels.clear()
    tokens, _, _ = generate(stack.router_stub(), greedy_request([1, 2], 3), timeout=30)
    assert len(tokens) == 3
    settled(stack)


@PLAINTEXT
def test_sigterm_drains_router_in_flight_finish_new_refused(services):
    decode = services("decode")
    prefill = services("prefill")
    router = services.router([prefill], [decode], "--grace-seconds", "60")
    stack = services.stack(router, [prefill], [decode])
    calls = [
        stack.router_stub().Generate(greedy_request([i] * 50, 300), timeout=60) for i in range(6)
    ]
    firsts = [next(call) for call in calls]  # all six are streaming
    assert all(f.token_ids for f in firsts)
    router.proc.send_signal(signal.SIGTERM)
    err = wait_until(lambda: _refused(stack), 10, "new requests to be refused")
    assert "draining" in err.details()
    for call in calls:
        rest = list(call)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in rest) + 1 == 300
    assert router.proc.wait(60) == 0
    settled(stack)


@MTLS
def test_sigterm_drains_decode(services):
    decode = services("decode", "--grace-seconds", "60")
    prefill = services("prefill")
    stack = services.stack(services.router([prefill], [decode]), [prefill], [decode])
    calls = [
        stack.router_stub().Generate(greedy_request([i] * 30, 200), timeout=60) for i in range(4)
    ]
    assert all(next(call).token_ids for call in calls)
    decode.proc.send_signal(signal.SIGTERM)
    for call in calls:
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert decode.proc.wait(60) == 0


def _refused(stack: Stack):
    try:
        generate(stack.router_stub(), greedy_request([1], 2), timeout=5)
    except grpc.RpcError as exc:
        return exc if exc.code() == grpc.StatusCode.UNAVAILABLE else None
    return None


@PLAINTEXT
def test_router_bounds_a_request_whose_client_set_no_deadline(services):
    decode = services("decode")
    prefill = services("prefill")
    stack = services.stack(
        services.router([prefill], [decode], "--request-timeout-seconds", "1"), [prefill], [decode]
    )
    call = stack.router_stub().Generate(greedy_request([3] * 20, 3500))  # no client deadline
    err = rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    settled(stack)


@PLAINTEXT
def test_a_failed_prefill_engine_fails_its_calls_at_once_and_leaves_service(services):
    """The engine loop fails outside the model call with a Prefill waiting: the call gets a clear
    status within a second (not at its deadline), the instance reports NOT_SERVING, and later
    calls are refused as UNAVAILABLE; decode gets its blocks back."""
    import time
    from pdserve.client import check_health
    from pdserve.models.loading import load_served_model
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    model = load_served_model("tinygpt", weights=False).fingerprint
    decode = services("decode")
    prefill = services("prefill", faults="prefill_engine_crash_at_step=1")
    with services.channel(decode.address) as d, services.channel(prefill.address) as p:
        lease_call = pb_grpc.DecodeServiceStub(d).Decode(
            pb.DecodeRequest(
                request_id="r",
                prompt_token_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_tokens=2),
                model_fingerprint=model,
            ),
            timeout=30,
        )
        lease = next(lease_call).lease
        request = pb.PrefillRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            sampling=pb.SamplingParams(max_tokens=2),
            lease_id=lease.lease_id,
            decode_address=decode.address,
            model_fingerprint=model,
        )
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillServiceStub(p).Prefill(request, timeout=30)
        assert time.monotonic() - started < 10.0  # told at once, not at the 30 s deadline
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "prefill engine loop fails" in err.value.details()
        wait_until(
            lambda: not check_health(prefill.address, 1.0, services.channel),
            5,
            "prefill to say NOT_SERVING",
        )
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillServiceStub(p).Prefill(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        lease_call.cancel()
        decode_stub = pb_grpc.DecodeServiceStub(d)

        def stats():
            return decode_stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)

        wait_until(lambda: stats().free_blocks == stats().total_blocks, 10, "decode's blocks")


# Each policy once, one of them under mTLS: what mTLS changes (the handshake, the reconnect)
# does not depend on the policy, and each run costs about 25 s of the CI's budget.
@pytest.mark.parametrize(
    "services, policy",
    [("plaintext", "prefix-aware"), ("mtls", "least-loaded")],
    indirect=["services"],
)
def test_one_of_two_decodes_killed_under_load_nothing_lost(services, policy):
    """40 requests sharing a system prompt, 8 at a time, over two small decode pools with the
    prefix cache, short remainders prefilled on decode. Decode 0 is killed once 10 are done.
    Every request still gets all its tokens (retried or migrated); nothing hangs; the survivor's
    pool is whole, and its cached blocks are evicted when a request needs the room."""
    decodes = [services("decode", "--num-blocks", "60") for _ in range(2)]
    prefill = services("prefill")
    flags = ("--routing-policy", policy, "--local-prefill-tokens", "64")
    stack = services.stack(services.router([prefill], decodes, *flags), [prefill], decodes)
    system = [(i * 11) % 250 + 1 for i in range(100)]

    def one(i: int) -> int:
        prompt = system + [i % 200 + 1] * (5 + i % 30)
        tokens, _, last = generate(stack.router_stub(), greedy_request(prompt, 24), 90)
        return (
            len(tokens)
            if last.usage.completion_tokens == len(tokens)
            else (
                len(tokens),
                last.usage.completion_tokens,
                last.metrics.attempts,
                last.metrics.prefill_path,
            )
        )

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        wait_until(lambda: sum(f.done() for f in futures) >= 10, 90, "10 requests to finish")
        decodes[0].stop(signal.SIGKILL)
        assert [f.result(timeout=120) for f in futures] == [24] * 40
    settled(stack)
    assert stack.pool_stats(1).cached_blocks > 0
    whole_pool = greedy_request([5] * 10, 60 * 16 - 10)  # every block: the cache must give way
    tokens, _, _ = generate(stack.router_stub(), whole_pool, 120)
    assert len(tokens) == 60 * 16 - 10
    settled(stack)


def _with_pending(stats, leases: int):
    """The stats when they show `leases` pending leases, else None (for wait_until)."""
    return stats if stats.pending_leases == leases else None
