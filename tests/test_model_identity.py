"""One model per stack: services refuse peers, leases and KV of another model, and say which.

KV computed by one model and decoded by another is fluent garbage, so it must never get that far.
Two TinyGPTs that differ only in dtype have different fingerprints, which makes the mismatch cheap
to set up.
"""

import grpc
import pytest

from procs import generate, greedy_request, start_service, wait_until
from pdserve.models.loading import load_served_model
from pdserve.rpc import model_info
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

OTHER = ("--dtype", "bfloat16")  # the tests' TinyGPT in another dtype: another fingerprint


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    """A router (float32) whose only decode serves the bfloat16 model."""
    tmp = str(tmp_path_factory.mktemp("mismatch"))
    decode = start_service("decode", *OTHER, "--torch-threads", "1", tmp_dir=tmp)
    prefill = start_service("prefill", "--torch-threads", "1", tmp_dir=tmp)
    router = start_service(
        "router", "--prefill", prefill.address, "--decode", decode.address, tmp_dir=tmp, ready=False
    )
    yield router, prefill, decode
    for service in (router, prefill, decode):
        service.stop()


def test_router_refuses_a_decode_that_serves_another_model(mismatched):
    router, _, decode = mismatched
    with grpc.insecure_channel(router.address) as channel:
        stub = pb_grpc.RouterServiceStub(channel)

        def refused():
            try:
                generate(stub, greedy_request([1, 2, 3], 2), timeout=5)
            except grpc.RpcError as exc:
                return exc if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else None
            raise AssertionError("a mismatched stack served a request")

        err = wait_until(refused, 30, "the router to learn which model decode serves")
    mine = load_served_model("tinygpt", weights=False)
    theirs = load_served_model("tinygpt", "bfloat16", weights=False)
    assert theirs.fingerprint in err.details() and mine.fingerprint in err.details()
    # Which instance it was is for the operator (the router's log), not for the client.
    assert decode.address not in err.details()
    assert "refusing decode" in router.log() and decode.address in router.log()


def test_decode_refuses_a_lease_and_kv_of_another_model(mismatched):
    _, _, decode = mismatched
    with grpc.insecure_channel(decode.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        request = pb.DecodeRequest(
            request_id="x",
            prompt_token_ids=[1, 2],
            sampling=pb.SamplingParams(max_tokens=2),
            model_fingerprint="0123456789abcdef",
        )
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Decode(request, timeout=5))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "0123456789abcdef" in err.value.details()
        info = model_info.fetch_blocking(channel, timeout=5)
        assert info.dtype == "bfloat16" and info.name == "tinygpt"
        # A lease for the right model, then a chunk that names another.
        request.model_fingerprint = info.fingerprint
        call = stub.Decode(request, timeout=10)
        lease = next(call).lease
        chunk = pb.KvChunk(
            lease_id=lease.lease_id,
            index=0,
            layer=0,
            token_start=0,
            token_end=2,
            dtype=pb.D_TYPE_BFLOAT16,
            shape=[2, 2, 4, 64],
            model_fingerprint="0123456789abcdef",
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.PushKv(iter([pb.PushKvRequest(chunk=chunk, data=bytes(2048))]), timeout=5)
        assert "0123456789abcdef" in err.value.details()
        call.cancel()
        wait_until(lambda: _settled(stub), 10, "decode's pool to be whole again")


def test_prefill_refuses_a_request_for_another_model(mismatched):
    _, prefill, _ = mismatched
    with grpc.insecure_channel(prefill.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.PrefillServiceStub(channel).Prefill(
                pb.PrefillRequest(
                    request_id="x",
                    prompt_token_ids=[1],
                    sampling=pb.SamplingParams(max_tokens=1),
                    lease_id="l",
                    decode_address="127.0.0.1:1",
                    model_fingerprint="feedfeedfeedfeed",
                ),
                timeout=5,
            )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "feedfeedfeedfeed" in err.value.details()


def _settled(stub) -> bool:
    stats = stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
    return stats.free_blocks == stats.total_blocks and stats.pending_leases == 0


@pytest.mark.parametrize("dtype, size", [("bfloat16", 2), ("float16", 2)])
def test_half_precision_kv_moves_half_the_bytes(tmp_path, dtype, size):
    from procs import start_stack

    flags = ("--dtype", dtype)
    stack = start_stack(str(tmp_path), decode_flags=flags, prefill_flags=flags, router_flags=flags)
    try:
        tokens, _, last = generate(stack.router_stub(), greedy_request(list(range(40)), 8))
        config = load_served_model("tinygpt", dtype, weights=False).config
        assert len(tokens) == 8
        assert last.metrics.handoff.bytes == 40 * config.kv_bytes_per_token
        assert config.kv_bytes_per_token == 2 * 6 * 4 * 64 * size
    finally:
        stack.stop()
