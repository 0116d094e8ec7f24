"""A speed probe (engine/speed_probe.py) times one prompt of its own through an idle engine: a prefill worker's
reading is its prompt's step, a colocated worker's a decode step after it; the pool and the prefix cache are left as
they were (nothing keyed, nothing evicted, no block left held). It runs only on an idle engine. Its reading replaces
the live correction (SpeedTracker.probed); one far from it only once a second probe confirms it, so a probe paused
midway (a GC, a freeze) moves nothing, and a worker truly slowed or sped up is read so at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from pdserve.cluster.worker_spec import role_scheduler
from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.profiling import SpeedTracker
from pdserve.engine.speed_probe import PROBE_TOKENS, Reading, run_probe
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.perf_profile import PerfProfile
from pdserve.protocol.roles import Role
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import assert_idle, complete

pytestmark = pytest.mark.timeout(60)
CACHED = list(range(3, 3 + 48))  # three full blocks the prefix cache keeps


def engine_of(role: Role, num_kv_blocks: int = 64) -> LLMEngine:
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks)
    return LLMEngine(replace(config, num_threads=1, scheduler=role_scheduler(config.scheduler, role)))


class Readings:
    """A probe's reader that takes each reading as it comes, none confirmed by a second probe."""

    def __init__(self) -> None:
        self.taken: list[Reading] = []

    def probed(self, *reading: int | float) -> None:
        self.taken.append(reading)  # type: ignore[arg-type]

    def far(self, *reading: int | float) -> bool:
        return False


def probe(engine: LLMEngine, may_run: bool = True) -> list[Reading]:
    readings = Readings()
    ran = run_probe(engine, readings, lambda: may_run)
    assert ran == bool(readings.taken)
    return readings.taken


class DelayedSteps:
    """The engine's steps, each `seconds` longer (a host that slow), and the next one `pause` more (a GC or a freeze
    mid-probe): set far over tiny-random's own step (milliseconds), so a probe's reading is known."""

    def __init__(self, engine: LLMEngine, seconds: float) -> None:
        self.step, self.seconds, self.pause, self.steps = engine.step, seconds, 0.0, 0
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> object:
        time.sleep(self.seconds + self.pause)
        self.pause, self.steps = 0.0, self.steps + 1
        return self.step()


@pytest.mark.parametrize("role", [Role.PREFILL, Role.COLOCATED])
def test_a_probe_times_one_step_and_leaves_the_pool_and_the_prefix_cache_as_they_were(role: Role) -> None:
    engine = engine_of(role)
    complete(engine, [CACHED + [60]], SamplingParams(max_tokens=1))
    blocks, journal = engine.blocks, engine.blocks.journal
    assert journal is not None and blocks.num_cached_blocks == 3
    journal.take()
    cached, hits = blocks.block_hashes(), blocks.prefix_hits
    (reading,) = probe(engine)
    assert reading[2] > 0
    assert_idle(engine)
    assert (blocks.block_hashes(), blocks.prefix_hits, blocks.enable_prefix_caching) == (cached, hits, True)
    changes = journal.take()  # the routers' prefix index learns nothing of it
    assert (changes.stored, changes.removed) == ([], [])
    complete(engine, [CACHED + [61]], SamplingParams(max_tokens=1))
    assert blocks.prefix_hits == hits + 3  # the cached prompt is still there


def test_a_prefill_workers_probe_reads_its_prompt_and_a_colocated_workers_a_decode_step_after_it() -> None:
    """A colocated worker's one factor prices its decode steps too, which are most of its live steps: a prompt's
    reading priced an idle one's decode 1.3-1.8x slow (smollm2-135m), and a TPOT SLO it met was refused."""
    (prompt,) = probe(engine_of(Role.PREFILL))
    assert (prompt[0], prompt[1], prompt[3], prompt[4]) == (PROBE_TOKENS, 0, PROBE_TOKENS**2, 0)
    (decode,) = probe(engine_of(Role.COLOCATED))
    assert (decode[0], decode[1], decode[3]) == (0, 1, 0) and PROBE_TOKENS + 1 <= decode[4] <= PROBE_TOKENS + 3


