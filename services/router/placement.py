"""Choosing the workers for one request: SLO-aware and prefix-aware by default, round-robin to compare."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import UnavailableError
from pdserve.protocol.prefix_hash import prefix_hashes_off_loop
from pdserve.protocol.request_checks import kv_tokens
from pdserve.protocol.roles import Role
from pdserve.registry.base import PrefixIndex, Registry, WorkerState
from services.router.ejection import Ejections
from services.router.kv_pairing import Group, pairable, pairing_groups, running, versions
from services.router.offered_workers import OfferedWorkers
from services.router.predictor import Predictor, own_context_tokens
from services.router.same_tokenizer import of_tokenizer, other_tokenizers


@dataclass(frozen=True)
class Placement:
    decode: WorkerState  # whose stream the router relays (a colocated worker in colocated mode)
    prefill: WorkerState | None  # None: the decode worker prefills itself (colocated)
    cached_tokens: int  # prompt tokens the prefill worker is expected to hold already
    own_ttft_s: float  # this request's TTFT on the chosen prefill worker were it idle
    fixed_s: float  # of own_ttft_s, the prefill worker's fixed cost of a first token (fixed_cost.py)
    compute_s: float  # the prompt's compute there at its live speed, before the TTFT calibration factor
    queue_s: float  # what the load adds: `profiled_queue_s` as loaded requests showed it (load_calibration.py)
    profiled_queue_s: float  # the queue ahead of it there and the decode worker's step, as the profiles price them
    prefill_queue_s: float  # of profiled_queue_s, the prefill worker's queue (what that worker reports it waited)
    ttft_factor: float  # the prefill worker's TTFT calibration factor the prediction was made with
    predicted_tpot_s: float
    own_context_tokens: int  # what the request's decode steps attend over on average (predictor.own_context_tokens)
    blocks_needed: int
    block_hashes: list[bytes]  # the prompt's full blocks, which its prefill worker will key
    offer: Offer

    @property
    def prefill_worker(self) -> WorkerState:
        return self.prefill or self.decode

    @property
    def predicted_ttft_s(self) -> float:
        return self.own_ttft_s + self.queue_s


class NoWorkersError(UnavailableError):
    """No live worker of a role (after ejections and drains): often a moment's gap, see RequestLifecycle."""


class UnpairedError(NoWorkersError):
    """Live prefill and decode workers, but none of them may be paired (another model or block size, a rollout's
    gap): once its wait is out a new request is shed with a retry hint (placement_waits.py), not UNAVAILABLE."""


@dataclass(frozen=True)
class Offer:
    """The best the cluster could do for this request were it idle: what admission tells a request whose
    SLO asks for less, since no retry can get under it. Over every registered worker (ejected and draining ones
    too: their absence passes) and every one gone lately (offered_workers.py: a restart's absence passes too),
    each at its best speed (Predictor.offer_ttft_s)."""

    ttft_s: float  # the smallest own TTFT over the prefill workers
    tpot_s: float  # the smallest one-sequence decode step over the decode workers, at the request's own context
    # The same at the workers' speeds now, which may be slower than their best: less than these is shed however
    # idle the cluster, so an SLO refused as impossible is told to ask for the larger of the two.
    ttft_now_s: float
    tpot_now_s: float
    kv_blocks: int  # the most KV blocks any decode worker has in total
    held_at_once: int  # how many such requests the decode workers hold together (the HTTP API's n choices)


@dataclass(frozen=True)
class Ask:
    """What a policy chooses a request's workers for."""

    hits: dict[str, int]  # cache key -> prompt blocks that worker's prefix cache holds
    prompt_tokens: int
    blocks: int  # KV blocks of prompt + max_tokens
    tpot_slo_s: float
    own_context: int  # what its decode steps attend over on average (predictor.own_context_tokens)
    new: bool  # a request admission judges, which leaves the KV blocks an earlier, larger one claimed (kv_claims.py)


