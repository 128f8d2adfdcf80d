"""Small-kernel batching: the rewritten graph equals the original on random graphs."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from torchport import config
from torchport.compiler import TorchportBackend, last_report
from torchport.compiler.batching import BATCHING, DerivedInput, derive


class RandomHeads(nn.Module):
    """A random mix of parallel linears on shared inputs, per-head linears and small unary ops."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.d = rng.choice([1, 5, 16])
        self.n_shared = rng.randint(0, 4)
        self.n_heads = rng.randint(0, 4)
        self.bias = rng.random() < 0.5
        outs = [rng.choice([1, 3, 8]) for _ in range(self.n_shared)]
        self.shared = nn.ModuleList(nn.Linear(self.d, o, bias=self.bias) for o in outs)
        self.heads = nn.ModuleList(
            nn.Linear(self.d, 4, bias=self.bias) for _ in range(self.n_heads)
        )
        self.unary = rng.choice([torch.exp, torch.tanh, torch.sigmoid, torch.sin])

    def forward(self, x: torch.Tensor, hs: list[torch.Tensor]) -> torch.Tensor:
        outs = [lin(x) for lin in self.shared]
        outs += [lin(h) for lin, h in zip(self.heads, hs, strict=True)]
        outs = [self.unary(o) for o in outs]
        outs.append(F.relu(x))
        return torch.cat([o.reshape(-1) for o in outs])


@pytest.fixture(autouse=True)
def _always_batch():
    # autotune off: the first non-anchor candidate (batched) is taken, so every rule is exercised
    with config.override(autotune=False):
        yield


@pytest.mark.parametrize("seed", range(8))
def test_batching_random_graphs_match_eager(seed: int) -> None:
    torch.manual_seed(seed)
    m = RandomHeads(seed)
    rows = random.Random(seed).choice([0, 1, 3])
    x = torch.randn(rows, m.d)
    hs = [torch.randn(rows, m.d) for _ in range(m.n_heads)]
    backend = TorchportBackend(inner="eager", passes=[], batching=True, verify=True)
    fn = torch.compile(m, backend=backend, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(fn(x, hs), m(x, hs), rtol=1e-5, atol=1e-5)
    rep = last_report()
    assert rep is not None
    expect_linear = m.n_shared >= 2
    assert (rep.rule_counts.get(BATCHING.rules[0].name, 0) > 0) == expect_linear


def test_batching_training_gradients_match() -> None:
    torch.manual_seed(0)
    m = RandomHeads(3)
    m.n_shared, m.n_heads = 3, 0
    m.shared = nn.ModuleList(nn.Linear(m.d, o) for o in (2, 3, 4))
    m.heads = nn.ModuleList()
    x = torch.randn(5, m.d)
    ref = m(x, []).square().sum()
    ref_g = torch.autograd.grad(ref, list(m.parameters()))
    fn = torch.compile(m, backend=TorchportBackend(inner="eager", passes=[], batching=True))
    out = fn(x, []).square().sum()
    got_g = torch.autograd.grad(out, list(m.parameters()))
    assert last_report().rule_counts  # type: ignore[union-attr]
    torch.testing.assert_close(out, ref)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_derived_weights_cache_follows_in_place_updates() -> None:
    w1, w2 = torch.randn(2, 3), torch.randn(4, 3)
    d = DerivedInput("w", "cat", (0, 1))
    with torch.no_grad():
        first = derive(d, [w1, w2])
        assert derive(d, [w1, w2]) is first  # unchanged weights: reused
        w1.add_(1.0)  # an optimizer step bumps the version counter
        second = derive(d, [w1, w2])
    assert second is not first
    torch.testing.assert_close(second, torch.cat([w1, w2]))


def test_derived_weights_cache_follows_a_fused_optimizer_step() -> None:
    # Adam(fused=True) updates its parameters without bumping their version counters: the
    # cached cat of the weights from before the step was served after it
    w1, w2 = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4, 3))
    d = DerivedInput("w", "cat", (0, 1))
    opt = torch.optim.Adam([w1, w2], lr=0.1, fused=True)
    with torch.no_grad():
        first = derive(d, [w1, w2])
    w1.grad, w2.grad = torch.ones_like(w1), torch.ones_like(w2)
    version = w1._version
    opt.step()
    assert w1._version == version  # the step bypassed the version counter
    with torch.no_grad():
        second = derive(d, [w1, w2])
    assert second is not first
    torch.testing.assert_close(second, torch.cat([w1, w2]))


