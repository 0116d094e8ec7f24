"""Request start times cross threads: the engine thread marks and trims them, callers on the loop take them."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterator

from pdserve.engine import start_times
from pdserve.engine.start_times import KEPT, StartTimes


def test_a_time_is_taken_once_and_a_later_mark_keeps_the_first():
    times = StartTimes()
    times.mark(["a"], 1)
    times.mark(["a", "b"], 2)
    assert (times.take("a"), times.take("a"), times.take("b"), times.take("never")) == (1, None, 2, None)


def test_a_taken_start_is_not_marked_again_while_its_stream_runs_and_an_ended_streams_id_starts_anew():
    """The engine thread marks every running request each step: a decode stream's start, once taken, came back
    each step after, for nobody to take (a decode worker's map grew to KEPT)."""
    times = StartTimes()
    times.mark(["a", "b"], 1)
    assert times.take("a") == 1
    times.mark(["a", "b"], 2)
    assert times.take("a") is None
    times.stream_ended("a")
    times.stream_ended("b")
    assert times.take("b") == 1  # a start taken once its stream ended (a prefill's caller takes it after)
    assert times._ns == {} and times._marked == {}
    times.mark(["a"], 3)  # an id used again by a later stream
    assert times.take("a") == 3


def test_past_the_kept_count_the_oldest_are_forgotten():
    times = StartTimes()
    times.mark((f"r{i}" for i in range(KEPT + 2)), 5)
    assert times.take("r0") is None and times.take("r1") is None
    assert times.take("r2") == 5 and times.take(f"r{KEPT + 1}") == 5


def test_a_take_of_the_very_time_being_trimmed_waits_for_the_trim(monkeypatch):
    """Forces the interleaving a thread switch can make: a caller takes the oldest time between the engine
    thread's finding it and forgetting it. Unguarded, the engine thread's pop raised KeyError, which kills it."""
    times = StartTimes()
    times.mark((f"old{i}" for i in range(KEPT)), 1)
    taken: list[int | None] = []
    takers: list[threading.Thread] = []

    def oldest_then_taken(keys: Iterator[str]) -> str:
        oldest = builtins.next(keys)
        taker = threading.Thread(target=lambda: taken.append(times.take(oldest)))
        takers.append(taker)
        taker.start()
        taker.join(0.2)  # the caller's take runs now, if nothing holds it back
        return oldest

    monkeypatch.setattr(start_times, "next", oldest_then_taken, raising=False)
    times.mark(["new"], 2)
    takers[0].join(5)
    assert taken == [None]  # it waited for the trim, and found that time forgotten
    assert times.take("new") == 2
