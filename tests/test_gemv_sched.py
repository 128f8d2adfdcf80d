"""GEMV row scheduling: rows claimed in chunks give the same bits as the static split.

Every kernel family (dense/decode, int8-activation FP4, lane-block and pair-split FP4, FP8 shift
decode) is built with the static per-thread split (``chunk=0``) and with small claims (1 KiB of
weights: many ragged claims, N not a multiple of the claim), and run on two threads; each output row is
computed by one thread in a fixed order either way, so the results must be identical, and within
the stated tolerance of the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.gemv_inputs import pack
from torchport import native
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import gemv_fp4_block_kernel, gemv_fp4_pair_kernel
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.kernels import gemv_i8_kernel, gemv_kernel
from torchport.lowp import NVFP4Tensor

pytestmark = pytest.mark.skipif(
    native.cpu_info().isa == "scalar", reason="the pair/shift kernels need AVX2"
)

N, K = 1003, 256  # N * K > the kernels' one-thread cut-off; N prime-ish, not a multiple of 8


def _kernels(family: str, fmt: str, chunk: int):
    isa = native.cpu_info().isa
    if family == "pair":
        return gemv_fp4_pair_kernel(fmt, isa, 512, chunk)
    if family == "block":
        return gemv_fp4_block_kernel(fmt, isa, 4096, chunk)
    if family == "i8":
        return gemv_i8_kernel(fmt, isa, 512, 0, chunk)
    if family == "shift":
        return gemv_fp8_shift_kernel(isa, 2048, chunk)
    return gemv_kernel(fmt, isa, 512, None, chunk)


CASES = [
    ("block", "nvfp4"),  # (the row loop is the same for mxfp4: one format keeps builds down)
    ("pair", "nvfp4"),
    ("pair", "mxfp4"),
    ("i8", "nvfp4"),
    ("shift", "fp8_e4m3"),
    ("plain", "bf16"),
    ("plain", "f32"),
    ("plain", "mxfp4"),
]


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_claimed_rows_match_static_split(family: str, fmt: str, rows: int) -> None:
    torch.manual_seed(rows)
    pw = pack(fmt, torch.randn(N, K) * 0.05)
    x = torch.randn(rows, K)
    bias = torch.randn(N)
    outs = []
    for chunk in (0, 1 << 10):
        out = torch.empty(rows, N)
        gops._launch(_kernels(family, fmt, chunk), x, pw, bias, out, 2)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = gops.gemv_reference(x.double(), gops.dequantize_packed(pw), bias).float()
    # int8 activations (FP4 families) quantize x per 32 elements: a looser, stated bound
    tol = 0.05 if family in ("block", "pair", "i8") else 1e-4
    err = (outs[1] - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item() + 1e-5, err


# K-block loops (activations over an L1 budget): a thread claims its next row range ahead so that
# the last row group of a range prefetches the next range's first rows. (family, fmt, K, rows):
# the FP4 lane-block kernel blocks from 20 KB of prepared activations (2 K bytes a row, one or two
# rows); the others get a 512-byte block budget (``xblock``).
KBLOCK_CASES = [
    ("block", "nvfp4", 10368, 1),
    ("block", "mxfp4", 5248, 2),
    ("dp", "bf16", 1088, 3),
    ("dp", "fp8_e4m3", 1088, 4),
    ("shift", "fp8_e4m3", 1088, 2),
    ("plain", "f32", 1088, 3),
    ("plain", "nvfp4", 1088, 5),
]


def _kblock_kernel(family: str, fmt: str, chunk: int):
    isa = native.cpu_info().isa
    if family == "block":
        return gemv_fp4_block_kernel(fmt, isa, 4096, chunk)
    if family == "dp":
        from torchport.gemv.bf16_kernel import gemv_bf16_dp_kernel

        return gemv_bf16_dp_kernel(isa, 2048, chunk, hint="NTA", xblock=512, weights=fmt)
    if family == "shift":
        return gemv_fp8_shift_kernel(isa, 2048, chunk, xblock=512)
    return gemv_kernel(fmt, isa, 512, None, chunk, xblock=512)


@pytest.mark.parametrize(("family", "fmt", "k", "rows"), KBLOCK_CASES)
def test_k_block_claims_ahead_match_static_split(family: str, fmt: str, k: int, rows: int) -> None:
    """Many small claims (1 KiB: one row group each, 67 rows: a ragged last claim), each taken one
    ahead by the K-block loop, cover every row once with the static split's bits."""
    if family in ("block", "dp") and native.cpu_info().isa != "avx512":
        pytest.skip("K blocks of the lane-block and vdpbf16ps kernels are AVX-512 only")
    if family == "dp" and not native.cpu_info().has_avx512_bf16:
        pytest.skip("the vdpbf16ps kernel needs AVX512-BF16")
    torch.manual_seed(k + rows)
    n = 67
    pw = pack(fmt, torch.randn(n, k) * 0.05)
    x = torch.randn(rows, k)
    if family == "dp":
        x = x.bfloat16().float()  # (the kernel's activations are bf16 values)
    bias = torch.randn(n)
    outs = []
    for chunk in (0, 1 << 10):
        out = torch.full((rows, n), float("nan"))
        gops._launch(_kblock_kernel(family, fmt, chunk), x, pw, bias, out, 2)
        outs.append(out)
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
    ref = gops.gemv_reference(x.double(), gops.dequantize_packed(pw), bias).float()
    tol = 0.05 if family == "block" else 1e-4
    err = (outs[1] - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item() + 1e-5, err


def test_step_rounds_to_whole_row_groups() -> None:
    """A claim bigger than N (the default 256 KiB here) still covers every row exactly once."""
    pw = pack("nvfp4", torch.randn(N, K))
    x = torch.randn(1, K)
    out = torch.full((1, N), float("nan"))
    gops._launch(gemv_fp4_pair_kernel("nvfp4", native.cpu_info().isa), x, pw, None, out, 2)
    assert not out.isnan().any()


def test_large_packed_weight_moves_to_huge_page_memory() -> None:
    """A >= 4 MiB weight's pack is 2 MiB-aligned, equal in value, and qdata is the same buffer."""
    from torchport import config
    from torchport.gemv.hugepages import HUGE
    from torchport.lowp.tensors import HUGEPAGE_MIN_BYTES

    w = torch.randn(2048, 4096) * 0.02  # NVFP4: 4 MiB of codes
    ref = NVFP4Tensor.from_float(w)
    codes, scales = ref.qdata.clone(), ref.scale.view(torch.uint8).clone()
    pw = ref.gemv_pack()
    assert pw.data.nbytes >= HUGEPAGE_MIN_BYTES
    assert pw.data.data_ptr() % HUGE == 0
    assert torch.equal(pw.data, codes) and torch.equal(pw.scales, scales)
    assert ref.qdata.data_ptr() == pw.data.data_ptr()  # one copy kept, not two
    with config.override(gemv_hugepages=False):
        plain = NVFP4Tensor.from_float(w).gemv_pack()
    x = torch.randn(1, 4096)
    assert torch.equal(gops.gemv_packed(x, pw), gops.gemv_packed(x, plain))
    assert torch.equal(ref.dequantize(), NVFP4Tensor.from_float(w).dequantize())


def test_hugepage_copy_keeps_values_shape_and_dtype() -> None:
    from torchport.gemv.hugepages import hugepage_copy

    for t in (torch.arange(7, dtype=torch.uint8), torch.randn(3, 5), torch.empty(0, 4)):
        c = hugepage_copy(t)
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t)


