"""The model fingerprint workers compare before one's KV serves another: it tells apart weights that differ in any
tensor (a fine-tune that kept its embeddings), and only those."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.model_runner import load_model
from pdserve.engine.models import resolve_model


@pytest.fixture(scope="module")
def tiny() -> Path:
    return resolve_model("tiny-random")


def fingerprint(path: Path, dtype: torch.dtype = torch.float32) -> str:
    return load_model(path, dtype, torch.device("cpu")).fingerprint


def tuned(tiny: Path, out: Path, name: str) -> Path:
    """tiny-random with tensor `name` moved a little throughout, every other tensor (the embeddings too) as is."""
    shutil.copytree(tiny, out)
    weights = load_file(tiny / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    weights[name] = weights[name] + 1e-3 * torch.randn(weights[name].shape, generator=generator).to(weights[name].dtype)
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])
def test_weights_tuned_past_the_embeddings_have_another_fingerprint(tiny: Path, tmp_path: Path, name: str) -> None:
    assert fingerprint(tuned(tiny, tmp_path / "tuned", name)) != fingerprint(tiny)


def test_the_same_weights_have_one_fingerprint_in_any_dtype_and_copy(tiny: Path, tmp_path: Path) -> None:
    """A float32 and a bfloat16 worker keep the weights in other layouts (KV layouts check the dtype apart)."""
    shutil.copytree(tiny, tmp_path / "copy")
    assert fingerprint(tiny) == fingerprint(tiny, torch.bfloat16) == fingerprint(tmp_path / "copy")
