"""What a command says about a model it cannot use: once, in one line, before any worker starts (retrying workers
cannot make an architecture supported or a cache writable), never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.cli import main
from pdserve.engine.models import resolve_model


@pytest.fixture
def tiny() -> Path:
    return resolve_model("tiny-random")


def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(command: str) -> None:
        pytest.fail("the cluster started")

    monkeypatch.setattr(cli, "_runner", never)


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_up_refuses_an_unsupported_architecture_at_once_as_generate_does(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It cost 46 s of eight worker starts before the same error."""
    from services.main import SERVICES

    model = shutil.copytree(tiny, tmp_path / "mistral")
    config = json.loads((model / "config.json").read_text()) | {"architectures": ["MistralForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config | {"model_type": "mistral"}))
    no_cluster(monkeypatch)
    assert main(["up", "--model", str(model), "--port", "0"], services=SERVICES) == 2
    up = one_line(capsys)
    assert main(["generate", "--model", str(model), "--prompt", "hi"]) == 2
    generate = one_line(capsys)
    assert "unsupported architecture ('MistralForCausalLM',)" in up
    assert up.removeprefix("pdserve up: ") == generate.removeprefix("pdserve generate: ")


@pytest.mark.parametrize("command", ["up", "router"])
@pytest.mark.parametrize("file", ["tokenizer.json", "model.safetensors"])
def test_a_cut_tokenizer_or_weights_file_is_named_before_any_worker_starts(
    tiny: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    file: str,
) -> None:
    """Each worker failed on it four times (50 s), naming no file; the router in a traceback."""
    from services.main import SERVICES

    model = shutil.copytree(tiny, tmp_path / "model")
    (model / file).write_bytes((model / file).read_bytes()[:-100])
    no_cluster(monkeypatch)
    redis = ["--redis", "redis://127.0.0.1:1/0"] if command == "router" else []
    assert main([command, "--model", str(model), "--port", "0", *redis], services=SERVICES) == 2
    assert one_line(capsys).startswith(f"pdserve {command}: {model / file}: damaged (")


@pytest.mark.parametrize("command", [["fetch"], ["generate", "--prompt", "hi"], ["up", "--port", "0"]])
def test_no_home_for_the_default_cache_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """A container's uid with no passwd entry and no HOME: RuntimeError "Could not determine home directory"."""
    from services.main import SERVICES

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    no_cluster(monkeypatch)
    assert main([*command, "--model", "tiny-random"], services=SERVICES) == 1
    line = one_line(capsys)
    assert line.startswith(f"pdserve {command[0]}: ") and "set PDSERVE_CACHE_DIR" in line


@pytest.mark.parametrize("command", [["fetch"], ["generate", "--prompt", "hi"]])
def test_a_cache_that_cannot_be_written_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """(`up` fetches through `pdserve fetch`.) /sys takes no folder, even from root: as a read-only volume."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/sys/pdserve-cache")
    assert main([*command, "--model", "tiny-random"]) == 1
    line = one_line(capsys)
    assert line.startswith(f"pdserve {command[0]}: could not build tiny-random in the model cache (")
    assert "PDSERVE_CACHE_DIR" in line


def test_force_is_for_built_in_models_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder or .gguf the user named is theirs: pdserve never rebuilds it."""
    assert main(["fetch", "--force", "--model", str(tmp_path)]) == 2
    assert one_line(capsys) == f"pdserve fetch: --force rebuilds built-in models only, not {tmp_path}"


def test_sigterm_of_up_during_its_fetch_stops_the_fetch_too(tmp_path: Path) -> None:
    """A pod's stop reaches `pdserve up` alone: its child fetch built on, orphaned, and left its staging folder."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pdserve.cluster.local_process import PDSERVE_COMMAND, alive, descendants
    from pdserve.engine.model_cache import OWNER_FILE

    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    up = subprocess.Popen([sys.executable, "-m", PDSERVE_COMMAND, "up", "--model", "tiny-random"], env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f"models/.tiny-random-*/{OWNER_FILE}")):
        assert up.poll() is None and time.monotonic() < deadline, "the fetch never began building"
        time.sleep(0.01)
    children = descendants(up.pid)
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=60) == 128 + signal.SIGTERM
    assert children and not any(alive(pid) for pid in children)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".tiny-random.lock"]


@pytest.mark.parametrize("command", [["fetch"], ["generate", "--prompt", "hi"], ["up", "--port", "0"]])
def test_a_name_that_is_no_model_is_a_usage_error_for_every_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    """`fetch` answered it 1, as a cache it could not write, where `up` and `generate` answer 2."""
    from services.main import SERVICES

    no_cluster(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--model", "smollm-135m"], services=SERVICES) == 2
    line = one_line(capsys)
    assert line.startswith(f"pdserve {command[0]}: model 'smollm-135m' is neither a built-in name (smollm2-135m,"), line


def test_an_unknown_log_level_names_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    from services.main import SERVICES

    assert main(["up", "--model", "tiny-random", "--port", "0", "--log-level", "LOUD"], services=SERVICES) == 2
    assert one_line(capsys) == "pdserve up: unknown --log-level 'LOUD' (DEBUG, INFO, WARNING or ERROR)"
