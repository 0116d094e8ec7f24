"""Reading the router's TOML config file: every key checked against the dataclass field it sets (name, type,
range), so a misspelled key or a value of the wrong type is refused naming the file and the key, never dropped or
taken silently."""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING

from pdserve.config import SLOClass
from pdserve.protocol.request_checks import RequestLimits

if TYPE_CHECKING:
    from pdserve.config import RouterConfig


def read_router_config(path: str, cls: type[RouterConfig]) -> RouterConfig:
    """A TOML file's [router] table (slo classes as [[router.slo_classes]], limits as [router.request_limits]);
    other tables are other programs'. An empty file is the defaults."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    if strays := sorted(key for key, value in document.items() if not isinstance(value, dict)):
        raise ValueError(f"{path}: {', '.join(strays)} outside any table (the router's settings go under [router])")
    if document and "router" not in document:
        raise ValueError(f"{path}: no [router] table (it has {', '.join(f'[{t}]' for t in sorted(document))})")
    table = dict(document.get("router", {}))
    _checked_fields(path, "[router]", table, cls, nested={"slo_classes": list, "request_limits": dict})
    classes = table.get("slo_classes", [])
    for i, c in enumerate(classes):
        _checked_fields(path, f"[[router.slo_classes]] #{i + 1}", c, SLOClass, required=True)
    limits = table.get("request_limits", {})
    _checked_fields(path, "[router.request_limits]", limits, RequestLimits)
    table["slo_classes"] = tuple(SLOClass(**c) for c in classes)
    table["request_limits"] = RequestLimits(**limits)
    try:
        return cls(**table)
    except ValueError as e:  # a value out of its range
        raise ValueError(f"{path}: {e}") from None


# A TOML value's type for a field's annotation (the scalars a config file sets).
_TOML_TYPES: dict[str, type] = {
    "float": float, "int": int, "bool": bool, "str": str, "str | None": str, "tuple[str, ...]": tuple,
}  # fmt: skip
_TYPE_NAMES = {
    float: "a number", int: "a whole number", bool: "true or false", str: "a string", dict: "a table",
    list: "an array of tables", tuple: "an array of strings",
}  # fmt: skip


def _checked(path: str, where: str, table: object, types: dict[str, type]) -> None:
    """`table` is a table whose keys are all in `types`, each of its type (a float takes a whole number; a number
    is never a bool, nor a bool a number)."""
    if not isinstance(table, dict):
        raise ValueError(f"{path}: {where} must be a table, got {table!r}")
    if unknown := sorted(set(table) - set(types)):
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(types))}")
    for key, value in table.items():
        expected = types[key]
        taken = (int, float) if expected is float else list if expected is tuple else expected
        strings = expected is not tuple or all(isinstance(item, str) for item in value)
        if not isinstance(value, taken) or (isinstance(value, bool) and expected is not bool) or not strings:
            raise ValueError(f"{path}: {where} {key} must be {_TYPE_NAMES[expected]}, got {value!r}")


def _checked_fields(
    path: str, where: str, table: object, cls: type, nested: dict[str, type] | None = None, required: bool = False
) -> None:
    """`table` sets fields of the dataclass `cls`, each with a value of its type (`nested`: its tables and arrays
    of tables, checked apart); `required`: every field without a default must be there."""
    declared = fields(cls)
    types = {f.name: _TOML_TYPES[str(f.type)] for f in declared if str(f.type) in _TOML_TYPES} | (nested or {})
    _checked(path, where, table, types)
    assert isinstance(table, dict)
    for key, value in table.items():  # stored as the field's type: 5 for a float field is 5.0
        if types[key] is float:
            table[key] = float(value)
    missing = [f.name for f in declared if f.default is MISSING and f.name not in table]
    if required and missing:
        raise ValueError(f"{path}: {where} lacks {', '.join(missing)}")
