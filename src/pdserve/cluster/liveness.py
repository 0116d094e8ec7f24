"""The controller's liveness: whether its supervision loop still ends passes. /metrics is served from a thread of
its own, so a controller whose loop hangs (a blocking call on its event loop, a deadlock) would still answer
scrapes and look alive while it heals nothing; /healthz, beside /metrics, answers from this instead, and the
chart's livenessProbe asks it, so that the kubelet restarts such a controller (the workers, detached, serve on)."""

from __future__ import annotations

from pdserve.cluster.supervisor import Supervisor

# Passes the loop may miss before it counts as hung: a loaded machine, or a slow call on the event loop, costs a few.
STALE_PASSES = 10


class SupervisionLiveness:
    """Healthy while the supervisor's last pass is at most `bound_s` old: STALE_PASSES check intervals, plus a
    check's timeout (a pass itself waits on none, but the event loop it shares with the checks may)."""

    def __init__(self, supervisor: Supervisor, interval_s: float) -> None:
        self.supervisor = supervisor
        self.bound_s = STALE_PASSES * interval_s + supervisor.check_timeout_s

    def problem(self) -> str | None:
        """None while the loop makes progress; otherwise why not, for /healthz's 503."""
        passed_at = self.supervisor.passed_at
        if passed_at is None:
            return "the worker supervision has not ended a pass yet"
        age = self.supervisor.clock() - passed_at
        if age <= self.bound_s:
            return None
        return f"the worker supervision's last pass ended {age:.1f} s ago (bound {self.bound_s:g} s): its loop is stuck"
