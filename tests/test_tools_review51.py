"""Review 51: the native graph tier's GEMM and GEMV calls run on torch's thread count at replay;
the GEMM tools' sizes are bounded and their kernel-config strings are usage errors when bad; the
tuner counts an overturned long-call rejection as a confirmation and keys its per-process memos
on the ISA level the ``isa`` setting resolves to. Nothing here is timed: the tools' parsers run,
their benchmarks do not, and the tuner runs fake kernels on a fake clock."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch
from conftest import FakeClock

from torchport import autotune, benchmarks, config, native
from torchport.autotune import ATEN, Candidate
from torchport.gemm.kernels import Config
from torchport.graphs import Graph

# --- item 1: native replays read the thread count when they run ------------------------------

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# torchport.gemm.templates.GEMM_F32_ENTRY_TYPEDEF / graphs.native_gemv.GEMV_ENTRY_TYPEDEF
_GEMM_T = ctypes.CFUNCTYPE(
    ctypes.c_int, _PTR, _I64, _PTR, _I64, _I64, _PTR, *[_I64] * 5, _PTR, _PTR, *[_I64] * 3, _PTR
)
_GEMV_T = ctypes.CFUNCTYPE(
    ctypes.c_int, _PTR, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_double, _PTR, _I64, _PTR, _I64, _I64
)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def gemm_threads(monkeypatch):
    """The ``nthreads`` argument of every GEMM-engine call a graph program makes, in order."""
    if not native.enabled():
        pytest.skip("no native toolchain")
    from torchport.gemm import kernels

    seen: list[int] = []
    real = kernels._function

    def recording(*args, **kw):
        fn = real(*args, **kw)

        def call(*a):
            seen.append(a[13])
            return fn(*a)

        return _GEMM_T(call)

    monkeypatch.setattr(kernels, "_function", recording)
    return seen


@pytest.mark.parametrize(("at_capture", "at_replay"), [(2, 1), (1, 2)], ids=lambda v: f"{v}t")
def test_native_gemm_runs_on_the_replay_thread_count(gemm_threads, threads, at_capture, at_replay):
    # the program passed the capture-time count: a replay after set_num_threads(1) ran two
    torch.manual_seed(0)
    a, b, c = torch.randn(5, 48), torch.randn(48, 40), torch.randn(40)
    threads(at_capture)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.addmm(c, a, b) @ b.t()
    assert g.tier == "native"
    threads(at_replay)
    gemm_threads.clear()
    a.copy_(torch.randn(5, 48))
    g.replay()
    assert gemm_threads == [at_replay, at_replay]
    torch.testing.assert_close(y, torch.addmm(c, a, b) @ b.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("plan_threads", [0, 1], ids=["all-threads-plan", "one-thread-plan"])
def test_native_gemv_plan_runs_on_the_replay_thread_count(monkeypatch, threads, plan_threads):
    """An all-threads GEMV plan (``threads`` 0) runs on the count at replay; a one-thread plan
    stays on one."""
    if not native.enabled():
        pytest.skip("no native toolchain")
    from torchport.gemv import gemv, ops

    seen: list[int] = []
    real = ops._native_plan

    class Recording:  # the plan's kernel, its calls' thread counts recorded
        def __init__(self, kernel) -> None:
            def call(*a):
                seen.append(a[11])
                return kernel._fn(*a)

            self._fn = _GEMV_T(call)

    def plan(*args, **kw):
        p = real(*args, **kw)
        return None if p is None else replace(p, kernel=Recording(p.kernel), threads=plan_threads)

    monkeypatch.setattr(ops, "_native_plan", plan)
    torch.manual_seed(1)
    w, bias, x = torch.randn(37, 64), torch.randn(37), torch.randn(2, 64)
    threads(2)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.ops.torchport.gemv_dense(x, w, bias)
    assert g.tier == "native"
    threads(1)
    seen.clear()
    g.replay()
    threads(2)
    g.replay()
    assert seen == ([1, 2] if plan_threads == 0 else [1, 1])
    monkeypatch.setattr(ops, "_native_plan", real)
    assert torch.equal(y, gemv(x, w, bias))


# --- item 2: the GEMM tools' bounds and config strings -----------------------------------------


BAD_OPTIONS = [
    ("gemm", ["--grid", "linear:8:4096:110080"], "--grid: must be <= 32768, got 110080 in"),
    ("gemm", ["--grid", "mlp:99999:768:3072"], "--grid: must be <= 32768, got 99999 in"),
    ("gemm_amx_ab", ["--shape", "2048x3072x76800"], "--shape: must be <= 32768, got 76800"),
    ("gemm_amx_ab", ["--mc", "1000000"], "--mc: must be <= 65536, got 1000000"),
    ("gemm_amx_ab", ["--cold", str(1 << 40)], f"--cold: must be <= {8 << 30}, got {1 << 40}"),
    ("gemm_amx_ab", ["--epilogue", "gelu:xx"], "--epilogue: unknown epilogue step 'gelu:xx'"),
    ("gemm_amx_ab", ["--epilogue", "out=f64"], "--epilogue: epilogue output dtype must be f32"),
    ("gemm_amx_ab", ["--variant", "m0_k32"], "--variant: must be >= 1, got 0 in 'm0_k32'"),
    ("gemm_amx_ab", ["--variant", "m64_k9999999"], "--variant: must be <= 65536, got 9999999"),
    ("gemm_amx_ab", ["--variant", "x=a"], "--variant: expected NAME=old>>new[|old>>new...] or"),
    ("gemm_amx_ab", ["--variant", "x=>>b"], "--variant: expected NAME=old>>new"),
    ("gemm_amx_ab", ["--variant", "plain"], "--variant: expected NAME=old>>new"),
    ("gemm_eo_ab", ["--d", "409600"], "--d: must be <= 32768, got 409600"),
    ("gemm_eo_ab", ["--cfgs", "4:24:8:64,,"], "--cfgs: expected a comma-separated list"),
    ("gemm_eo_ab", ["--cfgs", "4:x"], "--cfgs: expected mr:nr:mc[:pf:kc:ks:nt:dp], got '4:x'"),
    ("gemm_eo_ab", ["--cfgs", "4:24:8,4:24:q"], "--cfgs: mc: expected an integer, got 'q' in"),
    ("gemm_epilogue_ab", ["--m", "999999"], "--m: must be <= 32768, got 999999"),
    ("gemm_epilogue_ab", ["--cfg", "4:24"], "--cfg: expected mr:nr:mc[:pf:kc:ks:nt:dp], got"),
    ("gemm_epilogue_ab", ["--cfg", "4:24:1:0:0:1:1:0:9"], "--cfg: expected mr:nr:mc"),
    ("gemm_epilogue_ab", ["--cfg", "4:24:0"], "--cfg: mc: must be >= 1, got 0 in '4:24:0'"),
    ("gemm_epilogue_ab", ["--cfg", "4:24:8:0:0:99999"], "--cfg: ks: must be <= 64, got 99999"),
    ("gemm_epilogue_ab", ["--cfg", "5:24:8"], "--cfg: tile 5x24 is not built for isa"),
    ("gemm_epilogue_ab", ["--cfg", "4:24:8:0:64:2"], "--cfg: K blocking and K-split do not"),
    ("gemm_activation", ["--isa", "avx3"], "--isa: must be one of scalar"),
]


@pytest.mark.parametrize(
    "name, argv, message", BAD_OPTIONS, ids=[f"{n}{' '.join(a)}" for n, a, _ in BAD_OPTIONS]
)
def test_bad_gemm_tool_options_are_usage_errors(capsys, parse_only, name, argv, message):
    """Each was accepted (a size without an upper bound: a typo allocated until the memory ran
    out) or parsed after the parser (a ValueError, TypeError, KeyError, EpilogueError or
    InvalidCandidate traceback). Now: exit 2 naming the option and the value."""
    assert benchmarks.run_benchmark(name, argv) == 2
    assert f"error: argument {message}" in capsys.readouterr().err


def test_isa_the_cpu_lacks_is_a_usage_error(capsys, parse_only):
    """``bench gemm_activation --isa`` past the CPU's level built it and died of SIGILL."""
    from torchport.native.cpu import ISA_LEVELS

    above = ISA_LEVELS[ISA_LEVELS.index(native.cpu_info().max_isa) + 1 :]
    if not above:
        pytest.skip("this CPU runs every ISA level")
    assert benchmarks.run_benchmark("gemm_activation", ["--isa", above[0]]) == 2
    assert "--isa: must be one of scalar" in capsys.readouterr().err


