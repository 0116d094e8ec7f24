"""The architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class UnsupportedModelError(ValueError):
    """The model folder describes something this engine cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    rope_scaling: RopeScaling = RopeScaling()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = tuple(cfg.get("architectures") or ())
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and cfg.get("model_type") != "llama":
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: "
                f"pdserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UnsupportedModelError("Llama variants with attention or MLP biases are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported activation {cfg['hidden_act']!r}: only silu")
        missing = [key for key in _REQUIRED_KEYS if key not in cfg]
        if missing:
            raise UnsupportedModelError(f"the model's config lacks {', '.join(missing)}")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            rope_scaling=_rope_scaling(cfg),
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling:
    """transformers 4.x writes `rope_scaling`, 5.x `rope_parameters`; both mean the same."""
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}: supported {SUPPORTED_ROPE_TYPES}")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
