"""API keys: a TOML file of SHA-256 digests, each naming a tenant and its caps, and `authenticate`, the one key
check every front end calls (the gRPC servicer today; an HTTP front end would call it with its headers).

Only digests are stored, so a leaked key file leaks no usable key. A key is compared by its digest's lookup;
the digest of a guess reveals nothing about a real key's bytes.
"""

from __future__ import annotations

import hashlib
import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.errors import MissingKeyError, PermissionDeniedError, UnauthenticatedError

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case; HTTP's Authorization header folds to it
BEARER = "bearer "
OPEN_TENANT = "anonymous"  # the tenant of every request on a cluster started without --api-keys
# The quota name of a tenant's own limits (a [[tenants]] entry): counted as a key's are, under a name no key takes.
TENANT_LIMITS = "tenant/"
TENANT_LIMIT_FIELDS = ("requests_per_second", "tokens_per_minute", "max_concurrent")
# The Admin service's methods (protos/pdserve/v1/admin.proto), which a key's `admin` list may name; spelled out, as
# every client imports this module for its bearer metadata and need not load the protos for it.
ADMIN_CALLS = frozenset({"ClusterStatus", "DrainWorkers", "ScaleWorkers"})
Metadata = Mapping[str, str] | Iterable[tuple[str, str | bytes]]


def _admin_calls(value: object) -> frozenset[str]:
    """The Admin calls a key file's `admin` list names; anything but a bool or such a list is refused, as an
    unknown name is: `admin = "drain"` or a misspelt call must not load as a key that silently lacks its rights."""
    if not isinstance(value, list | tuple | set | frozenset) or not all(isinstance(c, str) for c in value):
        raise ValueError(f"admin must be true, false or a list of Admin calls ({_names(ADMIN_CALLS)}), got {value!r}")
    if unknown := set(value) - ADMIN_CALLS:
        raise ValueError(f"admin: unknown Admin call(s) {_names(unknown)}; the calls are {_names(ADMIN_CALLS)}")
    return frozenset(value)


def _names(calls: Iterable[str]) -> str:
    return ", ".join(sorted(calls))


def _check_number(name: str, value: object, whole: bool) -> None:
    kinds = int if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):  # bool is an int
        raise ValueError(f"{name} must be a finite number (0: unlimited), got {value!r}")


@dataclass(frozen=True)
class Tenant:
    """The caller a request was authenticated as: its tenant, the key it used, and that key's caps.
    A limit of 0 means unlimited."""

    name: str
    key_name: str = ""
    max_priority: int = 2**31 - 1
    requests_per_second: float = 0.0
    tokens_per_minute: float = 0.0
    max_concurrent: int = 0
    # The Admin service's calls it may make: true every one, false none, or a list of their names (a worker pod's
    # drain key: ["DrainWorkers"], so that what its pod's environment leaks can neither scale nor survey the cluster).
    # An open cluster lets everyone.
    admin: bool | frozenset[str] = False
    # Its tenant's own limits (the key file's [[tenants]] entry), charged beside the key's: shared by its keys.
    shared: Tenant | None = None
    # The SHA-256 of the key it was authenticated with (as the file stores it; its KeyTable sets it): which key a
    # reload revoked, whatever its name (a name may be kept for a new key). Empty for a tenant's own limits and an
    # open cluster. Not compared: the same key under the same caps is the same caller.
    key_digest: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        """Each field of its type, each limit >= 0: from a key file, `admin = "false"` would be a true flag,
        `max_priority = "5"` fail every request, and a negative limit silently mean none."""
        for name, kind in (("name", str), ("key_name", str), ("key_digest", str)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.shared is not None and not isinstance(self.shared, Tenant):
            raise ValueError(f"shared must be a tenant's limits, got {self.shared!r}")
        if not isinstance(self.admin, bool):  # a key file's list, kept as immutable as the rest of a Tenant
            object.__setattr__(self, "admin", _admin_calls(self.admin))
        _check_number("max_priority", self.max_priority, whole=True)
        for name in ("max_concurrent", "requests_per_second", "tokens_per_minute"):
            _check_number(name, getattr(self, name), whole=name == "max_concurrent")
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: unlimited), got {getattr(self, name)!r}")

    @property
    def holders(self) -> tuple[Tenant, ...]:
        """Whose limits a request of this key is charged to: the key's, and its tenant's where the file sets any."""
        return (self,) if self.shared is None else (self, self.shared)

    @property
    def who(self) -> str:
        """Whose limits these are, as a refusal names them."""
        if self.key_name.startswith(TENANT_LIMITS):
            return f"tenant {self.name!r}"
        return f"API key {self.key_name!r}"

    @property
    def admin_calls(self) -> frozenset[str]:
        if isinstance(self.admin, bool):
            return ADMIN_CALLS if self.admin else frozenset()
        return self.admin

    def check_admin(self, call: str) -> None:
        """PermissionDeniedError unless this key may make `call`, an Admin method; the refusal names what it may."""
        if call in (allowed := self.admin_calls):
            return
        key = f"API key {self.key_name!r}"
        if not allowed:
            raise PermissionDeniedError("authorization", f"{key} may not call the Admin service ({call})")
        raise PermissionDeniedError(
            "authorization", f"{key} may call only {_names(allowed)} of the Admin service, not {call}"
        )

    def check_priority(self, priority: int) -> None:
        if priority > self.max_priority:
            raise PermissionDeniedError(
                "priority", f"{priority} is above the highest this API key may use ({self.max_priority})"
            )


