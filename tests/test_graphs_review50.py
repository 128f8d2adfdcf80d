"""Graph capture, native tier: a float ``arange`` past ATen's parallel grain follows the thread
count at replay, not at capture (ATen's split of the range by threads decides which positions
take the vector-lane formula)."""

from __future__ import annotations

import pytest
import torch

from torchport import native
from torchport.graphs import Graph

# around ATen's 32768-element grain and the vector blocks: empty, one, primes, 2^k ± 1
_SIZES = [0, 1, 31, 32767, 32769, 40009, 65537]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 8: torch.int64}[t.element_size()])


def _eager(start: float, step: float, n: int, dtype: torch.dtype) -> torch.Tensor:
    end = start + step * (n - 0.5) if n else start  # n elements: half a step past the last
    return torch.arange(start, end, step, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("capture_threads", "replay_threads"), [(1, 2), (2, 1), (1, 3)], ids=lambda v: f"{v}t"
)
def test_native_arange_follows_the_replay_thread_count(
    capture_threads: int, replay_threads: int, dtype: torch.dtype
) -> None:
    # the program split the range by the capture-time count: replayed after set_num_threads,
    # 1 value in 5 of arange(-7, ..., 0.37) past 32768 elements was 1 ulp off torch.arange
    if not native.enabled():
        pytest.skip("no native toolchain")
    before = torch.get_num_threads()
    try:
        for n in _SIZES:
            torch.set_num_threads(capture_threads)
            zero = torch.zeros(n, dtype=dtype)  # makes the arange an op of the graph
            g = Graph()
            with torch.no_grad(), g:
                got = _eager(-7.0, 0.37, n, dtype) + zero
            if g.tier != "native":
                pytest.skip(f"arange not native here ({g.tier})")
            torch.set_num_threads(replay_threads)
            got.fill_(float("nan"))  # every element must be written by the replay
            g.replay()
            want = _eager(-7.0, 0.37, n, dtype)
            assert got.shape == want.shape == (n,)
            diff = (_bits(got) != _bits(want)).nonzero().flatten()
            assert diff.numel() == 0, (n, diff.numel(), diff[:8].tolist())
    finally:
        torch.set_num_threads(before)
