"""Parsed command-line flags into the config dataclasses, by field name: each field is mapped once, here
or by its flag's name, instead of in a keyword list beside every command. Also the checks of what a flag names
(a model, a file to write) that commands make before their work."""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from pdserve.burstiness import check_burstiness
from pdserve.config import (
    DECODE_GRAPH_MODES,
    DTYPE_NAMES,
    MAX_KV_CACHE_GB,
    MAX_TORCH_THREADS,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from pdserve.engine.model_files import BUILTIN_MODELS
from pdserve.errors import InvalidRequestError
from pdserve.protocol.output_constraint import MAX_SPEC_BYTES, OutputConstraint
from pdserve.protocol.sampling import MAX_LOGPROBS, SamplingParams
from pdserve.request_rate import check_request_rate

T = TypeVar("T")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None, a flag's False): every command's
    --help, `pdserve`'s and `loadgen`'s."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def flag_values(cls: type, args: argparse.Namespace, renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The flags that carry one of `cls`'s field names (or the flag `renamed` maps a field to), None left out:
    an unset flag keeps the dataclass's default, or a config file's value."""
    renamed = renamed or {}
    values = {f.name: getattr(args, renamed.get(f.name, f.name), None) for f in fields(cls)}
    return {name: value for name, value in values.items() if value is not None}


def from_flags(cls: type[T], args: argparse.Namespace, renamed: Mapping[str, str] | None = None, **given: Any) -> T:
    """`cls` built from the flags named after its fields; `given` values win. A setting out of its range is named
    by its flag (`flags_named`)."""
    with flags_named(args, renamed):
        return cls(**{**flag_values(cls, args, renamed), **given})


@contextmanager
def flags_named(args: argparse.Namespace, renamed: Mapping[str, str] | None = None) -> Iterator[None]:
    """A ConfigError raised meanwhile about a setting that one of `args`'s flags gave (the flag named after the
    field, or the one `renamed` maps it to) names that flag, as the operator typed it: `--stall-timeout-s must be
    at least 2 s`, not `stall_timeout_s`. One a config file gave names its key there (config_file.py)."""
    try:
        yield
    except ConfigError as e:
        dest = (renamed or {}).get(e.setting, e.setting)
        if getattr(args, dest, None) is None:  # not a flag of this command, or not given: the file's or the code's
            raise
        raise ConfigError(f"--{dest.replace('_', '-')}", e.problem) from None


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """How to pick tokens (all but --max-tokens, whose default differs): `pdserve generate` and `pdserve client`."""
    s = SamplingParams
    p.add_argument("--temperature", type=float, default=s.temperature, help="0: greedy")
    p.add_argument("--top-p", type=float, default=s.top_p, help="nucleus sampling mass")
    p.add_argument("--top-k", type=in_range(int, -1, 2**31), default=s.top_k, help="0 or -1 (as the APIs take it): off")
    p.add_argument(
        "--seed", type=in_range(int, 0, 2**64), default=None, help="sampling seed, 0 to 2^64-1 (the API's uint64)"
    )
    p.add_argument("--stop", action="append", default=None, help="a stop string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens, past end-of-sequence")
    p.add_argument("--presence-penalty", type=float, default=s.presence_penalty, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=s.frequency_penalty, help="in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=s.repetition_penalty, help="1: off")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help=f"with --json: each token's and its N (0-{MAX_LOGPROBS}) alternatives'",
    )
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the output is a JSON value this schema accepts")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", help="the output matches this regular expression")


def sampling_from_flags(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    """The flags of `add_sampling_flags` as SamplingParams, checked (InvalidRequestError names the field)."""
    constraint = None
    if args.json_schema is not None:
        constraint = OutputConstraint("json_schema", _schema_file(args.json_schema))
    elif args.json_object:
        constraint = OutputConstraint("json_object")
    elif args.regex is not None:
        constraint = OutputConstraint("regex", args.regex)
    stop = tuple(args.stop or ())
    top_k = max(args.top_k, 0)  # vLLM's -1, which both APIs read as off, is SamplingParams' 0
    return from_flags(SamplingParams, args, max_tokens=max_tokens, stop=stop, constraint=constraint, top_k=top_k)


def _schema_file(path: str) -> str:
    """The file's text, read no further than the cap past which it is refused (`/dev/zero` is a file too)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise InvalidRequestError("sampling.json_schema", f"cannot read {path}: {e}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise InvalidRequestError("sampling.json_schema", f"{path} is over {MAX_SPEC_BYTES} bytes, the most it may be")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise InvalidRequestError("sampling.json_schema", f"{path} is not UTF-8 text ({e})") from None


