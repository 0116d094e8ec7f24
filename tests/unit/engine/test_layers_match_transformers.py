"""The model's element-wise pieces equal transformers' Llama bit for bit, in float32 and bfloat16.

Greedy equality with transformers (test_model_matches_transformers) only holds while every operation
rounds as theirs does; these catch a rewrite that changes rounding without the slow end-to-end test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from pdserve.engine.model import RMSNorm
from pdserve.engine.rotary import RotaryEmbedding, apply_rotary
from pdserve.protocol.model_config import ModelConfig

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN = 576


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 512])
def test_rms_norm_is_transformers_bit_for_bit(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.rand(HIDDEN, generator=gen) * 2).to(dtype)
    x = (torch.randn(rows, HIDDEN, generator=gen) * 4).to(dtype)
    theirs = LlamaRMSNorm(HIDDEN, eps=1e-5).to(dtype)
    theirs.weight.data.copy_(weight)
    assert torch.equal(RMSNorm(weight, eps=1e-5)(x), theirs(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    hf_config = LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
        max_position_embeddings=2048, num_hidden_layers=1, intermediate_size=64, vocab_size=32,
    )  # fmt: skip
    positions = torch.tensor([0, 1, 7, 100, 1023, 2047])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 9, 64, generator=gen).to(dtype)
    k = torch.randn(len(positions), 3, 64, generator=gen).to(dtype)

    cos, signed_sin = RotaryEmbedding(ModelConfig.from_hf(hf_config.to_dict()), dtype, torch.device("cpu")).lookup(
        positions
    )
    their_cos, their_sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])  # [1, tokens, head_dim]
    # transformers lays heads before tokens: [batch, heads, tokens, head_dim].
    their_q, their_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], their_cos, their_sin)
    assert torch.equal(apply_rotary(q, cos, signed_sin), their_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, signed_sin), their_k[0].transpose(0, 1))
