"""The model-server protocol metrics that the Gateway API Inference Extension's endpoint pickers
scrape (vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc,
vllm:cache_config_info), read from a real stack's /metrics under load and checked against what
decode's GetPoolStats says at the same moment."""

import re
import urllib.request

import grpc
import pytest

from procs import free_port, greedy_request, start_stack, wait_until
from pdserve.metrics import Load
from pdserve.models.loading import load_served_model
from pdserve.services.router.backends import BackendSet, Instance
from pdserve.v1 import pdserve_pb2 as pb

MODEL = load_served_model("tinygpt", weights=False)
NUM_BLOCKS = 600  # two full-context streams (256 blocks each) fit, a third does not
LONG = MODEL.config.max_context - 4  # with a 4-token prompt: the whole context, over a minute
WAIT = 30.0
SAMPLE = re.compile(r"^(vllm:\w+)\{(.*)\} (\S+)$")


def protocol(port: int) -> dict[str, dict]:
    """The protocol samples of one /metrics page: name -> {"value": v, "labels": {...}}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if match := SAMPLE.match(line):
            name, labels, value = match.groups()
            samples[name] = {
                "value": float(value),
                "labels": dict(re.findall(r'(\w+)="([^"]*)"', labels)),
            }
    return samples


def figures(port: int) -> tuple[float, float, float]:
    """(waiting, running, KV usage) as an endpoint picker reads them."""
    s = protocol(port)
    return tuple(
        s[f"vllm:{name}"]["value"]
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")
    )


def usage(stats: pb.GetPoolStatsResponse) -> float:
    return (stats.total_blocks - stats.free_blocks) / stats.total_blocks


@pytest.fixture(scope="module")
def gateway_stack(tmp_path_factory):
    ports = {role: free_port() for role in ("router", "decode")}
    stack = start_stack(
        str(tmp_path_factory.mktemp("gateway")),
        decode_flags=("--metrics-port", str(ports["decode"]), "--num-blocks", str(NUM_BLOCKS)),
        router_flags=("--metrics-port", str(ports["router"]), "--queue-timeout-seconds", "120"),
    )
    yield stack, ports
    stack.stop()


@pytest.fixture
def idle(gateway_stack):
    """The stack with an empty pool, left as it was found: every block free, nothing held."""
    stack, ports = gateway_stack
    wait_until(stack.pools_settled, WAIT, "decode's pool to be empty before the test")
    yield stack, ports
    wait_until(stack.pools_settled, WAIT, "decode's pool to be empty after the test")
    for port in ports.values():
        wait_until(lambda p=port: figures(p) == (0, 0, 0.0), WAIT, "the metrics back at 0")


def test_cache_configuration_is_an_info_metric(idle):
    stack, ports = idle
    stats = stack.pool_stats()
    want = {"block_size": str(stats.block_size), "num_gpu_blocks": str(NUM_BLOCKS)}
    for port in ports.values():  # the router's, once it has read decode's pool
        info = wait_until(
            lambda p=port: protocol(p).get("vllm:cache_config_info"), WAIT, "cache_config_info"
        )
        assert info["value"] == 1 and info["labels"].items() >= want.items()


def test_decode_counts_uncommitted_reservations_as_waiting(idle):
    """Leases that no prefill fills: waiting on decode, not running, and their blocks used."""
    stack, ports = idle
    calls = [
        stack.decode_stub().Decode(
            pb.DecodeRequest(
                request_id=f"waiting-{i}",
                prompt_token_ids=[i + 1] * 8,
                sampling=pb.SamplingParams(max_tokens=40),
                model_fingerprint=MODEL.fingerprint,
            ),
            timeout=60,
        )
        for i in range(2)
    ]
    try:
        assert all(next(call).HasField("lease") for call in calls)
        stats = stack.pool_stats()
        assert (stats.pending_leases, stats.running) == (2, 0)
        assert figures(ports["decode"]) == (2, 0, usage(stats)) and usage(stats) > 0
        assert figures(ports["router"])[:2] == (0, 0)  # the router holds none of them
    finally:
        for call in calls:
            call.cancel()


def test_running_streams_and_the_routers_queue(idle):
    """Two full-context streams fill decode's pool; a third waits in the router's line."""
    stack, ports = idle
    router = stack.router_stub()
    streams = []
    try:
        for i in range(2):  # one after the other: two pending leases would pass the pending share
            streams.append(router.Generate(greedy_request([10 + i] * 4, LONG), timeout=300))
            assert next(streams[-1]).token_ids  # running on decode
        stats = stack.pool_stats()
        assert stats.running == 2 and stats.free_blocks < stats.total_blocks // 2
        assert figures(ports["decode"]) == (0, 2, usage(stats))
        # The router's view of the pool is decode's last report (refreshed every second).
        wait_until(
            lambda: figures(ports["router"]) == (0, 2, usage(stats)), WAIT, "router's figures"
        )
        streams.append(router.Generate(greedy_request([20] * 4, LONG), timeout=300))
        wait_until(lambda: figures(ports["router"])[0] == 1, WAIT, "the third to queue")
        assert figures(ports["decode"])[:2] == (0, 2)
        for stream in streams[:2]:
            stream.cancel()
        # Room again: the queued request starts, and the line empties.
        assert next(streams[2]).token_ids
        wait_until(lambda: figures(ports["router"])[:2] == (0, 1), WAIT, "the queue to drain")
        assert stack.pool_stats().running == 1
    finally:
        for stream in streams:
            stream.cancel()
    with pytest.raises(grpc.RpcError) as cancelled:
        next(streams[2])
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED


def test_the_router_sums_the_pools_of_its_healthy_decodes():
    """Unhealthy instances and those not yet reported stay out of the pool; every reservation
    held counts as running, wherever it is."""
    decodes = BackendSet("decode", [], lambda channel: None, "f", "model")
    reports = {  # address: (healthy, total, free, streams)
        "a:1": (True, 100, 25, 2),
        "b:1": (True, 300, 300, 0),
        "c:1": (False, 100, 0, 1),
        "d:1": (True, 0, 0, 0),
    }
    for address, (healthy, total, free, streams) in reports.items():
        decodes.instances[address] = Instance(
            address, None, None, healthy, free_blocks=free, total_blocks=total, streams=streams
        )
        decodes.instances[address].block_size = 16 if total else 0
    assert decodes.load(waiting=3) == Load(3, 3, 75, 400, 16)
    assert Load(0, 0, 0, 0, 0).kv_usage == 0.0  # no pool known: nothing used
