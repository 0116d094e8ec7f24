"""A stand-in for a Ray actor method: `.remote()` returns an awaitable, as a Ray ObjectRef is; `.options(...)`
records the call options each call carried, as Ray's method handle takes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RemoteMethod:
    def __init__(self, answer: Callable[[], Any]) -> None:
        self.answer = answer
        self.calls: list[dict[str, Any]] = []  # each call's options

    def options(self, **options: Any) -> _WithOptions:
        return _WithOptions(self, options)

    def remote(self) -> Any:
        self.calls.append({})
        return self.answer()


class _WithOptions:
    def __init__(self, method: RemoteMethod, options: dict[str, Any]) -> None:
        self.method, self.options = method, options

    def remote(self) -> Any:
        self.method.calls.append(self.options)
        return self.method.answer()
