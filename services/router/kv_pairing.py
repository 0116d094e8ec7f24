"""Which prefill and decode workers may be paired: those whose KV the other can use (`WorkerState.kv_pairing`: the
same weights, block size and KV transfer version). A fleet runs one such version but while a rollout replaces its
weights, block size or KV header; then each request is placed within one version, never across."""

from __future__ import annotations

from pdserve.registry.base import WorkerState

Group = tuple[list[WorkerState], list[WorkerState]]


def pairing_groups(prefills: list[WorkerState], decodes: list[WorkerState]) -> list[Group]:
    """The prefill and decode workers by `kv_pairing`, each group with both roles, so a pair's hand-offs are never
    refused; none when no version has both (a rollout's gap: the new prefill worker serving, the new decode worker
    still loading, the old ones gone)."""
    groups = []
    for pairing in sorted({w.kv_pairing for w in (*prefills, *decodes)}, reverse=True):
        paired = [w for w in prefills if w.kv_pairing == pairing]
        with_them = [w for w in decodes if w.kv_pairing == pairing]
        if paired and with_them:
            groups.append((paired, with_them))
    return groups


def pairable(prefills: list[WorkerState], decodes: list[WorkerState]) -> Group:
    """Of `prefills` and `decodes`, those of a `kv_pairing` both roles have; all of them where none is shared."""
    shared = {w.kv_pairing for w in prefills} & {w.kv_pairing for w in decodes}
    if not shared:
        return prefills, decodes
    return [w for w in prefills if w.kv_pairing in shared], [w for w in decodes if w.kv_pairing in shared]


def versions(workers: list[WorkerState]) -> str:
    """The workers' versions as a log line or an error names them: fingerprint/block size/KV transfer version."""
    return ", ".join(
        sorted({f"{w.model_fingerprint or '?'}/{w.block_size}/v{w.speaks_kv_wire_version}" for w in workers})
    )


def running(workers: list[WorkerState], weights: str) -> list[WorkerState]:
    """The workers running the weights of fingerprint `weights`."""
    return [w for w in workers if w.model_fingerprint == weights]
