"""Prefill and decode tokens/s of pdserve's engine against Hugging Face transformers, same run.

Both sides get the same model folder, dtype, device, thread count and random prompts. Every prompt
is new to the engine, so its prefix cache never turns a timed prefill into a cache hit.
Decode throughput excludes the prefill: the clock starts once every sequence has its first token.
Each row also gets a GEMM floor: the tokens/s of a step that did nothing but the model's own projections
(same weights, kernels and order), measured in the same run. No engine using these kernels can beat it,
so it says how much of a target the hardware leaves to reach.
"""

from __future__ import annotations

import inspect
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.bench.bandwidth import copy_bandwidth_gbps, decode_bound_tok_s, weight_bytes_per_step
from pdserve.config import EngineConfig
from pdserve.engine.device import resolve_device, resolve_dtype, synchronize
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.protocol.engine_request import EngineRequest

if TYPE_CHECKING:
    from pdserve.engine.model import LlamaModel

PREFILL_REPEATS = 3
GEMM_FLOOR_REPEATS = 5


@dataclass(frozen=True)
class DecodeTiming:
    first_token_s: float  # prefill of the whole batch up to its first tokens
    decode_s: float  # from then to the last token
    decode_tokens: int  # tokens produced in decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


class _Runner(Protocol):
    def prefill_s(self, prompt: list[int]) -> float: ...

    def decode(self, prompts: list[list[int]], num_tokens: int) -> DecodeTiming: ...


class _EngineRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pdserve.engine.engine import LLMEngine

        self.engine = LLMEngine(config)
        self.device = resolve_device(config)

    def prefill_s(self, prompt: list[int]) -> float:
        from pdserve.protocol.sampling import SamplingParams

        synchronize(self.device)
        start = time.perf_counter()
        self.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        synchronize(self.device)
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], num_tokens: int) -> DecodeTiming:
        from pdserve.protocol.sampling import SamplingParams

        engine = self.engine
        params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
        synchronize(self.device)
        start = time.perf_counter()
        for prompt in prompts:
            engine.add_request(EngineRequest(f"bench-{uuid.uuid4().hex}", prompt, params))
        started: set[str] = set()
        first = None
        after_first = 0
        while engine.has_unfinished():
            outputs = engine.step()
            if first is None:
                started.update(o.request_id for o in outputs)
                if len(started) == len(prompts):
                    synchronize(self.device)
                    first = time.perf_counter()
            else:
                after_first += sum(len(o.new_token_ids) for o in outputs)
        synchronize(self.device)
        end = time.perf_counter()
        assert first is not None
        return DecodeTiming(first - start, end - first, after_first)


class _TransformersRunner:
    """A greedy forward loop over transformers' own KV cache: what `generate` does, minus its overhead."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        from pdserve.engine.models import resolve_model

        self.device = resolve_device(config)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(resolve_model(config.model)), dtype=resolve_dtype(config), attn_implementation="sdpa"
        ).to(self.device)  # type: ignore[arg-type]  # transformers types its wrapped `to` as unbound
        self.model.eval()
        # transformers renamed `past_key_values` to `cache` within 5.x; take whichever this version has.
        forward_args = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"

    @torch.inference_mode()
    def prefill_s(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt], device=self.device)
        synchronize(self.device)
        start = time.perf_counter()
        logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
        logits[:, -1].argmax(-1).tolist()
        synchronize(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], num_tokens: int) -> DecodeTiming:
        ids = torch.tensor(prompts, device=self.device)  # equal lengths: no padding, no mask
        synchronize(self.device)
        start = time.perf_counter()
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
        token.tolist()
        synchronize(self.device)
        first = time.perf_counter()
        cache = getattr(out, self.cache_arg)
        for _ in range(num_tokens - 1):
            out = self.model(input_ids=token, use_cache=True, **{self.cache_arg: cache})
            cache = getattr(out, self.cache_arg)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.tolist()  # a server reads each token as it comes; keeps the comparison honest
        synchronize(self.device)
        end = time.perf_counter()
        return DecodeTiming(first - start, end - first, len(prompts) * (num_tokens - 1))


def _gemm_floor_tok_s(model: LlamaModel, tokens: int, logit_rows: int, device: torch.device) -> float:
    """tokens/s of a forward pass of `tokens` rows reduced to its GEMMs (the LM head over `logit_rows`)."""
    projections = model.projections()
    dtype = model.embed_tokens.dtype
    widths = {p.in_features for p in projections}
    inputs = {w: torch.randn(tokens, w, dtype=dtype, device=device) for w in widths}
    head = projections.pop()
    head_input = inputs[head.in_features][:logit_rows]

    def one_pass() -> float:
        synchronize(device)
        start = time.perf_counter()
        for projection in projections:
            projection(inputs[projection.in_features])
        head(head_input)
        synchronize(device)
        return time.perf_counter() - start

    with torch.inference_mode():
        one_pass()  # warm-up
        return tokens / statistics.median(one_pass() for _ in range(GEMM_FLOOR_REPEATS))


class _Prompts:
    """Seeded random token ids; every call gives new ones so no prefix repeats."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, count: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.vocab_size, (count, length), generator=self.gen).tolist()


