"""Constrained decoding in the engine: each constrained request's llguidance matcher, fed every token of its output,
masks each step's logits to the tokens its grammar (protocol/output_constraint.py) allows next. The sampler's biases
and penalties come after and leave a masked token out of reach (-inf, or -1e30 past a repetition penalty's clamp,
below any logit the model gives); temperature, top-k and top-p see the masked logits. Log probabilities stay the
model's.

A matcher follows the output wherever it was sampled: a decode worker's feeds it the prefill worker's first token
when the hand-off commits, and a migrated stream's the tokens it had streamed (the prompt's resumed tail).

Compiling a grammar against the vocabulary takes about 1.5 ms per KiB of schema (25 ms for 16 KiB with SmolLM2's),
which on the engine thread would hold every stream of the worker: a worker compiles each grammar off that thread
(`compile`, from its request handler), the request carries it to the engine (EngineRequest.grammar), and each
request's matcher is a copy of it (a microsecond).

A row's next mask depends only on the tokens its matcher has consumed, all known before the step's forward: `start`
computes the step's masks beside it, on a thread of its own, with llguidance's executor (its rows in parallel, the GIL
released), and turns the bits into an additive bias (0 or -inf per token, for finite logits; adding it costs a tenth
of a masked fill over the same logits on a CPU). The engine thread only adds it after the forward: 32 rows of
SmolLM2's 49,152 tokens took a median 1.3 ms there on a shared 2-core CPU, against 7.1 ms computing and filling the
bits after the forward. Not llguidance.torch.apply_token_bitmask_inplace: it is torch.compile'd, 25 s to compile at
its first call here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import OutputConstraint

COMPILED_KEPT = 64  # grammars a worker keeps compiled, the least recently used dropped past it

# Row b of the table: byte value b's eight tokens (lowest bit first, llguidance's order), 0 where allowed, -inf not.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)


class StepMask:
    """The masks of one step's constrained rows, being computed beside its forward. Until `masked` returns, their
    matchers are the mask thread's: nothing else may touch them."""

    def __init__(self, rows: list[int], bias: Future[np.ndarray]) -> None:
        self.rows = rows  # the constrained rows' places among the step's sampled rows
        self._bias = bias  # [len(rows), vocab] float32: 0 where allowed, -inf where not

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [N, V] (read only) with each constrained row's disallowed tokens at -inf: a float copy."""
        bias = torch.from_numpy(self._bias.result()).to(logits.device)
        rows = torch.tensor(self.rows, device=logits.device)
        return logits.to(torch.float32, copy=True).index_add_(0, rows, bias)


class GuidedDecoding:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        # At start (0.3 s for SmolLM2's 49,152 tokens), not at the first constrained request on the engine thread.
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # `compile` runs in request handlers' threads, `matcher` on the engine's
        self._executor = llguidance.LLExecutor()  # its own threads: the rows' masks in parallel
        self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided-mask")

    def compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """The constraint's grammar compiled against the vocabulary, once per grammar while it is kept; any thread."""
        grammar = constraint.grammar
        with self._lock:
            if (compiled := self._compiled.get(grammar)) is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise InvalidRequestError(f"sampling.{constraint.kind}", compiled.get_error())
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(
        self, constraint: OutputConstraint, output_so_far: Sequence[int], compiled: llguidance.LLMatcher | None = None
    ) -> llguidance.LLMatcher:
        """A matcher for a request whose output so far is `output_so_far` (tokens sampled elsewhere), copied from
        `compiled` (`compile`'s, from the request's handler), or compiled here when the request came without it."""
        matcher = (compiled or self.compile(constraint)).deep_copy()
        if output_so_far and not matcher.consume_tokens(list(output_so_far)):
            why = matcher.get_error()
            raise InvalidRequestError("resumed_output_tokens", f"the output so far breaks its {constraint.kind}: {why}")
        return matcher

    def start(self, matchers: Sequence[llguidance.LLMatcher | None]) -> StepMask | None:
        """Starts computing the masks of a step's sampled rows (None: unconstrained); None when no row is."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        return StepMask([i for _, i in rows], self._mask_thread.submit(self._bias, [m for m, _ in rows]))

    def _bias(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """On the mask thread: each matcher's next mask as an additive bias, one row each."""
        bits = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)  # int32 words, -1: all
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m, j) for j, m in enumerate(matchers)], bits)
        # Token t is bit t % 8 of byte t // 8 of the words read little-endian: each byte picks its eight biases.
        as_bytes = bits.astype("<i4", copy=False).view(np.uint8)
        bias = np.take(_BYTE_BIAS, as_bytes, axis=0).reshape(len(matchers), -1)
        return np.ascontiguousarray(bias[:, : self.vocab_size])
