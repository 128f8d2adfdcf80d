"""torchport.graphs.Graph: capture/replay equality with eager, switch/while inside, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport import config
from torchport.graphs import CaptureError, Graph, GraphError, MemPool


def _model(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = F.gelu(F.linear(x, w, b))
    h = h.softmax(-1) * x.sum(-1, keepdim=True)
    h = torch.cat([h[:, :3], h[:, 3:] * 2], dim=1)
    return F.layer_norm(h, h.shape[-1:]).transpose(0, 1).contiguous()


@pytest.mark.parametrize("rows", [1, 7])  # each case compiles its own program
@pytest.mark.parametrize("cols", [4, 13, 64])
def test_replay_matches_eager_on_new_inputs(rows: int, cols: int) -> None:
    torch.manual_seed(rows * 100 + cols)
    x = torch.randn(rows, cols)
    w, b = torch.randn(cols, cols), torch.randn(cols)
    g = Graph()
    with torch.no_grad(), g:
        y = _model(x, w, b)
    for _ in range(3):
        x.copy_(torch.randn(rows, cols))
        g.replay()
        # native tier: float32 in another summation order (GEMM over K, sums, softmax)
        torch.testing.assert_close(y, _model(x, w, b), rtol=1e-4, atol=1e-4)


def test_in_place_updates_of_static_buffers_replay() -> None:
    cache = torch.zeros(4, 3)
    pos = torch.tensor([0])
    x = torch.randn(1, 3)
    g = Graph()
    with g:
        cache.index_copy_(0, pos, x)
        pos.add_(1)
    torch.testing.assert_close(cache[0], x[0])
    for k in range(1, 4):
        x.copy_(torch.full((1, 3), float(k)))
        g.replay()
        torch.testing.assert_close(cache[k], x[0])
    assert int(pos) == 4


def test_switch_and_while_loop_inside_capture_follow_data() -> None:
    n = torch.tensor(0)
    sel = torch.tensor(0)
    a0 = torch.randn(5)
    branches = [lambda t: t + 1, lambda t: t * 2, lambda t: t - 3]

    def body(i: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, torchport.switch((i + sel) % 3, branches, (a,))

    g = Graph()
    with g:
        i_out, a_out = torchport.while_loop(lambda i, a: i < n, body, (torch.tensor(0), a0))
        picked = torchport.switch(sel, branches, (a_out,))
    for trips in (0, 1, 4, 9):
        for s in (0, 2, 5):
            n.fill_(trips)
            sel.fill_(s)
            g.replay()
            ref = a0.clone()
            for j in range(trips):
                ref = branches[(j + s) % 3](ref)
            assert int(i_out) == trips
            torch.testing.assert_close(a_out, ref)
            torch.testing.assert_close(picked, branches[min(s, 2)](ref))


def test_item_is_rejected_at_capture_naming_the_op() -> None:
    x = torch.randn(3)
    g = Graph()
    with pytest.raises(CaptureError, match=r"aten\._local_scalar_dense"), g:
        if (x.sum() > 0).item():
            x.add_(1)
    g2 = Graph()  # the failed capture left no recorder behind
    with config.override(native=False), g2:
        y = x * 2
    g2.replay()
    torch.testing.assert_close(y, x * 2)


def test_explicit_generator_is_rejected() -> None:
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(CaptureError, match=r"torch\.Generator"), Graph():
        torch.rand(3, generator=gen)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: torch.nonzero(x),
        lambda x: x[x > 0],
        lambda x: torch.unique(x),
        lambda x: torch.repeat_interleave(x.long()),
        # out= overloads torch leaves untagged (index.Tensor_out was recorded, its shape frozen)
        lambda x: torch.ops.aten.index.Tensor_out(x, [x > 0], out=torch.empty(0)),
        lambda x: torch.ops.aten.bincount.out(x.long(), out=torch.empty(0, dtype=torch.long)),
        lambda x: torch.ops.aten.unique_consecutive.out(
            x, out0=torch.empty(0), out1=torch.empty(0, dtype=torch.long), out2=torch.empty(0)
        ),
        lambda x: torch.ops.aten.repeat_interleave.Tensor_out(
            x.long(), out=torch.empty(0, dtype=torch.long)
        ),
    ],
    ids=[
        "nonzero",
        "bool_mask_index",
        "unique",
        "repeat_interleave",
        "index_out",
        "bincount_out",
        "unique_consecutive_out",
        "repeat_interleave_out",
    ],
)
@pytest.mark.parametrize("mode", ["global", "relaxed"])
def test_data_dependent_output_shape_is_rejected(op, mode: str) -> None:  # type: ignore[no-untyped-def]
    # Recorded, nonzero's 3 capture-time rows came back from a replay finding 1 nonzero as 3
    # copies of that row (the result broadcast into the capture-time buffer).
    x = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0])
    g = Graph(capture_error_mode=mode)  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match="shape depends on the input values"), g:
        op(x)


def test_integer_index_and_sized_repeat_interleave_stay_capturable() -> None:
    x, idx, reps = torch.randn(5), torch.tensor([0, 3]), torch.tensor([1, 2, 0])
    g = Graph()
    with config.override(native=False), g:
        y = x[idx]
        z = torch.repeat_interleave(reps, output_size=3)
        w = torch.ops.aten.index.Tensor_out(x, [idx], out=torch.empty(2))
    x.copy_(torch.arange(5.0))
    reps.copy_(torch.tensor([0, 0, 3]))
    g.replay()
    torch.testing.assert_close(y, torch.tensor([0.0, 3.0]))
    torch.testing.assert_close(z, torch.tensor([2, 2, 2]))
    torch.testing.assert_close(w, torch.tensor([0.0, 3.0]))


def test_int_carried_in_captured_loop_is_rejected() -> None:
    with pytest.raises(torchport.control.WhileLoopError, match="0-dim int64 tensor"), Graph():
        torchport.while_loop(lambda n, x: n < 3, lambda n, x: (n + 1, x), (0, torch.ones(1)))


def test_captured_loop_with_a_float_condition_names_it() -> None:
    # Formatting the error with the tensor's repr read its value, which the capture bans: the
    # user got a CaptureError about Tensor.item() instead of the WhileLoopError.
    match = r"bool tensor, got Tensor\(\) torch.float32"
    with pytest.raises(torchport.control.WhileLoopError, match=match), Graph():
        torchport.while_loop(lambda x: x.sum(), lambda x: x + 1, (torch.ones(3),))


def test_captured_loop_mutating_a_carried_value_is_refused() -> None:
    # Eager mul_ updated the caller's x; the captured loop ran on a copy and left x unchanged.
    def body(i: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a.mul_(2)
        return i + 1, a

    x = torch.ones(3)
    match = r"modifies carried value 1 \(Tensor\(3,\) torch.float32\) in place"
    with pytest.raises(torchport.control.WhileLoopError, match=match), Graph():
        torchport.while_loop(lambda i, a: i < 2, body, (torch.tensor(0), x))


@pytest.fixture
def torchscript_tier():  # type: ignore[no-untyped-def]
    """Force the TorchScript tier (no C compile) for tests about Graph's state machine."""
    with config.override(native=False):
        yield


