"""The model folder's tokenizer and chat template, behind the few calls the engine and router make.

One class for both, torch-free: the `tokenizers` library reads tokenizer.json, and the chat template is
rendered with jinja2 the way transformers renders it (sandboxed, trim_blocks and lstrip_blocks, its
`tojson`, `raise_exception` and `strftime_now`, the special tokens as variables), so the router and the
engine produce the same ids transformers would, without importing transformers (which imports torch).

One deliberate difference: message content is tokenized as text. Transformers renders the template with the
content inside and parses special tokens across the whole string, so a user who writes `<|im_start|>system`
in a message injects a real system turn. Here the template is rendered with a random placeholder per message,
the template's own text is tokenized with special tokens parsed, and each content with them split as text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

from pdserve.engine.byte_tokenizer import byte_level_bytes
from pdserve.engine.model_files import damaged, unreadable
from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import chat_role, check_role

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_FALLBACK = re.compile("<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json: pdserve reads fast (tokenizers) tokenizers")
        if error := unreadable(path):
            raise error
        self._tok = _read_tokenizer(path)
        self._text_tok = _read_tokenizer(path)  # a second instance: the flag is per object
        self._text_tok.encode_special_tokens = True  # special-token text in content stays text
        self._added = self._tok.get_added_tokens_decoder()
        self._specials = [t.content for t in self._added.values() if t.special]
        settings = _tokenizer_settings(folder)
        self.special_tokens = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(settings.get(n))) is not None}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos is not None else None
        template = _chat_template(folder, settings)
        self._template = _compile(template) if template else None

    @functools.cached_property
    def digest(self) -> str:
        """Its vocabulary's digest (`_vocabulary_digest`), computed once when first asked (~0.1 s for 49k tokens)."""
        return _vocabulary_digest(self._tok)

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` object itself, for what streams through it (`IncrementalDetokenizer`)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Raw text, without added special tokens (the chat template adds its own). Through `encode_batch`,
        which releases the GIL while it works (`encode` holds it), so a router that tokenizes a long prompt on
        a thread keeps serving its other streams meanwhile."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw text prompt, with the special tokens the tokenizer's post-processor adds (a BOS, for models that
        have one), as transformers' `tokenizer(text)` and vLLM's completions API tokenize it."""
        return self._tok.encode_batch([text], add_special_tokens=True)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """Like `encode`, but special-token text (`<|im_start|>`) is split like any other text, never a control
        token: how untrusted content is tokenized."""
        return self._text_tok.encode_batch([text], add_special_tokens=False)[0].ids

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> list[int]:
        """(role, content) pairs -> the prompt ids, ending with the assistant's turn opener. Content holding
        special-token text is tokenized as text (`encode_text`), apart from the template around it; otherwise
        the rendered string is tokenized whole, exactly as transformers does (splitting there would change how
        whitespace at a content's edge merges)."""
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        for i, (role, _) in enumerate(messages):
            check_role(i, role)
        messages = [(chat_role(role), content) for role, content in messages]
        if self._template is None:
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt instead")
        if not any(s in content for _, content in messages for s in self._specials):
            return self.encode(self._render(messages))  # as transformers does: one string, one tokenization
        marker = f"\ue000{secrets.token_hex(8)}"  # unguessable, so content cannot forge a placeholder
        text = self._render([(r, f"{marker}{i}\ue001") for i, (r, _) in enumerate(messages)])
        ids: list[int] = []
        for n, part in enumerate(re.split(f"{marker}(\\d+)\ue001", text)):
            if n % 2:  # a placeholder's message index
                ids += self.encode_text(messages[int(part)][1])
            elif part:
                ids += self.encode(part)
        return ids

    def _render(self, messages: list[tuple[str, str]]) -> str:
        assert self._template is not None
        messages_ = [{"role": r, "content": c} for r, c in messages]
        # tools and documents as transformers passes them when a caller gives none: None, not undefined (a
        # template's `is not none` and `is defined` tests tell the two apart)
        return self._template.render(
            messages=messages_, add_generation_prompt=True, tools=None, documents=None, **self.special_tokens
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for (OpenAI's logprobs `bytes`): a byte-level token may hold part of a
        character, which its decoded text ("\ufffd") loses. None when the tokenizer cannot say."""
        if (added := self._added.get(token_id)) is not None:
            return added.content.encode()
        token = self._tok.id_to_token(token_id)
        if token is None:
            return None
        if isinstance(self._tok.decoder, decoders.ByteLevel):
            return byte_level_bytes(token)
        if fallback := _BYTE_FALLBACK.fullmatch(token):  # sentencepiece's byte tokens
            return bytes([int(fallback[1], 16)])
        text = self._tok.decode([token_id], skip_special_tokens=False)
        return None if "\ufffd" in text else text.encode()


def _vocabulary_digest(tok: _HFTokenizer) -> str:
    """What routers compare with a worker's before placing a prompt they tokenized there: its ids mean the same text
    only to a worker of the same vocabulary (a model of another rolled out under routers still running the old one).
    Every token and its id, not the file's bytes: nodes of two builds may write one vocabulary's tokenizer.json
    differently (a model cache converted by another `tokenizers`)."""
    vocabulary = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda token_id: token_id[1])
    return hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode()).hexdigest()[:16]


def _read_tokenizer(path: Path) -> _HFTokenizer:
    """tokenizers says what is wrong with a cut or overwritten file (its JSON error) but not which file."""
    try:
        return _HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise damaged(path, str(e)) from None


def _tokenizer_settings(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json (older folders) filling what it lacks."""
    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).exists():
            settings.update(json.loads((folder / name).read_text()))
    return settings


def _token_text(token: Any) -> str | None:
    """A special token is written as its text or, by older transformers, as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: Path, settings: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5) or tokenizer_config.json's chat_template (4.x: a string, or a list
    of named templates of which "default" is the one used for chat)."""
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _compile(template: str) -> jinja2.Template:
    """Chat templates come from model folders, so they are untrusted code: rendered in jinja2's sandbox."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """jinja2's own tojson escapes HTML characters, which would change the prompt."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    """Templates call this to refuse a conversation they cannot format (e.g. roles out of order)."""
    raise InvalidRequestError("messages", message)
