from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pdserve.engine import sampler as sampler_module
from pdserve.engine.sampler import Sampler, _inverse_cdf_draw, _outside_among_candidates
from pdserve.engine.seeded_noise import exponential_noise_at
from pdserve.protocol.sampling import SamplingParams

CPU = torch.device("cpu")
# The CUDA case is marked, so scripts/gpu_check.sh runs it with the other CUDA tests (`-m cuda`).
CUDA = pytest.param(torch.device("cuda"), marks=pytest.mark.cuda)
DEVICES = [CPU] + ([CUDA] if torch.cuda.is_available() else [])


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row, as one batch of n copies on the global RNG."""
    torch.manual_seed(seed)
    return Sampler()(logits.expand(n, -1), [params] * n, [None] * n)


def _seeded_run(
    row: torch.Tensor, seed: int, steps: int, others: list[tuple[torch.Tensor, int | None]], position: int
) -> list[int]:
    """Sample `row` seeded for several steps (positions 100, 101, ...), batched with `others` (row, seed or None)."""
    params = SamplingParams(temperature=1.0)
    tokens = []
    for step in range(steps):
        rows = [r for r, _ in others]
        seeded: list[tuple[int, int] | None] = [None if s is None else (s, 100 + step) for _, s in others]
        rows.insert(position, row)
        seeded.insert(position, (seed, 100 + step))
        out = Sampler()(torch.stack(rows), [params] * len(rows), seeded)
        tokens.append(int(out[position]))
    return tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(device: torch.device, dtype: torch.dtype) -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    out = Sampler()(logits, [SamplingParams()] * 8, [None] * 8)
    assert out.dtype == torch.int64
    assert out.device == logits.device
    assert torch.equal(out, logits.float().argmax(dim=-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = Sampler()(logits, params, [None] * 6)
    assert torch.equal(out[0::2], logits[0::2].argmax(dim=-1))
    assert out.shape == (6,)


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch(device: torch.device) -> None:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(64, generator=g).to(device)
    others = [(torch.randn(64, generator=g).to(device), s) for s in (7, None, 11)]
    alone = _seeded_run(row, seed=42, steps=20, others=[], position=0)
    torch.manual_seed(123)  # the global RNG state must not matter to a seeded row
    batched = _seeded_run(row, seed=42, steps=20, others=others, position=2)
    reordered = _seeded_run(row, seed=42, steps=20, others=others[::-1], position=0)
    assert alone == batched == reordered
    assert len(set(alone)) > 1  # the draws really vary from step to step


def test_same_seed_with_top_k_top_p_neighbours() -> None:
    """A plain seeded row must not change when another row in the batch forces the top-k/top-p path."""
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    plain = SamplingParams(temperature=1.0)
    filtered = SamplingParams(temperature=1.0, top_k=3, top_p=0.5)
    for position in range(20):
        alone = Sampler()(logits[:1], [plain], [(5, position)])
        together = Sampler()(logits, [plain, filtered], [(5, position), None])
        assert alone[0] == together[0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_that_keeps_few_tokens_draws_what_the_race_over_the_vocabulary_draws(
    device: torch.device, monkeypatch
) -> None:
    """A batch whose rows keep few tokens (top-k, top-p) races those alone; each row's token is the one the race
    over the whole vocabulary gives, which it takes where a neighbour keeps the whole vocabulary."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(5)).to(device) * 2
    params = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, top_p=0.5)]
    plain = SamplingParams(temperature=1.0)
    raced_over_candidates = []
    monkeypatch.setattr(sampler_module, "exponential_noise_at", spy(raced_over_candidates, exponential_noise_at))
    drawn = []
    for position in range(100):
        seeded = [(9, position), (10, position), (11, position)]
        few = Sampler()(logits[:2], params, seeded[:2])
        assert len(raced_over_candidates) == position + 1  # the few candidates' race
        with_plain = Sampler()(logits, [*params, plain], seeded)
        assert len(raced_over_candidates) == position + 1  # the vocabulary's
        assert few.tolist() == with_plain[:2].tolist(), position
        drawn.append(few.tolist())
    assert all(len({d[row] for d in drawn}) > 5 for row in range(2))  # the draws really vary


