"""Rotary position embeddings (rotate-half form, as Hugging Face Llama), with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import torch

from pdserve.protocol.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Computed exactly as transformers does, so float32 outputs match token for token."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, config)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    s = config.rope_scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to the context length, looked up per token.

    The sin table carries rotate-half's sign (its first half negated), so applying the rotation takes one
    roll instead of two slices, a negation and a concatenation; negating a factor instead of the term
    is exact, so the result is bit-identical to Hugging Face's `x * cos + rotate_half(x) * sin`.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
        freqs = positions[:, None] * inverse_frequencies(config)[None, :]
        self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(dtype=dtype, device=device)  # [max_pos, head_dim]
        self.signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, shaped to broadcast over heads: [num_tokens, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; rolling by half swaps the halves as rotate-half does."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
