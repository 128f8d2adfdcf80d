"""Native replay tier: GEMMs through the GEMM engine's tiles, over a grid of shapes and layouts.

Every case is captured into one graph (one C program, one compile) and compared with ATen after
replays on fresh inputs written into the static buffers; the reference is eager ATen (float32,
tolerance for a different summation order over K).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from torchport import config
from torchport.graphs import Graph
from torchport.graphs.native import _tile_for

# (M, N, K): size 0 and 1, primes, tile non-multiples, the demo's 8x64x64.
SHAPES = [(0, 5, 3), (1, 1, 1), (3, 7, 0), (1, 64, 64), (7, 13, 5), (8, 64, 64), (13, 67, 31)]


def _cases(
    m: int, n: int, k: int
) -> list[tuple[str, Callable[..., torch.Tensor], list[torch.Tensor]]]:
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    w = torch.randn(n, k)  # Linear weight: B = w.t()
    bias = torch.randn(n)
    bias2 = torch.randn(m, n)
    wide = torch.randn(k, 2 * n + 1)  # B a strided slice (column stride 2)
    at = torch.randn(k, m)  # A transposed
    return [
        ("mm", lambda a, b: torch.mm(a, b), [a, b]),
        ("linear", lambda a, w, c: torch.nn.functional.linear(a, w, c), [a, w, bias]),
        ("linear_nobias", lambda a, w: torch.nn.functional.linear(a, w), [a, w]),
        (
            "addmm_beta_alpha",
            lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=-2.0),
            [bias, a, b],
        ),
        ("addmm_2d_bias", lambda c, a, w: torch.addmm(c, a, w.t()), [bias2, a, w]),
        ("addmm_beta0", lambda c, a, b: torch.addmm(c, a, b, beta=0.0), [bias, a, b]),
        ("strided_b", lambda a, x: torch.mm(a, x[:, ::2]), [a, wide]),
        ("transposed_a", lambda x, b: torch.mm(x.t(), b), [at, b]),
        ("addmm_inplace", lambda c, a, b: c.clone().addmm_(a, b, alpha=0.5), [bias2, a, b]),
    ]


@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_native_gemm_grid_matches_aten(isa: str) -> None:
    torch.manual_seed(0)
    overrides = {} if isa == "native" else {"isa": "scalar"}
    cases = [(f"{s}-{name}", fn, args, s[2]) for s in SHAPES for name, fn, args in _cases(*s)]
    g = Graph()
    with config.override(**overrides):
        with torch.no_grad(), g:
            outs = [fn(*args) for _, fn, args, _ in cases]
        assert g.tier == "native", "every case must lower to the native tier"
        assert g.source.count("((tp_gemm_t)F[") == len(cases), "every GEMM runs an engine tile"
        for _ in range(2):
            for _, _, args, _ in cases:
                for t in args:
                    t.copy_(torch.randn_like(t))
            g.replay()
            for (cid, fn, args, k), got in zip(cases, outs):
                tol = 2e-5 * max(1, k) ** 0.5  # fp32, a different summation order over K
                torch.testing.assert_close(got, fn(*args), rtol=tol, atol=tol, msg=cid)


def test_weights_are_read_at_replay() -> None:
    """A Linear weight changed in place (even behind autograd's back) is used by the next replay."""
    x, w, b = torch.randn(8, 64), torch.randn(64, 64), torch.randn(64)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.nn.functional.linear(x, w, b)
    w.data.mul_(-3.0)  # .data: no version bump, so no pack cache could notice
    g.replay()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("m", "n", "k"), [(8, 64, 64), (1, 64, 64), (6, 16, 9), (0, 0, 0)])
def test_tile_choice_is_an_engine_tile(m: int, n: int, k: int) -> None:
    from torchport import native
    from torchport.gemm.kernels import TILES

    assert _tile_for(m, n, k) in TILES[native.cpu_info().isa]
    with config.override(isa="scalar"):
        assert _tile_for(m, n, k) in TILES["scalar"]
