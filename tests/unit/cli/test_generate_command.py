"""`pdserve generate`: the single-process engine from the command line, one JSON object per prompt with --json."""

from __future__ import annotations

import json

import pytest

from pdserve import cli
from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams

FLAGS = ["--model", "tiny-random", "--dtype", "float32", "--max-tokens", "4", "--ignore-eos"]


def test_json_lines_in_prompt_order_with_penalties_and_logprobs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", *FLAGS, "--prompt", "abc", "--prompt", "hello", "--json"]
    assert cli.main([*argv, "--frequency-penalty", "1.5", "--repetition-penalty", "1.2", "--logprobs", "2"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["abc", "hello"]

    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_kv_blocks=64))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.2, logprobs=2)
    want = engine.generate([engine.tokenizer.encode(p) for p in ("abc", "hello")], sampling)
    for record, c in zip(records, want, strict=True):
        assert (record["token_ids"], record["text"], record["finish_reason"]) == (c.token_ids, c.text, "length")
        assert [lp["top_token_ids"] for lp in record["logprobs"]] == [list(lp.top_token_ids) for lp in c.logprobs]
        assert [lp["logprob"] for lp in record["logprobs"]] == pytest.approx([lp.logprob for lp in c.logprobs])


def test_an_invalid_setting_is_named_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", *FLAGS, "--prompt", "x", "--presence-penalty", "3"]) == 2
    assert "invalid sampling.presence_penalty: must be in [-2, 2], got 3.0" in capsys.readouterr().err
