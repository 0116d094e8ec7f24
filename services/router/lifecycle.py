"""A request's life in the router, as code: build, admit (a ticket that owns the load bookkeeping), place,
relay the decode worker's stream, account for how it ended. The gRPC servicer only converts around it."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from opentelemetry import trace

from pdserve.config import RouterConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import InvalidRequestError, OverloadedError, UnavailableError
from pdserve.metrics import RecentLatencies, RouterMetrics
from pdserve.protocol.model_config import ModelConfig
from pdserve.registry.base import PrefixIndex
from pdserve.telemetry import Telemetry, request_id_var
from pdserve.v1 import generate_pb2 as pb
from services.router.admission import Admission, SLOTarget
from services.router.load_tracker import LoadTracker
from services.router.placement import Placement, PlacementPolicy
from services.router.relay import Relay
from services.router.request import RoutedRequest, build_request
from services.router.ticket import Ticket

log = logging.getLogger(__name__)
# The router's own key of the request being served in this context, for its log lines beside the client's id.
request_key_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_key", default=None)


class RequestLifecycle:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model: ModelConfig,
        config: RouterConfig,
        placement: PlacementPolicy,
        prefix_index: PrefixIndex,
        tracker: LoadTracker,
        telemetry: Telemetry,
    ) -> None:
        self.telemetry = telemetry
        self.metrics = RouterMetrics(telemetry.meter)
        self.recent = RecentLatencies()
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.placement = placement
        self.prefix_index = prefix_index
        self.tracker = tracker
        self.admission = Admission(config, placement.predictor)
        self.relay = Relay(
            telemetry, self.metrics, self.recent, placement.predictor.calibration, config.first_token_timeout_s
        )
        self.draining = False

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    async def admit(self, msg: pb.GenerateRequest, started_at: float) -> Ticket:
        """Build, place and admit, or raise (InvalidRequestError, OverloadedError, UnavailableError) before
        anything is sent. The request gets its own unique key here; the caller's request_id is only echoed."""
        key = uuid.uuid4().hex
        client_id = msg.request_id or key
        request_id_var.set(client_id)
        request_key_var.set(key)
        ids = {"request.id": key, "request.client_id": client_id}
        trace.get_current_span().set_attributes(ids)
        with self.telemetry.tracer.start_as_current_span("admission", attributes=ids) as span:
            config = self.config
            req = await build_request(msg, self.tokenizer, self.model, config.default_max_tokens, config.request_limits)
            span.set_attribute("prompt_tokens", len(req.prompt_token_ids))
            try:
                placement = await self._place_and_check(req)
            except (OverloadedError, InvalidRequestError) as e:
                span.set_attribute("rejected", str(e))
                raise
        prefill, decode = placement.prefill_worker, placement.decode
        trace.get_current_span().set_attributes(
            {"prefill.worker.id": prefill.worker_id, "decode.worker.id": decode.worker_id}
        )
        self.prefix_index.record(prefill.worker_id, placement.block_hashes)
        return Ticket(key, client_id, req, placement, started_at, self.tracker, self.admission)

    async def _place_and_check(self, req: RoutedRequest) -> Placement:
        if self.draining:
            raise UnavailableError("the router is draining; retry on another replica")
        ttft_ms, tpot_ms = self.config.slo_for(req.priority, req.ttft_slo_ms, req.tpot_slo_ms)
        with self.telemetry.tracer.start_as_current_span("placement") as span:
            placement = await self.placement.place(req.prompt_token_ids, req.sampling.max_tokens, tpot_ms / 1e3)
            span.set_attribute("prefill.worker.id", placement.prefill_worker.worker_id)
            span.set_attribute("decode.worker.id", placement.decode.worker_id)
            span.set_attribute("cached_tokens", placement.cached_tokens)
            span.set_attribute("predicted_ttft_s", placement.predicted_ttft_s)
        slo = SLOTarget(ttft_ms / 1e3, tpot_ms / 1e3, req.ttft_slo_ms > 0, req.tpot_slo_ms > 0)
        self.admission.check(placement, len(req.prompt_token_ids), req.priority, slo)
        return placement

    def stream(self, ticket: Ticket, time_remaining: float | None) -> AsyncIterator[pb.GenerateResponse]:
        return self.relay.stream(ticket, time_remaining)

    @contextmanager
    def accounting(self, started_at: float) -> Iterator[None]:
        """Counts the request by how it ended and logs it once."""
        outcome = "failed"
        try:
            yield
            outcome = "finished"
        except InvalidRequestError:
            outcome = "invalid"
            raise
        except OverloadedError:
            outcome = "rejected"
            raise
        except (asyncio.CancelledError, GeneratorExit, TimeoutError):
            outcome = "cancelled"  # by the caller, or its deadline passed
            raise
        finally:
            self.metrics.requests.add(1, {"outcome": outcome})
            e2e_s = time.perf_counter() - started_at
            if outcome == "finished":
                self.metrics.e2e.record(e2e_s)
            extra = {"outcome": outcome, "e2e_ms": round(e2e_s * 1e3, 2), "request_key": request_key_var.get()}
            log.info("request %s", outcome, extra=extra)
