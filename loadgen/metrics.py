"""The metric definitions, as `vllm bench serve` has them, as pure functions of the client's records.

Per request: TTFT is send -> first message carrying tokens; E2EL is send -> last message (a hold by the
concurrency bound, RequestRecord.wait_s, is before the send, in neither, as vLLM times them); TPOT is
(E2EL - TTFT) / (output tokens - 1), defined for two or more tokens. Two ITLs: `itl` is vLLM's, per chunk: each
gap between consecutive token-carrying messages, one per message however many tokens it carries (what a reader of
the stream waits between updates; pdserve merges the tokens a slow reader missed into one message, so it exceeds
the per-token gap). `token_itl` is SGLang's, per token: each such gap spread over the message's k tokens, k values
of gap / k; only for a request whose messages say how many tokens each carries (an OpenAI stream's chunks do not:
one counted per chunk, its per-token ITL is known when the usage's total agrees).
A request is good when it completed and meets every goodput bound; `request_goodput` is vLLM's goodput, good
requests per second of the run, SLO attainment the share of all sent requests that were good. DistServe's
goodput is a sweep's figure, not a run's: the highest request rate swept whose SLO attainment reaches a target.
The throughputs and vLLM's goodput divide by the run's duration, its clock start (the arrivals' 0, a drawn gap
before the first send) to its last answer, as vLLM's do; genai-perf's runs from the first send.
The latency figures are over the completed requests only (`completed` says how many); with none completed they
are None (null), not 0, which read as the best latency of all. Time to reject is each shed request's send ->
its refusal.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.record import REJECTED, RequestRecord

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (90, 99)
DEFAULT_ATTAINMENT_TARGET = 0.9  # DistServe's: 90% of requests within the SLOs


@dataclass(frozen=True)
class GoodputSLO:
    """Upper bounds in milliseconds; None leaves the metric unbounded."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> GoodputSLO:
        """From `--goodput ttft:500 tpot:50`."""
        bounds: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput bound must be a number of ms, got {item!r}") from None
            if not ms > 0:
                raise ValueError(f"--goodput bound must be > 0 ms, got {item!r}")
            bounds[f"{name}_ms"] = ms
        return cls(**bounds)

    @property
    def bounded(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}


def ttft_s(record: RequestRecord) -> float | None:
    return next((t for t, n in zip(record.message_times_s, record.message_tokens, strict=True) if n), None)


def e2el_s(record: RequestRecord) -> float | None:
    return record.message_times_s[-1] if record.message_times_s else None


def tpot_s(record: RequestRecord) -> float | None:
    first, last, n = ttft_s(record), e2el_s(record), record.output_tokens
    if first is None or last is None or n < 2:
        return None
    return (last - first) / (n - 1)


def itls_s(record: RequestRecord) -> list[float]:
    times = [t for t, n in zip(record.message_times_s, record.message_tokens, strict=True) if n]
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def token_itls_s(record: RequestRecord) -> list[float] | None:
    """SGLang's: None when the messages' token counts are not the stream's own (they disagree with its usage)."""
    if record.reported_tokens is not None and record.reported_tokens != sum(record.message_tokens):
        return None
    carrying = [(t, n) for t, n in zip(record.message_times_s, record.message_tokens, strict=True) if n]
    return [(t - earlier) / n for (earlier, _), (t, n) in zip(carrying, carrying[1:], strict=False) for _ in range(n)]


def is_good(record: RequestRecord, slo: GoodputSLO) -> bool:
    if not record.completed:
        return False
    for bound, value in ((slo.ttft_ms, ttft_s(record)), (slo.tpot_ms, tpot_s(record)), (slo.e2el_ms, e2el_s(record))):
        if bound is not None and value is not None and value * 1e3 > bound:
            return False
    return True


def distserve_goodput(runs: list[dict[str, Any]], attainment_target: float) -> float | None:
    """DistServe's goodput: the highest request rate swept whose SLO attainment is at least the target; None when
    no rate met it. All at once names no rate, and an interrupted run's attainment is over part of its requests."""
    met = [
        run["request_rate"]
        for run in runs
        if run["request_rate"] != "inf"
        and not run.get("interrupted")
        and (run.get("slo_attainment") or 0.0) >= attainment_target
    ]
    return max(met, default=None)


def summarize(
    records: list[RequestRecord], duration_s: float, slo: GoodputSLO, percentiles: tuple[float, ...] = PERCENTILES
) -> dict[str, Any]:
    """The result fields of `vllm bench serve` (same names and meanings: `failed` is every request that did not
    complete, shed ones included) plus rejected (those shed), failures by status code and SLO attainment."""
    done = [r for r in records if r.completed]
    failures = Counter(r.status for r in records if not r.completed)
    good = sum(is_good(r, slo) for r in records)
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "rejected": sum(r.status == REJECTED for r in records),
        "failed": sum(failures.values()),
        "failed_by_code": dict(failures),
        # Completed with fewer tokens than asked (a server that ignored ignore_eos, or stopped early): still
        # completed, as vLLM counts them, but a run where this is not 0 measured a shorter workload.
        "short_outputs": sum(r.output_tokens < r.output_len for r in done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if slo.bounded else None,
        "slo_attainment": good / len(records) if slo.bounded and records else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    token_itls = [token_itls_s(r) for r in done]
    summary["token_itl_requests"] = sum(gaps is not None for gaps in token_itls)  # those whose token counts are known
    per_request: dict[str, list[float | None]] = {
        "ttft": [ttft_s(r) for r in done],
        "tpot": [tpot_s(r) for r in done],
        "itl": [gap for r in done for gap in itls_s(r)],
        "token_itl": [gap for gaps in token_itls for gap in gaps or ()],
        "e2el": [e2el_s(r) for r in done],
    }
    per_request["time_to_reject"] = [r.error_s for r in records if r.status == REJECTED]
    for name, values in per_request.items():
        summary |= _stats(name, [v * 1e3 for v in values if v is not None], percentiles)
    return summary


def percentile_stat(percentile: float) -> str:
    """A percentile's name in the result's keys, as vLLM names it: p99, p99.9, every digit kept (`:g` wrote
    99.99999 as p100, the maximum's key)."""
    return f"p{int(percentile)}" if percentile == int(percentile) else f"p{percentile!r}"


def _stats(name: str, ms: list[float], percentiles: tuple[float, ...]) -> dict[str, float | None]:
    """Mean, median, std and percentiles; None when there are no values (vLLM's 0 reads as infinitely fast)."""
    stats = ["mean", "median", "std", *(percentile_stat(p) for p in percentiles)]
    keys = [f"{stat}_{name}_ms" for stat in stats]
    if not ms:
        return dict.fromkeys(keys)
    values = np.asarray(ms)
    figures = [values.mean(), np.median(values), values.std()] + [np.percentile(values, p) for p in percentiles]
    return {key: float(figure) for key, figure in zip(keys, figures, strict=True)}
