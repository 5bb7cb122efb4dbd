"""`pdserve bench --endpoint openai-completions|openai-chat` drives the router's HTTP API and
times each streamed token, as it does over gRPC."""

import json
import subprocess
import sys

import pytest


def bench(tmp_path, *flags) -> dict:
    out = tmp_path / "run.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "bench",
            "--num-requests",
            "6",
            "--rate",
            "inf",
            "--concurrency",
            "3",
            "--prompt-len",
            "8",
            "--output-len",
            "5",
            "--seed",
            "3",
            "--json",
            str(out),
            *flags,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return json.loads(out.read_text())["runs"][0]


def test_bench_over_the_http_api_counts_every_streamed_token(stack, tmp_path):
    run = bench(tmp_path, "--endpoint", "openai-completions", "--http-url", stack.router.http_url)
    assert run["summary"]["ok"] == 6
    s = run["summary"]  # vLLM's keys over HTTP too; the API's responses carry no role figures
    assert s["completed"] == 6 and s["mean_itl_ms"] > 0 and s["p99_ttft_ms"] >= s["median_ttft_ms"]
    assert s["roles"]["decode"]["prefix_cache"]["hit_rate"] is None and "note" in s["roles"]
    for r in run["requests"]:
        assert r["output_tokens"] == r["max_tokens"] == 5
        assert r["server"]["completion_tokens"] == r["output_tokens"]  # usage agrees
        assert len(r["itl"]) == r["output_tokens"] - 1 and r["ttft"] > 0
        assert r["finish_reason"] == "length"


def test_chat_endpoint_with_token_prompts_says_what_to_use(stack, tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as err:
        bench(tmp_path, "--endpoint", "openai-chat", "--http-url", stack.router.http_url)
    assert b"openai-completions for token-id prompts" in err.value.stderr
