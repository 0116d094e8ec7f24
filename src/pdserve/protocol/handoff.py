"""What a decode worker and a prefill worker tell each other about one KV hand-off (the Prefill RPC's values)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.outputs import FinishReason, TokenLogprobs


@dataclass(frozen=True)
class KVTarget:
    """Where the prefill worker sends the prompt's KV: the decode worker's reserved blocks, over their pair."""

    decode_worker_id: str
    rendezvous: str  # host:port of the decode side's store for this (prefill, decode) pair
    block_ids: list[int]  # allocated before any byte moves, in block-table order
    tag: int  # tells concurrent transfers over one pair apart
    model_fingerprint: str  # both sides must run the same weights...
    block_size: int  # ...and cut the prompt into the same blocks


@dataclass(frozen=True)
class FirstToken:
    """The prefill worker's first event: the prompt ran."""

    token_id: int
    kv_follows: bool  # False when the first token already ended the request: no KV follows
    cached_prompt_tokens: int  # served by the prefill worker's prefix cache
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # when the request asked for them
    # On the prefill worker before its first step: prompts ahead of it, any router's. None: not reported (a prefill
    # worker of an earlier build), which is not a prompt that waited 0 s.
    waited_s: float | None = None
    # Why the first token ended the request, when it did (kv_follows False): the decode side ends it so too. None
    # from a prefill worker of an earlier build.
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class KVSent:
    """The prefill worker's second event: the KV is in the decode worker's blocks, its own copy freed."""
