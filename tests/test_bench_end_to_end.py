"""`pdserve bench` against a real stack: `pdserve up` on a free port, 20 requests at 8 req/s,
its services' /metrics read too; and that stack's prefill sending KV to its own decode only."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from pdserve.loadtest import cli, report
from pdserve.client import check_health
from pdserve.core.config import ModelConfig
from pdserve.launcher import free_port
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

READY_SECONDS = 90.0
NUM_REQUESTS = 20


@pytest.fixture(scope="module")
def stack():
    port, prefill_port = free_port(), free_port()
    metrics_port = _free_ports_in_a_row(3)  # router; prefill and decode on the next two
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--port",
            str(port),
            "--prefill-port",
            str(prefill_port),
            "--http-port",
            "0",
            "--metrics-base-port",
            str(metrics_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"},
    )
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + READY_SECONDS
        # Ready: the router says SERVING, all three services' /metrics answer, and one request
        # goes through (a router's health can pass a moment before its first handoff can).
        while not (
            check_health(address, timeout=1.0)
            and _metrics_answer(metrics_port)
            and _one_request_served(address)
        ):
            if proc.poll() is not None:
                pytest.fail(f"pdserve up exited ({proc.returncode}): {_stderr_tail(proc)}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the stack was not serving after {READY_SECONDS:.0f} s: {_stderr_tail(proc)}"
                )
            time.sleep(0.25)
        yield address, metrics_port, f"127.0.0.1:{prefill_port}"
    finally:
        _stop(proc)


def _metrics_answer(base: int) -> bool:
    for port in range(base, base + 3):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        except OSError:
            return False
    return True


def _one_request_served(address: str) -> bool:
    request = pb.GenerateRequest(
        prompt_token_ids=[7] * 8, sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)
    )
    with grpc.insecure_channel(address) as channel:
        try:
            list(pb_grpc.RouterServiceStub(channel).Generate(request, timeout=10))
        except grpc.RpcError:
            return False
    return True


def _stderr_tail(proc: subprocess.Popen) -> str:
    """What the stack has written to stderr so far (without waiting for more)."""
    chunks = []
    while select.select([proc.stderr], [], [], 0)[0]:
        chunk = os.read(proc.stderr.fileno(), 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")[-3000:]


def _free_ports_in_a_row(count: int) -> int:
    """A port free with the `count - 1` after it: free_port() vouches for one only, and the
    one after it may be another connection's (a service that cannot bind its metrics port
    exits, and the stack then answers UNAVAILABLE)."""
    for _ in range(100):
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError(f"no {count} free ports in a row")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to `pdserve up` (it stops its three services); then the whole group, by force."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started, services included
    except ProcessLookupError:
        pass
    proc.wait(10)
    proc.stderr.close()


def test_bench_against_stack(stack, tmp_path, capsys):
    stack, metrics_port, _ = stack
    out = tmp_path / "run.json"
    rc = cli.main(
        [
            "--address",
            stack,
            "--percentiles",
            "50,90,99,99.9",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            "--prefill-cores",
            "1",
            "--decode-cores",
            "2",
            "--metrics-url",
            *(f"http://127.0.0.1:{metrics_port + i}/metrics" for i in (1, 2)),
            "--rate",
            "8",
            "-n",
            str(NUM_REQUESTS),
            "--prompt-len",
            "16-64",
            "--output-len",
            "8-16",
            "--seed",
            "3",
            "--label",
            "disaggregated",
            "--json",
            str(out),
            "--timeout",
            "30",
        ]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert f"{NUM_REQUESTS} ok, 0 failed" in stdout
    assert "TTFT" in stdout and "goodput" in stdout
    assert "Conditions: tinygpt (TinyGPT, float32, 5,905,408 params)" in stdout

    doc = report.load_json(out)
    conds = doc["conditions"]
    # The model as the stack reports it (conftest makes every service serve TinyGPT).
    model = conds["model"]
    assert model["reported_by"] == "the target's GetModelInfo"
    assert (model["name"], model["architecture"], model["dtype"]) == (
        "tinygpt",
        "TinyGPT",
        "float32",
    )
    assert model["fingerprint"] and model["server"]["num_layers"] == ModelConfig().n_layers
    assert model["kv_bytes_per_token"] == ModelConfig().kv_bytes_per_token
    assert model["parameters"] == report.parameter_count(ModelConfig())
    assert conds["cpu"]["model"] and conds["software"]["torch"]
    assert conds["seed"] == 3 and conds["rates"] == [8.0]
    assert conds["workload"]["arrival"] == "poisson"
    assert conds["workload"]["prompt_len"] == "16-64"
    assert conds["target"] == {"address": stack, "label": "disaggregated"}
    assert conds["date"]

    (run,) = doc["runs"]
    s = run["summary"]
    assert (s["requests"], s["ok"], s["failed"]) == (NUM_REQUESTS, NUM_REQUESTS, 0)
    assert s["by_status"] == {"OK": NUM_REQUESTS}
    requests = run["requests"]
    assert len(requests) == NUM_REQUESTS
    assert sorted(r["index"] for r in requests) == list(range(NUM_REQUESTS))
    kv_per_token = model["kv_bytes_per_token"]  # what the server says its KV costs per token
    for r in requests:
        assert r["status"] == "OK" and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: exact lengths
        assert len(r["itl"]) == r["output_tokens"] - 1
        assert 0 < r["ttft"] <= r["e2e"]
        assert r["tpot"] == pytest.approx(
            (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1), rel=1e-4, abs=1e-6
        )
        srv = r["server"]
        assert srv["completion_tokens"] == r["output_tokens"]
        assert srv["prompt_tokens"] == r["prompt_tokens"]
        assert srv["handoff_bytes"] == r["prompt_tokens"] * kv_per_token
        assert srv["handoff_seconds"] > 0
        # Exposed runs from prefill's compute end, handoff from its first chunk sent: on a busy
        # machine the first chunk can leave after compute ends, so exposed may exceed handoff.
        # Both end at the commit, which the router waits for before its final response.
        assert 0 <= srv["handoff_exposed_seconds"] <= srv["end_to_end_seconds"]
        # The server's TTFT starts later (on receipt) than the client's (on send).
        assert srv["time_to_first_token_seconds"] <= r["ttft"] + 1e-3
    assert s["output_tokens"] == sum(r["max_tokens"] for r in requests)
    assert s["input_tokens"] == sum(r["prompt_tokens"] for r in requests)
    for key in (
        "ttft_seconds",
        "tpot_seconds",
        "itl_seconds",
        "e2e_seconds",
        "handoff_bytes",
        "handoff_seconds",
    ):
        d = s[key]
        assert d["p50"] is not None and d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert s["goodput"] <= s["request_throughput"]
    assert s["slo_attainment"] == s["requests_meeting_slo"] / NUM_REQUESTS
    assert 0 <= s["slo_attainment_per_token"] <= 1

    # vLLM's result keys, with its meanings and units (ms).
    assert (s["completed"], s["failed"]) == (NUM_REQUESTS, 0)
    assert s["total_input_tokens"] == s["input_tokens"]
    assert s["total_output_tokens"] == s["output_tokens"]
    assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration"])
    assert s["request_goodput"] == s["goodput"] <= s["request_throughput"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert s[f"mean_{name}_ms"] > 0 and s[f"std_{name}_ms"] >= 0
        assert s[f"median_{name}_ms"] <= s[f"p99_{name}_ms"] <= s[f"p99.9_{name}_ms"]
        assert s[f"p50_{name}_ms"] == s[f"median_{name}_ms"]
    assert s["p99_ttft_ms"] == pytest.approx(s["ttft_seconds"]["p99"] * 1e3)
    assert s["ttft_seconds"]["p99.9"] >= s["ttft_seconds"]["p99"]
    assert s["mean_handoff_ms"] > 0 and s["median_handoff_exposed_ms"] >= 0
    assert s["handoff_transports"] and s["prefill_paths"] == {"prefill": NUM_REQUESTS}
    assert run["input_lens"] == [r["prompt_tokens"] for r in requests]
    assert run["output_lens"] == [r["output_tokens"] for r in requests]
    assert run["ttfts"] == [r["ttft"] for r in requests] and run["errors"] == [""] * NUM_REQUESTS
    assert all(r["meets_slo"] for r in requests)  # objectives far above TinyGPT's latencies

    # Each role: prefix hits from the responses, and what its /metrics counted over the run.
    roles = s["roles"]
    prefill, decode = roles["prefill"], roles["decode"]
    assert prefill["prefix_cache"]["lookup_tokens"] == s["input_tokens"]
    assert 0 <= prefill["prefix_cache"]["hit_rate"] <= 1
    assert 0 <= decode["prefix_cache"]["hit_rate"] <= 1
    assert prefill["tokens_per_second_per_core"] == pytest.approx(prefill["tokens_per_second"])
    assert decode["tokens_per_second_per_core"] == pytest.approx(s["output_throughput"] / 2)
    for role in (prefill, decode):
        srv = role["server_metrics"]
        assert srv["instances"] == 1 and srv["cpu_seconds"] > 0 and srv["busy_cores"] > 0
        # Nothing else is sent to this stack, so its counters saw exactly the bench's prompts.
        assert srv["prefix_lookup_tokens"] == role["prefix_cache"]["lookup_tokens"]
        assert srv["prefix_hit_tokens"] == role["prefix_cache"]["hit_tokens"]
    assert prefill["server_metrics"]["prompt_tokens"] == prefill["prompt_tokens_computed"]

    # Re-rendering saved results (and a chart, when matplotlib is there) needs no server.
    args = ["--from-json", str(out)]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(tmp_path / "cdf.png")]
    except ImportError:
        pass
    assert cli.main(args) == 0
    assert f"{NUM_REQUESTS} ok, 0 failed" in capsys.readouterr().out
    if "--plot" in args:
        assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(doc, allow_nan=False)  # strict JSON


def test_the_stacks_prefill_dials_no_loopback_port_but_its_decodes(stack):
    """A Prefill call naming another local port (any local user can make one over plaintext)
    is refused before a connection is tried: `pdserve up` gives prefill its decode's address
    as the allow-list, where without one any loopback port would be dialled."""
    _, _, prefill = stack
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        with grpc.insecure_channel(prefill) as channel:
            info = pb_grpc.ModelInfoServiceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), timeout=10
            )
            request = pb.PrefillRequest(
                request_id="probe",
                prompt_token_ids=[7] * 8,
                sampling=pb.SamplingParams(max_tokens=1),
                lease_id="0" * 32,
                decode_address=f"127.0.0.1:{port}",
                model_fingerprint=info.model.fingerprint,
                data_endpoints=[pb.DataEndpoint(transport="tcp", port=port)],
            )
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert "--decode-allow" in err.value.details()
        assert not select.select([listener], [], [], 0.5)[0], "prefill connected anyway"
    finally:
        listener.close()
