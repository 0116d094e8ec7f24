"""A KV transfer that fails mid-way (a stalled or killed prefill worker, a killed decode worker) through a real
`pdserve up`: the client gets a clear status at once, the KV blocks are freed on both sides, and the cluster serves
the next request.

A tiny-random transfer takes well under a millisecond, so the prefill worker is made to stall between the first
token and the KV send with the PDSERVE_FAULT_* knobs (`pdserve.env.fault_config`), for faulted request ids only.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from pdserve.cluster.local_process import ClusterProcess
from pdserve.config import RouterConfig
from pdserve.metrics import KV_TRANSFER_FAILURE_REASONS
from pdserve.rpc.client import generate
from pdserve.rpc.server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from pdserve.v1 import generate_pb2 as pb
from tests.integration.cluster_view import scrape, total
from tests.integration.reference import request
from tests.integration.worker_view import by_role, idle, pid_serving

pytestmark = pytest.mark.timeout(420)
# Ray's restart of a SIGKILLed actor, its model's load and warm-up: tens of seconds on a busy 2-core machine, where
# CI once missed 60 s.
RESTART_S = 180
TRANSFER_TIMEOUT_S = 8.0
SEND_DELAY_S = 30.0  # the stall: far past the transfer timeout, so the two outcomes cannot be confused
FAULTED = "fault-"  # request ids starting with this stall; the others run normally


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("transfer-faults") / "cluster.log"
    args = ["--model", "tiny-random", "--kv-cache-gb", "0.05", "--mode", "disaggregated", "--prefill", "1"]
    args += ["--decode", "1", "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S)]
    args += ["--stall-timeout-s", str(2 * SEND_DELAY_S)]  # the decode side's transfer timeout ends a stall here
    faults = {"PDSERVE_FAULT_KV_SEND_DELAY_S": str(SEND_DELAY_S), "PDSERVE_FAULT_REQUEST_ID_PREFIX": FAULTED}
    proc = ClusterProcess(*args, log_path=log, env=faults)
    yield proc
    proc.stop()


async def tokens(address: str, req: pb.GenerateRequest, timeout_s: float | None = 30.0) -> list[int]:
    result = None
    async for _, result in generate(address, req, timeout_s):  # noqa: B007 (the last one is the answer)
        pass
    assert result is not None and result.finish_reason == "length"
    return result.token_ids


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.05) -> None:
    """Polls `check` until it holds; fails the test when it does not within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"{check.__name__} did not hold within {timeout_s}s")
        await asyncio.sleep(interval_s)


async def blocks_freed(router: str, roles: tuple[str, ...] = ("prefill", "decode"), within_s: float = 0.0) -> None:
    """Every worker in `roles` soon holds no KV block for a live sequence or transfer (the prefix cache may keep
    some); by default within the transfer timeout, which ends even a receive whose bytes already flowed."""
    end = time.monotonic() + (within_s or TRANSFER_TIMEOUT_S + 10)
    while True:
        got = {role: w for role, w in (await by_role(router)).items() if role in roles}
        if len(got) == len(roles) and all(idle(w) for w in got.values()):
            return
        if time.monotonic() > end:
            raise AssertionError(f"KV blocks still held: {got}")
        await asyncio.sleep(0.1)


async def transfer_failures(router: str) -> dict[str, float]:
    """The decode worker's pdserve_kv_transfer_failures_total, by reason."""
    samples = scrape(f"http://{(await by_role(router))['decode'].metrics_address}/metrics")
    return {r: total(samples, "pdserve_kv_transfer_failures_total", reason=r) for r in KV_TRANSFER_FAILURE_REASONS}


def plus(counts: dict[str, float], reason: str, n: int) -> dict[str, float]:
    return {**counts, reason: counts[reason] + n}


def stalled_after_first_token(router: str) -> Callable[[], Awaitable[bool]]:
    async def stalled_after_first_token() -> bool:
        # The prompt ran (nothing left to schedule) and its blocks wait for the hand-off: the worker stalls.
        w = (await by_role(router))["prefill"]
        return w.kv_blocks_used > 0 and w.running == 0 and w.waiting == 0

    return stalled_after_first_token


