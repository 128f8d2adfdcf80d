"""Decode GEMVs inside graph captures: quantized linears replayed by the native and TorchScript tiers.

The native tier calls the kernel eager mode plans for the same problem, so replay must equal eager
mode bit for bit (and meet the float64 reference's tolerance, as in test_gemv.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchport.gemv import gemv, gemv_reference
from torchport.graphs import CaptureError, Graph
from torchport.lowp import (
    Float8Tensor,
    MXTensor,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4Tensor,
    NVFP4WeightOnlyConfig,
    quantize_,
)


def _quantized(fmt: str, w: torch.Tensor) -> torch.Tensor:
    if fmt == "fp8_row":
        return Float8Tensor.from_float(w, torch.float8_e4m3fn, "row")
    if fmt == "fp8_tensor":
        return Float8Tensor.from_float(w, torch.float8_e5m2, "tensor")
    if fmt == "nvfp4":
        return NVFP4Tensor.from_float(w)
    if fmt == "nvfp4_nopts":
        return NVFP4Tensor.from_float(w, per_tensor_scale=False)
    elem = {"mxfp4": "fp4_e2m1", "mxfp8": "fp8_e4m3"}[fmt]
    return MXTensor.from_float(w, elem)


FMTS = ["fp8_row", "fp8_tensor", "nvfp4", "nvfp4_nopts", "mxfp4", "mxfp8"]
# (N, K): N = 1 and primes; K = one block, not a multiple of 64 (group-32 kernel), several 64s
SHAPES = [(1, 32), (17, 96), (131, 256)]


def _mag(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    return x.double().abs().reshape(-1, x.shape[-1]) @ wd.double().abs().T


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("rows", "has_bias"), [(1, False), (3, True)], ids=["rows1", "rows3-bias"])
def test_native_tier_replays_quantized_linear_bit_exact(fmt, shape, rows, has_bias) -> None:
    n, k = shape
    torch.manual_seed(n * 7 + k + rows)
    w = _quantized(fmt, torch.randn(n, k) * 0.1)
    bias = torch.randn(n) if has_bias else None
    x = torch.randn(rows, k)
    g = Graph()
    with torch.no_grad(), g:
        y = F.linear(x, w, bias)
    assert g.tier == "native"
    assert "tp_gemv_t" in g.source
    for _ in range(2):
        x.copy_(torch.randn(rows, k))
        g.replay()
        with torch.no_grad():
            want = F.linear(x, w, bias)
        assert torch.equal(y, want)
        ref = gemv_reference(x, w.dequantize(), bias).double()
        # int8 activations (FP4 weights): per-group rounding, as test_gemv.py states it
        tol = 1e-2 if fmt in ("nvfp4", "nvfp4_nopts", "mxfp4") else 1e-5
        assert bool(((y.double() - ref).abs() <= tol * _mag(x, w.dequantize()) + 1e-6).all())


def test_torchscript_tier_replays_quantized_linear() -> None:
    """An op the native tier declines (integer division) sends the capture to TorchScript, which
    calls the GEMV custom op through the dispatcher."""
    torch.manual_seed(0)
    w = NVFP4Tensor.from_float(torch.randn(48, 64))
    bias = torch.randn(48)
    x, a = torch.randn(1, 64), torch.tensor([7, 9])
    g = Graph()
    with torch.no_grad(), g:
        y = F.linear(x, w, bias)
        q = torch.div(a, 2, rounding_mode="floor")
    assert g.tier == "torchscript"
    assert "torchport.gemv_packed" in g.source
    x.copy_(torch.randn(1, 64))
    a.copy_(torch.tensor([4, 5]))
    g.replay()
    with torch.no_grad():
        assert torch.equal(y, F.linear(x, w, bias))
    assert q.tolist() == [2, 2]


def test_dense_gemv_op_in_native_tier() -> None:
    """``torchport::gemv_dense`` (what torchport.compile's routing emits) captured natively."""
    torch.manual_seed(1)
    w, bias = torch.randn(37, 64), torch.randn(37)
    x = torch.randn(2, 64)
    g = Graph()
    with torch.no_grad(), g:
        y = torch.ops.torchport.gemv_dense(x, w, bias)
    assert g.tier == "native"
    x.copy_(torch.randn(2, 64))
    w.mul_(0.5)  # weights are read at replay
    g.replay()
    assert torch.equal(y, gemv(x, w, bias))
    torch.testing.assert_close(y, gemv_reference(x, w, bias), rtol=1e-5, atol=1e-5)


def test_bfloat16_activations_use_the_torchscript_tier() -> None:
    torch.manual_seed(2)
    w = NVFP4Tensor.from_float(torch.randn(16, 64))
    x = torch.randn(1, 64).bfloat16()
    g = Graph()
    with torch.no_grad(), g:
        y = F.linear(x, w)
    assert g.tier == "torchscript"
    x.copy_(torch.randn(1, 64))
    g.replay()
    with torch.no_grad():
        assert torch.equal(y, F.linear(x, w))


def test_quantized_mlp_in_captured_loop_matches_eager() -> None:
    """A quantize_'d MLP iterated by a captured while_loop with a data-dependent trip count."""
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)
    ).eval()
    rep = quantize_(mlp, NVFP4WeightOnlyConfig())
    assert rep.quantized == ["0", "2"]
    import torchport

    x, n = torch.randn(1, 64), torch.tensor(3)
    g = Graph()
    with torch.no_grad(), g:
        i, y = torchport.while_loop(
            lambda i, y: i < n, lambda i, y: (i + 1, torch.tanh(mlp(y))), (torch.tensor(0), x)
        )
    assert g.tier == "native"
    for trips in (0, 1, 4):
        x.copy_(torch.randn(1, 64))
        n.fill_(trips)
        g.replay()
        want = x.clone()
        with torch.no_grad():
            for _ in range(trips):
                want = torch.tanh(mlp(want))
        assert int(i) == trips
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)  # tanh: the tier's polynomial


