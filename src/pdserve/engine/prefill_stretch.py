"""How much the short prompts that go ahead of a long prompt's chunks (short_first.py) stretch its prefill, as a
prefill worker measured it on its recent long prompts.

Short prompts may run between two chunks of a long prompt, up to one chunk's tokens each time, so under a stream of
them a long prompt's prefill takes up to about twice its own compute. A router pricing a long prompt as its own
compute plus the queue ahead of it sees none of the short prompts that will arrive during its prefill: in
docs/experiments/prefill_head_of_line/ such prompts measured 1.51x their prediction at the median. Per long prompt
whose prefill ends, the stretch is the time of its own chunks' steps and of the steps between them that ran other
prompts, over its own (not the wall time: the engine's idle moments between steps stretched a long prompt alone, and
a router then shed, on an idle cluster, a prompt whose SLO its own cost filled). In seconds, not in tokens: a short
prompt's step costs its fixed part whatever its tokens, and a long prompt's chunk at depth costs its attention to
the tokens before it, so the short tokens that went ahead over its own would misprice both; and a ratio of this
worker's own times prices a long prompt whatever the profile's error on its compute. An average over recent long
prompts, which decays toward 1 (no stretch) while no long prompt runs: the short prompts' stream may have stopped,
and a worker that shed its long prompts for a stretch it no longer has would never measure it again.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.sequence import Sequence, SequenceStatus

WEIGHT = 0.3  # of each long prompt's stretch in the average: the last few long prompts weigh most
HALF_LIFE_S = 60.0  # while no long prompt is part-way through its prefill, the stretch past 1 halves in this long


class PrefillStretch:
    """One prefill worker's stretch of its long prompts (those of more new tokens than `chunk`, one step's)."""

    def __init__(self, chunk: int, weight: float = WEIGHT, half_life_s: float = HALF_LIFE_S) -> None:
        self.chunk = chunk
        self.weight = weight
        self.half_life_s = half_life_s
        self._stretch = 1.0
        self._at = 0.0  # when a long prompt's chunk last ran (time.monotonic()): the stretch decays from then
        self._part_way: list[Sequence] = []  # the long prompts seen running that have chunks left

    def value(self, now: float) -> float:
        """The stretch a long prompt starting now is expected to take: 1, none."""
        self._part_way = [s for s in self._part_way if _part_way(s)]
        if self._part_way:
            return self._stretch
        return 1.0 + (self._stretch - 1.0) * 0.5 ** (max(0.0, now - self._at) / self.half_life_s)

    def step_ran(self, ran: Iterable[tuple[Sequence, bool]], began: float, done: float) -> None:
        """A step from `began` to `done` ran a chunk of each of `ran`'s sequences (True: the chunk ended its
        prompt). A long prompt's chunk counts the step's time as its own; its last one ends its stretch's sample. A
        recompute (a preempted sequence's) is skipped: its wait is no short prompt's doing."""
        ran = list(ran)
        stepped = {id(seq) for seq, _ in ran}
        for seq in self._part_way:
            if id(seq) not in stepped and _part_way(seq):
                seq.passed_s += done - began  # a step of other prompts, between two of its chunks
        for seq, last in ran:
            if seq.num_prompt_tokens - seq.num_cached_tokens <= self.chunk or seq.num_preemptions:
                continue
            if seq not in self._part_way:
                self._stretch = self.value(began)  # decayed over the time no long prompt was part-way
                if not last:
                    self._part_way.append(seq)
            seq.own_chunks_s += done - began
            self._at = done
            if last:
                sample = (seq.own_chunks_s + seq.passed_s) / seq.own_chunks_s
                self._stretch += self.weight * (sample - self._stretch)


def _part_way(seq: Sequence) -> bool:
    """Running with chunks left: not waiting again (preempted), handed off or finished."""
    return seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens < seq.num_prompt_tokens