def test_eo_ab_copies_beyond_the_bound_are_refused_before_anything_is_built(capsys, monkeypatch):
    from torchport.gemm import kernels

    def no_build(*a, **k):
        raise AssertionError("a launcher was built")

    monkeypatch.setattr(kernels, "launcher", no_build)
    assert benchmarks.run_benchmark("gemm_eo_ab", ["--copies", "100000"]) == 2
    err = capsys.readouterr().err
    assert "argument --copies: copies of a 11008x4096 bf16 weight must fit in 8 GiB" in err
    assert "(at most 95), got 100000" in err


@pytest.mark.parametrize(
    "name, argv, check",
    [
        ("gemm", ["--grid", "linear:8:32768:1"], lambda a: a.grid == [("linear", 8, 32768, 1)]),
        (
            "gemm_epilogue_ab",
            [],
            lambda a: (a.cfg, a.m, a.h) == (Config(4, 24, 32, 32, 0, 1, 1), 32, 4096),
        ),
        (
            "gemm_eo_ab",
            ["--cfgs", "4:24:8:64, 6:16:5:8"],
            lambda a: a.cfgs == [Config(4, 24, 8, 64), Config(6, 16, 5, 8)],
        ),
        ("gemm_eo_ab", [], lambda a: a.cfgs == [Config(4, 24, 8, 64), Config(4, 24, 8, 0)]),
        ("gemm_amx_ab", [], lambda a: a.epilogue.encode() == "bias_col:bf16" and a.mc == 256),
        (
            "gemm_amx_ab",
            ["--epilogue", "", "--variant", "m512_k256", "--variant", "ctl=", "--variant", "e=a>>"],
            lambda a: not a.epilogue.ops and a.variant == ["m512_k256", "ctl=", "e=a>>"],
        ),
        ("gemm_activation", [], lambda a: a.isa is None),
        ("gemm_activation", ["--isa", "scalar"], lambda a: a.isa == "scalar"),
    ],
)
def test_gemm_tool_defaults_and_good_values_parse(parse_only, name, argv, check):
    if name in ("gemm_epilogue_ab", "gemm_eo_ab") and native.cpu_info().isa == "scalar":
        pytest.skip("the default tiles are AVX2/AVX-512 ones")
    with pytest.raises(parse_only) as e:
        benchmarks.run_benchmark(name, argv)
    assert check(e.value.args[0])


