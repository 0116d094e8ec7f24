"""One benchmark: the workload sent at each requested rate in turn, each run measured and summarized."""

from __future__ import annotations

import asyncio
import datetime
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rich.console import Console

from loadgen import metrics, provenance
from loadgen.arrivals import schedule
from loadgen.client import BACKENDS, DEFAULT_MAX_CONCURRENCY, Backend, Client, RunInterrupted
from loadgen.metrics import GoodputSLO
from loadgen.pacing import pacing
from loadgen.record import OK, REJECTED, RequestRecord
from loadgen.report import json_rate, summary_table
from loadgen.workload import Request, WorkloadConfig, build_workload
from pdserve.config import EngineConfig
from pdserve.progress import counting
from pdserve.request_rate import check_span
from pdserve.rpc.client_hints import with_hint
from pdserve.rpc.credentials import ClientCredentials
from pdserve.v1 import generate_pb2 as pb

PROMPTS_STREAM, ARRIVALS_STREAM, CHECK_STREAM, WARMUP_STREAM = 0, 1, 2, 3  # independent generators from the seed


class ClusterCheckFailed(RuntimeError):
    """The single request sent before the runs did not complete."""


class CheckRequestInvalid(ClusterCheckFailed):
    """The server refused the single request as invalid: the workload the flags drew (a prompt past the model's
    context, ids outside its vocabulary, an SLO no worker meets) is a usage error, as a bad flag is."""


@dataclass(frozen=True)
class BenchmarkConfig:
    address: str  # grpc: the router's HOST:PORT; openai backends: the server's base URL
    workload: WorkloadConfig
    model: str = EngineConfig.model
    backend: str = "grpc"  # one of BACKENDS
    endpoint: str | None = None  # openai backends: the path; default /v1/completions or /v1/chat/completions
    served_model_name: str | None = None  # openai backends: the `model` sent; default `model`
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: GoodputSLO = field(default_factory=GoodputSLO)
    seed: int = 0
    send_slo: bool = False  # put the goodput TTFT/TPOT bounds into each request, for the router's admission
    priority: int = 0  # sent with each request: higher is admitted and scheduled first when capacity is short
    warmup_requests: int = 0  # sent all at once and awaited at the start of each rate, in no figure
    metric_percentiles: tuple[float, ...] = metrics.PERCENTILES  # of every latency, as vLLM's --metric-percentiles
    credentials: ClientCredentials | None = None  # TLS and API key (None: plaintext, no key)

    def __post_init__(self) -> None:
        check_span(self.workload.num_prompts, min(self.request_rates), "--request-rate", "--num-prompts")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.send_slo and self.slo.ttft_ms is None and self.slo.tpot_ms is None:
            # A bound of 0 is the server's default (the proto's SLO): sent, it changed nothing but the result's record.
            raise ValueError(
                "--send-slo sends the --goodput ttft and tpot bounds with each request; give at least one "
                "(--goodput ttft:MS tpot:MS): without, every request would go with the server's default SLO"
            )


def make_backend(config: BenchmarkConfig) -> Backend:
    """The protocol the workload goes over; the same requests, timings and summary whichever it is."""
    bounds = {"ttft_ms": config.slo.ttft_ms or 0.0, "tpot_ms": config.slo.tpot_ms or 0.0}
    if config.backend == "grpc":
        from loadgen.grpc_backend import GrpcBackend

        slo = pb.SLO(**bounds) if config.send_slo else None
        return GrpcBackend(config.address, slo, config.credentials, config.priority)
    from loadgen.openai_backend import OpenAIBackend

    chat = config.backend == "openai-chat"
    return OpenAIBackend(
        config.address,
        config.served_model_name or config.model,
        chat,
        config.endpoint,
        {k: v for k, v in bounds.items() if v} if config.send_slo else None,
        _detokenizer(config.model) if chat else None,
        config.credentials,
        config.priority,
    )


def _detokenizer(model: str) -> Callable[[list[int]], str]:
    from pdserve.engine.model_files import tokenizer_folder
    from pdserve.engine.models import resolve_model
    from pdserve.engine.tokenizer import Tokenizer

    return Tokenizer(tokenizer_folder(resolve_model(model))).decode


