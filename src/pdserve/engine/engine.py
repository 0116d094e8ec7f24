"""The engine loop: requests in, one batched model step at a time, token and text deltas out."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.engine.batch_generate import Completion, generate_all
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.device import resolve_device, resolve_dtype
from pdserve.engine.guided import GuidedDecoding
from pdserve.engine.model_files import generation_eos_ids, tokenizer_folder
from pdserve.engine.model_runner import ModelRunner, kv_block_bytes, load_model
from pdserve.engine.models import resolve_model
from pdserve.engine.sampler import Sampler, TokenHistory
from pdserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.outputs import FinishReason, RequestOutput, TokenLogprobs
from pdserve.protocol.request_checks import check_request, kv_tokens
from pdserve.protocol.roles import EngineMode
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    prompt_seen: np.ndarray | None  # with penalties: the prompt's distinct tokens, found once
    matcher: llguidance.LLMatcher | None  # with an output constraint: what its output may be next (guided.py)
    # With prompt logprobs: those of prompt positions 1, 2, ... found so far (position 0 has no context).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def token_history(self) -> TokenHistory:
        return None if self.prompt_seen is None else (self.prompt_seen, self.seq.penalized_output_token_ids())


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        path = resolve_model(config.model)
        self.model = load_model(path, resolve_dtype(config), resolve_device(config))
        self.model_config = self.model.config
        self.tokenizer = Tokenizer(tokenizer_folder(path))
        eos = set(self.model_config.eos_token_ids) | set(generation_eos_ids(path))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory()
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.runner = ModelRunner(self.model, config, num_blocks)
        self.sampler = Sampler()
        vocab_size, threads = self.model_config.vocab_size, config.num_threads
        self.guided = GuidedDecoding(self.tokenizer, vocab_size, self.eos_token_ids, threads)
        self._requests: dict[str, _Request] = {}
        self.fingerprint = self.model.fingerprint
        self.last_step_tokens = 0  # tokens the last step ran (0: it could run nothing), for live speed tracking
        # The earlier tokens its prompt chunks read, and those its decoding sequences attend over (SchedulerOutput's).
        self.last_step_prefill_squares = self.last_step_decode_context = 0
        # Its requests' waits, once each (monotonic): arrival to the start of its first step, then to its first token.
        self.last_step_queue_s: list[float] = []
        self.last_step_prefill_s: list[float] = []
        # Once a preemption: from it to the start of the step that ran its sequence again (its stream's wait).
        self.last_step_requeue_s: list[float] = []

    def _blocks_for_memory(self) -> int:
        per_block = kv_block_bytes(self.model_config, self.config.block_size, resolve_dtype(self.config))
        return max(1, int(self.config.kv_cache_memory_gb * 2**30) // per_block)

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def preempted_outputs(self) -> list[RequestOutput]:
        """An output with no token for each sequence that streamed and was preempted, while it waits to be
        recomputed and while it is (a long context's recompute runs chunk by chunk): its stream says the worker is
        alive while nothing comes (a router's stall bound would take the silence for a hung worker)."""
        return [
            RequestOutput(seq.seq_id, [], "", None, seq.num_prompt_tokens, seq.num_cached_tokens)
            for seq in itertools.chain(self.scheduler.waiting, self.scheduler.running)
            if seq.num_preemptions and seq.output_token_ids and seq.num_computed_tokens < seq.num_tokens - 1
        ]

    def stats(self) -> dict[str, int]:
        """The load a worker publishes (registry, metrics, the router's predictor)."""
        queued, free = self.scheduler.queued_prefill(), self.blocks_free_for_new()
        short, chunk_s = self.scheduler.queued_ahead_of_short() or (queued, 0.0)
        return {
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_free": free,  # a new request's: less those owed
            "kv_blocks_owed": self.blocks.num_free_blocks - free,  # free, but owed to its own sequences
            "kv_blocks_cached": self.blocks.num_cached_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "sequences": self.num_sequences,
            "queued_prefill_tokens": queued.tokens,
            "queued_prefill_prompts": queued.prompts,
            "queued_prefill_token_squares": queued.token_squares,
            # What a prompt that fits one step waits for, where such prompts go ahead (engine/short_first.py).
            "short_prompt_tokens": self.scheduler.short_first.chunk if self.scheduler.short_first else 0,
            "queued_short_prefill_prompts": short.prompts,
            "queued_short_prefill_tokens": short.tokens,
            "queued_short_prefill_token_squares": short.token_squares,
            "prefill_chunk_us": round(chunk_s * 1e6),
            "prefill_stretch_milli": round(self.scheduler.prefill_stretch() * 1e3),  # prefill_stretch.py
            "prefix_hits": self.blocks.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
            "sequences_freed": self.scheduler.num_freed,  # sampled with the free blocks: which ends they hold
            "sampled_at_ns": time.time_ns(),  # for routers of an earlier build, which read it on their own clocks
            "sampled_mono_ns": time.monotonic_ns(),  # the age the worker reports with it (WorkerState.load_age_s)
        }

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Everything about a request that can be wrong before it runs; raises InvalidRequestError."""
        check_request(prompt_token_ids, sampling, self.model_config)
        field, what = "sampling.max_tokens", "prompt + max_tokens"
        total = kv_tokens(len(prompt_token_ids), sampling.max_tokens)
        # A prefill worker hands the prompt's blocks off: they are all it holds. A prompt too big alone is the
        # prompt's fault, not max_tokens'.
        prompt_blocks = self.blocks.blocks_for(len(prompt_token_ids))
        if self.config.mode is EngineMode.PREFILL_ONLY or prompt_blocks > self.blocks.num_blocks:
            field, what, total = "prompt_token_ids", "the prompt", len(prompt_token_ids)
        needed, held = self.blocks.blocks_for(total), self.blocks.num_blocks
        if needed > held:
            raise InvalidRequestError(field, f"{what} needs {needed} KV blocks; this worker has {held}")

    def add_request(self, request: EngineRequest) -> None:
        if self.config.mode is EngineMode.DECODE_ONLY:
            raise RuntimeError("a decode-only engine takes sequences with their KV, through receive()")
        self.scheduler.add(self._new_request(request))

    def _new_request(self, request: EngineRequest) -> Sequence:
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        prompt, sampling, resumed = request.prompt, request.sampling, request.resumed_output_tokens
        self.validate(prompt, sampling)
        if not 0 <= resumed <= len(prompt):
            raise InvalidRequestError("resumed_output_tokens", f"must be in [0, {len(prompt)}], got {resumed}")
        seq = Sequence(
            request.request_id,
            list(prompt),
            sampling,
            arrival=time.monotonic(),
            cache_salt=request.cache_salt,
            resumed_output_tokens=resumed,
            tenant=request.tenant,
            priority=request.priority,
        )
        detok = IncrementalDetokenizer(self.tokenizer.backend, seq.prompt_token_ids, stop=sampling.stop)
        seen = np.unique(np.asarray(seq.original_prompt_token_ids, dtype=np.int64)) if sampling.penalized else None
        constraint, so_far = sampling.constraint, prompt[len(prompt) - resumed :]
        matcher = None if constraint is None else self.guided.matcher(constraint, so_far, request.grammar)
        self._requests[request.request_id] = _Request(seq, detok, seen, matcher)
        return seq

    @property
    def num_sequences(self) -> int:
        """Its requests: waiting, running, and (decode) those whose KV is arriving: what `max_num_seqs` bounds."""
        return len(self._requests)

    def abort(self, request_id: str) -> bool:
        """Drop the request wherever it is and free its blocks; False when it is unknown."""
        if (req := self._requests.pop(request_id, None)) is not None:
            self.scheduler.finish(req.seq, FinishReason.ABORT)
        return req is not None

    # Hand-off between a prefill-only and a decode-only engine: the KV bytes move outside it (pdserve.transfer).

    def release(self, request_id: str) -> None:
        """Prefill side: the decode side has the KV (or gave up); free the sequence's blocks."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, FinishReason.LENGTH)

    def reserve(self, request: EngineRequest) -> list[int]:
        """Decode side: allocate the blocks a prompt's KV will arrive in, before any byte moves. Raises
        OverloadedError (the caller sheds it) when the batch is full, or the pool cannot hold it now beside what
        preempted sequences wait for."""
        # Checked first: what is never valid says so, full batch or not. Its first token is the prefill worker's.
        seq = self._new_request(request)
        if (held := self.num_sequences - 1) >= (cap := self.config.scheduler.max_num_seqs):
            del self._requests[request.request_id]
            raise OverloadedError(f"its batch is full ({held} sequences, max_num_seqs {cap})")
        leaves_owed = self.blocks.blocks_for(seq.num_prompt_tokens) <= self.blocks_free_for_new()
        if not (leaves_owed and self.blocks.allocate_slots(seq, seq.num_prompt_tokens)):
            del self._requests[request.request_id]
            raise OverloadedError(f"no free KV blocks for {seq.num_prompt_tokens} tokens")
        seq.status = SequenceStatus.RECEIVING
        return list(seq.block_table)

    def blocks_owed(self) -> int:
        """Decode-only: the free blocks its own sequences will need before a new hand-off may take one (0 elsewhere).
        Sequences preempted here resume first: a reservation takes only what their recompute leaves, or each block
        they free would go to the next hand-off, and they would wait for ever. And each sequence running or with KV
        arriving that will outgrow its blocks keeps one free for its next: taken by a hand-off, a running sequence
        is preempted for it, recomputes, and is preempted again by the next hand-off (a review's run of 60
        hand-offs recomputed 697 prompt tokens for 1540 decoded)."""
        if self.config.mode is not EngineMode.DECODE_ONLY:
            return 0
        owed = sum(self.blocks.blocks_for(s.num_tokens) for s in self.scheduler.waiting)
        growing = (SequenceStatus.RUNNING, SequenceStatus.RECEIVING)
        return owed + sum(1 for r in self._requests.values() if r.seq.status in growing and self._will_grow(r.seq))

    def blocks_free_for_new(self) -> int:
        """What a reservation may take; the worker publishes it as free, so no router places a hand-off it refuses."""
        return max(0, self.blocks.num_free_blocks - self.blocks_owed())

    def _will_grow(self, seq: Sequence) -> bool:
        """Whether `seq` may yet need a block it does not hold (its max_tokens past its blocks)."""
        return self.blocks.blocks_for(kv_tokens(seq.num_prompt_tokens, seq.sampling.max_tokens)) > len(seq.block_table)

    def commit(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        kv_received: bool = True,
        first_finish: FinishReason | None = None,
    ) -> RequestOutput:
        """Decode side: the KV arrived and the prefill side sampled `first_token` (and computed its
        `first_logprobs`, when the request asked); start decoding. `kv_received` False: the first token ended
        the request (for `first_finish`, when the prefill worker said), so no KV came; its blocks, never written,
        must not enter the prefix cache (a later prompt with that prefix would attend to whatever they held). That
        decision holds here even where this worker's would differ (a matcher's lexer, whose states its compiled
        grammar shares with earlier requests, may fail on one worker and not on the other): nothing could decode
        without the KV. A prefill worker of an earlier build says no reason: this worker's own, else STOP."""
        req = self._requests[request_id]
        if req.seq.status is not SequenceStatus.RECEIVING:
            raise RuntimeError(f"{request_id} is {req.seq.status.value}, not receiving")
        req.seq.num_computed_tokens = req.seq.num_prompt_tokens
        if kv_received:
            self.blocks.cache_full_blocks(req.seq)
        ends = None if kv_received else first_finish
        out = self._append_token(req, first_token, first_logprobs, ends, must_end=not kv_received)
        if not out.finished:
            req.seq.arrival = time.monotonic()  # its queue here: the KV's wait is pdserve_kv_transfer_seconds
            self.scheduler.add_running(req.seq)
        return out

    def step(self) -> list[RequestOutput]:
        began = time.monotonic()
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_tokens
        self.last_step_prefill_squares = plan.prefill_attention_squares
        self.last_step_decode_context = plan.decode_context_tokens
        for seq in plan.started:
            seq.first_scheduled = began
        self.last_step_queue_s = [began - seq.arrival for seq in plan.started]
        self.last_step_requeue_s = self._requeue_waits(plan, began)
        self.last_step_prefill_s = []
        if not plan.chunks:
            return []
        sampled = [self._requests[c.seq_id] for c in plan.chunks if c.sample]
        mask = self.guided.start([r.matcher for r in sampled], self.runner.device)  # beside the forward
        step = self.runner.execute(plan.chunks)
        logits = step.sampled
        self.scheduler.complete_step()
        for chunk in plan.chunks:
            if chunk.seq_id in step.prompt:
                self._record_prompt_logprobs(self._requests[chunk.seq_id], chunk, step.prompt[chunk.seq_id])
        prefilled = [r.seq for r in sampled if not r.seq.output_token_ids]  # a recompute's prompt has its tokens
        params = [r.seq.sampling for r in sampled]
        histories = [r.token_history() for r in sampled]
        masked = logits if mask is None else mask.masked(logits)
        # The position each row draws is its sequence's length: the same on whichever engine draws it.
        seeded = [None if p.seed is None else (p.seed, r.seq.num_tokens) for p, r in zip(params, sampled, strict=True)]
        tokens = self.sampler(masked, params, seeded, histories)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: dict[int, TokenLogprobs] = {}
        if asked:
            found = self.sampler.logprobs(logits, tokens, asked, [params[i].logprobs or 0 for i in asked])
            logprobs = dict(zip(asked, found, strict=True))
        outputs = [
            self._append_token(req, tok, logprobs.get(i))
            for i, (req, tok) in enumerate(zip(sampled, tokens.tolist(), strict=True))
        ]
        done = time.monotonic()
        for chunk in plan.chunks:
            if len(chunk.token_ids) > 1 and not chunk.sample:  # a prompt part-way: its next chunk takes about as long
                self._requests[chunk.seq_id].seq.last_chunk_s = done - began
        self.scheduler.step_took(began, done)
        if prefilled:
            self.last_step_prefill_s = [done - s.first_scheduled for s in prefilled if s.first_scheduled is not None]
        return outputs

    def _requeue_waits(self, plan: SchedulerOutput, began: float) -> list[float]:
        """The waits of the preempted sequences this step runs again; those it preempts begin theirs."""
        waits = []
        for seq in (self._requests[c.seq_id].seq for c in plan.chunks):
            if seq.preempted_at is not None:
                waits.append(began - seq.preempted_at)
                seq.preempted_at = None
        for seq_id in plan.preempted:
            self._requests[seq_id].seq.preempted_at = began
        return waits

    def _record_prompt_logprobs(self, req: _Request, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Row j of the chunk predicts the token at position start + j + 1: keep those that are prompt tokens
        not yet recorded (a sequence preempted and recomputed runs its prompt again)."""
        seq, start = req.seq, chunk.start_position
        first = len(req.prompt_logprobs) + 1
        rows = [j for j in range(len(chunk.token_ids)) if first <= start + j + 1 < seq.num_prompt_tokens]
        if not rows:
            return
        last = seq.num_prompt_tokens - 1
        targets = [seq.prompt_token_ids[min(start + j + 1, last)] for j in range(len(chunk.token_ids))]
        count = seq.sampling.prompt_logprobs or 0
        targets_tensor = torch.tensor(targets, device=logits.device)
        req.prompt_logprobs += self.sampler.logprobs(logits, targets_tensor, rows, [count] * len(rows))

    def _append_token(
        self,
        req: _Request,
        token: int,
        logprobs: TokenLogprobs | None = None,
        ends: FinishReason | None = None,
        must_end: bool = False,
    ) -> RequestOutput:
        """`ends`: the request ends at this token for that reason, decided elsewhere (`must_end`: it ends here
        whatever this engine finds, STOP when it finds no reason)."""
        seq = req.seq
        seq.output_token_ids.append(token)
        if req.matcher is not None:
            req.matcher.consume_token(token)
        # A stop token ends the output without its own text, as a stop string does (vLLM's rule); its id stays.
        text = "" if token in seq.sampling.stop_token_ids else req.detokenizer.step([token])
        error = None if must_end else self._constraint_failure(req)
        reason = ends or (FinishReason.ABORT if error else self._finish_reason(req, token))
        if must_end and reason is None:
            reason = FinishReason.STOP
        if reason is not None:
            if error is None and (reason is not FinishReason.STOP or not req.detokenizer.stopped):
                text += req.detokenizer.flush()
                if req.detokenizer.stopped:  # a stop string ending in the last token's whole characters
                    reason = FinishReason.STOP
            self.scheduler.finish(seq, reason)
            del self._requests[seq.seq_id]
        handoff: tuple[int, ...] = ()
        if reason is None and self.config.mode is EngineMode.PREFILL_ONLY:
            self.scheduler.detach(seq)
            seq.status = SequenceStatus.HANDOFF
            handoff = tuple(seq.block_table[: self.blocks.blocks_for(seq.num_prompt_tokens)])
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=[token],
            new_text=text,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            handoff_block_ids=handoff,
            logprobs=() if logprobs is None else (logprobs,),
            prompt_logprobs=tuple(req.prompt_logprobs) if seq.num_output_tokens == 1 else (),
            error=error,
            sequences_freed=self.scheduler.num_freed,
        )

    def _constraint_failure(self, req: _Request) -> InvalidRequestError | None:
        if req.matcher is None or not req.matcher.is_error():
            return None
        seq = req.seq
        error = self.guided.failure(
            seq.sampling.constraint, req.matcher, seq.resumed_output_tokens + seq.num_output_tokens - 1
        )
        log.warning("%s: %s", seq.seq_id, error.recorded)
        return error

    def _finish_reason(self, req: _Request, token: int) -> FinishReason | None:
        seq, params = req.seq, req.seq.sampling
        if token in params.stop_token_ids or req.detokenizer.stopped:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.EOS
        if req.matcher is not None and req.matcher.is_stopped():
            return FinishReason.STOP  # the constraint is complete: nothing may follow
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Runs every prompt to completion in one continuous batch (batch_generate.py)."""
        return generate_all(self, prompts, sampling)
