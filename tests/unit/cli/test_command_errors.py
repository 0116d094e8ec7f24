"""Commands answer a bad flag or a reader that left with one line and a status, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from loadgen.workload import WorkloadConfig
from pdserve.cli import _parser, main
from pdserve.cluster.launcher import WorkerStartError
from pdserve.config import ClusterConfig, EngineConfig
from pdserve.flags import writable_file

NOISY_STATUS = """
import sys
from pdserve import cli, client_commands

def noisy(args):
    for _ in range(20000):
        print("x" * 100)
    return 0

client_commands._status = noisy
sys.exit(cli.main(["status", "--addr", "127.0.0.1:1"]))
"""


def test_a_reader_that_leaves_is_status_1_without_a_traceback():
    run = subprocess.run(
        f"{sys.executable} -c '{NOISY_STATUS}' | head -c 10 >/dev/null; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (run.returncode, run.stderr) == (1, "")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["client", "--addr", "127.0.0.1:1", "--prompt", "hi", "--max-tokens", "-5"], "--max-tokens: must be in [0, "),
        # past the wire's uint32: protobuf raised ValueError, a traceback and status 1
        (["client", "--addr", "127.0.0.1:1", "--prompt", "hi", "--max-tokens", str(2**32)], "4294967295]"),
        (["client", "--addr", "127.0.0.1:1", "--prompt", ""], "--prompt: must not be empty"),
        (["client", "--addr", "127.0.0.1:1", "--prompt", "", "--chat"], "--prompt: must not be empty"),
        (["scale", "--addr", "127.0.0.1:1", "--prefill", "0"], "--prefill must be 1 to 64"),
        (["scale", "--kubernetes", "--dry-run", "--decode", "0"], "--decode must be 1 to 64"),  # a role serving nothing
        (["scale", "--kubernetes", "--dry-run", "--prefill", "100000"], "--prefill must be 1 to 64"),
        (["scale", "--kubernetes", "--dry-run", "--colocated", "3"], "--colocated is --addr only"),
    ],
)
def test_a_bad_count_is_refused_before_any_call(capsys, argv, says):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert says in captured.err and captured.out == ""


@pytest.mark.parametrize("command", [["status"], ["client", "--prompt", "hi"], ["drain", "w-1"]])
def test_a_certificate_file_that_is_not_there_is_a_usage_error(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command[0], "--addr", "127.0.0.1:1", *command[1:], "--tls-ca", "/nonexistent/ca.pem"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "pdserve: --tls-ca: no such file: /nonexistent/ca.pem\n"


def test_loadgen_counts_must_be_positive():
    with pytest.raises(ValueError, match="--num-prompts must be at least 1, got -1"):
        WorkloadConfig(num_prompts=-1)
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes must be at least 1"):
        WorkloadConfig(num_prefixes=0)


@pytest.mark.parametrize("command", [["client", "--prompt", "hi"], ["status"], ["drain", "w-1"]])
def test_an_addr_without_a_port_is_refused(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command[0], "--addr", "localhost", *command[1:]])
    assert exit_.value.code == 2
    assert "'localhost' is not HOST:PORT" in capsys.readouterr().err


def test_bench_admission_against_no_router_fails_with_the_reason(capsys):
    assert main(["bench", "admission", "--addr", "127.0.0.1:1", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pdserve bench admission: the warm-up request failed with UNAVAILABLE: ")


def test_bench_json_is_stdout_alone_and_its_tables_go_to_stderr(capsys, monkeypatch):
    from pdserve.bench import admission_bench
    from pdserve.bench.report_console import report_console

    def bench(*_args: object) -> dict:
        report_console().print("a table")
        return {"admitted": 3}

    monkeypatch.setattr(admission_bench, "run_admission_bench", bench)
    assert main(["bench", "admission", "--addr", "127.0.0.1:1", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"admitted": 3}
    assert "a table" in captured.err


@pytest.mark.parametrize("command", ["drain", "restart"])
@pytest.mark.parametrize("timeout", ["-5", "inf", "nan", "1e10"])  # 1e10: a gRPC deadline that expired at once
def test_a_drain_timeout_no_drain_could_keep_is_refused(capsys, command, timeout):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--addr", "127.0.0.1:1", "w-1", "--timeout", timeout])
    assert exit_.value.code == 2
    assert f"argument --timeout: must lie in [0, 1e+06], got {timeout}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["status"], ["client", "--prompt", "hi"], ["restart", "w-1", "--ready-timeout"]], ids=lambda a: a[0]
)
@pytest.mark.parametrize("timeout", ["0", "-5", "inf", "nan", "1e10"])
def test_a_call_deadline_that_would_expire_at_once_is_refused(capsys, argv, timeout):
    """Each was DEADLINE_EXCEEDED at once against a healthy router, read as the router's failure."""
    flag = argv[-1] if argv[-1].startswith("--") else "--timeout"
    argv = argv if argv[-1].startswith("--") else [*argv, "--timeout"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, timeout, "--addr", "127.0.0.1:1"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must lie in (0, 1e+06], got {timeout}" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-5", "inf", "nan", "1e303"])  # 1e303: every other wait's bound
