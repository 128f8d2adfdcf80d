"""Review 50: the autotuner's confirmation memo is keyed like the choice cache (thread count,
ISA setting); an anchor's error while a choice is confirmed is no verdict on the choice; the GEMM
templates emit each float constant as the exact float32 nearest to the double it was computed as."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from conftest import FakeClock

from torchport import autotune, config
from torchport.autotune import ATEN, Candidate, tuner
from torchport.gemm import templates

PAIR = [Candidate("aten", ATEN), Candidate("native")]


def _kernels(clock: FakeClock, aten_s: float, native_s: float, calls: list[str]):
    """A factory of fake kernels taking the given fake seconds per call, logging their calls."""

    def make(c: Candidate):
        cost = aten_s if c.is_anchor else native_s

        def f(x):
            clock.t += cost
            calls.append(c.name)
            return x * 2

        return f

    return make


def _select(case: str, make, make_args=lambda: (torch.ones(4),), **kw):
    return autotune.select(
        "toy.review50",
        {"case": case},
        PAIR,
        make,
        make_args,
        cold=False,
        check=torch.equal,
        confirm=True,
        **kw,
    )


def _saved(case: str) -> str:
    return autotune.choice_cache.get("toy.review50", {"case": case})["choice"]


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)


@pytest.mark.parametrize("setting", ["threads", "isa"])
def test_confirmation_verdict_is_per_thread_count_and_isa(fresh_cache, clock, setting):
    """A native choice confirmed under one thread count (or ``isa`` setting) is confirmed again
    when the cache serves the one saved under another: before, the first verdict was reused
    and a choice 5x slower than ATen there ran unconfirmed."""
    threads = torch.get_num_threads()
    calls: list[str] = []

    def under_b():
        if setting == "threads":
            _set_threads(1 if threads != 1 else 2)
            return config.override()
        return config.override(isa="scalar")

    try:
        autotune.choice_cache.put("toy.review50", {"case": "memo"}, "native", {"aten": 0.02})
        first = _select("memo", _kernels(clock, 0.002, 0.001, calls))
        assert first.candidate.name == "native" and first.from_cache and "aten" in calls
        with under_b():
            # saved by another process under this configuration, where the kernel is slow
            autotune.choice_cache.put("toy.review50", {"case": "memo"}, "native", {"aten": 0.02})
            calls.clear()
            other = _select("memo", _kernels(clock, 0.002, 0.010, calls))
            assert calls.count("aten") >= 3 and calls.count("native") >= 3  # confirmed here
            assert other.candidate.name == "aten" and _saved("memo") == "aten"
    finally:
        _set_threads(threads)
    # back under the first configuration, its verdict stands (and its entry is untouched)
    calls.clear()
    again = _select("memo", _kernels(clock, 0.002, 0.001, calls))
    assert again.candidate.name == "native" and again.from_cache and calls == []


def _anchor_fails(clock: FakeClock, how: str, calls: list[str]):
    """Kernels where the native one is fast and the anchor fails ``how``: "build" (its factory
    raises), "first" (its first call raises), "later" (its second and later calls raise)."""
    fast = _kernels(clock, 0.002, 0.001, calls)

    def make(c: Candidate):
        if not c.is_anchor:
            return fast(c)
        if how == "build":
            raise RuntimeError("anchor cannot be built")
        n = [0]

        def f(x):
            n[0] += 1
            if how == "first" or n[0] > 1:
                raise RuntimeError("anchor ran out of memory")
            return fast(c)(x)

        return f

    return make


@pytest.mark.parametrize("how", ["build", "first", "args"])
def test_anchor_error_before_a_result_raises_and_keeps_the_cached_choice(fresh_cache, clock, how):
    """A cached native choice whose confirmation fails on the anchor's side (the anchor cannot
    be built, its first call raises, the arguments cannot be made) is no evidence against the
    choice: ``select`` raises that error, as when the anchor raises in the search, and the
    choice stays saved and unconfirmed (before, ATen replaced it on disk and in the memo)."""
    autotune.choice_cache.put("toy.review50", {"case": how}, "native", {"aten": 0.02})
    calls: list[str] = []
    rejected = autotune.stats.rejected

    def no_args():
        raise MemoryError("cannot make the arguments")

    if how == "args":
        with pytest.raises(MemoryError, match="cannot make the arguments"):
            _select(how, _kernels(clock, 0.002, 0.001, calls), make_args=no_args)
    else:
        with pytest.raises(RuntimeError, match=r"anchor (cannot be built|ran out of memory)"):
            _select(how, _anchor_fails(clock, how, calls))
    assert _saved(how) == "native" and tuner._confirmed == {}
    assert autotune.stats.rejected == rejected
    # the next call confirms it again, with an anchor that works now
    calls.clear()
    ch = _select(how, _kernels(clock, 0.002, 0.001, calls))
    assert ch.candidate.name == "native" and calls.count("aten") >= 3


def test_anchor_failing_on_a_later_call_leaves_the_cached_choice_unjudged(fresh_cache, clock):
    """An anchor that returned and then failed while a cached choice was confirmed leaves the
    choice unjudged, as in the search: kept, the anchor's error in ``failures``, not memoised."""
    autotune.choice_cache.put("toy.review50", {"case": "later"}, "native", {"aten": 0.02})
    calls: list[str] = []
    ch = _select("later", _anchor_fails(clock, "later", calls))
    assert ch.candidate.name == "native" and ch.from_cache
    assert "anchor ran out of memory" in ch.failures["aten"]
    assert _saved("later") == "native" and tuner._confirmed == {}


