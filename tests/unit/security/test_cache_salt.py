"""Salts differ per tenant and per request salt, the open cluster's anonymous tenant's too, each keyed with the
cluster secret."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.security.cache_salt import MAX_CACHE_SALT_BYTES, cache_salt
from pdserve.security.cluster_secret import ClusterSecret


def test_salts_separate_tenants_and_request_salts() -> None:
    salts = {cache_salt(t, s) for t in ("a", "b", "ab", "anonymous") for s in ("", "b", "x")}
    assert len(salts) == 12 and b"" not in salts
    assert cache_salt("a", "b") != cache_salt("ab", "")  # no ambiguous joins
    tokens = list(range(64))
    assert not set(prefix_hashes(tokens, 16, cache_salt("a"))) & set(prefix_hashes(tokens, 16, cache_salt("b")))


def test_an_oversized_salt_names_the_field() -> None:
    cache_salt("a", "x" * MAX_CACHE_SALT_BYTES)
    with pytest.raises(InvalidRequestError, match="^cache_salt"):
        cache_salt("a", "x" * (MAX_CACHE_SALT_BYTES + 1))


def test_a_salt_is_keyed_with_the_cluster_secret() -> None:
    """Whoever holds the internal RPC token chooses a request's salt bytes; without the cluster secret it cannot
    compute another tenant's, so it cannot probe that tenant's cached prefixes."""
    one, other = ClusterSecret(b"one"), ClusterSecret(b"other")
    assert cache_salt("acme", cluster=one) != cache_salt("acme", cluster=other)
    assert cache_salt("acme", cluster=one) != cache_salt("acme", cluster=ClusterSecret())
    assert cache_salt("acme", cluster=one) == cache_salt("acme", cluster=ClusterSecret(b"one"))


def test_the_open_clusters_prefix_keys_are_keyed_too() -> None:
    """An unsalted chain is a hash of the tokens alone: whoever reads the prefix index in Redis could hash a prompt
    it guesses and find whether it was sent. Keyed, only a holder of the cluster secret can."""
    tokens = list(range(64))
    salt = cache_salt("anonymous", cluster=ClusterSecret(b"one"))
    assert salt != cache_salt("anonymous", cluster=ClusterSecret(b"other"))
    assert not set(prefix_hashes(tokens, 16)) & set(prefix_hashes(tokens, 16, salt))
