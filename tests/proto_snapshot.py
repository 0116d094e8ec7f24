"""The descriptors of protos/ as last snapshotted (protos/compat), which tests/unit/rpc/test_wire_compat.py holds
the generated code to (tests/wire_compat.py), and their writer, `make proto-snapshot`: it takes in compatible changes
at once, so the test guards them from then on, and refuses to hide a breaking one unless told it is meant
(`make proto-snapshot BREAKING=1`)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

from google.protobuf import text_format
from google.protobuf.descriptor_pb2 import FileDescriptorProto

import pdserve.v1
from tests.wire_compat import breaking_changes

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "protos" / "compat"
HEADER = (
    "# The descriptor of {name} that tests/unit/rpc/test_wire_compat.py holds the generated code to:\n"
    "# written by `make proto-snapshot` (docs/architecture.md#contracts), never by hand.\n"
)


def current_descriptors() -> dict[str, FileDescriptorProto]:
    """Each generated module's descriptor (src/pdserve/v1/*_pb2.py) by its .proto's name."""
    found = {}
    for module in pkgutil.iter_modules(pdserve.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = FileDescriptorProto()
            importlib.import_module(f"pdserve.v1.{module.name}").DESCRIPTOR.CopyToProto(descriptor)
            found[descriptor.name] = descriptor
    return found


def read_snapshots() -> dict[str, FileDescriptorProto]:
    found = {}
    for path in sorted(SNAPSHOTS.rglob("*.txtpb")):
        descriptor = text_format.Parse(path.read_text(), FileDescriptorProto())
        found[descriptor.name] = descriptor
    return found


def snapshot_path(name: str) -> Path:
    return SNAPSHOTS / Path(name).with_suffix(".txtpb")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make proto-snapshot", description=__doc__)
    parser.add_argument("--allow-breaking", action="store_true", help="write even over breaking changes (BREAKING=1)")
    args = parser.parse_args(argv)
    snapshots, current = read_snapshots(), current_descriptors()
    changes = breaking_changes(snapshots, current)
    if changes and not args.allow_breaking:
        print("Breaking changes since the snapshot, which a reader of the other build would trip on:", file=sys.stderr)
        print("\n".join(f"  {change}" for change in changes), file=sys.stderr)
        print("Nothing written. If the break is meant: `make proto-snapshot BREAKING=1`.", file=sys.stderr)
        return 1
    if snapshots == current:
        print(f"{SNAPSHOTS.relative_to(ROOT)} is current")
        return 0
    for name in sorted(set(snapshots) - set(current)):
        snapshot_path(name).unlink()
        print(f"removed {snapshot_path(name).relative_to(ROOT)}")
    for name, descriptor in sorted(current.items()):
        if snapshots.get(name) != descriptor:
            path = snapshot_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(HEADER.format(name=name) + text_format.MessageToString(descriptor))
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
