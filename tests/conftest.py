"""What every test leaves as it found it: the process environment."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator

import pytest


def _restore(saved: dict[str, str]) -> None:
    for name in [n for n in os.environ if n not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True, scope="module")
def _environment_as_found_by_the_module() -> Iterator[None]:
    """A module's own fixtures (a cluster it starts) may set variables for its tests; the next module sees none."""
    saved = dict(os.environ)
    yield
    _restore(saved)


@pytest.fixture(autouse=True)
def _environment_as_found() -> Iterator[None]:
    """Code run in-process (`pdserve up`, a worker) writes the environment as a process of its own would (the
    cluster secret it made, Ray's settings): twice such a write reached a later module's test in the same pytest
    worker and failed it there, far from its cause."""
    saved = dict(os.environ)
    yield
    _restore(saved)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failure's report parses the test's source (`ast.parse`); under CPython 3.11 that raises SystemError when
    another thread parses at the same moment (a traceback formatted by a cluster's thread: CPython gh-106905), and
    the pytest-xdist worker crashes, ending the whole run without saying what failed. The report is made again."""
    try:
        return (yield)
    except SystemError:
        return pytest.TestReport.from_item_and_call(item, call)
