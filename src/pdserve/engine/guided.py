"""Constrained decoding in the engine: each constrained request's llguidance matcher, fed every token of its output,
masks each step's logits to the tokens its grammar (protocol/output_constraint.py) allows next. The sampler's biases
and penalties come after and leave a masked token out of reach (-inf, kept through a repetition penalty's clamp,
which lifts only finite logits to -1e30); temperature, top-k and top-p see the masked logits. Log probabilities stay the
model's.

A matcher follows the output wherever it was sampled: a decode worker's feeds it the prefill worker's first token
when the hand-off commits, and a migrated stream's the tokens it had streamed (the prompt's resumed tail).

Compiling a grammar against the vocabulary takes about 1.5 ms per KiB of schema (25 ms for 16 KiB with SmolLM2's),
which on the engine thread would hold every stream of the worker: a worker compiles each grammar off that thread
(`compile`, from its request handler), the request carries it to the engine (EngineRequest.grammar), and each
request's matcher is a copy of it (a microsecond).

A row's next mask depends only on the tokens its matcher has consumed, all known before the step's forward: `start`
computes the step's masks beside it, on a thread of its own, with llguidance's executor (its rows in parallel, the GIL
released). For logits on a CPU it turns the bits into an additive bias (0 or -inf per token; adding it costs a tenth
of a masked fill over the same logits there, and a +inf logit's NaN is made -inf after): the engine thread only adds
it after the forward, 32 rows of SmolLM2's 49,152 tokens a median 1.3 ms there on a shared 2-core CPU, against 7.1 ms
computing and filling the bits after the forward. For a GPU's it keeps the bits, 32 times fewer bytes to copy there
than a bias (6 MB a step for those 32 rows), which the device expands and fills (`disallowed`). Not
llguidance.torch.apply_token_bitmask_inplace: it is torch.compile'd, 25 s to compile at its first call here.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import WITHHELD, InvalidRequestError
from pdserve.protocol.output_constraint import OutputConstraint

COMPILED_KEPT = 64  # grammars a worker keeps compiled, the least recently used dropped past it
MAX_MASK_THREADS = 8  # a step's rows' masks take microseconds each: more threads only crowd the forward's

# Row b of the table: byte value b's eight tokens (lowest bit first, llguidance's order), 0 where allowed, -inf not.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)


class StepMask:
    """The masks of one step's constrained rows, being computed beside its forward. Until `masked` returns, their
    matchers are the mask thread's: nothing else may touch them."""

    def __init__(self, rows: list[int], masks: Future[np.ndarray], as_bias: bool) -> None:
        self.rows = rows  # the constrained rows' places among the step's sampled rows
        # `as_bias` (logits on a CPU): [len(rows), vocab] float32 biases, 0 where allowed and -inf where not; else
        # (a GPU's) the packed bits, [len(rows), ceil(vocab / 32)] int32, 32 times fewer bytes to copy to it.
        self._masks = masks
        self._as_bias = as_bias

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [N, V] (read only) with each constrained row's disallowed tokens at -inf: a float copy."""
        masks, device = self._masks.result(), logits.device
        rows = torch.tensor(self.rows, device=device)
        out = logits.to(torch.float32, copy=True)
        if self._as_bias:  # an add: a tenth of a masked fill's time on a CPU
            out.index_add_(0, rows, torch.from_numpy(masks))
            # A +inf logit plus its -inf bias is NaN, which argmax would pick: -inf, as the fill would make it.
            return out.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        bits = torch.from_numpy(masks).to(device, non_blocking=True)
        out[rows] = out[rows].masked_fill_(disallowed(bits, logits.shape[1]), -math.inf)
        return out