def first_failure(log: str, request_id: str) -> tuple[float, str, bool]:
    """When the router's log first says the request failed (epoch seconds), why, and whether it was placed again."""
    for line in log.splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        retried = record.get("msg", "").startswith("request placed again")
        if record.get("request_id") == request_id and (retried or record["msg"].startswith("request failed:")):
            at = datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()
            return at, record.get("error", record["msg"]), retried
    raise AssertionError(f"the router logged no failure of {request_id}")


def test_killed_prefill_worker_fails_the_request_at_once_and_ray_restarts_it(cluster, expected):
    """First in the module: the prefill worker has never sent to the decode worker, so the decode side's receive
    waits on a pair that will never connect, and only the lost Prefill stream can end the attempt early. Where Ray
    restarts the worker within the router's wait for one (a quiet host: ~2 s), the router places the request there
    again, and the fault, the request id's, stalls that attempt too: the first attempt's end is checked in the
    router's log (the caller's answer alone failed every run on a quiet host)."""

    async def run() -> None:
        prefill = (await by_role(cluster.address))["prefill"]
        prefill_address = prefill.address
        pid = pid_serving(prefill_address)
        failures = await transfer_failures(cluster.address)
        start = time.monotonic()
        call = asyncio.create_task(tokens(cluster.address, request(f"{FAULTED}kill")))

        await until(stalled_after_first_token(cluster.address), timeout_s=5)
        # Within the stall's seconds: let the first token reach the decode worker, which then waits for the KV.
        await asyncio.sleep(0.3)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        failed_after = time.monotonic() - start
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        # The lost peer ends the attempt, not the transfer timeout (which counts from the first token).
        at, why, retried = first_failure(cluster.log(), f"{FAULTED}kill")
        assert at - killed_at < TRANSFER_TIMEOUT_S and f"prefill worker {prefill_address}" in why, (at - killed_at, why)
        if retried:  # the restarted worker served within the router's wait: placed there, the fault stalled it again
            assert (await transfer_failures(cluster.address))["peer_gone"] == failures["peer_gone"] + 1
        else:
            assert f"prefill worker {prefill.id}" in err.value.details()  # named, by id: no address reaches callers
            assert prefill_address not in err.value.details()
            assert failed_after < TRANSFER_TIMEOUT_S, failed_after
            assert await transfer_failures(cluster.address) == plus(failures, "peer_gone", 1)  # the decode side saw it
        await blocks_freed(cluster.address, ("decode",))

        async def restarted() -> bool:
            prefill = (await by_role(cluster.address)).get("prefill")
            return prefill is not None and prefill.address != prefill_address and prefill.health == "SERVING"

        try:
            await until(restarted, timeout_s=RESTART_S, interval_s=0.5)
        except AssertionError as e:  # it failed once in CI, under load, with nothing to say why
            raise AssertionError(f"{e}\n{cluster.log()[-6000:]}") from e
        assert pid_serving((await by_role(cluster.address))["prefill"].address) != pid
        assert await tokens(cluster.address, request("after-kill")) == expected
        await blocks_freed(cluster.address)

    asyncio.run(run())


def test_transfer_timeout_fails_the_request_and_frees_blocks_on_both_sides(cluster, expected):
    """The prefill worker stalls past the decode side's transfer timeout: the decode side gives up and cancels
    the Prefill call, which ends the stall before any late send, and the prefill worker frees its blocks."""

    async def run() -> None:
        prefill_pid = pid_serving((await by_role(cluster.address))["prefill"].address)
        failures = await transfer_failures(cluster.address)
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokens(cluster.address, request(f"{FAULTED}timeout"))
        took = time.monotonic() - start
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "KV transfer" in err.value.details() and "timed out" in err.value.details(), err.value.details()
        # The decode side's transfer timeout ended it, not the stalled prefill worker finally sending.
        assert TRANSFER_TIMEOUT_S <= took < SEND_DELAY_S, (took, err.value.details())
        # Each of the router's attempts (it retries a failed transfer's request) timed out on the decode side.
        assert await transfer_failures(cluster.address) == plus(failures, "timeout", RouterConfig.max_attempts)
        await blocks_freed(cluster.address)
        assert pid_serving((await by_role(cluster.address))["prefill"].address) == prefill_pid  # stalled, not crashed
        assert await tokens(cluster.address, request("after-timeout")) == expected

    asyncio.run(run())


