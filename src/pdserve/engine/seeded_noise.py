"""The exponential noise a seeded row draws its token with: a hash of (seed, position, token id).

A seeded token is the winner of an exponential race, argmax of probability / noise over the vocabulary (as vLLM
samples). Its noise depends on nothing but the request's seed, the position of the token drawn and each token's
id, so:
- what shares its batch cannot change it unless two tokens' scores are within the ~1e-4 a batch moves the
  logits. A single uniform drawn against the cumulative sum flipped wherever it fell that near any of the
  sum's cut-offs (1.3e-3 of tokens at temperature 1 on smollm2-135m; docs/engine.md).
- any engine draws a position's token alike, with no generator to carry or skip ahead: a prefill worker's first
  token, a decode worker's next, a migrated stream's continuation, a recomputed sequence's.
- it is a few elementwise integer operations for the whole batch on any device, one kernel chain on a GPU,
  where a generator per row launched a kernel per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_GOLDEN = -1640531535  # 0x9E3779B1 as an int32: spreads consecutive token ids over the 32 bits
_SEED_SALT, _POSITION_SALT = 0x2545F491, 0x68E31DA4  # keep 0 (lowbias32's fixed point) out of the inputs
# A uniform v = (k + 0.5) / 2**31 from 31 bits of the hash, never 0; its noise -log(1 - v), taken as -log1p(-v), is
# resolved down to 2**-32, where a token far less likely than the others wins. -log(u) of a 23-bit u went no lower than
# 6e-8 (float32's spacing near 1), so tokens below ~3e-8 of probability never won: 1.3e-4 of smollm2-135m's mass a
# token at temperature 1, against ~1e-6 below 1e-9. v rounds to 1 for the largest k: clamped below it (noise <= 16.6).
_UNIFORM_BITS = 31
_LARGEST_UNIFORM = 1 - 2.0**-24  # float32's largest below 1


def lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32, in place on an int32 tensor, its multiplications wrapping modulo 2**32 as torch's
    integer arithmetic does on CPU and CUDA (a test checks it against Python's integers); `>>` is arithmetic on
    int32, so each shift masks the sign's copies off. In place: a [rows, vocabulary] pass less per operation."""
    x ^= (x >> 16) & 0xFFFF
    x *= 0x7FEB352D
    x ^= (x >> 15) & 0x1FFFF
    x *= -2073254261  # 0x846CA68B as an int32
    x ^= (x >> 16) & 0xFFFF
    return x


def _int32(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Unsigned 32-bit values as the int32 tensor with the same bits."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32, device=device)


def row_keys(seeds: Sequence[int], positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """[n, 1] int32: one key per (uint64 seed, position) row, every bit of each mixed into every bit of the key."""
    mask = 0xFFFFFFFF
    low = _int32([s & mask for s in seeds], device)
    high = _int32([(s >> 32) & mask for s in seeds], device)
    position = _int32([p & mask for p in positions], device)
    seed = lowbias32_(low ^ lowbias32_(high + _SEED_SALT))
    return lowbias32_(seed + lowbias32_(position + _POSITION_SALT)).unsqueeze(1)


def exponential_noise(seeds: Sequence[int], positions: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] float32 Exp(1) noise, row i's from (seeds[i], positions[i]) alone."""
    return exponential_noise_at(seeds, positions, torch.arange(vocab, dtype=torch.int32, device=device).unsqueeze(0))


def exponential_noise_at(seeds: Sequence[int], positions: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
    """float32 Exp(1) noise of the `token_ids` ([n, m], or [1, m] for every row), row i's from (seeds[i],
    positions[i]) alone: a token's noise is the same whichever other tokens it is drawn with, so a row whose
    top-k or top-p left few candidates is raced over those alone. Each token id's golden-step multiple XORed with
    the row's key, then hashed. XOR, not a sum: two keys a multiple of the golden step apart would then give the
    same noise shifted by that many token ids."""
    bits = token_ids.to(torch.int32) * _GOLDEN
    bits = lowbias32_(bits ^ row_keys(seeds, positions, token_ids.device))
    bits &= (1 << _UNIFORM_BITS) - 1
    minus_v = bits.float().mul_(-(2.0**-_UNIFORM_BITS)).sub_(2.0 ** -(_UNIFORM_BITS + 1))
    return minus_v.clamp_(min=-_LARGEST_UNIFORM).log1p_().neg_()
