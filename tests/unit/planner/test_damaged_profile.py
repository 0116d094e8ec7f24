"""A hand-edited or damaged profile file is refused by `pdserve plan`, exit status 2, naming what is wrong: never a
traceback, a hang, or a plan that reads a broken cost as an SLO no split meets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve import cli
from tests.unit.planner.synthetic import synthetic_profile


def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """`base` with `change`'s keys; a dict in both is merged one level down (a term of `perf`, a `meta` key)."""
    both = {k: {**base[k], **v} for k, v in change.items() if isinstance(v, dict) and isinstance(base.get(k), dict)}
    return base | change | both


@pytest.mark.timeout(30)  # a 0-token chunk never ended a prompt: the plan ran forever
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"perf": None}, "perf must be a JSON object"),  # these three were an AttributeError traceback
        ({"perf": "fast"}, "perf must be a JSON object"),
        ({"meta": []}, "meta must be a JSON object"),
        ({"points": "none"}, "points must be a JSON object"),
        ({"perf": {"prefill_fixed_s": math.nan}}, "perf.prefill_fixed_s must be a finite number >= 0"),  # planned 0
        ({"perf": {"decode_fixed_s": -0.01}}, "perf.decode_fixed_s must be a finite number >= 0"),
        ({"step_overhead_s": -0.001}, "step_overhead_s must be a finite number >= 0"),
        ({"long_prefill_chunk": 0}, "long_prefill_chunk must be at least 1"),  # the hang
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1"),
        ({"perf": {"prefill_per_token_s": 0.0}}, "a prompt's tokens must cost time"),  # a ZeroDivisionError
        ({"meta": {"context_tokens": "4096"}}, "meta.context_tokens must be a whole number >= 1"),  # unchecked
    ],
)
def test_a_damaged_profile_is_a_usage_error_naming_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any], named: str
) -> None:
    path = tmp_path / "profile.json"
    synthetic_profile(meta={"model": "tiny-random", "context_tokens": 4096}).save(path)
    path.write_text(json.dumps(merged(json.loads(path.read_text()), change)))
    argv = ["plan", "--profile", str(path), "--rate", "1", "--input-len", "600", "--output-len", "8"]
    assert cli.main([*argv, "--workers", "2", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve plan: {path} is not a pdserve profile: ") and named in err, err


@pytest.mark.parametrize(("text", "named"), [("[1, 2]", "got list"), ("null", "got NoneType"), ("7", "got int")])
def test_a_profile_that_is_no_json_object_is_a_usage_error_saying_so(tmp_path: Path, capsys, text, named) -> None:
    """A list was 'cannot convert dictionary update sequence element #0 to a sequence', null "'NoneType' object is
    not iterable": Python's words, not what is wrong with the file."""
    path = tmp_path / "profile.json"
    path.write_text(text)
    argv = ["plan", "--profile", str(path), "--rate", "1", "--input-len", "60", "--output-len", "8"]
    assert cli.main([*argv, "--workers", "2", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"pdserve plan: {path} is not a pdserve profile: it must be a JSON object, {named}"