def test_a_scale_wait_that_could_never_end_or_never_wait_is_refused(capsys, timeout):
    with pytest.raises(SystemExit) as exit_:
        main(["scale", "--addr", "127.0.0.1:1", "--decode", "2", "--wait", "--timeout", timeout])
    assert exit_.value.code == 2
    assert f"argument --timeout: must lie in (0, 1e+06], got {timeout}" in capsys.readouterr().err


@pytest.mark.parametrize("seconds", [-5.0, math.inf, math.nan])
def test_a_workers_drain_timeout_must_be_finite_and_not_negative(seconds):
    with pytest.raises(ValueError, match="worker_drain_timeout_s must be a finite number >= 0"):
        ClusterConfig(worker_drain_timeout_s=seconds)


@pytest.mark.parametrize(
    ("setting", "seconds", "says"),
    [
        ("speed_recheck_s", -1.0, "must be >= 0 (0: never)"),
        ("speed_recheck_s", math.inf, "must be >= 0 (0: never)"),
        ("speed_recheck_idle_s", 0.0, "must be a positive number"),
        ("speed_recheck_idle_s", math.nan, "must be a positive number"),
    ],
)
def test_a_workers_speed_recheck_timing_must_be_a_time_it_can_keep(setting, seconds, says):
    """An idle time of 0 would have a worker look at its engine without pause; a period that is no number, never."""
    with pytest.raises(ValueError, match=rf"{setting} {re.escape(says)}"):
        ClusterConfig(**{setting: seconds})


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (lambda: WorkerStartError("worker prefill-0 failed to start 1 times: boom"), "failed to start 1 times: boom"),
        (lambda: RedisConnectionError("Error 111 connecting"), "--redis redis://***@127.0.0.1:1/0: Error 111"),
    ],
)
def test_a_cluster_that_cannot_start_is_one_line_and_status_1(capsys, monkeypatch, failure, says):
    """Its reasons are in the log lines above; the command's own last word is one line, not a traceback. (`pdserve
    router`: the commands that start workers refuse a password in the URL before they start.)"""
    from pdserve import cli
    from services.main import SERVICES

    async def fails(config: object, services: object) -> None:
        raise failure()

    monkeypatch.setattr(cli, "_runner", lambda command: fails)
    argv = ["router", "--model", "tiny-random", "--port", "0", "--redis", "redis://:hunter2@127.0.0.1:1/0"]
    assert main(argv, services=SERVICES) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdserve router: ") and says in err and "Traceback" not in err
    assert "hunter2" not in err  # the URL's password is a credential


@pytest.mark.parametrize("seconds", [0.0, -1.0, 90_000.0, math.inf, math.nan])
def test_a_kv_transfer_timeout_no_transfer_header_can_carry_is_refused(seconds):
    """Its header bounds the timeout at a day (a drain sized by a larger one would hold the pair for years): a
    larger setting would make every transfer a protocol error, so it is refused at start."""
    from pdserve.config import MAX_KV_TRANSFER_TIMEOUT_S
    from pdserve.transfer.wire import MAX_TIMEOUT_MS

    assert MAX_TIMEOUT_MS == MAX_KV_TRANSFER_TIMEOUT_S * 1000  # one bound, on both sides
    with pytest.raises(ValueError, match="kv_transfer_timeout_s must be above 0 and at most 86400"):
        ClusterConfig(kv_transfer_timeout_s=seconds)
    assert ClusterConfig(kv_transfer_timeout_s=86_400.0).kv_transfer_timeout_s == 86_400.0


