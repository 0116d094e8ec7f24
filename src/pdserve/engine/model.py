"""Llama over a paged KV cache: one flattened batch of tokens from many sequences, no padding."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, paged_attention, write_kv
from pdserve.engine.rotary import RotaryEmbedding, apply_rotary
from pdserve.engine.weights import weights_fingerprint
from pdserve.protocol.model_config import ModelConfig


def _onednn_bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Module):
    """A bias-free projection whose weight is stored in the layout the kernels run fastest.

    On CPU, float32 GEMM is faster against a pre-transposed weight (`x @ w_t`), and bfloat16 against a
    weight pre-packed once for oneDNN (otherwise every call repacks it: measured 1.3-1.6x slower at
    batch 1-32). CUDA takes `F.linear(x, w)`.
    """

    PACK_BATCH_HINT = 128

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        on_cpu = weight.device.type == "cpu"
        self.mode = "plain"
        if on_cpu and weight.dtype == torch.float32:
            self.mode = "transposed"
            weight = weight.t().contiguous()
        elif on_cpu and weight.dtype == torch.bfloat16 and _onednn_bf16_available():
            self.mode = "packed"
            weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.PACK_BATCH_HINT)
        self.weight = nn.Parameter(weight.contiguous() if self.mode != "packed" else weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "transposed":
            return x @ self.weight
        if self.mode == "packed":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Exactly transformers' LlamaRMSNorm, bit for bit: `F.rms_norm` normalises a half-precision input in
    float32 and rounds back before the weight multiplies, as LlamaRMSNorm does op by op (2.5x slower)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.input_norm = RMSNorm(w["input_layernorm.weight"], config.rms_norm_eps)
        self.post_attention_norm = RMSNorm(w["post_attention_layernorm.weight"], config.rms_norm_eps)
        qkv = [w[f"self_attn.{p}_proj.weight"] for p in "qkv"]
        self.qkv_proj = Linear(torch.cat(qkv, dim=0))
        self.o_proj = Linear(w["self_attn.o_proj.weight"])
        self.gate_up_proj = Linear(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]], dim=0))
        self.down_proj = Linear(w["mlp.down_proj.weight"])
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        qkv = self.qkv_proj(self.input_norm(hidden))
        # Rotate queries and keys in one pass: [n, heads + kv_heads, head_dim].
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim), cos, signed_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        write_kv(cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k, v, cache, meta)
        hidden = hidden + self.o_proj(attn.reshape(n, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """Built from a Hugging Face-named state dict; projections are fused (QKV, gate+up) at load."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.fingerprint = weights_fingerprint(config, weights)  # before `take` empties `weights`

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        self.embed_tokens = nn.Parameter(take("model.embed_tokens.weight"), requires_grad=False)
        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            names = [n for n in weights if n.startswith(prefix)]
            layers.append(DecoderLayer(config, {n[len(prefix) :]: take(n) for n in names}))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(take("model.norm.weight"), config.rms_norm_eps)
        if config.tie_word_embeddings:  # an untied model without its head is refused at load (`check_weights`)
            self.lm_head = Linear(self.embed_tokens.data)
        else:
            self.lm_head = Linear(take("lm_head.weight"))
        self.rotary = RotaryEmbedding(config, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; returns the final hidden states [num_tokens, hidden]."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, signed_sin = self.rotary.lookup(positions)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, signed_sin, cache, meta)
        return self.norm(hidden)

    def projections(self) -> list[Linear]:
        """Every GEMM of a forward pass, in the order it runs (the LM head last): what bounds a step's speed."""
        layers = cast(list[DecoderLayer], list(self.layers))  # a ModuleList's items are typed Module
        per_layer = [(layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) for layer in layers]
        return [projection for projections in per_layer for projection in projections] + [self.lm_head]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] for the rows that sample; returns float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()
