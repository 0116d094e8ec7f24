"""Predicted TTFT and TPOT of a request on a candidate worker, from its profile, heartbeat and our own sends.

A prediction has two parts that admission treats differently: the request's own isolated cost (the fixed cost of
a first token's hops, fixed_cost.py, plus its prefill on an idle worker, minus prefix-cache hits, plus the KV
transfer; one decode step on an idle batch) and the part other requests add (the queue ahead of it, the batch it
joins), which the factor requests under load taught (load_calibration.py) scales. Only the second changes with load,
so only it can make a retry succeed.
"""

from __future__ import annotations

from pdserve.config import RouterConfig
from pdserve.protocol.perf_profile import QueuedPrefill, kv_transfer_s
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from services.router.best_speed import BestSpeeds
from services.router.calibration import TTFTCalibration
from services.router.fixed_cost import FixedCost
from services.router.kv_claims import KVClaims
from services.router.load_calibration import LoadCalibration
from services.router.load_tracker import LoadTracker


class Predictor:
    def __init__(self, config: RouterConfig, tracker: LoadTracker, calibration: TTFTCalibration | None = None):
        self.config = config
        self.tracker = tracker
        self.calibration = calibration or TTFTCalibration()
        self.load_calibration = LoadCalibration()
        self.fixed_cost = FixedCost()
        self.claims = KVClaims()
        self.best = BestSpeeds()

    def speed(self, w: WorkerState) -> float:
        """Profiled seconds -> predicted seconds on `w`: its live speed and the router's own correction."""
        return w.speed_factor * self.calibration.factor(w.worker_id)

    def compute_s(self, w: WorkerState, new_tokens: int, cached_tokens: int = 0) -> float:
        """This prompt's compute on `w` at its live speed, before the router's correction (what fixed_cost.py fits
        the TTFTs of requests alone against)."""
        return w.profile.prefill_s(new_tokens, cached_tokens) * w.speed_factor if w.profile else 0.0

    def prefill_s(self, w: WorkerState, new_tokens: int, cached_tokens: int = 0) -> float:
        """This prompt's own compute on `w`, live speed and the router's correction included."""
        return self.compute_s(w, new_tokens, cached_tokens) * self.calibration.factor(w.worker_id)

    def fixed_s(self, w: WorkerState) -> float:
        """What a first token from `w` takes besides the compute and the transfer, whatever the prompt."""
        return self.fixed_cost.fixed_s(w.worker_id)

    def queue_s(self, w: WorkerState, new_tokens: int = 0, cached_tokens: int = 0) -> float:
        """Work ahead of a new prompt of `new_tokens` to compute (0: any prompt, all the queue): what we sent and is
        not done, or what the worker last reported (other routers' prompts too), each prompt priced as we price our
        own; a worker too old to count its prompts has its tokens priced linearly. Where a prompt that fits one step
        goes ahead of longer ones (engine/short_first.py), such a prompt waits only for the short prompts queued
        and the chunk in flight, and a longer one also for those that will go ahead of its chunks (`stretch_s`)."""
        short = 0 < new_tokens <= w.short_prompt_tokens
        if short:
            local = self.tracker.pending_ahead_of_short_s(w.worker_id, w.short_prompt_tokens, w.load_sampled_at)
        else:
            local = self.tracker.pending_prefill_s[w.worker_id]
        if not w.profile:
            return local
        queue = self.reported_queue(w, new_tokens if short else 0)
        if w.queued_prefill_prompts:
            reported = w.profile.queued_prefill_s(queue)
        else:
            reported = w.profile.prefill_per_token_s * queue.tokens
        in_flight_s = w.prefill_chunk_s if short else 0.0  # measured on the worker, not priced
        return max(local, reported * self.speed(w) + in_flight_s) + self.stretch_s(w, new_tokens, cached_tokens)

    def stretch_s(self, w: WorkerState, new_tokens: int, cached_tokens: int = 0) -> float:
        """What the short prompts that go ahead of a prompt's chunks on `w` add to its prefill: its own compute times
        the stretch `w` measured on its recent long prompts, less one (engine/prefill_stretch.py). Load that passes,
        so part of the queue (a retry can meet an SLO it misses now), never of the prompt's own cost or the offer.
        None for a prompt that fits one step, or where prompts run in order."""
        if not 0 < w.short_prompt_tokens < new_tokens:
            return 0.0
        return (max(w.prefill_stretch, 1.0) - 1.0) * self.prefill_s(w, new_tokens, cached_tokens)

    def reported_queue(self, w: WorkerState, new_tokens: int = 0) -> QueuedPrefill:
        """The worker's last reported queue (of it, what a prompt of `new_tokens` waits for), less what of ours it
        has finished since it sampled that queue (not since it sent the report: a prefill ending in between would
        count twice, and shed for a heartbeat)."""
        sampled_at = w.load_sampled_at
        if 0 < new_tokens <= w.short_prompt_tokens:
            done = self.tracker.prefilled_since(w.worker_id, sampled_at, most_tokens=w.short_prompt_tokens)
            return w.queued_prefill_ahead_of(new_tokens).minus(done)
        return w.queued_prefill.minus(self.tracker.prefilled_since(w.worker_id, sampled_at))

    def reported_tokens(self, w: WorkerState) -> int:
        return self.reported_queue(w).tokens

    def queued_tokens(self, w: WorkerState) -> int:
        return max(self.reported_tokens(w), self.tracker.pending_prefill_tokens[w.worker_id])

    def own_ttft_s(self, w: WorkerState, prompt_tokens: int, cached_tokens: int) -> float:
        """The request's TTFT on `w` were it idle: what no amount of waiting makes shorter."""
        new_tokens = max(prompt_tokens - cached_tokens, 1)
        return (
            self.fixed_s(w)
            + self.prefill_s(w, new_tokens, prompt_tokens - new_tokens)
            + self.transfer_s(w, prompt_tokens)
        )

    def ttft_s(self, w: WorkerState, prompt_tokens: int, cached_tokens: int) -> float:
        own_s = self.own_ttft_s(w, prompt_tokens, cached_tokens)
        new_tokens = max(prompt_tokens - cached_tokens, 1)
        queue_s = self.queue_s(w, new_tokens, prompt_tokens - new_tokens)
        return own_s + self.load_calibration.queueing_s(w.worker_id, own_s, queue_s)

    def transfer_s(self, w: WorkerState, prompt_tokens: int) -> float:
        if w.role == Role.COLOCATED:  # the prompt's KV stays where it was computed
            return 0.0
        return kv_transfer_s(prompt_tokens, w.kv_bytes_per_token, self.config.transfer_gbps)

    def idle_tpot_s(self, w: WorkerState, own_context: int = 0) -> float:
        """One decode step of this request alone on `w`. `own_context`: the tokens its steps attend over
        (own_context_tokens)."""
        return w.profile.decode_step_s(1, own_context) * w.speed_factor if w.profile else 0.0

    # What `w` offers at best: its profile at the best speed the live corrections have shown (best_speed.py). They
    # also rise with contention, which passes; what admission calls impossible must be so at this speed.

    def offer_ttft_s(self, w: WorkerState, prompt_tokens: int, cached_tokens: int) -> float:
        """`own_ttft_s` at `w`'s best speed and least fixed cost (each the best of the window on its own: their sum
        is never above any one moment's)."""
        fixed = self.best.best(w.worker_id, "fixed", self.fixed_s(w), uncorrected=0.0)
        if not w.profile:
            return fixed + self.transfer_s(w, prompt_tokens)
        best = self.best.best(w.worker_id, "ttft", self.speed(w))
        new_tokens = max(prompt_tokens - cached_tokens, 1)
        compute = w.profile.prefill_s(new_tokens, prompt_tokens - new_tokens) * best
        return fixed + compute + self.transfer_s(w, prompt_tokens)

    def offer_tpot_s(self, w: WorkerState, own_context: int = 0) -> float:
        """`idle_tpot_s` at `w`'s best speed."""
        if not w.profile:
            return 0.0
        return w.profile.decode_step_s(1, own_context) * self.best.best(w.worker_id, "tpot", w.speed_factor)

    def tpot_s(self, w: WorkerState, own_context: int = 0) -> float:
        """The step time once this request joins the batch: its sequences' context and the request's own."""
        if not w.profile:
            return 0.0
        return w.profile.decode_step_s(self._running(w) + 1, batch_context_tokens(w) + own_context) * w.speed_factor

    def decode_wait_s(self, w: WorkerState) -> float:
        """What a busy decode worker adds to a first token: its engine takes the hand-off's two commands (reserve
        the blocks, commit the first token) only between steps, each waiting half a step on average. None on an
        idle worker. (A colocated worker's prefill waits half a step, then shares its step with the batch: at
        least as much.)"""
        running = self._running(w)
        if not (w.profile and running):
            return 0.0
        return w.profile.decode_step_s(running, batch_context_tokens(w)) * w.speed_factor

    def _running(self, w: WorkerState) -> int:
        return max(w.running, self.tracker.decoding[w.worker_id])

    def has_batch_room(self, w: WorkerState, spare: int = 0) -> bool:
        """A decode worker refuses a hand-off once its batch holds `max_num_seqs` sequences (decoding, preempted,
        or with KV arriving): those it reported, less ours it may have counted that ended since it sampled them,
        plus ours placed since; or all of ours not seen to end, the more. A colocated worker queues prompts past
        its cap instead; a worker that does not say has none. `spare`: places to leave free besides."""
        if w.role != Role.DECODE or not w.max_num_seqs:
            return True
        held = max(w.sequences, w.running + w.waiting)  # a worker of the build before `sequences` reports 0
        sampled_at, t = w.load_sampled_at, self.tracker
        reported = max(0, held - t.streams_ended_since(w.worker_id, sampled_at, w.instance, w.sequences_freed))
        reported += t.streams_placed_since(w.worker_id, sampled_at)
        return max(reported, t.decoding[w.worker_id]) + spare < w.max_num_seqs

    def free_blocks(self, w: WorkerState) -> int:
        """The report's free blocks, less ours it cannot show: those about to be reserved, and those placed since
        it sampled them (their first token may be back, and their blocks reserved, before the next report); plus
        what it still counts of ours that have ended since."""
        sampled_at = w.load_sampled_at
        since = self.tracker.placed_since(w.worker_id, sampled_at)
        held = w.kv_blocks_total - w.kv_blocks_free
        owed = w.role == Role.DECODE
        freed = self.tracker.blocks_freed_since(w.worker_id, sampled_at, held, owed, w.instance, w.sequences_freed)
        return w.kv_blocks_free + freed - max(self.tracker.pending_blocks[w.worker_id], since)

    def free_blocks_for(self, w: WorkerState, blocks: int) -> int:
        """The free blocks a new request needing `blocks` may take: those beyond an earlier, larger request's claim
        (kv_claims.py)."""
        return self.free_blocks(w) - self.claims.held_from(w.worker_id, blocks)

    def takes(self, decode: WorkerState, prompt_tokens: int) -> bool:
        """Whether a decode worker would reserve the prompt now, as far as this router can tell (a colocated
        worker queues what it cannot run yet)."""
        if decode.role != Role.DECODE:
            return True
        blocks = -(-prompt_tokens // decode.block_size)
        return self.has_batch_room(decode) and self.free_blocks(decode) >= blocks


def own_context_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """What a request's decode steps attend over on average: its prompt and half its output (its context halfway
    through max_tokens, as its KV blocks are reserved for all of them)."""
    return prompt_tokens + max(max_tokens, 1) // 2


def batch_context_tokens(w: WorkerState) -> int:
    """The tokens `w`'s batch attends over each step, as its last report holds them: its used KV blocks, whole (a
    decode worker keeps no prefix cache, so no block is shared between sequences; a colocated worker's shared
    prefix blocks count once, where each sequence reads them). A worker whose profile has no context term adds
    nothing for it (its step is priced by batch size alone)."""
    return max(0, w.kv_blocks_used) * w.block_size