def disallowed(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks [R, W] int32 (bit t % 32 of word t // 32 set: token t allowed) as [R, vocab_size] bools, True
    where disallowed, on the bits' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab_size] == 0


class GuidedDecoding:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int], threads: int | None = None
    ) -> None:
        """`threads`: the CPUs the worker may use (None: this host's), which bound the mask's threads."""
        # At start (0.3 s for SmolLM2's 49,152 tokens), not at the first constrained request on the engine thread.
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # A grammar being compiled: a second request for it waits for that compile rather than running its own.
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self._lock = threading.Lock()  # `compile` runs in request handlers' threads, `matcher` on the engine's
        self._threads = max(1, min(threads or os.cpu_count() or 1, MAX_MASK_THREADS))
        # Made at the first constrained step: a worker that never sees one starts no thread for them.
        self._executor: llguidance.LLExecutor | None = None  # the rows' masks in parallel, on threads of its own
        self._mask_thread: ThreadPoolExecutor | None = None

    def compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """The constraint's grammar compiled against the vocabulary, once per grammar while it is kept (concurrent
        requests for one grammar share one compile); any thread. Raises InvalidRequestError for a grammar that does
        not compile or cannot be followed from its start."""
        grammar = constraint.grammar
        with self._lock:
            if (compiled := self._compiled.get(grammar)) is not None:
                self._compiled.move_to_end(grammar)
                return compiled
            pending = self._compiling.get(grammar)
            if pending is None:
                future = self._compiling[grammar] = Future()
        if pending is not None:
            return pending.result()  # the first requester's grammar, or its error
        try:
            compiled = self._compile(constraint)
        except BaseException as e:
            with self._lock:
                del self._compiling[grammar]
            future.set_exception(e)
            raise
        with self._lock:
            del self._compiling[grammar]
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        future.set_result(compiled)
        return compiled

    def _compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """Compiles, then computes the first mask on a copy (its lexer states stay in the compiled grammar, where
        the first request finds them): a grammar past the limits fails here, in the request's handler, before its
        prompt runs, not on the step of every stream; so does one no text matches (`[^\\s\\S]`), whose output
        would end at once, as if complete."""
        field = f"sampling.{constraint.kind}"
        compiled = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0, limits=_limits())
        if compiled.is_error():
            raise InvalidRequestError(field, compiled.get_error(), WITHHELD)
        first = compiled.deep_copy()
        first.compute_bitmask()
        if first.is_error():
            why = first.get_error().splitlines()[0]  # then the lexer's state, dumped
            raise InvalidRequestError(
                field, f"fails at its start (past this worker's limits, or matches nothing): {why}"
            )
        return compiled

    def failure(
        self, constraint: OutputConstraint | None, matcher: llguidance.LLMatcher, followed: int
    ) -> InvalidRequestError:
        """The error of a request whose matcher failed on its last token, after `followed` tokens it held to the
        constraint: its grammar ran past the limits (`_limits`), which no retry changes. Not a STOP: its output so far
        is no complete match, and its caller must not take it for one. The grammar's kept copy is dropped: its lexer
        states, which every copy shares and adds to, may be what ran out; the next request compiles it afresh."""
        assert constraint is not None
        with self._lock:
            self._compiled.pop(constraint.grammar, None)
        why = matcher.get_error().splitlines()[0]
        return InvalidRequestError(
            f"sampling.{constraint.kind}",
            f"the output could not be held to it past {followed} tokens (this worker's limits on grammars): {why}",
        )

    def matcher(
        self, constraint: OutputConstraint, output_so_far: Sequence[int], compiled: llguidance.LLMatcher | None = None
    ) -> llguidance.LLMatcher:
        """A matcher for a request whose output so far is `output_so_far` (tokens sampled elsewhere), copied from
        `compiled` (`compile`'s, from the request's handler), or compiled here when the request came without it."""
        matcher = (compiled or self.compile(constraint)).deep_copy()
        if output_so_far and not matcher.consume_tokens(list(output_so_far)):
            why = matcher.get_error().splitlines()[0]  # then the tokens so far and the grammar, dumped
            breaks = f"the output so far breaks its {constraint.kind}"
            raise InvalidRequestError("resumed_output_tokens", f"{breaks}: {why}", f"{breaks}: {WITHHELD}")
        return matcher

    def start(self, matchers: Sequence[llguidance.LLMatcher | None], device: torch.device) -> StepMask | None:
        """Starts computing the masks of a step's sampled rows (None: unconstrained), for logits on `device`; None
        when no row is constrained."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if self._mask_thread is None:
            self._executor = llguidance.LLExecutor(num_threads=self._threads)
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided-mask")
        as_bias, executor = device.type == "cpu", self._executor
        assert executor is not None  # made with the thread
        masks = self._mask_thread.submit(self._masks, executor, [m for m, _ in rows], as_bias)
        return StepMask([i for _, i in rows], masks, as_bias)

    def close(self) -> None:
        """Ends the mask's threads (a stopped engine's), once its last step's are done."""
        if self._mask_thread is not None:
            self._mask_thread.shutdown()

    def _masks(
        self, executor: llguidance.LLExecutor, matchers: list[llguidance.LLMatcher], as_bias: bool
    ) -> np.ndarray:
        """On the mask thread: each matcher's next mask, packed, or as an additive bias (`StepMask`)."""
        bits = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)  # int32 words, -1: all
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, j) for j, m in enumerate(matchers)], bits)
        if not as_bias:
            return bits
        # Token t is bit t % 8 of byte t // 8 of the words read little-endian: each byte picks its eight biases.
        as_bytes = bits.astype("<i4", copy=False).view(np.uint8)
        bias = np.take(_BYTE_BIAS, as_bytes, axis=0).reshape(len(matchers), -1)
        return np.ascontiguousarray(bias[:, : self.vocab_size])


def _limits() -> llguidance.LLParserLimits:
    """A grammar is cheap to send and may be costly to follow: `(x{1000}){6000}` (15 bytes) compiles in a
    millisecond, but under llguidance's defaults (fuel 1M at start, 200k a step; 250k lexer states) its first mask
    took 1.3 s and ~160 MiB of lexer states, and `(x{500}){500}`'s 130 ms every step, on the step every stream of
    the worker waits for. Under these (a tenth to a twelfth of the defaults) its mask takes ~60 ms and its matcher
    fails at the first token it cannot follow within them (the request ends with an error: engine.py), while
    realistic schemas and regexes (nested objects, 1,500-value enums, 20 KiB schemas, formats, `[a-z]{300}`) stay
    well inside them. Lexer states live in the compiled grammar, shared by its copies: 20,000 of them (~14 MiB
    measured) bound what one kept grammar grows to."""
    return llguidance.LLParserLimits(initial_lexer_fuel=100_000, step_lexer_fuel=50_000, max_lexer_states=20_000)
