"""The engine tests' shared helpers: a tiny-random engine on the CPU, prompts, and runs that fail instead of looping
forever."""

from __future__ import annotations

import itertools
import random

import pytest

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import FinishReason, RequestOutput
from pdserve.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
_request_ids = itertools.count()


def make_engine(num_kv_blocks: int = 256, block_size: int = 16, **scheduler: int) -> LLMEngine:
    config = EngineConfig(
        model="tiny-random",
        dtype="float32",
        device="cpu",
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        num_threads=1,
        scheduler=SchedulerConfig(**scheduler),
    )
    return LLMEngine(config)


def prompts(n: int, lo: int = 5, hi: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_used_blocks == 0
    assert engine.blocks.num_used_blocks + engine.blocks.num_free_blocks == engine.blocks.num_blocks


def record_schedules(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[SchedulerOutput]:
    plans: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        plans.append(schedule())
        return plans[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    return plans


def run_to_end(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def complete(
    engine: LLMEngine, batch: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[tuple[list[int], FinishReason | None]]:
    """Like engine.generate, but fails instead of looping forever: (token ids, finish reason) per prompt."""
    params = params if isinstance(params, list) else [params] * len(batch)
    ids = [f"req-{next(_request_ids)}" for _ in batch]
    for request_id, prompt, p in zip(ids, batch, params, strict=True):
        engine.add_request(EngineRequest(request_id, prompt, p))
    outs = run_to_end(engine)
    for request_id in ids:
        assert [o.finished for o in outs[request_id]] == [False] * (len(outs[request_id]) - 1) + [True]
    return [([t for o in outs[i] for t in o.new_token_ids], outs[i][-1].finish_reason) for i in ids]


def tokens(results: list[tuple[list[int], FinishReason | None]]) -> list[list[int]]:
    return [t for t, _ in results]