@pytest.mark.parametrize("budget_s", [None, 100.0], ids=["short", "long-calls"])
@pytest.mark.parametrize("how", ["call", "build"])
def test_a_fresh_winner_is_kept_when_the_anchor_fails_in_its_confirmation(
    fresh_cache, clock, monkeypatch, how, budget_s
):
    """The search's native winner whose confirmation fails on the anchor's side (its call
    raises, or it cannot be built again; it returned in the search) is kept unjudged and saved,
    the error in ``failures``, not memoised: before, the anchor's error rejected it and ATen was
    saved. Both confirmations: of short calls, and of long ones under a budget (ATen 0.1 s and
    the kernel 0.08 s a call: not 1.5x, so confirmed)."""
    confirming = [False]
    real = tuner._confirm_choice

    def flagged(*args, **kw):
        confirming[0] = True
        return real(*args, **kw)

    monkeypatch.setattr(tuner, "_confirm_choice", flagged)
    calls: list[str] = []
    long = budget_s is not None
    fast = _kernels(clock, 0.1 if long else 0.002, 0.08 if long else 0.001, calls)

    def make(c: Candidate):
        if not c.is_anchor:
            return fast(c)
        if confirming[0] and how == "build":
            raise RuntimeError("anchor failed in the confirmation")
        inner = fast(c)

        def f(x):
            if confirming[0]:
                raise RuntimeError("anchor failed in the confirmation")
            return inner(x)

        return f

    with config.override(autotune_reps=5):
        ch = _select("fresh", make, budget_s=budget_s)
    assert confirming[0] and ch.candidate.name == "native" and not ch.from_cache
    assert "anchor failed in the confirmation" in ch.failures["aten"]
    assert _saved("fresh") == "native" and tuner._confirmed == {}


def test_a_candidate_failing_in_its_confirmation_is_still_rejected(fresh_cache, clock):
    """The candidate's own error in the confirmation rejects it, in memory and on disk."""
    autotune.choice_cache.put("toy.review50", {"case": "broken"}, "native", {"aten": 0.02})
    calls: list[str] = []
    fast = _kernels(clock, 0.002, 0.001, calls)

    def make(c: Candidate):
        if c.is_anchor:
            return fast(c)

        def boom(x):
            raise RuntimeError("kernel library went away")

        return boom

    rejected = autotune.stats.rejected
    ch = _select("broken", make)
    assert ch.candidate.name == "aten" and _saved("broken") == "aten"
    assert autotune.stats.rejected == rejected + 1
    assert list(tuner._confirmed.values()) == [False]


