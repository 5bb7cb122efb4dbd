"""Every service exposes Prometheus metrics; the handoff is measured on both sides."""

import urllib.request

import pytest

from procs import free_port, generate, greedy_request, start_stack


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture(scope="module")
def metered_stack(tmp_path_factory):
    ports = {role: free_port() for role in ("router", "prefill", "decode")}
    stack = start_stack(str(tmp_path_factory.mktemp("metered")),
                        decode_flags=("--metrics-port", str(ports["decode"])),
                        prefill_flags=("--metrics-port", str(ports["prefill"])),
                        router_flags=("--metrics-port", str(ports["router"])))
    yield stack, ports
    stack.stop()


def test_handoff_latency_and_counts_on_every_service(metered_stack):
    stack, ports = metered_stack
    for n in (10, 100, 300):
        generate(stack.router_stub(), greedy_request(list(range(n % 256)) * (n // 256 + 1), 4))
    router, prefill, decode = (scrape(ports[r]) for r in ("router", "prefill", "decode"))
    for service, samples in (("router", router), ("prefill", prefill), ("decode", decode)):
        assert samples[f'pdserve_handoff_seconds_count{{service="{service}"}}'] == 3
        assert samples[f'pdserve_handoff_seconds_sum{{service="{service}"}}'] > 0
    assert router['pdserve_requests_total{code="OK",outcome="ok",service="router"}'] == 3
    assert router['pdserve_tokens_total{kind="generated",service="router"}'] == 12
    assert decode['pdserve_kv_blocks_used{service="decode"}'] == 0
    assert decode['pdserve_decode_batch_size_count{service="decode"}'] >= 3
    assert prefill['pdserve_prefill_batch_size_count{service="prefill"}'] >= 1
