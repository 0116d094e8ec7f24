from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chart import helm_binary, render

EXAMPLE_FILES = ("gpu.yaml", "cpu-small.yaml", "external-redis-tls-monitoring.yaml")


@pytest.fixture(scope="session", autouse=True)
def _helm() -> None:
    if helm_binary() is None:
        pytest.skip("the helm binary could not be fetched (scripts/fetch_helm.py; `make helm`)")


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Each example values file's objects, rendered once per session."""
    return {name: render([name]) for name in EXAMPLE_FILES}
