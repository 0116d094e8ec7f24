"""`pdserve bench ...`: the micro-benchmarks' flags and how each runs, every one against a baseline measured in
the same run."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from pdserve.addresses import host_port
from pdserve.config import ClusterConfig, EngineConfig
from pdserve.flags import (
    add_engine_flags,
    at_least_one,
    counts,
    engine_config,
    fetch_model,
    from_flags,
    natural,
    positive_float,
    request_rate,
)


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="micro-benchmarks against a baseline measured in the same run")
    bench_sub = bench.add_subparsers(required=True, metavar="WHAT")
    engine = bench_sub.add_parser("engine", help="prefill and decode tokens/s, engine vs transformers")
    add_engine_flags(engine)
    engine.add_argument("--batch-sizes", type=counts, default="1,8,32", help="comma-separated, one row each")
    engine.add_argument("--prompt-len", type=at_least_one, default=512, help="prompt tokens for the prefill figure")
    engine.add_argument("--decode-prompt-len", type=at_least_one, default=32, help="prompt tokens before decoding")
    engine.add_argument("--decode-tokens", type=at_least_one, default=64, help="tokens generated per sequence")
    engine.add_argument("--compare", choices=["transformers", "none"], default="transformers", help="baseline")
    engine.add_argument(
        "--rounds", type=at_least_one, default=3, help="rounds of every row on both engines, back to back"
    )
    engine.set_defaults(func=_bench_engine)
    guided = bench_sub.add_parser("guided", help="decode step time with rows held to a JSON schema vs none")
    add_engine_flags(guided)
    guided.add_argument("--batch", type=at_least_one, default=32, help="decoding rows")
    guided.add_argument("--constrained", type=counts, default="8,32", help="comma-separated, constrained rows of each")
    guided.add_argument("--prompt-len", type=at_least_one, default=16, help="prompt tokens before decoding")
    guided.add_argument("--steps", type=at_least_one, default=32, help="decode steps timed per case and round")
    guided.add_argument("--rounds", type=at_least_one, default=3, help="rounds of every case")
    guided.set_defaults(func=_bench_guided)
    placement = bench_sub.add_parser("placement", help="prefix-aware placement vs round-robin, TTFT and hit rate")
    placement.add_argument("--model", default=EngineConfig.model, help="as for up")
    placement.add_argument("--prefill", type=at_least_one, default=2, help="prefill workers")
    placement.add_argument("--decode", type=at_least_one, default=1, help="decode workers")
    placement.add_argument("--num-prefixes", type=at_least_one, default=8, help="distinct shared prefixes")
    placement.add_argument("--requests-per-prefix", type=at_least_one, default=4, help="requests sharing each")
    placement.add_argument("--prefix-len", type=at_least_one, default=512, help="tokens")
    placement.add_argument("--suffix-len", type=natural, default=32, help="tokens after the prefix")
    placement.add_argument("--request-rate", type=request_rate, default=0.5, help="Poisson arrivals per second")
    placement.set_defaults(func=_bench_placement)
    transfer = bench_sub.add_parser("transfer", help="KV transfer GB/s between two processes vs raw gloo and a copy")
    transfer.add_argument("--host", default=ClusterConfig.host, help="address both processes bind")
    transfer.add_argument("--device", default="cpu", help="where the KV caches live: cpu, cuda, cuda:N")
    transfer.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="auto: by device")
    transfer.add_argument("--tokens", type=at_least_one, default=1000, help="sequence length of the SmolLM2 cases")
    transfer.add_argument("--mib", type=at_least_one, default=64, help="size of the large case")
    transfer.add_argument("--repeats", type=at_least_one, default=7, help="timed runs per case")
    transfer.add_argument(
        "--pipeline-mib", type=natural, default=32, help="staging bytes in flight per side (at least two messages)"
    )
    transfer.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    transfer.set_defaults(func=_bench_transfer)
    _add_admission_bench(bench_sub)


def _add_admission_bench(bench_sub: argparse._SubParsersAction) -> None:
    from pdserve.bench.admission_bench import AdmissionBench

    d = AdmissionBench()
    admission = bench_sub.add_parser(
        "admission",
        help="predicted vs measured TTFT, and a burst far above capacity",
    )
    admission.add_argument(
        "--addr", type=host_port, default=None, help="a running router HOST:PORT (default: start a cluster)"
    )
    admission.add_argument("--model", default=EngineConfig.model, help="for the cluster it starts")
    admission.add_argument("--prefill", type=at_least_one, default=1, help="for the cluster it starts")
    admission.add_argument("--decode", type=at_least_one, default=1, help="for the cluster it starts")
    admission.add_argument(
        "--prompt-lens", type=counts, default=",".join(map(str, d.prompt_lens)), help="sequential phase"
    )
    admission.add_argument(
        "--repeats", type=at_least_one, default=d.repeats, help="sequential requests per prompt length"
    )
    admission.add_argument("--burst", type=at_least_one, default=d.burst, help="simultaneous requests")
    admission.add_argument(
        "--burst-prompt-len", type=at_least_one, default=d.burst_prompt_len, help="prompt tokens of each"
    )
    admission.add_argument(
        "--ttft-slo-ms", type=positive_float, default=d.ttft_slo_ms, help="explicit SLO of the burst"
    )
    admission.add_argument("--max-tokens", type=at_least_one, default=d.max_tokens, help="tokens per request")
    admission.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    admission.set_defaults(func=_bench_admission)


def _bench_admission(args: argparse.Namespace) -> int:
    from pdserve.bench.admission_bench import AdmissionBench, RouterNotServing, run_admission_bench

    bench = from_flags(AdmissionBench, args, prompt_lens=args.prompt_lens)
    cluster = ("--model", args.model, "--prefill", str(args.prefill), "--decode", str(args.decode))
    try:
        with _tables_to_stderr(args.json):
            result = run_admission_bench(bench, args.addr, cluster)
    except RouterNotServing as e:
        print(f"pdserve bench admission: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    return 0


def _tables_to_stderr(json_output: bool) -> contextlib.AbstractContextManager:
    """With --json, stdout carries the one JSON object alone, for a pipe; the tables go to stderr."""
    return contextlib.redirect_stdout(sys.stderr) if json_output else contextlib.nullcontext()


def _bench_placement(args: argparse.Namespace) -> int:
    from pdserve.bench.placement_bench import run_placement_bench

    run_placement_bench(
        args.model,
        args.prefill,
        args.decode,
        args.num_prefixes,
        args.requests_per_prefix,
        args.prefix_len,
        args.suffix_len,
        args.request_rate,
    )
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from pdserve.bench.engine_bench import run_engine_bench

    batch_sizes = list(args.batch_sizes)
    if max(batch_sizes) > args.max_num_seqs:  # its steps would run fewer sequences than its row names
        message = f"--batch-sizes {max(batch_sizes)} is past --max-num-seqs {args.max_num_seqs}"
        print(f"pdserve bench engine: {message}", file=sys.stderr)
        return 2
    if fetch_model(args.model, "pdserve bench engine") is None:  # a name that is no model: one line, no trace
        return 2
    try:
        run_engine_bench(
            engine_config(args),
            batch_sizes=batch_sizes,
            prompt_len=args.prompt_len,
            decode_prompt_len=args.decode_prompt_len,
            decode_tokens=args.decode_tokens,
            compare_transformers=args.compare == "transformers",
            rounds=args.rounds,
        )
    except ValueError as e:  # a prompt or its tokens past the model's context: InvalidRequestError, a traceback
        print(f"pdserve bench engine: {e}", file=sys.stderr)
        return 2
    return 0


def _bench_guided(args: argparse.Namespace) -> int:
    from pdserve.bench.guided_bench import run_guided_bench

    if args.batch > args.max_num_seqs or max(args.constrained) > args.batch:
        message = f"--batch {args.batch} must be within --max-num-seqs {args.max_num_seqs} and hold --constrained"
        print(f"pdserve bench guided: {message}", file=sys.stderr)
        return 2
    if fetch_model(args.model, "pdserve bench guided") is None:
        return 2
    config = engine_config(args)
    try:
        run_guided_bench(config, args.batch, args.constrained, args.prompt_len, args.steps, args.rounds)
    except ValueError as e:  # a prompt past the model's context, a batch its KV cannot hold
        print(f"pdserve bench guided: {e}", file=sys.stderr)
        return 2
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from pdserve.bench.transfer_bench import default_cases, run_transfer_bench

    with _tables_to_stderr(args.json):
        result = run_transfer_bench(
            default_cases(args.tokens, args.mib),
            host=args.host,
            device=args.device,
            backend=args.backend,
            repeats=args.repeats,
            pipeline_mib=args.pipeline_mib,
        )
    if args.json:
        print(json.dumps(result))
    return 0
