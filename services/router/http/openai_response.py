"""The shared path's GenerateResponse stream -> OpenAI's response objects: one whole completion, or the chunks of
a Server-Sent Events stream (`data: {json}` per event, then `data: [DONE]`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.v1 import generate_pb2 as pb
from services.router.http.openai_request import OpenAIRequest

# OpenAI has "stop" and "length"; the end-of-sequence token is a stop too.
FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop"}


@dataclass
class Answer:
    """What the OpenAI objects of one request share, and the text and usage gathered so far."""

    request: OpenAIRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        self.text.append(msg.text)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "stop")
            self.usage = usage(msg.usage)

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.request.model, "choices": choices}

    def whole(self) -> dict[str, Any]:
        """The non-streaming response."""
        text = "".join(self.text)
        if self.request.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            kind = "chat.completion"
        else:
            choice, kind = {"index": 0, "text": text, "logprobs": None}, "text_completion"
        return self._object(kind, [choice | {"finish_reason": self.finish_reason}]) | {"usage": self.usage}

    def chunk(self, msg: pb.GenerateResponse, first: bool) -> dict[str, Any]:
        """One streamed message as a chunk; the first chat chunk names the assistant's role."""
        self.add(msg)
        if self.request.chat:
            delta = {"role": "assistant", "content": msg.text} if first else {"content": msg.text}
            choice, kind = {"index": 0, "delta": delta}, "chat.completion.chunk"
        else:
            choice, kind = {"index": 0, "text": msg.text, "logprobs": None}, "text_completion"
        chunk = self._object(kind, [choice | {"finish_reason": self.finish_reason}])
        return chunk | {"usage": None} if self.request.include_usage else chunk

    def usage_chunk(self) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, no choices, the whole request's usage."""
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        return self._object(kind, []) | {"usage": self.usage}


def usage(u: pb.Usage) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the prefix cache served and pdserve's server-side TTFT."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "ttft_ms": round(u.ttft_ms, 3),
    }


async def sse_events(answer: Answer, stream: AsyncIterator[pb.GenerateResponse]) -> AsyncIterator[bytes]:
    first = True
    async for msg in stream:
        yield event(answer.chunk(msg, first))
        first = False
    if answer.request.include_usage:
        yield event(answer.usage_chunk())
    yield b"data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
