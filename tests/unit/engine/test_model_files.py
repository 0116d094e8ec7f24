"""A model's config read from metadata: config.json, or a .gguf file's header without its tensor data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from pdserve.engine.model_files import (
    ModelNotFetchedError,
    locate_model,
    read_gguf_header,
    read_hf_config,
    read_model_config,
)
from pdserve.engine.models import SMOLLM2_GGUF, resolve_model
from pdserve.protocol.model_config import UnsupportedModelError


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model("smollm2-135m")


def test_gguf_header_alone_gives_the_converted_config(smollm2: Path, tmp_path: Path) -> None:
    """A copy cut where the tensor data begins reads the same: no tensor byte is needed for the config."""
    gguf = smollm2 / Path(SMOLLM2_GGUF).name
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(gguf.read_bytes()[: GGUFReader(gguf).data_offset])
    converted = json.loads((smollm2 / "config.json").read_text())
    assert read_hf_config(header_only) == converted == read_hf_config(gguf)
    assert read_model_config(header_only) == read_model_config(smollm2)


def test_gguf_header_matches_the_gguf_library(smollm2: Path) -> None:
    gguf = smollm2 / Path(SMOLLM2_GGUF).name
    reader = GGUFReader(gguf)
    meta, names = read_gguf_header(gguf)
    assert names == {t.name for t in reader.tensors}
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the library's own
    assert set(meta) == set(fields)
    for key, field in fields.items():
        expected = field.contents()
        assert meta[key] == (len(expected) if isinstance(expected, list) else expected), key


def test_locate_model_never_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelNotFetchedError, match="pdserve fetch --model tiny-random"):
        locate_model("tiny-random")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="neither a built-in name"):
        locate_model(str(tmp_path / "missing"))


def test_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        read_model_config(tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_model_config(tmp_path)