def run_benchmark(
    config: BenchmarkConfig, console: Console, on_result: Callable[[list[dict[str, Any]]], None] = lambda _: None
) -> list[dict[str, Any]]:
    """One result per rate. Each run draws fresh prompts from (seed, run index): same seed, same benchmark.
    `on_result` gets the results so far after each rate (a sweep stopped midway keeps the rates it ran). Ctrl-C
    raises KeyboardInterrupt once `on_result` has had the interrupted rate's result, marked `interrupted`."""
    client = Client(make_backend(config), config.max_concurrency)
    check_rng = np.random.default_rng([config.seed, CHECK_STREAM])
    check = build_workload(replace(config.workload, num_prompts=1), check_rng)[0]
    try:
        record = asyncio.run(client.check(replace(check, arrival_s=0.0)))
    except RunInterrupted:
        raise KeyboardInterrupt from None
    if record.status not in (OK, REJECTED):  # shed by admission is an answer: the cluster serves
        message = (
            f"the check request failed: {record.status}: {with_hint(record.status, record.error, config.credentials)}"
        )
        if record.status != "INVALID_ARGUMENT":
            raise ClusterCheckFailed(message)
        if "vocabulary" in record.error:  # ids drawn for another model's (pdserve: "outside", vLLM: "out of")
            message += f" (the prompts were drawn for --model {config.model}: pass the model the server serves)"
        raise CheckRequestInvalid(message)
    warn = Console(stderr=True, soft_wrap=True)  # a warning stays one line, whole for grep
    results = []
    for i, rate in enumerate(config.request_rates):
        requests = drawn_requests(config, i, rate)
        trace = config.workload.dataset_name == "trace"
        if trace:  # a trace brings its own arrival times: its rate is the one they offer
            rate = offered_rate(requests)
        interrupted: RunInterrupted | None = None
        warmed: list[RequestRecord] = []
        with counting(_run_label(rate, trace), len(requests)) as advance:
            try:
                run = client.run(requests, lambda _record: advance(), warmup_requests(config, i), warmed.extend)
                records, duration_s = asyncio.run(run)
            except RunInterrupted as e:
                interrupted, records, duration_s = e, e.records, e.duration_s
        result = build_result(config, rate, records, duration_s, warmed, interrupted=interrupted is not None)
        console.print(summary_table(result))
        for warning in result["warnings"]:
            warn.print(f"loadgen: warning: {warning}", style="yellow", markup=False)
        results.append(result)
        on_result(results)
        if interrupted is not None:
            raise KeyboardInterrupt from interrupted
    return results


def drawn_requests(config: BenchmarkConfig, run_index: int, rate: float) -> list[Request]:
    """The run's prompts, from (seed, run index): each rate its own, so no rate hits the prefix cache another filled;
    its arrivals (a trace has its own) from a generator of their own, so they depend on the seed, rate,
    burstiness and count alone: drawn from the prompts' generator, changing a length moved every arrival."""
    requests = build_workload(config.workload, np.random.default_rng([config.seed, PROMPTS_STREAM, run_index]))
    if config.workload.dataset_name == "trace":
        return requests
    return schedule(requests, rate, config.burstiness, np.random.default_rng([config.seed, ARRIVALS_STREAM]))


def warmup_requests(config: BenchmarkConfig, run_index: int) -> list[Request]:
    """The rate's warm-up prompts, from a generator of their own: its measured prompts and arrivals stay those of
    a run without them, and the warm-up fills no prefix cache the measured prompts would hit."""
    if not config.warmup_requests:
        return []
    workload = replace(config.workload, num_prompts=config.warmup_requests)
    return build_workload(workload, np.random.default_rng([config.seed, WARMUP_STREAM, run_index]))


def _run_label(rate: float, trace: bool) -> str:
    if trace:
        return "requests at trace timestamps"
    return "requests all at once" if math.isinf(rate) else f"requests at {rate:g}/s"


