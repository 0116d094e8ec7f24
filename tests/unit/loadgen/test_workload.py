"""Datasets: lengths, valid token ids, shared prefixes, trace replay."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.benchmark import offered_rate
from loadgen.workload import FIRST_TOKEN_ID, TRACE_BLOCK_TOKENS, WorkloadConfig, build_workload
from pdserve.trace import read_trace


def build(**kw):
    return build_workload(WorkloadConfig(**kw), np.random.default_rng(0))


def test_random_lengths_within_the_range_ratio_and_ids_valid():
    reqs = build(num_prompts=500, vocab_size=259, random_input_len=100, random_output_len=20, random_range_ratio=0.5)
    inputs = np.array([r.input_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    assert len(reqs) == 500
    assert inputs.min() >= 50 and inputs.max() <= 150 and 90 < inputs.mean() < 110
    assert outputs.min() >= 10 and outputs.max() <= 30
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() >= FIRST_TOKEN_ID and ids.max() < 259
    assert all(r.arrival_s == 0.0 for r in reqs)


def test_random_without_range_is_exact():
    reqs = build(num_prompts=20, random_input_len=64, random_output_len=7)
    assert {(r.input_len, r.output_len) for r in reqs} == {(64, 7)}


def test_same_generator_same_workload():
    assert build(num_prompts=5, random_input_len=8) == build(num_prompts=5, random_input_len=8)


def test_sharegpt_synthetic_matches_the_published_means_with_a_heavy_tail():
    reqs = build(dataset_name="sharegpt-synthetic", num_prompts=20_000)
    inputs = np.array([r.input_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    assert inputs.mean() == pytest.approx(161, rel=0.05)
    assert outputs.mean() == pytest.approx(338, rel=0.05)
    assert np.median(inputs) < 0.7 * inputs.mean()  # heavy right tail
    assert inputs.min() >= 4 and outputs.min() >= 4 and inputs.max() <= 1024 and (inputs + outputs).max() <= 2048


def test_prefix_repetition_shares_prefixes_evenly():
    reqs = build(
        dataset_name="prefix-repetition", num_prompts=12, prefix_len=32, suffix_len=8, num_prefixes=3,
        prefix_output_len=5,
    )  # fmt: skip
    prefixes = [tuple(r.prompt_token_ids[:32]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 12
    assert {(r.input_len, r.output_len) for r in reqs} == {(40, 5)}


def test_trace_replays_timestamps_lengths_and_shared_blocks(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 1250, "input_length": 700, "output_length": 4, "hash_ids": [1, 3]},
        {"timestamp": 3000, "input_length": 20, "output_length": 5},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    reqs = build(dataset_name="trace", trace=trace, num_prompts=10)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 2.0]
    assert [(r.input_len, r.output_len) for r in reqs] == [(600, 3), (700, 4), (20, 5)]
    assert reqs[0].prompt_token_ids[:TRACE_BLOCK_TOKENS] == reqs[1].prompt_token_ids[:TRACE_BLOCK_TOKENS]
    assert reqs[0].prompt_token_ids[TRACE_BLOCK_TOKENS:] != reqs[1].prompt_token_ids[TRACE_BLOCK_TOKENS:600]
    assert len(build(dataset_name="trace", trace=trace, num_prompts=2)) == 2


def test_a_trace_out_of_timestamp_order_is_replayed_in_order(tmp_path):
    """As `pdserve plan --trace` simulates it: the earliest stamped lines first, and the first N of those."""
    stamps = [0, 1000, 200, 600]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 5, "output_length": t // 100 + 1}) + "\n" for t in stamps)
    )
    reqs = build(dataset_name="trace", trace=trace, num_prompts=3)
    assert [(r.arrival_s, r.output_len) for r in reqs] == [(0.0, 1), (0.2, 3), (0.6, 7)]


@pytest.mark.parametrize(("stamps", "rate"), [([0, 1000], 1.0), ([500, 1000, 2500, 3000], 1.2), ([7, 7], math.inf)])
def test_a_trace_offers_its_gaps_per_second_as_the_planner_reads_it(tmp_path, stamps, rate):
    """Its first request goes at 0: n / last would count a gap before it (two lines 1 s apart at 2 req/s)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 5, "output_length": 2}) + "\n" for t in stamps)
    )
    assert offered_rate(build(dataset_name="trace", trace=trace)) == pytest.approx(rate)


@pytest.mark.parametrize(
    "kw",
    [{"dataset_name": "nope"}, {"random_range_ratio": 1.0}, {"dataset_name": "trace"}, {"vocab_size": 3}],
)
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError):
        WorkloadConfig(**kw)


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ({"timestamp": 0, "input_length": 5}, "no output_length"),
        ({"timestamp": 0, "input_length": 5, "output_length": 0}, "max_tokens 0 reads as the server's default"),
        ({"timestamp": "soon", "input_length": 5, "output_length": 2}, "a timestamp that is no number"),
        ({"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": ["a"]}, "a hash id that is no int"),
        ({"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [-1]}, "a hash id below 0"),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_trace_line_is_refused_naming_the_line(tmp_path, line, what):
    good = {"timestamp": 0, "input_length": 5, "output_length": 2}
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(good) + "\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_trace(trace)
