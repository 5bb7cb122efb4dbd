"""Every service exposes Prometheus metrics; the handoff is measured on both sides."""

import json
import shutil
import subprocess
import sys
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
    stack = start_stack(
        str(tmp_path_factory.mktemp("metered")),
        decode_flags=("--metrics-port", str(ports["decode"])),
        prefill_flags=("--metrics-port", str(ports["prefill"])),
        router_flags=("--metrics-port", str(ports["router"])),
    )
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
    config.write_text(
        PROMETHEUS_CONFIG.format(targets=", ".join(f"'127.0.0.1:{p}'" for p in ports.values()))
    )
    port = free_port()
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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
        list(
            pool.map(
                lambda i: generate(stack.router_stub(), greedy_request([i] * 200, 4)), range(16)
            )
        )
    query = (
        'histogram_quantile(0.9, sum by (le) (pdserve_handoff_seconds_bucket{service="prefill"}))'
    )
    result = wait_until(
        lambda: [r for r in promql(prometheus, query) if r["value"][1] not in ("NaN", "0")],
        60,
        "Prometheus to answer the handoff latency quantile",
    )
    p90 = float(result[0]["value"][1])
    assert 1e-4 <= p90 <= 60
    wait_until(
        lambda: any(
            float(r["value"][1]) >= 16
            for r in promql(prometheus, 'pdserve_handoff_seconds_count{service="decode"}')
        ),
        30,
        "Prometheus to have scraped decode's handoff count",
    )


def histogram(samples: dict[str, float], name: str, service: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram's buckets, in order."""
    prefix = f'{name}_bucket{{le="'
    rows = [
        (float(key[len(prefix) :].split('"')[0]), value)
        for key, value in samples.items()
        if key.startswith(prefix) and f'service="{service}"' in key
    ]
    return sorted(rows)


def bucket_of(buckets: list[tuple[float, float]], rank: int) -> tuple[float, float]:
    """(lower, upper] bounds of the bucket holding the rank-th smallest observation (1-based)."""
    lower = 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            return lower, upper
        lower = upper
    raise AssertionError(f"rank {rank} beyond the histogram")


def test_bench_summary_agrees_with_the_servers_metrics(metered_stack, tmp_path):
    stack, ports = metered_stack
    before = scrape(ports["router"])
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "bench",
            "--address",
            stack.router.address,
            "--num-requests",
            "100",
            "--rate",
            "25",
            "--prompt-len",
            "16-128",
            "--output-len",
            "4-12",
            "--seed",
            "3",
            "--no-progress",
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    after = scrape(ports["router"])
    ok_key = 'pdserve_requests_total{code="OK",outcome="ok",service="router"}'
    assert summary["requests"] == 100
    assert summary["ok"] == after[ok_key] - before.get(ok_key, 0) == 100
    tokens_key = 'pdserve_tokens_total{kind="generated",service="router"}'
    assert summary["output_tokens"] == after[tokens_key] - before.get(tokens_key, 0)
    # Only this run's observations: subtract the buckets as they were before it.
    old = dict(histogram(before, "pdserve_time_to_first_token_seconds", "router"))
    buckets = [
        (upper, count - old.get(upper, 0))
        for upper, count in histogram(after, "pdserve_time_to_first_token_seconds", "router")
    ]
    n = summary["ttft_seconds"]["count"]
    for q in (50, 90, 99):
        position = q / 100 * (n - 1)  # linear interpolation between these two ranks
        low = bucket_of(buckets, int(position) + 1)[0]
        high = bucket_of(buckets, min(int(position) + 2, n))[1]
        assert low <= summary["server_ttft_seconds"][f"p{q}"] <= high
        assert summary["ttft_seconds"][f"p{q}"] >= low  # the client sees the token later


PHASES = ("routing", "decode_room", "prefill_call", "prefill_queue", "prefill_compute")
PHASES += ("transfer_after_compute",)
PHASES += ("relay",)  # together they tile the time to first token; first_decode_step follows it


def test_the_time_to_first_token_is_told_in_phases(metered_stack):
    """The final response splits the TTFT into phases that add up to it; each is observed in
    the router's pdserve_request_phase_seconds; `pdserve generate` prints the split."""
    stack, ports = metered_stack
    before = scrape(ports["router"])
    _, _, last = generate(stack.router_stub(), greedy_request(list(range(200)), 6))
    m, p = last.metrics, last.metrics.phases
    parts = [getattr(p, f"{name}_seconds") for name in PHASES]
    assert all(part >= 0 for part in parts) and p.decode_room_seconds > 0
    assert (p.prefill_queue_seconds, p.prefill_compute_seconds) == (
        m.queue_seconds,
        m.prefill_seconds,
    )
    assert p.transfer_after_compute_seconds == m.handoff.exposed_seconds
    ttft = m.time_to_first_token_seconds
    # Exact, unless prefill's parts overlapped the first token's way back (the rest is then 0).
    assert abs(sum(parts) - ttft) < 1e-9 or (p.relay_seconds == 0 and sum(parts) >= ttft)
    assert 0 < p.first_decode_step_seconds < m.end_to_end_seconds - ttft
    after = scrape(ports["router"])
    for phase in (*PHASES, "first_decode_step"):
        key = f'pdserve_request_phase_seconds_count{{phase="{phase}",service="router"}}'
        assert after[key] == before.get(key, 0) + 1
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "hello", "--max-tokens", "4"]
        + ["--address", stack.router.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    split = next(line for line in done.stderr.splitlines() if line.startswith("time to first"))
    assert all(f"{phase} " in split for phase in (*PHASES, "first_decode_step"))
