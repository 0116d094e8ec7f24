"""The cluster secret: what makes a caller of an internal RPC, a KV transfer or a prefill address a cluster peer.

One random secret per cluster (env PDSERVE_CLUSTER_SECRET; `pdserve up` makes one per run when it is unset, and
its workers inherit it). Never used as is on a wire: each use gets its own key derived from it, so what one use
exposes (the RPC token, readable on a plaintext internal hop) gives nothing toward another (the KV-header MAC,
the prefill grants).

- RPC token: metadata every internal call carries; worker servers refuse calls without it (UNAUTHENTICATED).
- Prefill grant: the router's MAC over (request key, prefill address) it placed the request on, from the
  registry; a decode worker dials a prefill address only with a valid grant, so it never dials an address a
  caller made up (server-side request forgery) nor keeps a connection per made-up address.
- Transfer key: keys the MAC of each KV transfer's control header (transfer/wire.py).
- Cache-salt key: keys the tenants' prefix-cache salts (security/cache_salt.py).
Without a secret (in-process tests and benches) every check passes: the same code, an open cluster.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from pdserve import env

CLUSTER_AUTH_KEY = "x-pdserve-cluster-auth"  # gRPC metadata of internal calls


@dataclass(frozen=True)
class ClusterSecret:
    secret: bytes = b""

    @classmethod
    def from_env(cls) -> ClusterSecret:
        return cls(env.cluster_secret())

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def _derive(self, purpose: str, *parts: str) -> bytes:
        message = b"\0".join(p.encode() for p in (purpose, *parts))
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    @property
    def rpc_token(self) -> str:
        return self._derive("rpc-token").hex()

    @property
    def transfer_key(self) -> bytes:
        return self._derive("kv-transfer-mac")

    @property
    def cache_salt_key(self) -> bytes:
        """b"" without a secret: blake2b unkeyed."""
        return self._derive("cache-salt") if self.enabled else b""

    def check_rpc_token(self, presented: str | None) -> bool:
        return not self.enabled or (presented is not None and hmac.compare_digest(presented, self.rpc_token))

    def prefill_grant(self, request_key: str, prefill_address: str) -> bytes:
        return self._derive("prefill-grant", request_key, prefill_address)[:16]

    def check_prefill_grant(self, request_key: str, prefill_address: str, grant: bytes) -> bool:
        return not self.enabled or hmac.compare_digest(grant, self.prefill_grant(request_key, prefill_address))
