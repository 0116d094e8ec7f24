"""What every unit test leaves as it found it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _root_logger_as_found() -> Iterator[None]:
    """A command run under test (`pdserve up`, `chaos`) configures logging: its handler writes to this test's
    captured stderr, closed once the test ends, and its INFO level would let later tests' caplog see records
    they did not ask for. Both go; pytest's own capture handlers are its business."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        root.removeHandler(handler)
    root.setLevel(level)
