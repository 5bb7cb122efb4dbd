"""The Kubernetes manifests (deploy/k8s): the overlays render, every document validates offline
against the Kubernetes schemas (kubernetes-validate, strict), and the NetworkPolicies select the
pods and ports they claim to. The gateway overlay's InferencePool validates against the Gateway
API Inference Extension's CRD (tests/fixtures/gateway-api-inference-extension), its HTTPRoute
against the fields of the Gateway API v1 reference."""

import importlib.util
import pathlib

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("render", ROOT / "deploy/k8s/render.py")
render_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render_module)
KUBERNETES = "1.37.0"
OVERLAYS = {"1p1d": (1, 1), "4p8d": (4, 8)}
FIXTURES = ROOT / "tests/fixtures"
# Kinds that kubernetes-validate does not know: the gateway overlay's, checked below instead.
GATEWAY_KINDS = {"InferencePool", "HTTPRoute"}


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
    """The components a NetworkPolicy lets reach `component` on `port` ("anyone": a rule with no
    `from`)."""
    allowed = set()
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        if not _selects(policy["spec"]["podSelector"], _pod_labels(docs, component)):
            continue
        for rule in policy["spec"].get("ingress", []):
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            if "from" not in rule:
                allowed.add("anyone")
            for peer in rule.get("from", []):
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


# --- least privilege: one Secret per role, hardened pods, default-deny with egress rules ---

secrets_spec = importlib.util.spec_from_file_location("secrets", ROOT / "deploy/k8s/secrets.py")
secrets_module = importlib.util.module_from_spec(secrets_spec)
secrets_spec.loader.exec_module(secrets_module)
SERVICES = ("router", "prefill", "decode")
ALL_OVERLAYS = [*OVERLAYS, "gateway"]
KUBE_DNS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}


def _pod(docs, component) -> dict:
    return by(docs, "Deployment", component)["spec"]["template"]["spec"]


