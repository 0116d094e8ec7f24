"""Decode step time with some of a batch's rows held to a JSON schema against the same batch unconstrained, in the
same run: what constrained decoding costs every stream of a worker. Also the engine thread's own time in the mask
after the forward (guided.StepMask.masked: waiting for the masks computed beside the forward, then adding them)."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from pdserve.config import EngineConfig
from pdserve.engine.device import resolve_device, synchronize
from pdserve.engine.engine import LLMEngine
from pdserve.engine.guided import StepMask
from pdserve.protocol.engine_request import EngineRequest
from pdserve.protocol.output_constraint import OutputConstraint
from pdserve.protocol.sampling import SamplingParams

# A string no step can close: a constrained row stays constrained, and in the batch, for the whole run.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}


class _TimedMasks:
    """The engine's masks as they are, the engine thread's time in each step's `masked` added up."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self._start = engine.guided.start
        engine.guided.start = self.start  # type: ignore[method-assign]

    def start(self, matchers: Sequence[llguidance.LLMatcher | None], device: torch.device) -> StepMask | None:
        mask = self._start(matchers, device)
        if mask is not None:
            masked = mask.masked

            def timed(logits: torch.Tensor) -> torch.Tensor:
                began = time.perf_counter()
                out = masked(logits)
                synchronize(logits.device)
                self.seconds += time.perf_counter() - began
                return out

            mask.masked = timed  # type: ignore[method-assign]
        return mask


def _case(
    engine: LLMEngine, masks: _TimedMasks, batch: int, constrained: int, prompt_len: int, steps: int
) -> tuple[float, float]:
    """Median step and mask seconds of `steps` decode steps of `batch` rows, `constrained` of them held to SCHEMA."""
    device = resolve_device(engine.config)
    schema = OutputConstraint("json_schema", json.dumps(SCHEMA))
    ids = []
    for i in range(batch):
        prompt = torch.randint(3, engine.model_config.vocab_size, (prompt_len,)).tolist()
        sampling = SamplingParams(
            max_tokens=steps + 2, temperature=1.0, ignore_eos=True, constraint=schema if i < constrained else None
        )
        ids.append(f"bench-{uuid.uuid4().hex}")
        engine.add_request(EngineRequest(ids[-1], prompt, sampling))
    for _ in range(batch * prompt_len + 1):  # prompts, up to a step sampling every row (one token a step at least)
        if sum(not o.finished for o in engine.step()) == batch:
            break
    else:
        raise ValueError(f"no step decoded all {batch} rows: too few KV blocks for them (--num-kv-blocks)?")
    step_s, mask_s = [], []
    for _ in range(steps):
        masks.seconds = 0.0
        synchronize(device)
        began = time.perf_counter()
        engine.step()
        synchronize(device)
        step_s.append(time.perf_counter() - began)
        mask_s.append(masks.seconds)
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(step_s), statistics.median(mask_s)


def run_guided_bench(
    config: EngineConfig, batch: int, constrained: Sequence[int], prompt_len: int, steps: int, rounds: int
) -> dict[str, Any]:
    """Measures, prints a table and returns the figures (JSON-serialisable). Each round runs every case, in
    alternating order: a shared machine drifts over minutes."""
    from rich.table import Table

    from pdserve.bench.report_console import report_console

    if any(not 0 < k <= batch for k in constrained):
        raise ValueError(f"constrained rows must be in [1, {batch}], got {list(constrained)}")
    engine = LLMEngine(config)
    masks = _TimedMasks(engine)
    cases = sorted({0, *constrained})
    _case(engine, masks, batch, max(cases), prompt_len, 2)  # warm-up
    samples: dict[int, list[tuple[float, float]]] = {k: [] for k in cases}
    for round_index in range(rounds):
        for k in cases if round_index % 2 == 0 else reversed(cases):
            samples[k].append(_case(engine, masks, batch, k, prompt_len, steps))
    base = [step for step, _ in samples[0]]
    rows = [
        {
            "constrained": k,
            "step_ms": statistics.median(s for s, _ in per_round) * 1e3,
            "vs_unconstrained": statistics.median(s / b for (s, _), b in zip(per_round, base, strict=True)),
            "mask_ms": statistics.median(m for _, m in per_round) * 1e3,
        }
        for k, per_round in samples.items()
    ]
    table = Table(title=f"guided decoding: {batch} decoding rows, {config.model} on {resolve_device(config)}")
    for column in ("constrained rows", "step ms", "vs unconstrained", "mask ms on the engine thread"):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = f"{row['vs_unconstrained']:.3f}×"
        table.add_row(str(row["constrained"]), f"{row['step_ms']:.2f}", ratio, f"{row['mask_ms']:.3f}")
    console = report_console()
    console.print(f"medians of {rounds} rounds of {steps} steps; ratios are medians of per-round ratios")
    console.print(table)
    return {"model": config.model, "batch": batch, "steps": steps, "rounds": rounds, "rows": rows}
