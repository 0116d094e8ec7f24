"""A store call a stopped peer cannot hold past its deadline. A stopped (or hung) decode process's kernel still
accepts connections and takes requests into its socket buffer; TCPStore's first ping, and a `check` on a
connected store, then wait for an answer with no timeout of their own, holding whatever the caller holds (a
prefill worker: the prompt's KV blocks) as long as the stop lasts. The call runs on a daemon thread of its own,
which ends once the peer answers, resumes or dies."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class StoreSilent(TimeoutError):
    """The peer's store gave no answer in time."""


def started(call: Callable[[], T], name: str) -> Future[T]:
    """`call()` running on a daemon thread of its own; its outcome once it returns."""
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            outcome.set_result(call())
        except BaseException as e:  # handed to the caller, if it still waits
            outcome.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return outcome


def answer(outcome: Future[T], timeout_s: float) -> T:
    """The call's result or exception, or StoreSilent after `timeout_s` (the call goes on)."""
    try:
        return outcome.result(timeout=max(timeout_s, 0.001))
    except TimeoutError:
        if outcome.done():  # the call's own TimeoutError
            raise
        raise StoreSilent(f"no answer within {timeout_s:.3g} s") from None


def within(call: Callable[[], T], timeout_s: float, name: str) -> T:
    """`call()`'s result or exception, or StoreSilent after `timeout_s`."""
    return answer(started(call, name), timeout_s)
