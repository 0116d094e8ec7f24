"""A model's files: where they are (built-in name, model folder, .gguf file) and the config they describe.

Torch-free and weight-free: the router reads the model's architecture and tokenizer from here without
loading, converting or dequantizing a single tensor. Building a built-in model into the cache is the
engine's job (`pdserve.engine.models`), since it needs torch.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from pdserve import env
from pdserve.engine.cache_manifest import problem
from pdserve.protocol.model_config import ModelConfig, UnsupportedModelError

BUILTIN_MODELS = ("smollm2-135m", "tiny-random", "llama-1b-random")


class ModelNotFetchedError(FileNotFoundError):
    """A built-in model that is not in the cache yet; the message says how to put it there."""


def builtin_folder(name: str) -> Path:
    """Where a built-in model's converted folder lives (or will, once built)."""
    return env.cache_dir() / "models" / name


def is_built(folder: Path) -> bool:
    """Whether the folder holds every file its build wrote, at the size written (`cache_manifest`)."""
    return problem(folder) is None


def locate_model(model: str) -> Path:
    """A built-in name, a Hugging Face model folder or a .gguf file -> the path to read, without building."""
    if model in BUILTIN_MODELS:
        folder = builtin_folder(model)
        if (why := problem(folder)) == "not built":
            raise ModelNotFetchedError(f"model {model!r} is not in the cache yet: run `pdserve fetch --model {model}`")
        if why:
            raise ModelNotFetchedError(
                f"model {model!r} in {folder} is incomplete ({why}): run `pdserve fetch --model {model}` to rebuild it"
            )
        return folder
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}) nor an existing path"
        )
    return path


def damaged(path: Path, reason: str) -> UnsupportedModelError:
    """A model file that cannot be read as what it should be, named, with the fix where it is ours to rebuild (a
    built-in model's cache folder; a folder or .gguf the user named is theirs)."""
    owner = path.parent
    fix = f"; run `pdserve fetch --force --model {owner.name}`" if _in_cache(owner) else ""
    return UnsupportedModelError(f"{path}: damaged ({reason}){fix}")


def _in_cache(folder: Path) -> bool:
    try:
        return folder.name in BUILTIN_MODELS and folder.parent == env.cache_dir() / "models"
    except OSError:  # no cache to be in
        return False


def unreadable(path: Path) -> PermissionError | None:
    """A file that is there but that this user may not read (a cache built by another user), said so: safetensors
    and tokenizers report it as missing. None when it is readable or not there."""
    if not path.exists() or os.access(path, os.R_OK):
        return None
    st = path.stat()
    return PermissionError(
        f"{path}: not readable by uid {os.getuid()} (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}); "
        "let the files be read (chmod a+r) or build the cache as this user"
    )


def check_weight_files(folder: Path) -> None:
    """Each *.safetensors file of a model folder readable and whole, from its header alone (no tensor is read): a
    cut file is named before a cluster starts, not by each worker's load, four times over."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(folder.glob("*.safetensors")):
        if error := unreadable(f):
            raise error
        try:
            with safe_open(f, framework="numpy"):  # checks the header covers the file exactly
                pass
        except SafetensorError as e:
            raise damaged(f, str(e)) from None


def tokenizer_folder(path: Path) -> Path:
    """A model folder holds its tokenizer; a .gguf file's is read from the folder beside it."""
    return path if path.is_dir() else path.parent


def read_model_config(path: Path) -> ModelConfig:
    """The architecture of a model folder or .gguf file, from metadata only."""
    return ModelConfig.from_hf(read_hf_config(path))


