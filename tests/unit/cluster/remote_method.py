"""A stand-in for a Ray actor method: `.remote()` returns an awaitable, as a Ray ObjectRef is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RemoteMethod:
    def __init__(self, answer: Callable[[], Any]) -> None:
        self.answer = answer

    def remote(self) -> Any:
        return self.answer()
