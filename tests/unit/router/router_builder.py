"""A router's predictor, placement and admission over an in-process registry, and its request lifecycle (tiny-random's
tokenizer), built for unit tests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from pdserve.config import RouterConfig
from pdserve.engine.model_files import locate_model, read_model_config, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import OverloadedError
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.security.api_keys import KeyTable
from pdserve.security.quotas import Quotas
from pdserve.telemetry import Telemetry
from services.router.admission import MAX_RETRY_MS, MIN_RETRY_MS, Admission, SLOTarget
from services.router.lifecycle import RequestLifecycle
from services.router.load_tracker import LoadTracker
from services.router.placement import Placement, SLOAwarePlacement
from services.router.predictor import Predictor
from services.router.round_robin_placement import RoundRobinPlacement
from tests.unit.round_profile import PROFILE

BS = 16
MODEL = "tiny-random"


def worker(worker_id: str, role: str = "prefill", **fields: object) -> WorkerState:
    base: dict[str, object] = dict(
        address=f"{worker_id}.local:50051",
        block_size=BS,
        kv_blocks_total=4096,
        kv_blocks_free=4096,
        profile=PROFILE,
    )
    base.update(fields)
    return WorkerState(worker_id=worker_id, role=role, **base)  # type: ignore[arg-type]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


class Router:
    """What the router wires together per process, on an in-memory registry."""

    def __init__(
        self,
        workers: list[WorkerState],
        policy: str = "slo",
        registry: InMemoryRegistry | None = None,
        tokenizer: str = "",
        **config: object,
    ) -> None:
        self.config = RouterConfig(policy=policy, **config)  # type: ignore[arg-type]
        self.registry = registry or InMemoryRegistry(ttl_s=600)
        for w in workers:
            self.registry.publish(w)
        self.index = InMemoryPrefixIndex()
        self.tracker = LoadTracker()
        self.predictor = Predictor(self.config, self.tracker)
        cls = SLOAwarePlacement if policy == "slo" else RoundRobinPlacement
        self.placement = cls(self.registry, self.index, self.predictor, tokenizer=tokenizer)
        self.admission = Admission(self.config, self.predictor)

    def place(self, tokens: list[int], max_tokens: int, tpot_slo_s: float) -> Placement:
        return asyncio.run(self.placement.place(tokens, max_tokens, tpot_slo_s))

    def admit(
        self,
        tokens: list[int],
        max_tokens: int = 16,
        priority: int = 0,
        slo_s: tuple[float, float] = (5, 1),
        explicit: bool = True,
    ):
        placed = self.place(tokens, max_tokens, slo_s[1])
        slo = SLOTarget(*slo_s, explicit, explicit)
        self.admission.check_feasible(placed, len(tokens), slo)
        self.admission.check_load(placed, len(tokens), priority, slo)
        return placed

    def lifecycle(
        self, keys: KeyTable | None = None, quotas: Quotas | None = None, telemetry: Telemetry | None = None
    ) -> RequestLifecycle:
        """The request lifecycle on this placement, serving tiny-random (its tokenizer; the model's name); without
        `telemetry`, its metrics and spans go nowhere."""
        path = locate_model(MODEL)
        tokenizer, model = Tokenizer(tokenizer_folder(path)), read_model_config(path)
        telemetry = telemetry or Telemetry("test-router", enabled=False)
        return RequestLifecycle(
            tokenizer, model, self.config, self.placement, self.index, self.tracker, telemetry, MODEL, keys, quotas
        )


# --- Predictor -----------------------------------------------------------------------------------------------


def replace_free(w: WorkerState, free: int) -> WorkerState:
    return replace(w, kv_blocks_free=free, updated_at=time.time())


def shed(r: Router, tokens: list[int], match: str, **kw: object) -> OverloadedError:
    with pytest.raises(OverloadedError, match=match) as info:
        r.admit(tokens, **kw)  # type: ignore[arg-type]
    assert MIN_RETRY_MS <= info.value.retry_after_ms <= MAX_RETRY_MS
    assert 100 <= info.value.retry_after_ms <= 30_000
    return info.value
