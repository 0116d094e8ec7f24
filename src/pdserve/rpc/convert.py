"""Protobuf <-> the engine's dataclasses. Proto3 zero values mean "unset" and take the server default."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from pdserve.errors import InvalidRequestError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.output_constraint import KINDS, OutputConstraint
from pdserve.protocol.outputs import FinishReason, RequestOutput, TokenLogprobs
from pdserve.protocol.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb

T = TypeVar("T")
TOP_K_OFF = -1  # vLLM's "no top-k cut", which clients of either API send; 0 (proto3's unset) is off too

_FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}


def sampling_from_pb(msg: pb.SamplingParams, default_max_tokens: int = 0) -> SamplingParams:
    """The one conversion in; SamplingParams itself checks every rule, naming `sampling.<field>`.

    Unset max_tokens takes `default_max_tokens`; the router sets it on everything it forwards, so a worker
    needs no default of its own (0: a missing value is an error, not a guess). top_p and repetition_penalty
    0 mean 1 (off); top_k -1 means off as 0 does (vLLM's), on both public APIs alike."""
    return SamplingParams(
        max_tokens=msg.max_tokens or default_max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=top_k_from_pb(msg.top_k),
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        constraint=constraint_from_pb(msg),
    )


def top_k_from_pb(top_k: int) -> int:
    """0 (unset) and vLLM's -1 are off, which SamplingParams spells 0; below -1 is refused here, naming the range the
    wire takes (the HTTP API passes its `top_k` through to this one rule)."""
    if top_k < TOP_K_OFF:
        raise InvalidRequestError("sampling.top_k", f"must be >= -1 (0 or -1 = off), got {top_k}")
    return max(top_k, 0)


def constraint_from_pb(msg: pb.SamplingParams) -> OutputConstraint | None:
    """The one constraint a request may set (json_schema, json_object or regex), or None."""
    asked = [kind for kind in KINDS if getattr(msg, kind)]
    if len(asked) > 1:
        raise InvalidRequestError(f"sampling.{asked[1]}", f"at most one output constraint; {' and '.join(asked)} set")
    if not asked:
        return None
    return OutputConstraint(asked[0], "" if asked[0] == "json_object" else getattr(msg, asked[0]))


async def off_the_loop_when_constrained(convert: Callable[[], T], sampling: pb.SamplingParams) -> T:
    """`convert()` of a request with these sampling settings, in a thread when it carries a schema or a regex: on the
    event loop its compile would stall every other stream for a time its structure sets, not its size (a 3 KB
    schema of `allOf` over `anyOf`s took 0.4-0.9 s on this VM; llguidance releases the GIL meanwhile).
    `json_object` is one fixed grammar, 0.1 ms."""
    if sampling.json_schema or sampling.regex:
        return await asyncio.to_thread(convert)
    return convert()


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    """The one conversion out: every field set, so the receiver needs no defaults."""
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if (constraint := params.constraint) is not None:
        setattr(msg, constraint.kind, True if constraint.kind == "json_object" else constraint.spec)
    return msg


def finish_reason_to_pb(reason: FinishReason | None) -> pb.FinishReason:
    if reason is None:
        return pb.FINISH_REASON_UNSPECIFIED
    return _FINISH_TO_PB.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_pb(reason: pb.FinishReason) -> FinishReason | None:
    """None for UNSPECIFIED: not finished, or not said (a peer of an earlier build)."""
    return next((ours for ours, theirs in _FINISH_TO_PB.items() if theirs == reason), None)


def output_to_pb(out: RequestOutput) -> pb.GenerateResponse:
    """One engine output -> one stream message (usage is the router's to add on the last)."""
    return pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text=out.new_text,
        finish_reason=finish_reason_to_pb(out.finish_reason),
        logprobs=[logprobs_to_pb(lp) for lp in out.logprobs],
        prompt_logprobs=[logprobs_to_pb(lp) for lp in out.prompt_logprobs],
    )


def logprobs_to_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)


def logprobs_from_pb(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.logprob, tuple(msg.top_token_ids), tuple(msg.top_logprobs))


def engine_request_from_pb(msg: wpb.WorkerGenerateRequest | wpb.PrefillRequest) -> EngineRequest:
    """A worker's request as its engine runs it; its sampling as the router filled it in."""
    return EngineRequest(
        msg.request_id,
        list(msg.prompt_token_ids),
        sampling_from_pb(msg.sampling),
        msg.cache_salt,
        msg.resumed_output_tokens,
        msg.tenant,
        msg.priority,
    )
