"""The metric names and meanings, a contract (docs/architecture.md, "Metrics"; docs/observability.md#metrics), of
the router, the workers and the launcher's supervision."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from pdserve.build import current_build
from pdserve.telemetry import (
    LATENCY_BUCKETS_S,
    STEP_BUCKETS_S,
    STEP_TOKEN_BUCKETS,
    TOKEN_BUCKETS_S,
    TRANSFER_BUCKETS_S,
)

if TYPE_CHECKING:
    from pdserve.cluster.worker_spec import WorkerSpec
    from pdserve.registry.base import WorkerState

# Why a KV transfer failed (pdserve.transfer.failures says which is which), a fixed set: each is exported from 0.
KV_TRANSFER_FAILURE_REASONS = ("peer_gone", "timeout", "cancelled", "error")
# How a request ended (services/router/outcome.py says which is which), and how it moved: fixed sets, each exported
# from 0 for every tenant the router knows, so that a rate sees the first deadline passed or request refused.
REQUEST_OUTCOMES = (
    "finished",
    "invalid",
    "unauthenticated",
    "denied",
    "rejected",
    "cancelled",
    "deadline_exceeded",
    "failed",
)
FINISH_REASONS = ("length", "stop", "eos")
# Why a `rejected` request was refused (OverloadedError.reason, or the router draining): admission's sheds (the
# router's in-flight cap, a prefill queue full, a predicted TTFT or TPOT past its SLO, no decode worker with the KV
# room or a place in its batch, the room kept for a higher priority or for tenants below their share), a worker's own
# refusal that no retry got past, the API key's quotas, a drain, live workers none of which may be paired (a rollout's
# gap between its halves: services/router/kv_pairing.py).
REJECTION_REASONS = (
    "in_flight",
    "queue",
    "ttft",
    "tpot",
    "kv",
    "batch",
    "priority",
    "fair_share",
    "worker",
    "quota",
    "draining",
    "unpaired",
)
MOVE_KINDS = ("retry", "migration")
SLO_JUDGEMENTS = ("met", "missed")


class RouterMetrics:
    """Request latencies as the router sees them (it relays every token), and how requests ended."""

    def __init__(
        self,
        meter: Meter,
        tenants: Iterable[str] = (),
        in_flight: Mapping[str, int] | None = None,
        slo_labels: Iterable[str] = ("own", "default"),
    ) -> None:
        """`in_flight`: the streams per tenant (admission's), read at each scrape; `slo_labels`: which SLO a request
        may be judged by (services/router/slo_attainment.py)."""
        self.ttft = meter.create_histogram(
            "pdserve_time_to_first_token_seconds",
            unit="s",
            description="from the request's arrival at the router to its first token",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.tpot = meter.create_histogram(
            "pdserve_time_per_output_token_seconds",
            unit="s",
            description="(end-to-end - TTFT) / (tokens - 1), per request of two or more tokens",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS_S,
        )
        self.itl = meter.create_histogram(
            "pdserve_inter_token_latency_seconds",
            unit="s",
            description="each token's gap after the first (tokens of one message share its gap)",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS_S,
        )
        self.e2e = meter.create_histogram(
            "pdserve_e2e_request_latency_seconds",
            unit="s",
            description="from the request's arrival to its last token, finished requests",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.requests = meter.create_counter("pdserve_requests_total", description="requests by outcome")
        # A counter of its own rather than a label on requests_total: that one's series stay as they were.
        self.successes = meter.create_counter(
            "pdserve_request_success_total", description="finished requests by finish reason (length, stop, eos)"
        )
        self.prompt_tokens = meter.create_counter(
            "pdserve_prompt_tokens_total", description="prompt tokens of requests served a first message, once each"
        )
        self.generation_tokens = meter.create_counter(
            "pdserve_generation_tokens_total", description="tokens relayed to callers, over all of a request's attempts"
        )
        self.slo = meter.create_counter(
            "pdserve_requests_slo_total",
            description="finished requests by whether their TTFT and TPOT met the SLO they were held to (slo: their "
            "own, their priority class's, the default): attainment is the share with both met",
        )
        self._slo_labels = tuple(dict.fromkeys(slo_labels))
        self.rejections = meter.create_counter(
            "pdserve_requests_rejected_total",
            description="requests counted as rejected in pdserve_requests_total, by why: an admission shed, a "
            "worker's refusal, a quota, a draining router",
        )
        self.moves = meter.create_counter(
            "pdserve_request_moves_total", description="requests placed again after a worker failed them, by kind"
        )
        self.ejections = meter.create_counter(
            "pdserve_worker_ejections_total",
            description="workers this router took out of placement, by reason (a failure, a bound, a drain): "
            "a worker ejected again and again is flapping",
        )
        built = {"role": "router", "build": current_build()}
        meter.create_observable_gauge(
            "pdserve_build_info",
            callbacks=[lambda options: [Observation(1, built)]],
            description="1, labelled with the build this router runs: count by build follows a rollout",
        )
        for kind in MOVE_KINDS:
            self.moves.add(0, {"kind": kind})
        self._tenants: set[str] = set()
        self._in_flight = {} if in_flight is None else in_flight
        meter.create_observable_gauge(
            "pdserve_requests_in_flight",
            callbacks=[self._observe_in_flight],
            description="requests streaming through this router by tenant: what its fair share of them judges",
        )
        self.count_from_zero(tenants)

    def _observe_in_flight(self, options: CallbackOptions) -> list[Observation]:
        """Every known tenant's, 0 when it has none: a series that vanished would read as no data, not as none."""
        counts = dict(self._in_flight)
        return [Observation(counts.get(t, 0), {"tenant": t}) for t in sorted(self._tenants | counts.keys())]

    def count_from_zero(self, tenants: Iterable[str]) -> None:
        """Each of `tenants`' series exported from 0 (a tenant known at start, or added by a key reload): the first
        request of an outcome is then an increase a rate sees, not a new series at 1. "" (not authenticated) has
        only `unauthenticated`. Counting 0 again is nothing, so a reload passes every tenant."""
        for tenant in tenants:
            labels = {"tenant": tenant}
            for outcome in REQUEST_OUTCOMES if tenant else ("unauthenticated",):
                self.requests.add(0, {"outcome": outcome, **labels})
            if not tenant:
                continue
            self._tenants.add(tenant)
            for reason in FINISH_REASONS:
                self.successes.add(0, {"finish_reason": reason, **labels})
            for reason in REJECTION_REASONS:
                self.rejections.add(0, {"reason": reason, **labels})
            for slo in self._slo_labels:
                for ttft in SLO_JUDGEMENTS:
                    for tpot in SLO_JUDGEMENTS:
                        self.slo.add(0, {"slo": slo, "ttft": ttft, "tpot": tpot, **labels})
            self.prompt_tokens.add(0, labels)
            self.generation_tokens.add(0, labels)

    def ended(self, outcome: str, tenant: str, e2e_s: float, finish_reason: str) -> None:
        """A request's end: its outcome; a finished one's end-to-end latency and finish reason."""
        self.requests.add(1, {"outcome": outcome, "tenant": tenant})
        if outcome == "finished":
            self.e2e.record(e2e_s, {"tenant": tenant})
            self.successes.add(1, {"finish_reason": finish_reason, "tenant": tenant})

    def slo_judged(self, tenant: str, slo: str, ttft_met: bool, tpot_met: bool) -> None:
        """A finished request's latencies against the SLO (labelled `slo`) it was held to."""
        judged = {"ttft": SLO_JUDGEMENTS[not ttft_met], "tpot": SLO_JUDGEMENTS[not tpot_met]}
        self.slo.add(1, {"slo": slo, **judged, "tenant": tenant})

    def rejected(self, reason: str, tenant: str) -> None:
        """A request counted `rejected`, for `reason` (one of REJECTION_REASONS)."""
        self.rejections.add(1, {"reason": reason, "tenant": tenant})

    def ejected(self, worker: WorkerState, reason: str) -> None:
        """A worker taken out of placement (services/router/ejection.py), once per ejection however many of its
        requests failed meanwhile."""
        self.ejections.add(1, {"worker_id": worker.worker_id, "role": str(worker.role), "reason": reason})


class SupervisionMetrics:
    """What the launcher's supervision did: worker actors replaced after their restarts were used up."""

    def __init__(self, meter: Meter, roles: Iterable[str] = ()) -> None:
        self.replacements = meter.create_counter(
            "pdserve_worker_replacements_total", description="worker actors replaced after their restarts ran out"
        )
        for role in dict.fromkeys(roles):  # from 0, so that increase() (the chart's alert) sees the first replacement
            self.replacements.add(0, {"role": str(role)})

    def replaced(self, spec: WorkerSpec) -> None:
        self.replacements.add(1, {"role": str(spec.role)})


class WorkerMetrics:
    """One worker's load (gauges read from the engine's stats when scraped), its engine steps and its KV traffic."""

    def __init__(self, meter: Meter, worker_id: str, role: str, stats: Callable[[], dict[str, int]]) -> None:
        self.labels = {"worker_id": worker_id, "role": role}
        self._stats, self._meter = stats, meter
        for name, key, what in (
            ("pdserve_queue_tokens", "queued_prefill_tokens", "prompt tokens still to prefill, past cached prefixes"),
            ("pdserve_running_sequences", "running", "sequences in the running batch"),
            ("pdserve_waiting_sequences", "waiting", "sequences waiting for the batch: new, or preempted to recompute"),
            ("pdserve_kv_blocks_used", "kv_blocks_used", "KV blocks held by live sequences or transfers"),
            ("pdserve_kv_blocks_cached", "kv_blocks_cached", "KV blocks kept only by the prefix cache"),
            (
                "pdserve_kv_blocks_owed",
                "kv_blocks_owed",
                "free KV blocks a decode worker's preempted and growing sequences will need: no hand-off takes them",
            ),
            ("pdserve_kv_blocks_total", "kv_blocks_total", "KV blocks in the cache"),
        ):
            meter.create_observable_gauge(name, callbacks=[self._gauge(key)], description=what)
        built = {**self.labels, "build": current_build()}
        meter.create_observable_gauge(
            "pdserve_build_info",
            callbacks=[lambda options: [Observation(1, built)]],
            description="1, labelled with the build this worker runs: count by build follows a rollout",
        )
        meter.create_observable_counter(
            "pdserve_prefix_cache_hits_total",
            callbacks=[lambda options: [Observation(self._stats().get("prefix_hits", 0), self.labels)]],
            description="KV blocks served from the prefix cache instead of computed",
        )
        meter.create_observable_counter(
            "pdserve_preemptions_total",
            callbacks=[lambda options: [Observation(self._stats().get("preemptions", 0), self.labels)]],
            description="sequences preempted for want of KV blocks, to be recomputed (their streams wait meanwhile)",
        )
        self.step_seconds = meter.create_histogram(
            "pdserve_engine_step_seconds",
            unit="s",
            description="one engine step's wall time, steps that ran tokens (prefill chunks and decodes together)",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
        )
        self.step_tokens = meter.create_histogram(
            "pdserve_engine_step_tokens",
            description="tokens in one engine step's batch (prompt tokens prefilled plus sequences decoded)",
            explicit_bucket_boundaries_advisory=STEP_TOKEN_BUCKETS,
        )
        # TTFT's buckets: a queue time is read against the router's TTFT bound for bound.
        self.queue_seconds = meter.create_histogram(
            "pdserve_request_queue_time_seconds",
            unit="s",
            description="from a request's arrival in the engine (a decode worker: its KV committed) to the start of "
            "the first step that ran it, once a request (not its recompute); one dropped before it ran is not counted",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.preemption_wait_seconds = meter.create_histogram(
            "pdserve_preemption_wait_seconds",
            unit="s",
            description="from a sequence's preemption to the start of the step that ran it again (its recompute), "
            "once a preemption: the time it lost waiting; one dropped while it waited is not counted",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.prefill_seconds = meter.create_histogram(
            "pdserve_request_prefill_time_seconds",
            unit="s",
            description="prefill and colocated workers: from the first step that ran a prompt's start to its first "
            "token, once a prompt however many chunks or recomputes it took",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.transfer_bytes = meter.create_counter(
            "pdserve_kv_transfer_bytes_total", description="KV bytes sent to decode workers"
        )
        self.transfer_seconds = meter.create_histogram(
            "pdserve_kv_transfer_seconds",
            unit="s",
            description="one prompt's KV sent to its decode worker, transfers that succeeded",
            explicit_bucket_boundaries_advisory=TRANSFER_BUCKETS_S,
        )
        self.transfer_failures = meter.create_counter(
            "pdserve_kv_transfer_failures_total",
            description="KV transfers that failed, by reason, on the side that saw them: a decode worker's receives, "
            "a prefill worker's sends",
        )
        if role != "colocated":  # from 0, so that a rate sees the first failure
            for reason in KV_TRANSFER_FAILURE_REASONS:
                self.transfer_failures.add(0, {**self.labels, "reason": reason})

    def track_speed(self, factor: Callable[[], float]) -> None:
        """Once the worker's start-up profile is measured: its live correction, read when scraped. A worker priced
        slow gets no traffic at low load (the router places by profile times factor), so this says why."""
        self._meter.create_observable_gauge(
            "pdserve_worker_speed_factor",
            callbacks=[lambda options: [Observation(factor(), self.labels)]],
            description="measured over profiled step time (live steps, and an idle worker's own timed prompts): "
            "2 = priced twice as slow as its start-up profile",
        )

    def stepped(self, tokens: int, seconds: float) -> None:
        """One engine step, on the engine thread (OTel's instruments are thread-safe): a dashboard reads step
        latency and batch fill per worker, which the request latencies blur over the whole cluster."""
        self.step_seconds.record(seconds, self.labels)
        self.step_tokens.record(tokens, self.labels)

    def requests_timed(self, queue_s: list[float], prefill_s: list[float], requeue_s: list[float]) -> None:
        """One step's requests, on the engine thread (AsyncEngine.on_request_times), each once: a prefill queue time
        rising while prefill time holds is prompts waiting for a prefill worker, not longer prompts. A request
        cancelled before any step ran it has no queue time (as recent vLLM). `requeue_s`: once a preemption."""
        for seconds in queue_s:
            self.queue_seconds.record(seconds, self.labels)
        for seconds in prefill_s:
            self.prefill_seconds.record(seconds, self.labels)
        for seconds in requeue_s:
            self.preemption_wait_seconds.record(seconds, self.labels)

    def transfer_failed(self, reason: str) -> None:
        """One KV transfer this worker saw fail, for `reason` (one of KV_TRANSFER_FAILURE_REASONS)."""
        self.transfer_failures.add(1, {**self.labels, "reason": reason})

    def _gauge(self, key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(self._stats().get(key, 0), self.labels)]

        return observe