@dataclass(frozen=True)
class _Case:
    """One row of the table. A prefill row times single prompts; a decode row `batch` sequences at once."""

    name: str
    batch: int
    prompt_len: int
    decode_tokens: int  # 0 for the prefill row

    def prompts(self, source: _Prompts) -> list[list[int]]:
        return source.batch(PREFILL_REPEATS if self.is_prefill else self.batch, self.prompt_len)

    @property
    def is_prefill(self) -> bool:
        return self.decode_tokens == 0

    def tok_s(self, runner: _Runner, prompts: list[list[int]]) -> float:
        if self.is_prefill:
            return self.prompt_len / statistics.median(runner.prefill_s(p) for p in prompts)
        return runner.decode(prompts, self.decode_tokens).tokens_per_s

    def warm_up(self, runner: _Runner, source: _Prompts) -> None:
        if self.is_prefill:
            runner.prefill_s(source.batch(1, self.prompt_len)[0])
        else:
            runner.decode(source.batch(self.batch, self.prompt_len), min(self.decode_tokens, 4))

    def gemm_floor_tok_s(self, model: LlamaModel, device: torch.device) -> float:
        """A prefill samples its last row only; a decode step samples every row."""
        if self.is_prefill:
            return _gemm_floor_tok_s(model, self.prompt_len, 1, device)
        return _gemm_floor_tok_s(model, self.batch, self.batch, device)


def _cases(batch_sizes: list[int], prompt_len: int, decode_prompt_len: int, decode_tokens: int) -> list[_Case]:
    prefill = _Case("prefill", 1, prompt_len, 0)
    return [prefill] + [_Case(f"decode B={b}", b, decode_prompt_len, decode_tokens) for b in batch_sizes]


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Of ratios taken round by round: the two sides of each were measured seconds apart, so drift cancels."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def run_engine_bench(
    config: EngineConfig,
    batch_sizes: list[int],
    prompt_len: int,
    decode_prompt_len: int,
    decode_tokens: int,
    compare_transformers: bool,
    rounds: int = 3,
) -> dict[str, Any]:
    """Measures, prints a rich table and returns the figures (JSON-serialisable).

    Each round times every row on pdserve and on transformers back to back (in alternating order) and the
    GEMM floor after them: a shared machine's speed drifts by tens of percent over minutes, so figures taken
    one engine after the other would compare different machines.
    """
    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be at least 2 (the first token is prefill), got {decode_tokens}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    ours = _EngineRunner(config)
    runners: dict[str, _Runner] = {"pdserve": ours}
    if compare_transformers:
        runners["transformers"] = _TransformersRunner(config)
    cases = _cases(batch_sizes, prompt_len, decode_prompt_len, decode_tokens)
    samples, copy_gbps = _timed_rounds(ours, runners, cases, rounds)
    e = ours.engine
    result: dict[str, Any] = {
        "model": config.model,
        "dtype": str(resolve_dtype(config)).removeprefix("torch."),
        "device": str(ours.device),
        "threads": torch.get_num_threads(),
        "decode_steps": e.runner.decode_graphs.describe() if e.runner.decode_graphs else "eager",
        "prompt_len": prompt_len,
        "decode_prompt_len": decode_prompt_len,
        "decode_tokens": decode_tokens,
        "rounds": rounds,
        "copy_gbps": statistics.median(copy_gbps),
        "weight_bytes_per_step": weight_bytes_per_step(e.model),
        "rows": [_row(name, per_round, compare_transformers) for name, per_round in samples.items()],
    }
    _print_report(result, compare_transformers)
    return result


