"""The committed gRPC stubs are exactly what the .proto files generate."""

from __future__ import annotations

from server.protos.generate import PROTOS, ROOT, generate


def test_stubs_in_sync_with_protos(tmp_path):
    generate(tmp_path)
    for proto in PROTOS:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            rel = proto.replace(".proto", suffix)
            fresh = (tmp_path / rel).read_text()
            committed = (ROOT / rel).read_text()
            assert fresh == committed, f"{rel} is stale: run `python -m server.protos.generate`"
