"""The engine's logprobs and prompt logprobs against transformers' forward pass: batched, chunked, preempted."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models import resolve_model
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.sampling import SamplingParams
from tests.unit.engine.engine_harness import GREEDY, assert_idle, make_engine, prompts, run_to_end

pytestmark = pytest.mark.timeout(60)


def test_logprobs_are_the_models_log_softmax_for_the_rows_that_ask() -> None:
    """Checked against transformers' forward pass over each prompt + output: the sampled token's log
    probability and the k most likely, before temperature or penalties."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny-random")), dtype=torch.float32)
    batch = prompts(3, seed=7)
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=6, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0, temperature=1.5, seed=1, frequency_penalty=1.0),
    ]
    got = make_engine().generate(batch, params)
    assert got[1].logprobs == []
    for prompt, p, c in ((batch[0], params[0], got[0]), (batch[2], params[2], got[2])):
        assert len(c.logprobs) == len(c.token_ids) == 6
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + c.token_ids])).logits[0]  # [tokens, vocab]
        want = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        for position, (token, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(want[position, token].item(), abs=1e-4)
            top = want[position].topk(p.logprobs or 1)
            assert list(lp.top_token_ids) == top.indices.tolist()[: p.logprobs]
            assert list(lp.top_logprobs) == pytest.approx(top.values.tolist()[: p.logprobs], abs=1e-4)


@pytest.mark.parametrize(("chunk", "blocks"), [(512, 256), (7, 256), (7, 6)], ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_are_the_models_for_each_prompt_token_after_the_first(chunk: int, blocks: int) -> None:
    """Against transformers' forward pass over the prompt; prompts longer than a chunk, a prefix another
    request just cached (which must not stand in for computed positions), a pool too small for the batch
    (a preempted prompt runs again: its positions are not recorded twice), and a row that asks for none."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny-random")), dtype=torch.float32)
    engine = make_engine(num_kv_blocks=blocks, long_prefill_chunk=chunk)
    shared = prompts(1, lo=40, hi=40, seed=9)[0]
    engine.generate([shared], GREEDY)  # caches its blocks: the next prompt starts with them
    batch = [shared + [7, 8, 9], prompts(1, seed=10)[0], prompts(1, lo=20, hi=20, seed=11)[0]]
    params = [
        SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=0, logprobs=1),
    ]
    got = engine.generate(batch, params)
    assert got[1].logprobs == got[1].prompt_logprobs == []
    for prompt, p, c in ((batch[0], params[0], got[0]), (batch[2], params[2], got[2])):
        found = c.prompt_logprobs
        assert len(found) == len(prompt) - 1
        with torch.inference_mode():
            want = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1], dim=-1)
        for position, lp in enumerate(found, start=1):
            assert lp.logprob == pytest.approx(want[position - 1, prompt[position]].item(), abs=1e-4)
            top = want[position - 1].topk(max(p.prompt_logprobs or 0, 1))
            assert list(lp.top_token_ids) == top.indices.tolist()[: p.prompt_logprobs]
    assert (engine.scheduler.num_preemptions > 0) == (blocks < 10)
    assert_idle(engine)


def test_a_prompt_preempted_halfway_through_its_prefill_records_each_position_once() -> None:
    """Preempted after two of its seven chunks, the prompt runs again from its start: the positions already
    recorded are skipped, so the first output carries each prompt position's log probability once."""
    sampling = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    prompt = prompts(1, lo=45, hi=45, seed=12)[0]
    unbroken = make_engine(long_prefill_chunk=7).generate([prompt], sampling)[0]
    engine = make_engine(long_prefill_chunk=7)
    engine.add_request(EngineRequest("halfway", prompt, sampling))
    assert engine.step() == [] and engine.step() == []  # two chunks of seven, no token yet
    (seq,) = engine.scheduler.running
    engine.scheduler._preempt(seq)
    outs = run_to_end(engine)["halfway"]
    assert seq.num_preemptions == 1
    assert outs[0].prompt_logprobs == tuple(unbroken.prompt_logprobs) and len(unbroken.prompt_logprobs) == 44
    assert_idle(engine)
