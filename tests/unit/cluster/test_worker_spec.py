"""What engine each role's worker runs, as its spec builds it in the worker's own process."""

from __future__ import annotations

import pytest

from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import Role
from pdserve.protocol.sampling import SamplingParams


def test_a_decode_worker_decodes_its_whole_batch_every_step_however_small_the_token_budget() -> None:
    """`--max-num-seqs` past the step's token budget (2048 by default): the batch's last sequences got no token, step
    after step, until those ahead of them ended (here 4 of 8 for 20 steps), a silence a router's stall bound takes
    for a hung worker, which it ejects and whose streams it moves."""
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, long_prefill_chunk=4)
    engine_config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_threads=1, scheduler=scheduler)
    engine = LLMEngine(WorkerSpec(Role.DECODE, engine_config).engine_config())
    for i in range(8):
        engine.reserve(EngineRequest(f"s{i}", [5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True)))
        engine.commit(f"s{i}", 9)
    for _ in range(3):
        assert sorted(out.request_id for out in engine.step()) == [f"s{i}" for i in range(8)]


@pytest.mark.parametrize("role", [Role.DECODE, Role.COLOCATED])
def test_a_decoding_workers_budget_holds_a_full_batch_and_a_recomputes_chunk(role: Role) -> None:
    scheduler = SchedulerConfig(max_num_seqs=3000)
    budget = WorkerSpec(role, EngineConfig(scheduler=scheduler)).engine_config().scheduler.max_num_batched_tokens
    assert budget == 3000 + scheduler.long_prefill_chunk
    default = WorkerSpec(role, EngineConfig()).engine_config().scheduler
    assert default.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens  # the default batch fits already


def test_a_prefill_workers_budget_is_one_chunk() -> None:
    scheduler = WorkerSpec(Role.PREFILL, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=3000))).engine_config()
    assert scheduler.scheduler.max_num_batched_tokens == SchedulerConfig.long_prefill_chunk


@pytest.mark.parametrize("role", list(Role))
def test_only_a_prefill_worker_lets_short_prompts_ahead_of_long_ones_chunks(role: Role) -> None:
    """Where one prompt runs per step; a decoding worker's budget already holds a short prompt beside a chunk."""
    scheduler = WorkerSpec(role, EngineConfig()).engine_config().scheduler
    assert scheduler.short_prompts_first == (role is Role.PREFILL)