def at_least_one(value: str) -> int:
    """An argparse type: a count that must be positive (exit 2 with the flag named, before anything runs)."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def threads(value: str) -> int:
    """An argparse type: torch's threads, at least 1 and at most MAX_TORCH_THREADS (EngineConfig's bound)."""
    n = at_least_one(value)
    if n > MAX_TORCH_THREADS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TORCH_THREADS}, got {n}")
    return n


def counts(value: str) -> tuple[int, ...]:
    """An argparse type: comma-separated counts, each at least 1 (batch sizes, prompt lengths)."""
    try:
        parsed = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,8,32, got {value!r}") from None
    if min(parsed) < 1:
        raise argparse.ArgumentTypeError(f"each must be at least 1, got {value!r}")
    return parsed


def positive_float(value: str) -> float:
    """An argparse type: a finite number that must be positive (exit 2 with the flag named)."""
    x = float(value)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return x


def kv_cache_gb(value: str) -> float:
    """An argparse type: a worker's KV cache in GiB, positive and at most MAX_KV_CACHE_GB (EngineConfig's bound)."""
    gb = positive_float(value)
    if gb > MAX_KV_CACHE_GB:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_KV_CACHE_GB:g} GiB, got {value}")
    return gb


def burstiness(value: str) -> float:
    """An argparse type: the gamma shape of arrival gaps, in the range whose draws mean it (pdserve.burstiness)."""
    try:
        return check_burstiness(float(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def request_rate(value: str) -> float:
    """An argparse type: requests per second, finite, in the range loadgen's --request-rate takes
    (pdserve.request_rate): a plan, a bench or a chaos run at 1e303 req/s named a rate no sender offers."""
    rate = positive_float(value)
    try:
        return check_request_rate(rate, infinite=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def in_range(
    kind: Callable[[str], Any], low: float, high: float, low_in: bool = True, high_in: bool = False
) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` between `low` and `high`, each bound in or out (nan never is)."""
    bounds = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"

    def parse(value: str) -> Any:
        x = kind(value)
        if not ((low <= x if low_in else low < x) and (x <= high if high_in else x < high)):
            raise argparse.ArgumentTypeError(f"must lie in {bounds}, got {value}")
        return x

    return parse