def test_derived_weights_cache_keeps_frozen_weights_over_an_optimizer_step() -> None:
    # the step hook cleared every derived weight: the cat of frozen weights (no gradient, left
    # alone by the optimiser) was rebuilt after every step; a stepped one's still is
    frozen = [nn.Parameter(torch.randn(2, 3), requires_grad=False) for _ in range(2)]
    trained = [nn.Parameter(torch.randn(2, 3)) for _ in range(2)]
    d = DerivedInput("w", "cat", (0, 1))
    opt = torch.optim.Adam([*frozen, *trained], lr=0.1, fused=True)
    with torch.no_grad():
        cat_frozen, cat_trained = derive(d, frozen), derive(d, trained)
    for p in trained:
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        assert derive(d, frozen) is cat_frozen
        again = derive(d, trained)
    assert again is not cat_trained
    torch.testing.assert_close(again, torch.cat(trained))


def test_derived_weights_cache_misses_a_new_tensor_at_a_reused_address() -> None:
    # fresh weights per call: the allocator may put a new tensor where a freed one was, with the
    # same address, shape and version counter (0); numpy memory rewritten under a new tensor
    # object stands in for that reuse deterministically
    np = pytest.importorskip("numpy")
    buf = np.arange(6, dtype=np.float32).reshape(2, 3)
    w2 = torch.randn(4, 3)
    d = DerivedInput("w", "cat", (0, 1))
    with torch.no_grad():
        derive(d, [torch.from_numpy(buf), w2])  # the first tensor is freed after this call
        buf[:] = -1.0
        again = derive(d, [torch.from_numpy(buf), w2])
    torch.testing.assert_close(again, torch.cat([torch.from_numpy(buf), w2]))


def _eager_batched(fn: Callable[..., object]) -> Callable[..., object]:
    torch._dynamo.reset()
    return torch.compile(fn, backend=TorchportBackend(inner="eager", passes=[], batching=True))


