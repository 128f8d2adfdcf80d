"""Review 49 of the GEMM engine and the autotuner: non-finite scales in ``scaled_mm``, tuning
on operands holding NaN, an anchor that raises, and the choice cache's memo across thread
counts and ISA levels."""

from __future__ import annotations

import sys

import pytest
import torch

import torchport
from torchport import autotune, config, gemm
from torchport.autotune import ATEN, Candidate, ChoiceCache
from torchport.autotune.cache import entry_key
from torchport.lowp.scaled_mm import scaled_mm_reference

SM = sys.modules["torchport.lowp.scaled_mm"]
gemm_mm = sys.modules["torchport.gemm.mm"]  # (torchport.gemm.mm is the function)
E4 = torch.float8_e4m3fn
INF, NAN = float("inf"), float("nan")


def _fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul(4).to(E4)


def _same_values(out: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN, inf and -inf in the same places; finite values close."""
    if not (torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())):
        return False
    fin = out.isfinite()
    return bool(torch.equal(out[~fin & ~out.isnan()], want[~fin & ~want.isnan()])) and bool(
        torch.allclose(out[fin].double(), want[fin].double(), rtol=1e-4, atol=1e-3)
    )


# --- 1. scaled_mm with a NaN or inf scale, whatever the tuner picked -----------------------------

# (prefill route, lowp_panel choice) forced; M = 4 is the GEMV route, which no choice steers
_ROUTES = {
    "gemv": (4, None, None),
    "mkl_panels": (16, "mkl_panels", None),
    "engine_panels-aten": (16, "engine_panels", "aten"),
    "engine_panels-native": (16, "engine_panels", "native"),
}


@pytest.mark.parametrize("route", list(_ROUTES))
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_scaled_mm_non_finite_scale_matches_torch_on_every_route(
    route, value, rowwise, monkeypatch
):
    """A NaN scale raised EpilogueError where the engine's panel tuning chose ATen (the public
    gemm.mm refuses non-finite Scale operands) and gave NaN on the other routes; an inf scale
    gave ±inf (the float32 product scaled) where torch._scaled_mm, which scales the operands,
    gives NaN for inf · 0 and inf − inf. Every route now gives torch's values."""
    m, prefill, panel = _ROUTES[route]
    if prefill is not None:
        kind = ATEN if prefill == "mkl_panels" else autotune.NATIVE
        monkeypatch.setattr(SM, "_prefill_choice", lambda p, tag: Candidate(prefill, kind))
    if panel is not None:
        backend = ATEN if panel == "aten" else autotune.NATIVE
        monkeypatch.setattr(SM, "_panel_choice", lambda *a: Candidate(panel, backend))
    n, k = 24, 40
    a, b = _fp8((m, k), 1), _fp8((n, k), 2).t()
    a[0, 3] = 0.0  # a zero times an infinite scale: NaN in torch's order
    if rowwise:
        sa, sb = torch.full((m, 1), 0.5), torch.full((1, n), 2.0)
        sa[m - 1, 0] = value
        sb[0, 5] = value
    else:
        sa, sb = torch.tensor(value), torch.tensor(2.0)
    with config.override(autotune=False):
        got = torchport.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
        if prefill is not None:  # the forced route serves finite scales
            taken: list[str] = []
            for name in ("_mkl_panels", "_engine_panels"):
                real = getattr(SM, name)
                monkeypatch.setattr(SM, name, lambda p, f=real, n=name: taken.append(n) or f(p))
            ones = sa.nan_to_num(1.0, 1.0, 1.0), sb.nan_to_num(1.0, 1.0, 1.0)
            ok = torchport.scaled_mm(a, b, *ones, out_dtype=torch.float32)
            assert taken == [f"_{prefill}"] and ok.isfinite().all()
            if rowwise:  # the entries no bad scale reaches: as the route gives them
                keep = torch.ones(m, n, dtype=torch.bool)
                keep[m - 1], keep[:, 5] = False, False
                assert torch.equal(got[keep], ok[keep])
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert not want.isfinite().all()
    assert _same_values(got, want)
    assert _same_values(scaled_mm_reference(a, b, sa, sb, out_dtype=torch.float32), want)


def test_engine_panel_aten_choice_serves_a_nan_scale_as_the_native_one(monkeypatch):
    """The panel GEMM fell back to the public gemm.mm where its tuning chose ATen, which raised
    EpilogueError for a NaN Scale operand the native route multiplies in (block_scaled_mm's bf16
    panels carry the weight's float32 scale as one); it now runs the tuning's ATen anchor."""
    x, panel = torch.randn(16, 32), torch.randn(24, 32)
    col = torch.ones(24)
    col[3] = NAN
    epi = [gemm.Scale(torch.full((16,), 0.5), "row"), gemm.Scale(col, "col")]
    want = (x @ panel.t()) * 0.5 * col
    outs = {}
    with config.override(autotune=False):
        for backend in (ATEN, autotune.NATIVE):
            monkeypatch.setattr(SM, "_panel_choice", lambda *a, b=backend: Candidate("c", b))
            outs[backend] = SM._engine_panel(x, panel, epi)
    for out in outs.values():
        assert out[:, 3].isnan().all() and out.isnan().sum() == 16
        assert _same_values(out, want)


# --- 2. tuning on real operands that hold NaN or inf ---------------------------------------------


