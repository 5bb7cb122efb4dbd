"""deploy/k8s/overlays/autoscale: KEDA ScaledObjects for prefill and decode. Every document of the
overlay validates offline (built-in kinds against the Kubernetes schemas, the ScaledObjects
against KEDA's own CRD, tests/fixtures/keda), each ScaledObject targets a Deployment of the
build, its queries read metrics pdserve exports, and its thresholds are the ones bench/autoscale.py
derives from the committed results. Then the scaler's decision rule, the function the replay
uses, against hand-computed cases."""

import importlib.util
import pathlib
import re
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from test_k8s import KUBERNETES, _strict, by, rendered  # the kustomize build and helpers

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("autoscale", ROOT / "bench/autoscale.py")
autoscale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(autoscale)

CRD = next(
    d
    for d in yaml.safe_load_all(
        (ROOT / "tests/fixtures/keda/keda.sh_scaledobjects.yaml").read_text()
    )
    if d
)
(SO_VERSION,) = [v for v in CRD["spec"]["versions"] if v["name"] == "v1alpha1"]
SO_SCHEMA = _strict(SO_VERSION["schema"]["openAPIV3Schema"])
POD_CORES = 2  # the base's prefill and decode pods request 2 CPUs


def _docs() -> list[dict]:
    return rendered("autoscale")


def _scaled(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}


def test_the_fixture_is_keda_scaledobject_crd():
    assert CRD["spec"]["group"] == "keda.sh"
    assert CRD["spec"]["names"]["kind"] == "ScaledObject"
    assert SO_VERSION["served"] and SO_VERSION["storage"]
    assert "x-kubernetes-validations" not in yaml.safe_dump(CRD)  # no CEL rules to check by hand


def test_autoscale_overlay_validates_offline():
    docs = _docs()
    assert {d["kind"] for d in docs} >= {"ScaledObject", "Deployment", "Service"}
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            assert doc["apiVersion"] == "keda.sh/v1alpha1"
            jsonschema.validate(doc, SO_SCHEMA)  # raises on any error, unknown fields included
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_one_scaledobject_per_scaled_role_targeting_its_deployment():
    docs = _docs()
    scaled = _scaled(docs)
    assert set(scaled) == {"prefill", "decode"}  # the router stays fixed
    assert by(docs, "Deployment", "router")["spec"]["replicas"] == 1
    for name, so in scaled.items():
        ref = so["spec"]["scaleTargetRef"]
        target = by(docs, ref.get("kind", "Deployment"), ref["name"])  # raises if absent
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", name)
        assert target["apiVersion"] == ref["apiVersion"]
        lo, hi = autoscale.LIMITS[name]  # the replay's scaler has the same limits
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (lo, hi)
        assert so["spec"]["pollingInterval"] == autoscale.POLLING_INTERVAL_SECONDS
        down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] == autoscale.SCALE_DOWN_WINDOW_SECONDS
        assert down["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": autoscale.SCALE_DOWN_PERIOD_SECONDS}
        ]
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] == "prometheus"
            assert trigger["metricType"] == "AverageValue"  # ceil(value / threshold)
            assert (
                set(trigger["metadata"])
                == {
                    "serverAddress",
                    "query",
                    "threshold",
                    "ignoreNullValues",
                }
            )  # the Prometheus scaler's documented parameters: keda.sh/docs/2.17/scalers/prometheus/


@pytest.mark.parametrize(
    "change",
    [
        lambda so: so["spec"].update(scaleTargetRef={"kind": "Deployment"}),  # no name
        lambda so: so["spec"].pop("triggers"),
        lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=296),  # not a string
        lambda so: so["spec"].update(maxReplicas=8),  # the HPA's name, not KEDA's
        lambda so: so["spec"]["triggers"][0].update(useCachedMetrics=True),  # not in this CRD
    ],
)
def test_the_crd_schema_refuses_what_it_does_not_define(change):
    so = _scaled(_docs())["prefill"]
    change(so)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, SO_SCHEMA)


def _exported_names() -> set[str]:
    from prometheus_client import REGISTRY

    import pdserve.metrics as m

    names = {m.PROTOCOL_WAITING, m.PROTOCOL_RUNNING, m.PROTOCOL_KV_USAGE, m.PROTOCOL_CACHE_INFO}
    for family in REGISTRY.collect():
        names |= {s.name for s in family.samples} | {family.name}
    for metric in vars(m).values():  # a labelled metric has no samples until it is used
        if hasattr(metric, "_name") and hasattr(metric, "_type"):
            base = metric._name
            names |= {base, base + "_total", base + "_sum", base + "_count", base + "_bucket"}
    return names


def test_the_queries_read_metrics_pdserve_exports():
    exported = _exported_names()
    for so in _scaled(_docs()).values():
        for trigger in so["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            used = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", query))
            assert used and used <= exported, (so["metadata"]["name"], used - exported)
            service = so["metadata"]["name"]
            assert set(re.findall(r'service="(\w+)"', query)) == {service}


