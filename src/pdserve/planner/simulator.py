"""A discrete-event simulation of one cluster shape serving a list of requests, step by step.

Each worker runs engine steps back to back while it has work, as the engine does. A step's time comes from
the profile: a prefill chunk costs its tokens (linear and attention terms) and its reads of the prompt's
earlier chunks from the cache, a decode step its batch and the context it reads, and every step the
engine's own overhead, plus what the worker's RPC loop does meanwhile under the same interpreter lock (per
prompt handed off, per token streamed); a colocated worker's step holds both, so a prompt's prefill slows
every decode in its step (the interference disaggregation removes). Each role's batching is the one its workers
get (worker_spec.py `role_scheduler`): a prefill worker runs one prompt a step, a long one in chunks of
`long_prefill_chunk`, and (the profile's `short_prompts_first`, as pdserve's prefill workers do) a prompt that fits
one step ahead of a longer prompt's next chunk, by the engine's own rule (prefill_steps.py); a colocated worker
packs chunks of at most `long_prefill_chunk` beside its decodes within its step budget, first come, first served.
Routing is least-loaded, as the router's is when no prefix is shared: the least predicted wait of the prompts the
router placed there (placed_prompts.py: a short prompt's counts only what it waits for on a short-first worker),
counted from their placement (not when they reach the worker) until their first token is out.

A disaggregated request follows the hand-off as the workers run it (services/decode/handoff.py,
services/prefill/run_and_send.py). Everything a worker's engine does besides stepping is a command its
engine thread applies between steps, so it waits for the step in flight: the decode worker reserves the
prompt's blocks, then the prefill worker queues the prompt; once the prompt's last chunk ran, its output names
the blocks and the prefill worker sends the KV at once; then the decode worker commits the KV and the first
token reaches the caller, while the prefill worker frees the sent blocks between its own steps. The decode
worker admits a sequence to its batch only while its whole KV (prompt + output) fits, and takes no hand-off
while `max_num_seqs` sequences are placed on it (the request fails, or admission sheds it). Unlike the engine
(which reserves the prompt at the hand-off and preempts), a sequence waiting for room holds no KV and none is
preempted: near the KV capacity the wait shows as TPOT where the engine would shed or recompute. A worker that
prefills starts a new prompt only while the sequences in its engine (in prefill or decoding) are fewer, as the
engine's scheduler does. Each request's serving latency (serving_latency.py) delays it, holding no worker.

Where the workers share a host's cores (the profile's `shared_cores`), the cores are shared as the kernel
shares them, among everything that wants one at the moment (processor sharing): while more wants them than
there are cores (the engine threads stepping, the serving stack's own demand at `serving_cpu_s` per request
at the offered rate, the host's background demand), every step in flight runs that much slower, and speeds up
again when a step ends. A profile timed in one process on an idle machine sees none of that.

With an `AdmissionModel` (admission_model.py), each arrival first passes the router's admission: a shed request
never runs and counts against attainment. Its predicted wait is that same wait on its prefill worker, plus one
decode step of the streams placed on its decode worker (which its hand-off waits for), at the shared cores'
current slowdown.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.cluster.worker_spec import role_scheduler
from pdserve.config import SchedulerConfig
from pdserve.planner.admission_model import AdmissionModel
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.placed_prompts import PlacedPrompts
from pdserve.planner.prefill_steps import PrefillSteps
from pdserve.planner.serving_latency import serving_latencies
from pdserve.planner.shape import Shape
from pdserve.planner.sim_result import SimResult, sim_result
from pdserve.planner.step_costs import chunk_s, decoded_s
from pdserve.planner.workload import SimRequest
from pdserve.protocol.perf_profile import kv_transfer_s
from pdserve.protocol.roles import Role


@dataclass(eq=False)
class _Seq:
    req: SimRequest
    prefilled: int = 0
    priority: int = 0  # no priority classes are simulated: every request at the default
    first_s: float | None = None
    done_s: float | None = None
    decoder: _Worker | None = None  # disaggregated: placed with its prefill worker, on arrival
    prefiller: _Worker | None = None  # placed on arrival


Command = Callable[[], None]


@dataclass(eq=False)
class _Worker:
    prefills: bool
    decodes: bool
    placed: PlacedPrompts  # of prompts placed here whose first token is not out, as the router counts them
    prefill_steps: PrefillSteps[_Seq] | None = None  # a prefill worker's; None: a colocated worker's packing
    queue: deque[_Seq] = field(default_factory=deque)  # waiting for or in prefill
    waiting: deque[_Seq] = field(default_factory=deque)  # KV arrived (or prefilled), waiting for a batch slot
    finishing: list[tuple[int, int, _Seq]] = field(default_factory=list)  # heap: (last decode step, order, seq)
    commands: list[Command] = field(default_factory=list)  # for the engine thread, once the step in flight ends
    running: int = 0  # sequences in the decode batch
    incoming: int = 0  # sequences placed here whose KV has not been committed yet
    steps: int = 0  # decode steps run so far: a sequence joining at step j with m tokens to go ends at j + m
    context: int = 0  # tokens of KV the running batch reads per step
    kv_used: int = 0
    busy: bool = False
    busy_s: float = 0.0
    step: _Step | None = None  # the step in flight
    started_s: float = 0.0
    work_s: float = 0.0  # of the step in flight, what it still needs at full speed
    version: int = 0  # of its end event: a change of speed reschedules it


@dataclass(frozen=True)
class _Step:
    chunks: list[tuple[_Seq, int]]
    decoded: int  # sequences that each get one token
    context: int  # their KV tokens


class Simulator:
    def __init__(self, profile: HardwareProfile, shape: Shape, admission: AdmissionModel | None = None) -> None:
        self.p = profile
        self.shape = shape
        self.admission = admission
        self.shed = 0
        limits = SchedulerConfig(profile.max_num_seqs, profile.max_num_batched_tokens, profile.long_prefill_chunk)
        self.colocated_budget = role_scheduler(limits, Role.COLOCATED).max_num_batched_tokens
        prefill = replace(role_scheduler(limits, Role.PREFILL), short_prompts_first=profile.short_prompts_first)
        short_tokens = prefill.long_prefill_chunk if prefill.short_prompts_first else 0
        if shape.colocated:
            self.prefillers = [_Worker(True, True, PlacedPrompts(profile.perf, 0)) for _ in range(shape.colocated)]
            self.decoders = self.prefillers
        else:
            self.prefillers = [
                _Worker(True, False, PlacedPrompts(profile.perf, short_tokens), PrefillSteps[_Seq](prefill))
                for _ in range(shape.prefill)
            ]
            self.decoders = [_Worker(False, True, PlacedPrompts(profile.perf, 0)) for _ in range(shape.decode)]
        self.workers = self.prefillers if shape.colocated else self.prefillers + self.decoders
        self._events: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self.now = 0.0
        self._background_cores = profile.background_cores  # plus the serving stack's at the offered rate
        self._speed = 1.0  # of every step in flight: full speed over the stretch of the shared cores
        self._progressed_s = 0.0  # when the steps in flight last had their work brought up to date
        self._work_s = 0.0  # every step's work at full speed, summed

    def run(self, requests: list[SimRequest]) -> SimResult:
        seqs = [_Seq(r) for r in sorted(requests, key=lambda r: r.arrival_s)]
        if len(seqs) > 1 and (span := seqs[-1].req.arrival_s - seqs[0].req.arrival_s) > 0:
            self._background_cores += (len(seqs) - 1) / span * self.p.serving_cpu_s
        for s, latency in zip(seqs, serving_latencies(self.p, len(seqs)), strict=True):
            self._at(s.req.arrival_s + latency, "arrive", s)
        while self._events:
            self.now, _, kind, what = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(what)
        return self._result(seqs)

    def _at(self, t: float, kind: str, what: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, what))

    def _command(self, w: _Worker, command: Command) -> None:
        """As the engine thread applies a command: at once when idle, else when its step in flight ends."""
        if w.busy:
            w.commands.append(command)
        else:
            command()
            self._kick(w)

    def _on_arrive(self, s: _Seq) -> None:
        """The request reaches the workers, its serving latency paid (the simulator starts it that late)."""
        need = s.req.input_len + s.req.output_len
        if need > self.p.kv_capacity_tokens:
            return  # never fits: the request fails, as the worker refuses it
        # As the router: a prompt counts from its placement, though in a split it reaches the worker only after the
        # decode worker's step in flight. Ties go to the first worker, as the router's go by worker id.
        p = min(self.prefillers, key=lambda w: w.placed.wait_s(s.req.input_len))
        d = p if self.shape.colocated else min(self.decoders, key=_streams)
        if not self.shape.colocated and _streams(d) >= self.p.max_num_seqs:
            self.shed += bool(self.admission)  # every batch is full: the router sheds it, or the worker refuses it
            return
        if self.admission and self._sheds(p, d, s.req.input_len):
            self.shed += 1
            return
        s.prefiller = p
        p.placed.place(s.req.input_len)
        if self.shape.colocated:
            self._enqueue(p, s)
            return
        s.decoder = d
        d.incoming += 1
        self._command(d, lambda: self._enqueue(p, s))  # the decode worker reserves, then calls the prefill one

    def _sheds(self, p: _Worker, d: _Worker, prompt_tokens: int) -> bool:
        """The router's admission on the predictions it would make of `p` and `d` now: the wait holds what the
        prompt waits for on the prefill worker and one step of the decode worker's streams
        (services/router/predictor.py)."""
        assert self.admission is not None
        slowdown = self._stretch()  # what the router's measured speed factor sees on shared cores
        own = self.p.perf.prefill_s(prompt_tokens) * slowdown
        if not self.shape.colocated:  # as the router predicts it (predictor.py): its configured speed, no latency
            own += kv_transfer_s(prompt_tokens, self.p.kv_bytes_per_token, self.admission.transfer_gbps)
        streams = _streams(d)
        wait = p.placed.wait_s(prompt_tokens) + (self.p.perf.decode_step_s(streams) if streams else 0.0)
        return self.admission.sheds(p.placed.tokens, wait * slowdown, prompt_tokens, own)

    def _enqueue(self, w: _Worker, s: _Seq) -> None:
        w.queue.append(s)
        self._kick(w)

    def _on_step(self, item: tuple[_Worker, int]) -> None:
        w, version = item
        if version != w.version:
            return  # the step's speed changed since this end was scheduled
        self._progress()
        step = w.step
        assert step is not None
        w.busy, w.step = False, None
        w.busy_s += self.now - w.started_s
        for s, n in step.chunks:
            s.prefilled += n
            if s.prefilled == s.req.input_len:
                self._prefilled(w, s)
        if step.decoded:
            w.steps += 1
            w.context += step.decoded
            while w.finishing and w.finishing[0][0] <= w.steps:
                self._finish(w, heapq.heappop(w.finishing)[2])
        commands, w.commands = w.commands, []
        for command in commands:
            command()
        self._kick(w)
        self._set_speed()

    def _prefilled(self, w: _Worker, s: _Seq) -> None:
        """The prompt's last chunk ran: its first token is out, naming the blocks to send (no engine call)."""
        w.queue.remove(s)
        if w.decodes:  # colocated: the first token goes out, the KV is here already
            self._first_token(s)
            if s.req.output_len <= 1:
                s.done_s = self.now
                w.kv_used -= s.req.input_len + s.req.output_len
            else:
                w.waiting.append(s)
            return
        if s.req.output_len <= 1:  # finished here: no KV follows, the decode worker commits the token alone
            w.kv_used -= s.req.input_len
            self._command(s.decoder, lambda: self._commit(s))  # type: ignore[arg-type]
            return
        self._at(self.now + self.p.transfer_s(s.req.input_len), "transferred", (w, s))

    def _on_transferred(self, item: tuple[_Worker, _Seq]) -> None:
        """The KV is on the decode worker: it commits; the prefill worker frees the sent blocks between its steps,
        a release nobody waits for."""
        p, s = item
        self._command(p, lambda: self._release(p, s))
        self._command(s.decoder, lambda: self._commit(s))  # type: ignore[arg-type]

    def _release(self, p: _Worker, s: _Seq) -> None:
        p.kv_used -= s.req.input_len

    def _commit(self, s: _Seq) -> None:
        """The decode worker takes the KV: the first token goes to the caller, the sequence waits to decode."""
        d = s.decoder
        assert d is not None
        self._first_token(s)
        d.incoming -= 1
        if s.req.output_len <= 1:
            s.done_s = self.now
        else:
            d.waiting.append(s)

    def _first_token(self, s: _Seq) -> None:
        """The first token reaches the caller: only now does the router stop counting the prompt on its prefill
        worker (LoadTracker.prefilled), though a split's prefill ended a transfer and a commit before."""
        s.first_s, p = self.now, s.prefiller
        assert p is not None
        p.placed.first_token(s.req.input_len)

    def _finish(self, w: _Worker, s: _Seq) -> None:
        """The sequence leaves the batch with all its tokens."""
        s.done_s = self.now
        w.running -= 1
        w.context -= s.req.input_len + s.req.output_len
        w.kv_used -= s.req.input_len + s.req.output_len

    def _admit(self, w: _Worker) -> None:
        """Sequences whose KV is here join the batch while there is room; a decode worker reserves it now.
        Only between steps: a step in flight runs the batch it started with. No `max_num_seqs` here: a decode-only
        engine took no hand-off past it (`_on_arrive`), and a prompt prefilled here was counted against the cap
        when it began (`_plan`)."""
        while w.waiting:
            s = w.waiting[0]
            need = s.req.input_len + s.req.output_len
            if not w.prefills and w.kv_used + need > self.p.kv_capacity_tokens:
                return
            if not w.prefills:
                w.kv_used += need
            w.waiting.popleft()
            w.running += 1
            w.context += s.req.input_len + 1
            heapq.heappush(w.finishing, (w.steps + s.req.output_len - 1, next(self._order), s))

    def _kick(self, w: _Worker) -> None:
        if w.busy:
            return
        self._admit(w)
        step = self._plan(w)
        if not step.chunks and not step.decoded:
            return
        self._progress()
        w.busy, w.step, w.started_s, w.work_s = True, step, self.now, self._step_s(step)
        self._work_s += w.work_s
        self._set_speed(started=w)

    def _progress(self) -> None:
        """Bring every step in flight's remaining work up to now, at the speed they have run since."""
        for w in self.workers:
            if w.busy:
                w.work_s -= (self.now - self._progressed_s) * self._speed
        self._progressed_s = self.now

    def _set_speed(self, started: _Worker | None = None) -> None:
        """The speed of the steps in flight, for what now wants the shared cores: a step just started gets
        its end at it, and if the speed changed, so does every other step in flight."""
        speed = 1.0 / self._stretch()
        changed, self._speed = speed != self._speed, speed
        for w in self.workers:
            if w.busy and (changed or w is started):
                w.version += 1
                self._at(self.now + max(0.0, w.work_s) / speed, "step", (w, w.version))

    def _stretch(self) -> float:
        """How much slower the steps in flight run than each did alone: what wants the shared cores (every
        stepping engine's threads and the serving stack's demand) over the cores there are."""
        if not self.p.shared_cores:
            return 1.0
        threads = int(self.p.meta.get("threads", 1))
        stepping = sum(w.busy for w in self.workers)
        return max(1.0, (stepping * threads + self._background_cores) / self.p.shared_cores)

    def _plan(self, w: _Worker) -> _Step:
        """As the engine's scheduler: a new prompt starts only while the sequences in the engine, those part-way
        through their prefill and those decoding, are under `max_num_seqs`, and its KV fits."""
        in_engine = w.running + len(w.waiting) + sum(s.prefilled > 0 for s in w.queue)

        def start(s: _Seq) -> bool:
            nonlocal in_engine
            need = s.req.input_len + (s.req.output_len if w.decodes else 0)
            if in_engine >= self.p.max_num_seqs or w.kv_used + need > self.p.kv_capacity_tokens:
                return False
            w.kv_used += need
            in_engine += 1
            return True

        if w.prefill_steps:
            chunk = w.prefill_steps.next(w.queue, start)
            return _Step([chunk] if chunk else [], 0, 0)
        decoded = w.running if w.decodes else 0
        budget = self.colocated_budget - decoded
        chunks: list[tuple[_Seq, int]] = []
        for s in w.queue if w.prefills else ():
            if budget <= 0 or (
                s.prefilled == 0 and not start(s)
            ):  # a new prompt reserves its KV before its first chunk
                break
            n = min(s.req.input_len - s.prefilled, self.p.long_prefill_chunk, budget)
            chunks.append((s, n))
            budget -= n
        return _Step(chunks, decoded, w.context if decoded else 0)

    def _step_s(self, step: _Step) -> float:
        perf = self.p.perf
        fixed = 0.0
        seconds = self.p.step_overhead_s
        if step.chunks:
            fixed = perf.prefill_fixed_s
            for s, n in step.chunks:
                seconds += chunk_s(self.p, n, s.prefilled, last=s.prefilled + n == s.req.input_len)
        if step.decoded:
            fixed = max(fixed, perf.decode_fixed_s)
            seconds += decoded_s(self.p, step.decoded, step.context)
        return fixed + seconds

    def _result(self, seqs: list[_Seq]) -> SimResult:
        return sim_result(
            self.p,
            [(s.req, s.first_s, s.done_s) for s in seqs],
            self.shed,
            (
                [w.busy_s for w in self.prefillers],
                [w.busy_s for w in self.decoders],
                sum(w.busy_s for w in self.workers),
            ),
            self._work_s,
        )


def _streams(d: _Worker) -> int:
    """The requests a router has placed on `d` and not seen finish: its batch, those waiting for a slot, and those
    whose KV is on its way."""
    return d.running + len(d.waiting) + d.incoming
