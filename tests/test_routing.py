"""Routing policies: the order in which the router tries instances, and least-loaded end to end."""

from dataclasses import dataclass

import grpc

from procs import Stack, generate, greedy_request, start_router, start_service, wait_until
from pdserve.models.loading import load_served_model
from pdserve.services.router.policy import LeastLoaded, RoundRobin
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = load_served_model("tinygpt", weights=False).fingerprint


@dataclass
class Fake:
    address: str
    free_blocks: int = 0
    running: int = 0
    queued_tokens: int = 0


def test_round_robin_rotates_and_puts_avoided_last():
    a, b, c = Fake("a"), Fake("b"), Fake("c")
    policy = RoundRobin()
    firsts = [policy.order([a, b, c], None, ())[0].address for _ in range(3)]
    assert firsts == ["a", "b", "c"]
    assert [i.address for i in policy.order([a, b, c], None, {"a"})][-1] == "a"


def test_least_loaded_orders_decode_by_free_blocks_then_running_and_prefill_by_tokens():
    full, roomy, busy = Fake("full", 10, 0), Fake("roomy", 500, 3), Fake("busy", 500, 9)
    order = LeastLoaded("decode").order([full, busy, roomy], None, ())
    assert [i.address for i in order] == ["roomy", "busy", "full"]
    assert LeastLoaded("decode").order([full, roomy], None, {"roomy"})[0].address == "full"
    idle, queued = Fake("idle", queued_tokens=0), Fake("queued", queued_tokens=900)
    assert LeastLoaded("prefill").order([queued, idle], None, ())[0].address == "idle"


def test_least_loaded_sends_work_to_the_decode_with_room(tmp_path):
    tmp = str(tmp_path)
    decodes = [start_service("decode", "--num-blocks", "600", tmp_dir=tmp) for _ in range(2)]
    prefill = start_service("prefill", tmp_dir=tmp)
    router = start_router([prefill], decodes, "--routing-policy", "least-loaded", tmp_dir=tmp)
    stack = Stack(router, [prefill], decodes)
    held = None
    try:
        # Decode 0 holds a large reservation (a lease with no KV): far fewer free blocks.
        with grpc.insecure_channel(decodes[0].address) as channel:
            held = pb_grpc.DecodeServiceStub(channel).Decode(
                pb.DecodeRequest(
                    request_id="hold",
                    prompt_token_ids=[1] * 3000,
                    sampling=pb.SamplingParams(max_tokens=100),
                    model_fingerprint=MODEL,
                ),
                timeout=60,
            )
            next(held)

            def all_on_the_roomy_decode() -> bool:
                placed = {
                    generate(stack.router_stub(), greedy_request([i + 1] * 8, 2))[
                        2
                    ].metrics.decode_instance
                    for i in range(4)
                }
                return placed == {f"decode@127.0.0.1:{decodes[1].port}"}

            # The router learns the pools' load from GetPoolStats every second.
            wait_until(all_on_the_roomy_decode, 15, "requests to go to the decode with room")
            held.cancel()
        wait_until(stack.pools_settled, 10, "both pools to be whole again")
    finally:
        if held is not None:
            held.cancel()
        stack.stop()
