"""The CLI's defaults are the config dataclasses' defaults, and --help shows them."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.config import ClusterConfig, EngineConfig, RouterConfig


def test_up_without_flags_is_the_default_cluster_config() -> None:
    args = cli._parser().parse_args(["up"])
    assert cli._cluster_config(args) == ClusterConfig()
    assert ClusterConfig().engine == EngineConfig() and ClusterConfig().router == RouterConfig()


def test_up_flags_reach_the_config() -> None:
    argv = ["up", "--model", "tiny-random", "--prefill", "2", "--kv-cache-gb", "0.25", "--kv-transfer-timeout", "7"]
    config = cli._cluster_config(cli._parser().parse_args([*argv, "--default-ttft-ms", "900", "--port", "0"]))
    assert (config.engine.model, config.prefill, config.engine.kv_cache_memory_gb) == ("tiny-random", 2, 0.25)
    assert (config.kv_transfer_timeout_s, config.router.default_ttft_ms, config.port) == (7.0, 900.0, 0)
    assert config.router.default_tpot_ms == RouterConfig.default_tpot_ms


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["up"], [f"(default: {ClusterConfig.port})", f"(default: {RouterConfig.default_ttft_ms:g})"]),
        (["up"], [f"(default: {EngineConfig.model})", f"(default: {ClusterConfig.kv_transfer_timeout_s})"]),
        (["generate"], ["(default: 128)", f"(default: {EngineConfig.dtype})"]),
        (["bench", "engine"], ["(default: 1,8,32)"]),
        (["profile"], [f"KV cache per worker (GiB) (default: {EngineConfig.kv_cache_memory_gb})"]),  # as up shows
    ],
)
def test_help_shows_defaults(argv: list[str], shown: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in shown:
        assert default in text
    assert "(default: None)" not in text


def test_controller_and_router_flags_reach_the_config() -> None:
    argv = ["controller", "--ray-address", "10.0.0.1:6379", "--redis", "redis://r:6379/0", "--role-resources"]
    argv += ["--bind-host", "0.0.0.0", "--advertise-host", "10.0.0.7", "--worker-port", "50061"]
    config = cli._cluster_config(cli._parser().parse_args([*argv, "--transfer-port", "50062", "--decode", "2"]))
    assert (config.ray_address, config.redis_url) == ("10.0.0.1:6379", "redis://r:6379/0")
    assert config.ray_namespace == "pdserve"
    assert (config.host, config.advertise_host, config.worker_port, config.transfer_port) == (
        "0.0.0.0",
        "10.0.0.7",
        50061,
        50062,
    )
    assert config.role_resources and config.decode == 2 and not config.stop_workers_on_exit
    router = cli._parser().parse_args(["router", "--redis", "redis://r/0", "--host", "0.0.0.0", "--port", "0"])
    config = cli._cluster_config(router)
    assert (config.redis_url, config.host, config.port, config.ray_address) == ("redis://r/0", "0.0.0.0", 0, None)


def test_a_wildcard_is_never_advertised() -> None:
    with pytest.raises(ValueError, match="--advertise-host must be an address others can dial"):
        cli._cluster_config(cli._parser().parse_args(["up", "--advertise-host", "0.0.0.0"]))
