"""Constrained decoding in the engine: each constrained request's llguidance matcher, fed every token of its output,
masks each step's logits to the tokens its grammar (protocol/output_constraint.py) allows next. The sampler's biases
and penalties come after and leave a masked token out of reach (-inf, or -1e30 past a repetition penalty's clamp,
below any logit the model gives); temperature, top-k and top-p see the masked logits. Log probabilities stay the
model's.

A matcher follows the output wherever it was sampled: a decode worker's feeds it the prefill worker's first token
when the hand-off commits, and a migrated stream's the tokens it had streamed (the prompt's resumed tail).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import numpy as np
import torch

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import OutputConstraint


class GuidedDecoding:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._source = (tokenizer.backend.to_str(), vocab_size, sorted(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first constrained request (0.3 s for SmolLM2's 49,152 tokens), then kept."""
        if self._tokenizer is None:
            text, vocab_size, eos = self._source
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, constraint: OutputConstraint, output_so_far: Sequence[int]) -> llguidance.LLMatcher:
        """A matcher for a request whose output so far is `output_so_far` (tokens sampled elsewhere)."""
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if output_so_far and not matcher.consume_tokens(list(output_so_far)):
            why = matcher.get_error()
            raise InvalidRequestError("resumed_output_tokens", f"the output so far breaks its {constraint.kind}: {why}")
        if matcher.is_error():
            raise InvalidRequestError(f"sampling.{constraint.kind}", matcher.get_error())
        return matcher

    @staticmethod
    def masked(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor:
        """`logits` [N, V] (read only) with each constrained row's disallowed tokens at -inf: a float copy, or
        `logits` itself when no row is constrained."""
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bits = np.stack([np.frombuffer(m.compute_bitmask(), dtype=np.uint8) for _, m in rows])
        allowed = np.unpackbits(bits, axis=1, bitorder="little")[:, : logits.shape[1]].astype(bool)
        out = logits.float().clone()
        index = torch.tensor([i for i, _ in rows], device=logits.device)
        disallowed = torch.from_numpy(~allowed).to(logits.device)
        out[index] = out[index].masked_fill(disallowed, float("-inf"))
        return out
