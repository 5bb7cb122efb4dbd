"""The bench client's workload, statistics and report, without a server."""

import json
import math
import statistics

import pytest

from pdserve.loadtest import cli, report, stats, workload
from pdserve.loadtest.stats import RequestResult
from pdserve.loadtest.workload import LengthRange, WorkloadSpec
from pdserve.core.config import ModelConfig


def _spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"seed": 7, **kw})


def _key(requests):
    return [(r.index, r.arrival, r.max_tokens, r.prompt_token_ids, r.prompt) for r in requests]


# ---------------------------------------------------------------------------------- workload


@pytest.mark.parametrize("kind", ["tokens", "text"])
@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
def test_same_seed_same_sequence(arrival, kind):
    a = workload.generate(_spec(arrival=arrival, burstiness=0.5, prompt_kind=kind), 200)
    b = workload.generate(_spec(arrival=arrival, burstiness=0.5, prompt_kind=kind), 200)
    assert _key(a) == _key(b)
    assert len(a) == 200


def test_different_seed_differs():
    a = workload.generate(_spec(seed=1), 50)
    b = workload.generate(_spec(seed=2), 50)
    assert [r.arrival for r in a] != [r.arrival for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in b]
    assert [r.max_tokens for r in a] != [r.max_tokens for r in b]


def test_rate_only_scales_arrivals():
    slow = workload.generate(_spec(rate=2.0), 50)
    fast = workload.generate(_spec(rate=8.0), 50)
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert [r.max_tokens for r in slow] == [r.max_tokens for r in fast]
    for s, f in zip(slow, fast):
        assert s.arrival == pytest.approx(4 * f.arrival)


def test_lengths_and_token_ranges():
    reqs = workload.generate(
        _spec(prompt_len=LengthRange(64, 256), output_len=LengthRange(16, 48)), 500
    )
    assert reqs[0].arrival == 0.0
    assert all(b.arrival >= a.arrival for a, b in zip(reqs, reqs[1:]))
    assert {64 <= r.prompt_len <= 256 and 16 <= r.max_tokens <= 48 for r in reqs} == {True}
    assert all(32 <= t <= 126 for r in reqs for t in r.prompt_token_ids)
    # Uniform over the range: both ends get reached with 500 draws.
    assert min(r.max_tokens for r in reqs) == 16 and max(r.max_tokens for r in reqs) == 48
    fixed = workload.generate(
        _spec(prompt_len=LengthRange.parse("100"), output_len=LengthRange.parse("8")), 20
    )
    assert {(r.prompt_len, r.max_tokens) for r in fixed} == {(100, 8)}


def test_text_prompts_match_token_prompts():
    toks = workload.generate(_spec(prompt_kind="tokens"), 10)
    text = workload.generate(_spec(prompt_kind="text"), 10)
    for t, x in zip(toks, text):
        assert list(x.prompt.encode("ascii")) == list(t.prompt_token_ids)
        assert x.prompt_len == t.prompt_len


def test_poisson_mean_rate():
    reqs = workload.generate(_spec(rate=16.0, prompt_len=LengthRange(1, 1)), 20001)
    gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]
    rate = len(gaps) / sum(gaps)
    assert rate == pytest.approx(16.0, rel=0.03)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1.0, abs=0.05)


def test_gamma_burstiness_keeps_rate_and_raises_cv():
    def gaps(**kw):
        reqs = workload.generate(_spec(rate=10.0, prompt_len=LengthRange(1, 1), **kw), 20001)
        return [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]

    poisson = gaps(arrival="poisson")
    bursty = gaps(arrival="gamma", burstiness=0.25)
    smooth = gaps(arrival="gamma", burstiness=4.0)
    cv = {
        name: statistics.pstdev(g) / statistics.fmean(g)
        for name, g in (("poisson", poisson), ("bursty", bursty), ("smooth", smooth))
    }
    assert len(bursty) / sum(bursty) == pytest.approx(10.0, rel=0.06)
    assert len(smooth) / sum(smooth) == pytest.approx(10.0, rel=0.03)
    assert cv["bursty"] > 1.5 * cv["poisson"]  # expected 2.0 vs 1.0
    assert cv["bursty"] == pytest.approx(2.0, rel=0.15)
    assert cv["smooth"] == pytest.approx(0.5, rel=0.1)


