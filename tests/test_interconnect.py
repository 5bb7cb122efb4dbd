"""The interconnect benchmark, reduced: at 100 Mbit/s a >= 1 MiB handoff takes bytes / rate.

It creates its own network namespaces (see bench/interconnect.py); where this machine cannot create
them (no root, no iproute2), the test is skipped with that reason, since there is no link to shape.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def can_make_namespaces() -> bool:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    name = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


# Both tests shape a link between namespaces they create; without root or iproute2 there is no
# link to shape. CI runs as root with iproute2, so they run there.
needs_namespaces = pytest.mark.skipif(
    not can_make_namespaces(),
    reason="network namespaces cannot be created here (needs root and iproute2)",
)


@needs_namespaces
def test_handoff_at_100mbit_matches_bytes_over_rate(tmp_path):
    out = tmp_path / "interconnect.json"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "interconnect.py"),
            "--rates",
            "100mbit",
            "--lengths",
            "256",
            "--reps",
            "2",
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
        cwd=ROOT,
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["handoff_bytes"] >= 1 << 20
        predicted = row["handoff_bytes"] * 8 / 100e6
        assert abs(row["handoff_s"] - predicted) / predicted < 0.25, row
        assert row["ttft_s"] >= predicted  # the slow link, not the prefill, sets the TTFT


@needs_namespaces
def test_short_prompts_skip_a_congested_100mbit_link(tmp_path):
    """The conditional-disaggregation benchmark, reduced. Concurrent long prompts share the
    100 Mbit/s link, and every request must complete. (Before, a sender that had handed its last
    bytes to the kernel gave decode 1 s to answer; on a shared slow link they were still queued,
    and the handoff failed.) The router with auto derives a threshold, and what it prefills on
    decode crosses the link without KV; the router without it prefills nothing on decode."""
    out = tmp_path / "local_prefill.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "local_prefill.py"), "--rounds", "1"]
        + ["--requests", "12", "--rate", "4", "--json", str(out)],
        check=True,
        timeout=400,
        cwd=ROOT,
        env=dict(os.environ, PDSERVE_BENCH_LOGS=str(tmp_path)),
    )
    result = json.loads(out.read_text())
    assert result["threshold_derived"] is not None and result["threshold_derived"] > 0
    for entry in result["rounds"]:
        rows = entry["rows"]
        assert len(rows) == 12  # the load client fails the run if any request fails
        on_decode = [r for r in rows if r["path"] == "decode"]
        handed_off = [r for r in rows if r["path"] == "prefill"]
        assert len(on_decode) + len(handed_off) == 12
        if entry["router"] == "off":
            assert not on_decode
        # Which prompts auto sends depends on the threshold it derived from this run's link.
        assert all(r["handoff_bytes"] == 0 and r["prompt_tokens"] <= 512 for r in on_decode)
        assert all(r["handoff_bytes"] > 0 for r in handed_off)
