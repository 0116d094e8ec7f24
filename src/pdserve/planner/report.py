"""The plan as a rich table, one row per candidate, the recommended split marked."""

from __future__ import annotations

from rich.table import Table

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.plan import SLO, Candidate, recommend
from pdserve.planner.serving_latency import describe
from pdserve.planner.workload import Workload


def plan_table(candidates: list[Candidate], workload: Workload, slo: SLO, profile: HardwareProfile) -> Table:
    best = None if unmet(candidates) is not None else recommend(candidates)  # none marked beside "none"
    table = Table(
        title=f"pdserve plan at {workload.rate:g} req/s (mean {workload.mean_input_len:.0f} in, "
        f"{workload.mean_output_len:.0f} out; SLO TTFT {slo.ttft_ms:g} ms, TPOT {slo.tpot_ms:g} ms, "
        f"{slo.attainment:.0%} attainment)",
        caption=profile_caption(profile),
    )
    columns: tuple[str, ...] = (
        "split", "goodput req/s", "attainment", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
        "busy prefill/decode", "shed", "max rate req/s",
    )  # fmt: skip
    if profile.shared_cores:
        columns += ("host cores",)
    for col in columns:
        table.add_column(col, justify="left" if col == "split" else "right", no_wrap=True)
    for c in candidates:
        o = c.at_rate
        cells = [
            c.shape.label + (" *" if c is best else ""),
            f"{o.goodput:.2f}",
            f"{o.attainment:.0%}",
            "/".join(f"{v:.0f}" for v in o.ttft_ms),
            "/".join(f"{v:.1f}" for v in o.tpot_ms),
            f"{o.prefill_busy:.0%}" if c.shape.colocated else f"{o.prefill_busy:.0%}/{o.decode_busy:.0%}",
            f"{o.shed:.0%}",
            f"{c.max_rate:.2f}",
        ]
        if profile.shared_cores:
            cells.append(f"{o.demand_cores / profile.shared_cores:.0%}")
        table.add_row(*cells)
    return table


def profile_caption(p: HardwareProfile) -> str:
    """What the simulation assumed of the hardware: an SRE reads a plan for GPU pods differently from one for
    workers sharing a host's cores."""
    meta = p.meta
    # A CPU profile's speed is its threads'.
    threads = f", {meta['threads']} thread{'s' * (meta['threads'] != 1)}" if "threads" in meta else ""
    line = f"profile: {meta.get('model', '?')} on {meta.get('device', '?')} ({meta.get('dtype', '?')}{threads})"
    served = p.serving_latency_s or p.serving_latency_quantiles_s
    line += f", serving latency {describe(p)}" if served else ", no serving latency"
    if p.shared_cores:
        line += f"; every worker shares {p.shared_cores} cores with the serving stack"
        return (
            line
            + f"\nhost cores: the share of the {p.shared_cores} cores the split asks for at this rate; "
            + (
                'toward 100% the measured TTFT tails ran above the prediction (docs/planning.md, "The simulator '
                'against the local cluster")'
            )
        )
    return line + "; each worker on its own device and cores"


def verdict(candidates: list[Candidate], rate: float) -> str:
    """The recommendation, and what it cannot do: no split meets the SLO (then no recommendation), or none
    sustains the rate asked for."""
    if unmet(candidates) is not None:
        return "recommended: none"
    best = recommend(candidates)
    line = f"recommended: --prefill {best.shape.prefill} --decode {best.shape.decode}"
    line += f" (sustains {best.max_rate:.2f} req/s)"
    co = next(c for c in candidates if c.shape.colocated)
    if co.max_rate > best.max_rate:
        line += f"; {co.shape.colocated} colocated workers sustain more ({co.max_rate:.2f} req/s)"
        line += f": consider --mode colocated --workers {co.shape.colocated}"
    if rate > max(c.max_rate for c in candidates):
        line += f"\nno shape of these workers sustains the workload's {rate:.2f} req/s within the SLO: add workers"
    elif rate > best.max_rate:  # the colocated shape would: a split of these workers would not
        line += f"\nno split of these workers sustains the workload's {rate:.2f} req/s within the SLO: add workers"
    return line


def unmet(candidates: list[Candidate]) -> str | None:
    """Why no recommendation holds, when no split (what `pdserve scale` applies) meets the SLO's attainment at
    any rate, even idle."""
    if any(c.max_rate > 0 for c in candidates if not c.shape.colocated):
        return None
    co = next((c for c in candidates if c.shape.colocated), None)
    if co is not None and co.max_rate > 0:
        return (
            f"no split meets the SLO at any rate, even idle; {co.shape.colocated} colocated workers sustain "
            f"{co.max_rate:.2f} req/s: consider --mode colocated --workers {co.shape.colocated}"
        )
    return (
        "no split (nor the colocated shape) meets the SLO at any rate, even idle: loosen --slo-ttft-ms, "
        "--slo-tpot-ms or --attainment, or profile faster hardware"
    )
