"""`pdserve up` and `controller` refuse a fleet that could not serve, or a port they could not listen on, before
anything starts: one line, exit 2. Every command that builds an engine refuses an engine it could not run so."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from pdserve import cli
from pdserve.cluster.commands import check_ports_distinct
from pdserve.config import MAX_WORKERS_PER_ROLE, ClusterConfig
from services.main import main


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prefill": 0}, "prefill"),
        ({"decode": -1}, "decode"),
        ({"decode": MAX_WORKERS_PER_ROLE + 1}, "decode"),
        ({"mode": "colocated", "workers": 0}, "workers"),
    ],
)
def test_a_fleet_that_cannot_serve_is_refused_naming_the_count(fields, named):
    with pytest.raises(ValueError, match=f"^{named} must be"):
        ClusterConfig(**fields)


def test_the_other_modes_counts_do_not_matter():
    assert ClusterConfig(mode="colocated", prefill=0, decode=0, workers=2).roles == ["colocated"] * 2


def test_up_exits_2_with_one_line_before_ray_starts(capsys):
    assert main(["up", "--model", "tiny-random", "--prefill", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdserve up: --prefill must be 1 to 64 workers in disaggregated mode, got -1"]


CONTROLLER = ["controller", "--model", "tiny-random", "--ray-address", "127.0.0.1:1", "--redis", "redis://r:6379/0"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["up", "--mode", "colocated", "--prefill", "3"],
            "--prefill counts --mode disaggregated's workers; --mode colocated takes --workers",
        ),
        (
            ["up", "--mode", "disaggregated", "--workers", "4"],
            "--workers counts --mode colocated's workers; --mode disaggregated takes --prefill and --decode",
        ),
        (["up", "--workers", "4"], "--workers counts --mode colocated's workers"),  # disaggregated by default
        ([*CONTROLLER, "--mode", "colocated", "--decode", "2"], "--decode counts --mode disaggregated's workers"),
    ],
)
def test_a_count_of_the_other_mode_is_refused_naming_both_flags_not_ignored(capsys, monkeypatch, argv, line):
    """`up --mode colocated --prefill 3` started 2 colocated workers, --workers' default, and said nothing."""
    monkeypatch.setattr(cli, "_runner", lambda command: pytest.fail(f"{command} started with the other mode's count"))
    assert main([*argv, "--model", "tiny-random"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"pdserve {argv[0]}: {line}"), err


def test_only_a_count_given_is_checked_and_each_mode_takes_its_own():
    parse = cli._parser().parse_args
    assert cli._cluster_config(parse(["up", "--mode", "colocated", "--workers", "3"])).roles == ["colocated"] * 3
    assert cli._cluster_config(parse(["up", "--mode", "colocated"])).workers == ClusterConfig.workers
    assert cli._cluster_config(parse(["up", "--prefill", "2", "--decode", "3"])).roles.count("decode") == 3


ROUTER = ["router", "--model", "tiny-random", "--redis", "redis://127.0.0.1:1/0"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["router", "--model", "tiny-random", "--redis", "notaurl"], "--redis must be a redis://"),
        (  # a scheme mistyped still hides the password it carries
            ["router", "--model", "tiny-random", "--redis", "redis:/:hunter2@h:6379?password=hunter2"],
            "--redis must be a redis://, rediss:// or unix:// URL, got '***@h:6379?password=***'",
        ),
        ([*ROUTER, "--metrics-port", "99999"], "--metrics-port must be a TCP port"),
        ([*ROUTER, "--http-port", "-5"], "--http-port must be a TCP port"),
        ([*ROUTER, "--drain-grace-s", "nan"], "--drain-grace-s must be a finite number >= 0"),
        ([*ROUTER, "--max-attempts", "0"], "--max-attempts must be at least 1"),
    ],
)
def test_a_router_refuses_what_it_could_not_use_in_one_line_not_a_traceback(capsys, argv, line):
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"pdserve router: {line}"), err


@pytest.mark.parametrize(
    ("flags", "line"),
    [  # each named the dataclass field (kv_transfer_timeout_s, stall_timeout_s), not the flag the operator typed
        (["--kv-transfer-timeout", "0"], "--kv-transfer-timeout must be above 0"),
        (["--stall-timeout-s", "1"], "--stall-timeout-s must be at least 2 s"),
        (["--first-token-timeout-s", "0"], "--first-token-timeout-s must be a positive number"),
        (["--redis", "localhost:6379"], "--redis must be a redis://, rediss:// or unix:// URL"),
        (["--advertise-host", "0.0.0.0"], "--advertise-host must be an address others can dial"),
        (["--mode", "colocated", "--workers", "0"], "--workers must be 1 to 64 workers in colocated mode"),
    ],
)
def test_a_setting_out_of_its_range_is_named_by_the_flag_that_gave_it(capsys, flags, line):
    assert main(["up", "--model", "tiny-random", *flags]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"pdserve up: {line}"), err


