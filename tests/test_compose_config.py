"""docker-compose.yml, read without running it (tests/test_compose.py runs it): each service
mounts only its own role's certificate files, never the CA key; every service, Prometheus
included, runs hardened; every image is built here or pinned to an exact version."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from pdserve.certs import ROLE_USAGE, role_files

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
ROLES = ("router", "prefill", "decode")
CERTS_DIR = "${PDSERVE_CERTS_DIR:-./deploy/certs}"


def _binds(service: dict) -> list[tuple[str, str, str]]:
    """(source, target, mode) of each volume given in the short syntax."""
    out = []
    for volume in service.get("volumes", []):
        assert isinstance(volume, str), f"long volume syntax not checked here: {volume}"
        # From the right: the source may hold ${VAR:-default}.
        if volume.endswith((":ro", ":rw")):
            source, target, mode = volume.rsplit(":", 2)
        else:
            (source, target), mode = volume.rsplit(":", 1), "rw"
        out.append((source, target, mode))
    return out


def _cert_binds(service: dict, certs_dir: str = CERTS_DIR) -> list[tuple[str, str, str]]:
    return [b for b in _binds(service) if b[0].startswith(certs_dir)]


@pytest.mark.parametrize("role", ROLES)
def test_each_service_mounts_only_its_roles_files(role):
    service = SERVICES[role]
    binds = _cert_binds(service)
    assert sorted(pathlib.PurePosixPath(source).name for source, _, _ in binds) == sorted(
        role_files(role)
    )
    for source, target, mode in binds:
        assert mode == "ro"
        assert pathlib.PurePosixPath(source).name == pathlib.PurePosixPath(target).name
    targets = {pathlib.PurePosixPath(t).name: t for _, t, _ in binds}
    env = service["environment"]
    cert, key, ca = role_files(role)
    assert env["PDSERVE_TLS_CERT"] == targets[cert]
    assert env["PDSERVE_TLS_KEY"] == targets[key]
    assert env["PDSERVE_TLS_CA"] == targets[ca]


def test_no_service_mounts_the_certificate_directory_or_a_ca_key():
    for name, service in SERVICES.items():
        for source, target, _ in _binds(service):
            assert source.rstrip("/") != CERTS_DIR and not source.rstrip("/").endswith("certs")
            assert "ca-key" not in source and "ca-key" not in target, name
    assert not _cert_binds(SERVICES["prometheus"])  # it holds no certificate at all


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_health_checks_verify_a_name_the_certificate_holds(role):
    """prefill's and decode's certificates name their role and no address."""
    test = SERVICES[role]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "pdserve", "health"]
    name = test[test.index("--server-name") + 1]
    assert name == role and name in ROLE_USAGE[role][0]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_is_hardened(name):
    service = SERVICES[name]
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in service["security_opt"]
    uid, _, gid = str(service["user"]).partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)
    assert service["mem_limit"]
    assert "/tmp" in service.get("tmpfs", [])
    assert not service.get("privileged") and "cap_add" not in service


def _default_image(service: dict) -> str:
    image = service["image"]
    match = re.fullmatch(r"\$\{[A-Z_]+:-(.+)\}", image)
    return match.group(1) if match else image


def test_every_image_is_built_here_or_pinned():
    for name, service in SERVICES.items():
        image = _default_image(service)
        if "build" in service:
            continue  # pdserve:local, built from deploy/Dockerfile
        pinned = re.search(r"@sha256:[0-9a-f]{64}$", image) or re.search(
            r":v?\d+\.\d+\.\d+$", image
        )
        assert pinned, f"{name}: {image} is neither a digest nor an exact version"
    assert _default_image(SERVICES["prometheus"]).startswith("prom/prometheus:")


def test_the_local_prometheus_image_runs_as_the_same_user():
    """scripts/compose_ci.sh builds deploy/prometheus/Dockerfile where the upstream image cannot
    be pulled: both run as nobody (65534), who owns /prometheus, as the compose file says."""
    dockerfile = (ROOT / "deploy/prometheus/Dockerfile").read_text()
    assert "USER nobody" in dockerfile and "chown nobody:nogroup /prometheus" in dockerfile
    assert SERVICES["prometheus"]["user"] == "65534:65534"


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.skipif(
    os.environ.get("PDSERVE_SKIP_COMPOSE") == "1",
    reason="PDSERVE_SKIP_COMPOSE=1: the person running the suite opted out of Compose",
)
def test_compose_config_resolves_to_per_role_mounts(tmp_path):
    """As Compose itself reads the file (variables interpolated, anchors merged): each service
    binds its three files from PDSERVE_CERTS_DIR and nothing else of it. scripts/test.sh
    installs the Compose CLI; without it this fails rather than passing unchecked."""
    assert _compose_command(), (
        "no docker-compose or docker compose here (scripts/test.sh installs it)"
    )
    certs = tmp_path / "certs"
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "PDSERVE_CERTS_DIR": str(certs)}
    done = subprocess.run(
        [*_compose_command(), "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    for name, service in resolved.items():
        sources = []
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith(str(certs)):
                sources.append(pathlib.PurePosixPath(source).name)
        expected = sorted(role_files(name)) if name in ROLES else []
        assert sorted(sources) == expected, name
