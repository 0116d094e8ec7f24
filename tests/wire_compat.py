"""Which changes to a .proto break a program that reads it with the other version: the public API (generate.proto,
admin.proto) is called by programs built against any earlier release, and worker.proto joins routers and workers of
two builds during a rolling upgrade (docs/architecture.md, "Mixed builds").

The rules are buf's `breaking` WIRE_JSON category (buf is no PyPI package), which protobuf's "Updating a message
type" rules underlie, over FileDescriptorProtos, plus what a gRPC caller needs that the category leaves to buf's
stricter ones: every message, enum, service and RPC stays. Two points are stricter than WIRE_JSON: a field keeps its
presence (proto3 `optional`; pdserve reads an absent field as "not reported", unlike 0), and an enum field keeps its
enum (buf takes a same-named one that keeps every value). The files are proto3, so a change of syntax is itself a
break and proto2's and editions' own rules (required fields, defaults, delimited encoding) are left out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

from google.protobuf.descriptor_pb2 import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorProto,
    MethodDescriptorProto,
    MethodOptions,
)

Field = FieldDescriptorProto
UPDATING = "https://protobuf.dev/programming-guides/proto3/#updating"
NEW_NUMBER = "give the field a new number instead, and reserve this one"
# Field types that read each other's values alike on the wire and in JSON (buf's FIELD_WIRE_JSON_COMPATIBLE_TYPE).
# All varints (int32, int64, uint32, uint64, bool) share the wire, but JSON writes a 64-bit integer as a string and a
# bool as true/false, so of those only a 32-bit and a 64-bit pair are left.
SAME_ENCODING = [
    {Field.TYPE_INT32, Field.TYPE_UINT32},
    {Field.TYPE_INT64, Field.TYPE_UINT64},
    {Field.TYPE_FIXED32, Field.TYPE_SFIXED32},
    {Field.TYPE_FIXED64, Field.TYPE_SFIXED64},
]
NAMED_TYPES = (Field.TYPE_MESSAGE, Field.TYPE_ENUM, Field.TYPE_GROUP)


def breaking_changes(
    previous: Mapping[str, FileDescriptorProto], current: Mapping[str, FileDescriptorProto]
) -> list[str]:
    """Each change from `previous` to `current` (by file name) that breaks a reader of either, with how to proceed."""
    changes = []
    for name, before in sorted(previous.items()):
        after = current.get(name)
        if after is None:
            changes.append(f"{name}: the file is gone; restore it (its messages, enums and services are the contract)")
        else:
            changes += [f"{name}: {change}" for change in file_changes(before, after)]
    return changes


def file_changes(before: FileDescriptorProto, after: FileDescriptorProto) -> Iterator[str]:
    if after.package != before.package:
        yield f"package changed from {before.package} to {after.package}: it names every message and RPC; restore it"
    if after.syntax != before.syntax:
        yield f"syntax changed from {before.syntax} to {after.syntax}: presence, defaults read otherwise; restore it"
    prefix = f"{before.package}." if before.package else ""
    messages_before, messages_after = messages_of(before), messages_of(after)
    for name, message in messages_before.items():
        if name in messages_after:
            yield from message_changes(prefix + name, message, messages_after[name])
        elif not message.options.map_entry:  # a map field's own entry: the field's change says it
            yield f"message {prefix}{name} removed: restore it (one no longer used can stay, marked deprecated)"
    enums_after = enums_of(after)
    for name, enum in enums_of(before).items():
        if name in enums_after:
            yield from enum_changes(prefix + name, enum, enums_after[name])
        else:
            yield f"enum {prefix}{name} removed: restore it (one no longer used can stay, marked deprecated)"
    services_after = {service.name: service for service in after.service}
    for service in before.service:
        if service.name not in services_after:
            yield f"service {prefix}{service.name} removed: its callers get UNIMPLEMENTED; restore it"
            continue
        methods_after = {method.name: method for method in services_after[service.name].method}
        for method in service.method:
            rpc = f"rpc {prefix}{service.name}/{method.name}"
            if method.name not in methods_after:
                yield f"{rpc} removed: its callers get UNIMPLEMENTED; restore it"
                continue
            shape_before, shape_after = method_shape(method), method_shape(methods_after[method.name])
            for part, was in shape_before.items():
                if shape_after[part] != was:
                    yield (
                        f"{rpc} changed its {part} from {was} to {shape_after[part]}: a caller or server of the other"
                        " build cannot speak it; add an RPC under a new name instead"
                    )


def messages_of(file: FileDescriptorProto) -> dict[str, DescriptorProto]:
    """Every message, nested ones included, by its name within the package ("SamplingParams.LogitBiasEntry")."""
    found: dict[str, DescriptorProto] = {}

    def walk(prefix: str, messages: Iterable[DescriptorProto]) -> None:
        for message in messages:
            found[prefix + message.name] = message
            walk(f"{prefix}{message.name}.", message.nested_type)

    walk("", file.message_type)
    return found


def enums_of(file: FileDescriptorProto) -> dict[str, EnumDescriptorProto]:
    found = {enum.name: enum for enum in file.enum_type}
    for name, message in messages_of(file).items():
        found.update({f"{name}.{enum.name}": enum for enum in message.enum_type})
    return found


def method_shape(method: MethodDescriptorProto) -> dict[str, str]:
    """What a caller and a server must agree on; the streaming flags are the 'stream of' of either side."""
    return {
        "request": ("stream of " if method.client_streaming else "") + method.input_type.lstrip("."),
        "response": ("stream of " if method.server_streaming else "") + method.output_type.lstrip("."),
        "idempotency level": MethodOptions.IdempotencyLevel.Name(method.options.idempotency_level),
    }


def message_changes(name: str, before: DescriptorProto, after: DescriptorProto) -> Iterator[str]:
    reserved_after = [(r.start, r.end) for r in after.reserved_range]  # end exclusive
    yield from reservation_changes(
        f"message {name}", [(r.start, r.end) for r in before.reserved_range], reserved_after, before, after
    )
    fields_after = {field.number: field for field in after.field}
    for field in before.field:
        label = f"field {name}.{field.name} = {field.number}"
        new = fields_after.get(field.number)
        if new is None:
            missing = unreserved(field.number, field.name, reserved_after, after.reserved_name)
            if missing:
                yield (
                    f"{label} removed; add {missing} to message {name}, so no later field takes its number (the"
                    f" other build would read that field as {field.name}) or its name (JSON and text format)"
                )
            continue
        if new.name != field.name:
            yield (
                f"{label} renamed to {new.name}: JSON, text format and generated code know a field by its name; keep"
                " it (a field that means something else takes a new number, this one reserved)"
            )
        elif json_name(new) != json_name(field):
            yield f"{label} changed its JSON name from {json_name(field)} to {json_name(new)}: restore it"
        type_before, type_after = type_of(field), type_of(new)
        if type_before != type_after and (encoding(field.type) != encoding(new.type) or field.type in NAMED_TYPES):
            yield (
                f"{label} changed type from {type_before} to {type_after}, which the other build misreads on the"
                f" wire or in JSON ({UPDATING}); {NEW_NUMBER}"
            )
        was, now = cardinality(field, before), cardinality(new, after)
        if was != now:
            why = (
                "one build tells 0 from absent (not reported), the other not"
                if {was, now} == {"optional", "singular"}
                else f"the other build reads it differently on the wire or in JSON ({UPDATING})"
            )
            yield f"{label} changed from {was} to {now}: {why}; {NEW_NUMBER}"
        if oneof_of(field, before) != oneof_of(new, after):
            yield (
                f"{label} moved from {oneof_of(field, before)} to {oneof_of(new, after)}: setting it clears other"
                f" fields for one build and not the other; {NEW_NUMBER}"
            )


def enum_changes(name: str, before: EnumDescriptorProto, after: EnumDescriptorProto) -> Iterator[str]:
    reserved_after = [(r.start, r.end + 1) for r in after.reserved_range]  # an enum's end is inclusive
    yield from reservation_changes(
        f"enum {name}", [(r.start, r.end + 1) for r in before.reserved_range], reserved_after, before, after
    )
    names_after: dict[int, list[str]] = {}
    for value in after.value:
        names_after.setdefault(value.number, []).append(value.name)
    for value in before.value:
        label = f"enum value {name}.{value.name} = {value.number}"
        if value.number not in names_after:
            missing = unreserved(value.number, value.name, reserved_after, after.reserved_name)
            if missing:
                yield (
                    f"{label} removed; add {missing} to enum {name}, so no later value takes its number (the other"
                    f" build would read that value as {value.name}) or its name (JSON and text format)"
                )
        elif value.name not in names_after[value.number]:
            yield (
                f"{label} renamed to {' / '.join(names_after[value.number])}: JSON and text format carry the name;"
                " keep it"
            )


def reservation_changes(
    owner: str,
    before: list[tuple[int, int]],
    after: list[tuple[int, int]],
    message_before: DescriptorProto | EnumDescriptorProto,
    message_after: DescriptorProto | EnumDescriptorProto,
) -> Iterator[str]:
    """A reservation dropped frees a removed field's (or value's) number or name for a new one to take."""
    for start, end in before:
        if not covered(start, end, after):
            numbers = str(start) if end == start + 1 else f"{start} to {end - 1}"
            yield f"{owner} no longer reserves {numbers}: keep `reserved {numbers};` (it was a removed one's)"
    for reserved in message_before.reserved_name:
        if reserved not in message_after.reserved_name:
            yield f'{owner} no longer reserves "{reserved}": keep `reserved "{reserved}";` (it was a removed one\'s)'


def unreserved(number: int, name: str, ranges: list[tuple[int, int]], names: Collection[str]) -> str:
    """The `reserved` statements a removed field or value still needs, '' when it has both."""
    missing = [] if covered(number, number + 1, ranges) else [f"`reserved {number};`"]
    if name not in names:
        missing.append(f'`reserved "{name}";`')
    return " and ".join(missing)


def covered(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether the numbers start..end-1 all lie in the union of the half-open ranges (reservations may merge)."""
    position = start
    while position < end:
        reaching = [stop for first, stop in ranges if first <= position < stop]
        if not reaching:
            return False
        position = max(reaching)
    return True


