"""The router's process imports no torch: its modules, the registry, configuration, the shared protocol and
the model's metadata (config and tokenizer) all load and run without it, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdserve import env
from pdserve.engine.models import resolve_model

ROOT = Path(__file__).resolve().parents[3]


def _modules(package_dir: Path, package: str) -> list[str]:
    return [f"{package}.{p.stem}" for p in sorted(package_dir.glob("*.py")) if p.stem != "__init__"]


ROUTER_SIDE = [
    *_modules(ROOT / "services" / "router", "services.router"),
    *_modules(ROOT / "src" / "pdserve" / "registry", "pdserve.registry"),
    *_modules(ROOT / "src" / "pdserve" / "protocol", "pdserve.protocol"),
    *_modules(ROOT / "src" / "pdserve" / "rpc", "pdserve.rpc"),
    "pdserve.config",
    "pdserve.env",
    "pdserve.errors",
    "pdserve.metrics",
    "pdserve.telemetry",
    "pdserve.cli",
    "pdserve.cluster.launcher",  # `pdserve up`'s process is the router's: launcher, CLI and services wired in
    "pdserve.cluster.worker_runtime",
    "services.main",
    "services.workers",
    "pdserve.engine.model_files",
    "pdserve.engine.tokenizer",
]

PROBE = """
import importlib, json, sys
from pathlib import Path
for name in {modules!r}:
    importlib.import_module(name)
from pdserve.engine.model_files import locate_model, read_model_config, tokenizer_folder
from pdserve.engine.tokenizer import Tokenizer
folder = locate_model("smollm2-135m")
configs = [read_model_config(folder), read_model_config(folder / {gguf!r})]
ids = Tokenizer(tokenizer_folder(folder)).apply_chat_template([("user", "hi")])
heavy = [m for m in ("torch", "transformers", "gguf", "safetensors") if m in sys.modules]
print(json.dumps({{"heavy": heavy, "same": configs[0] == configs[1], "vocab": configs[0].vocab_size, "ids": ids}}))
"""


def test_router_side_imports_and_model_metadata_need_no_torch() -> None:
    from pdserve.engine.models import SMOLLM2_GGUF

    resolve_model("smollm2-135m")  # built into the cache beforehand, as `pdserve up`'s workers do
    assert "services.router.server" in ROUTER_SIDE and "pdserve.registry.redis" in ROUTER_SIDE
    code = PROBE.format(modules=ROUTER_SIDE, gguf=Path(SMOLLM2_GGUF).name)
    child_env = {**env.worker_env(), "HOME": str(Path.home()), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []  # not even the gguf reader: the config comes from the header alone
    assert result["same"] and result["vocab"] == 49152
    assert len(result["ids"]) > 3
