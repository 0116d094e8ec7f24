"""A model folder or .gguf file the engine cannot run is refused by name when it is read (router) or loaded
(worker), as transformers refuses it: never a bare KeyError or struct error, never a load that fails the first
request. And the end-of-sequence ids a model declares anywhere all stop it."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_files import generation_eos_ids, read_model_config, unreadable
from pdserve.engine.model_runner import load_model
from pdserve.engine.models import resolve_model, write_folder_from_gguf
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.model_config import UnsupportedModelError

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@pytest.fixture(scope="module")
def tiny() -> Path:
    return resolve_model("tiny-random")


def load(path: Path) -> None:
    load_model(path, torch.float32, torch.device("cpu"))


def folder(tiny: Path, tmp_path: Path, config: dict | None = None, drop: str = "") -> Path:
    """tiny-random's folder, its config patched and one tensor dropped."""
    out = tmp_path / "model"
    out.mkdir()
    cfg = json.loads((tiny / "config.json").read_text()) | (config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in load_file(tiny / "model.safetensors").items() if k != drop}, out / "model.safetensors")
    return out


def write_gguf(
    tiny: Path, path: Path, extra_tensors: dict[str, np.ndarray] | None = None, eos: int = 2, **ids: int
) -> Path:
    """tiny-random as a float32 .gguf with llama.cpp's names (the q/k rows left as they are: only shapes and
    metadata matter here); `ids`: extra special token ids by GGUF key (eot, eom)."""
    cfg = json.loads((tiny / "config.json").read_text())
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    writer.add_eos_token_id(eos)
    for key, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    for name, tensor in load_file(tiny / "model.safetensors").items():
        stem = name.removesuffix(".weight")
        if stem in GGUF_GLOBAL_NAMES:
            gguf_name = GGUF_GLOBAL_NAMES[stem]
        else:
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"
        writer.add_tensor(f"{gguf_name}.weight", tensor.numpy())
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def engine_for(path: Path) -> LLMEngine:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, num_threads=1)
    return LLMEngine(config)


def test_every_eos_id_a_folder_declares_stops_it_and_its_kv_fingerprint_stays(tiny: Path, tmp_path: Path) -> None:
    """Llama 3 Instruct declares its end of turn in generation_config.json alone; transformers and vLLM stop there.
    Those ids are no part of the architecture: workers of the same weights, one reading them and one not (two
    builds in a rolling upgrade), still hand KV to each other."""
    model = folder(tiny, tmp_path)
    shutil.copy(tiny / "tokenizer.json", model / "tokenizer.json")
    before = engine_for(model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [186, 2]}))
    after = engine_for(model)
    assert generation_eos_ids(model) == (186, 2)
    assert {2, 186} <= after.eos_token_ids and 186 not in before.eos_token_ids
    assert after.fingerprint == before.fingerprint


def test_a_gguf_stops_on_its_end_of_turn_too(tiny: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny, tmp_path / "m.gguf", eot=186, eom=187)
    assert generation_eos_ids(path) == (2, 186, 187)
    load(path)  # and it loads: the writer above is a faithful one