def test_a_tie_of_scores_goes_to_the_lower_id_over_candidates_as_over_the_vocabulary(monkeypatch) -> None:
    """Tokens of equal probability (bf16 logits tie often) whose noise ties too: the lowest id wins either way."""
    monkeypatch.setattr(sampler_module, "exponential_noise", lambda seeds, _, n, device: torch.ones(len(seeds), n))
    monkeypatch.setattr(sampler_module, "exponential_noise_at", lambda seeds, _, ids: torch.ones(ids.shape))
    logits = torch.full((2, 4096), -math.inf)
    logits[0, [3000, 17, 2000, 999]] = 0.0
    logits[1] = 0.0
    tied, plain = SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=1.0)
    assert Sampler()(logits[:1], [tied], [(1, 0)]).tolist() == [17]  # over its four candidates
    assert Sampler()(logits, [tied, plain], [(1, 0), (2, 0)]).tolist() == [17, 0]  # over the vocabulary


def test_a_seeded_batch_with_a_row_keeping_the_vocabulary_counts_no_candidates(monkeypatch) -> None:
    """Counting the rows' candidates is a pass over the logits (on a GPU, a wait for it): a batch with a row that
    keeps the whole vocabulary races over it anyway, so it does not count."""
    counted: list = []
    monkeypatch.setattr(torch.Tensor, "count_nonzero", spy(counted, torch.Tensor.count_nonzero))
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(6))
    top_k, plain = SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0)
    Sampler()(logits, [top_k, plain], [(1, 0), (2, 0)])
    assert not counted
    Sampler()(logits, [top_k, top_k], [(1, 0), (2, 0)])
    assert counted


def spy(calls: list, f):
    def called(*args, **kwargs):
        calls.append(args)
        return f(*args, **kwargs)

    return called


def test_different_seeds_differ() -> None:
    row = torch.zeros(64)  # uniform, so two seeds agreeing on 20 draws is practically impossible
    assert _seeded_run(row, seed=1, steps=20, others=[], position=0) != _seeded_run(
        row, seed=2, steps=20, others=[], position=0
    )


def test_top_k_1_is_greedy() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=2.0, top_k=1)] * 32
    assert torch.equal(Sampler()(logits, params, [None] * 32), logits.argmax(dim=-1))


def test_top_k_restricts_support_to_the_k_most_likely() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(7))
    samples = _draws(logits, SamplingParams(temperature=5.0, top_k=5), n=4000)
    assert set(samples.tolist()) == set(logits.topk(5).indices.tolist())


def _shuffled_logits(probs: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for `probs` at shuffled vocabulary positions (so support is not just the first ids)."""
    perm = torch.randperm(len(probs), generator=torch.Generator().manual_seed(seed))
    logits = torch.empty(len(probs))
    logits[perm] = torch.tensor(probs).log()
    return logits, perm


@pytest.mark.parametrize(("top_p", "nucleus_size"), [(0.01, 1), (0.75, 2), (0.85, 3), (1.0, 4)])
def test_top_p_restricts_support_to_the_nucleus(top_p: float, nucleus_size: int) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits, perm = _shuffled_logits(probs, seed=8)
    samples = _draws(logits, SamplingParams(temperature=1.0, top_p=top_p), n=4000)
    assert set(samples.tolist()) == set(perm[:nucleus_size].tolist())
    # Inside the nucleus the original proportions hold.
    counts = torch.bincount(samples, minlength=len(probs))[perm[:nucleus_size]].float()
    expected = torch.tensor(probs[:nucleus_size]) / sum(probs[:nucleus_size])
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_top_p_applies_to_what_top_k_kept() -> None:
    # After top-k=2 the renormalised masses are 0.625 and 0.375, so top_p=0.6 keeps only the first.
    probs = [0.5, 0.3, 0.15, 0.05]
    logits, perm = _shuffled_logits(probs, seed=9)
    samples = _draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), n=2000)
    assert set(samples.tolist()) == {int(perm[0])}


def test_temperature_frequencies_follow_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.5
    expected = (logits / temperature).softmax(dim=-1)
    assert (expected - logits.softmax(dim=-1)).abs().max() > 0.1  # ignoring temperature would fail
    n = 20000
    samples = _draws(logits, SamplingParams(temperature=temperature), n=n, seed=10)
    freq = torch.bincount(samples, minlength=len(logits)).float() / n
    # Standard error is at most 0.0036 per token; 0.02 is over five of them.
    assert (freq - expected).abs().max() < 0.02


@pytest.mark.parametrize("top_k", [0, 3])
def test_seeded_rows_follow_softmax_too(top_k: int) -> None:
    """Over seeds and over one seed's positions alike; a top-k row never wins with a token it dropped."""
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, -3.0])
    n = 10000
    params = [SamplingParams(temperature=1.0, top_k=top_k)] * n
    expected = logits.softmax(dim=-1) if not top_k else logits.masked_fill(logits < 0, -math.inf).softmax(dim=-1)
    for seeded in ([(s, 3) for s in range(n)], [(3, p) for p in range(n)]):
        samples = Sampler()(logits.expand(n, -1), params, seeded)
        freq = torch.bincount(samples, minlength=5).float() / n
        assert (freq - expected).abs().max() < 0.02  # standard error at most 0.005