def test_the_thresholds_are_the_ones_derived_from_the_results():
    figures = autoscale.measured_figures(threads=POD_CORES)
    th = autoscale.derive_thresholds(
        figures["prefill_tokens_per_s"], figures["decode_step_seconds"], figures["startup_seconds"]
    )
    scaled = _scaled(_docs())
    got = {t["name"]: float(t["metadata"]["threshold"]) for so in scaled.values()
           for t in so["spec"]["triggers"]}  # fmt: skip
    assert got == {
        "queued_prompt_tokens": th.prefill_queued_tokens,
        "running_sequences": th.decode_running_sequences,
        "kv_cache_usage": th.decode_kv_usage,
    }
    # The figures docs/kubernetes.md quotes.
    assert (th.prefill_queued_tokens, th.decode_running_sequences, th.decode_kv_usage) == (
        296,
        10,
        0.87,
    )
    one = autoscale.measured_figures(threads=1)
    th1 = autoscale.derive_thresholds(
        one["prefill_tokens_per_s"], one["decode_step_seconds"], one["startup_seconds"]
    )
    assert (th1.prefill_queued_tokens, th1.decode_running_sequences, th1.decode_kv_usage) == (
        183,
        4,
        0.92,
    )


# --- the decision rule, by hand ---


def test_derivation_by_hand():
    steps = {1: 0.05, 16: 0.20}  # 10 ms more per added sequence
    assert autoscale.step_seconds(steps, 6) == pytest.approx(0.10)
    assert autoscale.step_seconds(steps, 31) == pytest.approx(0.35)  # extended past 16
    assert autoscale.sequences_at_itl(steps, 0.105) == 6  # 0.05 + 5 x 0.01 = 0.10 <= 0.105
    assert autoscale.sequences_at_itl(steps, 0.04) == 0  # not even one sequence
    th = autoscale.derive_thresholds(200.0, steps, 10.0, itl_goal=0.105, wait_budget=1.5)
    assert th.prefill_queued_tokens == 300  # 200 tok/s x 1.5 s
    assert th.decode_running_sequences == 6
    # (200 + 6 / 0.105) x 10 / 32768 = 0.0785 of the pool: 1 - 0.0785 = 0.9215, down to 0.92
    assert th.decode_kv_usage == 0.92


def test_a_trigger_asks_for_ceil_of_value_over_threshold_outside_the_tolerance():
    assert autoscale.trigger_replicas(1, 370, 183) == 3  # 370 / 183 = 2.02
    assert autoscale.trigger_replicas(2, 380, 183) == 2  # 380 / 366 = 1.04: within 10 %
    assert autoscale.trigger_replicas(2, 420, 183) == 3  # 420 / 366 = 1.15
    assert autoscale.trigger_replicas(3, 366, 183) == 2  # 0.67: down
    assert autoscale.trigger_replicas(2, 0, 183) == 0
    assert autoscale.trigger_replicas(1, 8, 4) == 2  # exactly 2.0 stays 2, not 3


def test_decode_takes_the_larger_of_its_triggers_and_the_limits():
    th = autoscale.Thresholds(183, 4, 0.92)
    s = autoscale.scalers(th)["decode"]
    # running 9 / 4 -> 3; KV 1.5 / 0.92 -> 2: three
    assert s.decide(0, {"running_sequences": 9, "kv_usage": 1.5}) == 3
    s = autoscale.scalers(th)["decode"]
    assert s.decide(0, {"running_sequences": 1, "kv_usage": 2.0}) == 3  # KV: 2.17 -> 3
    s = autoscale.scalers(th)["decode"]
    assert s.decide(0, {"running_sequences": 0, "kv_usage": 0}) == 1  # minReplicaCount
    s = autoscale.scalers(th)["prefill"]
    assert s.decide(0, {"queued_prompt_tokens": 1e6}) == 5  # from 1: max(2 x 1, 1 + 4)
    assert s.decide(20, {"queued_prompt_tokens": 1e6}) == 8  # maxReplicaCount


def test_scale_down_waits_out_the_window_then_one_pod_per_period():
    s = autoscale.scalers(autoscale.Thresholds(100, 4, 0.9))["prefill"]
    assert s.decide(0, {"queued_prompt_tokens": 500}) == 5
    got = {t: s.decide(t, {"queued_prompt_tokens": 0}) for t in range(10, 130, 10)}
    # The 5 of t=0 leaves the 60 s window at t=60; then one pod per 30 s.
    assert got == {10: 5, 20: 5, 30: 5, 40: 5, 50: 5, 60: 4, 70: 4, 80: 4, 90: 3, 100: 3,
                   110: 3, 120: 2}  # fmt: skip


def test_the_prefill_query_by_hand():
    samples = {
        ("pdserve_prefill_queued_prompt_tokens", (("service", "prefill"),)): 1200,
        ("pdserve_prefill_queued_prompt_tokens", (("service", "prefill"), ("pod", "b"))): 300,
        ("pdserve_queue_depth", (("service", "prefill"),)): 3,  # requests, not tokens
    }
    assert autoscale.prefill_value(samples) == 1500
    assert autoscale.decode_values(
        {
            ("pdserve_running_sequences", (("service", "decode"),)): 7,
            ("vllm:kv_cache_usage_perc", (("service", "decode"),)): 0.25,
        }
    ) == {"running_sequences": 7, "kv_usage": 0.25}
