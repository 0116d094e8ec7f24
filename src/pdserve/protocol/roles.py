"""What a worker does: its role in the cluster, and the engine mode that role runs."""

from __future__ import annotations

import enum
from collections.abc import Mapping


class EngineMode(enum.Enum):
    MIXED = "mixed"  # prefill and decode in one engine: single process and the colocated baseline
    PREFILL_ONLY = "prefill-only"  # stop after the first token; keep the blocks for the hand-off
    DECODE_ONLY = "decode-only"  # sequences arrive with their KV from a prefill worker


class Role(enum.StrEnum):
    """A worker's place in the request path; its value is what the registry, logs and `pdserve status` show."""

    PREFILL = "prefill"  # runs prompts, hands their KV blocks to a decode worker
    DECODE = "decode"  # reserves blocks, receives the KV, decodes and streams
    COLOCATED = "colocated"  # both phases in one engine: the baseline disaggregation must beat

    @property
    def engine_mode(self) -> EngineMode:
        return _ENGINE_MODES[self]


_ENGINE_MODES = {
    Role.PREFILL: EngineMode.PREFILL_ONLY,
    Role.DECODE: EngineMode.DECODE_ONLY,
    Role.COLOCATED: EngineMode.MIXED,
}


def mode_roles(colocated: bool) -> tuple[Role, ...]:
    """The roles a cluster of that mode is scaled by: a colocated one by `colocated` alone, a disaggregated one by
    `prefill` and `decode`."""
    return (Role.COLOCATED,) if colocated else (Role.PREFILL, Role.DECODE)


def other_mode_role(asked: Mapping[Role, int] | Mapping[str, int], colocated: bool) -> tuple[str, str] | None:
    """The first role asked a count for that a cluster of the other mode has, and why it is refused (the router's
    ScaleWorkers and `pdserve scale --dry-run` give the same answer)."""
    wanted = mode_roles(colocated)
    role = next((r for r, n in asked.items() if n and r not in wanted), None)
    if role is None:
        return None
    shape = "colocated: set colocated only" if colocated else "disaggregated: set prefill and decode"
    return str(role), f"this cluster is {shape}"
