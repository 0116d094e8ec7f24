"""What a person reads: the summary and comparison tables, the result JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from loadgen.metrics import PERCENTILES, distserve_goodput, percentile_stat

COUNTS = [
    ("completed", "Successful requests"),
    ("failed", "Failed requests (rejected included)"),
    ("rejected", "Rejected (RESOURCE_EXHAUSTED)"),
    ("total_input_tokens", "Total input tokens"),
    ("total_output_tokens", "Total generated tokens"),
]
RATES = [
    ("duration", "Benchmark duration (s)"),
    ("achieved_request_rate", "Achieved send rate (req/s)"),
    ("p50_send_lag_ms", "Median send lag (ms)"),
    ("p99_send_lag_ms", "P99 send lag (ms)"),
    ("max_send_lag_ms", "Max send lag (ms)"),
    ("max_concurrency_wait_ms", "Max concurrency wait (ms)"),
    ("request_throughput", "Request throughput (req/s)"),
    ("request_goodput", "Goodput, vLLM's (good req/s)"),
    ("slo_attainment", "SLO attainment"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("total_token_throughput", "Total token throughput (tok/s)"),
]
METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL per chunk", "token_itl": "ITL per token", "e2el": "E2EL"}


def latency_rows(percentiles: list[float]) -> list[tuple[str, str]]:
    """Each latency's mean, median, std and the percentiles the run asked for (--metric-percentiles)."""
    stats = ["mean", "median", "std", *(percentile_stat(p) for p in percentiles)]
    return [
        (f"{stat}_{m}_ms", f"{stat.capitalize()} {name} (ms)") for m, name in METRIC_NAMES.items() for stat in stats
    ]


def _percentiles(*runs: dict[str, Any]) -> list[float]:
    """The percentiles the runs' files hold: those they name, or loadgen's default (a vLLM file, an older one)."""
    return sorted({p for run in runs for p in run.get("metric_percentiles", PERCENTILES)})


def _time_to_reject_rows(percentiles: list[float]) -> list[tuple[str, str]]:
    stats = ["median", *(percentile_stat(p) for p in percentiles)]
    return [(f"{stat}_time_to_reject_ms", f"{stat.capitalize()} time to reject (ms)") for stat in stats]


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int | str):
        return str(value)
    return f"{value:.2f}"


def rate_label(result: dict[str, Any]) -> str:
    rate = result["request_rate"]
    if result.get("dataset_name") == "trace":
        return "trace timestamps"
    return "all at once" if rate == "inf" else f"{rate:g} req/s"


def summary_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"{result['dataset_name']} @ {rate_label(result)}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, name in COUNTS + RATES:
        table.add_row(name, _fmt(result.get(key)))
    sent = result["completed"] + result["failed"]
    table.add_row("Latencies below: completed requests only", f"{result['completed']} of {sent}")
    percentiles = _percentiles(result)
    for key, name in latency_rows(percentiles) + (_time_to_reject_rows(percentiles) if result["rejected"] else []):
        table.add_row(name, _fmt(result.get(key)))
    if result["failed_by_code"]:
        table.add_row("Failed by code", ", ".join(f"{k}: {v}" for k, v in result["failed_by_code"].items()))
    if result.get("warmup_requests"):
        warmed = f"{result['warmup_completed']} of {result['warmup_requests']} completed"
        table.add_row("Warm-up requests (before the run, in no figure)", warmed)
    if result.get("short_outputs"):
        table.add_row("Completed short of max_tokens", str(result["short_outputs"]))
    return table


