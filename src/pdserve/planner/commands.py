"""`pdserve profile`, `pdserve plan` and `pdserve scale`: their flags and how each runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.flags import add_engine_flags, engine_config


def add_planner_commands(sub: argparse._SubParsersAction) -> None:
    _add_profile(sub)
    _add_plan(sub)
    _add_scale(sub)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure one worker's prefill, decode, KV transfer and KV capacity")
    add_engine_flags(p)
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per worker, as for up")
    p.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, for tests and smoke runs)")
    p.add_argument("--transfer-gbps", type=float, default=None, help="use this KV transfer speed, do not measure")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profiler import QUICK, Grid, run_profile

    profile = run_profile(engine_config(args), QUICK if args.quick else Grid(), args.transfer_gbps)
    profile.save(args.out)
    perf = profile.perf
    print(
        f"wrote {args.out}: {profile.meta['model']} on {profile.meta['device']} ({profile.meta['dtype']}); "
        f"prefill(512) {perf.prefill_s(512) * 1e3:.1f} ms, decode step(1) {perf.decode_step_s(1) * 1e3:.1f} ms, "
        f"engine step overhead {profile.step_overhead_s * 1e3:.2f} ms, "
        f"KV {profile.kv_capacity_tokens} tokens, transfer {profile.transfer_gbps:.2f} GB/s"
    )
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate every prefill:decode split of K workers and recommend one")
    p.add_argument("--profile", type=Path, required=True, help="from pdserve profile")
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL: timestamp (ms), input_length, output_length")
    p.add_argument("--rate", type=float, help="requests per second (without --trace)")
    p.add_argument("--input-len", type=int, help="prompt tokens (without --trace)")
    p.add_argument("--output-len", type=int, help="output tokens (without --trace)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--num-requests", type=int, default=400, help="requests simulated per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    p.add_argument("--workers", type=int, required=True, help="K: the workers to split")
    p.add_argument("--json", action="store_true", help="print the recommendation and candidates as JSON")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from pdserve.planner import workload
    from pdserve.planner.hardware import HardwareProfile
    from pdserve.planner.plan import SLO, plan, plan_json

    try:
        if args.trace:
            load = workload.from_trace(args.trace)
        elif None in (args.rate, args.input_len, args.output_len):
            raise ValueError("give --trace FILE, or --rate, --input-len and --output-len")
        else:
            lengths = (args.rate, args.input_len, args.output_len, args.num_requests, args.range_ratio)
            load = workload.synthetic(*lengths, args.burstiness, args.seed)
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment)
        candidates = plan(HardwareProfile.load(args.profile), load, slo, args.workers)
    except (ValueError, OSError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(candidates)))
        return 0
    from pdserve.bench.report_console import report_console
    from pdserve.planner.report import plan_table, verdict

    console = report_console()
    console.print(plan_table(candidates, load, slo))
    console.print(verdict(candidates))
    return 0


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="set the prefill and decode worker counts (--kubernetes: the chart's RayCluster)")
    p.add_argument("--prefill", type=int, help="prefill workers")
    p.add_argument("--decode", type=int, help="decode workers")
    p.add_argument("--kubernetes", action="store_true", help="patch the Helm release's RayCluster worker groups")
    p.add_argument("--release", default="pdserve", help="the Helm release name")
    p.add_argument("--namespace", default="default", help="the release's namespace")
    p.add_argument("--dry-run", action="store_true", help="print the JSON patch, change nothing")
    p.set_defaults(func=_scale)


def _scale(args: argparse.Namespace) -> int:
    from pdserve.planner.kube_scale import apply_patch, raycluster_name, replicas_patch

    if not args.kubernetes:
        print("pdserve scale: only --kubernetes is supported so far (live local scaling is not built)", file=sys.stderr)
        return 2
    counts = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode)) if n is not None}
    if not counts:
        print("pdserve scale: give --prefill and/or --decode", file=sys.stderr)
        return 2
    name = raycluster_name(args.release)
    try:
        patch = replicas_patch(counts) if args.dry_run else apply_patch(name, args.namespace, counts)
    except ValueError as e:
        print(f"pdserve scale: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the kubernetes client's: no credentials, no such object, refused by the API server
        print(f"pdserve scale: RayCluster {args.namespace}/{name}: {e}", file=sys.stderr)
        return 1
    print(f"RayCluster {args.namespace}/{name} (ray.io/v1):", file=sys.stderr)
    print(json.dumps(patch, indent=1))
    return 0
