"""What only the whole fleet can serve is never answered as impossible while one of its workers is out of the
registry: through a real `pdserve up --http-port` (1 prefill + 2 decode, tiny-random, 26 KV blocks a worker), a
request of n=3 choices, two of which a decode worker holds, while the other decode worker is SIGSTOPped (its
supervisor unlists it as stuck, as it unlists a dead one until its restart serves). A soak found it answered 400
(`invalid_request_error`, param `n`: never retry) for each such restart; the same request succeeded once the
worker was back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import suppress

import httpx2
import pytest

from pdserve.cluster.local_process import ClusterProcess
from tests.integration.openai_cluster import MODEL, http_cluster
from tests.integration.worker_view import pid_serving, workers

pytestmark = pytest.mark.timeout(300)
BLOCKS = 26
# 100 + 100 tokens are 13 blocks of 16: a decode worker holds two such choices at once, the two of them four.
BODY = {"model": MODEL, "prompt": [3 + i % 250 for i in range(100)], "max_tokens": 100, "n": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ClusterProcess]:
    log = tmp_path_factory.mktemp("offer") / "cluster.log"
    with http_cluster(log, "--decode", "2", "--kv-cache-gb", str(BLOCKS * 8192 / 2**30)) as proc:
        yield proc


def decode_workers(cluster: ClusterProcess) -> list:
    return [w for w in asyncio.run(workers(cluster.address)) if w.role == "decode"]


def until(check, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_choices_the_whole_fleet_holds_are_shed_not_invalid_while_a_decode_worker_is_out(cluster):
    with httpx2.Client(base_url=cluster.base_url, timeout=120) as http:
        served = http.post("/completions", json=BODY)
        assert served.status_code == 200 and len(served.json()["choices"]) == 3, served.text
        until(lambda: len(decode_workers(cluster)) == 2, 30, "both decode workers listed")
        pid = pid_serving(decode_workers(cluster)[0].address)
        os.kill(pid, signal.SIGSTOP)
        try:
            until(lambda: len(decode_workers(cluster)) == 1, 60, "the stopped worker to be unlisted")
            out = http.post("/completions", json=BODY)
        finally:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        # The offer keeps the worker: a retry may succeed. Or the router's wait for a place outlasts the first two
        # choices on the worker left, and the third takes their blocks: served whole, as a retry would be.
        assert out.status_code in (200, 429, 503), out.text
        if out.status_code == 200:
            assert len(out.json()["choices"]) == 3, out.text
        if out.status_code == 429:
            assert out.headers["retry-after-ms"], out.headers
        until(lambda: len(decode_workers(cluster)) == 2, 60, "the worker back in the registry")
        again = http.post("/completions", json=BODY)
        assert again.status_code == 200 and len(again.json()["choices"]) == 3, again.text
