"""Autograd of quantized linears under ``torch.compile``: input and bias gradients match eager.

Weights are frozen (no weight gradient); ``grad_x = grad_out @ dequantize(W)`` as in eager mode
(see torchport.lowp.tensors). Covers Inductor and the torchport backend, decode (1 row) and
prefill (20 rows) shapes, weight-only and weight + activation configs.
"""

from __future__ import annotations

import pytest
import torch

import torchport
from torchport import lowp

CONFIGS = [
    lowp.NVFP4WeightOnlyConfig(),
    lowp.MXWeightOnlyConfig(elem="fp4_e2m1"),
    lowp.Float8WeightOnlyConfig(),
    lowp.NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=False),
]


def _grads(fn, lin: torch.nn.Linear, x: torch.Tensor, g: torch.Tensor):
    xx = x.detach().clone().requires_grad_(True)
    lin.bias.grad = None
    out = fn(xx)
    out.backward(g)
    return out.detach(), xx.grad, lin.bias.grad.clone()


CASES = [  # (config, rows, backend): every config, decode and prefill, both backends
    (CONFIGS[0], 1, "inductor"),
    (CONFIGS[0], 20, "torchport"),
    (CONFIGS[1], 20, "inductor"),
    (CONFIGS[2], 1, "torchport"),
    (CONFIGS[3], 1, "inductor"),
]


@pytest.mark.parametrize(
    ("cfg", "rows", "backend"), CASES, ids=[f"{type(c).__name__}-rows{r}-{b}" for c, r, b in CASES]
)
def test_compiled_quantized_linear_gradients_match_eager(cfg, rows, backend) -> None:
    torch.manual_seed(rows)
    lin = torch.nn.Linear(64, 48)
    lowp.quantize_(lin, cfg)
    x, g = torch.randn(rows, 1, 64), torch.randn(rows, 1, 48)
    torch._dynamo.reset()
    # weight-only: one graph; activation quantization checks its input for NaN/Inf (a
    # data-dependent branch, so a graph break)
    full = not isinstance(cfg, lowp.NVFP4DynamicActivationNVFP4WeightConfig)
    if backend == "torchport":
        compiled = torchport.compile(lin, fullgraph=full)
    else:
        compiled = torch.compile(lin, backend="inductor", fullgraph=full)
    y0, gx0, gb0 = _grads(lin, lin, x, g)
    y1, gx1, gb1 = _grads(compiled, lin, x, g)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb1, gb0, rtol=1e-5, atol=1e-5)
    assert lin.weight.grad is None and not lin.weight.requires_grad
    # the gradient is the dequantized weight's: grad_x = g @ W
    wd = lin.weight.dequantize()
    torch.testing.assert_close(gx1, g @ wd, rtol=1e-5, atol=1e-5)


def test_compiled_frozen_weight_rejects_requires_grad() -> None:
    lin = torch.nn.Linear(32, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    lin.weight.requires_grad_(True)
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend="inductor")
    with pytest.raises(Exception, match=r"weights are frozen.*got requires_grad=True"):
        compiled(torch.randn(2, 32, requires_grad=True))


@pytest.mark.parametrize("rows", [1, 12])
def test_torch_func_transforms_of_a_quantized_linear(rows) -> None:
    """``torch.func.grad``, ``jacrev`` and ``vmap(grad)`` through ``F.linear`` with a quantized
    weight give the input and bias gradients of the dequantized weight; they raised "it must
    override the setup_context staticmethod" (the frozen-weight autograd function took a ctx in
    its forward), decode and prefill alike."""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    w, b, wd = lin.weight, lin.bias.detach(), lin.weight.dequantize()
    x = torch.randn(rows, 64)

    def f(x, b, w):
        return torch.nn.functional.linear(x, w, b).pow(2).sum()

    gx, gb = torch.func.grad(f, argnums=(0, 1))(x, b, w)
    rx, rb = torch.func.grad(f, argnums=(0, 1))(x, b, wd)
    torch.testing.assert_close(gx, rx, rtol=2e-2, atol=2e-1)  # int8 activations at decode
    torch.testing.assert_close(gb, rb, rtol=2e-2, atol=2e-1)
    jac = torch.func.jacrev(lambda v: torch.nn.functional.linear(v, w, b))(x)
    assert jac.shape == (rows, 16, rows, 64)
    torch.testing.assert_close(jac[0, :, 0], wd)  # d out[0] / d x[0] = W
    per_row = torch.func.vmap(torch.func.grad(lambda v: f(v, b, w)))(x.unsqueeze(1))
    torch.testing.assert_close(per_row.squeeze(1), rx, rtol=2e-2, atol=2e-1)