OPEN = Tenant(OPEN_TENANT, admin=True)


class KeyTable:
    """sha256 hex digest -> Tenant, from the `[[keys]]` tables of an --api-keys file."""

    def __init__(self, tenants: Mapping[str, Tenant], weights: Mapping[str, float] | None = None) -> None:
        self._by_digest = {d: t if t.key_digest == d else replace(t, key_digest=d) for d, t in tenants.items()}
        self.weights = dict(weights or {})  # each tenant's weight in a full cluster's fair share (absent: 1)

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._by_digest.values())

    @property
    def limits(self) -> list[Tenant]:
        """Every holder of limits: each key, and each tenant of a [[tenants]] entry once."""
        return list({h.key_name: h for t in self.tenants for h in t.holders}.values())

    @classmethod
    def from_file(cls, path: str | Path) -> KeyTable:
        """Raises ValueError naming the entry when a key table is malformed, so a typo fails the start."""
        return cls.parse(Path(path).read_bytes(), path)

    @classmethod
    def parse(cls, data: bytes, path: str | Path) -> KeyTable:
        """The table of a key file's bytes (as read once: a reload checks what it swaps in); ValueError as
        `from_file`'s."""
        try:
            document = tomllib.loads(data.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid TOML ({e})") from None
        if unknown := sorted(set(document) - {"keys", "tenants"}):  # a [[kyes]] entry would be a key dropped unsaid
            raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; the keys go in [[keys]] tables")
        shared, weights = _tenant_limits(document.get("tenants", []), path)
        entries = document.get("keys", [])
        if not isinstance(entries, list):
            raise ValueError(f"{path}: keys must be [[keys]] tables, one per key, got {entries!r}")
        tenants: dict[str, Tenant] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: keys[{i}] must be a table (sha256, tenant, ...), got {entry!r}")
            entry = dict(entry)
            digest = str(entry.pop("sha256", "")).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{path}: keys[{i}].sha256 must be 64 hex digits (the SHA-256 of the key)")
            if digest in tenants:
                raise ValueError(f"{path}: keys[{i}] repeats the digest of {tenants[digest].key_name!r}")
            if "tenant" not in entry:
                raise ValueError(f"{path}: keys[{i}] names no tenant")
            # Unnamed, a key is named by its digest, never by its place: quotas are kept by name, and a reload that
            # removed a key before it would otherwise hand its counts to the next one.
            name = entry.pop("name", f"sha256:{digest[:12]}")
            if any(t.key_name == name for t in tenants.values()):  # quotas are kept by name, in Redis too
                raise ValueError(f"{path}: keys[{i}] repeats the name {name!r}; each key needs its own")
            if str(name).startswith(TENANT_LIMITS):
                raise ValueError(f"{path}: keys[{i}]: a key's name may not start with {TENANT_LIMITS!r}")
            try:
                tenant = entry.pop("tenant")
                tenants[digest] = Tenant(
                    name=tenant, key_name=name, shared=shared.get(tenant), key_digest=digest, **entry
                )
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: keys[{i}]: {e}") from None
        if not tenants:
            raise ValueError(f"{path}: holds no [[keys]]; omit --api-keys to run an open cluster")
        if strays := sorted(set(shared) - {t.name for t in tenants.values()}):  # a misspelt name would limit nobody
            raise ValueError(f"{path}: [[tenants]] {', '.join(map(repr, strays))}: no key has that tenant")
        return cls(tenants, weights)

    def grants(self, tenant: Tenant) -> bool:
        """Whether `tenant`'s key (authenticated against this table or an earlier one) still authenticates here as
        that tenant: a key removed, or moved to another tenant, no longer does; new caps change nothing."""
        now = self._by_digest.get(tenant.key_digest)
        return now is not None and now.name == tenant.name

    def authenticate(self, metadata: Metadata) -> Tenant:
        """The tenant of the request's `authorization: Bearer KEY`, or UnauthenticatedError (MissingKeyError for
        none). More than one `authorization` is refused, not one of them picked: which one a check takes and which
        one a proxy in front reads or adds need not agree. A value without the Bearer scheme, or a key this table
        does not hold, is refused saying so; no message echoes a key."""
        values = authorization_values(metadata)
        if not values:
            raise MissingKeyError("this cluster requires an API key: send metadata `authorization: Bearer KEY`")
        if len(values) > 1:
            raise UnauthenticatedError(f"authorization given {len(values)} times; send one `authorization: Bearer KEY`")
        key = bearer_key(values[0])
        tenant = self._by_digest.get(digest(key))
        if tenant is None:
            raise UnauthenticatedError("unknown API key")
        return tenant


def _tenant_limits(entries: object, path: str | Path) -> tuple[dict[str, Tenant], dict[str, float]]:
    """The [[tenants]] entries: a tenant's own limits, which all its keys' requests are charged to as well, and
    its weight in the fair share of a full cluster (services/router/tenant_shares.py)."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: tenants must be [[tenants]] tables (name and limits), got {entries!r}")
    limits: dict[str, Tenant] = {}
    weights: dict[str, float] = {}
    for i, entry in enumerate(entries):
        entry = dict(entry)
        name = entry.pop("name", None)
        if not isinstance(name, str) or name in limits:
            raise ValueError(f"{path}: tenants[{i}] needs a name of its own (a key's tenant), got {name!r}")
        weight = entry.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ValueError(f"{path}: tenants[{i}].weight must be a positive number, got {weight!r}")
        weights[name] = float(weight)
        if unknown := sorted(set(entry) - set(TENANT_LIMIT_FIELDS)):
            fields = ", ".join(("weight", *TENANT_LIMIT_FIELDS))
            raise ValueError(f"{path}: tenants[{i}]: unknown {', '.join(unknown)}; a tenant's fields are {fields}")
        try:
            limits[name] = Tenant(name=name, key_name=TENANT_LIMITS + name, **entry)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: tenants[{i}]: {e}") from None
    return limits, weights


def authenticate(table: KeyTable | None, metadata: Metadata) -> Tenant:
    """The one entry point: an open cluster (no table) serves everyone as the `anonymous` tenant."""
    return OPEN if table is None else table.authenticate(metadata)


def authorization_values(metadata: Metadata) -> list[str]:
    """Every `authorization` value, as text (a mapping's items hold repeats: Starlette's headers keep them)."""
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    return [
        v.decode("utf-8", "replace") if isinstance(v, bytes) else v for k, v in items if k.lower() == AUTHORIZATION_KEY
    ]


def bearer_key(value: str) -> str:
    """The key of an `authorization` value; UnauthenticatedError, naming what is wrong, for another scheme or none."""
    if value[: len(BEARER)].lower() != BEARER:
        raise UnauthenticatedError("authorization lacks the Bearer scheme: send `authorization: Bearer KEY`")
    if not (key := value[len(BEARER) :].strip()):
        raise UnauthenticatedError("authorization holds no key after `Bearer `: send `authorization: Bearer KEY`")
    return key


def digest(key: str) -> str:
    """What the key file stores: `printf %s KEY | sha256sum`."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """A client's call metadata for `key` (none without one)."""
    return ((AUTHORIZATION_KEY, f"Bearer {key}"),) if key else ()
