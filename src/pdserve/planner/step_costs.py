"""What an engine step costs in the profile's terms: a prompt chunk's share, a decode batch's share, and from them a
prompt's whole prefill and a decoded token at a given batch (the simulator's steps, and the rate bound plan.py
draws from them)."""

from __future__ import annotations

from pdserve.planner.hardware import HardwareProfile


def chunk_s(p: HardwareProfile, n: int, prefilled: int, last: bool) -> float:
    """A prompt chunk's share of a step: its tokens, its reads of the earlier chunks, its hand-off when last."""
    seconds = p.perf.prefill_per_token_s * n + p.perf.prefill_per_token2_s * n * n
    seconds += p.prefill_per_context_token_s * n * prefilled
    return seconds + (p.prefill_loop_s if last else 0.0)


def decoded_s(p: HardwareProfile, decoded: int, context: int | float) -> float:
    """A decode step's share for `decoded` sequences reading `context` tokens of KV between them."""
    return (p.perf.decode_per_seq_s + p.decode_loop_per_token_s) * decoded + p.decode_per_context_token_s * context


def prefill_work_s(p: HardwareProfile, input_len: int, packed: bool = False) -> float:
    """A prompt's engine seconds, chunk after chunk as a worker alone runs it. `packed`: at full load, where each
    step holds as many chunks of this size as its token budget and `max_num_seqs` allow, and they share the step's
    fixed cost (a colocated worker's engine and the simulator pack prompts so; a prefill worker runs one a step)."""
    seconds, done = 0.0, 0
    while done < input_len:
        n = min(input_len - done, p.long_prefill_chunk, p.max_num_batched_tokens)
        sharing = max(1, min(p.max_num_seqs, p.max_num_batched_tokens // n)) if packed else 1
        seconds += (p.step_overhead_s + p.perf.prefill_fixed_s) / sharing
        seconds += chunk_s(p, n, done, last=done + n == input_len)
        done += n
    return seconds


def decode_token_s(p: HardwareProfile, batch: int, context: float) -> float:
    """Engine seconds per token of a decode step of `batch` sequences, each reading `context` tokens of KV."""
    step = p.step_overhead_s + p.perf.decode_fixed_s + decoded_s(p, batch, batch * context)
    return step / batch
