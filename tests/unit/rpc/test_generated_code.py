"""The committed gRPC code must be what grpcio-tools makes of protos/ today."""

from __future__ import annotations

import filecmp
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[3]
PROTOS = sorted((ROOT / "protos" / "pdserve" / "v1").glob("*.proto"))


def test_generated_code_is_current(tmp_path: Path) -> None:
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    args += [f"--pyi_out={tmp_path}", *map(str, PROTOS)]
    assert protoc.main(args) == 0
    fresh = tmp_path / "pdserve" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    assert names, "protoc produced nothing"
    committed = ROOT / "src" / "pdserve" / "v1"
    _, mismatch, missing = filecmp.cmpfiles(fresh, committed, names, shallow=False)
    assert not mismatch and not missing, f"stale generated code {mismatch + missing}: run `make proto`"
