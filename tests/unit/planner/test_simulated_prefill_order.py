"""The simulator's prefill workers take prompts in the order the engine's do (engine/short_first.py): a prompt that
fits one step ahead of a longer prompt's remaining chunks, within a credit of one chunk's tokens between two of its
chunks; and the simulated router prices a short prompt's wait as the router does (services/router/predictor.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.cluster.worker_spec import role_scheduler
from pdserve.config import SchedulerConfig
from pdserve.planner.admission_model import AdmissionModel
from pdserve.planner.placed_prompts import PlacedPrompts
from pdserve.planner.prefill_steps import PrefillSteps
from pdserve.planner.shape import Shape
from pdserve.planner.simulator import Simulator
from pdserve.planner.workload import SimRequest
from pdserve.protocol.roles import Role
from tests.unit.engine.test_scheduler import Sim
from tests.unit.planner.synthetic import PERF, synthetic_profile

SPLIT = Shape(prefill=1, decode=1)


def first_tokens(short_first: bool, requests: list[SimRequest]) -> list[float]:
    """When each request's first token came, in order of arrival."""
    result = Simulator(synthetic_profile(short_prompts_first=short_first), SPLIT).run(requests)
    return [r.arrival_s + ttft for r, ttft in zip(requests, result.ttft_s, strict=True)]


def test_a_short_prompt_sent_during_a_long_prompts_prefill_gets_its_first_token_before_the_long_one() -> None:
    """3000 tokens are six chunks of ~0.1 s; a 100-token prompt sent during the second waits only for it."""
    requests = [SimRequest(0.0, 3000, 2), SimRequest(0.15, 100, 2)]
    long_first, short_first = first_tokens(True, requests)
    assert short_first < 0.25 + PERF.prefill_s(100) < long_first
    fcfs_long, fcfs_short = first_tokens(False, requests)
    assert fcfs_long < fcfs_short  # first come, first served: after all six chunks
    assert long_first > fcfs_long  # the long prompt pays for the step that went ahead


def test_short_prompts_go_ahead_by_at_most_one_chunks_tokens_between_two_of_the_long_prompts_chunks() -> None:
    """Twenty 200-token prompts sent during the first of a 2048-token prompt's four chunks: three go ahead of each of
    the other three (600 tokens spend the credit of 512), so its first token comes after nine of them, not twenty."""
    requests = [SimRequest(0.0, 2048, 2)] + [SimRequest(0.01 + 0.001 * i, 200, 2) for i in range(20)]
    long, *short = first_tokens(True, requests)
    assert sorted(short)[8] < long < sorted(short)[9]


@dataclass(eq=False)
class _Prompt:
    name: str
    req: SimRequest
    prefilled: int = 0
    priority: int = 0


def test_the_simulated_prefill_worker_steps_prompts_in_the_engines_order() -> None:
    """The same arrivals on the engine's scheduler with a prefill worker's settings and on the simulator's: the same
    chunks, step after step (a long prompt under way, five short ones and a second long one queued)."""
    config = role_scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=8), Role.PREFILL)
    engine, simulated = Sim(config, num_blocks=64), PrefillSteps[_Prompt](config)
    queue: list[_Prompt] = []

    def add(name: str, tokens: int) -> None:
        engine.add(name, list(range(1000 * len(queue), 1000 * len(queue) + tokens)), max_tokens=1)  # no shared prefix
        queue.append(_Prompt(name, SimRequest(0.0, tokens, 1)))

    def steps(n: int | None = None) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        engine_steps, simulated_steps = [], []
        while engine.sched.has_work and (n is None or len(engine_steps) < n):
            (chunk,) = engine.step().chunks
            engine_steps.append((chunk.seq_id, len(chunk.token_ids)))
            picked = simulated.next(queue, lambda p: True)
            assert picked is not None
            prompt, tokens = picked
            prompt.prefilled += tokens
            if prompt.prefilled == prompt.req.input_len:
                queue.remove(prompt)
            simulated_steps.append((prompt.name, tokens))
        assert not queue or n is not None
        return engine_steps, simulated_steps

    add("long", 32)
    first_engine, first_simulated = steps(1)
    for i in range(5):
        add(f"s{i}", 3)
    add("long2", 20)
    rest_engine, rest_simulated = steps()
    assert first_simulated + rest_simulated == first_engine + rest_engine
    assert [name for name, _ in rest_engine][:6] == ["s0", "s1", "s2", "long", "s3", "s4"]


def test_a_short_prompts_predicted_wait_is_the_short_prompts_placed_and_a_chunk_of_a_longer_one() -> None:
    placed = PlacedPrompts(PERF, short_tokens=512)
    for tokens in (3000, 1000, 100, 200):
        placed.place(tokens)
    everything = sum(PERF.prefill_s(n) for n in (3000, 1000, 100, 200))
    assert placed.wait_s(600) == pytest.approx(everything)
    assert placed.wait_s(0) == pytest.approx(everything)
    chunk = max(PERF.prefill_s(n) * 512 / n for n in (3000, 1000))  # the larger share of a chunk of a longer one
    assert placed.wait_s(50) == pytest.approx(PERF.prefill_s(100) + PERF.prefill_s(200) + chunk)
    for tokens in (3000, 1000, 100, 200):
        placed.first_token(tokens)
    assert (placed.tokens, placed.wait_s(50), placed.wait_s(600)) == (0, 0.0, 0.0)
    in_order = PlacedPrompts(PERF, short_tokens=0)
    in_order.place(3000)
    assert in_order.wait_s(50) == pytest.approx(PERF.prefill_s(3000))


def test_admission_takes_a_short_prompt_behind_a_long_one_it_would_shed_in_order() -> None:
    """Behind a 3000-token prompt (0.6 s), with a 300 ms TTFT SLO: a 100-token prompt waits for a chunk of it at
    most, so the router admits it; where the worker took prompts in order, it would wait for all of it."""
    requests = [SimRequest(0.0, 3000, 2), SimRequest(0.05, 100, 2)]
    admission = AdmissionModel(ttft_s=0.3)
    for short_first, shed in ((True, 0), (False, 1)):
        profile = synthetic_profile(short_prompts_first=short_first)
        assert Simulator(profile, SPLIT, admission).run(requests).shed == shed