def test_never_samples_a_masked_token() -> None:
    logits = torch.full((1000, 10), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 7] = 0.0
    torch.manual_seed(11)
    out = Sampler()(logits, [SamplingParams(temperature=1.0)] * 1000, [None] * 1000)
    assert set(out.tolist()) == {3, 7}


def test_the_extreme_draws_land_on_the_first_and_last_tokens_with_probability() -> None:
    """u = 0 and u just below 1 pick the outermost unmasked tokens, never a masked one beside them."""
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.5, 0.25, 0.0, 0.0]] * 2)
    u = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    assert _inverse_cdf_draw(probs, u).tolist() == [2, 4]
    assert _inverse_cdf_draw(probs, torch.tensor([0.25, 0.75], dtype=torch.float64)).tolist() == [3, 4]


def _openai_penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float, repetition: float
) -> torch.Tensor:
    """One row's penalties written out token by token, as vLLM documents them: repetition on every token
    seen (prompt or output), then frequency per occurrence and presence once, on output tokens."""
    row = logits.clone()
    for token in set(prompt) | set(output):
        row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_equal_their_definition_and_leave_other_rows_alone(device: torch.device) -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 12, device=device)
    logits[0, 4] = 0.0  # repetition leaves a zero logit at zero either way
    penalized = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5, logit_bias=((2, 0.75), (11, -3.0))
    )
    repetition_only = SamplingParams(repetition_penalty=0.8)  # < 1 favours repeats
    histories = [(np.array([1, 4, 4, 7]), [7, 2, 2, 2]), None, (np.array([3]), [3, 9])]
    params = [penalized, SamplingParams(), repetition_only]
    biased = logits[0].clone()  # biases first, then penalties
    biased[2] += 0.75
    biased[11] -= 3.0
    want = torch.stack(
        [
            _openai_penalized(biased, [1, 4, 4, 7], [7, 2, 2, 2], 0.5, 0.25, 1.5),
            logits[1],
            _openai_penalized(logits[2], [3], [3, 9], 0.0, 0.0, 0.8),
        ]
    )
    before = logits.clone()
    got = Sampler()._penalized(logits, [0, 2], params, histories)
    torch.testing.assert_close(got, want)
    assert torch.equal(logits, before)  # the runner's logits are read, never written
    assert Sampler()(logits, params, [None] * 3, histories).tolist() == want.argmax(dim=-1).tolist()


def test_a_greedy_row_with_penalties_moves_off_its_repeated_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    params = [SamplingParams(frequency_penalty=0.2)]
    assert Sampler()(logits, params, [None], [(np.array([0]), [])]).item() == 1
    assert Sampler()(logits, params, [None], [(np.array([0]), [1])]).item() == 2  # 3.0 - 0.2 < 2.9


def test_rows_with_penalties_need_their_history() -> None:
    with pytest.raises(ValueError, match="token histor"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [None])
    with pytest.raises(ValueError, match="row 1"):
        Sampler()(
            torch.zeros(2, 4), [SamplingParams(), SamplingParams(presence_penalty=1.0)], [None, None], [None, None]
        )