def test_stopped_prefill_worker_and_a_cancelled_caller_free_the_decode_blocks_at_once(cluster, expected):
    """The prefill worker is SIGSTOPped after its first token, while the decode side waits for the KV; the caller
    gives up. The decode worker frees its blocks at once (its receive had not started: nothing can write them),
    not when the transfer timeout ends the receive; the prefill worker frees its own once it runs again."""

    async def run() -> None:
        pid = pid_serving((await by_role(cluster.address))["prefill"].address)
        call = asyncio.create_task(tokens(cluster.address, request(f"{FAULTED}stop")))
        await until(stalled_after_first_token(cluster.address), timeout_s=5)
        await asyncio.sleep(0.3)  # the first token reaches the decode worker, which waits for the KV
        os.kill(pid, signal.SIGSTOP)
        try:

            async def decode_holds_blocks() -> bool:
                return (await by_role(cluster.address))["decode"].kv_blocks_used > 0

            await until(decode_holds_blocks, timeout_s=5)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await blocks_freed(cluster.address, ("decode",), within_s=TRANSFER_TIMEOUT_S / 2)
        finally:
            os.kill(pid, signal.SIGCONT)
        await blocks_freed(cluster.address)
        assert pid_serving((await by_role(cluster.address))["prefill"].address) == pid
        assert await tokens(cluster.address, request("after-stop")) == expected

    asyncio.run(run())


def test_stopped_prefill_worker_fails_a_request_without_deadline_by_keepalive(cluster, expected):
    """The prefill worker is SIGSTOPped before the request reaches it, and the client sets no deadline: no first
    token ever comes and no transfer starts, so only the decode worker's keepalive pings can tell. The request
    fails with UNAVAILABLE within the keepalive bound, and every block is free once the worker runs again."""

    async def run() -> None:
        pid = pid_serving((await by_role(cluster.address))["prefill"].address)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await tokens(cluster.address, request("stopped"), timeout_s=None)
            took = time.monotonic() - start
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert took < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1e3 + 10, took
            await blocks_freed(cluster.address, ("decode",), within_s=5)
        finally:
            os.kill(pid, signal.SIGCONT)
        await blocks_freed(cluster.address)
        assert await tokens(cluster.address, request("after-stopped")) == expected

    asyncio.run(run())


def test_killed_decode_worker_frees_the_kv_its_prefill_worker_holds_for_it_at_once(cluster, expected):
    """The decode worker is SIGKILLed while the prefill worker holds the prompt's KV for it (the stall before the
    send): its lost Prefill call frees the prefill worker's blocks at once, not when the stall would have ended
    (SEND_DELAY_S). The only decode worker is restarting, so the client gets UNAVAILABLE; its restart serves."""

    async def run() -> None:
        decode = (await by_role(cluster.address))["decode"]
        pid = pid_serving(decode.address)
        call = asyncio.create_task(tokens(cluster.address, request(f"{FAULTED}decode-kill"), timeout_s=60))
        await until(stalled_after_first_token(cluster.address), timeout_s=5)
        await asyncio.sleep(0.3)  # the first token reaches the decode worker, which waits for the KV
        os.kill(pid, signal.SIGKILL)
        # Seen idle once within seconds: a retry the restarted decode worker might take would stall anew only later.
        await blocks_freed(cluster.address, ("prefill",), within_s=SEND_DELAY_S / 4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"decode worker {decode.id}" in err.value.details(), err.value.details()

        async def restarted() -> bool:
            back = (await by_role(cluster.address)).get("decode")
            return back is not None and back.address != decode.address and back.health == "SERVING"

        await until(restarted, timeout_s=RESTART_S, interval_s=0.5)
        assert await tokens(cluster.address, request("after-decode-kill")) == expected
        await blocks_freed(cluster.address)

    asyncio.run(run())
