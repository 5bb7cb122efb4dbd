"""Generates the gRPC Python code for proto/pdserve/v1 into pdserve/v1 (git-ignored).

Run by scripts/install.sh and by the Docker build: `python -m pdserve.build_proto`.
"""

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    (ROOT / "pdserve" / "v1" / "__init__.py").write_text('"""Generated from proto/pdserve/v1."""\n')
    print(f"generated {len(protos)} proto file(s) into {ROOT / 'pdserve' / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
