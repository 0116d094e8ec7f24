"""DecodeWorker gRPC service: converts, and hands the request to the hand-off (or, colocated, the engine)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import grpc

from pdserve.config import FaultConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import PermissionDeniedError, UnavailableError
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.roles import Role
from pdserve.rpc.convert import engine_request_from_pb, off_the_loop_when_constrained, output_to_pb
from pdserve.rpc.metadata import HANDOFF_STARTED_KEY, PREFILL_WAITED_KEY, SEQUENCES_FREED_KEY
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.telemetry import Telemetry, request_id_var
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.decode.colocated import generate_here
from services.decode.handoff import Handoff, HandoffRequest


@dataclass
class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Also the colocated worker: a request with no prefill address is prefilled here (mixed engine).
    `handoff` is None on a worker that takes no KV hand-offs (colocated)."""

    engine: AsyncEngine
    handoff: Handoff | None
    worker_id: str
    role: Role
    telemetry: Telemetry
    faults: FaultConfig = field(default_factory=FaultConfig)  # none injected
    cluster: ClusterSecret = field(default_factory=ClusterSecret)  # checks the router's prefill grants

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        request_id_var.set(request.client_request_id or request.request_id)
        work = await off_the_loop_when_constrained(partial(engine_request_from_pb, request), request.sampling)
        work = await self.engine.prepare(work)
        if self.faults.engine_dies_for(request.client_request_id):
            self.engine.faults.fail_when_stepped(request.request_id)
        if delay_s := self.faults.step_delay_for(request.client_request_id):
            self.engine.faults.slow_when_stepped(request.request_id, delay_s)
        outputs: AsyncIterator[RequestOutput]
        trailing: dict[str, str] = {}  # for the router's accounting, set as each is known

        def trail(key: str, value: str) -> None:
            trailing[key] = value
            context.set_trailing_metadata(tuple(trailing.items()))

        if not request.prefill_address:
            outputs = generate_here(self.engine, self.telemetry, self.worker_id, work)
        elif self.handoff is None:
            raise UnavailableError(f"worker {self.worker_id} ({self.role}) takes no KV hand-offs")
        elif not self.cluster.check_prefill_grant(request.request_id, request.prefill_address, request.prefill_grant):
            raise PermissionDeniedError(
                "prefill_address", "not granted by the router: this worker dials only registered prefill workers"
            )
        else:
            handoff = HandoffRequest(work, request.prefill_address, request.client_request_id)

            async def dispatched() -> None:
                await context.send_initial_metadata(((HANDOFF_STARTED_KEY, "1"),))

            def prefilled(first: FirstToken) -> None:
                if first.waited_s is not None:  # else the router calibrates as if it had no wait to take off
                    trail(PREFILL_WAITED_KEY, str(round(first.waited_s * 1e3)))

            outputs = self.handoff.stream(handoff, context.time_remaining, dispatched, prefilled)
        async with contextlib.aclosing(outputs) as stream:  # type: ignore[type-var]
            async for out in stream:
                if out.finished and out.sequences_freed:  # its blocks are free here: which reports say so
                    trail(SEQUENCES_FREED_KEY, str(out.sequences_freed))
                yield _to_pb(out)


def _to_pb(out: RequestOutput) -> pb.GenerateResponse:
    """The last message reports how much of the prompt a prefix cache served."""
    msg = output_to_pb(out)
    if out.finished:
        msg.usage.cached_prompt_tokens = out.num_cached_tokens
    return msg
