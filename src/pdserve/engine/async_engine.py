"""The engine on its own thread, driven from asyncio.

gRPC servicers live on an event loop; the model step is long, blocking tensor work. One thread owns the
engine: it applies queued commands (add, abort, reserve, commit, release) between steps and hands
each step's outputs to the per-request asyncio queues. Nothing else touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from typing import TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; the worker must be restarted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._error: BaseException | None = None
        self.stats: dict[str, int] = {}
        self.on_step: Callable[[int, int, float], None] | None = None  # (prefill tokens, decode seqs, seconds)
        # request id -> wall-clock ns when the first step that ran it began (its queue wait ends there)
        self._started_ns: dict[str, int] = {}
        self._update_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- called from asyncio -------------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and await its result. Cancelling the caller
        does not stop `fn` from running: a caller whose command changes state undoes it if it must."""
        future: Future[T] = Future()

        def command() -> None:
            # Runs even when the caller was cancelled meanwhile (it may be the release or abort that frees a
            # request's blocks); the outcome then has nobody to go to, and must not stop the engine thread.
            with contextlib.suppress(InvalidStateError):
                try:
                    result = fn(self.engine)
                except Exception as e:  # handed to the awaiting caller
                    future.set_exception(e)
                else:
                    future.set_result(result)

        self._submit(command)
        return await asyncio.wrap_future(future)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Add a request (mixed or prefill-only engine) and yield its outputs; abort it if the caller leaves."""
        stream = self._open(request_id)
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_token_ids, sampling))
            async for out in self._drain(stream):
                yield out
        finally:
            await self._close(request_id)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> RequestOutput:
        """Prefill-only engine: run the prompt and return the first token. Unless that finished the
        request, its blocks stay held for the hand-off until `release` (or `abort`)."""
        stream = self._open(request_id)
        handed_off = False
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_token_ids, sampling))
            async for out in self._drain(stream):
                handed_off = True
                return out
            raise AssertionError("unreachable: a prefill always yields its first token")
        finally:
            await self._close(request_id, abort=not handed_off)

    async def commit_and_stream(self, request_id: str, first_token: int) -> AsyncIterator[RequestOutput]:
        """Decode side: the reserved blocks hold the KV; yield the first token's output, then the decode's."""
        stream = self._open(request_id)
        try:
            first = await self.call(lambda e: e.commit(request_id, first_token))
            yield first
            if not first.finished:
                async for out in self._drain(stream):
                    yield out
        finally:
            await self._close(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda e: e.abort(request_id))

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def take_started_ns(self, request_id: str) -> int | None:
        """When the request first ran in a step (time.time_ns), once; None if it has not run."""
        return self._started_ns.pop(request_id, None)

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def _open(self, request_id: str) -> asyncio.Queue[RequestOutput | Exception]:
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    async def _drain(self, q: asyncio.Queue[RequestOutput | Exception]) -> AsyncIterator[RequestOutput]:
        while True:
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    async def _close(self, request_id: str, abort: bool = True) -> None:
        """Stream over: forget it, and abort the request if it has not finished (cancel, error)."""
        if self._streams.pop(request_id, None) is not None and abort and self.alive:
            await self.call(lambda e: e.abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.alive:
            raise EngineDeadError(f"engine thread is down: {self._error!r}")
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                decoding = len(self.engine.scheduler.running)
                start = time.perf_counter()
                start_ns = time.time_ns()
                outputs = self.engine.step()
                self._mark_started(outputs, start_ns)
                if self.on_step is not None:
                    decode_seqs = min(decoding, self.engine.last_step_tokens)
                    self.on_step(self.engine.last_step_tokens - decode_seqs, decode_seqs, time.perf_counter() - start)
                for out in outputs:
                    self._deliver(out)
                self._update_stats()
        except BaseException as e:
            log.exception("engine loop failed")
            self._error = e
            self._fail_all(EngineDeadError(f"engine failed: {e!r}"))

    def _mark_started(self, outputs: list[RequestOutput], start_ns: int) -> None:
        started = self._started_ns
        for rid in [o.request_id for o in outputs] + [s.seq_id for s in self.engine.scheduler.running]:
            if rid not in started and rid in self._streams:
                started[rid] = start_ns
        while len(started) > 4096:  # never taken (a caller that does not trace): forget the oldest
            started.pop(next(iter(started)))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._update_stats()
                return
            command()

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _fail_all(self, error: Exception) -> None:
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, error)

    def _update_stats(self) -> None:
        """Published as one dict swap, so readers on other threads never see the queues mid-change."""
        e = self.engine
        self.stats = {
            "kv_blocks_total": e.blocks.num_blocks,
            "kv_blocks_used": e.blocks.num_used_blocks,
            "kv_blocks_cached": e.blocks.num_cached_blocks,
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "queued_prefill_tokens": e.scheduler.num_waiting_tokens,
        }
