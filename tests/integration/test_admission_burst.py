"""A burst far beyond capacity on the real model: some requests admitted, the rest shed at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.local_process import ClusterProcess

pytestmark = [pytest.mark.slow, pytest.mark.latency, pytest.mark.timeout(600)]
BURST, PROMPT_TOKENS, TTFT_SLO_MS = 100, 500, 3000.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("burst") / "cluster.log"
    proc = ClusterProcess(
        "--model", "smollm2-135m", "--mode", "disaggregated", "--prefill", "1", "--decode", "1", log_path=log
    )
    yield proc
    proc.stop()


def test_burst_admits_what_fits_and_sheds_the_rest_fast(cluster):
    cmd = [sys.executable, "-m", "tests.integration.burst_client", cluster.address, str(BURST), str(PROMPT_TOKENS)]
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([*cmd, str(TTFT_SLO_MS)], cwd=root, capture_output=True, text=True, timeout=300, check=True)
    results = json.loads(out.stdout)
    admitted = [r["seconds"] for r in results if r["status"] == "ok"]
    shed = [(r["seconds"], r["meta"]) for r in results if r["status"] == "RESOURCE_EXHAUSTED"]
    others = [r["status"] for r in results if r["status"] not in ("ok", "RESOURCE_EXHAUSTED")]
    assert not others, others
    assert admitted and shed, f"admitted {len(admitted)}, shed {len(shed)}"
    print(
        f"admitted {len(admitted)}, shed {len(shed)}, TTFTs {sorted(round(t, 2) for t in admitted)}, "
        f"slowest rejection {max(t for t, _ in shed) * 1e3:.0f} ms"
    )
    assert max(t for t, _ in shed) < 0.2
    assert all(int(meta["grpc-retry-pushback-ms"]) >= 100 for _, meta in shed)
    met = sum(t <= TTFT_SLO_MS / 1e3 for t in admitted)
    assert met >= 0.95 * len(admitted), sorted(admitted)
