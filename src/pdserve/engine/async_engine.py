"""The engine on its own thread, driven from asyncio.

gRPC servicers live on an event loop; the model step is long, blocking tensor work. One thread owns the
engine: it applies queued commands (add, abort, reserve, commit, release) between steps and hands
each step's outputs to the per-request streams (output_streams.py). Nothing else touches the engine: callers use
the named operations below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import replace
from functools import partial
from typing import TypeVar

import torch

from pdserve.engine.cache_journal import PrefixCacheJournal
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.engine.output_streams import OutputStreams, Stream
from pdserve.engine.profiling import measure_profile
from pdserve.engine.speed_probe import ProbeReader, run_probe
from pdserve.engine.start_times import StartTimes, StepStart
from pdserve.engine.step_faults import StepFaults
from pdserve.errors import UnavailableError
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.handoff import FirstToken
from pdserve.protocol.outputs import PREEMPTED_NOTICE_S, RequestOutput
from pdserve.protocol.perf_profile import PerfProfile

log = logging.getLogger(__name__)
T = TypeVar("T")


def _drop(engine: LLMEngine, request_id: str) -> None:
    """Undoes an add or a reservation whose caller left before it ran."""
    engine.abort(request_id)


class EngineDeadError(UnavailableError):
    """The engine thread stopped on an error; the worker must be restarted (its callers get UNAVAILABLE)."""


class AsyncEngine:
    """The named operations workers need; the engine itself and its thread stay private."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams = OutputStreams()
        self._error: BaseException | None = None
        self._pending: set[Future[object]] = set()  # commands awaited: failed at once if the thread dies
        self.faults = StepFaults()  # for tests: a step running a named request raises or is slowed
        self.on_death: Callable[[BaseException], None] | None = None  # called on the engine thread as it dies
        self.stats: dict[str, int] = {}
        # (prefill tokens, decode seqs, seconds, its prompt chunks' attention squares, the tokens its decoding
        # sequences attend over), on the engine thread
        self.on_step: Callable[[int, int, float, int, int], None] | None = None
        # (queue, prefill, requeue seconds) of the step's requests, each once (LLMEngine.last_step_queue_s), same thread
        self.on_request_times: Callable[[list[float], list[float], list[float]], None] | None = None
        self._started = StartTimes()
        self.prefix_journal: PrefixCacheJournal | None = engine.blocks.journal  # thread-safe; for routers' indexes
        self.tokenizer_digest = engine.tokenizer.digest  # read at each state check: computed once, here (~0.1 s)
        self._update_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def prepare(self, request: EngineRequest) -> EngineRequest:
        """The request with what it needs built before its engine takes it, built off the engine thread and the
        event loop: its output constraint's grammar, compiled (engine/guided.py)."""
        if (constraint := request.sampling.constraint) is None:
            return request
        return replace(request, grammar=await asyncio.to_thread(self._engine.guided.compile, constraint))

    # -- what the engine is (fixed at start-up; safe to read from any thread) --------------------------

    @property
    def fingerprint(self) -> str:
        """Identifies the model's weights: both sides of a KV hand-off must run the same."""
        return self._engine.fingerprint

    @property
    def block_size(self) -> int:
        return self._engine.config.block_size

    @property
    def max_num_seqs(self) -> int:
        return self._engine.config.scheduler.max_num_seqs

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV cache tensors the transfer reads from or writes into, one per layer. Only blocks a hand-off
        holds (`reserve` on the decode side, a prefill's `handoff_block_ids` on the prefill side) may be touched."""
        return self._engine.runner.kv_caches

    @property
    def device(self) -> torch.device:
        """Where the KV caches live: the transfer endpoints are built for it."""
        return self._engine.runner.device

    @property
    def kv_bytes_per_token(self) -> int:
        e = self._engine
        return kv_block_bytes(e.model_config, e.config.block_size, e.runner.dtype) // e.config.block_size

    # -- called from asyncio -------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Add a request (mixed or prefill-only engine) and yield its outputs; abort it if the caller leaves.
        Raises DuplicateRequestError while another request with this id is in flight here."""
        stream = self._streams.open(request.request_id)
        live = False  # the engine holds this caller's request: abort it if the caller leaves early
        try:
            await self._add(request)
            live = True
            async for out in stream.outputs():
                live = not out.finished
                yield out
        finally:
            await self._close(request.request_id, stream, abort=live)

    async def prefill(self, request: EngineRequest) -> RequestOutput:
        """Prefill-only engine: run the prompt and return the first token. Unless that finished the
        request, its blocks stay held for the hand-off until `release` (or `abort`)."""
        stream = self._streams.open(request.request_id)
        live = False
        try:
            await self._add(request)
            live = True
            async for out in stream.outputs():
                live = False  # finished, or held for the hand-off: the caller releases it
                return out
            raise AssertionError("unreachable: a prefill always yields its first token")
        finally:
            await self._close(request.request_id, stream, abort=live)

    async def reserve(self, request: EngineRequest) -> list[int]:
        """Decode-only engine: the blocks the prompt's KV will arrive in, held until `commit_and_stream` or
        `abort`; OverloadedError when this worker cannot take it now (LLMEngine.reserve). A caller cancelled
        meanwhile holds nothing."""
        return await self._call(lambda e: e.reserve(request), undo=lambda e, _: _drop(e, request.request_id))

    async def commit_and_stream(self, request_id: str, first: FirstToken) -> AsyncGenerator[RequestOutput, None]:
        """Decode side: the reserved blocks hold the KV (unless `first.kv_follows` is False: none came, the first
        token ended it); yield the first token's output, then the decode's."""
        stream = self._streams.open(request_id)
        live = True  # reserved by this caller
        try:
            args = (first.token_id, first.logprobs, first.kv_follows, first.finish_reason)
            out = await self._call(lambda e: e.commit(request_id, *args))
            live = not out.finished
            if out.error is not None:
                raise out.error
            yield out
            if live:
                async for out in stream.outputs():
                    live = not out.finished
                    yield out
        finally:
            await self._close(request_id, stream, abort=live)

    def release(self, request_id: str) -> None:
        """Prefill side: the hand-off is over (sent, failed or given up); the engine thread frees the request's
        blocks between steps. Returns at once: nothing downstream (the decode side's commit, the first token)
        waits for the step in flight, and a caller cancelled meanwhile cannot leave the blocks held."""
        self._submit(partial(self._release_now, request_id))

    def _release_now(self, request_id: str) -> None:
        try:
            self._engine.release(request_id)
        except Exception:  # nobody awaits it: logged, and the engine thread goes on
            log.exception("releasing %s failed", request_id)

    async def abort(self, request_id: str) -> bool:
        """Drop the request wherever it is and free its blocks; False when it is unknown."""
        return await self._call(lambda e: self._abort_now(e, request_id))

    def _abort_now(self, engine: LLMEngine, request_id: str) -> bool:
        """On the engine thread: a slowed request stays slow until the engine drops it (a test sees one left on)."""
        self.faults.forget(request_id)
        return engine.abort(request_id)

    async def measure_profile(self) -> PerfProfile:
        """Times the model on the engine thread; before the engine runs any request (it writes scratch KV)."""
        return await self._call(measure_profile)

    async def probe_speed(self, reader: ProbeReader, may_run: Callable[[], bool]) -> bool:
        """One speed probe between steps (speed_probe.py), unless a request or `may_run()` says no there; `reader`
        (the worker's `SpeedTracker`) gets its reading on the engine thread, where the live steps' corrections are
        made too. False: none ran."""
        return await self._call(partial(run_probe, reader=reader, may_run=may_run))

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._engine.guided.close()

    def take_started(self, request_id: str) -> StepStart | None:
        """When the request first ran in a step, once; None if it has not run."""
        return self._started.take(request_id)

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    async def _call(self, fn: Callable[[LLMEngine], T], undo: Callable[[LLMEngine, T], None] | None = None) -> T:
        """Run `fn(engine)` on the engine thread between steps and await its result. Cancelling the caller
        does not stop `fn` from running; `undo(engine, result)` then reverts what `fn` did for nobody."""
        future: Future[T] = Future()

        def command() -> None:
            # Runs even when the caller was cancelled meanwhile (it may be the release or abort that frees a
            # request's blocks); the outcome then has nobody to go to, and must not stop the engine thread.
            try:
                result = fn(self._engine)
            except Exception as e:  # handed to the awaiting caller
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(e)
                return
            try:
                future.set_result(result)
            except InvalidStateError:  # the caller left before it ran
                if undo is not None:
                    undo(self._engine, result)

        # Registered before the liveness check in `_submit`: a thread dying after the check still fails it.
        self._pending.add(future)  # type: ignore[arg-type]
        future.add_done_callback(self._pending.discard)  # type: ignore[arg-type]
        try:
            self._submit(command)
        except EngineDeadError:
            self._pending.discard(future)  # type: ignore[arg-type]
            raise
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The result may have been set just as the caller left: then nobody else will undo it.
            if undo is not None and future.done() and not future.cancelled() and future.exception() is None:
                self._submit(partial(undo, self._engine, future.result()))
            raise

    async def _add(self, request: EngineRequest) -> None:
        await self._call(lambda e: e.add_request(request), undo=lambda e, _: _drop(e, request.request_id))

    async def _close(self, request_id: str, stream: Stream, abort: bool) -> None:
        """Stream over: abort this caller's request if it is still live (cancel, error), then forget the stream.
        Until the engine thread ran the abort the id is in flight (a step delivers under it; a new caller is refused),
        even if this caller stops waiting for it (cancelled again: a drain or a stop after the caller's cancel)."""

        def forget(aborted: asyncio.Future[bool] | None = None) -> None:
            if aborted is not None and not aborted.cancelled():
                aborted.exception()  # seen here: a caller cancelled meanwhile does not read it
            if self._streams.forget(request_id, stream):
                self._started.stream_ended(request_id)

        if abort and self.alive:
            aborted = asyncio.ensure_future(self.abort(request_id))
            aborted.add_done_callback(forget)
            await asyncio.shield(aborted)
            return
        if not abort:  # it finished: the engine holds it no more
            self.faults.forget(request_id)
        forget()

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.alive:
            raise EngineDeadError(f"engine thread is down: {self._error!r}")
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        next_notice = 0.0
        try:
            while not self._stopping:
                self._apply_commands()
                if not (self._engine.has_unfinished() and self._step()):
                    # Idle, or the work waits for blocks that only a command frees (a release, an abort):
                    # spinning would starve the threads that send them of the GIL, and time steps that ran nothing.
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                if (now := time.monotonic()) >= next_notice:  # from this thread: a hung step sends none
                    next_notice = now + PREEMPTED_NOTICE_S
                    self._streams.deliver(self._engine.preempted_outputs())
        except BaseException as e:
            log.exception("engine loop failed")
            self._error = e
            if self.on_death is not None:  # first: whoever it tells learns before any caller sees the failure
                try:
                    self.on_death(e)
                except Exception:
                    log.exception("on_death failed")
            self._fail_all(EngineDeadError(f"engine failed: {e!r}"))

    def _step(self) -> bool:
        """One engine step and its deliveries; False when the scheduler could run nothing."""
        decoding = len(self._engine.scheduler.running)
        start = time.perf_counter()
        started = StepStart(time.time_ns(), time.monotonic_ns())
        outputs = self._engine.step()
        if not self._engine.last_step_tokens:
            return False
        ran = [o.request_id for o in outputs] + [s.seq_id for s in self._engine.scheduler.running]
        self._mark_started(ran, started)
        if self.on_step is not None:
            e, seconds = self._engine, time.perf_counter() - start
            decode_seqs = min(decoding, e.last_step_tokens)
            prefill_tokens, squares = e.last_step_tokens - decode_seqs, e.last_step_prefill_squares
            self.on_step(prefill_tokens, decode_seqs, seconds, squares, e.last_step_decode_context)
        times = (self._engine.last_step_queue_s, self._engine.last_step_prefill_s, self._engine.last_step_requeue_s)
        if self.on_request_times is not None and any(times):
            self.on_request_times(*times)
        self.faults.stepped(ran)  # a long prompt's chunks too, which have no output before its last
        self._streams.deliver(outputs)
        self._update_stats()
        return True

    def _mark_started(self, ran: list[str], started: StepStart) -> None:
        """`ran`: the requests the step ran (those it finished or handed off, and those still running)."""
        self._started.mark([rid for rid in ran if rid in self._streams], started)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._update_stats()
                return
            command()

    def _fail_all(self, error: Exception) -> None:
        """Every caller waiting on the dead thread gets `error`: streams, and commands it will never run."""
        self._streams.fail_all(error)
        for future in list(self._pending):
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)

    def _update_stats(self) -> None:
        """Published as one dict swap, so readers on other threads never see the queues mid-change."""
        self.stats = self._engine.stats()