def test_tuned_plan_adapts_thread_count_with_identical_results() -> None:
    """A tuned problem runs through a ThreadAdaptive over (tuned threads, the alternative); every
    arm gives the same bits, so outputs do not depend on which launch a call took."""
    if native.num_threads() < 2:
        pytest.skip("needs two threads")
    pw = pack("nvfp4", torch.randn(1024, 512) * 0.05)  # 2**19 weights: tuned
    x = torch.randn(1, 512)
    first = gops.gemv_packed(x, pw)
    plan = gops.plan_for(pw, 1, gops._use_int8(pw, True))
    assert plan.adaptive is not None
    for _ in range(12):  # learning visits both arms
        out = gops.gemv_packed(x, pw)
        assert torch.equal(out, first)
    assert min(len(h) for h in plan.adaptive.history) >= 3
    route = gops.settle_route(x, pw, None)
    assert route is not None and torch.equal(route.run(x), first)


def test_settled_route_passes_one_call_in_four_to_the_adaptive() -> None:
    """A settled route with a thread-adaptive plan hands the adaptive one call in
    ROUTE_SAMPLE_EVERY (timed there) and runs its current launch directly between: the same bits
    every call."""
    if native.num_threads() < 2:
        pytest.skip("needs two threads")
    pw = pack("nvfp4", torch.randn(1024, 512) * 0.05)  # 2**19 weights: tuned, adaptive
    x = torch.randn(1, 512)
    first = gops.gemv_packed(x, pw)
    assert torch.equal(gops.gemv_packed(x, pw), first)  # settles the route
    ad = gops.plan_for(pw, 1, gops._use_int8(pw, True)).adaptive
    assert ad is not None and not ad._warm_switch  # (no warm-up calls: one call in four exactly)
    before = ad.calls
    every = gops.ROUTE_SAMPLE_EVERY
    for _ in range(4 * every):
        assert torch.equal(gops.gemv_packed(x, pw), first)
    assert ad.calls - before == 4


