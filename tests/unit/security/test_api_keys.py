"""The key file and `authenticate`: digests only, bearer metadata, the caps each key carries."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.errors import PermissionDeniedError, UnauthenticatedError
from pdserve.security.api_keys import ADMIN_CALLS, OPEN, KeyTable, authenticate, bearer_metadata, digest
from pdserve.v1 import admin_pb2

KEYS = """
[[keys]]
name = "team-a-prod"
sha256 = "{a}"
tenant = "team-a"
max_priority = 0
requests_per_second = 50
tokens_per_minute = 200000
max_concurrent = 64

[[keys]]
name = "ops"
sha256 = "{b}"
tenant = "ops"
max_priority = 2
admin = true

[[keys]]
name = "drain"
sha256 = "{c}"
tenant = "ops"
max_priority = 0
admin = ["DrainWorkers"]
"""


@pytest.fixture
def table(tmp_path: Path) -> KeyTable:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS.format(a=digest("key-a"), b=digest("key-b").upper(), c=digest("key-c")))
    return KeyTable.from_file(path)


def test_a_known_bearer_key_is_its_tenant_with_its_caps(table: KeyTable) -> None:
    a = authenticate(table, bearer_metadata("key-a"))
    assert (a.name, a.key_name, a.max_priority, a.max_concurrent) == ("team-a", "team-a-prod", 0, 64)
    assert authenticate(table, {"authorization": "bearer key-b"}).name == "ops"  # scheme and digest case-blind
    assert authenticate(table, [("authorization", b"Bearer key-b")]).admin


@pytest.mark.parametrize(
    "metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", "key-a"),), (("x", "Bearer key-a"),)]
)
def test_missing_or_unknown_keys_are_unauthenticated_without_echoing_the_key(
    table: KeyTable, metadata: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(UnauthenticatedError) as caught:
        authenticate(table, metadata)
    assert "wrong" not in str(caught.value)


def test_caps_priority_and_admin(table: KeyTable) -> None:
    a = authenticate(table, bearer_metadata("key-a"))
    a.check_priority(0)
    with pytest.raises(PermissionDeniedError, match="^priority: 1 is above"):
        a.check_priority(1)
    with pytest.raises(PermissionDeniedError, match="^authorization: API key 'team-a-prod' may not call the Admin"):
        a.check_admin("DrainWorkers")
    assert authenticate(None, ()) is OPEN and OPEN.admin_calls == ADMIN_CALLS  # no key file: an open cluster


def test_an_admin_list_allows_the_calls_it_names_and_refuses_the_others_naming_them(table: KeyTable) -> None:
    """A worker pod's drain key may drain and nothing else: whoever reads it from the pod's environment can
    neither scale the cluster nor survey it."""
    drain, full = (authenticate(table, bearer_metadata(k)) for k in ("key-c", "key-b"))
    assert drain.admin_calls == {"DrainWorkers"} and full.admin_calls == ADMIN_CALLS
    drain.check_admin("DrainWorkers")
    for call in ("ScaleWorkers", "ClusterStatus"):
        full.check_admin(call)
        with pytest.raises(
            PermissionDeniedError, match=f"^authorization: .* may call only DrainWorkers .*, not {call}"
        ):
            drain.check_admin(call)
    assert drain.max_priority == 0  # the rest of its entry as any key's


def test_the_admin_calls_are_the_admin_services_methods() -> None:
    assert {m.name for m in admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods} == ADMIN_CALLS


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('sha256 = "abc"\ntenant = "t"', "64 hex digits"),
        (f'sha256 = "{digest("k")}"', "names no tenant"),
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nmax_prio = 1', "max_prio"),
        (
            f'name = "a"\nsha256 = "{digest("k")}"\ntenant = "t"\n'
            f'[[keys]]\nname = "a"\nsha256 = "{digest("j")}"\ntenant = "u"',
            "repeats the name 'a'",
        ),
        # A value of the wrong type or sign is no silent default: "false" would be a true admin flag, "5" fail
        # every request's priority check, -1 mean no limit at all.
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nadmin = "false"', r"keys\[0\]: admin must be true, false or a list"),
        # A drain key whose call is misspelt or not a list must not load as a key that cannot drain.
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nadmin = "drain"', r"keys\[0\]: admin must be true, false or a list"),
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nadmin = [1]', r"keys\[0\]: admin must be true, false or a list"),
        (
            f'sha256 = "{digest("k")}"\ntenant = "t"\nadmin = ["DrainWorker"]',
            r"keys\[0\]: admin: unknown Admin call\(s\) DrainWorker; the calls are ClusterStatus, DrainWorkers, ",
        ),
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nmax_priority = "5"', "max_priority must be a finite number"),
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nmax_concurrent = 1.5', "max_concurrent must be a finite number"),
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nrequests_per_second = -1', "requests_per_second must be >= 0"),
        (f'sha256 = "{digest("k")}"\ntenant = "t"\ntokens_per_minute = nan', "tokens_per_minute must be a finite"),
        # inf is no "unlimited" (that is 0): Redis's refill time of an infinite bucket is NaN, a 500 per request.
        (f'sha256 = "{digest("k")}"\ntenant = "t"\nrequests_per_second = inf', "requests_per_second must be a finite"),
        (f'sha256 = "{digest("k")}"\ntenant = 7', "name must be a str"),
    ],
)
def test_a_malformed_file_fails_naming_the_entry(tmp_path: Path, entry: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f"[[keys]]\n{entry}\n")
    with pytest.raises(ValueError, match=message):
        KeyTable.from_file(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A second key under a misspelled table was dropped without a word; the file started with one key.
        (
            f'[[keys]]\nsha256 = "{digest("k")}"\ntenant = "t"\n[[kyes]]\nsha256 = "{digest("j")}"\ntenant = "u"\n',
            "kyes",
        ),
        (f'[keys]\nsha256 = "{digest("k")}"\ntenant = "t"\n', "keys must be \\[\\[keys\\]\\] tables"),  # a table
        ("keys = [1]\n", r"keys\[0\] must be a table"),  # was a TypeError traceback
        (f'sha256 = "{digest("k")}"\n', "unknown key\\(s\\) sha256"),
        ("[[keys]]\nsha256 = \n", "not valid TOML"),  # the file named: the error alone named no file
    ],
)
def test_a_file_of_another_shape_fails_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as refused:
        KeyTable.from_file(path)
    assert str(refused.value).startswith(f"{path}: ")


def test_an_unnamed_keys_name_stays_when_a_key_before_it_is_removed() -> None:
    """Quotas are kept by key name across a reload: named by its place, the second key would take the name, and
    the counts, of the first one once that one is revoked."""
    both = b"".join(f'[[keys]]\nsha256 = "{digest(k)}"\ntenant = "t"\n'.encode() for k in ("first", "second"))
    only_second = f'[[keys]]\nsha256 = "{digest("second")}"\ntenant = "t"\n'.encode()
    bearer = {"authorization": "Bearer second"}
    table = KeyTable.parse(both, "keys.toml")
    before, first = (authenticate(table, {"authorization": f"Bearer {k}"}).key_name for k in ("second", "first"))
    assert before == authenticate(KeyTable.parse(only_second, "keys.toml"), bearer).key_name != first