def test_no_probe_runs_beside_a_request_or_once_told_not_to() -> None:
    engine = engine_of(Role.PREFILL)
    engine.add_request(EngineRequest("held", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert probe(engine) == []
    assert [r.request_id for r in engine.step()] == ["held"]  # a prefill worker holds it for its hand-off
    assert probe(engine) == []
    engine.release("held")
    assert probe(engine, may_run=False) == []
    assert len(probe(engine)) == 1


def test_a_probe_runs_only_where_one_run_of_free_blocks_holds_it_and_evicts_no_cached_block() -> None:
    """Three prompts in one step of a colocated engine take blocks 0-1, 2-5 and 6-8; their full blocks stay cached
    between the partial ones freed: 5 free blocks (the probe's 64 tokens and its 3 decodes), in runs of 1, 1 and 3.
    Allocated through the cache, the probe would evict cached blocks to make a run."""
    engine = engine_of(Role.COLOCATED, num_kv_blocks=11)
    complete(engine, [list(range(200, 217)), CACHED + [60], list(range(100, 133))], SamplingParams(max_tokens=1))
    blocks = engine.blocks
    assert (blocks.num_cached_blocks, blocks.num_free_blocks) == (6, 11)
    assert probe(engine) == [] and blocks.num_cached_blocks == 6
    roomy = engine_of(Role.COLOCATED, num_kv_blocks=10)
    complete(roomy, [CACHED + [60]], SamplingParams(max_tokens=1))  # 3 cached, then a run of 7 free blocks
    assert len(probe(roomy)) == 1 and roomy.blocks.num_cached_blocks == 3


def test_a_probe_replaces_the_live_correction_a_live_step_moves_it_a_tenth() -> None:
    profile = PerfProfile(0.01, 1e-3, 0.0, 0.01, 1e-3)
    speed = SpeedTracker(profile)
    stepped_at = speed.stepped_at
    speed.probed(64, 0, profile.prefill_s(64) / 4, 64 * 64, 0)  # a profile timed 4x slow: one probe corrects it
    assert speed.factor == pytest.approx(0.25)
    assert speed.stepped_at == stepped_at < speed.observed_at  # a probe is a reading, not a live step
    speed.observe(64, 0, profile.prefill_s(64), 64 * 64)
    assert speed.factor == pytest.approx(0.25 + 0.1 * 0.75)
    assert speed.stepped_at == speed.observed_at
    speed.probed(64, 0, 100.0, 64 * 64, 0)  # bounded as a live step's ratio is
    assert speed.factor == 4.0
    speed.probed(0, 1, profile.decode_step_s(1, 65) / 2, 0, 65)  # a colocated worker's: a decode step's
    assert speed.factor == pytest.approx(0.5)


def test_a_probe_paused_midway_moves_the_factor_nothing_and_a_worker_truly_slowed_or_sped_up_is_read_at_once() -> None:
    """A pause of the process mid-probe only adds time: read alone, it set the factor to the 4x bound, and routers sent
    the worker nothing until the next probe (30 s). A reading over 1.5x off the factor waits for a second probe at once
    and takes the faster: the pause's is dropped, a real change reads in both."""
    profile = PerfProfile(0.1, 1e-3, 0.0, 0.01, 1e-3)
    base = profile.prefill_s(PROBE_TOKENS)  # 164 ms: a probe's step reads its price, plus tiny-random's own few ms
    engine, speed = engine_of(Role.PREFILL), SpeedTracker(profile)
    steps = DelayedSteps(engine, base)

    def probe_into_speed(may_run: Callable[[], bool] = lambda: True) -> int:
        before = steps.steps
        assert run_probe(engine, speed, may_run)
        return steps.steps - before

    assert probe_into_speed() == 1 and 1.0 <= speed.factor < 1.5  # near the factor (1.0 at the start): one probe
    settled = speed.factor
    steps.pause = 1.0
    assert probe_into_speed() == 2 and speed.factor < 1.5  # read 4x, confirmed by nothing
    assert speed.factor != settled  # the second probe's reading, taken
    steps.seconds = 3 * base  # the host truly slowed 3x (another process's load)
    assert probe_into_speed() == 2 and 2.9 <= speed.factor < 3.6
    steps.seconds = base  # and back (or a profile timed 3x slow): a probe corrects it at once, downwards too
    assert probe_into_speed() == 2 and speed.factor < 1.5
    steps.pause, settled, drain = 1.0, speed.factor, iter([True, False])
    assert probe_into_speed(lambda: next(drain)) == 1  # a drain began before the second: unconfirmed, not taken
    assert speed.factor == settled
