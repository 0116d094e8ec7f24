"""Reading model weights: Hugging Face folders (safetensors) and GGUF files (dequantized, un-permuted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from pdserve.protocol.model_config import UnsupportedModelError

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
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a Hugging Face model folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}: pdserve reads safetensors, never pickles")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A Hugging Face style config dict and float32 weights under Hugging Face names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}: pdserve runs llama")
    config = _gguf_config(meta)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
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
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return config, tensors


def _gguf_config(meta: dict[str, Any]) -> dict[str, Any]:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if "llama.rope.scaling.type" in meta:
        raise UnsupportedModelError("GGUF rope scaling is not supported; convert the model to a folder first")
    return config


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    blk, index, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in _GGUF_LAYER_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{index}.{_GGUF_LAYER_NAMES[rest]}"


def _torch_shape(gguf_shape: Any) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first; torch wants them slowest-first."""
    return tuple(int(d) for d in reversed(list(gguf_shape)))


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves (its convert script's `permute`)."""
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(weight.shape).contiguous()


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a model folder: it has no config.json")
    return json.loads(path.read_text())