# --- the GEMM templates' float constants ----------------------------------------------------------


def _f32(d: float) -> float:
    return struct.unpack("f", struct.pack("f", d))[0]


def _f32_bits(f: float) -> int:
    return struct.unpack("<I", struct.pack("<f", f))[0]


def _c_value(lit: str) -> float:
    """The float a C compiler makes of the float literal ``lit``: the float32 nearest to its exact
    value (ties to even), decimal or hexadecimal."""
    assert lit.endswith("f"), lit
    body = lit[:-1]
    exact = Fraction(float.fromhex(body)) if "0x" in body.lower() else Fraction(body)
    guess = _f32_bits(_f32(float(exact)))  # within one float32 of the nearest
    near = [
        struct.unpack("<f", struct.pack("<I", guess + k))[0]
        for k in (-1, 0, 1)
        if 0 <= guess + k < 2**32
    ]
    return min(near, key=lambda c: (abs(Fraction(c) - exact), _f32_bits(c) & 1))


@pytest.mark.parametrize(
    "d",
    [
        math.nextafter(1.0 + 2.0**-24, -math.inf),  # just below the midpoint 1 .. 1 + 2^-23
        math.nextafter(1.5 + 2.0**-24, -math.inf),
        math.nextafter(_f32(0.7) + 2.0**-25, math.inf),  # just above a midpoint
        math.nextafter(_f32(3.3) + 2.0**-23, math.inf),
        1.0,
        -0.5,
        0.0,
        4.05 * math.sqrt(2.0),
    ],
    ids=lambda d: repr(d),
)
def test_c_float_literal_is_the_nearest_float32(d):
    """A constant computed in double is emitted as the float32 nearest to it: before, the double
    printed with ten digits (``1.000000060e+00f`` for 1 + 2^-24 less a double ulp) was rounded
    again by the compiler, to the float32 on the other side of the midpoint (1 + 2^-23, not 1)."""
    lit = templates._c_float(d)
    assert _c_value(lit) == _f32(d) and math.copysign(1.0, _c_value(lit)) == math.copysign(1.0, d)
    assert float.fromhex(lit[:-1]) == _f32(d)  # the literal is that float32's exact value


def test_every_emitted_template_constant_is_the_intended_float32():
    """Every computed constant of the GEMM vocabulary (the GELU rational's coefficients and
    clamp, the piecewise GELU's tables, the doubled exp coefficients) is an exact literal of the
    float32 nearest to the double it was computed as."""
    t = templates
    sites = [
        (float(c.rstrip("f")) * 0.5 * math.sqrt(0.5) / 2.0**k, lit)
        for k, (c, lit) in enumerate(zip(t._ERF_P, t._GELU_P))
    ]
    sites += [
        (float(c.rstrip("f")) / 2.0**k, lit) for k, (c, lit) in enumerate(zip(t._ERF_Q, t._GELU_Q))
    ]
    sites.append((4.05 * math.sqrt(2.0), t._GELU_CLAMP))
    for table in (t._GELU_PHI, t._GELU_PHI4):
        lanes = t._gelu_phi_lanes(table)
        for i, row in enumerate(table.split("\n")[1:-1]):
            for j, c in enumerate(row.split()):
                sites.append((float(c), lanes[j][(i - t._GELU_PHI_K) % 32]))
    sites += [(2.0 * _f32(float(c.rstrip("f"))), t._twice(c)) for c in t._EXP2_E]
    assert len(sites) == 271
    for d, lit in sites:
        assert float.fromhex(lit[:-1]) == _f32(d) == _c_value(lit), (d, lit)
    vocab = t.vocabulary("avx512") + t.vocabulary("avx512", otag="bf16") + t.vocabulary("avx2")
    for _, lit in sites:
        if lit not in ("0x0p+0f", "0x1p+0f"):  # (also spelt so elsewhere)
            assert lit in vocab
