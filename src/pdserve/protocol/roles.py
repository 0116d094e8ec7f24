"""What a worker does: its role in the cluster, and the engine mode that role runs."""

from __future__ import annotations

import enum


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
