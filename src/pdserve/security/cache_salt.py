"""Prefix-cache salts: the key chain of a request's cached blocks starts from its tenant's salt (and the
request's own `cache_salt`, when it sends one), so a tenant never hits, nor times, another tenant's blocks.

Salts are keyed with the cluster secret (a key derived from it): a caller of the internal RPCs, who chooses a
request's salt bytes, cannot compute another tenant's from its name, and a reader of the prefix index in Redis
without the secret cannot tell whether a prompt it guesses was sent. The open cluster's anonymous tenant is salted
too: its unsalted chain was a hash of the tokens alone, which anyone could compute for a guessed prompt and look up.
"""

from __future__ import annotations

import hashlib

from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import utf8_len
from pdserve.security.cluster_secret import ClusterSecret

MAX_CACHE_SALT_BYTES = 256


def cache_salt(tenant: str, request_salt: str = "", cluster: ClusterSecret | None = None) -> bytes:
    """16 bytes that differ for every (tenant, request salt) pair, under `cluster`'s secret (default: this
    process's)."""
    if utf8_len(request_salt) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(
            "cache_salt", f"{utf8_len(request_salt)} bytes; at most {MAX_CACHE_SALT_BYTES} are accepted"
        )
    name = tenant.encode()
    material = len(name).to_bytes(4, "big") + name + request_salt.encode()  # length first: no ambiguous joins
    key = (cluster or ClusterSecret.from_env()).cache_salt_key
    return hashlib.blake2b(material, digest_size=16, key=key, person=b"pdserve-salt").digest()
