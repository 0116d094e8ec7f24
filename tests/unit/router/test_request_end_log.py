"""A request the caller's own deadline ended is logged at INFO, not as a failure of the cluster's (WARNING), and
counted as `deadline_exceeded`: an SRE alerting on the router's warnings or failed requests must not be paged by
clients with short deadlines. Through a real lifecycle against stand-in decode workers on real gRPC servers."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


async def _run(time_left_s: float, telemetry: Telemetry) -> BaseException | None:
    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(StandInDecode(gap_s=0.5)) as d0:
        lc = Router([worker("p0"), worker("d0", "decode", address=d0)]).lifecycle(telemetry=telemetry)
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=8))
        try:
            async for _ in generate(lc, request, {}, lambda: time_left_s, admitted):
                pass
        except Exception as e:
            return e
    return None


def test_a_callers_deadline_is_logged_at_info_and_names_no_address(monkeypatch, caplog):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    caplog.set_level(logging.INFO, logger="services.router.lifecycle")
    telemetry = Telemetry("test-router")
    error = asyncio.run(_run(0.3, telemetry))
    assert isinstance(error, TimeoutError), error
    assert requests_by_outcome(telemetry) == {("deadline_exceeded", "anonymous"): 1}
    telemetry.shutdown()
    ended = [r for r in caplog.records if r.name == "services.router.lifecycle" and "Deadline" in r.getMessage()]
    assert ended and all(r.levelno == logging.INFO for r in ended), [(r.levelname, r.getMessage()) for r in ended]
    assert "127.0.0.1" not in str(error)  # the caller is told the worker's id, not its address