def test_settled_route_runs_the_adaptive_current_launch_between_samples(monkeypatch) -> None:
    """Between its sampled calls a settled route launches the thread count of the adaptive's
    current arm, whichever it is, and hands the adaptive exactly one call in ROUTE_SAMPLE_EVERY."""
    if native.num_threads() < 2:
        pytest.skip("needs two threads")
    pw = pack("nvfp4", torch.randn(1024, 512) * 0.05)
    x = torch.randn(1, 512)
    first = gops.gemv_packed(x, pw)
    plan = gops.plan_for(pw, 1, gops._use_int8(pw, True))
    ad, arms = plan.adaptive, plan.arm_threads
    assert ad is not None and sorted(arms) == [1, native.num_threads()], arms
    sampled: list[int] = []

    def sample(self: object, go: object) -> None:  # the adaptive's timed call, recorded
        sampled.append(ad.current)
        go(arms[ad.current])  # type: ignore[operator]

    monkeypatch.setattr(type(ad), "__call__", sample)
    used: list[int] = []
    real = plan.kernel._fn  # type: ignore[union-attr]

    def launch(*raw: object) -> int:  # the route's kernel: records the thread count passed
        used.append(int(raw[-1]))  # type: ignore[call-overload]
        return real(*raw)

    monkeypatch.setattr(plan.kernel, "_fn", launch)
    assert torch.equal(gops.gemv_packed(x, pw), first)  # settles the route on `launch`
    every = gops.ROUTE_SAMPLE_EVERY
    for arm in (1, 0, 1):
        ad.current = arm
        used.clear()
        sampled.clear()
        for _ in range(2 * every):
            assert torch.equal(gops.gemv_packed(x, pw), first)
        assert used == [arms[arm]] * (2 * every), (arm, used)
        assert sampled == [arm, arm], (arm, sampled)


def _fake_launches(monkeypatch):
    """A fake clock and a launch function that advances it by ``cost[threads]`` per call and
    records the thread counts used: (cost, used, go)."""
    from torchport.autotune import timing

    t = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: t[0])
    monkeypatch.setattr(native, "num_threads", lambda: 2)
    cost = {2: 1.9e-3, 1: 4.5e-3}
    used: list[int] = []

    def go(nt: int) -> None:
        t[0] += cost[nt]
        used.append(nt)

    return cost, used, go


def test_big_weight_returns_to_all_threads_within_a_few_calls(monkeypatch) -> None:
    """A >= 4 MiB weight's thread-adaptive plan (fake clock): a burst of load moves it to one
    thread; once the burst ends, a home probe every 4 calls brings it back to all threads within
    4 calls (before: one probe in 16 calls and a window of stale samples kept a benchmark's
    11 timed calls on the one-thread launch)."""
    from torchport.autotune import Candidate
    from torchport.gemm.adaptive import ThreadAdaptive

    cost, used, go = _fake_launches(monkeypatch)

    cand = Candidate("shift_p2048_t0", params=(("threads", 0),))
    plan = gops._with_adaptive(
        gops.LaunchPlan(cand, object(), 0), {cand.name: 1.9e-3, "shift_p2048_t1": 4.5e-3}, 45 << 20
    )
    ad = plan.adaptive
    assert isinstance(ad, ThreadAdaptive)
    for _ in range(8):
        plan.launch(go)
    assert used[-1] == 2 and ad.current == 0
    cost[2] = 9e-3  # a neighbour's burst: two-thread calls wait for a scheduler slice
    for _ in range(6):
        plan.launch(go)
    assert ad.current == 1
    cost[2] = 1.9e-3  # the burst is over
    used.clear()
    for _ in range(5):
        plan.launch(go)
    assert ad.current == 0 and used[-1] == 2
    used.clear()
    for _ in range(11):
        plan.launch(go)
    assert used.count(2) >= 10  # stays home (one probe of the other launch at most)
    # a small weight keeps the plain runner (no home probes)
    small = gops._with_adaptive(gops.LaunchPlan(cand, object(), 0), {}, 1 << 20)
    assert small.adaptive is not None and small.adaptive._home is None


