"""The router's caller learns which workers failed its request by id, never their addresses: through a real
lifecycle against stand-in decode workers on real gRPC servers, and for each error type the caller can get."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.registry.base import WorkerState
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.caller_errors import for_the_caller
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
REQUEST = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=4))
PREFILL_ADDRESS = "10.1.2.3:50051"


def prefill() -> WorkerState:
    """Made per test: a worker's state is live only for a while after it is made (its heartbeat)."""
    return worker("p0", address=PREFILL_ADDRESS)


class Fails(StandInDecode):
    """Ends every request with `code`, naming the prefill worker by address as a real decode worker does."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self.code = code

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await context.abort(self.code, f"prefill worker {PREFILL_ADDRESS}: connection reset")
        yield pb.GenerateResponse()  # unreachable: makes this a stream handler


async def failure(code: grpc.StatusCode) -> tuple[Exception, str]:
    """What a lone decode worker failing with `code` gives the caller, and that worker's address."""

    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(Fails(code)) as address:
        router = Router([prefill(), worker("d0", "decode", address=address)], max_attempts=1)
        with pytest.raises(Exception) as err:
            async for _ in generate(router.lifecycle(), REQUEST, {}, lambda: 10.0, admitted):
                pass
    return err.value, address


@pytest.mark.parametrize(
    ("code", "kind"),
    [(grpc.StatusCode.UNAVAILABLE, UnavailableError), (grpc.StatusCode.RESOURCE_EXHAUSTED, OverloadedError)],
)
async def test_a_workers_failure_names_the_workers_by_id_only(code: grpc.StatusCode, kind: type) -> None:
    error, address = await failure(code)
    assert type(error) is kind, error
    text = str(error)
    assert "decode worker d0:" in text and "prefill worker p0: connection reset" in text, text
    assert address not in text and PREFILL_ADDRESS not in text, text
    if kind is OverloadedError:
        assert error.retry_after_ms > 0  # still a shed a retry can pass


def test_each_type_keeps_what_its_status_carries() -> None:
    placed = Router([prefill(), worker("d0", "decode")]).place(prompt(40), 8, 1.0)
    d = placed.decode
    invalid = for_the_caller(InvalidRequestError("request", f"decode worker d0 at {d.address}: bad"), placed)
    assert isinstance(invalid, InvalidRequestError) and invalid.field == "request"
    assert str(invalid) == "request: decode worker d0: bad"
    quoting = InvalidRequestError("request", f"decode worker d0 at {d.address}: bad regex 'x(['", "(quoted)")
    assert for_the_caller(quoting, placed).recorded == "request: (quoted)"  # what logs and spans keep: no quote
    shed = for_the_caller(OverloadedError(f"{PREFILL_ADDRESS} is full", 750), placed)
    assert isinstance(shed, OverloadedError) and (str(shed), shed.retry_after_ms) == ("p0 is full", 750)
    late = for_the_caller(TimeoutError(f"decode worker d0 at {d.address}: Deadline Exceeded"), placed)
    assert type(late) is TimeoutError and str(late) == "decode worker d0: Deadline Exceeded"
    unreachable = f"prefill worker p0: failed to connect; last error: ipv4:{PREFILL_ADDRESS}: Connection refused"
    assert str(for_the_caller(UnavailableError(unreachable), placed)) == (
        "prefill worker p0: failed to connect; last error: p0: Connection refused"  # not "ipv4:p0"
    )
    own = UnavailableError("the router is draining; retry on another replica")
    assert for_the_caller(own, placed) is own  # nothing to hide: the same error


def test_any_other_address_a_message_names_is_hidden_too() -> None:
    """A transfer's failure names the decode worker's KV rendezvous store, a port of its own."""
    placed = Router([prefill(), worker("d0", "decode")]).place(prompt(40), 8, 1.0)
    for store in ("10.0.0.7:41234", "[fd00::7]:41234", "decode-0.pdserve.svc:50062", "localhost:50062"):
        told = for_the_caller(UnavailableError(f"prefill worker {PREFILL_ADDRESS}: decode side {store}: lost"), placed)
        assert str(told) == "prefill worker p0: decode side <address>: lost", told
    field = InvalidRequestError("slo.ttft_ms", "300 ms is below 510 ms; sampling.max_tokens: 4")
    assert for_the_caller(field, placed) is field  # no address in it: nothing changes
