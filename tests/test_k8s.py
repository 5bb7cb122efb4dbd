"""The Kubernetes manifests (deploy/k8s): both overlays render, every document validates offline
against the Kubernetes schemas (kubernetes-validate, strict), and the NetworkPolicies select the
pods and ports they claim to."""

import importlib.util
import pathlib

import kubernetes_validate
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("render", ROOT / "deploy/k8s/render.py")
render_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render_module)
KUBERNETES = "1.37.0"
OVERLAYS = {"1p1d": (1, 1), "4p8d": (4, 8)}


def rendered(overlay: str) -> list[dict]:
    return render_module.render(ROOT / "deploy/k8s/overlays" / overlay)


def by(docs, kind, name) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_document_validates_against_the_kubernetes_schemas(overlay):
    docs = rendered(overlay)
    assert {d["kind"] for d in docs} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises on any error


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_overlays_scale_prefill_and_decode_on_their_own(overlay):
    docs = rendered(overlay)
    prefills, decodes = OVERLAYS[overlay]
    assert by(docs, "Deployment", "prefill")["spec"]["replicas"] == prefills
    assert by(docs, "Deployment", "decode")["spec"]["replicas"] == decodes
    assert by(docs, "Deployment", "router")["spec"]["replicas"] == 1
    for name in ("prefill", "decode"):  # headless: DNS names every replica, for discovery
        assert by(docs, "Service", name)["spec"]["clusterIP"] == "None"


def _pod_labels(docs, component) -> dict:
    return by(docs, "Deployment", component)["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _who_may_reach(docs, component: str, port: int) -> set[str]:
    """The components a NetworkPolicy lets reach `component` on `port`."""
    allowed = set()
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        if not _selects(policy["spec"]["podSelector"], _pod_labels(docs, component)):
            continue
        for rule in policy["spec"]["ingress"]:
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            for peer in rule["from"]:
                for other in ("router", "prefill", "decode"):
                    if _selects(peer["podSelector"], _pod_labels(docs, other)):
                        allowed.add(other)
                if peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}:
                    allowed.add("prometheus")
    return allowed


def test_network_policies_select_what_they_claim():
    docs = rendered("1p1d")
    assert _who_may_reach(docs, "prefill", 50052) == {"router"}
    assert _who_may_reach(docs, "decode", 50053) == {"router", "prefill"}
    assert _who_may_reach(docs, "decode", 50054) == {"prefill"}  # the KV data plane
    assert _who_may_reach(docs, "decode", 9102) == {"prometheus"}
    assert _who_may_reach(docs, "prefill", 9101) == {"prometheus"}
    # The ports the policies guard are the ones the services listen on.
    env = {
        e["name"]: e["value"]
        for e in by(docs, "Deployment", "decode")["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
    }
    assert (env["PDSERVE_PORT"], env["PDSERVE_KV_DATA_PORT"]) == ("50053", "50054")


def test_decode_drains_within_its_termination_grace_period():
    pod = by(rendered("1p1d"), "Deployment", "decode")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert pod["terminationGracePeriodSeconds"] > float(env["PDSERVE_GRACE_SECONDS"])
