"""The wire-compatibility rules (tests/wire_compat.py) on edited in-memory copies of this build's descriptors: each
breaking edit is reported once, naming what broke and the fix, and each compatible edit passes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from google.protobuf.descriptor_pb2 import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorProto,
    ServiceDescriptorProto,
)

from tests.proto_snapshot import current_descriptors
from tests.wire_compat import breaking_changes

Files = dict[str, FileDescriptorProto]
GENERATE, WORKER, ADMIN = "pdserve/v1/generate.proto", "pdserve/v1/worker.proto", "pdserve/v1/admin.proto"


@pytest.fixture(scope="module")
def released() -> Files:
    return current_descriptors()


def message(files: Files, file: str, path: str) -> DescriptorProto:
    """A message by its name within the package, nested ones dotted ("SamplingParams.LogitBiasEntry")."""
    head, *nested = path.split(".")
    found = next(m for m in files[file].message_type if m.name == head)
    for name in nested:
        found = next(m for m in found.nested_type if m.name == name)
    return found


def field(files: Files, file: str, path: str) -> FieldDescriptorProto:
    owner, name = path.rsplit(".", 1)
    return next(f for f in message(files, file, owner).field if f.name == name)


def finish_reason(files: Files) -> EnumDescriptorProto:
    return next(e for e in files[GENERATE].enum_type if e.name == "FinishReason")


def service(files: Files, file: str, name: str) -> ServiceDescriptorProto:
    return next(s for s in files[file].service if s.name == name)


def remove_field(files: Files, file: str, path: str) -> None:
    message(files, file, path.rsplit(".", 1)[0]).field.remove(field(files, file, path))


def remove_waited_ms(files: Files, reserve_number: bool, reserve_name: bool) -> None:
    remove_field(files, WORKER, "FirstToken.waited_ms")
    first_token = message(files, WORKER, "FirstToken")
    if reserve_number:
        first_token.reserved_range.add(start=8, end=9)
    if reserve_name:
        first_token.reserved_name.append("waited_ms")


def remove_eos(files: Files, reserve: bool) -> None:
    enum = finish_reason(files)
    enum.value.remove(next(v for v in enum.value if v.name == "FINISH_REASON_EOS"))
    if reserve:
        enum.reserved_range.add(start=3, end=3)
        enum.reserved_name.append("FINISH_REASON_EOS")


def drop_optional(files: Files, file: str, path: str) -> None:
    """What protoc makes of `optional T name` edited to `T name`: no synthetic oneof (its own, the message's last)."""
    optional = field(files, file, path)
    message(files, file, path.rsplit(".", 1)[0]).oneof_decl.pop(optional.oneof_index)
    optional.ClearField("oneof_index")
    optional.proto3_optional = False


def set_attr(get: Callable[[Files], object], name: str, value: object) -> Callable[[Files], None]:
    return lambda files: setattr(get(files), name, value)


F = FieldDescriptorProto
BREAKING: dict[str, tuple[Callable[[Files], None], str]] = {
    "field removed": (
        lambda f: remove_waited_ms(f, reserve_number=False, reserve_name=False),
        'FirstToken.waited_ms = 8 removed; add `reserved 8;` and `reserved "waited_ms";` to message pdserve.v1.First',
    ),
    "field removed, its name not reserved": (
        lambda f: remove_waited_ms(f, reserve_number=True, reserve_name=False),
        'FirstToken.waited_ms = 8 removed; add `reserved "waited_ms";` to',
    ),
    "field number changed": (
        set_attr(lambda f: field(f, GENERATE, "SamplingParams.seed"), "number", 15),
        "field pdserve.v1.SamplingParams.seed = 5 removed; add `reserved 5;` and",
    ),
    "field number reused by another field": (
        set_attr(lambda f: field(f, WORKER, "FirstToken.waited_ms"), "name", "queued_ms"),
        "FirstToken.waited_ms = 8 renamed to queued_ms: JSON, text format and generated code",
    ),
    "JSON name changed": (
        set_attr(lambda f: field(f, GENERATE, "SamplingParams.max_tokens"), "json_name", "maxNewTokens"),
        "SamplingParams.max_tokens = 1 changed its JSON name from maxTokens to maxNewTokens",
    ),
    "field type changed": (
        set_attr(lambda f: field(f, GENERATE, "Usage.ttft_ms"), "type", F.TYPE_DOUBLE),
        "generate.proto: field pdserve.v1.Usage.ttft_ms = 3 changed type from float to double, which",
    ),
    "int32 to int64: one varint, but JSON writes int64 as a string": (
        set_attr(lambda f: field(f, GENERATE, "GenerateRequest.priority"), "type", F.TYPE_INT64),
        "GenerateRequest.priority = 7 changed type from int32 to int64",
    ),
    "message type changed": (
        set_attr(lambda f: field(f, WORKER, "WorkerGenerateRequest.sampling"), "type_name", ".pdserve.v1.SLO"),
        "changed type from pdserve.v1.SamplingParams to pdserve.v1.SLO",
    ),
    "map value type changed": (
        set_attr(lambda f: field(f, GENERATE, "SamplingParams.LogitBiasEntry.value"), "type", F.TYPE_DOUBLE),
        "SamplingParams.LogitBiasEntry.value = 2 changed type from float to double",
    ),
    "map made a repeated entry message: one wire, but JSON writes a map as an object": (
        lambda f: message(f, GENERATE, "SamplingParams.LogitBiasEntry").options.ClearField("map_entry"),
        "SamplingParams.logit_bias = 14 changed from map to repeated",
    ),
    "singular made repeated": (
        set_attr(lambda f: field(f, GENERATE, "GenerateRequest.cache_salt"), "label", F.LABEL_REPEATED),
        "GenerateRequest.cache_salt = 8 changed from singular to repeated",
    ),
    "optional made singular (absent is 'not reported', unlike 0)": (
        lambda f: drop_optional(f, WORKER, "FirstToken.waited_ms"),
        "FirstToken.waited_ms = 8 changed from optional to singular",
    ),
    "field moved out of its oneof": (
        lambda f: field(f, WORKER, "PrefillEvent.first_token").ClearField("oneof_index"),
        "PrefillEvent.first_token = 1 moved from oneof event to no oneof",
    ),
    "field reservation dropped": (
        lambda f: message(f, WORKER, "KVLayout").reserved_range.pop(0),
        "message pdserve.v1.KVLayout no longer reserves 2: keep `reserved 2;`",
    ),
    "field name reservation dropped": (
        lambda f: message(f, WORKER, "TransferDone").reserved_name.remove("bytes"),
        'message pdserve.v1.TransferDone no longer reserves "bytes"',
    ),
    "enum value removed": (
        lambda f: remove_eos(f, reserve=False),
        "FinishReason.FINISH_REASON_EOS = 3 removed; add `reserved 3;` and",
    ),
    "enum value renamed": (
        set_attr(lambda f: finish_reason(f).value[3], "name", "FINISH_REASON_END"),
        "FINISH_REASON_EOS = 3 renamed to FINISH_REASON_END",
    ),
    "enum removed": (
        lambda f: f[GENERATE].enum_type.remove(finish_reason(f)),
        "enum pdserve.v1.FinishReason removed",
    ),
    "message removed": (
        lambda f: f[GENERATE].message_type.remove(message(f, GENERATE, "Usage")),
        "message pdserve.v1.Usage removed",
    ),
    "rpc removed": (
        lambda f: service(f, ADMIN, "Admin").method.pop(0),
        "admin.proto: rpc pdserve.v1.Admin/ClusterStatus removed: its callers get UNIMPLEMENTED",
    ),
    "response streaming flag changed": (
        set_attr(lambda f: service(f, GENERATE, "Generation").method[0], "server_streaming", False),
        "rpc pdserve.v1.Generation/Generate changed its response from stream of pdserve.v1.GenerateResponse to"
        " pdserve.v1.GenerateResponse",
    ),
    "request streaming flag changed": (
        set_attr(lambda f: service(f, WORKER, "WorkerControl").method[0], "client_streaming", True),
        "WorkerControl/Drain changed its request from pdserve.v1.DrainRequest to stream of",
    ),
    "request type changed": (
        set_attr(lambda f: service(f, WORKER, "WorkerControl").method[0], "input_type", ".pdserve.v1.CheckPeerRequest"),
        "WorkerControl/Drain changed its request from pdserve.v1.DrainRequest to pdserve.v1.CheckPeerRequest",
    ),
    "idempotency level changed": (
        set_attr(lambda f: service(f, ADMIN, "Admin").method[0].options, "idempotency_level", 1),
        "rpc pdserve.v1.Admin/ClusterStatus changed its idempotency level from IDEMPOTENCY_UNKNOWN to NO_SIDE_EFFECTS",
    ),
    "service removed": (
        lambda f: f[WORKER].service.remove(service(f, WORKER, "PrefillWorker")),
        "service pdserve.v1.PrefillWorker removed: its callers get UNIMPLEMENTED",
    ),
    "package changed": (set_attr(lambda f: f[ADMIN], "package", "pdserve.v2"), "package changed from pdserve.v1"),
    "syntax changed": (set_attr(lambda f: f[WORKER], "syntax", "proto2"), "syntax changed from proto3 to proto2"),
    "file removed": (lambda f: f.pop(ADMIN) and None, "pdserve/v1/admin.proto: the file is gone"),
}

COMPATIBLE: dict[str, Callable[[Files], None]] = {
    "field added": lambda f: message(f, WORKER, "FirstToken").field.add(
        name="queue_depth", number=99, label=F.LABEL_OPTIONAL, type=F.TYPE_UINT32
    ),
    "field removed, number and name reserved": lambda f: remove_waited_ms(f, reserve_number=True, reserve_name=True),
    "JSON name spelled out as protoc's default": set_attr(
        lambda f: field(f, GENERATE, "SamplingParams.stop_token_ids"), "json_name", "stopTokenIds"
    ),
    "int32 to uint32: one varint, one JSON number": set_attr(
        lambda f: field(f, GENERATE, "GenerateRequest.priority"), "type", F.TYPE_UINT32
    ),
    "enum value added": lambda f: finish_reason(f).value.add(name="FINISH_REASON_ABORT", number=4),
    "enum value removed, number and name reserved": lambda f: remove_eos(f, reserve=True),
    "message added": lambda f: f[ADMIN].message_type.add(name="ListWorkersRequest"),
    "rpc added": lambda f: service(f, ADMIN, "Admin").method.add(
        name="ListWorkers", input_type=".pdserve.v1.ListWorkersRequest", output_type=".pdserve.v1.WorkerStatus"
    ),
    "reservations merged": lambda f: (
        message(f, WORKER, "KVLayout").ClearField("reserved_range")
        or message(f, WORKER, "KVLayout").reserved_range.add(start=2, end=7)
    ),
}


def edited(released: Files, edit: Callable[[Files], None]) -> Files:
    copies = {}
    for name, descriptor in released.items():
        copies[name] = FileDescriptorProto()
        copies[name].CopyFrom(descriptor)
    edit(copies)
    return copies


def test_this_build_breaks_nothing_against_itself(released: Files) -> None:
    assert breaking_changes(released, edited(released, lambda f: None)) == []


@pytest.mark.parametrize("edit, expected", BREAKING.values(), ids=BREAKING.keys())
def test_a_breaking_edit_is_reported_once_saying_how_to_proceed(
    released: Files, edit: Callable[[Files], None], expected: str
) -> None:
    changes = breaking_changes(released, edited(released, edit))
    assert len(changes) == 1 and expected in changes[0], changes


@pytest.mark.parametrize("edit", COMPATIBLE.values(), ids=COMPATIBLE.keys())
def test_a_compatible_edit_passes(released: Files, edit: Callable[[Files], None]) -> None:
    assert breaking_changes(released, edited(released, edit)) == []


def test_the_check_has_a_direction(released: Files) -> None:
    """Removing a field breaks; the reverse edit, from the build without it to the one with it, adds a field."""
    later = edited(released, lambda f: remove_waited_ms(f, reserve_number=False, reserve_name=False))
    assert breaking_changes(released, later) and not breaking_changes(later, released)
