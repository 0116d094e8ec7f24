"""One benchmark: the workload sent at each requested rate in turn, each run measured and summarized."""

from __future__ import annotations

import asyncio
import datetime
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rich.console import Console

from loadgen import metrics
from loadgen.arrivals import schedule
from loadgen.client import Client
from loadgen.metrics import GoodputSLO
from loadgen.record import OK, REJECTED, RequestRecord
from loadgen.report import json_rate, summary_table
from loadgen.workload import WorkloadConfig, build_workload
from pdserve.config import EngineConfig
from pdserve.progress import counting
from pdserve.rpc.credentials import ClientCredentials
from pdserve.v1 import generate_pb2 as pb


class ClusterCheckFailed(RuntimeError):
    """The single request sent before the runs did not complete."""


@dataclass(frozen=True)
class BenchmarkConfig:
    address: str
    workload: WorkloadConfig
    model: str = EngineConfig.model
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: GoodputSLO = field(default_factory=GoodputSLO)
    seed: int = 0
    send_slo: bool = False  # put the goodput TTFT/TPOT bounds into each request, for the router's admission
    credentials: ClientCredentials | None = None  # TLS and API key (None: plaintext, no key)


def run_benchmark(config: BenchmarkConfig, console: Console) -> list[dict[str, Any]]:
    """One result per rate. Each run draws fresh prompts from (seed, run index): same seed, same benchmark."""
    slo = pb.SLO(ttft_ms=config.slo.ttft_ms or 0, tpot_ms=config.slo.tpot_ms or 0) if config.send_slo else None
    client = Client(config.address, config.max_concurrency, slo, config.credentials)
    check_rng = np.random.default_rng([config.seed, len(config.request_rates)])
    check = build_workload(replace(config.workload, num_prompts=1), check_rng)[0]
    record = asyncio.run(client.check(replace(check, arrival_s=0.0)))
    if record.status not in (OK, REJECTED):  # shed by admission is an answer: the cluster serves
        raise ClusterCheckFailed(f"the check request failed: {record.status}: {record.error}")
    results = []
    for i, rate in enumerate(config.request_rates):
        rng = np.random.default_rng([config.seed, i])
        requests = build_workload(config.workload, rng)
        trace = config.workload.dataset_name == "trace"
        if not trace:  # a trace brings its own arrival times
            requests = schedule(requests, rate, config.burstiness, rng)
        with counting(_run_label(rate, trace), len(requests)) as advance:
            records, duration_s = asyncio.run(client.run(requests, lambda _record: advance()))
        result = build_result(config, rate, records, duration_s)
        console.print(summary_table(result))
        results.append(result)
    return results


def _run_label(rate: float, trace: bool) -> str:
    if trace:
        return "requests at trace timestamps"
    return "requests all at once" if math.isinf(rate) else f"requests at {rate:g}/s"


def build_result(
    config: BenchmarkConfig, rate: float, records: list[RequestRecord], duration_s: float
) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "pdserve",
        "model_id": config.model,
        "address": config.address,
        "dataset_name": config.workload.dataset_name,
        "num_prompts": len(records),
        "request_rate": json_rate(rate),
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "seed": config.seed,
        "goodput": config.slo.as_dict(),
        "send_slo": config.send_slo,
        **metrics.summarize(records, duration_s, config.slo),
        "requests": [_record_json(r, config.slo) for r in records],
    }


def _record_json(record: RequestRecord, slo: GoodputSLO) -> dict[str, Any]:
    """The raw timings and the per-request metrics derived from them, in milliseconds."""
    return {
        "request_id": record.request_id,
        "status": record.status,
        "error": record.error,
        "input_len": record.input_len,
        "output_len": record.output_len,
        "output_tokens": record.output_tokens,
        "scheduled_ms": record.scheduled_s * 1e3,
        "start_ms": record.start_s * 1e3,
        "ttft_ms": _ms(metrics.ttft_s(record)),
        "tpot_ms": _ms(metrics.tpot_s(record)),
        "e2el_ms": _ms(metrics.e2el_s(record)),
        "good": metrics.is_good(record, slo) if slo.bounded else None,
        "message_times_ms": [t * 1e3 for t in record.message_times_s],
        "message_tokens": record.message_tokens,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