def _mass_ranked_above(logits: torch.Tensor, token: int, top_k: int = 0) -> float:
    """In float64: the probability of the tokens a stable sort ranks above `token` (likelier, or tied and before
    it in id order), over the `top_k` likeliest tokens when there is a top-k."""
    probs = logits.double().softmax(dim=-1)
    if top_k:
        kept = probs.sort(descending=True, stable=True).indices[:top_k]
        probs = torch.zeros_like(probs).index_copy_(0, kept, probs[kept])
        probs /= probs.sum()
    ids = torch.arange(len(probs), device=probs.device)
    above = (probs > probs[token]) | ((probs == probs[token]) & (ids < token))
    return float(probs[above].sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_nucleus_found_among_the_likeliest_tokens_is_the_full_sorts(
    device: torch.device, dtype: torch.dtype
) -> None:
    """Over a real-sized vocabulary: peaked rows (a model's) find their nucleus among the first 64 candidates,
    less peaked ones (nuclei of ~1 to ~350 tokens) some among 64 and the rest among 1,024, flat rows fall back to
    the sort unless they have a top-k, bfloat16 rows are full of ties; every row's mask is the full sort's, but
    for the token at the cut-off when the mass ranked above it is top_p to within rounding (the two paths sum the
    same probabilities differently)."""
    gen = torch.Generator().manual_seed(5)
    vocab, rows = 49_152, 48
    scale = torch.tensor([8.0] * 16 + [5.0] * 16 + [0.1] * 16).unsqueeze(1)  # peaked, less so, nearly flat
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype).float().to(device)
    top_ps = [0.5, 0.9, 0.95, 0.99]
    params = [SamplingParams(temperature=1.0, top_p=top_ps[i % 4], top_k=50 if i % 7 == 6 else 0) for i in range(rows)]
    params[5] = SamplingParams(temperature=1.0)  # neither: nothing dropped
    for row in (7, 23, 40):  # top-k alone: peaked, less so, flat
        params[row] = SamplingParams(temperature=1.0, top_k=40)
    want = Sampler._outside_sorted(logits, params)
    got = Sampler._outside_top_k_top_p(logits, params)
    for row, p in enumerate(params):
        differ = (got[row] != want[row]).nonzero().flatten().tolist()
        assert len(differ) <= 1, (row, differ)
        if differ:
            # Each path sums the ranked probabilities in float32 in its own order: each term may round.
            rounding = int(want[row].logical_not().sum()) * torch.finfo(torch.float32).eps
            assert abs(_mass_ranked_above(logits[row], differ[0], p.top_k) - p.top_p) < rounding, row
    no_top_k = torch.full((rows,), vocab, device=device)
    top_p = torch.tensor(top_ps * (rows // 4), device=device)
    _, found_among_64 = _outside_among_candidates(logits, no_top_k, top_p, 64)
    _, found_among_1024 = _outside_among_candidates(logits, no_top_k, top_p, 1024)
    assert found_among_1024[:32].sum() >= 30 and not found_among_1024[32:].any()  # the fast paths ran where they should
    assert 0 < found_among_64[:32].sum() < found_among_1024[:32].sum()  # some rows needed the second tier
    # A top-k of 40 is found among 64 candidates however flat the row, unless ties straddle the 64th.
    top_k_only = torch.full((rows,), 40, device=device), torch.full((rows,), math.inf, device=device)
    _, found_top_k = _outside_among_candidates(logits, *top_k_only, 64)
    assert found_top_k.all() if dtype == torch.float32 else found_top_k[:32].all()
    assert not want[5].any()


def test_a_repetition_penalty_near_zero_still_samples_among_the_tokens_it_favours() -> None:
    """Dividing positive logits by 1e-40 overflows float32; clamped, they tie, and sampling splits between them
    (infinite logits would make every probability NaN and the draw always the first token)."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]]).expand(2000, -1)
    params = [SamplingParams(temperature=1.0, repetition_penalty=1e-40)] * 2000
    torch.manual_seed(0)
    drawn = Sampler()(logits, params, [None] * 2000, [(np.array([0, 3]), [])] * 2000)
    assert set(drawn.tolist()) == {0, 3}


def test_a_huge_repetition_penalty_never_lifts_a_masked_token_to_an_allowed_ones_level() -> None:
    """probe_rep3's case: an output constraint masks tokens 0 and 1 (-inf), logit biases and a huge penalty push the
    allowed 2 and 3 to the clamp's floor; all four were seen. Greedy must still pick an allowed token, not the
    lowest id among tokens tied at -1e30."""
    logits = torch.tensor([[float("-inf"), float("-inf"), 3.0, 1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=3e38, logit_bias=((2, -100.0), (3, -100.0)))
    drawn = Sampler()(logits, [params], [None], [(np.array([0, 1, 2, 3]), [])])
    assert drawn.tolist() == [2]


def test_a_seeded_draw_survives_the_logit_moves_a_batch_makes() -> None:
    """A batch moves a model's logits by up to ~1e-4 (docs/engine.md). The race flips only where its two best
    scores are that close; a single uniform against the cumulative sum (kept as the control: the seeded draw before
    the race) flips wherever it falls that near any cut-off of the sum."""
    gen = torch.Generator().manual_seed(12)
    rows, vocab = 400, 49_152
    logits = torch.randn(rows, vocab, generator=gen) * 3
    moved = logits + torch.randn(rows, vocab, generator=gen) * 1e-4
    params = [SamplingParams(temperature=1.0)] * rows
    seeded = [(seed, 40) for seed in range(rows)]
    race_flips = (Sampler()(logits, params, seeded) != Sampler()(moved, params, seeded)).sum().item()
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    cdf_flips = (_inverse_cdf_draw(logits.softmax(-1), u) != _inverse_cdf_draw(moved.softmax(-1), u)).sum().item()
    assert cdf_flips >= 5  # the move is enough to flip a draw that depends on the whole sum
    assert race_flips <= 1