def test_duration_and_infinite_rate():
    reqs = workload.generate(_spec(rate=10.0), duration=5.0)
    assert reqs and all(r.arrival < 5.0 for r in reqs)
    assert 25 <= len(reqs) <= 80
    burst = workload.generate(_spec(rate=math.inf), 5)
    assert [r.arrival for r in burst] == [0.0] * 5
    with pytest.raises(ValueError):
        workload.generate(_spec(rate=math.inf), duration=1.0)


def test_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"prompt number {i}", "max_tokens": i + 1} for i in range(5)]
    lines.append({"prompt": "no max tokens"})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    spec = _spec(dataset=str(path), output_len=LengthRange(3, 3))
    a = workload.generate(spec, 12)
    assert _key(a) == _key(workload.generate(spec, 12))
    # Two shuffled passes: each prompt exactly twice, and max_tokens from the line or the range.
    assert sorted(r.prompt for r in a) == sorted([x["prompt"] for x in lines] * 2)
    for r in a:
        assert r.max_tokens == (3 if r.prompt == "no max tokens" else int(r.prompt.split()[-1]) + 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        workload.generate(_spec(dataset=str(bad)), 1)


def test_spec_validation():
    with pytest.raises(ValueError):
        WorkloadSpec(arrival="uniform")
    with pytest.raises(ValueError):
        WorkloadSpec(rate=0)
    with pytest.raises(ValueError):
        WorkloadSpec(arrival="gamma", burstiness=0)
    with pytest.raises(ValueError):
        LengthRange.parse("10-5")
    assert LengthRange.parse("64-256") == LengthRange(64, 256)


# ---------------------------------------------------------------------------------- stats


def test_percentiles_known_values():
    xs = list(range(1, 101))  # 1..100
    assert stats.percentile(xs, 50) == pytest.approx(50.5)
    assert stats.percentile(xs, 90) == pytest.approx(90.1)
    assert stats.percentile(xs, 99) == pytest.approx(99.01)
    assert stats.percentile(xs, 0) == 1 and stats.percentile(xs, 100) == 100
    assert stats.percentile([3.0], 99) == 3.0
    assert stats.percentile([10, 0], 25) == pytest.approx(2.5)  # unsorted input
    assert math.isnan(stats.percentile([], 50))
    d = stats.describe([4.0, 1.0, None, 2.0, 3.0])
    assert d == {
        "count": 4,
        "mean": 2.5,
        "min": 1.0,
        "max": 4.0,
        "p50": 2.5,
        "p90": pytest.approx(3.7),
        "p99": pytest.approx(3.97),
    }
    assert stats.describe([])["p50"] is None


def _result(i, ttft, e2e, tokens, status="OK", **kw):
    return RequestResult(
        index=i,
        request_id=str(i),
        prompt_tokens=100,
        max_tokens=tokens,
        scheduled=0.0,
        sent=0.0,
        status=status,
        ttft=ttft,
        e2e=e2e,
        output_tokens=tokens,
        **kw,
    )


def test_tpot():
    assert _result(0, 0.1, 1.1, 11).tpot == pytest.approx(0.1)
    assert _result(0, 0.1, 0.1, 1).tpot is None


def test_goodput_counting():
    results = [
        _result(0, 0.10, 0.10 + 9 * 0.02, 10),  # meets both
        _result(1, 0.30, 0.30 + 9 * 0.02, 10),  # TTFT too slow
        _result(2, 0.10, 0.10 + 9 * 0.08, 10),  # TPOT too slow
        _result(3, 0.15, 0.15, 1),  # one token: judged on TTFT only, meets
        _result(4, None, None, 0, status="RESOURCE_EXHAUSTED"),
        _result(5, 0.05, 0.05 + 9 * 0.05, 10),  # exactly at the TPOT objective: meets
    ]
    assert stats.goodput(results, 2.0, 0.2, 0.05) == pytest.approx(3 / 2.0)
    assert stats.goodput(results, 2.0, None, None) == pytest.approx(5 / 2.0)
    assert stats.goodput(results, 2.0, 0.2, None) == pytest.approx(4 / 2.0)
    s = stats.summarize(results, 2.0, 0.2, 0.05)
    assert (s["requests"], s["ok"], s["failed"]) == (6, 5, 1)
    assert s["by_status"] == {"OK": 5, "RESOURCE_EXHAUSTED": 1}
    assert s["requests_meeting_slo"] == 3 and s["goodput"] == pytest.approx(1.5)
    assert s["output_tokens"] == 41 and s["output_tokens_per_second"] == pytest.approx(20.5)
    assert s["input_tokens"] == 500
    assert s["ttft_seconds"]["count"] == 5 and s["tpot_seconds"]["count"] == 4


# ---------------------------------------------------------------------------------- report, CLI


def test_parameter_count_matches_model():
    config = ModelConfig()
    n = report.parameter_count(config)
    assert n == 5_905_408
    import torch
    from pdserve.models.tinygpt import TinyGPT

    torch.manual_seed(0)
    small = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, max_context=128)
    assert report.parameter_count(small) == sum(p.numel() for p in TinyGPT(small).parameters())


