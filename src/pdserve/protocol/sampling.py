"""Per-request sampling settings. Constructing one checks every rule on its fields: this is the one definition
of what a valid SamplingParams is, wherever a request enters (router, worker, `pdserve generate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import OutputConstraint

# OpenAI's bound on presence_penalty and frequency_penalty.
MAX_PENALTY = 2.0
# OpenAI's bound on top_logprobs: the alternatives returned per token.
MAX_LOGPROBS = 20
# OpenAI's bound on each logit_bias value.
MAX_LOGIT_BIAS = 100.0


def shown(value: float) -> str:
    """A number as a refusal names it: an infinity from the wire is often a caller's finite number past what the
    float32 field holds (3.4e38), which the caller should read in the message, not just "inf"."""
    if math.isinf(value):
        return f"{value} (a float32 field holds at most 3.4e38; anything larger arrives as infinite)"
    return str(value)


def check_top_p(value: float, field: str = "sampling.top_p") -> None:
    """The one rule, which the HTTP API also applies to its `top_p` as given, before the wire's 0 would read as off."""
    if not math.isfinite(value) or not 0 < value <= 1:
        raise InvalidRequestError(field, f"must be in (0, 1], got {shown(value)}")


def check_repetition_penalty(value: float, field: str = "sampling.repetition_penalty") -> None:
    """The one rule, which the HTTP API also applies to its `repetition_penalty` as given (the wire's 0 is off)."""
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(field, f"must be a finite number > 0 (1 = off), got {shown(value)}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy; top_k 0 means off.

    Penalties as OpenAI and vLLM define them: presence and frequency subtract from the logit of each token
    already generated (once, and once per occurrence); repetition (1 = off) divides a positive logit and
    multiplies a negative one of every token in the prompt or the output. They apply to greedy rows too.

    Errors name the public API's field (`sampling.top_p`), so a client reads the same message from any entry.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; n: the sampled token's and the n most likely alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    constraint: OutputConstraint | None = None  # what the whole output must be (constrained decoding)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "sampling.temperature", f"must be a finite number >= 0, got {shown(self.temperature)}"
            )
        check_top_p(self.top_p)
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # also refuses nan
                bounds = f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
                raise InvalidRequestError(f"sampling.{name}", f"must be in {bounds}, got {shown(value)}")
        check_repetition_penalty(self.repetition_penalty)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"sampling.{name}", f"must be in [0, {MAX_LOGPROBS}], got {value}")
        for token, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also refuses nan
                raise InvalidRequestError(
                    f"sampling.logit_bias[{token}]",
                    f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {shown(bias)}",
                )
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("sampling.logit_bias", "names a token id more than once")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("sampling.stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits change before sampling: a bias or a penalty."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