def device(value: str) -> str:
    """An argparse type: auto, cpu, cuda or cuda:N."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")
    return value


MAX_SECONDS = 1e6  # 11.6 days: a gRPC deadline past ~1e9 s overflows and expires at once
natural = in_range(int, 0, math.inf)  # an argparse type: a count that may be 0
seconds = in_range(float, 0, MAX_SECONDS, high_in=True)  # an argparse type: a time that may be 0
deadline_seconds = in_range(float, 0, MAX_SECONDS, low_in=False, high_in=True)  # a wait that must be positive


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device, --threads, --decode-graphs, --max-num-seqs: what every command that builds an
    engine takes."""
    e = EngineConfig
    p.add_argument("--model", default=e.model, help=f"{', '.join(BUILTIN_MODELS)}, a model folder or a .gguf")
    p.add_argument(
        "--dtype", default=e.dtype, choices=["auto", *DTYPE_NAMES], help="auto: bfloat16 on CUDA, else float32"
    )
    p.add_argument("--device", type=device, default=e.device, help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument(
        "--threads",
        type=threads,
        default=e.num_threads,
        help="CPU threads for torch (default: torch's own; `up`'s workers: a fair share of the cores each)",
    )
    p.add_argument(
        "--decode-graphs",
        default=e.decode_graphs,
        choices=DECODE_GRAPH_MODES,
        help="decode steps at fixed batch sizes: auto (captured in CUDA graphs on CUDA, off elsewhere), static "
        "(the same steps, not captured), off",
    )
    p.add_argument(
        "--max-num-seqs",
        type=at_least_one,
        default=SchedulerConfig.max_num_seqs,
        help="the most sequences one engine step decodes; a decode worker refuses hand-offs past it",
    )


def fetch_model(model: str, command: str, force: bool = False) -> Path | None:
    """The model's folder, fetched and converted on first use (a progress line on a terminal's stderr), or again
    with `force`; None, said on stderr in one line, when it cannot be had: a name that is no model, a cache that
    cannot be written, are no traceback."""
    from pdserve.engine.model_cache import ModelFetchError
    from pdserve.engine.models import resolve_model

    try:
        return resolve_model(model, force)
    except (ModelFetchError, FileNotFoundError) as e:
        print(f"{command}: {e}", file=sys.stderr)
        return None


def model_unready(model: str, command: str) -> int:
    """For `pdserve up` and `router`, before Ray or any worker starts: 0 when the model is there to read and can be
    run (its config, tokenizer and weight files' headers read), a built-in one fetched and converted first by
    `pdserve fetch` in a child process, so that this process (the router's) never imports torch. Else the exit
    status, the reason said in one line: 2 for a name that is no model or one pdserve cannot run (as `generate`
    answers them: workers retrying could not change it), 1 for a fetch that failed or a cache that cannot be read."""
    from pdserve.engine.model_files import (
        ModelNotFetchedError,
        check_weight_files,
        locate_model,
        read_model_config,
        tokenizer_folder,
    )
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.protocol.model_config import UnsupportedModelError

    try:
        try:
            path = locate_model(model)
        except ModelNotFetchedError:
            if fetched := _fetch_in_child(model):
                return fetched
            path = locate_model(model)
        read_model_config(path)
        Tokenizer(tokenizer_folder(path))
        if path.is_dir():
            check_weight_files(path)
    except (FileNotFoundError, UnsupportedModelError) as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a cache another user built unreadable, no home for the default cache
        print(f"{command}: {e}", file=sys.stderr)
        return 1
    return 0


def _fetch_in_child(model: str) -> int:
    """`pdserve fetch --model` in a child process: 0 once fetched, 1 when it failed, 143 when this process was told
    to stop (SIGTERM: a pod's stop, which reaches only this process), passed on to the child so that it cleans up
    and ends rather than building on, orphaned."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "fetch", "--model", model])
    stopped: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        code = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        return 128 + signal.SIGTERM
    return 0 if code == 0 else 1


def writable_file(path: Path, flag: str, command: str) -> bool:
    """Whether `path` takes a file (said on stderr if not), found before the work whose result goes there: a
    folder, a missing folder or a file system that takes no file fails now, not once the work is done. A file
    this test created is removed again."""
    if not path.resolve().parent.is_dir():
        print(f"{command}: {flag} {path}: its folder does not exist", file=sys.stderr)
        return False
    existed = os.path.lexists(path)
    try:
        path.open("a").close()
    except OSError as e:
        print(f"{command}: {flag} {path} cannot be written as a file ({e.strerror})", file=sys.stderr)
        return False
    if not existed:
        path.unlink()
    return True


def check_readable(args: argparse.Namespace, flags: Mapping[str, str]) -> None:
    """Each file flag (flag: its dest) that `args` has and was given names a file this process can read; else
    ValueError naming the flag, the path and why (open's own `[Errno 2] No such file or directory: 'keys.toml'`
    names no flag)."""
    for flag, dest in flags.items():
        if path := getattr(args, dest, None):
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ValueError(f"{flag} {path}: cannot be read ({e.strerror})") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    given = getattr(args, "max_num_seqs", None)  # None: a command without engine flags (`router`)
    scheduler = SchedulerConfig() if given is None else SchedulerConfig(max_num_seqs=given)
    renamed = {"num_threads": "threads", "kv_cache_memory_gb": "kv_cache_gb"}
    return from_flags(EngineConfig, args, renamed, scheduler=scheduler)
