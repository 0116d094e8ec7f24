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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance
import numpy as np
import torch

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import OutputConstraint

COMPILED_KEPT = 64  # grammars a worker keeps compiled, the least recently used dropped past it


class GuidedDecoding:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        # At start (0.3 s for SmolLM2's 49,152 tokens), not at the first constrained request on the engine thread.
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # `compile` runs in request handlers' threads, `matcher` on the engine's

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

    @staticmethod
    def masked(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor:
        """`logits` [N, V] (read only) with each constrained row's disallowed tokens at -inf: a float copy, or
        `logits` itself when no row is constrained."""
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bits = np.stack([np.frombuffer(m.compute_bitmask(), dtype=np.uint8) for _, m in rows])
        # The disallowed tokens: inverted as bytes, unpacked, read as bools in place, and one fill over the whole
        # batch (a bool copy, then a gather and scatter of the rows, took 4 of the 4.3 ms 32 rows cost a step).
        disallowed = np.zeros(logits.shape, dtype=bool)
        unpacked = np.unpackbits(np.invert(bits), axis=1, bitorder="little")[:, : logits.shape[1]]
        disallowed[[i for i, _ in rows]] = unpacked.view(bool)
        return logits.float().clone().masked_fill_(torch.from_numpy(disallowed).to(logits.device), float("-inf"))