def encoding(field_type: int) -> int:
    return next((min(group) for group in SAME_ENCODING if field_type in group), field_type)


def type_of(field: FieldDescriptorProto) -> str:
    if field.type in NAMED_TYPES:
        return field.type_name.lstrip(".")
    return Field.Type.Name(field.type).removeprefix("TYPE_").lower()


def json_name(field: FieldDescriptorProto) -> str:
    """protoc's default when the .proto names none: lowerCamelCase, each underscore dropped."""
    if field.json_name:
        return field.json_name
    head, *rest = field.name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def cardinality(field: FieldDescriptorProto, message: DescriptorProto) -> str:
    """How many values the field holds, and whether it tells 0 from absent; a map's entry is nested in its message."""
    if field.label == Field.LABEL_REPEATED:
        entry = field.type_name.rsplit(".", 1)[-1]
        is_map = any(nested.name == entry and nested.options.map_entry for nested in message.nested_type)
        return "map" if is_map else "repeated"
    if field.label == Field.LABEL_REQUIRED:
        return "required"
    # A message field has presence with or without `optional`, so only a scalar's `optional` changes anything.
    return "optional" if field.proto3_optional and field.type != Field.TYPE_MESSAGE else "singular"


def oneof_of(field: FieldDescriptorProto, message: DescriptorProto) -> str:
    """The field's oneof, not counting the synthetic one proto3 gives each `optional` field."""
    if not field.HasField("oneof_index") or field.proto3_optional:
        return "no oneof"
    return f"oneof {message.oneof_decl[field.oneof_index].name}"
