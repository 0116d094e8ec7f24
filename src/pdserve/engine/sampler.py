"""Turns one step's logits into one token per sequence, honouring each request's sampling settings."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.seeded_noise import exponential_noise, exponential_noise_at
from pdserve.protocol.outputs import TokenLogprobs
from pdserve.protocol.sampling import SamplingParams

# Dividing by a near-zero temperature would overflow logits to inf and softmax to nan.
_MIN_TEMPERATURE = 1e-5
# Penalized logits stay within this, so that temperature and softmax still see finite numbers.
_LARGEST_LOGIT = 1e30

# A top-k or top-p row looks for the tokens it keeps among its likeliest ones, so many at a time: a model's
# distribution is peaked, so a nucleus is nearly always among the first 64 (a top-k of them costs a quarter of a
# top-k of 1,024, which costs a tenth of sorting the vocabulary; docs/experiments/sampling_costs/).
CANDIDATES = (64, 1024)
# A seeded batch whose every row keeps at most this share of the vocabulary (top-k, top-p) races those tokens alone:
# finding them (a top-k) and hashing few ids costs less than hashing every id (measured: sampling_bench.py).
RACE_CANDIDATES_SHARE = 8

# What a row's penalties look at: its prompt's distinct tokens (int64) and its output tokens in order (None for a
# row without penalties). The prompt's part is computed once per request, the output's grows by a token a step.
TokenHistory = tuple[np.ndarray, list[int]] | None

# A seeded row's (seed, position of the token it draws in its sequence); None for a row drawing from the global RNG.
SeedAt = tuple[int, int] | None


class Sampler:
    """Stateless; the engine calls it once per step on the whole batch.

    A seeded row races its tokens with noise from its (seed, position) alone (seeded_noise.py): its token does not
    depend on what shares its batch, or on which engine draws it, unless a batch's ~1e-4 move of the logits
    reorders its two best scores. Unseeded rows draw one uniform from the global RNG against the cumulative sum,
    cheaper on a CPU. Greedy rows draw nothing.
    Logit biases apply first, then penalties (as in vLLM), then temperature, top-k and top-p.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeded: Sequence[SeedAt],
        histories: Sequence[TokenHistory] | None = None,
    ) -> torch.Tensor:
        """logits [N, V] in any float dtype, read only; returns [N] int64 token ids on logits.device.
        `histories` is required when a row has penalties."""
        logits = logits.float()
        penalized_rows = [i for i, p in enumerate(params) if p.penalized]
        if penalized_rows:
            if histories is None:
                raise ValueError("rows with penalties need their token histories")
            logits = self._penalized(logits, penalized_rows, params, histories)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return logits.argmax(dim=-1)
        if len(sampled_rows) == len(params):
            return self._sample(logits, params, seeded)
        tokens = logits.argmax(dim=-1)
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = self._sample(logits[rows], [params[i] for i in sampled_rows], [seeded[i] for i in sampled_rows])
        return tokens

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeded: Sequence[SeedAt],
    ) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params], device=device)
        logits = logits / temperature.unsqueeze(1)  # [n, V], a copy the masking below may write into
        narrowed = [p.top_k > 0 or p.top_p < 1.0 for p in params]
        if any(narrowed):
            logits.masked_fill_(self._outside_top_k_top_p(logits, params), float("-inf"))
        return _draw(logits.softmax(dim=-1), seeded, narrowed)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], counts: list[int]) -> list[TokenLogprobs]:
        """The model's log probabilities (log-softmax of the logits as the model gave them: before penalties
        and temperature, as vLLM returns them by default) of each row's sampled token and of its `count` most
        likely tokens; one top-k for all rows and one copy to the host."""
        index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)
        chosen = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
        k = max(counts)
        top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        top_logprobs_rows, top_ids_rows = top_logprobs.tolist(), top_ids.tolist()
        return [
            TokenLogprobs(chosen[j], tuple(top_ids_rows[j][:n]), tuple(top_logprobs_rows[j][:n]))
            for j, n in enumerate(counts)
        ]

    @staticmethod
    def _penalized(
        logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
    ) -> torch.Tensor:
        """A copy of logits with the logit biases, then the penalties of `rows` applied. Only the logits of
        tokens biased or in a history are read and written (three scatters for all rows), so the cost follows
        the histories, not rows x vocabulary, and the sampler keeps no state between steps."""
        bias: list[tuple[int, np.ndarray, np.ndarray]] = []  # (row, tokens, their biases)
        seen: list[tuple[int, np.ndarray, float]] = []  # (row, tokens, repetition penalty)
        subtract: list[tuple[int, np.ndarray, float]] = []  # (row, tokens, amount), a token once per occurrence
        for i in rows:
            history, p = histories[i], params[i]
            if history is None:
                raise ValueError(f"row {i} has penalties but no token history")
            if p.logit_bias:
                tokens, biases = zip(*p.logit_bias, strict=True)
                bias.append((i, np.asarray(tokens, dtype=np.int64), np.asarray(biases, dtype=np.float32)))
            prompt_tokens, output_list = history
            output = np.asarray(output_list, dtype=np.int64)
            if p.repetition_penalty != 1.0:
                seen.append((i, np.concatenate([prompt_tokens, output]), p.repetition_penalty))
            if p.frequency_penalty != 0.0:
                subtract.append((i, output, p.frequency_penalty))
            if p.presence_penalty != 0.0:
                subtract.append((i, np.unique(output), p.presence_penalty))
        out = logits.clone()
        flat = out.view(-1)  # indexed by row * vocabulary + token: one-dimensional gathers are the cheap ones
        vocab = out.shape[1]
        if bias:
            index, values = _scatter_args(bias, vocab, out.device)
            flat.index_add_(0, index, values)
        if seen:
            index, factor = _scatter_args(seen, vocab, out.device)
            # A token seen twice is written twice with the same value, computed from the logit before either.
            values = flat[index]
            penalized = torch.where(values > 0, values / factor, values * factor)
            # A penalty near 0 divides a logit past float range: an infinite logit would make the softmax NaN. A
            # masked token (-inf before, an output constraint's) stays -inf: clamped, it would tie with an allowed
            # token a huge penalty pushed to -1e30, and a greedy row's argmax could pick it.
            clamped = penalized.clamp(-_LARGEST_LOGIT, _LARGEST_LOGIT)
            flat[index] = torch.where(torch.isneginf(values), values, clamped)
        if subtract:
            index, amount = _scatter_args(subtract, vocab, out.device)
            flat.index_add_(0, index, -amount)
        return out

    @classmethod
    def _outside_top_k_top_p(cls, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """[n, V] mask of tokens to drop: top-k, then top-p over what top-k kept. Rows look among their likeliest
        tokens first (a top-k row among more than k of them); those whose kept tokens reach past them sort the
        vocabulary."""
        vocab = logits.shape[-1]
        pending = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        out = torch.empty_like(logits, dtype=torch.bool)
        found_rows: set[int] = set()
        for candidates in CANDIDATES:
            rows = [i for i in pending if params[i].top_k < candidates]
            if not rows or vocab <= candidates:
                break
            index = torch.tensor(rows, device=logits.device)
            top_k, top_p = _cut_offs([params[i] for i in rows], vocab, logits.device)
            drop, found = _outside_among_candidates(logits[index], top_k, top_p, candidates)
            out[index] = drop  # the rows not found are overwritten below
            found_now = {row for row, ok in zip(rows, found.tolist(), strict=True) if ok}
            found_rows |= found_now
            pending = [row for row in pending if row not in found_now]
        rest = [i for i in range(len(params)) if i not in found_rows]
        if len(rest) == len(params):
            return cls._outside_sorted(logits, params)
        if rest:
            rest_index = torch.tensor(rest, device=logits.device)
            out[rest_index] = cls._outside_sorted(logits[rest_index], [params[i] for i in rest])
        return out

    @staticmethod
    def _outside_sorted(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """`_outside_top_k_top_p` by one stable sort of every row's vocabulary."""
        device = logits.device
        vocab = logits.shape[-1]
        top_k, top_p = _cut_offs(params, vocab, device)
        # Stable so tokens tied at the cut-off are chosen the same way in every batch.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        drop = torch.arange(vocab, device=device).unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # A token stays while the mass ranked above it is still short of top_p, so the top token (with
        # none above it) always stays.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_above >= top_p.unsqueeze(1)
        # Sampling must happen in vocabulary order: a row's draws may not depend on whether its batch sorted.
        return torch.empty_like(drop).scatter_(-1, order, drop)


def _draw(probs: torch.Tensor, seeded: Sequence[SeedAt], narrowed: Sequence[bool]) -> torch.Tensor:
    """Each row's token: a seeded row's by its race, the others' by the inverse CDF. `narrowed`: whether each row's
    top-k or top-p masked some of its tokens."""
    raced = [i for i, at in enumerate(seeded) if at is not None]
    if not raced:
        return _inverse_cdf_draw(probs)
    if len(raced) == len(seeded):
        return _race(probs, seeded, all(narrowed))
    tokens = torch.empty(len(seeded), dtype=torch.int64, device=probs.device)
    raced_index = torch.tensor(raced, device=probs.device)
    drawn_index = torch.tensor([i for i, at in enumerate(seeded) if at is None], device=probs.device)
    tokens[raced_index] = _race(probs[raced_index], [seeded[i] for i in raced], all(narrowed[i] for i in raced))
    tokens[drawn_index] = _inverse_cdf_draw(probs[drawn_index])
    return tokens


def _race(probs: torch.Tensor, seeded: Sequence[SeedAt], narrowed: bool) -> torch.Tensor:
    """Row i's token: the argmax of probability / Exp(1) noise, which is token j with probability probs[i, j]
    (the first of n exponential clocks of rates p to ring is j with probability p_j / sum p). A masked token
    (probability 0) never wins; the noise is at least 2**-32, so no score overflows."""
    keys = [at for at in seeded if at is not None]
    seeds, positions = [seed for seed, _ in keys], [position for _, position in keys]
    vocab = probs.shape[1]
    # Counted only where every row's top-k or top-p masked some tokens: a pass over the logits (and, on a GPU, a
    # wait for it) that a batch with a row keeping the vocabulary would spend for nothing.
    widest = int(probs.count_nonzero(dim=-1).max()) if narrowed else vocab
    if widest * RACE_CANDIDATES_SHARE > vocab:
        return (probs / exponential_noise(seeds, positions, vocab, probs.device)).argmax(dim=-1)
    # Top-k or top-p left every row few candidates: the noise of those alone, which is theirs whatever else is
    # drawn (seeded_noise.py). In id order, so that a tie of scores goes to the lower id as over the vocabulary;
    # a shorter row's padding has probability 0 and never wins.
    ids = probs.topk(widest, dim=-1, sorted=False).indices.sort(dim=-1).values
    scores = probs.gather(-1, ids) / exponential_noise_at(seeds, positions, ids)
    return ids.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)


def _inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds u[i] (from the global RNG when None) of the
    row's total. One uniform draw per row, where the race draws noise for every token of the vocabulary (on a
    CPU, most of a sampled step's cost: docs/experiments/sampling_costs/). Summed in float64, so that a token's
    share of [0, total) is its probability to well below float32's resolution; a masked token (probability 0)
    covers none of it."""
    cdf = probs.double().cumsum_(dim=-1)
    if u is None:
        u = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    target = u * cdf[:, -1]  # below the total, which the last token with any probability reaches: u < 1
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def _cut_offs(params: Sequence[SamplingParams], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the top-k (the vocabulary when none) and the top-p (inf when none: top-p 1 must drop nothing,
    even where rounding lets the cumulative sum reach 1 before the tail)."""
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=device)
    return top_k, top_p