def _model_info(name: str) -> dict:
    """What a server's GetModelInfo says for a built-in model, as fetch_model_info returns it."""
    from pdserve.models.loading import load_served_model
    from pdserve.rpc.convert import model_info_to_pb

    info = model_info_to_pb(load_served_model(name, weights=False))
    return {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields}


def test_conditions_and_text(tmp_path):
    from pdserve.loadtest.runner import RunOptions, RunResult

    spec = _spec(rate=16.0)
    options = RunOptions("127.0.0.1:1", num_requests=2)
    conds = report.conditions(
        spec,
        [16.0],
        options,
        model_info=_model_info("tinygpt"),
        label="test",
        preset="chapter",
        slo_ttft=0.2,
        slo_tpot=0.05,
    )
    model = conds["model"]
    assert (model["name"], model["architecture"], model["dtype"]) == (
        "tinygpt",
        "TinyGPT",
        "float32",
    )
    assert model["kv_bytes_per_token"] == 2 * 6 * 4 * 64 * 4  # 12288: K+V, layers, heads, dim, fp32
    assert model["reported_by"] == "the target's GetModelInfo"
    results = [
        _result(
            0,
            0.1,
            0.5,
            5,
            server={
                "handoff_bytes": 4096,
                "handoff_seconds": 0.001,
                "time_to_first_token_seconds": 0.09,
            },
        ),
        _result(1, None, None, 0, status="UNAVAILABLE"),
    ]
    doc = report.document(conds, [RunResult(spec, results, 1.0, 0.0)], 0.2, 0.05)
    text = report.report_text(doc)
    assert "1 ok, 1 failed (1 UNAVAILABLE)" in text
    assert "tinygpt (TinyGPT, float32, 5,905,408 params)" in text and "seed 7" in text
    path = tmp_path / "r.json"
    report.write_json(doc, path)
    loaded = report.load_json(path)
    assert loaded["conditions"]["model"]["parameters"] == 5_905_408
    assert loaded["conditions"]["workload"]["arrival"] == "poisson"
    assert loaded["runs"][0]["summary"]["handoff_bytes"]["p50"] == 4096


