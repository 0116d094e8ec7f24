"""Greedy float32 output of smollm2-135m must equal transformers' on the same GGUF, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.models import SMOLLM2_GGUF, resolve_model
from pdserve.protocol.sampling import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in one sentence.",
    "List three prime numbers.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans",
    "Paged attention stores the key-value cache in",
]


class OpenAIPenalties:
    """transformers has no presence or frequency penalty: this logits processor is OpenAI's definition, applied
    after transformers' repetition penalty (vLLM's order)."""

    def __init__(self, prompt_len: int, penalties: SamplingParams) -> None:
        self.prompt_len, self.penalties = prompt_len, penalties

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        p = self.penalties
        return scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


@pytest.fixture(scope="module")
def hf_model():
    """transformers reading the original GGUF itself (not our conversion)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=Path(SMOLLM2_GGUF).name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy outputs."""
    from transformers import LogitsProcessorList

    def generate(prompt: list[int], penalties: SamplingParams | None = None) -> list[int]:
        """Greedy; `penalties`: repetition as transformers' own, presence and frequency through OpenAIPenalties."""
        extra = {}
        if penalties is not None:
            extra["repetition_penalty"] = penalties.repetition_penalty
            extra["logits_processor"] = LogitsProcessorList([OpenAIPenalties(len(prompt), penalties)])
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **extra,
            )
        return out[0, len(prompt) :].tolist()

    return generate


@pytest.fixture(scope="module")
def prompts(engine_factory):
    tok = engine_factory().tokenizer
    long_text = " ".join(f"Item {i}: the value of {i} squared is {i * i}." for i in range(90))
    out = [tok.apply_chat_template([("user", c)]) for c in CHATS] + [tok.encode(r) for r in RAW]
    out.append(tok.apply_chat_template([("user", long_text + " What is item 7 squared?")]))
    assert len(out[-1]) > 1000
    return out


@pytest.fixture(scope="module")
def engine_factory():
    engines: dict[tuple, LLMEngine] = {}

    def make(num_kv_blocks: int | None = None, chunk: int = 512) -> LLMEngine:
        key = (num_kv_blocks, chunk)
        if key not in engines:
            sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, long_prefill_chunk=chunk)
            config = EngineConfig(model="smollm2-135m", dtype="float32", num_kv_blocks=num_kv_blocks, scheduler=sched)
            engines[key] = LLMEngine(config)
        return engines[key]

    return make


@pytest.fixture(scope="module")
def expected(prompts, reference):
    return [reference(p) for p in prompts]


def test_one_batch_matches_transformers(engine_factory, prompts, expected):
    engine = engine_factory()
    got = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, (c, want) in enumerate(zip(got, expected, strict=True)):
        assert c.token_ids == want, f"prompt {i} diverges"
    assert engine.blocks.num_used_blocks == 0


def test_matches_under_preemption_and_chunked_prefill(engine_factory, prompts, expected):
    # 120 blocks of 16 tokens hold 1,920 tokens: far less than the batch needs at once. The long prompt goes first
    # and takes 106 of them for its chunks; the short ones fit beside it, and their growth preempts.
    engine = engine_factory(num_kv_blocks=120, chunk=128)
    order = [len(prompts) - 1, *range(len(prompts) - 1)]
    got = engine.generate([prompts[i] for i in order], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for i, (c, want) in enumerate(zip(got, [expected[i] for i in order], strict=True)):
        assert c.token_ids == want, f"prompt {i} diverges"
    assert engine.blocks.num_used_blocks == 0


def test_the_gguf_file_itself_loads_the_same_model(engine_factory, prompts):
    """--model path/to/file.gguf: config from its header, weights dequantized, tokenizer from its folder."""
    gguf = resolve_model("smollm2-135m") / Path(SMOLLM2_GGUF).name
    from_gguf = LLMEngine(EngineConfig(model=str(gguf), dtype="float32", num_kv_blocks=128))
    from_folder = engine_factory()
    assert from_gguf.model_config == from_folder.model_config
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    ours = [c.token_ids for c in from_gguf.generate(prompts[:2], sampling)]
    assert ours == [c.token_ids for c in from_folder.generate(prompts[:2], sampling)]


PENALTIES = [
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.9),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=-0.5, repetition_penalty=0.9),
]


def test_penalties_match_transformers_in_a_batch_with_unpenalized_rows(engine_factory, prompts, expected, reference):
    """Each raw prompt once per penalty setting, batched with the plain chats; the penalized rows must change."""
    chosen = prompts[len(CHATS) : len(CHATS) + len(RAW)]
    penalized = [(p, s) for p in chosen for s in PENALTIES]
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [p for p, _ in penalized] + prompts[: len(CHATS)]
    got = engine_factory().generate(batch, [s for _, s in penalized] + [plain] * len(CHATS))
    for i, ((prompt, sampling), c) in enumerate(zip(penalized, got, strict=False)):
        assert c.token_ids == reference(prompt, sampling), f"penalized row {i} diverges"
    assert [c.token_ids for c in got[len(penalized) :]] == expected[: len(CHATS)]
    unpenalized = expected[len(CHATS) : len(CHATS) + len(RAW)]
    changed = sum(c.token_ids != unpenalized[i // len(PENALTIES)] for i, c in enumerate(got[: len(penalized)]))
    assert changed >= len(penalized) - 2, f"penalties changed only {changed} of {len(penalized)} outputs"


def test_logprobs_are_transformers_log_softmax(engine_factory, prompts, expected, hf_model):
    """The greedy tokens' log probabilities and the five most likely at each position, batched with rows that
    ask for none, against transformers' logits over prompt + output in one forward pass."""
    asking = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got = engine_factory().generate(prompts[:4], [asking, plain, asking, plain])
    for i in (0, 2):
        assert got[i].token_ids == expected[i]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompts[i] + expected[i]])).logits[0, len(prompts[i]) - 1 : -1]
        want = torch.log_softmax(logits.float(), dim=-1)
        top = want.topk(5)
        for position, lp in enumerate(got[i].logprobs):
            assert lp.logprob == pytest.approx(want[position, expected[i][position]].item(), abs=1e-3)
            assert list(lp.top_token_ids) == top.indices[position].tolist(), f"prompt {i} position {position}"
            assert list(lp.top_logprobs) == pytest.approx(top.values[position].tolist(), abs=1e-3)
    assert got[1].logprobs == got[3].logprobs == []
