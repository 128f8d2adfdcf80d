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


# --- control flow in the native tier ----------------------------------------------------------


def test_native_while_loop_data_dependent_trip_counts() -> None:
    import torchport

    n = torch.tensor(5)
    x = torch.randn(3, 5)

    def body(i: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, torch.tanh(v * 1.5 + 0.25)

    g = Graph()
    with torch.no_grad(), g:
        i_out, v_out = torchport.while_loop(lambda i, v: i < n, body, (torch.tensor(0), x))
    assert g.tier == "native" and "for (;;)" in g.source
    for trips in (0, 1, 2, 37):
        n.fill_(trips)
        x.copy_(torch.randn(3, 5))
        g.replay()
        i, v = torch.tensor(0), x.clone()
        while bool(i < n):
            i, v = body(i, v)
        assert int(i_out) == trips
        torch.testing.assert_close(v_out, v, rtol=1e-5, atol=1e-5)
        assert v_out.data_ptr() != x.data_ptr()  # zero trips: a copy, not the input


def test_native_while_loop_swapping_carried_values() -> None:
    """A body returning carried values in another order must not read half-updated buffers."""
    import torchport

    a, b, n = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]), torch.tensor(3)
    g = Graph()
    with torch.no_grad(), g:
        out = torchport.while_loop(
            lambda i, x, y: i < n, lambda i, x, y: (i + 1, y, x + y), (torch.tensor(0), a, b)
        )
    assert g.tier == "native"
    for trips in (0, 1, 4):
        n.fill_(trips)
        g.replay()
        x, y = a.clone(), b.clone()
        for _ in range(trips):
            x, y = y, x + y
        torch.testing.assert_close(out[1], x)
        torch.testing.assert_close(out[2], y)


