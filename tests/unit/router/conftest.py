"""Fixtures the router's unit tests share."""

from __future__ import annotations

import pytest

from services.router import kv_claims


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """time.monotonic, which kv_claims and retry_pacing read, moved by hand (`clock[0] += s`)."""
    now = [1000.0]
    monkeypatch.setattr(kv_claims.time, "monotonic", lambda: now[0])
    return now
