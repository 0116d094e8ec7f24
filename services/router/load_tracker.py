"""What this router has sent to each worker that the worker's last heartbeat cannot show yet, and what it has
seen finish since: a heartbeat taken before a prompt's first token came back still counts that prompt. Every time
here is this process's monotonic clock, as a report's sampling is (`WorkerState.load_sampled_at`)."""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_right
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.perf_profile import QueuedPrefill, attention_squares
from services.router.worker_frees import FreedAt

FORGET_AFTER_S = 60.0  # far older than any heartbeat a router still places by


@dataclass(frozen=True)
class Sent:
    """One placed request, as the tracker counts it until its first token and until it ends."""

    prefill_id: str
    decode_id: str
    new_tokens: int  # what the prefill worker computes: the prompt less the prefix hit predicted
    prompt_tokens: int  # the most a prefill worker's queue can show of it: its cache may hold less than we predict
    seconds: float  # predicted time it holds the prefill worker
    blocks: int  # KV blocks the decode worker reserves for it
    at: float  # when placed
    prompt_blocks: int = 0  # of those, the prompt's: what its hand-off reserves, and a report shows from then on


@dataclass
class KVGrowth:
    """When a stream's KV on its decode worker reached each size, as its tokens coming back here show it."""

    reserved_by: float = math.inf  # when its first token came back (inf: never), by which its prompt's were reserved
    grew_at: list[float] = field(default_factory=list)  # when its tokens back filled each block past its prompt's

    def held_at(self, since: float, sent: Sent, owed: bool) -> int:
        """The least a report sampled at `since` showed it holding: nothing before its first token came back, else
        the blocks its prompt and its tokens back by then fill, and (`owed`: a decode worker's) the one its worker
        keeps free for its next while its max_tokens may outgrow them (engine.py's `blocks_owed`), its whole
        reservation at most. Its worker is at least as far as the tokens that reached us; a stream preempted then
        held one block less than this."""
        if self.reserved_by > since:
            return 0
        filled = sent.prompt_blocks + bisect_right(self.grew_at, since)
        return min(filled + owed, max(sent.blocks, filled))


@dataclass
class LiveHeld:
    """The least our unfinished streams on one decode worker held at one report's sampling (`since`), each
    stream's share kept so that its end takes it off: once `since` has passed, what a stream held then never
    changes (its later tokens come back after it). Summed afresh for each placement, it cost ~0.8 ms a request with
    8 decode workers of 128 streams each; now once per report."""

    since: float
    owed: bool
    each: dict[int, int]  # placement number -> its share
    total: int


@dataclass(frozen=True)
class Ended:
    """One placed request that ended, as reports sampled before its end may still count it."""

    at: float  # when it ended here
    sent: Sent
    growth: KVGrowth
    freed: FreedAt | None  # when its worker freed it, in the worker's own order, where the worker said


