"""An admitted request's claim on the router's load bookkeeping, released exactly once however it ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType

from pdserve.protocol.request_checks import kv_tokens
from services.router.admission import Admission
from services.router.load_tracker import LoadTracker
from services.router.migration import Continuation
from services.router.placement import Placement
from services.router.request import RoutedRequest
from services.router.worker_frees import FreedAt


@dataclass
class Ticket:
    """`key`: the router's own unique id for the request, the key on every hop; `client_id`: the caller's
    request_id, only echoed (two clients may well send the same one)."""

    key: str
    client_id: str
    request: RoutedRequest
    placement: Placement
    started_at: float  # time.perf_counter() when the router received the request
    tracker: LoadTracker
    admission: Admission
    continuation: Continuation | None = None  # set when the stream migrated here after tokens were sent
    # When the relay called its decode worker: its workers' TTFT counts from here, not from the router's own
    # tokenizing, quota check and wait for a placement, which the prediction it is compared with leaves out.
    dispatched_at: float = field(default=0.0, init=False)
    # This attempt's own tokens and when its first came: its decode worker's TPOT is judged on them alone.
    first_token_at: float = field(default=0.0, init=False)
    tokens: int = field(default=0, init=False)
    # This attempt's TTFT when it ran alone as far as this router saw: calibration learns from it once the
    # stream ends, when the decode worker's trailing metadata says how long its prefill worker made it wait.
    alone_ttft_s: float | None = field(default=None, init=False)
    # Where this attempt's end fell in its decode worker's frees, once its call ended saying (worker_frees.py).
    freed_at: FreedAt | None = field(default=None, init=False)
    _prefilled: bool = field(default=False, init=False)
    _released: bool = field(default=False, init=False)
    _left: bool = field(default=False, init=False)
    _found_idle: bool = field(default=False, init=False)
    _placement_number: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        p = self.placement
        self._found_idle = not self.tracker.pending_prefill_tokens[p.prefill_worker.worker_id]
        self._placement_number = self.tracker.start(
            p.prefill_worker.worker_id,
            p.decode.worker_id,
            self.new_tokens,
            self.holds_s,
            p.blocks_needed,
            prompt_tokens=len(self.request.prompt_token_ids),
            prompt_blocks=-(-len(self.request.prompt_token_ids) // p.decode.block_size),
        )
        self.admission.entered(self.request.tenant, self.request.priority)

    @property
    def new_tokens(self) -> int:
        """Prompt tokens the prefill worker computes (the rest its prefix cache holds)."""
        return len(self.request.prompt_token_ids) - self.placement.cached_tokens

    @property
    def holds_s(self) -> float:
        """What the request adds to its prefill worker's queue until its first token: its own TTFT, not only its
        compute, since behind a queue the hand-offs (KV send, decode commit) measure as serial too; but not its fixed
        cost (fixed_cost.py), most of which (the calls before its prefill, the commit after) the next prompt's
        compute overlaps: counted, each smollm2-135m prompt queued added the 60-115 ms it was learned at under load."""
        return self.placement.own_ttft_s - self.placement.fixed_s

    def ran_alone(self) -> bool:
        """Nothing of ours was queued on its prefill worker when it was placed, nor placed there since: until
        its first token, its TTFT is its own cost, which is what calibration learns from."""
        queued = self.tracker.pending_prefill_tokens[self.placement.prefill_worker.worker_id]
        return self._found_idle and not self._prefilled and queued == self.new_tokens

    def prefilled(self) -> None:
        """The first token is back (or never will be): its prefill no longer queues."""
        if self._prefilled:
            return
        self._prefilled = True
        self.tracker.prefilled(self._placement_number)

    def streamed(self, tokens: int) -> None:
        """`tokens` more of this attempt's tokens came back (its first among them: `prefilled` first): its KV on the
        decode worker holds its prompt and every token but the last, which the router counts as freed once it ends."""
        self.tokens += tokens
        kv = kv_tokens(len(self.request.prompt_token_ids), self.tokens)
        self.tracker.streamed(self._placement_number, -(-kv // self.placement.decode.block_size))

    def leave_workers(self) -> None:
        """This attempt ended on its workers: their load here goes, while the request stays in flight (a move's
        next attempt is placed meanwhile, and must not find its own failed attempt holding a place)."""
        if self._left:
            return
        self._left = True
        self.prefilled()
        self.tracker.finished(self._placement_number, self.freed_at)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.leave_workers()
        self.admission.left(self.request.tenant, self.request.priority)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
