"""PNG figures of one or more labelled runs: TTFT and TPOT CDFs, SLO attainment and vLLM's goodput vs request
rate, with the attainment target and each sweep's DistServe goodput marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display here, and none wanted

import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
import numpy as np  # noqa: E402

from loadgen.metrics import distserve_goodput  # noqa: E402
from loadgen.record import OK  # noqa: E402
from loadgen.report import distserve_label, rate_label  # noqa: E402

Series = dict[str, list[dict[str, Any]]]  # label -> runs (one per request rate)


def write_plots(plot_dir: Path, series: Series, attainment_target: float) -> list[Path]:
    """Returns the files written; the rate plots need finite rates and the SLO ones --goodput bounds."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = [_cdf(plot_dir / f"{m}_cdf.png", series, m) for m in ("ttft", "tpot")]
    runs = [r for rs in series.values() for r in rs]
    if any(r["request_rate"] != "inf" for r in runs) and any(r["request_goodput"] is not None for r in runs):
        attainment, goodput = ("slo_attainment", "SLO attainment"), ("request_goodput", "vLLM goodput (good req/s)")
        written.append(_vs_rate(plot_dir / "slo_attainment.png", series, *attainment, attainment_target))
        written.append(_vs_rate(plot_dir / "goodput.png", series, *goodput, attainment_target))
    return written


def completed_values(run: dict[str, Any], metric: str) -> np.ndarray:
    """The metric's values (ms) of the run's completed requests, sorted: what the summary's percentiles count (a
    request that failed after its first token has a TTFT, but is no completed request)."""
    completed = [r[f"{metric}_ms"] for r in run["requests"] if r["status"] == OK]
    return np.sort([v for v in completed if v is not None])


def _cdf(path: Path, series: Series, metric: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in series.items():
        for run in runs:
            values = completed_values(run, metric)
            if len(values):
                fraction = np.arange(1, len(values) + 1) / len(values)
                ax.step(values, fraction, where="post", label=f"{label} @ {rate_label(run)}")
    bound = next((r["goodput"].get(f"{metric}_ms") for rs in series.values() for r in rs), None)
    if bound is not None:
        ax.axvline(bound, color="black", linestyle="--", linewidth=1, label=f"SLO {bound:g} ms")
    ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of completed requests", title=f"{metric.upper()} CDF")
    ax.set_xscale("log")
    return _save(fig, ax, path)


def _vs_rate(path: Path, series: Series, key: str, ylabel: str, attainment_target: float) -> Path:
    """Each sweep's DistServe goodput is a dashed vertical line in its colour (none where no rate met the target)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in series.items():
        points = sorted((r["request_rate"], r[key]) for r in runs if r["request_rate"] != "inf" and r[key] is not None)
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        distserve = distserve_goodput(runs, attainment_target)
        if distserve is not None:
            ax.axvline(
                distserve,
                color=line.get_color(),
                linestyle="--",
                linewidth=1,
                label=f"{label}: DistServe goodput {distserve_label(distserve)}",
            )
        else:
            line.set_label(f"{label} (DistServe goodput: {distserve_label(None)})")
    if key == "slo_attainment":
        ax.axhline(attainment_target, color="black", linestyle=":", linewidth=1, label=f"target {attainment_target:g}")
    if key == "request_goodput":
        rates = [r["request_rate"] for rs in series.values() for r in rs if r["request_rate"] != "inf"]
        ax.plot([0, max(rates)], [0, max(rates)], color="gray", linestyle=":", label="offered rate")
    ax.set(xlabel="request rate (req/s)", ylabel=ylabel, title=f"{ylabel} vs request rate")
    ax.set_ylim(bottom=0)
    return _save(fig, ax, path)


def _save(fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