def test_a_joined_ray_address_nothing_listens_at_is_refused_at_once_by_name():
    """ray.init waited on it for ever on a thread no signal reached (11 minutes, through a SIGTERM and a SIGINT)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    start = time.monotonic()
    argv = ["up", "--model", "tiny-random", "--port", "0", "--ray-address", f"127.0.0.1:{port}"]
    run = subprocess.run([sys.executable, "-m", "services.main", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and time.monotonic() - start < 30
    assert f"nothing accepts connections at the Ray address 127.0.0.1:{port}" in run.stderr
    assert "Traceback" not in run.stderr


@contextlib.contextmanager
def http_server() -> Iterator[int]:
    """A port where an HTTP server answers whatever it is sent with a 400, as a Redis URL's wrong port may."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = server.accept()
                    with conn:
                        conn.recv(4096)
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        yield server.getsockname()[1]


@pytest.mark.parametrize(("listener", "says"), [("none", "Connection refused"), ("http", "no Redis")])
def test_up_with_a_redis_that_does_not_answer_is_one_line_before_ray_starts(listener, says):
    """`up` started Ray first, and failed when its workers first called Redis, 6-18 s later, after Ray's own lines."""
    with contextlib.ExitStack() as stack:
        if listener == "http":
            port = stack.enter_context(http_server())
        else:
            with socket.socket() as closed:
                closed.bind(("127.0.0.1", 0))
                port = closed.getsockname()[1]
        url = f"redis://127.0.0.1:{port}"
        argv = ["up", "--model", "tiny-random", "--port", "0", "--redis", url]
        run = subprocess.run([sys.executable, "-m", "services.main", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    (line,) = run.stderr.splitlines()  # nothing of Ray's: it never started
    assert line.startswith(f"pdserve up: --redis {url}: ") and says in line, line


@pytest.mark.parametrize(
    ("argv", "says"),
    [  # each was a traceback, a NaN profile written, or a start that failed only once Ray was up
        (["generate", "--prompt", "hi", "--threads", "-1"], "argument --threads: must be at least 1"),
        (["generate", "--prompt", "hi", "--device", "banana"], "argument --device: must be auto, cpu, cuda or cuda:N"),
        (["generate", "--prompt", "hi", "--seed", str(2**70)], "argument --seed: must lie in"),
        (["client", "--addr", "127.0.0.1:1", "--prompt", "hi", "--seed", "-3"], "argument --seed: must lie in"),
        (["profile", "--out", "p.json", "--kv-cache-gb", "nan"], "argument --kv-cache-gb: must be a positive number"),
        (["profile", "--out", "p.json", "--transfer-gbps", "nan"], "argument --transfer-gbps: must be a positive"),
        (["up", "--max-restarts", "-5"], "argument --max-restarts: must lie in [0, inf)"),
        (["up", "--kv-cache-gb", "inf"], "argument --kv-cache-gb: must be a positive number"),
        (["up", "--rollout-surge-wait-s", "nan"], "argument --rollout-surge-wait-s: must lie in [0, 1e+06]"),
        (["up", "--worker-drain-timeout-s", "1e12"], "argument --worker-drain-timeout-s: must lie in [0, 1e+06]"),
        (["up", "--speed-recheck-s", "-1"], "argument --speed-recheck-s: must lie in [0, 1e+06]"),
        (["controller", "--speed-recheck-idle-s", "0"], "argument --speed-recheck-idle-s: must lie in (0, 1e+06]"),
        # bench and chaos: each was a traceback once the bench had started its processes, or a table of nothing
        (["bench", "transfer", "--repeats", "0"], "argument --repeats: must be at least 1"),
        (["bench", "transfer", "--tokens", "-1"], "argument --tokens: must be at least 1"),
        (["bench", "engine", "--batch-sizes", "8,0"], "argument --batch-sizes: each must be at least 1"),
        (["bench", "engine", "--batch-sizes", "1,x"], "argument --batch-sizes: expected counts like 1,8,32"),
        (["bench", "engine", "--rounds", "0"], "argument --rounds: must be at least 1"),
        (["bench", "admission", "--prompt-lens", "x"], "argument --prompt-lens: expected counts like 1,8,32"),
        (["bench", "admission", "--burst", "-1"], "argument --burst: must be at least 1"),
        (["bench", "placement", "--request-rate", "0"], "argument --request-rate: must be a positive number"),
        (["chaos", "--seed", "-1"], "argument --seed: must lie in [0, inf)"),
    ],
)
def test_an_engine_cluster_or_bench_number_out_of_its_range_is_a_usage_error(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_every_flag_of_every_command_says_what_it_is_in_help():
    def flags_without_help(parser: argparse.ArgumentParser, command: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    missing += flags_without_help(sub, f"{command} {name}")
            elif action.option_strings and not action.help:
                missing.append(f"{command} {action.option_strings[-1]}")
        return missing

    assert flags_without_help(_parser(), "pdserve") == []


def test_a_model_or_output_folder_that_is_not_there_is_named_before_any_work(capsys, tmp_path):
    assert main(["generate", "--prompt", "hi", "--model", str(tmp_path / "none")]) == 2
    assert "neither a built-in name" in capsys.readouterr().err
    assert main(["profile", "--model", "tiny-random", "--out", str(tmp_path / "none" / "p.json")]) == 2
    assert "its folder does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["a folder", "/proc/pdserve-profile.json"])
def test_a_profile_out_that_takes_no_file_is_a_usage_error_before_any_measuring(capsys, monkeypatch, tmp_path, out):
    """It measured for minutes, then lost it all to an IsADirectoryError (or FileNotFoundError) traceback."""
    from pdserve.planner import profiler

    monkeypatch.setattr(profiler, "run_profile", lambda *args: pytest.fail("profiled before --out was checked"))
    path = tmp_path if out == "a folder" else out
    assert main(["profile", "--model", "tiny-random", "--quick", "--out", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve profile: --out {path} cannot be written as a file")


def test_the_out_check_leaves_no_file_behind_and_an_existing_one_as_it_was(tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("kept")
    assert writable_file(new, "--out", "pdserve profile") and writable_file(old, "--out", "pdserve profile")
    assert not new.exists() and old.read_text() == "kept"


@pytest.mark.parametrize(
    ("command", "flags"), [("profile", ["--quick", "--out", "p.json"]), ("bench engine", []), ("bench guided", [])]
)
def test_a_model_that_is_not_there_is_one_line_not_a_traceback(capsys, monkeypatch, tmp_path, command, flags):
    monkeypatch.chdir(tmp_path)
    assert main([*command.split(), *flags, "--model", "nosuch"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve {command}: model 'nosuch' is neither a built-in name")


def test_up_with_a_model_that_is_not_there_exits_2_in_one_line(tmp_path):
    """The `pdserve` command itself (its services composed): `up` said `pdserve: ...` and exited 1."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "services.main", "up", "--model", str(tmp_path / "nosuch"), "--port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("pdserve up: model ") and "neither a built-in name" in line, line


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: EngineConfig(kv_cache_memory_gb=math.nan), "kv_cache_memory_gb must be a positive number"),
        (lambda: EngineConfig(num_threads=0), "num_threads must be at least 1"),
        (lambda: EngineConfig(device="gpu"), "device must be auto, cpu, cuda or cuda:N"),
        (lambda: ClusterConfig(max_restarts=-5), "max_restarts must be >= 0"),
        (lambda: ClusterConfig(rollout_surge_wait_s=math.nan), "rollout_surge_wait_s must be >= 0"),
    ],
)
def test_engine_and_cluster_configs_refuse_what_their_flags_refuse(make, says):
    """The same bounds for a config built in code (the chart's controller, tests) as for the flags."""
    with pytest.raises(ValueError, match=says):
        make()


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--profile", "p.json", "--rate", "1", "--input-len", "8", "--output-len", "8", "--workers", "100000"],
        ["autoscale", "--addr", "127.0.0.1:1", "--profile", "p.json", "--max-workers", "1"],
    ],
    ids=["plan", "autoscale"],
)
def test_a_worker_count_no_scale_could_apply_is_a_usage_error(capsys, argv):
    """plan --workers 100000 ran for minutes with no output; scale applies at most 64 a role."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"])
    assert exit_.value.code == 2 and "must lie in [2, 128]" in capsys.readouterr().err