def test_eager_quantized_linear_with_grad_binds_no_signature(monkeypatch) -> None:
    """Outside ``torch.func``, ``F.linear`` with a quantized weight and an input or bias that
    requires grad (a quantized ``nn.Linear``'s bias does) takes the autograd function with its
    ``ctx`` in ``forward``: the form with a separate ``setup_context`` made torch bind the
    arguments to ``forward``'s signature on every call (``inspect.signature``, about 17 µs of a
    40 µs decode call). Gradients as before."""
    import inspect

    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    x = torch.randn(1, 64, requires_grad=True)
    lin(x)  # the first call packs
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or real(*a, **k))
    out = lin(x)
    assert calls == []
    monkeypatch.undo()
    g = torch.randn(out.shape)
    out.backward(g)
    wd = lin.weight.dequantize()
    torch.testing.assert_close(x.grad, g @ wd, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad, g.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [
        lowp.Float8DynamicActivationFloat8WeightConfig(),
        lowp.NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=False),
        lowp.MXDynamicActivationMXWeightConfig(),
    ],
    ids=lambda c: type(c).__name__,
)
def test_torch_func_transforms_with_activation_quantization(cfg) -> None:
    """What the README states for activation-quantizing configs: ``grad``, ``jacrev`` and
    ``jvp`` work with each; ``vmap`` of ``grad`` works with FP8 activations and raises torch's
    data-dependent control flow error with FP4 ones (the NaN/Inf check of the quantization);
    the README said it worked for every config."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, cfg)
    w, b, x = lin.weight, lin.bias.detach(), torch.randn(2, 64)

    def f(v):
        return torch.nn.functional.linear(v, w, b).pow(2).sum()

    gx = torch.func.grad(f)(x)
    assert gx.shape == x.shape
    jac = torch.func.jacrev(lambda v: torch.nn.functional.linear(v, w, b))(x)
    torch.testing.assert_close(jac[0, :, 0], w.dequantize())
    # jvp: the straight-through tangent, as jacrev's (the kernels and the FP4 quantization's
    # zero derivative gave an all-zero tangent with the FP4 activation configs)
    t = torch.randn(2, 64)
    tan = torch.func.jvp(lambda v: torch.nn.functional.linear(v, w, b), (x,), (t,))[1]
    torch.testing.assert_close(tan, torch.einsum("bnck,ck->bn", jac, t))
    per_row = lambda: torch.func.vmap(torch.func.grad(f))(x.unsqueeze(1))  # noqa: E731
    if isinstance(cfg, lowp.Float8DynamicActivationFloat8WeightConfig):
        torch.testing.assert_close(per_row().squeeze(1), gx)
    else:
        with pytest.raises(RuntimeError, match="data-dependent control flow"):
            per_row()


@pytest.mark.parametrize("first", ["jvp", "jacfwd", "grad_other_arg", "gemv_jvp"])
def test_a_weight_first_used_under_torch_func_keeps_a_usable_pack(first) -> None:
    """A quantized weight whose first use (the pack, cached on the weight) is under a
    ``torch.func`` transform that wraps every op's result (``jvp``, ``jacfwd``, ``grad`` with
    respect to another argument) works in eager mode afterwards: the pack was made of the
    transform's wrappers, and every later call (``lin(x)`` under ``no_grad`` included) raised
    "Cannot access data pointer of Tensor that doesn't have storage"."""
    from torchport.gemv import gemv

    torch.manual_seed(5)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    w, b, x = lin.weight, lin.bias.detach(), torch.randn(2, 64)
    f = lambda v: torch.nn.functional.linear(v, w, b)  # noqa: E731
    if first == "jvp":
        torch.func.jvp(f, (x,), (x,))
    elif first == "jacfwd":
        torch.func.jacfwd(f)(x)
    elif first == "grad_other_arg":
        torch.func.grad(lambda s: (f(x) * s).sum())(torch.tensor(2.0))
    else:
        torch.func.jvp(lambda v: gemv(v, w, b), (x,), (x,))
    pw = w.gemv_pack()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    assert not any(wrapped(t) for t in (pw.data, pw.scales, pw.rowscale))
    want = x @ w.dequantize().T + b
    with torch.no_grad():
        torch.testing.assert_close(lin(x), want, rtol=2e-2, atol=2e-1)  # int8 activations
    xg = x.clone().requires_grad_()
    lin(xg).sum().backward()
    torch.testing.assert_close(xg.grad, w.dequantize().sum(0).expand_as(x))


def test_jvp_through_a_quantized_linear_module() -> None:
    """``torch.func.jvp`` (and ``hessian``, forward over reverse) through a quantize_'d
    ``nn.Linear``, whose bias requires grad: the autograd function raised "You must implement
    the jvp function"; the tangent is ``t @ dequantize(W).T`` plus the bias's tangent."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    wd = lin.weight.dequantize()
    x, t, bt = torch.randn(2, 64), torch.randn(2, 64), torch.randn(16)
    tan = torch.func.jvp(lin, (x,), (t,))[1]
    torch.testing.assert_close(tan, t @ wd.T)
    w = lin.weight
    f = lambda v, bb: torch.nn.functional.linear(v, w, bb)  # noqa: E731
    tan = torch.func.jvp(f, (x, lin.bias.detach()), (t, bt))[1]
    torch.testing.assert_close(tan, t @ wd.T + bt)
    tan = torch.func.jvp(lambda bb: f(x, bb), (lin.bias.detach(),), (bt,))[1]
    torch.testing.assert_close(tan, bt.expand(2, 16))
    h = torch.func.hessian(lambda v: lin(v).pow(2).sum())(x[0])
    torch.testing.assert_close(h, 2 * wd.T @ wd)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_eager_forward_ad_through_a_quantized_linear(grad) -> None:
    """Eager ``torch.autograd.forward_ad`` with a dual input whose primal does not require grad
    and no bias that does (forward mode ignores the grad mode): F.linear, its settled route and
    gemv reached the kernel, which dropped the tangent (None)."""
    import torch.autograd.forward_ad as fwad

    from torchport.gemv import gemv

    torch.manual_seed(6)
    w = lowp.Float8Tensor.from_float(torch.randn(16, 64), torch.float8_e4m3fn, "row")
    wd = w.dequantize()
    x, t, b, bt = torch.randn(1, 64), torch.randn(1, 64), torch.randn(16), torch.randn(16)
    for _ in range(3):  # settle the decode route for this input
        torch.nn.functional.linear(x, w)
    with fwad.dual_level(), torch.set_grad_enabled(grad):
        for f in (torch.nn.functional.linear, gemv):
            out, tan = fwad.unpack_dual(f(fwad.make_dual(x, t), w))
            torch.testing.assert_close(out, x @ wd.T)
            torch.testing.assert_close(tan, t @ wd.T)
            tan = fwad.unpack_dual(f(x, w, fwad.make_dual(b, bt))).tangent
            torch.testing.assert_close(tan, bt.expand(1, 16))
        # a dense weight's own tangent (gemv packed a detached copy)
        wt = torch.randn(16, 64)
        tan = fwad.unpack_dual(gemv(x, fwad.make_dual(wd, wt))).tangent
        torch.testing.assert_close(tan, x @ wt.T)