@pytest.mark.parametrize("dynamic_pts", [True, False])
def test_activation_quantization_is_not_capturable(dynamic_pts: bool) -> None:
    """Run-time activation quantization reads Python values (the NaN/Inf check, the dynamic
    per-tensor scale) that a replay could not recompute: the capture refuses it, by the
    ``capture_error_mode`` rules. Weight-only configs capture."""
    lin = torch.nn.Linear(64, 8).eval()
    quantize_(
        lin, NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=dynamic_pts)
    )
    x = torch.randn(1, 64)
    with pytest.raises(CaptureError, match="returns a Python value"), torch.no_grad(), Graph():
        lin(x)


def test_other_custom_ops_still_cannot_be_captured() -> None:
    import torchport.ops.elementwise  # noqa: F401  (registers torchport::axpy)

    a = torch.randn(8)
    g = Graph()
    with pytest.raises(CaptureError, match=r"torchport\.axpy.*not an ATen op"), torch.no_grad(), g:
        torch.ops.torchport.axpy(a, a, 2.0)


def test_demo_decoder_with_nvfp4_weights_captures_natively() -> None:
    """The demo's captured greedy decoder runs a quantize_'d GPT in the native tier; its step
    logits equal eager mode's to float32 rounding (gelu/softmax round differently)."""
    from torchport.demo.model import GPT, GPTConfig
    from torchport.demo.stage_graphs import CapturedDecoder, decode_step

    torch.manual_seed(5)
    model = GPT(GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=2)).eval()
    quantize_(model, NVFP4WeightOnlyConfig())
    dec = CapturedDecoder(model, 8)
    assert dec.graph.tier == "native"
    src = dec.graph.source
    twins = src.count(") s_ = ((tp_gemv_t)F[")  # int8 kernels' float twins (non-finite activations)
    assert src.count("tp_gemv_t)F[") - twins == 2 * 4 + 1  # every linear, no fallback
    out = dec.generate(b"ab", 8)
    assert len(out) <= 8
    cfg = model.cfg
    shape = (cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.d_model // cfg.n_heads)
    kc, vc = torch.randn(shape), torch.randn(shape)
    step = Graph()
    tok, pos = torch.tensor([3]), torch.tensor([2])
    with torch.no_grad(), step:
        _nxt, k2, v2 = decode_step(model, tok, pos, kc, vc)
    with torch.no_grad():
        want = decode_step(model, tok, pos, kc, vc)
    step.replay()
    torch.testing.assert_close(k2, want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v2, want[2], rtol=1e-5, atol=1e-5)