class LoadTracker:
    def __init__(self) -> None:
        self.pending_prefill_tokens: Counter[str] = Counter()  # placed, first token not back yet
        self.pending_prefill_s: defaultdict[str, float] = defaultdict(float)  # the same, in predicted seconds
        self.pending_blocks: Counter[str] = Counter()  # KV blocks a decode worker is about to reserve
        self.decoding: Counter[str] = Counter()  # streams in flight per decode worker
        self.moving = 0  # streams waiting for a decode worker with room to move to: new requests leave them a place
        self.moving_elsewhere = 0  # the same through the other routers of a shared registry (shared_moving.py)
        # prefill worker -> (when its prefill ended, (when placed, prompt tokens, new tokens)), oldest first
        self._prefilled: defaultdict[str, deque[tuple[float, tuple[float, int, int]]]] = defaultdict(deque)
        self._sent: dict[int, Sent] = {}  # placement number -> request, until it ends
        self._prefilling: set[int] = set()  # placement numbers whose first token is not back
        self._placed: defaultdict[str, dict[int, Sent]] = defaultdict(dict)  # `_sent`, per decode worker
        self._ended: defaultdict[str, deque[Ended]] = defaultdict(deque)
        self._growth: dict[int, KVGrowth] = {}  # placement number -> its KV's growth, from its first token on
        self._live_held: dict[str, LiveHeld] = {}  # per decode worker, at its last report read
        self._placements = itertools.count()

    @property
    def held_for_moving(self) -> int:
        """The places new requests leave free in the decode batches: one per stream moving, through any router."""
        return self.moving + self.moving_elsewhere

    def start(
        self,
        prefill_id: str,
        decode_id: str,
        new_tokens: int,
        seconds: float,
        blocks: int,
        prompt_tokens: int,
        prompt_blocks: int = 0,
    ) -> int:
        """Returns the placement's number, for `prefilled` and `finished`."""
        sent = Sent(prefill_id, decode_id, new_tokens, prompt_tokens, seconds, blocks, time.monotonic(), prompt_blocks)
        self.pending_prefill_tokens[prefill_id] += new_tokens
        self.pending_prefill_s[prefill_id] += seconds
        self.pending_blocks[decode_id] += blocks
        self.decoding[decode_id] += 1
        placement = next(self._placements)
        self._sent[placement] = sent
        self._prefilling.add(placement)
        self._placed[decode_id][placement] = sent
        return placement

    def prefilled(self, placement: int) -> None:
        """The first token is back (or the request ended before it): its prefill no longer queues. Once only."""
        self._prefilling.remove(placement)
        self._growth[placement] = KVGrowth(time.monotonic())
        sent = self._sent[placement]
        self.pending_prefill_tokens[sent.prefill_id] -= sent.new_tokens
        left_s = max(0.0, self.pending_prefill_s[sent.prefill_id] - sent.seconds)
        if not any(self._sent[p].prefill_id == sent.prefill_id for p in self._prefilling):
            left_s = 0.0  # nothing of ours queued there: sums taken off in another order than added leave ~1e-16
        self.pending_prefill_s[sent.prefill_id] = left_s
        self.pending_blocks[sent.decode_id] -= sent.blocks
        _log(self._prefilled[sent.prefill_id], (sent.at, sent.prompt_tokens, sent.new_tokens))

    def streamed(self, placement: int, blocks: int) -> None:
        """The stream's tokens back so far (`prefilled` first) fill `blocks` KV blocks on its decode worker: its
        prompt and every token but the last, which is not run through the model yet."""
        if (growth := self._growth.get(placement)) is None:
            return  # it ended
        now, grew = time.monotonic(), growth.grew_at
        grew.extend([now] * (blocks - self._sent[placement].prompt_blocks - len(grew)))

    def prefilled_since(self, prefill_id: str, since: float, most_tokens: int | None = None) -> QueuedPrefill:
        """What a queue sampled at `since` (a heartbeat's) showed of our prompts whose prefill has ended since (those
        of at most `most_tokens` new tokens, if given): those placed by then (one placed after it was never in it,
        and taking it off took another's prompts), their new tokens and squares as we predicted the worker counted
        them, its reads of a cached prefix included (`QueuedPrefill.minus` keeps the rest a queue that can be). Where
        its cache held less than we predicted (an eviction our prefix index learns of late) it counted more, and the
        rest is priced high until its next report, unless all it held was ours; each whole prompt's tokens taken off
        instead emptied a rest shorter than that prompt, another router's prompts with it."""
        prompts = tokens = squares = 0
        for at, (placed_at, prompt, new) in reversed(self._prefilled.get(prefill_id, ())):  # newest first
            if at <= since:
                break
            if placed_at <= since and (most_tokens is None or new <= most_tokens):
                prompts, tokens = prompts + 1, tokens + new
                squares += attention_squares(new, prompt - new)
        return QueuedPrefill(prompts, tokens, squares)

    def pending_ahead_of_short_s(self, prefill_id: str, short_tokens: int, since: float) -> float:
        """Of ours placed on the prefill worker whose first token is not back, what a prompt of at most
        `short_tokens` new tokens waits for there (engine/short_first.py), in predicted seconds: the short ones, and
        a chunk (its share of the prompt's seconds) of a longer one placed after `since`, a report's sampling, which
        cannot show the chunk it may have in flight (a later report prices that chunk itself: the share of the
        whole, held for all of a long prompt's prefill, read 5.4 s where its chunks took 1.2-2.1 s)."""
        pending = [s for p in self._prefilling if (s := self._sent[p]).prefill_id == prefill_id]
        short = sum(s.seconds for s in pending if s.new_tokens <= short_tokens)
        longer = [
            s.seconds * short_tokens / s.new_tokens for s in pending if s.new_tokens > short_tokens and s.at > since
        ]
        return short + max(longer, default=0.0)

    def placed_since(self, decode_id: str, since: float) -> int:
        """KV blocks of our unfinished requests placed on the decode worker after `since` (a heartbeat's): reserved
        there after it sampled its free blocks, first token back or not. A finished request holds none, whether it
        reserved them or ended before (an idle worker samples no more)."""
        return sum(sent.blocks for sent in self._placed[decode_id].values() if sent.at > since)

    def streams_placed_since(self, decode_id: str, since: float) -> int:
        """Our unfinished requests placed on the decode worker after `since`: each holds a place in its
        batch that a report sampled then cannot show."""
        return sum(1 for sent in self._placed[decode_id].values() if sent.at > since)

    def streams_ended_since(self, decode_id: str, since: float, instance: str, sequences_freed: int) -> int:
        """Our requests placed on the decode worker by `since` that have ended after it: a report sampled then may
        still count their places in its batch, unless their worker had freed them (`FreedAt`: the report's process
        `instance` had freed `sequences_freed` sequences then)."""
        count = 0
        for ended in reversed(self._ended[decode_id]):  # in the order they ended: read back only past `since`
            if ended.at <= since:
                break
            freed = ended.freed  # FreedAt's test inline, here and below: as calls, a placement cost ~50% more
            if ended.sent.at <= since and (freed is None or freed.instance == instance and freed.nth > sequences_freed):
                count += 1
        return count

    def blocks_freed_since(
        self, decode_id: str, since: float, reported_held: int, owed: bool, instance: str, sequences_freed: int
    ) -> int:
        """KV blocks of our requests that a report sampled at `since` counted as held and that have ended after it:
        the least each held then (`KVGrowth.held_at`). Without them, a worker whose streams were just cancelled (say,
        the other choices of a request whose last was shed) looked full until its next heartbeat, and the next
        request was shed for room it had; counted as their prompts' blocks alone, one that needs the whole pool was
        shed for up to a heartbeat after a long answer ended (60 of 65 blocks held then, 1 counted back). At most
        what the report held (`reported_held`: not free, owed included) beyond the least our unfinished streams
        held then. One that ended on its worker before the report but reached us after it was free in the report
        already: not counted where its worker said so (`FreedAt`: the report's process `instance` had freed
        `sequences_freed` sequences then); else only that cap keeps it from being counted twice, which holds where
        every block the report held was ours. `owed`: a decode worker's report, which counts the block each growing
        stream keeps free for its next."""
        freed = 0
        for ended in reversed(self._ended[decode_id]):
            if ended.at <= since:
                break
            said = ended.freed
            if said is None or said.instance == instance and said.nth > sequences_freed:  # not free in the report
                freed += ended.growth.held_at(since, ended.sent, owed)
        if not freed:
            return 0
        return max(0, min(freed, reported_held - self._live_held_at(decode_id, since, owed)))

    def _live_held_at(self, decode_id: str, since: float, owed: bool) -> int:
        live = self._live_held.get(decode_id)
        if live is None or (live.since, live.owed) != (since, owed):
            growth = self._growth
            each = {p: growth[p].held_at(since, s, owed) for p, s in self._placed[decode_id].items() if p in growth}
            live = LiveHeld(since, owed, each, sum(each.values()))
            if since <= time.monotonic():  # else tokens that come back before `since` would still add to it
                self._live_held[decode_id] = live
        return live.total

    def _per_worker(self) -> tuple[dict[str, Any], ...]:
        return (
            self.pending_prefill_tokens,
            self.pending_prefill_s,
            self.pending_blocks,
            self.decoding,
            self._prefilled,
            self._placed,
            self._ended,
            self._live_held,
        )

    def worker_ids(self) -> set[str]:
        return set().union(*self._per_worker())

    def forget(self, worker_id: str) -> bool:
        """Drops a gone worker's counts; False while a request placed on it has not ended (`finished` counts it)."""
        if any(worker_id in (sent.prefill_id, sent.decode_id) for sent in self._sent.values()):
            return False
        for per_worker in self._per_worker():
            per_worker.pop(worker_id, None)
        return True

    def finished(self, placement: int, freed: FreedAt | None = None) -> None:
        """The request ended, its prefill too (`prefilled` first); `freed`: when its decode worker freed it, where
        the worker said."""
        sent = self._sent.pop(placement)
        self.decoding[sent.decode_id] -= 1
        del self._placed[sent.decode_id][placement]
        if (live := self._live_held.get(sent.decode_id)) is not None:
            live.total -= live.each.pop(placement, 0)
        growth = self._growth.pop(placement, KVGrowth())
        ended = self._ended[sent.decode_id]
        ended.append(Ended(time.monotonic(), sent, growth, freed))
        while ended and ended[0].at < ended[-1].at - FORGET_AFTER_S:
            ended.popleft()


def _log(entries: deque[tuple[float, Any]], amount: Any) -> None:
    """Appends (now, amount), forgetting what no heartbeat a router still places by can predate."""
    now = time.monotonic()
    entries.append((now, amount))
    while entries and entries[0][0] < now - FORGET_AFTER_S:
        entries.popleft()