def test_forward_ad_level_keeps_the_settled_route(monkeypatch) -> None:
    """Inside a forward-AD dual level the settled route refuses every call (x may carry a
    tangent); each quantized F.linear settled a new route anyway (one settle per call, twice the
    call's time), which also replaced the one settled before the level."""
    import torch.autograd.forward_ad as fwad

    from torchport.lowp import tensors

    w = lowp.Float8Tensor.from_float(torch.randn(16, 64), torch.float8_e4m3fn, "row")
    x = torch.randn(1, 64)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    route = w._route
    assert route is not None
    calls, settle = [], tensors.settle_route

    def counting(*args, **kwargs):
        calls.append(1)
        return settle(*args, **kwargs)

    monkeypatch.setattr(tensors, "settle_route", counting)
    with fwad.dual_level():
        for _ in range(5):
            out = torch.nn.functional.linear(x, w)
    assert not calls and w._route is route
    assert torch.equal(torch.nn.functional.linear(x, w), out)


@pytest.mark.parametrize("rows", [1, 20])
def test_copy_into_the_weight_between_forward_and_backward_raises(rows) -> None:
    """``F.linear`` with a quantized weight, then ``w.copy_(new)``, then the backward: raises as
    torch does for a weight modified in place after the forward saved it (the backward silently
    used the new weight's values), decode and prefill. (Under ``torch.func`` the transform itself
    refuses a copy_ into the captured weight.)"""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    w, w1 = lin.weight, torch.randn(16, 64)
    x = torch.randn(rows, 64, requires_grad=True)
    out = lin(x)
    with torch.no_grad():
        w.copy_(w1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    lin(x).sum().backward()  # written before the forward: its gradient
    torch.testing.assert_close(x.grad, w.dequantize().sum(0).expand_as(x))


def test_data_assignment_to_the_weight_between_forward_and_backward_raises() -> None:
    """``w.data = other`` (a quantized tensor of the same type) after ``F.linear``'s forward:
    the autograd holds ``w`` itself, whose inner tensors the assignment swaps, so the backward
    silently took the new weight's gradient (/tmp/s26/readK/j.py). Counted as a write, it
    raises as after ``copy_``; assigned before the forward, the new weight's gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    other = torch.nn.Linear(64, 16)
    lowp.quantize_(other, lowp.NVFP4WeightOnlyConfig())
    x = torch.randn(3, 64, requires_grad=True)
    out = lin(x)
    lin.weight.data = other.weight.detach()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, other.weight.dequantize().sum(0).expand_as(x))


def test_weight_quantized_under_inference_mode_differentiates_in_eager_mode_only() -> None:
    """What the README states: a weight quantized under ``torch.inference_mode()`` (inference
    tensors inside) gives input gradients in eager mode (the pack is kept as a ctx attribute),
    while ``torch.compile``'s backward saves the weight's tensors, which torch refuses."""
    from torchport.gemv import gemv

    torch.manual_seed(0)
    with torch.inference_mode():
        lin = torch.nn.Linear(64, 16)
        lowp.quantize_(lin, lowp.NVFP4WeightOnlyConfig())
    w = lin.weight
    assert w.qdata.is_inference()
    x = torch.randn(1, 64, requires_grad=True)
    gemv(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.dequantize().sum(0, keepdim=True))
    torch._dynamo.reset()
    compiled = torch.compile(lambda v: gemv(v, w), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        compiled(torch.randn(1, 64, requires_grad=True)).sum().backward()


def test_inference_write_counts_go_with_their_storage() -> None:
    """``copy_`` into a weight made under ``torch.inference_mode()`` counts the write for its
    storage (for the backward's in-place check); the entry stayed after the weight was gone, so a
    model reloaded in a loop grew the map by one entry per inner tensor each time."""
    import gc

    from torchport.gemv import ops as gops

    def written() -> lowp.Float8Tensor:
        with torch.inference_mode():
            w = lowp.Float8Tensor.from_float(torch.randn(8, 32), torch.float8_e4m3fn, "row")
            w.copy_(torch.randn(8, 32))
        return w

    w = written()
    assert all(gops._writes_of(t) == 1 for t in (w.qdata, w.scale))
    view = w.qdata[2:]  # a view keeps the storage, and so its count
    del w
    gc.collect()
    assert gops._writes_of(view) == 1
    before = len(gops._INFERENCE_WRITES)
    del view
    gc.collect()
    assert len(gops._INFERENCE_WRITES) == before - 1
    for _ in range(20):
        written()
    gc.collect()
    assert len(gops._INFERENCE_WRITES) == before - 1


def test_inference_write_count_follows_a_moved_storage() -> None:
    """A weight storage moved in place (``share_memory_()``) between the forward and the backward
    keeps its write count: keyed by address, the count stayed at the old address (where a new
    storage would inherit it) and the backward, reading 0 at the new one, raised "modified by an
    inplace operation" with no write. A write after the move still raises."""
    from torchport.gemv import ops as gops

    n = k = 64
    with torch.inference_mode():
        data = torch.zeros(n, k, dtype=torch.uint8)
        rowscale = torch.ones(n)
    gops.note_written((data,))  # (a weight loaded by copy_)
    empty = torch.empty(0, dtype=torch.uint8)

    def forward() -> torch.Tensor:
        x = torch.randn(1, k, requires_grad=True)
        return gops.gemv_packed_op(x, data, empty, rowscale, 1.0, "fp8_e4m3", n, k, None, False)

    y = forward()
    old = data.data_ptr()
    data.share_memory_()
    assert data.data_ptr() != old and gops._writes_of(data) == 1
    y.sum().backward()
    with torch.inference_mode():  # a storage made now (at the old address or not) has no writes
        fresh = torch.zeros(n, k, dtype=torch.uint8)
    assert gops._writes_of(fresh) == 0
    y = forward()
    gops.note_written((data,))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
