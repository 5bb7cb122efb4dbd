"""The per-role Secrets that deploy/k8s mounts, from a directory of certificates as `pdserve certs`
writes them (or your own CA's, with the same file names): one Secret per service,
pdserve-<role>-tls, holding that role's certificate and key and the CA certificate, and nothing
else. No Secret holds another role's key or any CA key; a certificate file with a private key
in it is refused. The client certificate stays out of the cluster.

  python deploy/k8s/secrets.py certs/ | kubectl apply -f -

The same as, for each of router, prefill and decode:

  kubectl create secret generic pdserve-decode-tls \\
    --from-file=certs/ca.pem --from-file=certs/decode.pem --from-file=certs/decode-key.pem
"""

import base64
import sys
from pathlib import Path

import yaml

ROLES = ("router", "prefill", "decode")


def secret_name(role: str) -> str:
    return f"pdserve-{role}-tls"


def role_files(role: str) -> tuple[str, str, str]:
    """As pdserve.certs.role_files: the role's certificate, its key, the CA certificate."""
    return f"{role}.pem", f"{role}-key.pem", "ca.pem"


def secrets(directory: str | Path) -> list[dict]:
    """One Secret document per role, from the files in `directory`."""
    directory = Path(directory)
    docs = []
    for role in ROLES:
        cert, key, ca = role_files(role)
        data = {}
        for name in (ca, cert, key):
            content = (directory / name).read_bytes()
            if name != key and b"PRIVATE KEY" in content:
                raise ValueError(f"{directory / name} holds a private key: only {key} may")
            data[name] = base64.b64encode(content).decode()
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": secret_name(role),
                    "labels": {
                        "app.kubernetes.io/name": "pdserve",
                        "app.kubernetes.io/component": role,
                    },
                },
                "type": "Opaque",
                "data": data,
            }
        )
    return docs


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} CERTS_DIR")
    yaml.safe_dump_all(secrets(sys.argv[1]), sys.stdout, sort_keys=False)
