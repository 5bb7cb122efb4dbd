"""The decode service's ownership rules, driven directly over gRPC with KV computed here."""

import signal
import threading
import time

import grpc
import pytest

from procs import start_service, wait_until
from reference import model
from pdserve.kv import wire as kv_wire
from pdserve.models.loading import load_served_model
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

PROMPT = list(range(40, 90))
MODEL = load_served_model("tinygpt", weights=False).fingerprint  # what every lease and chunk names


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    # Without the prefix cache: these tests send every prompt token's KV, and a cache would hold
    # PROMPT after the first of them. test_a_lease_takes_no_kv_for_what_the_cache_holds is the
    # protocol with the cache.
    service = start_service(
        "decode",
        "--torch-threads",
        "1",
        "--prefix-cache",
        "false",
        tmp_dir=str(tmp_path_factory.mktemp("decode")),
    )
    channel = grpc.insecure_channel(service.address)
    yield pb_grpc.DecodeServiceStub(channel)
    channel.close()
    service.stop(signal.SIGKILL)


@pytest.fixture(autouse=True)
def pool_returns(decode):
    yield
    wait_until(
        lambda: _stats(decode).free_blocks == _stats(decode).total_blocks,
        10,
        "the decode pool to be empty again",
    )


def _stats(stub) -> pb.GetPoolStatsResponse:
    return stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)


def reserve(stub, request_id="r1", ttl=0.0, max_tokens=4):
    call = stub.Decode(
        pb.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT,
            lease_ttl_seconds=ttl,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            model_fingerprint=MODEL,
        ),
        timeout=30,
    )
    return call, next(call).lease


def kv_pushes(
    lease_id: str, request_id: str = "r1", first_token: int = 3, prompt=PROMPT, skip: int = 0
) -> list[pb.PushKvRequest]:
    """A valid KV stream for PROMPT, computed by the model here, ending with its commit; with
    `skip`, from that token on (what a lease with cached_tokens expects)."""
    layers = []
    model().prefill_packed([prompt], lambda layer, k, v: layers.append((layer, k, v)))
    pushes, crcs = [], []
    for layer, k, v in layers:
        for piece in kv_wire.split_layer(k[skip:], v[skip:], tokens_per=32):
            start, end = skip + piece.token_start, skip + piece.token_end
            crcs.append(piece.crc32c)
            pushes.append(
                pb.PushKvRequest(
                    data=piece.payload(),
                    chunk=pb.KvChunk(
                        lease_id=lease_id,
                        index=len(crcs) - 1,
                        layer=layer,
                        token_start=start,
                        token_end=end,
                        dtype=pb.D_TYPE_FLOAT32,
                        shape=[2, end - start, 4, 64],
                        crc32c=crcs[-1],
                        model_fingerprint=MODEL,
                    ),
                )
            )
    pushes.append(
        pb.PushKvRequest(
            commit=pb.KvCommit(
                lease_id=lease_id,
                first_token_id=first_token,
                num_chunks=len(crcs),
                digest=kv_wire.digest(crcs),
                request_id=request_id,
                prompt_digest=kv_wire.prompt_digest(PROMPT),
            )
        )
    )
    return pushes


def push(stub, pushes):
    return stub.PushKv(iter(pushes), timeout=10)