def test_agree_takes_the_anchors_non_finite_values():
    """The three result checks (GEMM engine, lowp prefill and panel) refused any NaN: operands
    holding one failed every native candidate, and ATen was saved for the shape."""
    ref = torch.randn(6, 7)
    ref[1, 2], ref[4, 0], ref[5, 6] = NAN, INF, -INF
    near = ref + 1e-5
    checks = [gemm_mm._close, SM._close, SM._close_values]
    for check in checks:
        assert check(ref.clone(), ref) and check(near, ref)
        for pos, val in [((1, 2), 0.0), ((4, 0), NAN), ((4, 0), -INF), ((0, 0), NAN)]:
            bad = ref.clone()
            bad[pos] = val
            assert not check(bad, ref), (check, pos, val)
        off = ref.clone()
        off[2, 2] += 1.0  # a finite value off by far more than the tolerance
        assert not check(off, ref)
    bf = ref.bfloat16()
    assert gemm_mm._close(bf.clone(), bf) and SM._close_values(bf, ref)
    assert gemm_mm.agree(torch.empty(0, 3), torch.empty(0, 3), 1e-3)


def test_first_call_with_nan_operands_times_the_native_candidates(monkeypatch):
    """A weight past L3 is tuned on the caller's real operands: a NaN in the activation failed
    every native candidate's check, so ATen was chosen (and saved) for the shape. The L3 bound is
    lowered so a small shape takes that path; the choice cache is off, so each call tunes."""
    monkeypatch.setattr(gemm_mm, "L3_BYTES", 1)
    choices: list[autotune.Choice] = []
    real = autotune.select

    def spy(*args, **kwargs):
        choices.append(real(*args, **kwargs))
        return choices[-1]

    monkeypatch.setattr(autotune, "select", spy)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(2, 64, generator=g)
    x[0, 5] = NAN
    with config.override(autotune_cache=False, autotune_reps=3):
        y = gemm.mm(x, w.t())
    assert y[0].isnan().all() and torch.allclose(y[1], x[1] @ w.t(), rtol=1e-4, atol=1e-4)
    (choice,) = [c for c in choices if c.op == "gemm"]
    native = [c for c in choice.timings_s if c != "aten" and ":" not in c]
    assert native, choice.failures
    assert not any("does not match" in f for f in choice.failures.values()), choice.failures


# --- 3. an anchor that raises --------------------------------------------------------------------


@pytest.mark.parametrize("error", [RuntimeError, autotune.InvalidCandidate])
def test_anchor_that_raises_chooses_and_saves_nothing(error, tmp_path):
    """Without the anchor's result no candidate was checked: one returning zeros was chosen,
    used and saved. select now raises the anchor's error, saves nothing, and tunes afresh on
    the next call."""
    cache = ChoiceCache(tmp_path / "choices-v1.json")
    x = torch.randn(32, 32)
    fail = [True]

    def factory(c):
        if c.is_anchor:

            def aten(x):
                if fail[0]:
                    raise error("transient failure")
                return x.sum(1)

            return aten
        if c.name == "wrong_fast":
            return lambda x: torch.zeros(x.shape[0])
        return lambda x: x.sum(1, dtype=torch.float64).float()

    cands = [Candidate("aten", ATEN), Candidate("wrong_fast"), Candidate("right")]

    def pick():
        return autotune.select(
            "toy.anchor_fails", {"s": 1}, cands, factory, lambda: (x,), cold=False, cache=cache
        )

    with config.override(autotune_reps=3):
        with pytest.raises(error, match=r"^transient failure$"):
            pick()
        assert cache.entries() == {} and cache.get("toy.anchor_fails", {"s": 1}) is None
        fail[0] = False
        ch = pick()
    assert not ch.from_cache and ch.candidate.name != "wrong_fast"
    assert ch.failures["wrong_fast"] == "invalid: result does not match the ATen anchor"


# --- 4. the choice cache's memo: thread count and ISA level --------------------------------------


def test_memo_serves_no_choice_of_another_thread_count_or_isa(tmp_path):
    """The in-memory memo was keyed on (op, key) alone: after torch.set_num_threads it served
    the choice tuned for the other count (whose disk entry key differs), and that count was never
    tuned. Likewise for another ``isa`` setting."""
    cache = ChoiceCache(tmp_path / "choices-v1.json")
    key = {"shape": [8, 8]}
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    cache.put("toy.memo", key, "native", {"native": 1e-6})
    assert cache.get("toy.memo", key)["choice"] == "native"  # memoised now
    assert cache.get("toy.memo", key) is cache.get("toy.memo", key)
    try:
        torch.set_num_threads(other)
        assert cache.get("toy.memo", key) is None
        cache.put("toy.memo", key, "aten", {"aten": 1e-6})
        assert cache.get("toy.memo", key)["choice"] == "aten"
    finally:
        torch.set_num_threads(threads)
    assert cache.get("toy.memo", key)["choice"] == "native"
    isa = torchport.native.cpu_info().isa
    lower = "scalar" if isa != "scalar" else None
    if lower is not None:
        with config.override(isa=lower):
            assert cache.get("toy.memo", key) is None
            assert entry_key("toy.memo", key) not in cache.entries()
    assert cache.get("toy.memo", key)["choice"] == "native"
