"""`pdserve profile`, `pdserve plan` and `pdserve autoscale`: their flags and how each runs (`pdserve scale`:
scale_command.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.addresses import host_port
from pdserve.config import MAX_WORKERS_PER_ROLE, EngineConfig, RouterConfig
from pdserve.flags import (
    MAX_SECONDS,
    add_engine_flags,
    at_least_one,
    burstiness,
    check_readable,
    deadline_seconds,
    engine_config,
    fetch_model,
    in_range,
    kv_cache_gb,
    natural,
    positive_float,
    request_rate,
    seconds,
    writable_file,
)
from pdserve.planner.scale_command import add_scale_command
from pdserve.rpc.credentials import add_client_flags, client_credentials

if TYPE_CHECKING:
    from pdserve.planner.admission_model import AdmissionModel


WORKER_TOTAL = in_range(int, 2, 2 * MAX_WORKERS_PER_ROLE, high_in=True)  # a worker of each role, what scale applies


def add_planner_commands(sub: argparse._SubParsersAction) -> None:
    _add_profile(sub)
    _add_plan(sub)
    add_scale_command(sub)
    _add_autoscale(sub)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure one worker's prefill, decode, KV transfer and KV capacity")
    add_engine_flags(p)
    p.add_argument(
        "--kv-cache-gb", type=kv_cache_gb, default=EngineConfig.kv_cache_memory_gb, help="KV cache per worker (GiB)"
    )
    p.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, for tests and smoke runs)")
    p.add_argument("--transfer-gbps", type=positive_float, help="use this KV transfer speed (GB/s), do not measure")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profiler import QUICK, Grid, NoisyMeasurement, run_profile
    from pdserve.protocol.model_config import UnsupportedModelError

    if not (writable_file(args.out, "--out", "pdserve profile") and fetch_model(args.model, "pdserve profile")):
        return 2
    try:
        profile = run_profile(engine_config(args), QUICK if args.quick else Grid(), args.transfer_gbps)
    # What was asked: a model folder without its weights, a KV cache that holds none of the grid's shapes
    except (FileNotFoundError, UnsupportedModelError, ValueError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    except NoisyMeasurement as e:  # after the whole grid: said in one line, not a traceback
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"pdserve profile: out of memory for a KV cache of --kv-cache-gb {args.kv_cache_gb:g}", file=sys.stderr)
        return 1
    profile.save(args.out)
    perf, gbps = profile.perf, profile.transfer_gbps
    bytes_at = f"{gbps:.2f} GB/s" if gbps else "bytes too cheap to measure"
    print(
        f"wrote {args.out}: {profile.meta['model']} on {profile.meta['device']} ({profile.meta['dtype']}); "
        f"prefill(512) {perf.prefill_s(512) * 1e3:.1f} ms, decode step(1) {perf.decode_step_s(1) * 1e3:.1f} ms, "
        f"engine step overhead {profile.step_overhead_s * 1e3:.2f} ms, KV {profile.kv_capacity_tokens} tokens, "
        f"transfer {profile.transfer_latency_s * 1e3:.1f} ms + {bytes_at}"
    )
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate every prefill:decode split of K workers and recommend one")
    p.add_argument("--profile", type=Path, required=True, help="from pdserve profile")
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL: timestamp (ms), input_length, output_length")
    p.add_argument("--rate", type=request_rate, help="requests per second (without --trace)")
    p.add_argument("--input-len", type=_length, help="prompt tokens (without --trace)")
    p.add_argument("--output-len", type=_length, help="output tokens (without --trace)")
    p.add_argument("--range-ratio", type=_ratio, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--burstiness", type=burstiness, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument(
        "--num-requests", type=_requests, help="requests per run (default 400); a trace's earliest N, at most 100000"
    )
    p.add_argument("--seed", type=natural, default=0, help="of the synthetic trace")
    _add_slo_flags(p)
    p.add_argument("--workers", type=WORKER_TOTAL, required=True, help="K: the workers to split (2 to 128)")
    _add_admission_flags(p)
    p.add_argument("--json", action="store_true", help="print the recommendation and candidates as JSON")
    p.set_defaults(func=_plan)


def _add_slo_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=positive_float, required=True, help="time to first token, ms")
    p.add_argument("--slo-tpot-ms", type=positive_float, required=True, help="time per output token, ms")
    p.add_argument("--attainment", type=_share, default=0.9, help="share of requests that must meet both SLOs")


def _add_admission_flags(p: argparse.ArgumentParser) -> None:
    """The router's admission, which the simulation applies with the TTFT SLO as the router's default."""
    r = RouterConfig
    p.add_argument("--slo-headroom", type=_share, default=r.slo_headroom, help="the router's slo_headroom (admission)")
    p.add_argument(
        "--max-queued-prefill-tokens",
        type=at_least_one,
        default=r.max_queued_prefill_tokens,
        help="the router's per-prefill-worker queue bound (admission; priority 0 gets its share)",
    )
    p.add_argument(
        "--first-token-timeout-s",
        type=positive_float,
        default=r.first_token_timeout_s,
        help="the router's first-token bound (admission holds every TTFT SLO to it)",
    )
    p.add_argument(
        "--router-transfer-gbps",
        type=positive_float,
        default=r.transfer_gbps,
        help="the router's transfer_gbps: the KV transfer speed its TTFT predictions assume (admission)",
    )
    p.add_argument("--no-admission", action="store_true", help="simulate a router that sheds nothing")


_share = in_range(float, 0, 1, low_in=False, high_in=True)  # as the router takes slo_headroom
_ratio = in_range(float, 0, 1)  # --range-ratio
# --num-requests: a simulation of 200,000 took 21 s and 120 MiB here, and a plan runs 8-12 a shape (its max-rate
# search), so the bound is minutes a shape; 1e8 took 60 GiB, 2**63 was numpy's "Maximum allowed dimension exceeded"
_requests = in_range(int, 1, 100_000, high_in=True)
# --input-len and --output-len: far past any model's context, which the plan checks (numpy drew lengths past 2**63
# as "high is out of bounds for int64")
_length = in_range(int, 1, 1e9, high_in=True)
_margin = in_range(float, 0, 10)  # --scale-down-margin
# --interval: at 1e-9 the loop asked the router's status ~100 times a second (829 decisions printed in 8 s); past
# MAX_SECONDS it never decided again, as --window never was covered
_interval = in_range(float, 0.1, MAX_SECONDS, high_in=True)


def _admission(args: argparse.Namespace) -> AdmissionModel | None:
    from pdserve.planner.admission_model import AdmissionModel

    if args.no_admission:
        return None
    bound = RouterConfig(max_queued_prefill_tokens=args.max_queued_prefill_tokens).queue_bound(0)
    return AdmissionModel(
        args.slo_ttft_ms / 1e3, args.slo_headroom, bound, args.first_token_timeout_s, args.router_transfer_gbps
    )


def _plan(args: argparse.Namespace) -> int:
    from pdserve.planner import workload
    from pdserve.planner.hardware import HardwareProfile
    from pdserve.planner.plan import SLO, plan, plan_json

    try:
        check_readable(args, {"--profile": "profile", "--trace": "trace"})
        if args.trace:
            synthetic_only = {"--rate": args.rate, "--input-len": args.input_len, "--output-len": args.output_len}
            if given := [flag for flag, value in synthetic_only.items() if value is not None]:  # else ignored
                raise ValueError(f"{given[0]} applies without --trace: a trace has its own timestamps and lengths")
            load = workload.from_trace(args.trace, args.num_requests)
        elif None in (args.rate, args.input_len, args.output_len):
            raise ValueError("give --trace FILE, or --rate, --input-len and --output-len")
        else:
            lengths = (args.input_len, args.output_len, args.num_requests or workload.SYNTHETIC_REQUESTS)
            load = workload.synthetic(args.rate, *lengths, args.range_ratio, args.burstiness, args.seed)
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment)
        profile = HardwareProfile.load(args.profile)
        longest = max(i + o for i, o in zip(load.input_lens, load.output_lens, strict=True))
        if longest > profile.kv_capacity_tokens:
            raise ValueError(
                f"a request of {longest} tokens (prompt and output) does not fit a worker's KV cache "
                f"({profile.kv_capacity_tokens} tokens in the profile): no split serves it"
            )
        context = profile.meta.get("context_tokens")  # a profile older than this field: unknown, unchecked
        if isinstance(context, int) and longest > context:
            raise ValueError(
                f"a request of {longest} tokens (prompt and output) exceeds the model's context of {context} tokens: "
                "the router refuses it (INVALID_ARGUMENT); no split serves it"
            )
        candidates = plan(profile, load, slo, args.workers, _admission(args))
    except (ValueError, OSError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    from pdserve.planner.report import unmet

    if args.json:
        print(json.dumps(plan_json(candidates), allow_nan=False))
    else:
        from pdserve.bench.report_console import report_console
        from pdserve.planner.report import plan_table, verdict

        console = report_console()
        console.print(plan_table(candidates, load, slo, profile))
        console.print(verdict(candidates, load.rate))
    # No shape meets the SLO even idle: the recommendation (JSON's `recommended` stays, as its contract says) is only
    # the first of equals; a script applying it must be told.
    if (why := unmet(candidates)) is not None:
        print(f"pdserve plan: {why}", file=sys.stderr)
        return 1
    return 0


def _add_autoscale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autoscale", help="re-plan the split from a router's live load and scale it, with hysteresis")
    p.add_argument("--addr", type=host_port, required=True, help="router HOST:PORT")
    p.add_argument("--profile", type=Path, required=True, help="from pdserve profile")
    _add_slo_flags(p)
    p.add_argument("--max-workers", type=WORKER_TOTAL, required=True, help="never more workers in all (2 to 128)")
    p.add_argument("--interval", type=_interval, default=10.0, help="seconds between decisions")
    p.add_argument("--window", type=deadline_seconds, default=60.0, help="seconds of admitted load per decision")
    p.add_argument("--consecutive", type=at_least_one, default=3, help="the same recommendation this often first")
    p.add_argument("--cooldown", type=seconds, default=120.0, help="seconds after a scale before the next one")
    p.add_argument(
        "--scale-down-margin",
        type=_margin,
        default=0.2,
        help="fewer workers only when they would sustain this fraction more than the load (0: as soon as they do)",
    )
    p.add_argument("--once", action="store_true", help="one decision once the window is covered, printed; then exit")
    p.add_argument("--dry-run", action="store_true", help="decide and print, never scale")
    p.add_argument(
        "--range-ratio", type=_ratio, default=0.0, help="the workload's lengths spread over len * [1 - r, 1 + r]"
    )
    add_client_flags(p)
    p.set_defaults(func=_autoscale)


def _autoscale(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.planner.autoscale_loop import AutoscaleConfig, run_autoscale
    from pdserve.planner.hardware import HardwareProfile
    from pdserve.planner.plan import SLO

    try:
        check_readable(args, {"--profile": "profile"})
        config = AutoscaleConfig(
            HardwareProfile.load(args.profile),
            SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment),
            *(args.max_workers, args.interval, args.window, args.consecutive, args.cooldown),
            once=args.once,
            dry_run=args.dry_run,
            range_ratio=args.range_ratio,
            scale_down_margin=args.scale_down_margin,
        )
        return asyncio.run(run_autoscale(args.addr, client_credentials(args), config))
    except (ValueError, OSError) as e:
        print(f"pdserve autoscale: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the loop took over the signals
        return 0
