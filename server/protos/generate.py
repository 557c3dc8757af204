"""Regenerate the Python stubs from the .proto files: `python -m server.protos.generate`.

The stubs are committed; tests/test_protos.py fails when they drift from the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # repository root: imports are server.protos.*
PROTOS = ["server/protos/jaxserve/v1/inference.proto",
          "server/protos/jetstream_proto/jetstream.proto"]


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc

    for proto in PROTOS:
        code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
                            f"--grpc_python_out={out_dir}", str(ROOT / proto)])
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate()
    sys.exit(0)
