"""FreeRuns against a bitmap: after any sequence of takes and gives, its runs are the bitmap's maximal runs and
its best fit is the bitmap scan's (the shortest run that holds the request, else the longest, lowest first)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.free_runs import FreeRuns

NUM_BLOCKS = 40


def _bitmap_runs(free: np.ndarray) -> list[tuple[int, int]]:
    edges = np.diff(np.concatenate(([0], free.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _bitmap_best_fit(free: np.ndarray, count: int) -> tuple[int, int]:
    runs = _bitmap_runs(free)
    fits = [(length, start) for start, length in runs if length >= count]
    if fits:
        return min(fits)[1], count
    length, start = min((-length, start) for start, length in runs)
    return start, -length


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.sets(st.integers(0, NUM_BLOCKS - 1), max_size=12)), max_size=30))
def test_runs_and_best_fit_match_a_bitmap(ops: list[tuple[bool, set[int]]]) -> None:
    runs = FreeRuns(NUM_BLOCKS)
    free = np.ones(NUM_BLOCKS, dtype=bool)
    for take, blocks in ops:
        chosen = sorted(b for b in blocks if free[b] == take)  # take only free blocks, give only used ones
        (runs.take if take else runs.give)(chosen)
        free[chosen] = not take
        assert runs.runs() == _bitmap_runs(free)
        assert runs.count == int(free.sum())
        assert all((b in runs) == bool(free[b]) for b in range(NUM_BLOCKS))
        if free.any():
            for count in (1, 2, 5, NUM_BLOCKS):
                assert runs.best_fit(count) == _bitmap_best_fit(free, count)


def test_taking_a_used_block_or_giving_a_free_one_is_refused() -> None:
    runs = FreeRuns(8)
    runs.take([2, 3])
    with pytest.raises(ValueError, match="not all free"):
        runs.take([3])
    with pytest.raises(ValueError, match="not all in use"):
        runs.give([3, 4])
    assert runs.runs() == [(0, 2), (4, 4)]