def test_native_switch_and_nested_loop() -> None:
    import torchport

    sel, x, lim = torch.tensor(0), torch.randn(4, 3), torch.tensor(4.0)

    def grow(t: torch.Tensor) -> torch.Tensor:
        # loop inside a branch: doubles until the first element exceeds lim
        return torchport.while_loop(
            lambda v: v[0, 0].abs() < lim, lambda v: (v * 2.0 + 0.5,), (t,)
        )[0]

    branches = [
        lambda t: t + 1,
        lambda t: torch.where(t > 0, t, -t),
        grow,
        lambda t: t.clamp(-0.5, 0.5),
    ]
    g = Graph()
    with torch.no_grad(), g:
        y = torchport.switch(sel, branches, (x,))
    assert g.tier == "native" and "switch (" in g.source
    for k in (-3, 0, 1, 2, 3, 9):
        sel.fill_(k)
        x.copy_(torch.randn(4, 3))
        g.replay()
        torch.testing.assert_close(y, torchport.control.switch_reference(sel, branches, (x,)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_native_typed_pointwise_matches_aten(dtype: torch.dtype) -> None:
    a = (torch.randn(5, 7) * 50).to(dtype)
    b = (torch.randn(7) * 50).to(dtype)

    def prog(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        lt, ge, eq = a < b, a >= 3, a == b
        both = (lt & ge) | eq
        outs = [lt, ge, eq, both, ~both, a + b * 3, a - 7, a * b, a.abs(), a.neg()]
        outs += [a.clamp(-10, 10), a.clamp(min=0), torch.where(lt, a, b), a.float() / 4]
        outs += [torch.relu(a), both.to(dtype), a.clone().fill_(2), torch.zeros_like(a)]
        outs += [
            torch.logical_and(a, b),
            torch.logical_or(lt, a),
            torch.ones_like(a),
            torch.full_like(a, 3),
        ]
        return outs

    g = Graph()
    with torch.no_grad(), g:
        outs = prog(a, b)
    assert g.tier == "native"
    for _ in range(2):
        a.copy_((torch.randn(5, 7) * 50).to(dtype))
        b.copy_((torch.randn(7) * 50).to(dtype))
        g.replay()
        for i, (got, want) in enumerate(zip(outs, prog(a, b))):
            assert got.dtype == want.dtype, i
            torch.testing.assert_close(got, want, msg=f"output {i}")


def test_integer_division_stays_out_of_the_native_tier() -> None:
    """ATen raises on integer division by zero; C would trap, so such captures use TorchScript."""
    a, b = torch.tensor([7, -7]), torch.tensor([2, 3])
    g = Graph()
    with torch.no_grad(), g:
        q = torch.div(a, b, rounding_mode="floor")
    assert g.tier == "torchscript"
    b.copy_(torch.tensor([-2, 5]))
    g.replay()
    torch.testing.assert_close(q, torch.div(a, b, rounding_mode="floor"))


@pytest.mark.parametrize("shape", [(4, 5, 3), (1,), (7, 1)])
def test_native_reductions_match_aten(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    xi = (torch.randn(shape) * 9).long()
    last = len(shape) - 1
    fns = [
        lambda: x.sum(),
        lambda: x.sum(last),
        lambda: x.sum(0, keepdim=True),
        lambda: x.mean(-1),
        lambda: x.amax(0),
        lambda: x.amin(last, keepdim=True),
        lambda: xi.sum(),
        lambda: xi.amax(last),
        lambda: x.transpose(0, last).sum(0),
    ]
    g = Graph()
    with torch.no_grad(), g:
        outs = [f() for f in fns]
    assert g.tier == "native"
    for nan in (False, True):
        x.copy_(torch.randn(shape))
        xi.copy_((torch.randn(shape) * 9).long())
        if nan:
            x.view(-1)[0] = float("nan")  # amax/amin propagate it, as ATen does
        g.replay()
        for i, (got, f) in enumerate(zip(outs, fns)):
            torch.testing.assert_close(got, f(), equal_nan=True, msg=f"reduction {i}")


def test_native_while_loop_until_converged() -> None:
    """A data-dependent convergence test (a reduction) as the loop condition, all native."""
    import torchport

    x, tol = torch.rand(6) + 1.0, torch.tensor(1e-3)

    def body(i: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, v * 0.5

    g = Graph()
    with torch.no_grad(), g:
        n, v = torchport.while_loop(lambda i, v: v.abs().amax() > tol, body, (torch.tensor(0), x))
    assert g.tier == "native"
    for scale in (1.0, 1e3, 1e-4):
        x.copy_((torch.rand(6) + 1.0) * scale)
        g.replay()
        i, ref = 0, x.clone()
        while float(ref.abs().amax()) > 1e-3:
            i, ref = i + 1, ref * 0.5
        assert int(n) == i
        torch.testing.assert_close(v, ref)


# --- model ops (a transformer decode step) ------------------------------------------------------


@pytest.mark.parametrize(("rows", "d"), [(1, 1), (3, 7), (4, 64)])
def test_native_model_ops_match_aten(rows: int, d: int) -> None:
    import torch.nn.functional as F

    emb = torch.nn.Parameter(torch.randn(11, d))
    idx = torch.tensor([3] * rows)
    x = torch.randn(rows, d)
    cache = torch.randn(2, 5, d)
    pos = torch.tensor([1])
    w, b = torch.randn(d), torch.randn(d)

    def prog() -> list[torch.Tensor]:
        e = F.embedding(idx, emb)
        h = F.layer_norm(x + e, (d,), w, b)
        att = torch.bmm(h.view(1, rows, d).expand(2, rows, d), cache.transpose(1, 2))
        valid = torch.arange(5) <= pos
        att = att.masked_fill(~valid, float("-inf")).softmax(-1)
        ctx = (att @ cache).reshape(2 * rows, d)
        kept = cache.index_copy(1, pos, h[:1].view(1, 1, d).expand(2, 1, d))
        g = F.gelu(ctx) + F.gelu(ctx, approximate="tanh")
        return [e, h, att, ctx, kept, g, torch.stack([h, x], 1), torch.cat([h, x]), g.argmax(-1)]

    gr = Graph()
    with torch.no_grad(), gr:
        outs = prog()
    assert gr.tier == "native"
    for step in range(3):
        idx.fill_(step * 4 % 11)
        pos.fill_(step + 1)
        x.copy_(torch.randn(rows, d))
        cache.copy_(torch.randn(2, 5, d))
        gr.replay()
        for i, (got, want) in enumerate(zip(outs, prog())):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"output {i}")


def test_native_index_out_of_range_raises_at_replay() -> None:
    import torch.nn.functional as F

    emb, idx = torch.randn(5, 3), torch.tensor([1])
    g = Graph()
    with torch.no_grad(), g:
        y = F.embedding(idx, emb)
    assert g.tier == "native"
    idx.fill_(4)
    g.replay()
    torch.testing.assert_close(y, emb[4:5])
    for bad in (5, -1, -2):  # ATen's embedding raises for negative indices too (they wrapped)
        idx.fill_(bad)
        with pytest.raises(IndexError, match="embedding: index out of range for size 5"):
            g.replay()
    cache, pos = torch.zeros(5, 4), torch.tensor([0])
    g2 = Graph()
    with torch.no_grad(), g2:
        cache.index_copy_(0, pos, torch.ones(1, 4))
    assert g2.tier == "native"
    cache.zero_()
    pos.fill_(-1)  # wrote the last row before; ATen raises
    with pytest.raises(IndexError, match="index_copy: index out of range for size 5"):
        g2.replay()
    assert not bool(cache.any())


def test_native_exp_and_sigmoid_over_the_whole_float_range() -> None:
    """exp(88.5) came out 0.61x (the input clamped at 88) and exp(-87.2) 0 (normal results
    flushed below -87): now within 2 ulp of ATen where the result is normal, its subnormals
    within one subnormal step, and inf / 0 / NaN where ATen gives them."""
    x = torch.cat(
        [
            torch.linspace(-110.0, 95.0, 4001),
            torch.tensor([88.72, 88.7228, 88.73, -87.33, -103.9, float("inf"), -float("inf")]),
            torch.tensor([float("nan")]),
        ]
    )
    g = Graph()
    with torch.no_grad(), g:
        y, s = torch.exp(x), torch.sigmoid(x)
    g.replay()
    assert g.tier == "native"
    want = torch.exp(x)
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert bool(((y - want).abs() <= 2 * ulp)[normal & want.isfinite()].all())
    sub = ~normal & want.isfinite()
    assert bool(((y - want).abs() <= 2.0**-149 * 2)[sub].all())
    assert torch.equal(y.isinf(), want.isinf()) and torch.equal(y.isnan(), want.isnan())
    torch.testing.assert_close(s, torch.sigmoid(x), rtol=1e-6, atol=1e-45, equal_nan=True)


def test_native_argmax_takes_nan_as_maximum() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, float("nan"), 9.0, float("nan")]])
    g = Graph()
    with torch.no_grad(), g:
        am = x.argmax(-1)
    g.replay()
    torch.testing.assert_close(am, x.argmax(-1))
    assert am.tolist() == [1, 1]


_NAN = float("nan")
_I64 = torch.zeros(4, dtype=torch.int64)  # makes the arange an op of the graph, not a constant
# (id, program, input): each once wrong after a native replay, now bit-exact to ATen.
_EXACT_CASES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = [
    ("arange_int64_past_2p53", lambda z: torch.arange(2**60, 2**60 + 4) + z, _I64),
    ("arange_int64_negative_step", lambda z: torch.arange(2**60 + 4, 2**60, -1) + z, _I64),
    (
        "arange_int64_float_bounds",
        lambda z: torch.arange(0.5, 3, 1.5, dtype=torch.int64) + z,
        _I64[:3],
    ),
    ("arange_int32", lambda z: torch.arange(-7, 9, 4, dtype=torch.int32) + z.int(), _I64),
    (
        "abs_float64_neg_zero_nan",
        lambda a: a.abs(),
        torch.tensor([-0.0, -_NAN, -2.0, 3.0], dtype=torch.float64),
    ),
    ("abs_float32_neg_zero_nan", lambda a: a.abs(), torch.tensor([-0.0, -_NAN, -2.0, 3.0])),
    ("clamp_nan_min", lambda a: a.clamp(min=_NAN), torch.tensor([0.0, -1.0, 2.0])),
    ("clamp_nan_max", lambda a: a.clamp(max=_NAN), torch.tensor([0.0, -1.0, 2.0])),
    ("clamp_nan_min_finite_max", lambda a: a.clamp(_NAN, 1.0), torch.tensor([0.0, -1.0, 2.0])),
    ("clamp_finite_min_nan_max", lambda a: a.clamp(-1.0, _NAN), torch.tensor([0.0, -1.0, 2.0])),
    (
        "clamp_min_nan",
        lambda a: torch.clamp_min(a, _NAN),
        torch.tensor([0.0, -1.0], dtype=torch.float64),
    ),
    (
        "clamp_max_nan",
        lambda a: torch.clamp_max(a, _NAN),
        torch.tensor([0.0, -1.0], dtype=torch.float64),
    ),
    ("clamp_nan_input", lambda a: a.clamp(0.0, 1.0), torch.tensor([_NAN, -0.0, 2.0, -1.0])),
]


@pytest.mark.parametrize(
    ("prog", "x"), [c[1:] for c in _EXACT_CASES], ids=[c[0] for c in _EXACT_CASES]
)
def test_native_integer_arange_abs_sign_and_clamp_nan_match_aten_exactly(
    prog: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> None:
    """Bugs: the native tier computed an integer arange in double (arange(2**60, 2**60 + 4)
    replayed as four equal values), float64 abs as ``a < 0 ? -a : a`` (abs(-0.0) kept its sign),
    and clamp compared with a NaN bound (``a < NaN`` is false: the input came back where ATen
    gives NaN). Results must equal ATen's bit for bit, sign of zero and NaN included."""
    g = Graph()
    with torch.no_grad(), g:
        got = prog(x)
    assert g.tier == "native"
    got.fill_(7)  # the replay, not the capture's eager run, must produce the values
    g.replay()
    want = prog(x)
    assert got.dtype == want.dtype
    if want.dtype.is_floating_point:
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        assert torch.equal(got.signbit(), want.signbit()), (got, want)
        keep = ~want.isnan()  # NaN payloads aside, equal values
        got, want = got[keep], want[keep]
    assert torch.equal(got, want), (got, want)
