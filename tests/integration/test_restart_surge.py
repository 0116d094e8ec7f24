"""`pdserve restart` of a real 1 prefill + 1 decode cluster (tiny-random, the router's defaults) under steady load:
each role's only worker is surged (its role scaled up by one, the new worker serving, before it drains; scaled
back after), so no request meets a role without a worker. In place, a user's review lost 4 of 120 requests to
that gap (`no workers to serve: 0 prefill, 2 decode live` after the router's 3 s wait)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pdserve.cluster.local_process import ClusterProcess
from tests.integration.reference import PROMPT, greedy
from tests.integration.steady_load import assert_all_served, steady_load
from tests.integration.worker_view import workers

pytestmark = pytest.mark.timeout(600)
LOAD_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("restart-surge") / "cluster.log"
    proc = ClusterProcess(
        "--model", "tiny-random", "--kv-cache-gb", "0.05", "--prefill", "1", "--decode", "1", log_path=log
    )
    yield proc
    proc.stop()


async def restart(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.cli",
        "restart",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


def test_a_rolling_restart_surges_each_roles_only_worker_and_loses_no_request(cluster):
    async def run() -> None:
        before = {w.id: w.address for w in await workers(cluster.address)}
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(cluster.address, stop, 4, "load-", PROMPT, LOAD_TOKENS))
        code, out = await restart("--addr", cluster.address, "--timeout", "5")
        stop.set()
        outcomes = await load
        print(out)
        assert code == 0, out
        assert out.count("is the only") == 2 and out.count("scaled back to 1 ") == 2, out
        assert_all_served(outcomes, greedy(PROMPT, LOAD_TOKENS))
        after = await workers(cluster.address)
        assert sorted(w.role for w in after) == ["decode", "prefill"], after  # back to 1P:1D
        assert not {w.address for w in after} & set(before.values())  # every process a new one
        print(f"{len(outcomes)} requests during the rolling restart, all served")

    asyncio.run(run())
