"""Every service exposes Prometheus metrics; the handoff is measured on both sides."""

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from procs import free_port, generate, greedy_request, start_stack, wait_until


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


PROMETHEUS_CONFIG = """
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: pdserve
    static_configs:
      - targets: [{targets}]
"""


@pytest.fixture
def prometheus(metered_stack, tmp_path):
    """A real Prometheus server (Debian's package) scraping the stack's three metrics ports."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/test.sh installs Debian's package"
    _, ports = metered_stack
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_CONFIG.format(
        targets=", ".join(f"'127.0.0.1:{p}'" for p in ports.values())))
    port = free_port()
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def promql(base: str, query: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return []  # not up yet
    return body["data"]["result"] if body.get("status") == "success" else []


def test_prometheus_scrapes_handoff_latency_under_load(metered_stack, prometheus):
    stack, _ = metered_stack
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: generate(stack.router_stub(), greedy_request([i] * 200, 4)),
                      range(16)))
    query = ('histogram_quantile(0.9, sum by (le) '
             '(pdserve_handoff_seconds_bucket{service="prefill"}))')
    result = wait_until(lambda: [r for r in promql(prometheus, query)
                                 if r["value"][1] not in ("NaN", "0")], 60,
                        "Prometheus to answer the handoff latency quantile")
    p90 = float(result[0]["value"][1])
    assert 1e-4 <= p90 <= 60
    wait_until(lambda: any(float(r["value"][1]) >= 16 for r in promql(
        prometheus, 'pdserve_handoff_seconds_count{service="decode"}')), 30,
        "Prometheus to have scraped decode's handoff count")