def _outside_among_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (below `candidates`), then top-p, among each row's `candidates` likeliest tokens: the drop mask,
    and per row whether it is the full sort's (up to rounding at the top-p cut-off: the probabilities are summed
    differently). It is when the least likely kept token is strictly likelier than the least likely candidate:
    every token ranked above a kept one is then a candidate, ties among them are put in id order as the stable
    sort puts them, so the ranks are the sort's and the masses above each are sums of the same probabilities."""
    values, ids = logits.topk(candidates, dim=-1)  # its order among ties is unspecified
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    in_top_k = torch.arange(candidates, device=logits.device).unsqueeze(0) < top_k.unsqueeze(1)
    # A top-k row's probabilities are over the tokens it keeps; the others' over the whole vocabulary.
    normalizer = torch.where(
        top_k < logits.shape[-1],
        values.masked_fill(~in_top_k, -math.inf).logsumexp(dim=-1),
        logits.logsumexp(dim=-1),
    )
    probs = (values - normalizer.unsqueeze(1)).exp()
    keep = in_top_k & (probs.cumsum(dim=-1) - probs < top_p.unsqueeze(1))
    least_kept = values.masked_fill(~keep, math.inf).amin(dim=-1)
    found = least_kept > values[:, -1]
    drop = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, ids, ~keep)
    return drop, found


def _scatter_args(
    parts: Sequence[tuple[int, np.ndarray, float | np.ndarray]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, tokens, value or a value per token) parts -> flat indices into [rows, vocab] and the value per
    index, one copy each."""
    index = np.concatenate([row * vocab + tokens for row, tokens, _ in parts])
    values = np.concatenate(
        [np.broadcast_to(v if isinstance(v, np.ndarray) else np.float32(v), len(t)) for _, t, v in parts]
    )
    return torch.from_numpy(index).to(device), torch.from_numpy(values).to(device)