def test_a_router_config_files_setting_is_named_by_its_key_and_a_flag_over_it_by_the_flag(capsys, tmp_path):
    config = tmp_path / "router.toml"
    config.write_text("[router]\nstall_timeout_s = 1.0\n")
    argv = ["up", "--model", "tiny-random", "--router-config", str(config)]
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"pdserve up: {config}: stall_timeout_s must be at least 2 s"), err
    config.write_text("[router]\nstall_timeout_s = 10.0\n")
    assert main([*argv, "--stall-timeout-s", "1"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("pdserve up: --stall-timeout-s must be at least 2 s"), err


@pytest.mark.parametrize("command", ["up", "controller", "generate", "profile", "bench engine"])
def test_a_batch_of_no_sequences_is_refused_by_every_command_that_builds_an_engine(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), "--max-num-seqs", "0"])
    assert exit_.value.code == 2
    assert "argument --max-num-seqs: must be at least 1, got 0" in capsys.readouterr().err


def test_bench_engine_refuses_rows_larger_than_a_step_runs(capsys):
    assert main(["bench", "engine", "--batch-sizes", "1,8", "--max-num-seqs", "4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "pdserve bench engine: --batch-sizes 8 is past --max-num-seqs 4"


def test_a_taken_port_is_named_before_anything_starts(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--model", "tiny-random", "--port", "0", "--http-port", str(port)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pdserve up: 127.0.0.1:{port} cannot be bound")
    assert line.endswith("pass another --http-port")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["up", "--port", "50962", "--metrics-port", "50962"], "--metrics-port and --port are both 50962"),
        (["up", "--http-port", "50962", "--worker-port", "50962"], "--http-port and --worker-port are both 50962"),
        ([*ROUTER, "--port", "50962", "--http-port", "50962"], "--port and --http-port are both 50962"),
        (
            [*CONTROLLER, "--transfer-port", "50962", "--worker-metrics-port", "50962"],
            "--transfer-port and --worker-metrics-port are both 50962",
        ),
    ],
)
def test_two_port_flags_naming_one_port_are_named_before_anything_binds(capsys, monkeypatch, argv, line):
    """`up --port P --metrics-port P` said P could not be bound (the second bind's failure): pass another --port."""
    monkeypatch.setattr(cli, "_runner", lambda command: pytest.fail(f"{command} started"))
    assert main([*argv, "--model", "tiny-random"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == f"pdserve {argv[0]}: {line}: give each a port of its own"


def test_a_controllers_metrics_or_a_joined_clusters_workers_may_share_a_port_number_with_the_router():
    """A controller's workers, and those of an `up` that joins a Ray cluster, may run on other hosts."""
    check_ports_distinct({"--metrics-port": 9100}, "controller", ClusterConfig(ray_address="auto", worker_port=9100))
    joined = ClusterConfig(ray_address="10.0.0.1:6379", port=9100, worker_port=9100)
    check_ports_distinct({"--port": 9100}, "up", joined)
    with pytest.raises(ValueError, match="^--port and --worker-port are both 9100"):
        check_ports_distinct({"--port": 9100}, "up", replace(joined, ray_address=None))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:6379/0", "redis://***@h:6379/0"),
        ("redis://:hunter@2@h:6379", "redis://***@h:6379"),  # redis-py reads the password up to the last @
        ("rediss://h:6380/0?ssl_password=hunter2&db=1", "rediss://h:6380/0?ssl_password=***&db=1"),
        ("unix:///run/redis.sock?password=hunter2", "unix:///run/redis.sock?password=***"),
        ("redis://h/0?%70assword=hunter2&db=1", "redis://h/0?%70assword=***&db=1"),  # redis-py decodes the name
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_a_redis_url_is_shown_without_its_password(url: str, shown: str) -> None:
    from pdserve.redaction import redacted_url

    assert redacted_url(url) == shown


@pytest.mark.timeout(30)  # let through, the command would try to join the Ray address for minutes
@pytest.mark.parametrize("command", ["up", "controller"])
@pytest.mark.parametrize(
    "url", ["redis://:hunter2@h:6379/0", "redis://app:hunter2@h:6379/0", "redis://h:6379/0?password=hunter2"]
)
def test_a_command_starting_workers_through_ray_refuses_a_password_in_the_redis_url(capsys, command, url):
    """The URL reaches every worker actor's arguments, which Ray's GCS keeps; the environment variable does not."""
    argv = [command, "--model", "tiny-random", "--redis", url, "--ray-address", "127.0.0.1:1"]
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "give the password in PDSERVE_REDIS_PASSWORD" in err and "hunter2" not in err, err


@pytest.mark.parametrize(
    ("url", "carries"),
    [
        ("redis://app@h:6379/0", False),  # an ACL user alone: its password may come from the environment
        ("redis://h:6379/0?db=1", False),
        ("unix:///run/redis.sock?%70assword=x", True),
        ("rediss://:p@ss@h:6380", True),
    ],
)
def test_a_password_is_found_where_redis_py_reads_one(url: str, carries: bool) -> None:
    from pdserve.redaction import has_password

    assert has_password(url) is carries
