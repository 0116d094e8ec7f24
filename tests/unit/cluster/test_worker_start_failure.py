"""A worker whose start fails says why to whoever waits for it, at once, and stays out of placement; it never
leaves its launcher waiting. (Under Ray it then exits for a restart: tests/integration/test_self_healing.py.)"""

from __future__ import annotations

import pytest

from pdserve.cluster.worker_runtime import WorkerRuntime, WorkerUnavailableError
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.protocol.roles import Role

pytestmark = pytest.mark.timeout(60)


def test_a_failed_start_is_reported_with_its_reason_and_the_worker_stays_unavailable(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    spec = WorkerSpec(Role.DECODE, EngineConfig(model=str(missing), device="cpu"), metrics_port=None)
    worker = WorkerRuntime(spec, lambda ctx: None)
    with pytest.raises(Exception) as err:
        worker.wait_ready(timeout_s=30)
    assert not isinstance(err.value, TimeoutError)
    assert "no-such-model" in str(err.value)
    with pytest.raises(WorkerUnavailableError):
        worker.state()
    worker.stop()