def comparison_table(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> Table:
    """Side by side; the ratio is B / A."""
    table = Table(title=f"{label_a} ({rate_label(a)}) vs {label_b} ({rate_label(b)})", title_justify="left")
    for column, justify in (("metric", "left"), (label_a, "right"), (label_b, "right"), ("B / A", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for key, name in COUNTS + RATES + latency_rows(_percentiles(a, b)):
        va, vb = _figure(a, key), _figure(b, key)
        ratio = vb / va if isinstance(va, int | float) and isinstance(vb, int | float) and va else None
        table.add_row(name, _fmt(va), _fmt(vb), "-" if ratio is None else f"{ratio:.2f}x")
    return table


def _figure(run: dict[str, Any], key: str) -> Any:
    """A run's figure; no latency where no request completed (a file of vLLM's, or loadgen's before it wrote
    null, has 0 there, which a ratio would read as infinitely fast)."""
    latency = any(key.endswith(f"_{metric}_ms") for metric in METRIC_NAMES)
    return None if latency and run.get("completed") == 0 else run.get(key)


Pair = tuple[dict[str, Any] | None, dict[str, Any] | None]


def paired_runs(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> list[Pair]:
    """Two runs as they are; two sweeps' runs matched by rate (a rate one side lacks is paired with None), in
    ascending rate, all at once last: by position, sweeps of different rates compared 1 req/s with 2, and a sweep
    run as `--request-rate 0.5,2,1` listed its rates in that order."""
    if len(runs_a) == 1 and len(runs_b) == 1:
        return [(runs_a[0], runs_b[0])]
    left: dict[str, list[dict[str, Any]]] = {}
    for b in runs_b:
        left.setdefault(rate_label(b), []).append(b)
    pairs: list[Pair] = [(a, left[rate_label(a)].pop(0) if left.get(rate_label(a)) else None) for a in runs_a]
    pairs += [(None, b) for rest in left.values() for b in rest]
    return sorted(pairs, key=lambda pair: _rate_value(next(run for run in pair if run is not None)))


def _rate_value(run: dict[str, Any]) -> float:
    """The run's request rate as a number ("inf", as vLLM writes it, is infinity)."""
    rate = run["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def sweep_table(pairs: list[Pair], label_a: str, label_b: str, attainment_target: float) -> Table:
    """The headline of two sweeps: vLLM's goodput, attainment and p99 TPOT per rate; DistServe's goodput of each
    sweep (the highest rate whose attainment reaches the target) beneath."""
    table = Table(title=f"{label_a} vs {label_b} across the sweep (ratio B / A)", title_justify="left")
    columns = ("vLLM goodput A", "vLLM goodput B", "B / A", "attain A", "attain B", "p99 TPOT A", "p99 TPOT B")
    for column in ("rate", *columns):
        table.add_column(column, justify="right")
    sweeps = ([a for a, _ in pairs if a is not None], [b for _, b in pairs if b is not None])
    a_rate, b_rate = (distserve_goodput(runs, attainment_target) for runs in sweeps)
    table.caption = (
        f"DistServe goodput (highest rate with SLO attainment >= {attainment_target:g}): "
        f"A {distserve_label(a_rate)}, B {distserve_label(b_rate)}"
    )
    table.caption_justify = "left"
    for pair in pairs:
        a, b = (run or {} for run in pair)
        labels = [rate_label(run) for run in pair if run is not None]
        rate = labels[0] if len(set(labels)) == 1 else " / ".join(labels)
        ga, gb = a.get("request_goodput"), b.get("request_goodput")
        ratio = f"{gb / ga:.2f}x" if ga and gb is not None else "-"
        attainment = (_fmt(a.get("slo_attainment")), _fmt(b.get("slo_attainment")))
        tpot = (_fmt(a.get("p99_tpot_ms")), _fmt(b.get("p99_tpot_ms")))
        table.add_row(rate, _fmt(ga), _fmt(gb), ratio, *attainment, *tpot)
    return table


def distserve_label(rate: float | None) -> str:
    return "none met" if rate is None else f"{rate:g} req/s"


def distserve_result(runs: list[dict[str, Any]], attainment_target: float) -> dict[str, Any] | None:
    """A sweep's DistServe goodput with the target and SLO bounds it was measured against; None without bounds."""
    if not runs or not runs[0].get("goodput"):
        return None
    return {
        "request_rate": distserve_goodput(runs, attainment_target),
        "slo_attainment_target": attainment_target,
        "slo": runs[0]["goodput"],
    }


def write_results(path: Path, runs: list[dict[str, Any]], attainment_target: float) -> None:
    """One run: the run's object, as `vllm bench serve` writes it; a sweep: {"runs": [...]}, one per rate, and with
    SLO bounds its `distserve_goodput`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = runs[0] if len(runs) == 1 else {"runs": runs}
    if len(runs) > 1 and (distserve := distserve_result(runs, attainment_target)) is not None:
        data["distserve_goodput"] = distserve
    path.write_text(json.dumps(data, indent=1))


def load_runs(path: Path) -> list[dict[str, Any]]:
    """A result file's runs; ValueError (naming the file and what is wrong) for one that is not a result."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    runs = data.get("runs", [data]) if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and "request_rate" in r for r in runs):
        raise ValueError(f'{path}: not a loadgen result (one run\'s object with request_rate, or {{"runs": [...]}})')
    return runs


def json_rate(rate: float) -> float | str:
    """JSON has no infinity; vLLM writes the string "inf"."""
    return "inf" if math.isinf(rate) else rate