def _timed_rounds(
    ours: _EngineRunner, runners: dict[str, _Runner], cases: list[_Case], rounds: int
) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """Per case, per runner (and "floor", "bound"), its tokens/s in each round; and each round's copy GB/s."""
    prompts = _Prompts(ours.engine.model_config.vocab_size)
    for runner in runners.values():
        for case in cases:
            case.warm_up(runner, prompts)
    samples: dict[str, dict[str, list[float]]] = {
        case.name: {label: [] for label in [*runners, "floor", "bound"]} for case in cases
    }
    e = ours.engine
    weights = weight_bytes_per_step(e.model)
    kv_per_token = kv_block_bytes(e.model_config, e.config.block_size, e.runner.dtype) // e.config.block_size
    copy_gbps: list[float] = []
    for round_index in range(rounds):
        copy_gbps.append(copy_bandwidth_gbps(ours.device))
        order = list(runners.items())
        if round_index % 2:
            order.reverse()
        for case in cases:
            batch = case.prompts(prompts)  # both engines get the same prompts
            for label, runner in order:
                samples[case.name][label].append(case.tok_s(runner, batch))
            samples[case.name]["floor"].append(case.gemm_floor_tok_s(e.model, ours.device))
            if not case.is_prefill:  # a prefill is bound by its GEMMs, not by reading the weights
                context = case.prompt_len + (case.decode_tokens - 1) / 2  # on average over the decode
                bound = decode_bound_tok_s(weights, kv_per_token, case.batch, context, copy_gbps[-1])
                samples[case.name]["bound"].append(bound)
    return samples, copy_gbps


def _row(name: str, per_round: dict[str, list[float]], compare_transformers: bool) -> dict[str, Any]:
    """One case's medians, and its ratios as medians of the rounds' ratios."""
    mine, floor = per_round["pdserve"], per_round["floor"]
    row: dict[str, Any] = {
        "name": name,
        "pdserve_tok_s": statistics.median(mine),
        "gemm_floor_tok_s": statistics.median(floor),
        "pdserve_share_of_floor": _median_ratio(mine, floor),
        "per_round": per_round,
    }
    if bounds := per_round["bound"]:
        row["bandwidth_bound_tok_s"] = statistics.median(bounds)
        row["pdserve_share_of_bound"] = _median_ratio(mine, bounds)
    if compare_transformers:
        theirs = per_round["transformers"]
        row["transformers_tok_s"] = statistics.median(theirs)
        row["ratio"] = _median_ratio(mine, theirs)
        row["floor_ratio"] = _median_ratio(floor, theirs)
    return row


def _print_report(result: dict[str, Any], compare_transformers: bool) -> None:
    from rich.table import Table

    from pdserve.bench.report_console import report_console

    console = report_console()
    console.print(
        f"model {result['model']}, dtype {result['dtype']}, device {result['device']}, {result['threads']} threads"
    )
    console.print(
        f"prefill: {result['prompt_len']} tokens; decode: {result['decode_tokens']} tokens after "
        f"{result['decode_prompt_len']}-token prompts; decode steps {result['decode_steps']}"
    )
    console.print(
        f"medians of {result['rounds']} rounds, the engines back to back in each; ratios are medians of per-round "
        "ratios"
    )
    console.print("GEMM floor: the step reduced to the model's projections; no engine using these kernels is faster")
    console.print(
        f"bandwidth bound: a decode step reading only its {result['weight_bytes_per_step'] / 1e6:.0f} MB of weights "
        f"and its KV once, at the {result['copy_gbps']:.1f} GB/s a copy measured here"
    )
    table = Table(title="pdserve engine bench")
    table.add_column("")
    table.add_column("pdserve tok/s", justify="right")
    if compare_transformers:
        table.add_column("transformers tok/s", justify="right")
        table.add_column("ratio", justify="right")
    table.add_column("GEMM floor tok/s", justify="right")
    table.add_column("pdserve / floor", justify="right")
    if compare_transformers:
        table.add_column("floor / transformers", justify="right")
    table.add_column("bandwidth bound tok/s", justify="right")
    table.add_column("pdserve / bound", justify="right")
    for row in result["rows"]:
        cells = [row["name"], f"{row['pdserve_tok_s']:.1f}"]
        if compare_transformers:
            cells += [f"{row['transformers_tok_s']:.1f}", f"{row['ratio']:.2f}×"]
        cells += [f"{row['gemm_floor_tok_s']:.1f}", f"{row['pdserve_share_of_floor']:.0%}"]
        if compare_transformers:
            cells.append(f"{row['floor_ratio']:.2f}×")
        if "bandwidth_bound_tok_s" in row:
            cells += [f"{row['bandwidth_bound_tok_s']:.1f}", f"{row['pdserve_share_of_bound']:.0%}"]
        else:
            cells += ["-", "-"]
        table.add_row(*cells)
    console.print(table)
