"""Reading model weights: Hugging Face folders (safetensors) and GGUF files (dequantized, un-permuted).

The config alone is read without any of this, from metadata (`pdserve.engine.model_files`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from pdserve.engine.model_files import check_weight_files, damaged, gguf_hf_config
from pdserve.protocol.model_config import ModelConfig, UnsupportedModelError

# GGUF tensor names (per layer after "blk.N.") -> Hugging Face names (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
FINGERPRINT_SAMPLES = 1024  # values hashed per tensor, spread evenly over it
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a Hugging Face model folder. A file that cannot be read is named
    (safetensors names none, and calls an unreadable one missing)."""
    _check_shards(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}: pdserve reads safetensors, never pickles")
    check_weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def _check_shards(folder: Path) -> None:
    """Every shard a sharded checkpoint's index names is there: one missing would leave its tensors out, which
    `check_weights` names only by tensor (and a missing lm_head would once have been tied silently)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise damaged(index, f"no readable weight_map: {e!r}") from None
    if missing := sorted(str(name) for name in shards if not (folder / str(name)).is_file()):
        raise UnsupportedModelError(f"{folder}: {', '.join(missing)} missing, named by {index.name}")


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A Hugging Face style config dict and float32 weights under Hugging Face names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    config = gguf_hf_config(path)
    tensors: dict[str, torch.Tensor] = {}
    try:
        gguf_tensors = GGUFReader(path).tensors
    except ValueError as e:  # the tensor data cut short: gguf cannot shape its memory map
        raise UnsupportedModelError(f"{path}: its tensor data is truncated or malformed ({e})") from None
    for t in gguf_tensors:
        array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if not array.flags.writeable:  # unquantized tensors come straight from the memory map
            array = array.copy()
        name = _hf_name(t.name)
        tensor = torch.from_numpy(np.ascontiguousarray(array)).reshape(_torch_shape(t.shape))
        if name.endswith("q_proj.weight"):
            tensor = _unpermute_rope(tensor, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            tensor = _unpermute_rope(tensor, config["num_key_value_heads"])
        tensors[name] = tensor
    return config, tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    blk, index, rest = [*gguf_name.split(".", 2), "", ""][:3]
    if blk != "blk" or not index.isdigit() or rest not in _GGUF_LAYER_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}: not one of a Llama's")
    return f"model.layers.{index}.{_GGUF_LAYER_NAMES[rest]}"


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    """UnsupportedModelError naming every tensor a Llama of `config` lacks or holds in another shape, at load,
    as transformers refuses them: a wrong shape would otherwise load and fail the first request, or a vocabulary
    larger than the embedding would pass request checks and index past it. Extra tensors are ignored."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    expected = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings or "lm_head.weight" in weights:  # tied: the embedding serves as the head
        expected["lm_head.weight"] = (config.vocab_size, h)
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    for layer in range(config.num_layers):
        expected |= {f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    missing = [name for name in expected if name not in weights]
    wrong = [
        f"{name} is {tuple(weights[name].shape)}, its config makes it {shape}"
        for name, shape in expected.items()
        if name in weights and tuple(weights[name].shape) != shape
    ]
    if missing or wrong:
        problems = [f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"] if missing else []
        raise UnsupportedModelError(f"{source}: weights do not match its config: {'; '.join(problems + wrong[:5])}")


def _torch_shape(gguf_shape: Any) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first; torch wants them slowest-first."""
    return tuple(int(d) for d in reversed(list(gguf_shape)))


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves (its convert script's `permute`)."""
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(weight.shape).contiguous()


def weights_fingerprint(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    """Equal on two workers only when they run the same architecture with the same weights: KV from one is
    meaningless to the other otherwise. Every tensor counts (a fine-tune may leave the embeddings as they were),
    by its name, shape and values spread evenly over it (a tuned tensor changes throughout), as read from the
    files: the same whatever device, dtype or kernel layout a worker then keeps them in."""
    digest = hashlib.blake2b(repr(config).encode(), digest_size=8)
    for name in sorted(weights):
        flat = weights[name].reshape(-1)
        sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
        digest.update(f"{name}{tuple(weights[name].shape)}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()