class PlacementPolicy(ABC):
    def __init__(
        self,
        registry: Registry,
        prefix_index: PrefixIndex,
        predictor: Predictor,
        ejections: Ejections | None = None,
        tokenizer: str = "",
    ) -> None:
        """`tokenizer`: the router's Tokenizer.digest; only workers of the same one take its requests ("": any)."""
        self.registry = registry
        self.tokenizer = tokenizer
        self.prefix_index = prefix_index
        self.predictor = predictor
        self.ejections = ejections or Ejections(predictor.config.ejection_s)
        self.offered = OfferedWorkers(registry)

    async def place(
        self,
        prompt: list[int],
        max_tokens: int,
        tpot_slo_s: float,
        needs: frozenset[str] = frozenset(),
        avoid: frozenset[str] = frozenset(),
        cache_salt: bytes = b"",
        must_hold: bool = False,
        weights: str | None = None,
    ) -> Placement:
        """Called by the router per request; raises UnavailableError when no worker serves at all. `avoid`:
        workers that already failed this request (a retry never goes back to them). `cache_salt`: the
        request's prefix-cache salt; only blocks cached under it count as hits. Prefill workers whose whole KV
        holds the prompt are preferred; while none is live but one is registered (draining, ejected),
        NoWorkersError, which the request waits out. `must_hold`: only those, and only decode workers whose
        whole KV holds prompt + max_tokens (NoWorkersError when none is live): a retry or a migration, which
        admission does not judge again, must not go where it would be refused as invalid. `needs`: the worker
        features the request needs (protocol/compatibility.py), which only workers that list them serve. A prefill
        and a decode worker are paired only where their `kv_pairing` (weights, block size, KV transfer version) is
        equal; of several such groups (a rollout), the pair whose prefill worker answers first. `weights`: a model
        fingerprint, the only one whose workers may take the request (a stream moving mid-answer)."""
        colocated, prefills, decodes = self._serving(avoid, needs, weights)
        groups = [(prefills, decodes)] if colocated else _pairing_groups(prefills, decodes)
        # What an idle cluster offers the request: on the workers that would serve it as asked (a feature's), of a
        # version with both roles (a rollout's prefill worker whose weights no decode worker runs serves nothing).
        offered_prefills, offered_decodes = (_honouring(ws, needs) or ws for ws in self._registered(colocated))
        offered = (offered_prefills, offered_decodes) if colocated else pairable(offered_prefills, offered_decodes)
        hashed: dict[int, tuple[list[bytes], dict[str, int]]] = {}  # block size -> the prompt's keys, their hits
        placed: list[Placement] = []
        refused = NoWorkersError("no live worker holds the request")
        for group_prefills, group_decodes in groups:
            try:
                args = (prompt, max_tokens, tpot_slo_s, cache_salt, must_hold)
                placed.append(await self._place_in(colocated, group_prefills, group_decodes, offered, hashed, *args))
            except NoWorkersError as e:  # none of this group holds it: another group may
                refused = e
        if not placed:
            raise refused
        return min(placed, key=lambda p: (p.own_ttft_s + p.prefill_queue_s, p.prefill_worker.worker_id))

    async def _place_in(
        self,
        colocated: bool,
        prefills: list[WorkerState],
        decodes: list[WorkerState],
        offered: tuple[list[WorkerState], list[WorkerState]],
        hashed: dict[int, tuple[list[bytes], dict[str, int]]],
        prompt: list[int],
        max_tokens: int,
        tpot_slo_s: float,
        cache_salt: bytes,
        must_hold: bool,
    ) -> Placement:
        """The request's placement on one group of workers that may be paired with each other."""
        block_size = prefills[0].block_size
        blocks = -(-kv_tokens(len(prompt), max_tokens) // block_size)
        if must_hold:
            decodes = _holding_request(decodes, blocks)
            prefills = decodes if colocated else prefills
        if not colocated:  # a prefill worker holds the prompt alone; one whose whole KV cannot refuses it
            prefills = self._holding_prompt(prefills, -(-len(prompt) // block_size), must_hold)
        if block_size not in hashed:
            keyed = await prefix_hashes_off_loop(prompt, block_size, cache_salt)
            # The worker keys every full block of the prompt, but a hit stops short of its last token (computed anew).
            hashed[block_size] = keyed, await self._prefix_hits(colocated, keyed[: (len(prompt) - 1) // block_size])
        keyed, hits = hashed[block_size]
        own_context = own_context_tokens(len(prompt), max_tokens)
        ask = Ask(hits, len(prompt), blocks, tpot_slo_s, own_context, new=not must_hold)
        if colocated:
            prefill = decode = self.choose_colocated(prefills, ask)
        else:
            prefill, decode = self.choose(prefills, decodes, ask)
        cached = hits.get(prefill.cache_key, 0) * block_size
        own_s = self.predictor.own_ttft_s(prefill, len(prompt), cached)
        new_tokens = max(len(prompt) - cached, 1)
        prefill_queue_s = self.predictor.queue_s(prefill, new_tokens, len(prompt) - new_tokens)
        profiled_queue_s = prefill_queue_s + self.predictor.decode_wait_s(decode)
        return Placement(
            decode=decode,
            prefill=None if colocated else prefill,
            cached_tokens=cached,
            own_ttft_s=own_s,
            fixed_s=self.predictor.fixed_s(prefill),
            compute_s=self.predictor.compute_s(prefill, new_tokens, len(prompt) - new_tokens),
            queue_s=self.predictor.load_calibration.queueing_s(prefill.worker_id, own_s, profiled_queue_s),
            profiled_queue_s=profiled_queue_s,
            prefill_queue_s=prefill_queue_s,
            ttft_factor=self.predictor.calibration.factor(prefill.worker_id),
            predicted_tpot_s=self.predictor.tpot_s(decode, own_context),
            own_context_tokens=own_context,
            blocks_needed=blocks,
            block_hashes=keyed,
            offer=self._offer(offered[0], offered[1], hits, len(prompt), blocks, own_context, colocated=colocated),
        )

    def can_place(self) -> bool:
        """Whether a request asking no particular feature would find a live prefill and decode worker that may be
        paired now."""
        try:
            colocated, prefills, decodes = self._serving(frozenset(), frozenset())
            if not colocated:
                _pairing_groups(prefills, decodes)
        except NoWorkersError:
            return False
        return True

    def _serving(
        self, avoid: frozenset[str], needs: frozenset[str], weights: str | None = None
    ) -> tuple[bool, list[WorkerState], list[WorkerState]]:
        """Whether the cluster runs colocated, and its live prefill and decode workers (colocated: the same ones)
        that honour `needs` and run `weights` (when given); none of a role is a NoWorkersError, a wait (starting,
        restarting, a rollout)."""
        colocated = self._workers(Role.COLOCATED, avoid)
        prefills = colocated or self._workers(Role.PREFILL, avoid)
        decodes = colocated or self._workers(Role.DECODE, avoid)
        if not prefills or not decodes:
            if why := other_tokenizers(self.registry.workers(), self.tokenizer):
                raise NoWorkersError(why)
            raise NoWorkersError(
                f"no workers to serve: {len(prefills)} prefill, {len(decodes)} decode live (the others starting, "
                "restarting or gone: `pdserve status` lists them); retry later"
            )
        if needs:  # workers of a build before a feature would ignore what the request asks of it
            prefills, decodes = _honouring(prefills, needs), _honouring(decodes, needs)
            if not prefills or not decodes:
                raise NoWorkersError(
                    f"no live worker honours {', '.join(sorted(needs))} yet (a rollout under way? `pdserve status` "
                    "lists each worker's build)"
                )
        if weights is not None:  # a stream continues on the weights that began it, or not at all
            prefills, decodes = running(prefills, weights), running(decodes, weights)
            if not prefills or not decodes:
                raise NoWorkersError(f"no live prefill and decode worker runs the weights {weights} any more")
        return bool(colocated), prefills, decodes

    def _holding_prompt(self, prefills: list[WorkerState], prompt_blocks: int, must_hold: bool) -> list[WorkerState]:
        """The prefill workers whose whole KV holds the prompt, else (none live does) all of them. A registered one
        that would, draining, out of placement or restarting for now, makes it a wait (NoWorkersError), not the
        small one's refusal (INVALID_ARGUMENT: never) of what it serves once back; so does `must_hold`."""
        holding = [w for w in prefills if w.kv_blocks_total >= prompt_blocks]
        if not holding and (must_hold or self._registered_holds(Role.PREFILL, prompt_blocks)):
            raise NoWorkersError(f"no live prefill worker holds {prompt_blocks} KV blocks")
        return holding or prefills

    async def _prefix_hits(self, colocated: bool, keys: list[bytes]) -> dict[str, int]:
        """Cache key -> leading `keys` its worker's prefix cache holds, over the registered workers only: a gone
        worker's cache went with it (its restart starts empty)."""
        registered = self.registry.workers(Role.COLOCATED if colocated else Role.PREFILL)
        return await self.prefix_index.match([w.cache_key for w in registered], keys)

    def kv_capacity_tokens(self) -> int | None:
        """The most KV slots one request may fill (prompt + max_tokens - 1): the largest decode (or colocated)
        worker's whole KV, over the workers an offer counts; None while none has said. More is refused as never
        servable, so a default max_tokens must not ask for it, nor the models list promise it."""
        workers = self.offered.workers(Role.COLOCATED) or self.offered.workers(Role.DECODE)
        return max((w.kv_blocks_total * w.block_size for w in workers if w.kv_blocks_total), default=None)

    def _by_ttft(self, hits: dict[str, int], prompt_tokens: int) -> Callable[[WorkerState], tuple[float, str]]:
        """Predicted TTFT, a cached prefix counting as work already done; ties by id."""
        p = self.predictor

        def key(w: WorkerState) -> tuple[float, str]:
            return p.ttft_s(w, prompt_tokens, hits.get(w.cache_key, 0) * w.block_size), w.worker_id

        return key

    def _workers(self, role: Role, avoid: frozenset[str]) -> list[WorkerState]:
        ours = of_tokenizer(self.registry.workers(role), self.tokenizer)
        live = [w for w in ours if w.worker_id not in avoid and not w.draining]
        return self.ejections.usable(live)

    def _registered_holds(self, role: Role, blocks: int) -> bool:
        return any(w.kv_blocks_total >= blocks for w in self._offered(role))

    def _registered(self, colocated: bool) -> tuple[list[WorkerState], list[WorkerState]]:
        """The prefill and decode workers the offer is over."""
        if colocated:
            every = self._offered(Role.COLOCATED)
            return every, every
        return self._offered(Role.PREFILL), self._offered(Role.DECODE)

    def _offered(self, role: Role) -> list[WorkerState]:
        """Of the workers the offer is over (offered_workers.py), those of this router's tokenizer."""
        return of_tokenizer(self.offered.workers(role), self.tokenizer)

    def _offer(
        self,
        prefills: list[WorkerState],
        decodes: list[WorkerState],
        hits: dict[str, int],
        prompt_tokens: int,
        blocks: int,
        own_context: int,
        colocated: bool,
    ) -> Offer:
        """The best an idle cluster does for this request: TPOT only on a decode worker whose KV holds it (a fast
        one too small for it offers nothing), TTFT only on a prefill worker whose KV holds the prompt (one too small
        refuses it) or, colocated, on a worker holding the whole request."""
        p = self.predictor
        bs = prefills[0].block_size
        holding = [w for w in decodes if w.kv_blocks_total >= blocks] or decodes
        if colocated:
            prefilling = holding
        else:
            prompt_blocks = -(-prompt_tokens // bs)
            prefilling = [w for w in prefills if w.kv_blocks_total >= prompt_blocks] or prefills
        return Offer(
            ttft_s=min(p.offer_ttft_s(w, prompt_tokens, hits.get(w.cache_key, 0) * bs) for w in prefilling),
            tpot_s=min(p.offer_tpot_s(w, own_context) for w in holding),
            ttft_now_s=min(p.own_ttft_s(w, prompt_tokens, hits.get(w.cache_key, 0) * bs) for w in prefilling),
            tpot_now_s=min(p.idle_tpot_s(w, own_context) for w in holding),
            kv_blocks=max(w.kv_blocks_total for w in decodes),
            held_at_once=sum(_held_at_once(w, blocks) for w in decodes),
        )

    def choose_colocated(self, workers: list[WorkerState], ask: Ask) -> WorkerState:
        """The colocated worker for a request; by default the prefill choice among them."""
        return self.choose(workers, workers, ask)[0]

    @abstractmethod
    def choose(
        self, prefills: list[WorkerState], decodes: list[WorkerState], ask: Ask
    ) -> tuple[WorkerState, WorkerState]:
        """The (prefill, decode) pair for a request."""


class SLOAwarePlacement(PlacementPolicy):
    """Prefill: the lowest predicted TTFT, a cached prefix counting as work already done. Decode: among
    workers with room in their batch and for prompt + max_tokens whose predicted TPOT meets the SLO, the most
    free blocks."""

    def choose(
        self, prefills: list[WorkerState], decodes: list[WorkerState], ask: Ask
    ) -> tuple[WorkerState, WorkerState]:
        p, free = self.predictor, self._free(ask)
        prefill = min(prefills, key=self._by_ttft(ask.hits, ask.prompt_tokens))
        roomy, within = self._decodable(decodes, ask, free)
        if within:
            decode = max(within, key=lambda w: (free(w), -p.tpot_s(w, ask.own_context)))
        else:  # nothing meets both: the best effort, which admission then judges
            decode = min(roomy or decodes, key=lambda w: (p.tpot_s(w, ask.own_context), -free(w)))
        return prefill, decode

    def choose_colocated(self, workers: list[WorkerState], ask: Ask) -> WorkerState:
        """The lowest TTFT among the workers that can also decode the request (room, TPOT within the SLO), else
        among those with room, else any: the fastest prefill alone may lack the blocks another worker has free."""
        roomy, within = self._decodable(workers, ask, self._free(ask))
        return min(within or roomy or workers, key=self._by_ttft(ask.hits, ask.prompt_tokens))

    def _free(self, ask: Ask) -> Callable[[WorkerState], int]:
        """A worker's free blocks as the request may take them (`Ask.new`)."""
        p = self.predictor
        return (lambda w: p.free_blocks_for(w, ask.blocks)) if ask.new else p.free_blocks

    def _decodable(
        self, workers: list[WorkerState], ask: Ask, free: Callable[[WorkerState], int]
    ) -> tuple[list[WorkerState], list[WorkerState]]:
        """Workers with room for the request's blocks and in their batch, and those of them whose TPOT meets its
        SLO. Room past the places streams waiting to move will take (admission holds a new request to that) where
        there is; else any room, which a moving stream's own placement looks for."""
        p = self.predictor

        def roomy_past(spare: int) -> list[WorkerState]:
            return [w for w in workers if free(w) >= ask.blocks and p.has_batch_room(w, spare)]

        roomy = roomy_past(p.tracker.held_for_moving) or roomy_past(0)
        return roomy, [w for w in roomy if p.tpot_s(w, ask.own_context) <= ask.tpot_slo_s]


def _holding_request(decodes: list[WorkerState], blocks: int) -> list[WorkerState]:
    """The decode workers whose whole KV holds the request, for one admission does not judge again (a retry, a
    migration): NoWorkersError, a wait, when none live does."""
    holding = [w for w in decodes if w.kv_blocks_total >= blocks]
    if not holding:
        raise NoWorkersError(f"no live decode worker holds {blocks} KV blocks")
    return holding


def _honouring(workers: list[WorkerState], needs: frozenset[str]) -> list[WorkerState]:
    return [w for w in workers if needs <= set(w.features)]


def _pairing_groups(prefills: list[WorkerState], decodes: list[WorkerState]) -> list[Group]:
    """kv_pairing.pairing_groups; none is an UnpairedError."""
    if groups := pairing_groups(prefills, decodes):
        return groups
    raise UnpairedError(
        "no live prefill and decode worker share weights, block size and KV transfer version (prefill workers "
        f"{versions(prefills)}, decode workers {versions(decodes)}): a rollout under way; retry later"
    )


def _held_at_once(w: WorkerState, blocks: int) -> int:
    """Requests of `blocks` KV blocks a worker holds at once: as many as its whole KV fits, and (a decode worker
    refuses a hand-off past it) no more than its batch cap."""
    fits = w.kv_blocks_total // blocks
    return min(fits, w.max_num_seqs) if w.role == Role.DECODE and w.max_num_seqs else fits
