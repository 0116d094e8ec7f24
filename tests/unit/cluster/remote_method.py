"""A stand-in for a Ray actor method: `.remote()` returns an awaitable, answered on the test's loop; `.options(...)`
records the call options each call carried, as Ray's method handle takes them."""

from __future__ import annotations

import asyncio
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


async def call_on_loop(method: Any, *args: Any, timeout_s: float, task_events: bool = True) -> Any:
    """The supervision's `call` over stand-ins, whose answers are coroutines of the test's loop (with Ray,
    `actor_calls.answer` makes the call on a thread of its own): the same options, the same timeout."""
    if not task_events:
        method = method.options(enable_task_events=False)
    return await asyncio.wait_for(method.remote(*args), timeout_s)