def test_smollm2_conditions_count_its_parameters():
    model = report.model_conditions(_model_info("smollm2-135m-instruct"))
    assert (model["name"], model["architecture"], model["dtype"]) == (
        "smollm2-135m-instruct",
        "LlamaForCausalLM",
        "bfloat16",
    )
    assert model["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # 23040
    # SmolLM2-135M's published count: embeddings 49152 x 576 (tied with the head) + 30 layers x
    # (q 576x576, k and v 576x192 each, o 576x576, MLP 3 x 576x1536, 2 norms of 576) + norm 576
    assert (
        model["parameters"]
        == 49152 * 576
        + 30 * (576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536 + 2 * 576)
        + 576
        == 134_515_008
    )


def test_conditions_without_model_info_say_unknown():
    from pdserve.loadtest.runner import RunOptions

    conds = report.conditions(
        _spec(),
        [4.0],
        RunOptions("127.0.0.1:1", num_requests=1),
        model_unavailable="the target at x does not implement GetModelInfo",
    )
    assert conds["model"]["name"] is None and conds["model"]["parameters"] is None
    assert "does not implement GetModelInfo" in conds["model"]["note"]
    assert report.conditions_line(conds).startswith("Conditions: model unknown, ")
    # A server whose fingerprint the client cannot reproduce gets no parameter count.
    info = {**_model_info("tinygpt"), "fingerprint": "0" * 16}
    assert report.model_conditions(info)["parameters"] is None


def test_fetch_model_info_reports_or_explains():
    """Against a server whose ModelInfoService answers, and one that leaves it unimplemented."""
    import asyncio

    import grpc

    from pdserve.loadtest.runner import fetch_model_info
    from pdserve.v1 import pdserve_pb2 as pb
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    class Answers(pb_grpc.ModelInfoServiceServicer):
        async def GetModelInfo(self, request, context):
            return pb.GetModelInfoResponse(
                model=pb.ModelInfo(name="tinygpt", architecture="TinyGPT", kv_bytes_per_token=12288)
            )

    async def ask(servicer) -> tuple:
        server = grpc.aio.server()
        pb_grpc.add_ModelInfoServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await fetch_model_info(f"127.0.0.1:{port}", timeout=10)
        finally:
            await server.stop(None)

    info, why = asyncio.run(ask(Answers()))
    assert why == "" and info["name"] == "tinygpt" and info["kv_bytes_per_token"] == 12288
    info, why = asyncio.run(ask(pb_grpc.ModelInfoServiceServicer()))  # the base: UNIMPLEMENTED
    assert info is None and "does not implement GetModelInfo" in why


def test_cli_rates_presets_and_times():
    assert cli.parse_rates("16") == [16.0]
    assert cli.parse_rates("2,4, 8") == [2.0, 4.0, 8.0]
    assert cli.parse_rates("2:8:2") == [2.0, 4.0, 6.0, 8.0]
    assert cli.parse_rates("inf") == [math.inf]
    with pytest.raises(ValueError):
        cli.parse_rates("0")
    assert cli.seconds("200ms") == pytest.approx(0.2)
    assert cli.seconds("1.5") == 1.5
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_bench(parser.add_subparsers())
    spec, rates, options, _ = cli.build(parser.parse_args(["bench", "--preset", "chapter"]))
    assert (
        spec.arrival,
        rates,
        str(spec.prompt_len),
        str(spec.output_len),
        spec.seed,
        options.num_requests,
    ) == ("poisson", [16.0], "64-256", "16-48", 7, 100)
    spec, rates, options, _ = cli.build(
        parser.parse_args(["bench", "--preset", "chapter", "--rate", "4,8", "-n", "20"])
    )
    assert rates == [4.0, 8.0] and options.num_requests == 20 and spec.seed == 7
    spec, rates, options, _ = cli.build(parser.parse_args(["bench", "--duration", "3"]))
    assert options.num_requests is None and options.duration == 3.0


# ---------------------------------------------------------------------------------- vLLM's keys


def _timed(i, sent, ttft, itl, status="OK", max_tokens=None, **kw):
    """A request sent at `sent`, its first token at ttft and the rest `itl` apart."""
    tokens = len(itl) + 1 if status == "OK" else 0
    return RequestResult(
        index=i,
        request_id=str(i),
        prompt_tokens=100,
        max_tokens=max_tokens or tokens,
        scheduled=0.0,
        sent=sent,
        status=status,
        error="" if status == "OK" else "boom",
        ttft=ttft if status == "OK" else None,
        e2e=ttft + sum(itl) if status == "OK" else None,
        output_tokens=tokens,
        itl=list(itl),
        **kw,
    )


def _three():
    return [
        _timed(0, 0.0, 0.1, [0.1] * 4),  # e2e 0.5, TPOT 0.1: meets TTFT 200 ms and TPOT 150 ms
        _timed(1, 0.2, 0.3, [0.2] * 3),  # e2e 0.9, TPOT 0.2: misses both
        _timed(2, 0.4, 0.0, [], status="UNAVAILABLE", max_tokens=3),
    ]


def test_percentile_flags_and_vllm_naming():
    assert stats.parse_percentiles("50, 90,p99.9,90") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError):
        stats.parse_percentiles("101")
    assert [stats.percentile_word(q) for q in (99.0, 99.9, 50)] == ["99", "99.9", "50"]
    d = stats.describe([1.0, 2.0, 3.0, 4.0], [25, 99.9])
    assert d["p25"] == pytest.approx(1.75) and d["p99.9"] == pytest.approx(3.997)
    assert {"p50", "p90", "p99"} <= d.keys()  # kept for the text, sweep table and charts
    assert stats.std([100.0, 300.0]) == pytest.approx(100.0)  # population, as np.std


