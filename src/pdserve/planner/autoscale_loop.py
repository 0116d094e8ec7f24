"""`pdserve autoscale`'s loop: every interval, the router's status (its admitted counters and desired counts), one
decision (`autoscale.py`), and ScaleWorkers when the decision is to scale. Each decision is printed as one JSON
line: `{"load": {"rate", "input_len", "output_len"}, "current", "recommended", "action": "scale"|"hold", "why"}`.
SIGINT or SIGTERM (a pod's stop) ends it after the step in progress, never halfway through a scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from pdserve.planner.autoscale import (
    Admitted,
    Decision,
    Hysteresis,
    Load,
    LoadWindow,
    bounded,
    recommend_counts,
    with_scale_down_margin,
)
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.live_scale import cluster_status, scale_workers
from pdserve.planner.plan import SLO
from pdserve.rpc.client_hints import exit_status, rpc_error_line
from pdserve.rpc.credentials import ClientCredentials

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleConfig:
    profile: HardwareProfile
    slo: SLO
    max_workers: int
    interval_s: float
    window_s: float
    consecutive: int
    cooldown_s: float
    once: bool  # one decision (once the window is covered), printed, then exit
    dry_run: bool  # decide and print, never scale
    range_ratio: float = 0.0  # the spread of lengths around the window's means (plan's --range-ratio)
    scale_down_margin: float = 0.2  # fewer workers only when they would sustain this much more (than the bound)


# A status call refused for what the caller is or asked: the same call at the next interval fails the same way.
_FOR_GOOD = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
)


def other_model(profile: HardwareProfile, served: str) -> str | None:
    """Why `profile` cannot size a cluster that serves `served` (another model's costs would), or None. A model is
    named as `--model` took it, a built-in name or its folder (the cache names the folder after the model); a
    router that does not say what it serves ("", before it could) is taken at its word."""
    measured = str(profile.meta.get("model", ""))
    if not served or not measured or Path(measured).name == Path(served).name:
        return None
    return f"the profile was measured on model {measured!r}, the cluster serves {served!r}: profile that one"


async def run_autoscale(addr: str, credentials: ClientCredentials, c: AutoscaleConfig) -> int:
    """Returns 0 once stopped by a signal (or after one decision with `once`); 1 when the router refuses the
    status call for good (a key without admin rights, say), or with `once` does not answer it; 2 when the profile
    is of another model than the cluster serves (its costs would size the cluster), or the cluster is colocated
    (ValueError: it has no split to scale). The signals set
    an event the loop checks rather than cancel its task: grpc.aio can swallow a task's cancellation when it
    lands as a call completes, and the loop would then run on."""
    window, hysteresis = LoadWindow(c.window_s), Hysteresis(c.consecutive, c.cooldown_s)
    if c.once:  # silent for its whole window otherwise; stdout stays the decision's one line, which scripts parse
        print(
            f"pdserve autoscale: collecting {c.window_s:g} s of {addr}'s load (--window) for one decision",
            file=sys.stderr,
        )
    seen: dict[str, int] | None = None  # the desired counts at the last status
    made: dict[str, int] | None = None  # this loop's last scale
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        try:
            status = await cluster_status(addr, credentials)
        except grpc.aio.AioRpcError as e:  # the router restarting, say: the next interval asks again
            if c.once or e.code() in _FOR_GOOD:  # one decision asked for, or no later call can succeed
                line = rpc_error_line(
                    f"pdserve autoscale: no status from {addr}", e.code().name, e.details() or "", credentials
                )
                print(line, file=sys.stderr)
                return exit_status(e.code().name)
            log.warning("no status from %s: %s: %s", addr, e.code().name, e.details())
            window.samples.clear()  # the next sample paired with the last before the gap would span all of it
            await _pause(stop, c.interval_s)
            continue
        if (mismatch := other_model(c.profile, status.model)) is not None:
            print(f"pdserve autoscale: {mismatch} (pdserve profile --model {status.model})", file=sys.stderr)
            return 2
        now = loop.time()
        current = dict(status.desired)
        if not current or status.admitted_local_only:  # its registry did not answer (Redis down)
            # Its totals are then its own: beside the cluster's before and after, they would read as a burst of
            # the cluster's whole history. The window starts over once the registry answers.
            if c.once:  # one decision asked for: none can be made now (a cron job must not wait for Redis)
                print(f"pdserve autoscale: no cluster state from {addr} (its registry did not answer)", file=sys.stderr)
                return 1
            log.warning("no cluster state from %s (its registry did not answer): no decision", addr)
            window.samples.clear()
            await _pause(stop, c.interval_s)
            continue
        if seen is not None and current != seen and current != made:  # an operator's scale, another autoscaler's
            hysteresis.applied(now)  # its cooldown holds here too: two autoscalers must not undo each other's
            log.info("the desired counts went from %s to %s, not by this autoscaler: cooling down", seen, current)
        seen = current
        counters = (status.admitted_requests, status.admitted_prompt_tokens, status.admitted_max_tokens)
        finished = (status.finished_requests, status.completion_tokens)
        window.observe(Admitted(now, *counters, *finished, status.shed_requests, status.shed_prompt_tokens))
        if "colocated" in current:
            raise ValueError("autoscale scales a disaggregated cluster's split; this one is colocated")
        load = window.load()
        if load is not None:

            def recommend(load: Load) -> dict[str, int]:
                plan = recommend_counts(c.profile, load, c.slo, c.max_workers, range_ratio=c.range_ratio)
                return bounded(plan, c.max_workers)

            margin, window_s = c.scale_down_margin, c.window_s
            recommended, held = await asyncio.to_thread(
                with_scale_down_margin, recommend, load, current, margin, window_s
            )
            if c.once:
                decision = Decision(None if recommended == current else recommended, "one decision (--once)")
            else:
                decision = hysteresis.decide(now, current, recommended)
            if held:
                decision = Decision(decision.target, held)
            action = "scale" if decision.target else "hold"
            record = {"load": asdict(load), "current": current, "recommended": recommended, "action": action}
            print(json.dumps({**record, "why": decision.why}), flush=True)
            target = None if stop.is_set() else decision.target  # stopping: no new scale
            if target and (c.dry_run or await _scale(addr, credentials, target)):
                hysteresis.applied(loop.time())  # only a scale made starts the cooldown (a dry run: as if made)
                made = target
            if c.once:
                return 0
        await _pause(stop, c.interval_s)
    return 0


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleeps `seconds`, or less when `stop` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _scale(addr: str, credentials: ClientCredentials, target: dict[str, int]) -> bool:
    """Whether the router took the counts; refused or unreachable: the next decision tries again."""
    try:
        await scale_workers(addr, credentials, target)
    except grpc.aio.AioRpcError as e:
        log.error("ScaleWorkers %s refused: %s: %s", target, e.code().name, e.details())
        return False
    return True