def test_big_weight_skips_probes_that_cannot_win(monkeypatch) -> None:
    """On a quiet machine (fake clock) a >= 4 MiB weight's plan does not probe its one-thread
    launch (best 4.5 ms, not below the two-thread median 1.9 ms less the margin); a burst of
    load that slows the two-thread launch past that bound brings the probes back, and the
    runner moves to one thread. A small weight's runner keeps probing on schedule."""
    from torchport.autotune import Candidate

    cost, used, go = _fake_launches(monkeypatch)

    cand = Candidate("block_p4096_t0", params=(("threads", 0),))
    timings = {cand.name: 1.9e-3, "block_p4096_t1": 4.5e-3}
    plan = gops._with_adaptive(gops.LaunchPlan(cand, object(), 0), timings, 45 << 20)
    ad = plan.adaptive
    assert ad is not None and ad._probe_bound
    for _ in range(96):
        plan.launch(go)
    assert used.count(1) == 0 and ad.current == 0
    cost[2] = 9e-3  # a neighbour's burst
    for _ in range(24):
        plan.launch(go)
    assert ad.current == 1 and used.count(1) > 0
    small = gops._with_adaptive(gops.LaunchPlan(cand, object(), 0), timings, 1 << 20)
    assert small.adaptive is not None and not small.adaptive._probe_bound


def test_big_weight_probes_time_a_launch_warm(monkeypatch) -> None:
    """The first call after a change of launch pays one-off costs (here +0.8 ms: waking the
    idle OpenMP worker). A >= 4 MiB weight's plan times a probe on its second call (fake clock):
    after a burst of load it returns to the two-thread launch (1.0 ms warm, 1.8 ms cold) from the
    one-thread one (1.5 ms); a runner timing each probe's first call stays on one thread."""
    from torchport.autotune import Candidate, timing
    from torchport.gemm.adaptive import ThreadAdaptive

    t = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: t[0])
    monkeypatch.setattr(native, "num_threads", lambda: 2)
    cand = Candidate("shift_p8192_t0", params=(("threads", 0),))
    timings = {cand.name: 1.0e-3, "shift_p8192_t1": 1.5e-3}
    for warm in (True, False):
        cost = {2: 1.0e-3, 1: 1.5e-3}
        used: list[int] = [2]

        def go(nt: int, cost: dict[int, float] = cost, used: list[int] = used) -> None:
            t[0] += cost[nt] + (0.8e-3 if nt == 2 and used[-1] != 2 else 0.0)
            used.append(nt)

        plan = gops._with_adaptive(gops.LaunchPlan(cand, object(), 0), timings, 45 << 20)
        ad = plan.adaptive
        assert isinstance(ad, ThreadAdaptive) and ad._warm_switch
        ad._warm_switch = warm
        cost[2] = 9e-3  # a neighbour's burst
        for _ in range(8):
            plan.launch(go)
        assert ad.current == 1
        cost[2] = 1.0e-3  # the burst is over
        for _ in range(24):
            plan.launch(go)
        assert ad.current == (0 if warm else 1), warm
        if warm:
            assert used[-8:].count(2) >= 7  # back home, staying there


def test_big_weight_home_probes_back_off_under_lasting_load(monkeypatch) -> None:
    """Under lasting load each home probe that loses doubles the interval to the next (4, 8,
    16 calls, capped at the 16-call probe period), so few calls pay for a slow two-thread
    launch; the runner still returns home once the load is gone (fake clock)."""
    from torchport.autotune import Candidate, timing

    t = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: t[0])
    monkeypatch.setattr(native, "num_threads", lambda: 2)
    cand = Candidate("shift_p8192_t0", params=(("threads", 0),))
    cost = {2: 1.0e-3, 1: 1.5e-3}
    used: list[int] = []

    def go(nt: int) -> None:
        t[0] += cost[nt]
        used.append(nt)

    plan = gops._with_adaptive(
        gops.LaunchPlan(cand, object(), 0), {cand.name: 1.0e-3, "shift_p8192_t1": 1.5e-3}, 45 << 20
    )
    ad = plan.adaptive
    assert ad is not None
    cost[2] = 9e-3  # lasting load
    for _ in range(8):
        plan.launch(go)
    assert ad.current == 1
    used.clear()
    for _ in range(96):
        plan.launch(go)
    assert ad.current == 1 and ad._home_every == 16
    assert used.count(2) <= 16  # a probe every 4 calls would have been 48 (two calls each)
    cost[2] = 1.0e-3  # the load is gone
    for _ in range(18):
        plan.launch(go)
    assert ad.current == 0 and ad._home_every == 4


