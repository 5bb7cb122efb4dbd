"""Renders a kustomization under deploy/k8s without the kustomize binary: the subset these
overlays use (`resources`, files or directories, and `replicas`). `kubectl kustomize DIR` gives
the same documents; this exists so that CI can render and validate them offline.

  python deploy/k8s/render.py deploy/k8s/overlays/4p8d > pdserve-4p8d.yaml
"""

import sys
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "replicas"}


def render(directory: str | Path) -> list[dict]:
    """The documents of the kustomization in `directory`, overlays applied."""
    directory = Path(directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}: kustomize fields this renderer lacks: {sorted(unknown)}")
    docs: list[dict] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs += render(path)
        else:
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for change in spec.get("replicas", []):
        targets = [
            d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == change["name"]
        ]
        if not targets:
            raise ValueError(f"{directory}: replicas for unknown Deployment {change['name']!r}")
        for doc in targets:
            doc["spec"]["replicas"] = change["count"]
    return docs


if __name__ == "__main__":
    yaml.safe_dump_all(render(sys.argv[1]), sys.stdout, sort_keys=False)