def test_vllm_metrics_hand_computed():
    m = stats.vllm_metrics(_three(), 2.0, slo_ttft=0.2, slo_tpot=0.15, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (200, 9)
    assert m["duration"] == 2.0 and m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(104.5)
    assert m["request_goodput"] == pytest.approx(0.5)  # request 0 alone, over 2 s
    # TTFT 100 and 300 ms; TPOT 100 and 200 ms; ITL 4 x 100 and 3 x 200 ms; E2EL 500, 900 ms.
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["std_ttft_ms"]) == pytest.approx(
        (200.0, 200.0, 100.0)
    )
    assert m["p50_ttft_ms"] == pytest.approx(200.0) and m["p99_ttft_ms"] == pytest.approx(298.0)
    assert (m["mean_tpot_ms"], m["std_tpot_ms"], m["p99_tpot_ms"]) == pytest.approx(
        (150.0, 50.0, 199.0)
    )
    assert m["mean_itl_ms"] == pytest.approx(1000 / 7) and m["median_itl_ms"] == pytest.approx(100)
    assert m["std_itl_ms"] == pytest.approx(100 * math.sqrt(12) / 7)  # sqrt(4/7 * 3/7) * 100
    assert m["p99_itl_ms"] == pytest.approx(200.0)
    assert (m["mean_e2el_ms"], m["median_e2el_ms"]) == pytest.approx((700.0, 700.0))
    assert "p90_ttft_ms" not in m  # only the percentiles asked for
    # Tokens at 0.1..0.5 s (request 0) and 0.5, 0.7, 0.9, 1.1 s (request 1): 8 in the first
    # second; both requests are active in it.
    assert (m["max_output_tokens_per_s"], m["max_concurrent_requests"]) == (8.0, 2)
    assert stats.vllm_metrics(_three(), 2.0)["request_goodput"] is None  # no objective
    lists = stats.vllm_lists(_three())
    assert lists["input_lens"] == [100, 100, 100] and lists["output_lens"] == [5, 4, 0]
    assert lists["ttfts"] == [0.1, 0.3, 0.0] and lists["errors"] == ["", "", "boom"]
    assert lists["latencies"] == pytest.approx([0.5, 0.9, 0.0])
    assert lists["itls"][1] == [0.2] * 3 and lists["start_times"] == [0.0, 0.2, 0.4]