def offered_rate(requests: list[Request]) -> float:
    """A trace's: its gaps per second, (n - 1) / (last - first arrival), as `pdserve plan` reads a trace. Its first
    request goes at 0, not after a gap as vLLM's scaled arrivals' first does, so n / last overstated it (two lines
    1 s apart offered 2 req/s). A trace whose requests all share one timestamp offers them all at once."""
    arrivals = [r.arrival_s for r in requests]
    span_s = max(arrivals) - min(arrivals)
    return (len(requests) - 1) / span_s if span_s > 0 else math.inf


def build_result(
    config: BenchmarkConfig,
    rate: float,
    records: list[RequestRecord],
    duration_s: float,
    warmed: list[RequestRecord] | None = None,
    interrupted: bool = False,
) -> dict[str, Any]:
    """`interrupted`: Ctrl-C cut the run short; its records are the requests sent by then, those in flight
    CANCELLED, so its figures are over part of the workload and no measurement of the rate. `warmed`: the warm-up
    requests' records, counted apart and in no figure."""
    warmed = warmed or []
    end = datetime.datetime.now(datetime.UTC)
    workload = config.workload
    return {
        "date": end.astimezone().strftime("%Y%m%d-%H%M%S"),  # vLLM's: local time, no zone
        "start_time": (end - datetime.timedelta(seconds=duration_s)).isoformat(),  # the clock start: arrivals' 0, UTC
        "end_time": end.isoformat(),
        "loadgen_version": provenance.version(),
        "git_commit": provenance.git_commit(),
        "backend": config.backend,
        "model_id": config.model,
        "served_model_name": config.served_model_name,
        "address": config.address,
        "endpoint": config.endpoint,
        "dataset_name": workload.dataset_name,
        "num_prompts": len(records),
        "random_input_len": workload.random_input_len,
        "random_output_len": workload.random_output_len,
        "random_range_ratio": workload.random_range_ratio,
        "prefix_repetition_prefix_len": workload.prefix_len,
        "prefix_repetition_suffix_len": workload.suffix_len,
        "prefix_repetition_num_prefixes": workload.num_prefixes,
        "prefix_repetition_output_len": workload.prefix_output_len,
        "trace": None if workload.trace is None else str(workload.trace),
        "request_rate": json_rate(rate),
        "burstiness": None if config.workload.dataset_name == "trace" else config.burstiness,
        "max_concurrency": config.max_concurrency or DEFAULT_MAX_CONCURRENCY,  # the bound in force, never null
        "concurrency_wait_in_latency": False,  # a request's wait for that bound (wait_ms) is before its send
        "seed": config.seed,
        "goodput": config.slo.as_dict(),
        "send_slo": config.send_slo,
        "priority": config.priority,
        "interrupted": interrupted,
        "warmup_requests": len(warmed),
        "warmup_completed": sum(r.completed for r in warmed),
        "warmup_failed_by_code": dict(Counter(r.status for r in warmed if not r.completed)),
        "metric_percentiles": list(config.metric_percentiles),
        **pacing(records, rate, config.workload.dataset_name == "trace", interrupted),
        **metrics.summarize(records, duration_s, config.slo, config.metric_percentiles),
        "requests": [_record_json(r, config.slo) for r in records],
    }


def _record_json(record: RequestRecord, slo: GoodputSLO) -> dict[str, Any]:
    """The raw timings and the per-request metrics derived from them, in milliseconds."""
    return {
        "request_id": record.request_id,
        "status": record.status,
        "error": record.error,
        "error_ms": _ms(record.error_s),  # did not complete: send -> its error
        "input_len": record.input_len,
        "output_len": record.output_len,
        "output_tokens": record.output_tokens,
        "scheduled_ms": record.scheduled_s * 1e3,
        "start_ms": record.start_s * 1e3,
        "wait_ms": record.wait_s * 1e3,  # held back by the concurrency bound before its send: in no latency
        "ttft_ms": _ms(metrics.ttft_s(record)),
        "tpot_ms": _ms(metrics.tpot_s(record)),
        "e2el_ms": _ms(metrics.e2el_s(record)),
        "good": metrics.is_good(record, slo) if slo.bounded else None,
        "message_times_ms": [t * 1e3 for t in record.message_times_s],
        "message_tokens": record.message_tokens,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
