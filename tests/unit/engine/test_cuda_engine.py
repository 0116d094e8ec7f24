"""The engine on CUDA, skipped without a GPU (`scripts/gpu_check.sh` runs these on a device machine): float32
greedy output equals the CPU's token for token (decode captured in CUDA graphs, the default, and eager);
bfloat16 runs the real model and returns every block."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 180)), [7] * 300, list(range(200, 250)) * 3]  # within tiny-random's vocab


def _greedy(model: str, device: str, dtype: str, decode_graphs: str = "auto") -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, decode_graphs=decode_graphs))
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return [c.token_ids for c in completions], engine


@pytest.mark.parametrize("model", ["tiny-random", "smollm2-135m"])
def test_greedy_float32_on_cuda_equals_cpu(model: str) -> None:
    on_cpu, _ = _greedy(model, "cpu", "float32")
    on_cuda, _ = _greedy(model, "cuda", "float32")
    assert on_cuda == on_cpu


@pytest.mark.parametrize("model", ["tiny-random", "smollm2-135m"])
def test_decode_captured_in_cuda_graphs_equals_eager_decode(model: str) -> None:
    eager, _ = _greedy(model, "cuda", "float32", decode_graphs="off")
    captured, engine = _greedy(model, "cuda", "float32")
    graphs = engine.runner.decode_graphs
    assert graphs is not None, "capture failed: see the warning logged by pdserve.engine.model_runner"
    assert graphs.steps_run >= 23  # every step after the prompts' decodes through a graph
    assert captured == eager
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("model", ["tiny-random", "smollm2-135m"])
def test_bfloat16_on_cuda_generates_and_frees_every_block(model: str) -> None:
    tokens, engine = _greedy(model, "cuda", "bfloat16")
    assert [len(t) for t in tokens] == [24] * len(PROMPTS)
    assert all(0 <= t < engine.model_config.vocab_size for seq in tokens for t in seq)
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.slow
def test_llama_1b_random_float32_on_cuda_equals_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1B-class benchmark model, built from its named shape and read through the same loader, decodes
    greedily as transformers does on the same folder (float32, no TF32, so both take the same arithmetic)."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.models import resolve_model

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # for this test only
    tokens, engine = _greedy("llama-1b-random", "cuda", "float32")
    assert engine.blocks.num_used_blocks == 0
    del engine
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model("llama-1b-random")), dtype=torch.float32).cuda()
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False, eos_token_id=None
            )
        assert out[0, len(prompt) :].tolist() == ours