def test_slo_attainment_per_request_and_per_token():
    s = stats.summarize(_three(), 2.0, slo_ttft=0.2, slo_tpot=0.15)
    assert s["requests_meeting_slo"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["request_goodput"] == s["goodput"]
    assert s["slo_attainment"] == pytest.approx(1 / 3)  # the failed request misses
    assert s["slo_attainment_by_objective"] == pytest.approx({"ttft": 1 / 3, "tpot": 1 / 3})
    # Request 0: 5 of 5 on time; request 1: late first token, gaps of 200 > 150 ms: 0 of 4;
    # the failed one: its 3 asked-for tokens late. 5 of 12.
    assert s["slo_attainment_per_token"] == pytest.approx(5 / 12)
    assert s["output_token_goodput"] == pytest.approx(5 / 2.0)
    # Only the TPOT objective: request 1's first token is on time, its gaps still late.
    assert stats.token_attainment(_three(), None, 0.15) == pytest.approx(6 / 12)
    # An E2EL objective of 600 ms: request 0 (500 ms) meets it, request 1 (900 ms) does not.
    assert stats.goodput(_three(), 2.0, None, None, 0.6) == pytest.approx(0.5)
    assert stats.goodput(_three(), 2.0, None, None, 1.0) == pytest.approx(1.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0) and s["ttft_seconds"]["p99"] == 0.298


def test_goodput_flag_takes_vllms_syntax():
    assert cli.parse_goodput(["ttft:500", "tpot:100"]) == {"ttft": 0.5, "tpot": 0.1}
    assert cli.parse_goodput(["e2el:2000,ttft:50"]) == {"e2el": 2.0, "ttft": 0.05}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            cli.parse_goodput(bad)
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_bench(parser.add_subparsers())
    v = cli.resolve(parser.parse_args(["bench", "--goodput", "ttft:500", "e2el:3000"]))
    assert (v["slo_ttft"], v["slo_tpot"], v["slo_e2el"]) == (0.5, None, 3.0)  # as vLLM: no TPOT
    v = cli.resolve(parser.parse_args(["bench"]))
    assert (v["slo_ttft"], v["slo_tpot"], v["slo_e2el"]) == (0.5, 0.05, None)
    with pytest.raises(ValueError, match="not both"):
        cli.resolve(parser.parse_args(["bench", "--goodput", "ttft:5", "--slo-tpot", "1"]))
    args = parser.parse_args(["bench", "--metric-percentiles", "90,99.9"])
    assert args.percentiles == (90.0, 99.9)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--percentiles", "200"])


def test_roles_prefix_hit_rates_and_throughput_per_core():
    results = _three()
    results[0].server = {"prefill_path": "prefill", "prefill_cached_tokens": 40}
    results[0].server["prefix_cached_tokens"] = 20
    results[1].server = {"prefill_path": "decode", "prefix_cached_tokens": 30}
    r = stats.roles(results, 2.0, prefill_cores=2, decode_cores=0.5)
    # Prefill saw request 0 alone: 40 of its 100 prompt tokens cached, 60 computed in 2 s.
    assert r["prefill"]["prefix_cache"] == {"lookup_tokens": 100, "hit_tokens": 40, "hit_rate": 0.4}
    assert (
        r["prefill"]["tokens_per_second"] == 30 and r["prefill"]["tokens_per_second_per_core"] == 15
    )
    # Decode looked up both prompts: 20 + 30 of 200 tokens; 9 output tokens in 2 s on 0.5 cores.
    assert r["decode"]["prefix_cache"]["hit_rate"] == pytest.approx(0.25)
    assert r["decode"]["prefilled_here"] == 1
    assert r["decode"]["tokens_per_second_per_core"] == pytest.approx(9.0)
    scraped = {"roles": {"prefill": {"cpu_seconds": 1.5, "prompt_tokens": 60.0}}}
    srv = stats.roles(results, 2.0, scraped=scraped)["prefill"]["server_metrics"]
    assert srv["busy_cores"] == pytest.approx(0.75) and srv["tokens_per_cpu_second"] == 40
    colocated = stats.roles(_three(), 2.0)
    assert colocated["prefill"]["prefix_cache"]["hit_rate"] is None and "note" in colocated


def test_scrape_parses_counters_by_role():
    from pdserve.loadtest import scrape

    def text(cpu, hits, prompt):
        return (
            "# TYPE process_cpu_seconds_total counter\n"
            f"process_cpu_seconds_total {cpu}\n"
            "# TYPE pdserve_prefix_cache_lookup_tokens_total counter\n"
            f'pdserve_prefix_cache_lookup_tokens_total{{service="prefill"}} {4 * hits}\n'
            "# TYPE pdserve_prefix_cache_hit_tokens_total counter\n"
            f'pdserve_prefix_cache_hit_tokens_total{{service="prefill"}} {hits}\n'
            "# TYPE pdserve_tokens_total counter\n"
            f'pdserve_tokens_total{{kind="prompt",service="prefill"}} {prompt}\n'
        )

    before = [{"url": "a", **scrape.parse(text(1.0, 10, 100))}, {"url": "b", "error": "refused"}]
    after = [{"url": "a", **scrape.parse(text(3.5, 30, 400))}, {"url": "b", "error": "refused"}]
    assert before[0]["role"] == "prefill"
    d = scrape.deltas(before, after)
    assert d["roles"]["prefill"] == {
        "cpu_seconds": 2.5,
        "prefix_lookup_tokens": 80.0,
        "prefix_hit_tokens": 20.0,
        "prompt_tokens": 300.0,
        "instances": 1,
    }
    assert d["errors"] == ["b: refused"]