def read_hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face style config dict: a folder's config.json, or built from a .gguf file's header."""
    if path.suffix == ".gguf":
        return gguf_hf_config(path)
    config = path / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    return _json_object(config)


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """End-of-sequence ids a model declares beside its config's: its generation_config.json's (where Llama 3
    Instruct declares its end of turn alone) or, in a GGUF, llama.cpp's end-of-turn and end-of-message ids. The
    engine stops on them too, as transformers and vLLM do. No part of the architecture, so not of ModelConfig (whose
    every field the KV fingerprint hashes: workers of one model must keep handing KV to each other across builds)."""
    if path.suffix == ".gguf":
        meta, _ = read_gguf_header(path)
        return _token_ids(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")))
    generation = path / "generation_config.json"
    return _token_ids(_json_object(generation).get("eos_token_id")) if generation.exists() else ()


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{path} holds no JSON object")
    return value


def _token_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Every id of `eos_token_id`-style values (an id, a list of ids or none), each once, in order."""
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else ([] if value is None else [value]):
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """What a .gguf file's metadata says, in config.json's terms."""
    meta, tensor_names = read_gguf_header(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}: pdserve runs llama")
    # llama.cpp writes Llama 3.1's rope scaling as per-frequency factors (rope_freqs.weight), with no type key:
    # run without them, the model would be wrong past a few thousand tokens.
    if "llama.rope.scaling.type" in meta or "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            f"{path}: GGUF rope scaling is not supported; pass the model's Hugging Face folder instead"
        )

    def need(key: str) -> Any:
        if key not in meta:
            raise UnsupportedModelError(f"{path}: its GGUF metadata lacks {key}")
        return meta[key]

    heads = int(need("llama.attention.head_count"))
    hidden = int(need("llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(need("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }


# GGUF metadata value types (the format's numbering) -> struct formats; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_GGUF_MAGIC = b"GGUF"


def read_gguf_header(path: Path) -> tuple[dict[str, Any], set[str]]:
    """A .gguf file's metadata and its tensors' names, read from the header; tensor data is never touched.

    Arrays (the vocabulary, merges, scores) come back as their length: nothing pdserve reads from the header
    needs more, and decoding 100k strings would cost seconds.
    """
    try:
        return _read_header(path)
    except UnsupportedModelError:
        raise
    except (ValueError, struct.error) as e:  # an empty file, a header cut short
        raise UnsupportedModelError(f"{path}: not a readable GGUF file (truncated or malformed: {e})") from None


def _read_header(path: Path) -> tuple[dict[str, Any], set[str]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _GGUF_MAGIC:
            raise UnsupportedModelError(f"{path} is not a GGUF file")
        reader = _HeaderReader(buf, 4)
        version = reader.scalar(4)
        if version < 2:
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 or later)")
        tensor_count, kv_count = reader.scalar(10), reader.scalar(10)
        meta = {reader.string(): reader.value(reader.scalar(4)) for _ in range(kv_count)}
        names = set()
        for _ in range(tensor_count):
            names.add(reader.string())
            reader.skip(8 * reader.scalar(4) + 4 + 8)  # the dimensions, element type and data offset
        return meta, names


class _HeaderReader:
    """Little-endian GGUF (version 2+) fields read one after another from a byte buffer."""

    def __init__(self, buf: mmap.mmap, offset: int) -> None:
        self.buf, self.offset = buf, offset

    def scalar(self, value_type: int) -> Any:
        fmt = "<" + _SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar(10)
        text = self.buf[self.offset : self.offset + n].decode("utf-8", errors="replace")
        self.offset += n
        return text

    def skip(self, n: int) -> None:
        self.offset += n

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self._skip_array()
        if value_type not in _SCALARS:
            raise UnsupportedModelError(f"unknown GGUF metadata type {value_type}")
        return self.scalar(value_type)

    def _skip_array(self) -> int:
        item_type, length = self.scalar(4), self.scalar(10)
        if item_type in _SCALARS:
            self.skip(length * struct.calcsize(_SCALARS[item_type]))
        elif item_type == _STRING:
            for _ in range(length):
                self.skip(self.scalar(10))
        else:  # arrays of arrays
            for _ in range(length):
                self.value(item_type)
        return length
