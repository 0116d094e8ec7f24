"""The seeded race's noise: the hash as its definition says on every device, each row's noise its (seed, position)'s
alone, and Exp(1) distributed."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.seeded_noise import exponential_noise, lowbias32_

# The CUDA case is marked, so scripts/gpu_check.sh runs it with the other CUDA tests (`-m cuda`).
CUDA = pytest.param(torch.device("cuda"), marks=pytest.mark.cuda)
DEVICES = [torch.device("cpu")] + ([CUDA] if torch.cuda.is_available() else [])
MASK = 0xFFFFFFFF


def reference_lowbias32(x: int) -> int:
    """The hash in Python's arbitrary-precision integers, reduced modulo 2**32 where C's uint32 would wrap."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


@pytest.mark.parametrize("device", DEVICES)
def test_the_hash_wraps_as_unsigned_32_bit_arithmetic(device: torch.device) -> None:
    """torch's int32 products must wrap modulo 2**32 (C leaves signed overflow undefined); the values span both
    signs and the extremes."""
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF] + [(i * 2654435761) & MASK for i in range(500)]
    signed = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32, device=device)
    got = [v & MASK for v in lowbias32_(signed).tolist()]
    assert got == [reference_lowbias32(v) for v in values]


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_noise_is_its_seed_and_position_alone(device: torch.device) -> None:
    vocab = 1000
    alone = exponential_noise([7], [12], vocab, device)
    batched = exponential_noise([3, 7, 2**64 - 1], [12, 12, 0], vocab, device)
    assert torch.equal(batched[1], alone[0])
    # All 64 bits of a seed count (torch's CPU generator kept 63: -1 and 2**63 - 1 sampled alike).
    top_bit = exponential_noise([2**63 - 1, 2**64 - 1], [12, 12], vocab, device)
    assert not torch.equal(top_bit[0], top_bit[1])
    again = exponential_noise([7, 7, 8], [12, 13, 12], vocab, device)
    assert torch.equal(again[0], alone[0])
    # Another position or seed is other noise, neither equal nor a shift of it.
    for row in (again[1], again[2], batched[0], batched[2]):
        assert not any(torch.equal(row[shift:], alone[0][: vocab - shift]) for shift in range(0, 50))


def test_the_noise_is_exp_1_and_never_0_or_infinite() -> None:
    noise = exponential_noise(list(range(64)), [5] * 64, 4096, torch.device("cpu")).double()
    assert noise.min() > 0 and torch.isfinite(noise).all()
    n = noise.numel()
    assert abs(noise.mean().item() - 1) < 5 / math.sqrt(n)  # Exp(1): mean 1, standard deviation 1
    for t in (0.1, 1.0, 3.0):  # the tail: P(E > t) = e^-t
        share = (noise > t).double().mean().item()
        assert abs(share - math.exp(-t)) < 5 * math.sqrt(math.exp(-t) / n)
    # Neighbouring token ids and neighbouring positions are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]) < 0.01
    rows = exponential_noise([9] * 200, list(range(200)), 4096, torch.device("cpu")).double()
    assert abs(torch.corrcoef(torch.stack([rows[:-1].flatten(), rows[1:].flatten()]))[0, 1]) < 0.01


def test_the_noise_resolves_the_small_values_where_unlikely_tokens_win() -> None:
    """A token p times as likely as another beats it when its noise is below about p times the other's: noise that
    went no lower than 6e-8 (-log of a float32 uniform, spaced 6e-8 near 1) let no token below ~3e-8 of probability
    win. Exp(1) puts ~8 of 2**27 draws below 5.9e-8."""
    below = 0
    for chunk in range(8):
        seeds = list(range(chunk * 256, (chunk + 1) * 256))
        below += int((exponential_noise(seeds, [3] * 256, 1 << 16, torch.device("cpu")) < 5.9e-8).sum())
    assert 1 <= below <= 20, below