def _env(container) -> dict:
    return {e["name"]: e["value"] for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_each_pod_mounts_only_its_own_roles_secret(overlay):
    """One Secret per role, and of it only the role's certificate, its key and the CA
    certificate: no pod can read another role's key or a CA key."""
    docs = rendered(overlay)
    for role in SERVICES:
        pod = _pod(docs, role)
        assert not [v for v in pod["volumes"] if "projected" in v or "hostPath" in v]
        secret_volumes = [v for v in pod["volumes"] if "secret" in v]
        assert [v["secret"]["secretName"] for v in secret_volumes] == [f"pdserve-{role}-tls"]
        (volume,) = secret_volumes
        items = volume["secret"]["items"]
        wanted = {f"{role}.pem", f"{role}-key.pem", "ca.pem"}
        assert {i["key"] for i in items} == {i["path"] for i in items} == wanted
        assert volume["secret"]["defaultMode"] & 0o007 == 0  # nothing for other users
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True
        env, at = _env(container), mount["mountPath"]
        assert env["PDSERVE_TLS_CERT"] == f"{at}/{role}.pem"
        assert env["PDSERVE_TLS_KEY"] == f"{at}/{role}-key.pem"
        assert env["PDSERVE_TLS_CA"] == f"{at}/ca.pem"
        assert not [e for e in container.get("envFrom", []) if "secretRef" in e]
    for doc in docs:  # no certificate material in the manifests themselves
        assert doc["kind"] != "Secret"
        assert "PRIVATE KEY" not in yaml.safe_dump(doc)


def test_the_secrets_hold_one_role_each_and_no_ca_key(tmp_path):
    """deploy/k8s/secrets.py makes exactly the Secrets the pods mount, each with its role's three
    files; no Secret holds the CA key, even where an old ca-key.pem lies beside the certs."""
    import base64

    from cryptography.hazmat.primitives import serialization
    from cryptography.x509 import load_pem_x509_certificate

    from pdserve.certs import make_dev_certs, role_files

    certs = make_dev_certs(tmp_path / "certs", ca_key=tmp_path / "ca-key.pem")
    (certs / "ca-key.pem").write_bytes((tmp_path / "ca-key.pem").read_bytes())  # old layout
    docs = secrets_module.secrets(certs)
    mounted = {
        v["secret"]["secretName"]
        for d in rendered("1p1d")
        if d["kind"] == "Deployment"
        for v in d["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert {d["metadata"]["name"] for d in docs} == mounted
    ca_key = (tmp_path / "ca-key.pem").read_bytes()
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        role = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        data = {name: base64.b64decode(value) for name, value in doc["data"].items()}
        assert set(data) == set(role_files(role)) == set(secrets_module.role_files(role))
        assert ca_key not in data.values() and not any(b"ca-key" in n.encode() for n in data)
        keys = [name for name, content in data.items() if b"PRIVATE KEY" in content]
        assert keys == [f"{role}-key.pem"]
        cert = load_pem_x509_certificate(data[f"{role}.pem"])
        key = serialization.load_pem_private_key(data[f"{role}-key.pem"], None)
        assert cert.public_key() == key.public_key()  # the role's own pair, nobody else's
        assert data["ca.pem"] == (certs / "ca.pem").read_bytes()


def test_a_certificate_file_with_a_key_in_it_is_refused(tmp_path):
    from pdserve.certs import make_dev_certs

    certs = make_dev_certs(tmp_path / "certs")
    with open(certs / "ca.pem", "ab") as f:
        f.write((certs / "router-key.pem").read_bytes())
    with pytest.raises(ValueError, match="private key"):
        secrets_module.secrets(certs)


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_pod_has_seccomp_and_no_service_account_token(overlay):
    for doc in (d for d in rendered(overlay) if d["kind"] == "Deployment"):
        pod = doc["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, doc["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context.get("seccompProfile", {"type": "RuntimeDefault"}) == {
                "type": "RuntimeDefault"
            }  # a container may not undo the pod's profile
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]


def test_the_probes_verify_each_server_as_a_name_its_certificate_holds():
    """`pdserve health` in the pod dials 127.0.0.1; prefill's and decode's certificates name only
    their role, so their probes verify that name (--server-name)."""
    from pdserve.certs import ROLE_USAGE

    docs = rendered("1p1d")
    for role in SERVICES:
        (container,) = _pod(docs, role)["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[:2] == ["pdserve", "health"]
            name = (
                command[command.index("--server-name") + 1]
                if "--server-name" in command
                else command[2].rsplit(":", 1)[0]
            )
            assert name in ROLE_USAGE[role][0], (role, probe, command)


def _policies(docs) -> list[dict]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def _where_may_go(docs, component: str, port: int, protocol: str = "TCP") -> set[str]:
    """What a NetworkPolicy lets `component` reach on `port`: components, "dns" (the cluster
    DNS), "other namespaces", "ip blocks" or "anywhere"."""
    allowed = set()
    for policy in _policies(docs):
        spec = policy["spec"]
        if "Egress" not in spec["policyTypes"]:
            continue
        if not _selects(spec["podSelector"], _pod_labels(docs, component)):
            continue
        for rule in spec.get("egress", []):
            ports = [(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])]
            if ports and (protocol, port) not in ports:
                continue
            if "to" not in rule:
                allowed.add("anywhere")
            for peer in rule.get("to", []):
                if "ipBlock" in peer:
                    allowed.add("ip blocks")
                elif peer == KUBE_DNS:
                    allowed.add("dns")
                elif "namespaceSelector" in peer:
                    allowed.add("other namespaces")
                else:
                    allowed |= {
                        other
                        for other in SERVICES
                        if _selects(peer["podSelector"], _pod_labels(docs, other))
                    }
    return allowed


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_pdserve_pod_starts_from_default_deny(overlay):
    """A policy that selects every pdserve pod for Ingress and Egress and allows nothing, so
    whatever the other policies do not open stays shut, both ways."""
    docs = rendered(overlay)
    denies = [
        p
        for p in _policies(docs)
        if set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    for role in SERVICES:
        assert [p for p in denies if _selects(p["spec"]["podSelector"], _pod_labels(docs, role))]
    for policy in _policies(docs):  # a rule of a kind not in policyTypes would be ignored
        types = set(policy["spec"]["policyTypes"])
        assert ("ingress" not in policy["spec"] or "Ingress" in types) and (
            "egress" not in policy["spec"] or "Egress" in types
        )


def test_egress_opens_exactly_the_connections_the_services_make():
    docs = rendered("1p1d")
    dns = {"dns"}
    assert _where_may_go(docs, "router", 50052) == {"prefill"}
    assert _where_may_go(docs, "router", 50053) == {"decode"}
    assert _where_may_go(docs, "router", 50054) == set()  # only prefill pushes KV
    assert _where_may_go(docs, "prefill", 50053) == {"decode"}  # PushKv, GetDataEndpoints
    assert _where_may_go(docs, "prefill", 50054) == {"decode"}  # the KV data plane
    assert _where_may_go(docs, "prefill", 50052) == set()
    for role in ("router", "prefill"):
        assert _where_may_go(docs, role, 53, "UDP") == _where_may_go(docs, role, 53) == dns
        assert _where_may_go(docs, role, 443) == set()  # nothing outside
    for port in (53, 443, 50051, 50052, 50053, 50054):  # decode dials nothing
        assert _where_may_go(docs, "decode", port) == _where_may_go(docs, "decode", port, "UDP")
        assert _where_may_go(docs, "decode", port) == set()


def test_ingress_and_egress_agree_on_the_services_ports():
    """Each connection the services make is open at both ends, on the port its Service names;
    Prometheus reaches every metrics port the pods announce; anyone reaches the router."""
    docs = rendered("1p1d")

    def service_port(component, name) -> int:
        ports = by(docs, "Service", component)["spec"]["ports"]
        return next(p["port"] for p in ports if p["name"] == name)

    for source, target, name in [
        ("router", "prefill", "grpc"),
        ("router", "decode", "grpc"),
        ("prefill", "decode", "grpc"),
        ("prefill", "decode", "kv-data"),
    ]:
        port = service_port(target, name)
        (container,) = _pod(docs, target)["containers"]
        assert port in [p["containerPort"] for p in container["ports"]]
        assert target in _where_may_go(docs, source, port), (source, target, name)
        assert source in _who_may_reach(docs, target, port), (source, target, name)
    for role in SERVICES:
        template = by(docs, "Deployment", role)["spec"]["template"]
        (container,) = template["spec"]["containers"]
        metrics = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
        assert int(template["metadata"]["annotations"]["prometheus.io/port"]) == metrics
        assert str(metrics) == _env(container)["PDSERVE_METRICS_PORT"]
        assert _who_may_reach(docs, role, metrics) == {"prometheus"}
    for name in ("grpc", "http"):
        assert _who_may_reach(docs, "router", service_port("router", name)) == {"anyone"}


def test_the_endpoint_picker_may_scrape_the_routers():
    docs = _gateway_docs()
    (container,) = _pod(docs, "router")["containers"]
    metrics = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    peers = [
        peer
        for policy in _policies(docs)
        if _selects(policy["spec"]["podSelector"], _pod_labels(docs, "router"))
        for rule in policy["spec"].get("ingress", [])
        if metrics in [p["port"] for p in rule.get("ports", [])]
        for peer in rule.get("from", [])
    ]
    assert {"podSelector": {"matchLabels": {"inferencepool": "pdserve-epp"}}} in peers


# --- deploy/k8s/overlays/gateway: the Gateway API Inference Extension ---


def _strict(schema: dict) -> dict:
    """A CRD's openAPIV3Schema as a JSON Schema that refuses unknown fields, as `kubectl apply
    --validate=strict` does (the API server would otherwise drop them without a word)."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        schema.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _strict(schema[key])
    return schema


CRD = yaml.safe_load(
    (
        FIXTURES / "gateway-api-inference-extension/inference.networking.k8s.io_inferencepools.yaml"
    ).read_text()
)
(POOL_VERSION,) = [v for v in CRD["spec"]["versions"] if v["name"] == "v1"]
POOL_SCHEMA = _strict(POOL_VERSION["schema"]["openAPIV3Schema"])
# The CRD's CEL rules, which JSON Schema cannot express; _cel_rules_hold checks them by hand.
CEL_RULES = {
    "self.kind != 'Service' || has(self.port)",
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
}


def _cel_rules(schema: dict) -> set[str]:
    found = {rule["rule"] for rule in schema.get("x-kubernetes-validations", [])}
    for child in schema.get("properties", {}).values():
        found |= _cel_rules(child)
    return found


def _cel_rules_hold(pool: dict) -> bool:
    picker, ports = pool["spec"]["endpointPickerRef"], pool["spec"]["targetPorts"]
    port_needed = picker.get("kind", "Service") == "Service"  # kind defaults to Service
    numbers = [p["number"] for p in ports]
    return (not port_needed or "port" in picker) and len(numbers) == len(set(numbers))


def _ref(required=("name",), **extra) -> dict:
    """An object reference as Gateway API v1 types it (group, kind, name, namespace)."""
    name = {"type": "string", "minLength": 1, "maxLength": 253}
    properties = {"group": {"type": "string"}, "kind": {"type": "string"}, "name": name}
    properties |= {"namespace": {"type": "string"}} | extra
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# HTTPRoute, the fields of gateway.networking.k8s.io/v1 (standard channel) as the Gateway API
# reference defines them: https://gateway-api.sigs.k8s.io/reference/spec/#httproute, and within
# it ParentReference, HTTPRouteRule, HTTPRouteMatch, HTTPPathMatch, HTTPBackendRef and
# HTTPRouteTimeouts. Its CRD (kubernetes-sigs/gateway-api, config/crd/standard/
# gateway.networking.k8s.io_httproutes.yaml) is over 300 kB and was not at hand at a v1 release.
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
DURATION = {"type": "string", "pattern": "^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
PATH_MATCH = {
    "type": "object",
    "properties": {
        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
        "value": {"type": "string", "maxLength": 1024, "pattern": "^/"},
    },
    "additionalProperties": False,
}
HTTPROUTE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "maxItems": 32,
                    "items": _ref(sectionName={"type": "string"}, port=PORT),
                },
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {
                                "type": "array",
                                "maxItems": 64,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "path": PATH_MATCH,
                                        "headers": {"type": "array"},
                                        "queryParams": {"type": "array"},
                                        "method": {"type": "string"},
                                    },
                                },
                            },
                            "filters": {"type": "array"},
                            "backendRefs": {
                                "type": "array",
                                "items": _ref(
                                    port=PORT,
                                    weight={"type": "integer", "minimum": 0},
                                    filters={"type": "array"},
                                ),
                            },
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"request": DURATION, "backendRequest": DURATION},
                            },
                        },
                    },
                },
            },
        },
    },
}
SCHEMAS = {"InferencePool": POOL_SCHEMA, "HTTPRoute": HTTPROUTE_SCHEMA}


def _gateway_docs() -> list[dict]:
    return rendered("gateway")


def test_the_fixture_is_the_v1_inferencepool_crd():
    assert CRD["spec"]["names"]["kind"] == "InferencePool"
    assert CRD["spec"]["group"] == "inference.networking.k8s.io"
    assert _cel_rules(POOL_VERSION["schema"]["openAPIV3Schema"]) == CEL_RULES  # all checked


def test_gateway_overlay_validates_offline():
    """Built-in kinds against the Kubernetes schemas; the InferencePool against the extension's
    CRD; the HTTPRoute against the Gateway API v1 reference's fields."""
    docs = _gateway_docs()
    assert {d["kind"] for d in docs} >= GATEWAY_KINDS | {"Deployment", "Service"}
    for doc in docs:
        if doc["kind"] in GATEWAY_KINDS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])  # raises on any error
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    pool = by(docs, "InferencePool", "pdserve-routers")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert _cel_rules_hold(pool)


@pytest.mark.parametrize(
    "change",
    [
        lambda spec: spec.update(extensionRef=spec.pop("endpointPickerRef")),  # the v1alpha2 name
        lambda spec: spec["endpointPickerRef"].update(failureMode="Open"),
        lambda spec: spec.update(targetPorts=[]),
        lambda spec: spec.pop("selector"),
    ],
)
def test_the_pool_schema_refuses_what_v1_does_not_define(change):
    pool = by(_gateway_docs(), "InferencePool", "pdserve-routers")
    change(pool["spec"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, POOL_SCHEMA)


@pytest.mark.parametrize(
    "change",
    [
        lambda rule: rule.update(backendRef=rule.pop("backendRefs")),
        lambda rule: rule["timeouts"].update(request="5 minutes"),
        lambda rule: rule["matches"][0]["path"].update(type="Prefix"),
    ],
)
def test_the_route_schema_refuses_what_v1_does_not_define(change):
    route = by(_gateway_docs(), "HTTPRoute", "pdserve")
    change(route["spec"]["rules"][0])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(route, HTTPROUTE_SCHEMA)


def test_the_cel_rules_refuse_a_service_picker_without_a_port():
    pool = by(_gateway_docs(), "InferencePool", "pdserve-routers")
    del pool["spec"]["endpointPickerRef"]["port"]
    assert not _cel_rules_hold(pool)


def test_the_gateway_reaches_routers_through_the_pool():
    """The pool selects the router pods (no prefill or decode) on their HTTP port, and the
    route sends the Gateway's traffic to that pool."""
    docs = _gateway_docs()
    pool = by(docs, "InferencePool", "pdserve-routers")["spec"]
    selected = {
        name
        for name in ("router", "prefill", "decode")
        if _selects(pool["selector"], _pod_labels(docs, name))
    }
    assert selected == {"router"}
    router = by(docs, "Deployment", "router")
    assert router["spec"]["replicas"] > 1  # something for the endpoint picker to pick between
    ports = {
        p["name"]: p["containerPort"]
        for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]]
    assert pool["endpointPickerRef"]["name"] == "pdserve-epp"
    (rule,) = by(docs, "HTTPRoute", "pdserve")["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pdserve-routers"}
    ]
