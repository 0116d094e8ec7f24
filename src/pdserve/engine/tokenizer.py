"""The model folder's tokenizer and chat template, behind the few calls the engine and router make."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from pdserve.errors import InvalidRequestError
from pdserve.protocol.request_checks import CHAT_ROLES


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        self._tok = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_id: int | None = self._tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Raw text, without added special tokens (the chat template adds its own)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> list[int]:
        """(role, content) pairs -> the prompt ids, ending with the assistant's turn opener."""
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        for i, (role, _) in enumerate(messages):
            if role not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"unknown role {role!r}; use one of {CHAT_ROLES}")
        if not self._tok.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt instead")
        text = self._tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
        )
        return self.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
