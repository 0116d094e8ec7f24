"""Fixtures several integration modules share: the greedy reference answer and an OTLP trace receiver."""

from __future__ import annotations

import pytest

from tests.integration.cluster_view import serving_collector
from tests.integration.reference import MAX_TOKENS, PROMPT, greedy


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """What the single-process engine answers to `reference.request`: a healthy cluster must match it."""
    return greedy(PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def collector():
    """Every span the cluster exports (OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{collector.port})."""
    with serving_collector() as c:
        yield c
