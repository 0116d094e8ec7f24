"""How much short prompts going ahead of a long prompt's chunks stretch its prefill, as a prefill worker measures it
(engine/prefill_stretch.py): its own chunks' steps and the other prompts' steps between them over its own chunks'
time, averaged over recent long prompts, decaying toward 1 while none runs. Steps are timed on a clock of the
test's own, one second each."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.prefill_stretch import HALF_LIFE_S, WEIGHT
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.test_scheduler import Sim
from tests.unit.engine.test_short_first import PREFILL

PREFILL_64 = replace(PREFILL, max_num_batched_tokens=64, long_prefill_chunk=64, mode=EngineMode.PREFILL_ONLY)


class Clocked:
    """A Sim whose steps each take one second, timed as the engine times them."""

    def __init__(self) -> None:
        self.sim = Sim(PREFILL, num_blocks=64)
        self.now = 0.0

    def steps(self, n: int | None = None) -> list[str]:
        ran = []
        while self.sim.sched.has_work and (n is None or len(ran) < n):
            out = self.sim.step()
            for seq in out.started:
                seq.first_scheduled = self.now
            self.sim.sched.step_took(self.now, self.now + 1.0)
            self.now += 1.0
            ran += [c.seq_id for c in out.chunks]
        return ran

    def long_passed_by_five_short(self) -> Clocked:
        """A long prompt's first chunk run, then five short prompts waiting to go ahead of its others."""
        self.sim.add("long", list(range(32)), max_tokens=1)
        self.steps(1)
        for i in range(5):
            self.sim.add(f"s{i}", list(range(100 + 10 * i, 103 + 10 * i)), max_tokens=1)
        return self

    def stretch(self, at: float | None = None) -> float:
        assert self.sim.sched.stretch is not None
        return self.sim.sched.stretch.value(self.now if at is None else at)


def test_a_long_prompt_alone_is_not_stretched() -> None:
    c = Clocked()
    c.sim.add("long", list(range(32)), max_tokens=1)
    assert c.steps() == ["long"] * 4
    assert c.stretch() == 1.0


def test_the_engines_idle_moments_between_a_long_prompts_chunks_are_no_stretch() -> None:
    """Its steps 1 s each with 2 s of nothing between them (the loop's own time, a busy host): a router pricing
    that as stretch shed, on an idle cluster, a long prompt whose SLO its own cost filled (a CI run)."""
    c = Clocked()
    c.sim.add("long", list(range(32)), max_tokens=1)
    for _ in range(4):
        c.steps(1)
        c.now += 2.0
    assert c.stretch(c.now - 2.0) == 1.0


def test_short_prompts_that_went_ahead_of_its_chunks_stretch_it_by_their_steps() -> None:
    """9 s from its first chunk to its last, 4 of them its own: a sample of 2.25, weighed into the average of 1."""
    c = Clocked().long_passed_by_five_short()
    assert c.steps() == ["s0", "s1", "s2", "long", "s3", "s4", "long", "long"]
    assert c.stretch() == pytest.approx(1 + WEIGHT * (9 / 4 - 1))
    # Short prompts alone measure nothing: no long prompt of theirs ran.
    c.sim.add("s5", list(range(200, 203)), max_tokens=1)
    c.steps()
    assert c.stretch(c.now - 1) == pytest.approx(1 + WEIGHT * (9 / 4 - 1))


def test_the_stretch_decays_toward_one_while_no_long_prompt_runs_and_holds_while_one_is_part_way() -> None:
    c = Clocked().long_passed_by_five_short()
    c.steps()
    measured = 1 + WEIGHT * (9 / 4 - 1)
    assert c.stretch(c.now + HALF_LIFE_S) == pytest.approx(1 + (measured - 1) / 2)
    c.sim.add("next", list(range(300, 332)), max_tokens=1)
    c.steps(1)  # its first chunk, right away: nothing decayed
    assert c.stretch(c.now + 10 * HALF_LIFE_S) == pytest.approx(measured)  # part-way: its chunks are slow, not gone


def test_a_prefill_engine_reports_the_stretch_its_long_prompts_took() -> None:
    """Through the engine's own steps and clock: a short prompt that runs between two chunks of a long one stretches
    it past 1 (its step's time is not the long prompt's own), reported in thousandths."""
    engine = LLMEngine(EngineConfig(model="tiny-random", num_threads=1, num_kv_blocks=64, scheduler=PREFILL_64))
    assert engine.stats()["prefill_stretch_milli"] == 1000
    engine.add_request(EngineRequest("long", list(range(3, 203)), SamplingParams(max_tokens=2)))
    engine.step()  # its first chunk
    engine.add_request(EngineRequest("short", list(range(210, 230)), SamplingParams(max_tokens=2)))
    ran = []
    while engine.has_unfinished():
        ran += [o.request_id for o in engine.step()]
    assert ran[0] == "short"
    assert engine.stats()["prefill_stretch_milli"] > 1000
