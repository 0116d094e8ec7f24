"""`loadgen`: benchmark a pdserve cluster over gRPC (`loadgen --addr HOST:PORT ...`) or any OpenAI-compatible
server over HTTP (`loadgen --backend openai --base-url http://HOST:PORT ...`), or compare two results
(`loadgen compare A.json B.json`). Flags are named as in `vllm bench serve`."""

from __future__ import annotations

import argparse
import math
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from loadgen.client import BACKENDS
from loadgen.metrics import DEFAULT_ATTAINMENT_TARGET, GoodputSLO
from loadgen.outcome import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, failed_runs, interrupted_line
from loadgen.workload import DATASETS, WorkloadConfig
from pdserve.addresses import host_port
from pdserve.config import EngineConfig
from pdserve.flags import DefaultsFormatter, at_least_one, burstiness, from_flags, in_range, natural
from pdserve.request_rate import check_request_rate
from pdserve.rpc.client_hints import TLS_HINT
from pdserve.rpc.credentials import add_client_flags, client_credentials
from pdserve.trace import read_trace


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        return _compare(_compare_parser().parse_args(argv[1:]))
    return _bench(_bench_parser().parse_args(argv))


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 0.5,1,2 or inf, got {text!r}") from None
    try:
        return tuple(check_request_rate(r) for r in rates)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _base_url(text: str) -> str:
    """An http(s) server root: the HTTP client refused any other only at the check request, which exited 1 as if
    the server had failed (`UNAVAILABLE: UnsupportedProtocol`)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected a URL like http://HOST:PORT, got {text!r}")
    return text


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected percentiles like 90,99 or 50,99.9, got {text!r}") from None
    if any(not 0 < p <= 100 for p in percentiles):
        raise argparse.ArgumentTypeError(f"percentiles must lie in (0, 100], got {text!r}")
    return tuple(sorted(set(percentiles)))


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loadgen", description=__doc__, formatter_class=DefaultsFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="grpc", help="grpc: pdserve's Generate; openai*: HTTP")
    p.add_argument("--addr", type=host_port, help="router HOST:PORT (--backend grpc)")
    p.add_argument(
        "--base-url", type=_base_url, help="server root, e.g. http://127.0.0.1:8000 (--backend openai, openai-chat)"
    )
    p.add_argument("--endpoint", help="openai backends: default /v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=EngineConfig.model, help="the served model; its vocabulary bounds the prompt ids")
    p.add_argument("--served-model-name", help="openai backends: the `model` sent (default: --model)")
    w = WorkloadConfig
    p.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default=w.dataset_name,
        help="random lengths, ShareGPT-like lengths, shared prefixes, or a --trace replayed",
    )
    p.add_argument(
        "--num-prompts", type=int, default=w.num_prompts, help="requests per rate (a trace: at most this many)"
    )
    p.add_argument("--random-input-len", type=int, default=w.random_input_len, help="random: prompt tokens")
    p.add_argument("--random-output-len", type=int, default=w.random_output_len, help="random: output tokens")
    p.add_argument(
        "--random-range-ratio", type=float, default=w.random_range_ratio, help="lengths uniform in len * [1 - r, 1 + r]"
    )
    prefixes = "prefix-repetition: "
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=w.prefix_len, help=f"{prefixes}shared tokens")
    p.add_argument(
        "--prefix-repetition-suffix-len", type=int, default=w.suffix_len, help=f"{prefixes}each request's own tokens"
    )
    p.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=w.num_prefixes, help=f"{prefixes}distinct prefixes"
    )
    p.add_argument(
        "--prefix-repetition-output-len", type=int, default=w.prefix_output_len, help=f"{prefixes}output tokens"
    )
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL: timestamp (ms), input_length, output_length")
    p.add_argument(
        "--request-rate",
        "--sweep",
        type=_rates,
        default=None,
        help="requests per second, inf = all at once (default); a comma list (0.5,1,2,4) runs each in turn",
    )
    p.add_argument("--burstiness", type=burstiness, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=at_least_one, default=None, help="requests in flight at most")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLO bounds: ttft:MS tpot:MS e2el:MS")
    add_attainment_flag(p)
    p.add_argument(
        "--send-slo", action="store_true", help="send the ttft/tpot bounds with each request (router admission)"
    )
    p.add_argument(
        "--priority",
        type=int,
        default=0,
        help="each request's priority: higher is admitted first when capacity is short",
    )
    p.add_argument(
        "--warmup-requests",
        type=natural,
        default=0,
        help="sent all at once and awaited at the start of each rate, in no figure (counted in the JSON)",
    )
    p.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default="90,99",
        help="latency percentiles reported (p90_ttft_ms, ...), e.g. 50,90,95,99",
    )
    p.add_argument("--seed", type=natural, default=0, help="each rate's prompts and arrival gaps: same seed, same run")
    p.add_argument("--result-json", type=Path, help="write the results (with per-request records) here")
    p.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    add_client_flags(p)
    return p


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen compare",
        description="two result files side by side, ratios B / A",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    add_attainment_flag(p)
    p.add_argument("--plot-dir", type=Path, help="write both runs into the same PNG plots here")
    return p


def add_attainment_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--goodput-attainment",
        type=in_range(float, 0.0, 1.0, low_in=False, high_in=True),
        default=DEFAULT_ATTAINMENT_TARGET,
        help="a sweep's DistServe goodput: the highest rate whose SLO attainment reaches this",
    )


def _bench(args: argparse.Namespace) -> int:
    from loadgen.benchmark import BenchmarkConfig, CheckRequestInvalid, ClusterCheckFailed, run_benchmark
    from loadgen.report import distserve_label, distserve_result, write_results

    console, errors = Console(), Console(stderr=True, soft_wrap=True)  # an error stays one line, whole for grep
    if args.dataset_name == "trace" and args.request_rate is not None:
        errors.print("loadgen: a trace replays its own timestamps; drop --request-rate", style="red")
        return EXIT_USAGE
    unused = _unused_flags(args)
    for line in unused:
        errors.print(f"loadgen: {line}", style="red", markup=False)
    if unused:
        return EXIT_USAGE
    address = args.addr if args.backend == "grpc" else args.base_url
    if not address:
        errors.print(f"loadgen: --backend {args.backend} needs {_ADDRESS_FLAG[args.backend]}", style="red")
        return EXIT_USAGE
    try:
        prefixed = {f: f"prefix_repetition_{f}" for f in ("prefix_len", "suffix_len", "num_prefixes")}
        prefixed["prefix_output_len"] = "prefix_repetition_output_len"
        workload = from_flags(WorkloadConfig, args, prefixed, vocab_size=_vocab_size(args.model))
        config = from_flags(
            BenchmarkConfig,
            args,
            address=address,
            workload=workload,
            request_rates=args.request_rate or (math.inf,),
            slo=GoodputSLO.parse(args.goodput or []),
            credentials=client_credentials(args),
        )
        if workload.trace is not None:
            # a bad trace is a usage error now, not a traceback once the cluster answered; a span past the bound too,
            # among the --num-prompts replayed
            read_trace(workload.trace, workload.num_prompts)
        _check_outputs(args.result_json, args.plot_dir)
    except (ValueError, OSError, RuntimeError) as e:  # bad flags, or a model whose vocabulary cannot be read
        errors.print(f"loadgen: {e}", style="red")
        return EXIT_USAGE

    ran: list[dict[str, Any]] = []

    def save(results: list[dict[str, Any]]) -> None:
        ran[:] = results
        if args.result_json:
            write_results(args.result_json, results, args.goodput_attainment)

    status = EXIT_OK
    interrupted = False
    try:
        run_benchmark(config, console, save)
    except CheckRequestInvalid as e:  # before any run: what the flags drew, refused
        errors.print(f"loadgen: {e}", style="red")
        return EXIT_USAGE
    except (ClusterCheckFailed, TimeoutError, OSError) as e:  # OSError: nothing listens, or the JSON was not written
        errors.print(f"loadgen: {str(e) or _no_answer(address, config)}", style="red")
        status = EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C: the rates run so far (the cut one marked) are saved; one line, no traceback
        interrupted = True
    distserve = distserve_result(ran, args.goodput_attainment) if len(ran) > 1 else None
    if distserve is not None and not interrupted:
        console.print(
            f"DistServe goodput (highest rate with SLO attainment >= {args.goodput_attainment:g}): "
            f"{distserve_label(distserve['request_rate'])}"
        )
    for line in [] if interrupted else failed_runs(ran):  # an interrupted run's cancels are loadgen's own
        errors.print(f"loadgen: {line}", style="red", markup=False)
        status = EXIT_FAILED
    finished = [run for run in ran if not run["interrupted"]]
    if args.plot_dir and finished:  # a sweep cut short (the cluster gone midway) plots the rates it ran
        try:
            series = {args.result_json.stem if args.result_json else "run": finished}
            _plot(console, args.plot_dir, series, args.goodput_attainment)
        except OSError as e:
            errors.print(f"loadgen: {e}", style="red")
            status = EXIT_FAILED
    if interrupted:
        errors.print(f"loadgen: {interrupted_line(ran, args.result_json)}", style="yellow", markup=False)
        status = EXIT_INTERRUPTED
    return status


def _unused_flags(args: argparse.Namespace) -> list[str]:
    """Flags given that this run would not use, yet its result records as if it had: `--trace` with another dataset
    sent that dataset and wrote `"trace": PATH` beside it."""
    unused = []
    if args.trace is not None and args.dataset_name != "trace":
        unused.append(f"--trace is replayed only with --dataset-name trace, not {args.dataset_name}")
    for flag, value in (("--endpoint", args.endpoint), ("--served-model-name", args.served_model_name)):
        if value is not None and args.backend == "grpc":
            unused.append(f"{flag} is for the openai backends; --backend grpc calls pdserve's Generate")
    return unused


def _no_answer(address: str, config: Any) -> str:
    """The channel never became ready: over gRPC without --tls-ca, a router serving TLS is the likely cause (its
    handshake fails on every try, which gRPC reports only as no connection)."""
    hint = f" {TLS_HINT}" if config.backend == "grpc" and not (config.credentials and config.credentials.tls_ca) else ""
    return f"no answer from {address}{hint}"


def _check_outputs(result_json: Path | None, plot_dir: Path | None) -> None:
    """Before any request: a path that cannot take its file fails now, not after the whole run (a file on the
    way to it failed the folders' making once the run was over, its JSON never written)."""
    if result_json is not None and result_json.is_dir():
        raise ValueError(f"--result-json {result_json} is a folder; give a file's path")
    if plot_dir is not None and plot_dir.exists() and not plot_dir.is_dir():
        raise ValueError(f"--plot-dir {plot_dir} is a file; give a folder's path")
    for flag, path, folder in (
        ("--result-json", result_json, result_json and result_json.parent),
        ("--plot-dir", plot_dir, plot_dir),
    ):
        on_the_way = next((p for p in (folder, *folder.parents) if p.exists()), None) if folder else None
        if on_the_way is not None and not on_the_way.is_dir():
            raise ValueError(f"{flag} {path}: {on_the_way} is a file, not a folder")


_ADDRESS_FLAG = {"grpc": "--addr HOST:PORT", "openai": "--base-url URL", "openai-chat": "--base-url URL"}


def _compare(args: argparse.Namespace) -> int:
    from loadgen.report import comparison_table, load_runs, paired_runs, sweep_table
    from loadgen.workload_diff import workload_differences

    console, errors = Console(), Console(stderr=True, soft_wrap=True)
    try:
        runs_a, runs_b = load_runs(args.a), load_runs(args.b)
    except ValueError as e:
        errors.print(f"loadgen compare: {e}", style="red")
        return 2
    label_a, label_b = args.a.stem, args.b.stem
    if label_a == label_b:
        label_a, label_b = str(args.a), str(args.b)
    for difference in workload_differences(runs_a, runs_b):
        errors.print(f"loadgen compare: warning: the workloads differ, {difference}", style="yellow", markup=False)
    pairs = paired_runs(runs_a, runs_b)
    for path, runs in ((args.a, runs_a), (args.b, runs_b)):
        if args.plot_dir and not all("requests" in r for r in runs):
            errors.print(f"loadgen compare: {path} has no per-request records (plots need loadgen's)", style="red")
            return 2
    for a, b in pairs:
        if a is not None and b is not None:
            console.print(comparison_table(a, b, label_a, label_b))
    if len(pairs) > 1:
        console.print(sweep_table(pairs, label_a, label_b, args.goodput_attainment))
    if args.plot_dir:
        _plot(console, args.plot_dir, {label_a: runs_a, label_b: runs_b}, args.goodput_attainment)
    return 0


def _plot(console: Console, plot_dir: Path, series: dict, attainment_target: float) -> None:
    from loadgen.plots import write_plots

    for path in write_plots(plot_dir, series, attainment_target):
        console.print(f"wrote {path}")


def _vocab_size(model: str) -> int:
    """From the model's config, so random prompt ids are always valid for the served model."""
    from pdserve.engine.model_files import read_model_config
    from pdserve.engine.models import resolve_model

    return read_model_config(resolve_model(model)).vocab_size


if __name__ == "__main__":
    sys.exit(main())
