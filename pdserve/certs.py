"""`pdserve certs DIR`: a development CA and one certificate per role, for mutual TLS.

Each certificate names its role twice: as its common name (router, prefill, decode, client),
which the services check before any handler runs, and as a SAN URI spiffe://pdserve/<role>.
Its DNS names are the role itself (the name a peer verifies, whatever address it dialled), the
compose service name (the same), and localhost / 127.0.0.1 for health checks inside a container.

Development only: the CA key sits beside the certificates. For production, issue certificates
with the same common names from your own CA (docs/security.md).
"""

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("router", "prefill", "decode", "client")
VALID_DAYS = 365


def service_flags(directory: str | Path | None, role: str) -> list[str]:
    """The --tls-* flags that give a service `role`'s certificate from `directory` (as
    make_dev_certs wrote it); none without a directory."""
    if directory is None:
        return []
    out = Path(directory)
    return [
        "--tls-cert",
        str(out / f"{role}.pem"),
        "--tls-key",
        str(out / f"{role}-key.pem"),
        "--tls-ca",
        str(out / "ca.pem"),
    ]


def make_dev_certs(directory: str | Path, roles=ROLES, readable_keys: bool = False) -> Path:
    """Writes ca.pem, ca-key.pem and <role>.pem / <role>-key.pem for each role; returns the dir.
    Keys are readable by their owner only, unless readable_keys (for containers whose user
    differs from the one who made them; the CA key stays private)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve development CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / "ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca-key.pem", ca_key)
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)])
        cert = (
            _builder(name, ca_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_alt_names(role), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write(out / f"{role}.pem", cert.public_bytes(serialization.Encoding.PEM))
        _write_key(out / f"{role}-key.pem", key, 0o644 if readable_keys else 0o600)
    return out


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _alt_names(role: str) -> x509.SubjectAlternativeName:
    return x509.SubjectAlternativeName(
        [
            x509.UniformResourceIdentifier(f"spiffe://pdserve/{role}"),
            x509.DNSName(role),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
    )


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o644)


def _write_key(path: Path, key, mode: int = 0o600) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(mode)
