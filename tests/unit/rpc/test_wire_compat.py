"""The generated code keeps the wire contract of protos/ as snapshotted (protos/compat): a program built against the
snapshot, or a router or worker of the other build during a rollout, reads what this build writes and the other way
round. The rules themselves are tested on edited copies in test_wire_compat_rules.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto

from tests import proto_snapshot
from tests.proto_snapshot import current_descriptors, read_snapshots
from tests.wire_compat import breaking_changes

REFRESH = (
    "Either undo the change as said, or, if the break is meant (never within pdserve.v1: a breaking API is a new"
    " package), refresh the snapshot on purpose with `make proto-snapshot BREAKING=1` and say why in the commit."
)


def test_protos_break_no_reader_of_the_snapshot() -> None:
    snapshots = read_snapshots()
    assert set(snapshots) >= {"pdserve/v1/generate.proto", "pdserve/v1/admin.proto", "pdserve/v1/worker.proto"}
    changes = breaking_changes(snapshots, current_descriptors())
    assert not changes, "\n".join(
        ["Breaking changes to protos/ since its snapshot (protos/compat):", *changes, REFRESH]
    )


def test_the_snapshot_holds_every_compatible_change() -> None:
    """A field added since the snapshot would be unguarded (renumbered next week, unnoticed) until the snapshot had
    it, so an addition takes `make proto-snapshot` too, which writes compatible changes without being told."""
    snapshots = read_snapshots()
    behind = sorted(name for name, descriptor in current_descriptors().items() if snapshots.get(name) != descriptor)
    assert not behind, f"protos/compat lacks changes to {behind}: run `make proto-snapshot` so they are guarded too"


@pytest.fixture
def snapshot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(proto_snapshot, "ROOT", tmp_path)
    monkeypatch.setattr(proto_snapshot, "SNAPSHOTS", tmp_path / "compat")
    return tmp_path / "compat"


def drop_a_field(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make the build's descriptors lack one field, not reserved (a breaking change); returns how it is reported."""
    descriptors = current_descriptors()
    file = descriptors["pdserve/v1/generate.proto"]
    owner = next(message for message in file.message_type if message.field)
    dropped = owner.field.pop(0)
    monkeypatch.setattr(proto_snapshot, "current_descriptors", lambda: descriptors)
    return f"{file.package}.{owner.name}.{dropped.name} = {dropped.number} removed; add `reserved {dropped.number};`"


def test_make_proto_snapshot_writes_what_reads_back(snapshot_dir: Path) -> None:
    assert proto_snapshot.main([]) == 0
    assert read_snapshots() == current_descriptors()
    assert (snapshot_dir / "pdserve" / "v1" / "worker.txtpb").read_text().startswith("# The descriptor of")


def test_make_proto_snapshot_refuses_a_break_unless_told(
    snapshot_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert proto_snapshot.main([]) == 0
    written = {path: path.read_text() for path in snapshot_dir.rglob("*.txtpb")}
    reported = drop_a_field(monkeypatch)
    assert proto_snapshot.main([]) == 1
    assert reported in capsys.readouterr().err
    assert {path: path.read_text() for path in snapshot_dir.rglob("*.txtpb")} == written
    assert proto_snapshot.main(["--allow-breaking"]) == 0
    assert breaking_changes(read_snapshots(), proto_snapshot.current_descriptors()) == []


def test_make_proto_snapshot_drops_the_snapshot_of_a_proto_removed_on_purpose(
    snapshot_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert proto_snapshot.main([]) == 0
    fewer: dict[str, FileDescriptorProto] = current_descriptors()
    del fewer["pdserve/v1/admin.proto"]
    monkeypatch.setattr(proto_snapshot, "current_descriptors", lambda: fewer)
    assert proto_snapshot.main([]) == 1
    assert proto_snapshot.main(["--allow-breaking"]) == 0
    assert sorted(p.name for p in snapshot_dir.rglob("*.txtpb")) == ["generate.txtpb", "worker.txtpb"]
