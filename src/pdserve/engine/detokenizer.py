"""Streams one request's output tokens as text: whole characters only, never any part of a stop string."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens decoded ahead of the first output token so it gets the spacing it has in context.
_PROMPT_CONTEXT = 5
# Tokens that may wait for the character they end: a UTF-8 character is at most 4 bytes, a byte token at least
# one. A longer run that still decodes to an unfinished character is invalid bytes, emitted as U+FFFD each;
# waiting on would redecode an ever longer window every step (a model looping on one stray byte token).
_MAX_WAITING_TOKENS = 8
_INCOMPLETE = "\ufffd"  # what a decode ends with when its last bytes are not a whole character


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, doing O(window) work per step.

    `tokenizers`' `DecodeStream` does the incremental decoding (the vLLM technique: decode a short window,
    emit what it adds, hold back a character still incomplete) in Rust, a fifth of the time the same steps
    took in Python per token. Decoded text waits in `_held` until no stop string can still begin in it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._max_partial_stop = max((len(s) for s in stop), default=1) - 1
        # Only the prompt's tail is context for the first output tokens; it is never emitted.
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # the last tokens whose text decoded
        self._waiting: list[int] = []  # tokens fed since then, their text not yet decodable
        self._stream = self._new_stream()
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
        for token in new_token_ids:  # one at a time: text before a character still incomplete goes out now
            text = self._stream.step(self._tokenizer, token)
            self._waiting.append(token)
            if text is not None:
                self._held += text
                self._context = (self._context + self._waiting)[-_PROMPT_CONTEXT:]
                self._waiting = []
            elif len(self._waiting) > _MAX_WAITING_TOKENS:
                self._held += self._decode_waiting()
        return self._release(final=False)

    def _decode_waiting(self) -> str:
        """The waiting tokens' text, invalid bytes as U+FFFD. The stream starts again after them from the same
        context: tokens whose text decoded, which a stream can start from (it could not from invalid bytes)."""
        decode = self._tokenizer.decode
        before = decode(self._context, skip_special_tokens=self._skip_special_tokens)
        text = decode(self._context + self._waiting, skip_special_tokens=self._skip_special_tokens)
        self._waiting = []
        self._stream = self._new_stream()
        return text[len(before) :] if text.startswith(before) else text

    def _new_stream(self) -> DecodeStream:
        """A stream after `_context`. DecodeStream counts its context's text as emitted only when that text ends
        in a whole character, so a context ending inside one (a prompt of token ids can) is cut back to where
        it does; otherwise the first delta would repeat the prompt's tail."""
        skip = self._skip_special_tokens
        while self._context and self._tokenizer.decode(self._context, skip_special_tokens=skip).endswith(_INCOMPLETE):
            self._context = self._context[:-1]
        return DecodeStream(ids=self._context, skip_special_tokens=self._skip_special_tokens)

    def flush(self) -> str:
        """At finish (length or EOS): release the held-back text.

        An incomplete multi-byte character at the very end is dropped rather than emitted as "\ufffd":
        it is not a character the model produced. Whole characters the waiting tokens hold before it (a byte-level
        token may carry a space and the first bytes of an emoji) are kept, and a stop string may end in them.
        """
        if self.stopped:
            return ""
        if self._waiting:
            self._held += self._decode_waiting().rstrip(_INCOMPLETE)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        """Emit held text up to a stop string, or up to what could still start one."""
        held = self._held
        if not self._stop:  # the common case, once per token: nothing to hold back
            self._held = ""
            if held:
                self._emitted.append(held)
            return held
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