# --- item 3: the tuner's counts and memo keys ---------------------------------------------------

PAIR = [Candidate("aten", ATEN), Candidate("native")]


def _kernels(clock: FakeClock, aten_s, native_s, calls: list[str]):
    """Fake kernels; ``aten_s``/``native_s`` give each one's seconds by its call number."""
    made: dict[str, object] = {}

    def make(c: Candidate):
        if c.name not in made:  # one callable per candidate: call numbers span the phases
            cost, n = (aten_s if c.is_anchor else native_s), [0]

            def f(x):
                clock.t += cost(n[0])
                n[0] += 1
                calls.append(c.name)
                return x * 2

            made[c.name] = f
        return made[c.name]

    return make


def _select(case: str, make, **kw):
    return autotune.select(
        "toy.review51",
        {"case": case},
        PAIR,
        make,
        lambda: (torch.ones(4),),
        cold=False,
        check=torch.equal,
        confirm=True,
        **kw,
    )


def test_overturned_long_call_rejection_counts_as_confirmed(fresh_cache, clock):
    """Long calls: the confirmation's one round is slowed by a burst on the native kernel and
    rejects it, then the fastest-call verdict keeps it. ``stats.rejected`` counted the
    rejection the verdict overturned (and ``confirmed`` missed the kept kernel)."""
    calls: list[str] = []
    # ATen 0.4 s a call; native 0.3 s, but 0.5 s through its confirmation (calls 2 and up)
    make = _kernels(clock, lambda i: 0.4, lambda i: 0.3 if i < 2 else 0.5, calls)
    before = (autotune.stats.confirmed, autotune.stats.rejected)
    with config.override(autotune_reps=100, autotune_noise=0.03):
        ch = _select("long-burst", make, budget_s=0.3)
    assert ch.candidate.name == "native" and ch.timings_s["confirm:native"] == pytest.approx(0.5)
    assert (autotune.stats.confirmed - before[0], autotune.stats.rejected - before[1]) == (1, 0)


