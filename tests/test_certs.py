"""`pdserve certs`: each role's certificate may do what its role does and nothing more (pdserve/
certs.py), checked on the certificates and through real gRPC handshakes; the CA key is never
written beside the certificates."""

import stat
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.certs import ROLES, make_dev_certs

SERVER, CLIENT = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
# What each role does: router serves clients (who dial it by any address, localhost included)
# and calls prefill and decode; prefill serves the router and calls decode; decode serves (and
# its own health probe presents its certificate); a client only calls.
EXPECTED = {
    "router": ({SERVER, CLIENT}, {"router", "localhost"}, {"127.0.0.1"}),
    "prefill": ({SERVER, CLIENT}, {"prefill"}, set()),
    "decode": ({SERVER, CLIENT}, {"decode"}, set()),
    "client": ({CLIENT}, set(), set()),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("certs"))


def _cert(certs, role) -> x509.Certificate:
    return x509.load_pem_x509_certificate((certs / f"{role}.pem").read_bytes())


@pytest.mark.parametrize("role", ROLES)
def test_each_certificate_holds_what_its_role_needs_and_no_more(certs, role):
    cert = _cert(certs, role)
    usages, dns, ips = EXPECTED[role]
    assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == dns
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == ips
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://pdserve/{role}"]
    common_name = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)
    assert [a.value for a in common_name] == [role]  # what the role checks read
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert basic.ca is False


def _serve(certs, role):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials = grpc.ssl_server_credentials(
        [((certs / f"{role}-key.pem").read_bytes(), (certs / f"{role}.pem").read_bytes())],
        root_certificates=(certs / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def _handshake(certs, port, client_role, name) -> bool:
    """A health check as `client_role`, verifying the server as `name` (None: the address)."""
    credentials = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / f"{client_role}-key.pem").read_bytes(),
        (certs / f"{client_role}.pem").read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", name)] if name else []
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
    return True


def test_only_the_right_certificate_passes_as_each_server(certs):
    """The router verifies prefill and decode by role name, and clients dial the router at
    localhost: no certificate but prefill's passes as prefill, none but decode's as decode, and
    none but the router's as a server on localhost or 127.0.0.1. The client's serves nothing."""
    names = ["router", "prefill", "decode", "localhost", None]  # None: 127.0.0.1, as dialled
    passes = {}
    for server_role in ROLES:
        server, port = _serve(certs, server_role)
        try:
            passes[server_role] = {n for n in names if _handshake(certs, port, "router", n)}
            # Each role's certificate opens the connection as a client: every role calls
            # something, or (decode) probes its own health. Which methods it may call is the
            # role check's business (tests/test_tls.py).
            name = server_role if server_role != "client" else None
            if passes[server_role]:
                assert all(_handshake(certs, port, client, name) for client in ROLES)
        finally:
            server.stop(0)
    assert passes == {
        "router": {"router", "localhost", None},
        "prefill": {"prefill"},
        "decode": {"decode"},
        "client": set(),
    }


def test_the_ca_key_is_not_written_beside_the_certificates(tmp_path):
    certs = make_dev_certs(tmp_path / "certs")
    assert sorted(p.name for p in certs.iterdir()) == sorted(
        ["ca.pem"] + [f"{r}{suffix}" for r in ROLES for suffix in (".pem", "-key.pem")]
    )
    for path in certs.iterdir():  # no key but each role's own, in its own file
        if path.name.endswith("-key.pem"):
            role = path.name.removesuffix("-key.pem")
            key = serialization.load_pem_private_key(path.read_bytes(), None)
            assert key.public_key() == _cert(certs, role).public_key()
        else:
            assert b"PRIVATE KEY" not in path.read_bytes()


def test_the_ca_key_is_kept_only_where_asked_and_never_inside(tmp_path):
    kept = tmp_path / "private" / "ca-key.pem"
    kept.parent.mkdir()
    certs = make_dev_certs(tmp_path / "certs", ca_key=kept)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    assert serialization.load_pem_private_key(kept.read_bytes(), None).public_key() == (
        ca.public_key()
    )
    assert not (certs / "ca-key.pem").exists()
    with pytest.raises(ValueError, match="out of"):
        make_dev_certs(tmp_path / "certs", ca_key=tmp_path / "certs" / "ca-key.pem")


def test_the_cli_refuses_a_ca_key_inside_the_directory(tmp_path, capsys):
    from pdserve.cli import main

    assert main(["certs", str(tmp_path / "c"), "--ca-key", str(tmp_path / "c" / "k.pem")]) == 2
    assert "keep the CA key out of" in capsys.readouterr().err
    assert main(["certs", str(tmp_path / "d"), "--ca-key", str(tmp_path / "ca-key.pem")]) == 0
    assert (tmp_path / "ca-key.pem").exists() and not (tmp_path / "d" / "ca-key.pem").exists()


def test_key_modes(tmp_path):
    """Owner-only by default. --readable-keys (for containers that run as another user): keys
    0644 but the directory 0700, so that on the host only its owner reaches them, and each
    container sees only the files mounted into it."""
    private = make_dev_certs(tmp_path / "private")
    readable = make_dev_certs(tmp_path / "readable", readable_keys=True)
    for role in ROLES:
        assert stat.S_IMODE((private / f"{role}-key.pem").stat().st_mode) == 0o600
        assert stat.S_IMODE((readable / f"{role}-key.pem").stat().st_mode) == 0o644
    assert stat.S_IMODE(readable.stat().st_mode) == 0o700


def test_the_ca_can_sign_nothing_but_certificates(certs):
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
