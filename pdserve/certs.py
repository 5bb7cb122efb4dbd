"""`pdserve certs DIR`: a development CA and one certificate per role, for mutual TLS.

Each certificate names its role twice: as its common name (router, prefill, decode, client),
which the services check before any handler runs, and as a SAN URI spiffe://pdserve/<role>.
What else it holds fits what the role does (ROLE_USAGE):

- router: a server for clients, who dial it by any address (localhost / 127.0.0.1 included, as in
  compose), and a client of prefill and decode. serverAuth and clientAuth; DNS names router and
  localhost, IP 127.0.0.1.
- prefill: a server for the router, and a client of decode. serverAuth and clientAuth; DNS name
  prefill only: its peers verify it as `prefill` whatever address they dial
  (grpc.ssl_target_name_override; `pdserve health --server-name prefill`).
- decode: a server for the router and prefill. serverAuth; DNS name decode only. clientAuth too,
  for one thing alone: its own health probe (`pdserve health` in its pod or container) presents
  it to decode, which asks every peer for a certificate. It may call no internal method.
- client: a client only. clientAuth; no DNS name or address, so it cannot act as any server.

So no certificate but the router's can pass as a server on localhost, and none passes as another
role's server.

The CA key signs these and is then thrown away, unless ca_key (`--ca-key FILE`) says where to
keep it: it never sits beside the certificates, so that a directory of them can be mounted or
made into a Secret without it. Deployments take one role's files each (role_files): that role's
certificate and key, and the CA certificate. For production, issue certificates with the same
common names from your own CA (docs/security.md).
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
# Per role: the names a peer may verify it as when it serves (none: it never serves), and
# whether it may present itself as a TLS client.
ROLE_USAGE: dict[str, tuple[tuple[str, ...], bool]] = {
    "router": (("router", "localhost", "127.0.0.1"), True),
    "prefill": (("prefill",), True),
    "decode": (("decode",), True),  # clientAuth for its own health probe only
    "client": ((), True),
}


def role_files(role: str) -> tuple[str, str, str]:
    """The file names one `role` needs, as make_dev_certs writes them: its certificate, its key
    and the CA certificate. Nothing else (another role's key, the CA key) belongs with it."""
    return f"{role}.pem", f"{role}-key.pem", "ca.pem"


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


def make_dev_certs(
    directory: str | Path,
    roles=ROLES,
    readable_keys: bool = False,
    ca_key: str | Path | None = None,
) -> Path:
    """Writes ca.pem and <role>.pem / <role>-key.pem for each role; returns the directory. The CA
    key is kept only if `ca_key` names a file for it (owner-only, and not inside `directory`).
    Keys are readable by their owner only, unless readable_keys: then every key is 0644 for
    containers whose user differs from the one who made them, and the directory itself is made
    0700, so that on the host only its owner reaches them; each container sees only the files
    mounted into it (role_files)."""
    out = Path(directory)
    if ca_key is not None and Path(ca_key).resolve().parent == out.resolve():
        raise ValueError(f"keep the CA key out of {out}: that directory is what gets mounted")
    out.mkdir(parents=True, exist_ok=True)
    if readable_keys:
        out.chmod(0o700)
    signer = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve development CA")])
    ca = (
        _builder(ca_name, ca_name, signer.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(signer, hashes.SHA256())
    )
    _write(out / "ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    if ca_key is not None:
        _write_key(Path(ca_key), signer)
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)])
        server_names, client = ROLE_USAGE[role]
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server_names else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        cert = (
            _builder(name, ca_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_alt_names(role, server_names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(signer, hashes.SHA256())
        )
        cert_file, key_file, _ = role_files(role)
        _write(out / cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write_key(out / key_file, key, 0o644 if readable_keys else 0o600)
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


def _alt_names(role: str, server_names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(f"spiffe://pdserve/{role}")]
    for name in server_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(names)


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
