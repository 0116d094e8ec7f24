"""The shared path's GenerateResponse stream -> OpenAI's response objects: one whole completion, or the chunks of
a Server-Sent Events stream (`data: {json}` per event, then `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2 as pb
from services.router.http.openai_request import OpenAIRequest

# OpenAI has "stop" and "length"; the end-of-sequence token is a stop too.
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop"}
DONE_EVENT = b"data: [DONE]\n\n"  # the last event of every stream


@dataclass
class Choice:
    """One choice's text, finish and log probabilities gathered so far, and the usage its last message carried."""

    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    logprobs: list[dict[str, list[Any]]] = field(default_factory=list)  # one per message, when asked for
    text_offset: int = 0  # the tokens' text before the message being added (each token decoded alone)


@dataclass
class Answer:
    """What the OpenAI objects of one request share and each of its choices (each prompt's `n`). The tokenizer
    decodes the log probabilities' tokens one at a time, and an echoed prompt."""

    request: OpenAIRequest
    id: str
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.request.choices)]

    def add(self, index: int, msg: pb.GenerateResponse) -> str:
        """Gathers one message of choice `index`; returns the text it adds (after the echoed prompt, on the
        first)."""
        choice = self.choices[index]
        echo = self.request.echo and not choice.text
        text = self._prompt_text(index) + msg.text if echo else msg.text
        choice.text.append(text)
        if self.request.message.sampling.HasField("logprobs"):
            parts = [self._prompt_logprobs(choice, msg)] if echo else []
            choice.logprobs.append(_joined([*parts, self._logprobs(choice, msg)]))
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = FINISH_REASONS.get(msg.finish_reason, "stop")
            choice.usage = msg.usage
        return text

    @property
    def usage(self) -> dict[str, Any] | None:
        """The request's usage once every choice finished: each prompt counted once, as OpenAI and vLLM count it
        (its first choice's count)."""
        if any(c.usage is None for c in self.choices):
            return None
        prompts = [c.usage for c in self.choices[:: self.request.n] if c.usage is not None]
        return usage(prompts, sum(c.usage.completion_tokens for c in self.choices if c.usage))

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The fields every object shares; `system_fingerprint` null, as OpenAI sends it when it has none."""
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.request.model}
        return head | {"system_fingerprint": None, "choices": choices}

    def whole(self) -> dict[str, Any]:
        """The non-streaming response."""
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            logprobs = _joined(c.logprobs) if c.logprobs else None
            if self.request.chat:
                message = {"role": "assistant", "content": text, "refusal": None}  # OpenAI's, null: none refused
                choice = {"index": c.index, "message": message, "logprobs": logprobs}
            else:
                choice = {"index": c.index, "text": text, "logprobs": logprobs}
            choices.append(choice | {"finish_reason": c.finish_reason})
        kind = "chat.completion" if self.request.chat else "text_completion"
        return self._object(kind, choices) | {"usage": self.usage}

    async def add_off_the_loop(self, index: int, msg: pb.GenerateResponse) -> None:
        """`add`, on a thread for a message with an echoed prompt's log probabilities: each alternative of each of its
        tokens is decoded, 0.1-0.2 s for 4000-8000 tokens with 20 each, which on the loop would stall every other stream
        of the router (it is Python: on a thread, the GIL comes back to the loop every 5 ms)."""
        if msg.prompt_logprobs:
            await asyncio.to_thread(self.add, index, msg)
        else:
            self.add(index, msg)

    async def whole_json(self) -> bytes:
        """The non-streaming response as JSON (Starlette's JSONResponse's encoding), each choice encoded on a turn of
        the loop of its own: 16 choices of an echoed 4000-token prompt with 20 alternatives a token made 28 MB, whose
        one `json.dumps` (which holds the GIL throughout) stalled the router's loop ~0.9 s."""
        whole = self.whole()
        choices = []
        for choice in whole["choices"]:
            choices.append(_json(choice))
            await asyncio.sleep(0)
        # No string in the rest holds an unescaped quote, so the first `"choices":[]` is the key's.
        before, key, after = _json(whole | {"choices": []}).partition(b'"choices":[]')
        return before + key[:-1] + b",".join(choices) + b"]" + after

    def chunk(self, index: int, msg: pb.GenerateResponse) -> dict[str, Any]:
        """One streamed message of choice `index` as a chunk; a choice's first chat chunk names the role."""
        first = not self.choices[index].text
        text = self.add(index, msg)
        c = self.choices[index]
        logprobs = c.logprobs[-1] if self.request.message.sampling.HasField("logprobs") else None
        if self.request.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice, kind = {"index": index, "delta": delta, "logprobs": logprobs}, "chat.completion.chunk"
        else:
            choice, kind = {"index": index, "text": text, "logprobs": logprobs}, "text_completion"
        chunk = self._object(kind, [choice | {"finish_reason": c.finish_reason}])
        return chunk | {"usage": None} if self.request.include_usage else chunk

    def _prompt_text(self, index: int) -> str:
        message = self.request.prompt_message(index)
        return message.prompt or self.tokenizer.decode(list(message.prompt_token_ids), skip_special_tokens=False)

    def _prompt_logprobs(self, choice: Choice, msg: pb.GenerateResponse) -> dict[str, list[Any]]:
        """The echoed prompt's tokens in the completions API's lists; the first has no log probability (null).
        A text prompt is tokenized again, as the router tokenized it."""
        message = self.request.prompt_message(choice.index)
        ids = list(message.prompt_token_ids) or self.tokenizer.encode_prompt(message.prompt)
        return self._legacy(choice, ids, [None, *msg.prompt_logprobs])

    def _logprobs(self, choice: Choice, msg: pb.GenerateResponse) -> dict[str, list[Any]]:
        """One message's tokens in OpenAI's shape: chat's `content` entries, or the completions API's parallel
        lists (as vLLM's: `top_logprobs` also holds the sampled token, `text_offset` counts the tokens' text)."""
        if self.request.chat:
            content = []
            for token, lp in zip(msg.token_ids, msg.logprobs, strict=True):
                top = [self._chat_entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
                content.append(self._chat_entry(token, lp.logprob) | {"top_logprobs": top})
            return {"content": content}
        return self._legacy(choice, list(msg.token_ids), list(msg.logprobs))

    def _legacy(
        self, choice: Choice, token_ids: list[int], logprobs: list[pb.TokenLogprobs | None]
    ) -> dict[str, list[Any]]:
        """The completions API's parallel lists; `None` (an echoed prompt's first token) is null."""
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [
                None if lp is None else self._top(token, lp) for token, lp in zip(tokens, logprobs, strict=True)
            ],
            "text_offset": offsets,
        }

    def _top(self, token: str, lp: pb.TokenLogprobs) -> dict[str, float]:
        """One token's alternatives keyed by their text, the token's own included. Tokens that decode alike (each
        byte of a split character is U+FFFD) share a key, which keeps the likeliest's value: the alternatives
        come most likely first, and the token itself, if not among them, is less likely than all of them."""
        top: dict[str, float] = {}
        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            top.setdefault(self._token_text(t), v)
        top.setdefault(token, lp.logprob)
        return top

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        """`bytes` are the token's own, which join with its neighbours' into a character split across them."""
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": self._token_text(token_id), "logprob": logprob, "bytes": None if raw is None else list(raw)}

    def usage_chunk(self) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, no choices, the whole request's usage."""
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        return self._object(kind, []) | {"usage": self.usage}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _joined(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Each message's log probabilities as one, for the whole (non-streaming) response."""
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}


def usage(prompts: list[pb.Usage], completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage from each prompt's (its first choice's), with the prompt tokens the prefix cache served and
    pdserve's server-side TTFT (the first choice's)."""
    prompt_tokens = sum(u.prompt_tokens for u in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in prompts)},
        "ttft_ms": round(prompts[0].ttft_ms, 3),
    }


async def sse_events(
    answer: Answer, stream: AsyncGenerator[tuple[int, pb.GenerateResponse], None]
) -> AsyncGenerator[bytes, None]:
    """Each choice's messages as they come, tagged with its index; `stream` closed however this ends."""
    async with aclosing(stream):
        async for index, msg in stream:
            yield event(answer.chunk(index, msg))
    if answer.request.include_usage:
        yield event(answer.usage_chunk())
    yield DONE_EVENT


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
