"""Engines built here set torch's thread count (one: much faster for the tiny model); each test module leaves it
as it found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Leaves torch's thread count as the module found it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
