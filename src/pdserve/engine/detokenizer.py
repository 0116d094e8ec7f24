"""Streams one request's output tokens as text: whole characters only, never any part of a stop string."""

from __future__ import annotations

from typing import Protocol

# Trailing replacement char: the last tokens end inside a multi-byte character (or are invalid UTF-8).
_INCOMPLETE = "\ufffd"
# Prompt tokens decoded ahead of the first output token so it gets the spacing it has in context.
_PROMPT_CONTEXT = 5


class Decoder(Protocol):
    """What the detokenizer needs; `tokenizers.Tokenizer` and transformers tokenizers both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, doing O(window) work per step.

    Each step decodes only the tokens from `prefix_offset` on and emits what they add beyond the
    already-emitted tokens between `prefix_offset` and `read_offset` (the vLLM technique). Decoded text
    waits in `_held` until no stop string can still begin in it.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._max_partial_stop = max((len(s) for s in stop), default=1) - 1
        # Only the prompt's tail is kept: it is context for the first output tokens, never emitted.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""
        self._emitted: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far; after `flush`, the final output text."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def step(self, new_token_ids: list[int]) -> str:
        """Append sampled tokens; return the text now safe to emit (maybe "").

        A stop string sets `stopped`; later tokens are ignored and the engine should finish with STOP.
        """
        if self.stopped:
            return ""
        self._ids.extend(new_token_ids)
        self._held += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At finish (length or EOS): release the held-back text.

        An incomplete multi-byte character at the very end is dropped rather than emitted as "\\ufffd":
        it is not a character the model produced. (A genuine U+FFFD as the last character is lost too;
        the decoded text cannot tell the two apart.)
        """
        if self.stopped:
            return ""
        self._held += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        read_from = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read_from])
        new_text = self._decode(window)
        if final:
            new_text = new_text.rstrip(_INCOMPLETE)
        elif new_text.endswith(_INCOMPLETE):
            return ""
        # No growth: e.g. a skipped special token; keep the window until real text arrives.
        if len(new_text) <= len(prefix_text):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, final: bool) -> str:
        """Emit held text up to a stop string, or up to what could still start one."""
        held = self._held
        stop_at = self._find_stop(held)
        if stop_at is not None:
            self.stopped = True
            keep = 0
            held = held[:stop_at]
        elif final:
            keep = 0
        else:
            keep = self._partial_stop_len(held)
        out = held[: len(held) - keep]
        self._held = held[len(held) - keep :]
        if out:
            self._emitted.append(out)
        return out

    def _find_stop(self, text: str) -> int | None:
        """Earliest stop-string start in `text`; held text is the only place a new one can be."""
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits, default=None)

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_partial_stop), 0, -1):
            tail = text[-length:]
            if any(len(s) > length and s.startswith(tail) for s in self._stop):
                return length
        return 0