def test_long_call_rejection_that_stands_is_counted_once(fresh_cache, clock):
    """The other side: ATen's search call was slowed, its confirmation shows it faster; the
    verdict agrees with the rejection, which is counted (once)."""
    make = _kernels(clock, lambda i: 0.44 if i < 2 else 0.28, lambda i: 0.3, [])
    before = (autotune.stats.confirmed, autotune.stats.rejected)
    with config.override(autotune_reps=100, autotune_noise=0.03):
        ch = _select("long-anchor-burst", make, budget_s=0.3)
    assert ch.candidate.name == "aten"
    assert (autotune.stats.confirmed - before[0], autotune.stats.rejected - before[1]) == (0, 1)


def _same_level_settings() -> list[str]:
    """Spellings of the ISA level "auto" resolves to here: that level, and any level above the
    hardware's (capped to it)."""
    from torchport.native.cpu import ISA_LEVELS

    hw = native.cpu_info().max_isa
    return [hw, *ISA_LEVELS[ISA_LEVELS.index(hw) + 1 :]]


@pytest.mark.parametrize("setting", _same_level_settings())
def test_cached_choice_is_confirmed_once_per_isa_level(fresh_cache, clock, setting):
    """``isa`` "auto" and the level it resolves to (one entry of the choice cache) confirmed the
    cached choice once each: the memo was keyed on the raw setting."""
    autotune.choice_cache.put("toy.review51", {"case": "level"}, "native", {"aten": 0.02})
    calls: list[str] = []
    with config.override(isa="auto"):
        first = _select("level", _kernels(clock, lambda i: 0.002, lambda i: 0.001, calls))
    assert first.candidate.name == "native" and calls.count("native") >= 3  # confirmed
    calls.clear()
    with config.override(isa=setting):
        again = _select("level", _kernels(clock, lambda i: 0.002, lambda i: 0.001, calls))
    assert again.candidate.name == "native" and again.from_cache and calls == []
    # a lower level is another entry and another verdict (as before)
    if setting != "scalar":
        with config.override(isa="scalar"):
            autotune.choice_cache.put("toy.review51", {"case": "level"}, "native", {"aten": 0.02})
            _select("level", _kernels(clock, lambda i: 0.002, lambda i: 0.001, calls))
        assert calls.count("native") >= 3


@pytest.mark.parametrize("setting", _same_level_settings())
def test_replaced_choice_is_not_served_from_the_memo_of_another_spelling(fresh_cache, setting):
    """A choice replaced under ``isa`` "auto" was still served, from the lookup memo, under the
    setting naming the level "auto" resolves to (``put`` dropped only its own spelling's memo)."""
    cache, key = autotune.choice_cache, {"case": "stale"}
    with config.override(isa=setting):
        cache.put("toy.review51", key, "native", {})
        assert cache.get("toy.review51", key)["choice"] == "native"  # (memoised)
    with config.override(isa="auto"):
        cache.put("toy.review51", key, "aten", {})
    with config.override(isa=setting):
        assert cache.get("toy.review51", key)["choice"] == "aten"