def test_a_gguf_with_llama3_rope_factors_is_refused_when_read(tiny: Path, tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1's rope scaling as a tensor and no type key: run without it the model is wrong."""
    path = write_gguf(tiny, tmp_path / "m.gguf", {"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope scaling is not supported"):
        read_model_config(path)


def test_a_cut_or_empty_gguf_is_named(tiny: Path, tmp_path: Path) -> None:
    whole = write_gguf(tiny, tmp_path / "m.gguf").read_bytes()
    for name, data in (("header.gguf", whole[:300]), ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UnsupportedModelError, match=f"{name}: not a readable GGUF file"):
            read_model_config(tmp_path / name)
    (tmp_path / "data.gguf").write_bytes(whole[:-1000])
    read_model_config(tmp_path / "data.gguf")  # the header is whole
    with pytest.raises(UnsupportedModelError, match="tensor data is truncated"):
        load(tmp_path / "data.gguf")


def test_a_config_missing_a_key_or_not_json_is_named(tiny: Path, tmp_path: Path) -> None:
    model = folder(tiny, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_attention_heads"}))
    with pytest.raises(UnsupportedModelError, match="lacks num_attention_heads"):
        read_model_config(model)
    (model / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="config.json is not valid JSON"):
        read_model_config(model)


@pytest.mark.parametrize(
    ("config", "drop", "message"),
    [
        ({}, "model.layers.1.self_attn.q_proj.weight", "missing model.layers.1.self_attn.q_proj.weight"),
        ({"num_key_value_heads": 4}, "", r"k_proj.weight is \(32, 64\), its config makes it \(64, 64\)"),
        ({"vocab_size": 300}, "", r"embed_tokens.weight is \(259, 64\), its config makes it \(300, 64\)"),
        ({"tie_word_embeddings": False}, "lm_head.weight", "missing lm_head.weight"),  # was tied, silently
    ],
)
def test_weights_that_do_not_match_the_config_are_refused_at_load(
    tiny: Path, tmp_path: Path, config: dict, drop: str, message: str
) -> None:
    """A wrong KV head count loaded and failed the first request; a vocabulary past the embedding let request
    checks pass ids that indexed past it."""
    with pytest.raises(UnsupportedModelError, match=message):
        load(folder(tiny, tmp_path, config, drop))


def test_a_gguf_converted_to_a_folder_keeps_its_end_of_turn(tiny: Path, tmp_path: Path) -> None:
    """The folder keeps them where folders do, in generation_config.json: it stopped only on the eos otherwise."""
    path = write_gguf(tiny, tmp_path / "m.gguf", eot=186)
    shutil.copy(tiny / "tokenizer.json", tmp_path / "tokenizer.json")
    (out := tmp_path / "folder").mkdir()
    write_folder_from_gguf(path, out)
    assert generation_eos_ids(out) == (2, 186)


def test_a_shard_its_index_names_must_be_there(tiny: Path, tmp_path: Path) -> None:
    """A sharded checkpoint missing the shard with lm_head.weight ran on the embedding instead."""
    model = folder(tiny, tmp_path)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UnsupportedModelError, match="model-00002-of-00002.safetensors missing, named by model.saf"):
        load(model)


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_cut_file_in_the_cache_is_named_with_the_command_that_rebuilds_it(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors said "incomplete metadata" and tokenizers an EOF, naming no file, in every worker's four tries.
    (A folder built before the manifest existed: one built since is found incomplete before it is loaded.)"""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    cached = shutil.copytree(tiny, tmp_path / "models" / "tiny-random")
    cut(cached / "model.safetensors")
    cut(cached / "tokenizer.json")
    fix = "; run `pdserve fetch --force --model tiny-random`"
    with pytest.raises(UnsupportedModelError, match=r"model.safetensors: damaged \(.+\)" + re.escape(fix)):
        load(cached)
    with pytest.raises(UnsupportedModelError, match=r"tokenizer.json: damaged \(.+\)" + re.escape(fix)):
        Tokenizer(cached)
    mine = shutil.copytree(cached, tmp_path / "mine")  # the user's own folder: not ours to rebuild
    with pytest.raises(UnsupportedModelError, match=r"mine/model.safetensors: damaged \([^)]+\)$"):
        load(mine)


def test_a_weights_file_this_user_may_not_read_is_named_with_its_owner_and_mode(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors raises FileNotFoundError on EACCES: "No such file or directory", for a file that is there.
    (Root reads every file, so the denial is the os's answer here; `..._as_another_user` checks the real one.)"""
    model = folder(tiny, tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=rf"model.safetensors: not readable by uid {os.getuid()} \(owner uid"):
        load(model)


@pytest.mark.skipif(os.getuid() == 0, reason="root reads every file")
def test_a_weights_file_this_user_may_not_read_as_another_user(tiny: Path, tmp_path: Path) -> None:
    model = folder(tiny, tmp_path)
    (model / "model.safetensors").chmod(0o200)
    with pytest.raises(PermissionError, match=r"model.safetensors: not readable .* mode 200"):
        load(model)


@pytest.mark.skipif(os.getuid() != 0, reason="becomes another user")
def test_a_file_root_wrote_0600_is_named_to_another_user(tiny: Path) -> None:
    """The reported case, for real: a cache baked as root, read by uid 65534 (a forked child, which imports nothing
    more: the interpreter's own files may not be readable by that user)."""
    shared = Path(tempfile.mkdtemp())  # pytest's tmp_path lies under a 0700 folder
    try:
        shared.chmod(0o755)
        model = folder(tiny, shared)  # safetensors wrote it 0600
        read, write = os.pipe()
        if (child := os.fork()) == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(write, str(unreadable(model / "model.safetensors")).encode())
            finally:
                os._exit(0)  # never back into pytest
        os.waitpid(child, 0)
        os.close(write)
        said = os.read(read, 4096).decode()
    finally:
        shutil.rmtree(shared)
    assert said.startswith(f"{model / 'model.safetensors'}: not readable by uid 65534 (owner uid 0, mode 600)")
