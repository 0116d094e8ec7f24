"""Which backend a pair's data travels over, as both sides decide it from the two device strings: NCCL only
between two GPUs (a prefill and a decode worker sharing one GPU, as on a single-GPU node, pair over gloo: NCCL
refuses two ranks on one device), and the same answer on both sides, a peer of an older release included."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.base import TransferError
from pdserve.transfer.rendezvous import choose_backend, device_info

GPU_A, GPU_B = "cuda:GPU-1c0f", "cuda:GPU-7e42"


@pytest.mark.parametrize(
    ("mine", "theirs", "chosen"),
    [
        (f"{GPU_A} auto 1", f"{GPU_B} auto 1", "nccl"),
        (f"{GPU_A} auto 1", f"{GPU_A} auto 1", "gloo"),  # one GPU, two workers
        (f"{GPU_A} auto 1", "cpu auto 0", "gloo"),
        (f"{GPU_A} auto 1", f"{GPU_B} auto 0", "gloo"),  # no NCCL on one side
        (f"{GPU_A} auto 1", "cuda auto 1", "gloo"),  # an older peer's "cuda": it reads ours as no CUDA device
        (f"{GPU_A} gloo 1", f"{GPU_B} auto 1", "gloo"),
        ("cpu auto 0", "cpu auto 0", "gloo"),
    ],
)
def test_both_sides_choose_the_same_backend(mine: str, theirs: str, chosen: str) -> None:
    assert choose_backend(mine, theirs) == choose_backend(theirs, mine) == chosen


@pytest.mark.parametrize("theirs", [f"{GPU_A} auto 1", "cpu auto 0"])
def test_nccl_asked_for_where_it_cannot_run_is_refused(theirs: str) -> None:
    with pytest.raises(TransferError, match="backend nccl needs two GPUs"):
        choose_backend(f"{GPU_A} nccl 1", theirs)


def test_a_cpu_side_says_cpu() -> None:
    assert device_info(torch.device("cpu"), "auto") == "cpu auto 0"