@pytest.mark.parametrize(
    "opts",
    [
        {"probe_every": 16, "sample_every": 2},
        {"home": 0, "probe_every": 16, "sample_every": 1},
        {"home": 1, "sample_every": 2, "probe_every": 8},
        {"home": 0, "home_probe_every": 4, "warm_switch": True, "probe_bound": True}
        | {"sample_every": 1, "probe_every": 16},
        {"home": 2, "home_probe_every": 4, "probe_every": 16, "sample_every": 1},
    ],
    ids=["plain", "home0", "home1_every2", "gemv_big", "home2_3arms"],
)
@pytest.mark.parametrize("seed", range(4))
def test_adaptive_steady_check_makes_the_full_pass_decisions(monkeypatch, opts, seed) -> None:
    """ThreadAdaptive's shortcut for a sample of the current launch (``steady_check``) takes the
    same decisions as the full pass: two runners fed the same random timings (fake clock, load
    phases that favour each launch in turn) run the same launches and switch alike."""
    import random

    from torchport.autotune import timing
    from torchport.gemm.adaptive import ThreadAdaptive

    t = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: t[0])
    rng = random.Random(seed)
    narms = 3 if opts.get("home") == 2 else 2
    base = [1.0e-3, 1.6e-3, 1.3e-3][:narms]
    runners, logs = [], []
    for fast in (True, False):
        log: list[int] = []
        arms = [(lambda go, i=i, log=log: go(i, log)) for i in range(narms)]
        ad = ThreadAdaptive(*arms, **opts)
        ad.steady_check = fast
        runners.append(ad)
        logs.append(log)
    costs: list[float] = []

    def go(i: int, log: list[int]) -> None:
        t[0] += costs[i]
        log.append(i)

    for phase in range(24):
        slow = phase % (narms + 1)  # the launch a neighbour's load slows (none: narms)
        extra = (0.1, 0.3, 6.0)[phase // (narms + 1) % 3]  # a little (home-margin cases) or a lot
        for _ in range(rng.randrange(3, 60)):
            costs[:] = [
                b * (rng.uniform(0.9, 1.1) + (extra if i == slow else 0.0))
                for i, b in enumerate(base)
            ]
            for ad in runners:
                ad(go)
        assert logs[0] == logs[1], (phase, logs[0][-20:], logs[1][-20:])
    assert runners[0].switches == runners[1].switches and runners[0].current == runners[1].current
    assert runners[0].switches > 0


def test_final_round_keeps_the_interleaved_winner_and_caches_it(fresh_cache, monkeypatch) -> None:
    """A fresh native plan goes through the autotuner's final round with FINAL_ROUND native
    candidates (the anchor not among them): the best median of the round is the plan's kernel,
    cached, with its ``final:`` medians."""
    from torchport import autotune
    from torchport.autotune import timing, tuner

    timed: list[int] = []
    rotations: list[int] = []

    def fake_interleaved(fns, arg_sets, **kw):
        timed.append(len(fns))
        rotations.append(len(arg_sets))
        return [2e-3, 1e-3, 3e-3][: len(fns)]  # the second-fastest by the search wins the round

    made: list[int] = []  # the tuner's rotation is the GEMV's own (weights read from memory)
    memory_sets = gops._memory_sets
    monkeypatch.setattr(
        gops, "_memory_sets", lambda args, **kw: made.append(1) or memory_sets(args, **kw)
    )

    monkeypatch.setattr(tuner, "FINAL_ROUND_SPREAD", 1e9)  # every native timed may enter
    monkeypatch.setattr(timing, "interleaved", fake_interleaved)
    monkeypatch.setattr(gops, "_PLANS", {})
    pw = pack("nvfp4", torch.randn(768, 512) * 0.05)  # 3 * 2**17 weights: tuned
    plan = gops.plan_for(pw, 1, gops._use_int8(pw, True))
    assert timed == [gops.FINAL_ROUND]
    assert made == [1] and rotations[0] > 1
    (entry,) = [e for e in autotune.choice_cache.entries().values() if e["op"] == "gemv"]
    assert entry["key"]["timing"] == "memory"
    finals = {k[6:]: v for k, v in entry["timings_s"].items() if k.startswith("final:")}
    assert len(finals) == gops.FINAL_ROUND and "aten_linear" not in finals
    assert plan.candidate.name == entry["choice"] == min(finals, key=finals.__getitem__)
    assert finals[plan.candidate.name] == 1e-3