def test_state_errors_and_reset(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    g = Graph()
    with pytest.raises(GraphError, match="nothing captured"):
        g.replay()
    with pytest.raises(GraphError, match="no capture in progress"):
        g.capture_end()
    x = torch.ones(2)
    g.capture_begin()
    with pytest.raises(GraphError, match="already in progress"):
        g.capture_begin()
    y = x + 1
    g.capture_end()
    with pytest.raises(GraphError, match="reset"):
        g.capture_begin()
    g.reset()
    with g:
        z = x * 3
    x.fill_(2)
    g.replay()
    torch.testing.assert_close(z, torch.full((2,), 6.0))
    torch.testing.assert_close(y, torch.full((2,), 2.0))  # no longer replayed
    with pytest.raises(GraphError, match="MemPool"):
        Graph(pool=3)  # type: ignore[arg-type]
    with pytest.raises(GraphError, match="capture_error_mode"):
        Graph(capture_error_mode="strict")  # type: ignore[arg-type]


def test_outputs_live_in_shared_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pool = MemPool()
    x = torch.randn(16, 16)
    g1 = Graph(pool=pool)
    with config.override(native=False), g1:
        y1 = x @ x
    g2 = Graph(pool=g1.pool())
    with config.override(native=False), g2:
        y2 = y1.relu()
    assert g1.tier == g2.tier == "torchscript"
    assert g2.pool() is pool
    assert pool.stats().allocated >= 2 * 16 * 16 * 4
    x.copy_(torch.randn(16, 16))
    g1.replay()
    g2.replay()
    torch.testing.assert_close(y2, (x @ x).relu())
    g1.enable_debug_mode()
    g1.debug_dump(str(tmp_path / "g.ts"))
    assert "aten.mm" in (tmp_path / "g.ts").read_text()
    assert g1.num_ops == 1


def _pointwise_mix(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0).relu() * 0.25
    h = h - x.exp().neg() / 3.0
    h = torch.tanh(h) + torch.sigmoid(h * 4)
    h.add_(b, alpha=-2.0)
    return torch.mm(h, w) + x.clone()


@pytest.mark.parametrize(("rows", "cols"), [(0, 7), (1, 64), (5, 7)])
def test_native_tier_matches_eager(rows: int, cols: int) -> None:
    torch.manual_seed(rows + 31 * cols)
    x = torch.randn(rows, cols)
    w, b = torch.randn(cols, cols), torch.randn(cols)
    g = Graph()
    with torch.no_grad(), g:
        y = _pointwise_mix(x, w, b)
    assert g.tier == "native"
    for scale in (1.0, 8.0):  # large inputs reach the saturated exp/tanh range
        x.copy_(torch.randn(rows, cols) * scale)
        w.copy_(torch.randn(cols, cols))
        g.replay()
        torch.testing.assert_close(y, _pointwise_mix(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change",
    ["resize_input", "resize_view_of_input", "set_input", "set_output", "resize_storage"],
)
def test_native_replay_refuses_moved_storages(change: str) -> None:
    # The C program holds raw pointers: replaying after a reallocation used freed memory.
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.relu(x @ w) + 1
    assert g.tier == "native"
    g.replay()
    label = "static output" if change == "set_output" else "static input e0"
    if change == "resize_input":
        x.resize_(64, 64)
    elif change == "resize_view_of_input":
        x.view(-1).resize_(4096)  # reallocates the storage x shares
    elif change == "set_input":
        x.set_(torch.randn(4, 8))
    elif change == "set_output":
        y.set_(torch.empty(4, 8))
    else:
        x.untyped_storage().resize_(4 * 4096)
    with pytest.raises(GraphError, match=f"{label} .*no longer at its capture-time address"):
        g.replay()


@pytest.mark.parametrize("change", ["set_smaller", "resize_smaller", "resize_larger", "output"])
def test_torchscript_replay_refuses_reshaped_static_tensors(torchscript_tier, change: str) -> None:  # type: ignore[no-untyped-def]
    # The interpreter runs at the tensors' new shapes: x set_ to 1 element made the replay
    # broadcast 2 * x[0] into all 3 elements of y, silently.
    x = torch.tensor([1.0, 2.0, 3.0])
    g = Graph()
    with g:
        y = x * 2
    assert g.tier == "torchscript"
    if change == "set_smaller":
        x.set_(torch.tensor([10.0]))
    elif change == "resize_smaller":
        x.resize_(1)
    elif change == "resize_larger":
        x.resize_(6)
    else:
        y.resize_(1)
    label = r"static output v\d+" if change == "output" else "static input e0"
    with pytest.raises(GraphError, match=f"{label} has shape .* but was captured with \\(3,\\)"):
        g.replay()


def test_torchscript_expanded_output_replays(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    # copy_ into a stride-0 output raised "more than one element of the written-to tensor
    # refers to a single memory location" at every replay.
    x = torch.randn(3, 1)
    g = Graph()
    with g:
        y = torch.erf(x).expand(3, 4)
        z = (x * 2).expand(2, 3, 5).transpose(0, 2)
    x.copy_(torch.arange(3.0).view(3, 1))
    g.replay()
    torch.testing.assert_close(y, torch.erf(x).expand(3, 4))
    torch.testing.assert_close(z, (x * 2).expand(2, 3, 5).transpose(0, 2))


def test_torchscript_replay_leaves_autograd_alone(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    # Replayed under grad mode, the output captured under no_grad from a Parameter came back
    # requiring grad, with a new autograd graph (grad_fn CopyBackwards) at every replay.
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    g = Graph()
    with torch.no_grad(), g:
        y = lin(x) * 2
    x.copy_(torch.randn(2, 4))
    g.replay()
    assert not y.requires_grad and y.grad_fn is None
    with torch.no_grad():
        torch.testing.assert_close(y, lin(x) * 2)


@pytest.mark.parametrize("native", [True, False])
def test_replay_inside_another_capture(native: bool) -> None:
    # A native replay is one C call the outer recorder never saw: the outer graph's replays
    # used y as it was at capture time (z = 10 * old y), silently.
    x = torch.randn(4)
    g1, g2 = Graph(), Graph()
    with config.override(native=native), g1:
        y = x * 2 + 1
    assert g1.tier == ("native" if native else "torchscript")
    if native:
        with pytest.raises(GraphError, match="inside another graph's capture"), g2:
            g1.replay()
        return
    with g2:
        g1.replay()
        z = y * 10
    x.copy_(torch.ones(4))
    g2.replay()
    torch.testing.assert_close(z, torch.full((4,), 30.0))


def test_torchscript_replay_follows_same_shape_set_(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    x = torch.tensor([1.0, 2.0, 3.0])
    g = Graph()
    with g:
        y = x * 2
    x.set_(torch.tensor([4.0, 5.0, 6.0]))
    g.replay()
    torch.testing.assert_close(y, torch.tensor([8.0, 10.0, 12.0]))


def test_native_replay_guard_leaves_in_place_updates_alone() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.relu(x @ w) + 1
    x.copy_(torch.randn(4, 8))
    x.resize_(2, 8)  # shrinking keeps the memory: still safe
    x.resize_(4, 8)
    g.replay()
    torch.testing.assert_close(y, torch.relu(x @ w) + 1)


def test_unsupported_ops_fall_back_to_torchscript() -> None:
    x = torch.randn(4, 4)
    g = Graph()
    with g:
        y = x.cumsum(-1)  # not in the native tier's op set
    assert g.tier == "torchscript"
    x.copy_(torch.randn(4, 4))
    g.replay()
    torch.testing.assert_close(y, x.cumsum(-1))


def test_captured_switch_with_mismatched_branches_names_branch() -> None:
    x = torch.randn(3)
    with pytest.raises(torchport.control.SwitchError, match="branch1"), Graph():
        torchport.switch(torch.tensor(0), [lambda t: t + 1, lambda t: t[:2]], (x,))
    with pytest.raises(torchport.control.SwitchError, match="data-dependent Python int"), Graph():
        torchport.switch(torch.tensor(0), [lambda t: (t, 1), lambda t: (t, 2)], (x,))


def test_loop_inside_switch_inside_loop() -> None:
    n, x = torch.tensor(0), torch.randn(4)

    def inner(t: torch.Tensor) -> torch.Tensor:
        return torchport.while_loop(lambda v: v.abs().sum() < 100, lambda v: (v * 2 + 1,), (t,))[0]

    def body(i: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, torchport.switch(i % 2, [inner, lambda t: t - 50], (v,))

    g = Graph()
    with g:
        _, out = torchport.while_loop(lambda i, v: i < n, body, (torch.tensor(0), x.abs()))
    for trips in (0, 1, 2, 5):
        n.fill_(trips)
        g.replay()
        ref = x.abs()
        for j in range(trips):
            if j % 2 == 0:
                while ref.abs().sum() < 100:
                    ref = ref * 2 + 1
            else:
                ref = ref - 50
        torch.testing.assert_close(out, ref)


def test_keep_graph_compiles_on_first_replay(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(3)
    g = Graph(keep_graph=True)
    with g:
        y = x.softmax(0)
    with pytest.raises(GraphError, match="nothing captured"):
        _ = g.tier  # not compiled yet
    x.copy_(torch.randn(3))
    g.replay()
    assert g.tier == "torchscript"
    torch.testing.assert_close(y, x.softmax(0))
    g.instantiate()  # idempotent


def test_native_tier_special_values() -> None:
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 0.0, -0.0, 1e-3]])
    g = Graph()
    with torch.no_grad(), g:
        outs = [x.relu(), x.exp(), x.tanh(), x.sigmoid(), x.neg(), x * 2 - 1]
    assert g.tier == "native"
    g.replay()
    for got, want in zip(outs, [x.relu(), x.exp(), x.tanh(), x.sigmoid(), x.neg(), x * 2 - 1]):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-6)


def _item_on_other_thread() -> str:
    import threading

    out: list[str] = []

    def run() -> None:
        try:
            out.append(f"value {torch.tensor(2.5).item()}")
        except CaptureError as e:
            out.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    return out[0]


@pytest.mark.parametrize("mode", ["default", "global"])
def test_capture_error_mode_global_prohibits_item_on_every_thread(mode: str) -> None:
    x = torch.randn(3)
    g = Graph(capture_error_mode=mode)  # type: ignore[arg-type]
    with g:
        y = x + 1
        assert "capture_error_mode='global'" in _item_on_other_thread()
        with pytest.raises(CaptureError, match="returns a Python value"):
            x.sum().item()
        # the capture's own bookkeeping still reads values (switch index, loop predicate)
        z = torchport.switch(torch.tensor(1), [lambda t: t * 0, lambda t: t - 1], (x,))
    assert _item_on_other_thread() == "value 2.5"  # lifted when the capture ends
    g.replay()
    torch.testing.assert_close(y, x + 1)
    torch.testing.assert_close(z, x - 1)


def test_capture_error_mode_global_is_lifted_after_a_failed_capture() -> None:
    with pytest.raises(ValueError, match="boom"), Graph(capture_error_mode="global"):
        raise ValueError("boom")
    assert torch.tensor(4.0).item() == 4.0


def test_capture_error_mode_thread_local_only_bans_the_capturing_thread() -> None:
    x = torch.randn(3)
    with Graph(capture_error_mode="thread_local"):
        assert _item_on_other_thread() == "value 2.5"
        with pytest.raises(CaptureError, match="returns a Python value"):
            bool(x[0] > 0)


def test_capture_error_mode_relaxed_freezes_the_value() -> None:
    x = torch.tensor([1.0, 2.0])
    g = Graph(capture_error_mode="relaxed")
    with g:
        s = x.sum().item()  # read now (3.0) and frozen, as the mode documents
        y = x * s
    x.copy_(torch.tensor([10.0, 20.0]))
    g.replay()
    torch.testing.assert_close(y, x * 3.0)
    with (
        pytest.raises(CaptureError, match=r"torch\.Generator"),
        Graph(capture_error_mode="relaxed"),
    ):
        torch.randn(3, generator=torch.Generator())


def test_dropped_pools_free_their_heaps_once_their_tensors_die() -> None:
    """A pool dropped in the same collection as its last tensors (a deleted graph's) kept its
    heaps forever: 40 graphs held 80 MiB. Such heaps now wait until their tensors die."""
    import gc

    from torchport.graphs import pool as poolmod

    x = torch.randn(512, 1024)
    for _ in range(6):
        g = Graph()
        with torch.no_grad(), g:
            y = torch.special.erf(x)  # the TorchScript tier: y lives in the graph's pool
        g.replay()
        del y, g
        gc.collect()
    p = poolmod.MemPool()  # a new pool sweeps the orphans
    t = p.empty((10,))
    del t, p
    gc.collect()
    poolmod.MemPool()
    assert sum(len(hs) for hs, _ in poolmod._ORPHANS) <= 1
    with pytest.raises(poolmod.MemPoolError, match=r"positive multiple of 512, got 1024\.0"):
        poolmod.MemPool(heap_bytes=1024.0)


def test_capture_end_from_another_thread_is_refused() -> None:
    """capture_end() on another thread raised ValueError half-way and left the capturing thread
    capturing for good (its .item() calls refused, reset() no help)."""
    import threading

    g = Graph()
    x = torch.ones(3)
    g.capture_begin()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            g.capture_end()
        except BaseException as e:  # recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "thread that called capture_begin" in str(errors[0])
    y = x * 2
    g.capture_end()
    g.replay()
    assert torch.equal(y, torch.full((3,), 2.0)) and float(x.sum().item()) == 3.0


def test_torchscript_whole_view_of_static_input_keeps_aliasing(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    # The output placement moved the view into the pool: it stopped seeing the input.
    x = torch.zeros(8)
    g = Graph()
    with g:
        v = x.view(2, 4)
        y = v.sum(0)
        w = y.view(4)  # two outputs on one storage keep sharing it too
    g.replay()
    assert v.data_ptr() == x.data_ptr() and w.data_ptr() == y.data_ptr()
    x.fill_(1.0)
    assert v.sum().item() == 8.0


def test_torchscript_switch_branch_returning_an_earlier_tensor_copies_it(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    # The program bound the switch output to the tensor itself: the later add_ reached it.
    x = torch.ones(3)
    g = Graph()
    with g:
        h = x * 1.0
        s = torchport.switch(torch.tensor(0), [lambda t: h, lambda t: t * 3], (x,))
        h.add_(100)
    torch.testing.assert_close(s, torch.ones(3))
    g.replay()
    torch.testing.assert_close(s, torch.ones(3))


@pytest.mark.parametrize("keep_graph", [False, True])
def test_torchscript_capture_in_inference_mode_replays_outside_it(
    torchscript_tier,  # type: ignore[no-untyped-def]
    keep_graph: bool,
) -> None:
    # Its outputs are inference tensors: writing them outside inference_mode raised.
    x = torch.zeros(3)
    g = Graph(keep_graph=keep_graph)
    with torch.inference_mode(), g:
        y = x + 1
    x.fill_(2.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 3.0))


def test_torchscript_loop_body_returning_an_earlier_tensor_copies_it(torchscript_tier) -> None:  # type: ignore[no-untyped-def]
    # The loop variable was bound to the tensor itself: the later add_ reached the output.
    x = torch.ones(3)
    g = Graph()
    with g:
        h = x * 2.0
        _, y = torchport.while_loop(
            lambda i, y: i < 2, lambda i, y: (i + 1, h), (torch.tensor(0), x)
        )
        h.add_(100)
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 2.0))