def test_batching_keeps_a_member_after_an_in_place_update_of_its_input() -> None:
    def f(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = a + 1
        y1 = torch.exp(b)
        b.mul_(2)  # the second exp reads the updated b
        return y1, torch.exp(b)

    a = torch.randn(8)
    for got, want in zip(_eager_batched(f)(a), f(a), strict=True):  # type: ignore[call-overload]
        torch.testing.assert_close(got, want)


def test_batching_does_not_hoist_a_weight_updated_in_the_graph() -> None:
    def f(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w1.mul_(2)  # the concatenated weight must see this update
        return F.linear(x, w1), F.linear(x, w2)

    x, w1, w2 = torch.randn(3, 4), torch.randn(5, 4), torch.randn(6, 4)
    got = _eager_batched(f)(x, w1.clone(), w2)
    want = f(x, w1.clone(), w2)
    for g, w in zip(got, want, strict=True):  # type: ignore[call-overload]
        torch.testing.assert_close(g, w)


def test_batching_leaves_small_complex_unary_ops_to_the_complex_decomposition() -> None:
    # _foreach_exp of complex tensors has no real decomposition: the compile used to fail
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.exp(a), torch.exp(b)

    a, b = torch.randn(4, dtype=torch.complex64), torch.randn(5, dtype=torch.complex64)
    torch._dynamo.reset()
    got = torch.compile(f, backend=TorchportBackend(inner="eager", batching=True))(a, b)
    for g, w in zip(got, f(a, b), strict=True):
        torch.testing.assert_close(g, w)


def test_derived_weights_of_inference_tensors() -> None:
    # weights made under inference_mode have no version counter: reading it raised
    d = DerivedInput("w", "cat", (0, 1))
    with torch.inference_mode():
        w1, w2 = torch.randn(2, 3), torch.randn(4, 3)
        torch.testing.assert_close(derive(d, [w1, w2]), torch.cat([w1, w2]))
        w1.add_(1.0)  # allowed in inference mode, and no counter records it
        torch.testing.assert_close(derive(d, [w1, w2]), torch.cat([w1, w2]))


def test_per_head_rule_rewrites_to_bmm_and_verifies() -> None:
    class PerHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(6, 5) for _ in range(4))

        def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
            return [lin(x) for lin, x in zip(self.lins, xs, strict=True)]

    m = PerHead()
    xs = [torch.randn(2, 3, 6) for _ in range(4)]
    fn = torch.compile(
        m,
        backend=TorchportBackend(inner="eager", passes=[], batching=True, verify=True),
        dynamic=False,
    )
    with torch.no_grad():
        for a, b in zip(fn(xs), m(xs), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert last_report().rule_counts.get(BATCHING.rules[1].name) == 1  # type: ignore[union-attr]


def test_no_gain_means_no_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph is batched only when the decision (compiled graph against compiled graph) says so."""
    import torchport.compiler.batching as batching

    seen: list[dict[str, object]] = []

    def never(key: dict[str, object], build: Callable, inputs: object, decided: Callable) -> object:
        seen.append(key)
        decided(False, {})
        return build(False)

    monkeypatch.setattr(batching, "batching_runner", never)
    torch._dynamo.reset()  # no cached graph of this module from an earlier test
    m = RandomHeads(5)  # two shared linears, two per-head linears
    x, hs = torch.randn(3, m.d), [torch.randn(3, m.d) for _ in range(m.n_heads)]
    fn = torch.compile(
        m, backend=TorchportBackend(inner="eager", passes=[], batching=True), dynamic=False
    )
    with torch.no_grad():
        torch.testing.assert_close(fn(x, hs), m(x, hs))
    rep = last_report()
    assert rep is not None and rep.rule_counts == {} and rep.batching == "unbatched"
    assert len(seen) == 1 and seen[0]["inner"] == "eager"


def _sleeper(seconds: float, calls: list[str], name: str) -> Callable:
    def fn(*args: torch.Tensor) -> torch.Tensor:
        calls.append(name)
        time.sleep(seconds)
        return args[0] * 2

    return fn


def _runner(key: dict, faster: str, built: list[bool], calls: list[str], got: list) -> Callable:
    from torchport.compiler.batching import batching_runner

    def build(batched: bool) -> Callable:
        built.append(batched)
        fast = batched == (faster == "batched")
        return _sleeper(0.0 if fast else 0.02, calls, "batched" if batched else "unbatched")

    return batching_runner(key, build, [torch.ones(3)], lambda use, t: got.append((use, t)))


@pytest.mark.parametrize("faster", ["batched", "unbatched"])
def test_batching_runner_times_real_calls_and_settles(fresh_cache, faster: str) -> None:
    from torchport.autotune import stats

    key = {"graph": f"test-{faster}", "inputs": [], "grad": False, "inner": "eager"}
    built: list[bool] = []
    calls: list[str] = []
    got: list = []
    before = stats.tuned
    with config.override(autotune=True, autotune_reps=3):
        fn = _runner(key, faster, built, calls, got)
        assert sorted(built) == [False, True] and got == []  # both compiled, not decided yet
        n = 0
        while not got:
            torch.testing.assert_close(fn(torch.ones(3)), torch.full((3,), 2.0))
            n += 1
            assert n < 100
        use, timings = got[0]
        assert use == (faster == "batched") and stats.tuned == before + 1
        assert timings["unbatched" if faster == "batched" else "batched"] >= 0.02
        calls.clear()
        fn(torch.ones(3))
        assert calls == [faster]  # settled: only the winner runs
        built.clear()
        got.clear()
        _runner(key, faster, built, calls, got)  # cached: only the chosen form is compiled
    assert built == [faster == "batched"] and got[0][0] == use and stats.tuned == before + 1


def test_batching_runner_rejects_a_form_whose_outputs_differ(fresh_cache) -> None:
    from torchport.compiler.batching import batching_runner

    got: list = []

    def build(batched: bool) -> Callable:
        return (lambda x: x + 1) if batched else (lambda x: x)

    with config.override(autotune=True, autotune_reps=3):
        fn = batching_runner({"graph": "differ"}, build, [torch.ones(3)], lambda *a: got.append(a))
    assert got == [(False, {})] and torch.equal(fn(torch.ones(2)), torch.ones(2))


def test_batching_runner_checks_on_copies_not_the_callers_inputs(fresh_cache) -> None:
    from torchport.compiler.batching import batching_runner

    def build(batched: bool) -> Callable:
        def fn(x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)  # a graph that mutates its input (e.g. a running statistic)
            return x.clone()

        return fn

    x = torch.zeros(4)
    with config.override(autotune=True, autotune_reps=3):
        batching_runner({"graph": "mutates"}, build, [x], lambda *a: None)
    assert torch.equal(x, torch.zeros(4))


def test_batching_decided_under_inductor_matches_eager(fresh_cache) -> None:
    """The default path: both forms compiled by Inductor, timed on real calls, the winner runs."""
    torch._dynamo.reset()
    m = RandomHeads(5)
    x, hs = torch.randn(3, m.d), [torch.randn(3, m.d) for _ in range(m.n_heads)]
    fn = torch.compile(m, backend=TorchportBackend(passes=[], batching=True), dynamic=False)
    with config.override(autotune=True, autotune_reps=3), torch.no_grad():
        for _ in range(12):
            torch.testing.assert_close(fn(x, hs), m(x, hs), rtol=1e-5, atol=1e-5)
    rep = last_report()
    assert rep is not None and rep.batching in ("batched", "unbatched")
    assert set(rep.batching_timings_s) == {"batched", "unbatched"}
    assert bool(rep.rule_counts) == (rep.batching == "batched")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), rows=st.sampled_from([0, 1, 2, 7]), train=st.booleans())
def test_batching_equivalence_property(seed: int, rows: int, train: bool) -> None:
    """Hypothesis over random graphs: the batched graph (verified after every rewrite) computes
    what eager does, forward and (when training) gradients."""
    torch._dynamo.reset()  # every example compiles afresh (no recompile-limit fallback to eager)
    torch.manual_seed(seed)
    m = RandomHeads(seed)
    x = torch.randn(rows, m.d)
    hs = [torch.randn(rows, m.d) for _ in range(m.n_heads)]
    backend = TorchportBackend(inner="eager", passes=[], batching=True, verify=True)
    fn = torch.compile(m, backend=backend, dynamic=False)
    with torch.set_grad_enabled(train):
        got, want = fn(x, hs), m(x, hs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if train and got.requires_grad:
            params = list(m.parameters())
            g1 = torch.autograd.grad(got.square().sum(), params, allow_unused=True)
            g2 = torch.autograd.grad(want.square().sum(), params, allow_unused=True)
            for a, b in zip(g1, g2, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rep = last_report()
    assert rep is not None and rep.batching in ("batched", "no batchable group")


def test_batching_runner_check_leaves_the_random_stream_alone(fresh_cache) -> None:
    """The forms' agreement check draws no random numbers from the caller's stream (a graph with
    dropout then sees eager's stream), and both forms draw the same numbers, so they agree."""
    from torchport.compiler.batching import batching_runner

    got: list = []

    def build(batched: bool) -> Callable:
        return lambda x: x + torch.rand(x.shape)

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with config.override(autotune=True, autotune_reps=3):
        batching_runner({"graph": "rng"}, build, [torch.ones(3)], lambda *a: got.append(a))
    assert torch.equal(torch.rand(3), expected)
    assert got == []  # the check passed: the forms drew the same numbers, timing follows


def test_batching_runner_check_restores_cuda_generators_only_when_initialised(
    fresh_cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check restored only the CPU generator: a graph drawing on CUDA advanced the caller's
    CUDA stream. The CUDA generators are restored when CUDA is initialised, and CUDA is never
    initialised by the check (stand-ins here: the test machine has no GPU)."""
    from torchport.compiler.batching import batching_runner

    state = {"cuda": 0}
    sets: list[list[int]] = []

    def build(batched: bool) -> Callable:
        def fn(x: torch.Tensor) -> torch.Tensor:
            state["cuda"] += 1  # a draw from the (stand-in) CUDA generator
            return x + state["cuda"] * 0

        return fn

    with config.override(autotune=True, autotune_reps=3):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("initialised"))
        batching_runner({"graph": "cuda-off"}, build, [torch.ones(3)], lambda *a: None)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [state["cuda"]])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: sets.append(list(s)))
        state["cuda"] = 7
        batching_runner({"graph": "cuda-on"}, build, [torch.ones(3)], lambda *a: None)
    assert sets and all(s == [7] for s in sets)  # restored to the state before the check