def push_error(stub, pushes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        push(stub, pushes)
    return err.value


def test_unknown_lease_is_refused(decode):
    err = push_error(decode, kv_pushes("no-such-lease"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown" in err.details()


def test_expired_lease_is_refused_and_its_blocks_return(decode):
    call, lease = reserve(decode, ttl=0.3)
    assert lease.blocks > 0  # what it held (pool stats read now could already see them back)
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.ABORTED and "expired" in ended.value.details()
    err = push_error(decode, kv_pushes(lease.lease_id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_lease_receiving_kv_still_expires_at_its_ttl(decode):
    """KV started arriving, then stopped with no commit: the lease's own time limit ends it,
    not only the no-first-chunk deadline, and its blocks come back."""
    ttl = 3.0
    started = time.monotonic()
    call, lease = reserve(decode, ttl=ttl)
    pushes, resume = kv_pushes(lease.lease_id), threading.Event()

    def stalled():
        yield pushes[0]  # accepted at once: the lease is receiving
        resume.wait(60)

    push_call = decode.PushKv.future(stalled(), timeout=60)
    try:
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
    finally:
        resume.set()
    assert ended.value.code() == grpc.StatusCode.ABORTED
    assert "expired before its KV was committed" in ended.value.details()
    assert time.monotonic() - started >= ttl  # it lived its time, and no more was needed
    with pytest.raises(grpc.RpcError):
        push_call.result(timeout=30)  # the stalled stream is refused, not left open


def test_commit_is_idempotent_and_a_conflicting_one_is_refused(decode):
    # Long enough that the sequence is still decoding (its lease known) when the conflicting
    # commit comes: with 4 tokens it could end first, and the lease be unknown by then.
    call, lease = reserve(decode, max_tokens=400)
    pushes = kv_pushes(lease.lease_id)
    assert push(decode, pushes).newly_committed
    again = push(decode, [pushes[-1]])
    assert not again.newly_committed and again.bytes == 2 * 6 * 4 * 64 * len(PROMPT) * 4
    conflicting = pb.PushKvRequest(
        commit=pb.KvCommit(
            lease_id=lease.lease_id,
            first_token_id=4,
            num_chunks=pushes[-1].commit.num_chunks,
            digest=pushes[-1].commit.digest,
            request_id="r1",
            prompt_digest=pushes[-1].commit.prompt_digest,
        )
    )
    err = push_error(decode, [conflicting])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "other contents" in err.details()
    events = list(call)
    tokens = [t for e in events for t in (e.tokens.token_ids or e.finished.last.token_ids)]
    assert tokens[0] == 3 and len(tokens) == 400  # the committed first token, then decode's
    assert events[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH


def test_a_finished_lease_cannot_be_replayed(decode):
    call, lease = reserve(decode, max_tokens=2)
    pushes = kv_pushes(lease.lease_id)
    push(decode, pushes)
    list(call)
    wait_until(lambda: _stats(decode).free_blocks == _stats(decode).total_blocks, 10, "free")
    err = push_error(decode, pushes)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_commit_for_another_request_is_refused(decode):
    call, lease = reserve(decode, request_id="mine")
    err = push_error(decode, kv_pushes(lease.lease_id, request_id="someone-else"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "another request" in err.details()
    with pytest.raises(grpc.RpcError) as ended:  # the lease is void: no tokens, ever
        list(call)
    assert ended.value.code() == grpc.StatusCode.ABORTED


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda c: setattr(c, "index", 5), "expected chunk 0"),
        (lambda c: setattr(c, "dtype", pb.D_TYPE_FLOAT16), "dtype"),
        (lambda c: c.shape.__setitem__(2, 8), "shape"),
        (lambda c: setattr(c, "token_end", 999), "outside"),
        (lambda c: setattr(c, "crc32c", c.crc32c ^ 1), "CRC"),
        (lambda c: setattr(c, "layer", 6), "layer"),
    ],
)
def test_a_bad_first_chunk_voids_the_lease(decode, damage, words):
    call, lease = reserve(decode)
    pushes = kv_pushes(lease.lease_id)
    damage(pushes[0].chunk)
    err = push_error(decode, pushes)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert "rejected" in ended.value.details()


def test_a_stream_that_ends_before_its_commit_voids_the_lease(decode):
    call, lease = reserve(decode)
    err = push_error(decode, kv_pushes(lease.lease_id)[:3])
    assert "without a commit" in err.details()
    with pytest.raises(grpc.RpcError):
        list(call)


def test_reservations_without_kv_cannot_take_the_whole_pool(decode):
    """A caller that reserves and never sends KV is stopped at the pending share (0.5 by
    default): the other half stays for sequences that have their KV. Its reservations expire
    when no chunk comes, and an ordinary request gets room again."""

    def big():
        call = decode.Decode(
            pb.DecodeRequest(
                request_id="big",
                prompt_token_ids=[1] * 4000,
                sampling=pb.SamplingParams(max_tokens=96),
                model_fingerprint=MODEL,
                lease_ttl_seconds=1.0,  # the first-chunk deadline follows a shorter lease
            ),
            timeout=30,
        )
        return call, next(call)

    total = _stats(decode).total_blocks
    fits = (total // 2) // (4096 // 16)  # what the pending share lets through
    held = [big() for _ in range(fits)]
    assert all(event.lease.blocks == 4096 // 16 for _, event in held)
    with pytest.raises(grpc.RpcError) as err:
        big()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-pending-lease-share" in err.value.details()
    normal = wait_until(lambda: _try_reserve(decode), 10, "the idle reservations to expire")
    normal.cancel()
    for call, _ in held:
        call.cancel()


def _try_reserve(stub):
    try:
        return reserve(stub, "normal")[0]
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return None


@pytest.mark.parametrize("asked", [1e9, -5.0, float("nan")])
def test_a_caller_cannot_lengthen_or_break_the_lease_ttl(decode, asked):
    call, lease = reserve(decode, ttl=asked)
    assert 0 < lease.expires_at_unix - time.time() <= 30.0 + 1.0  # the server's default TTL
    call.cancel()


def test_a_lease_takes_no_kv_for_what_the_cache_holds(tmp_path):
    """With the prefix cache, a second lease for PROMPT says its first 48 tokens (3 full blocks,
    never the last token) are cached. KV from token 0 is refused and voids the lease; KV from
    token 48 commits."""
    service = start_service("decode", "--torch-threads", "1", tmp_dir=str(tmp_path))
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            call, lease = reserve(stub, max_tokens=2)
            assert lease.cached_tokens == 0
            push(stub, kv_pushes(lease.lease_id))
            list(call)  # decodes and ends: PROMPT's full blocks are cached before its last token
            call, lease = reserve(stub, max_tokens=2)
            assert lease.cached_tokens == 48
            err = push_error(stub, kv_pushes(lease.lease_id))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "expected 48" in err.details()
            call, lease = reserve(stub, max_tokens=2)
            reply = push(stub, kv_pushes(lease.lease_id, skip=lease.cached_tokens))
            assert reply.newly_committed and reply.bytes == (len(PROMPT) - 48) * 12288  # TinyGPT
            assert len([e for e in call if e.HasField("tokens") or e.HasField("finished")]) > 0
            stats = _stats(stub)
            assert stats.free_blocks == stats.total_blocks and stats.cached_blocks >= 3
    finally:
        service.stop()


def test_a_cache_salt_over_64_bytes_is_refused(decode):
    call = decode.Decode(
        pb.DecodeRequest(
            request_id="salty",
            prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=2),
            model_fingerprint=MODEL,
            cache_salt=b"x" * 65,
        ),
        timeout=30,
    )
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt is longer than 64 bytes" in err.value.details()
