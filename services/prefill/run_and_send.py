"""The prefill worker's side of a hand-off: run the prompt, report the first token, send the KV blocks to the
decode worker's reserved blocks, free its own. The blocks are held from the first token on and freed however
the hand-off ends: sent, failed, or cancelled by a decode side that gave up.

Nothing on the way to the caller's first token waits for this worker's next engine step: the first token's
output names the blocks to send, and their release is queued for the engine thread, not awaited. (Each would
otherwise wait for the step in flight, a whole batch of chunks on a busy worker.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pdserve.addresses import split_host_port
from pdserve.config import FaultConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.start_times import StepStart
from pdserve.errors import InvalidRequestError, KVMismatchError, UnavailableError
from pdserve.metrics import WorkerMetrics
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken, KVSent, KVTarget
from pdserve.protocol.outputs import RequestOutput
from pdserve.telemetry import Telemetry, mark_ended_by, now_ns
from pdserve.transfer.base import KVSender, NotExpectedError, TransferError
from pdserve.transfer.failures import failure_reason
from pdserve.transfer.send_start import SendStart
from pdserve.transfer.threads import in_transfer_thread
from pdserve.transfer.wire import check_tag

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillJob:
    request: EngineRequest
    target: KVTarget
    transfer_timeout_s: float  # the decode side's own deadline for the transfer
    client_request_id: str = ""  # the caller's own id: echoed in logs, matched by fault injection, never a key


@dataclass
class RunAndSend:
    engine: AsyncEngine
    sender: KVSender
    worker_id: str
    telemetry: Telemetry
    metrics: WorkerMetrics | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)  # none injected

    async def run(self, job: PrefillJob) -> AsyncGenerator[FirstToken | KVSent, None]:
        """The first token, then (unless it ended the request) the confirmation that the KV was sent."""
        self._check(job)
        if self.faults.engine_dies_for(job.client_request_id):
            self.engine.faults.fail_when_stepped(job.request.request_id)
        if delay_s := self.faults.step_delay_for(job.client_request_id):
            self.engine.faults.slow_when_stepped(job.request.request_id, delay_s)
        out, waited_s = await self._run_prompt(job)
        first = FirstToken(
            out.new_token_ids[0],
            not out.finished,
            out.num_cached_tokens,
            next(iter(out.logprobs), None),
            out.prompt_logprobs,
            waited_s,
            out.finish_reason,
        )
        if out.finished:
            yield first
            return
        try:
            yield first
            if delay_s := self.faults.kv_send_delay_for(job.client_request_id):
                await asyncio.sleep(delay_s)
            await self._send(job, list(out.handoff_block_ids))
        finally:
            self.engine.release(job.request.request_id)  # queued before the decode side may end the call on KVSent
        yield KVSent()

    def _check(self, job: PrefillJob) -> None:
        """What would make the hand-off fail, found before the prompt runs."""
        try:
            check_tag(job.target.tag)
            split_host_port(job.target.rendezvous)
        except ValueError as e:  # else found only by the send, after the prompt ran, as a handler bug
            raise InvalidRequestError("target", str(e)) from None
        ours = (self.engine.fingerprint, self.engine.block_size)
        theirs = (job.target.model_fingerprint, job.target.block_size)
        if theirs != ours:
            raise KVMismatchError(f"KV layout mismatch: decode runs (model, block size) {theirs}, this worker {ours}")
        if job.transfer_timeout_s <= 0:
            raise InvalidRequestError("transfer_timeout_ms", f"must be positive, got {job.transfer_timeout_s * 1e3:g}")

    async def _run_prompt(self, job: PrefillJob) -> tuple[RequestOutput, float]:
        """Prefills the prompt; its blocks stay held for the hand-off. Returns its output and how long it waited for
        its first step, on the monotonic clock (a step of the wall clock would skew the router's calibration by as
        much). Traces its queue wait and compute (wall-clock times, as spans are exported), also when they end
        otherwise: the wait alone when the prompt never ran."""
        start_ns, start_monotonic_ns = now_ns(), time.monotonic_ns()
        ids = {"request__id": job.request.request_id, "worker__id": self.worker_id}
        try:
            out = await self.engine.prefill(job.request)
        except BaseException as e:
            ran = self.engine.take_started(job.request.request_id)
            if ran is None:
                self.telemetry.span("prefill.queue_wait", start_ns, now_ns(), e, **ids)
            else:
                self.telemetry.span("prefill.queue_wait", start_ns, ran.wall_ns, **ids)
                self.telemetry.span("prefill.compute", ran.wall_ns, now_ns(), e, **ids)
            raise
        end_ns, prefill_ms = now_ns(), round((time.monotonic_ns() - start_monotonic_ns) / 1e6, 2)
        ran = self.engine.take_started(job.request.request_id) or StepStart(start_ns, start_monotonic_ns)
        self.telemetry.span("prefill.queue_wait", start_ns, ran.wall_ns, **ids)
        self.telemetry.span(
            "prefill.compute",
            ran.wall_ns,
            end_ns,
            **ids,
            prompt_tokens=len(job.request.prompt),
            cached_prompt_tokens=out.num_cached_tokens,
        )
        log.debug("prefilled", extra={"prompt_tokens": len(job.request.prompt), "prefill_ms": prefill_ms})
        return out, max(ran.monotonic_ns - start_monotonic_ns, 0) / 1e9

    async def _send(self, job: PrefillJob, blocks: list[int]) -> None:
        """Returns only once the send thread is done with the blocks, even when the caller cancels: at once when the
        send had not begun reading them (called off: a stopped or hung decode process holds it in its wait for the
        pair's turn or liveness check until its deadline), else when it ends."""
        target = job.target
        if len(blocks) != len(target.block_ids):
            raise UnavailableError(f"decode side reserved {len(target.block_ids)} blocks, prompt has {len(blocks)}")
        attributes = {
            "request.id": job.request.request_id,
            "worker.id": self.worker_id,
            "decode.worker.id": target.decode_worker_id,
            "kv.blocks": len(blocks),
        }
        began = time.perf_counter()
        with self.telemetry.tracer.start_as_current_span("kv_transfer.send", attributes=attributes) as span:
            caches, timeout_s, start = self.engine.kv_caches, job.transfer_timeout_s, SendStart()
            send = asyncio.ensure_future(
                in_transfer_thread(self.sender.send, target.rendezvous, target.tag, caches, blocks, timeout_s, start)
            )
            try:
                nbytes = await asyncio.shield(send)
            except TransferError as e:  # counted here: a decode worker lost mid-transfer counts nothing itself
                if self.metrics is not None and not isinstance(e, NotExpectedError):  # the decode side counted it
                    self.metrics.transfer_failed(failure_reason(e))
                raise UnavailableError(f"KV transfer to decode worker {target.decode_worker_id} failed: {e}") from e
            except asyncio.CancelledError as e:  # the caller left: `cancelled`, not a send that reads as done
                mark_ended_by(span, e)
                raise
            finally:
                if not send.done() and start.call_off():  # the caller left before the send read the blocks
                    send.add_done_callback(_read_outcome)
                elif not send.done():  # the caller left: the blocks stay held until the send thread lets go
                    while not send.done():  # a second cancel (a drain after the caller's) must not end the wait
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.wait([send])
                    if not send.cancelled():
                        send.exception()  # seen: the caller left, so its failure is no news (no asyncio error log)
            span.set_attribute("kv.bytes", nbytes)
        self._record(nbytes, time.perf_counter() - began)

    def _record(self, nbytes: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.transfer_bytes.add(nbytes, self.metrics.labels)
            self.metrics.transfer_seconds.record(seconds, self.metrics.labels)
        log.debug("kv sent", extra={"bytes": nbytes, "transfer_ms": round(seconds * 1e3, 2)})


def _read_outcome(send: asyncio.Future[int]) -> None:
    """A send called off ends later, unawaited (TransferCancelledError, or its deadline's error): reading it keeps
    asyncio from logging it as never retrieved."""
    if not send.cancelled():
        send.exception()
