"""Low-precision fixes from the review of session 47.

- ``torchport.nn.functional.scaled_mm`` never checked its operands' devices: the 1x128 / 128x128
  recipes dropped a meta bias and read a meta ``scale_b`` as 1 (a wrong result, no error), and
  the other recipes failed with untyped errors (KernelArgumentError, ``Tensor.item()``,
  device mismatches), where ``torchport.scaled_mm`` refuses such operands with a
  LowPrecisionError.
- ``quantize_`` on a Linear whose weight is derived (``torch.nn.utils.parametrize``, the legacy
  ``weight_norm`` / ``spectral_norm`` hooks): a KeyError after earlier linears were swapped, or a
  "quantized" linear whose every forward failed. Such linears are skipped with a reason.
- NVFP4 dynamic activations (``use_dynamic_per_tensor_scale=True``) read the activation's amax
  as a Python float: ``torch.export`` failed on it and ``torch.compile`` recompiled for every
  new value.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torchport
from torchport.lowp import (
    LowPrecisionError,
    LowPrecisionTensor,
    MXWeightOnlyConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    mx_quantize,
    nvfp4,
    nvfp4_quantize,
)
from torchport.nn import functional as F

S = F.ScalingType
FP4 = torch.float4_e2m1fn_x2


def _recipe_args(recipe: str, m: int) -> list:
    """(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b) for a valid ``scaled_mm`` call,
    N = 8."""
    torch.manual_seed(0)
    x, w = torch.randn(m, 256), torch.randn(8, 256)
    if recipe.startswith("nvfp4"):
        (xq, xs), (wq, ws) = nvfp4_quantize(x), nvfp4_quantize(w)
        if recipe == "nvfp4":
            return [xq.view(FP4), wq.view(FP4).t(), xs, S.BlockWise1x16, ws, S.BlockWise1x16]
        two = [S.BlockWise1x16, S.TensorWise]
        g = torch.tensor(0.5)
        return [xq.view(FP4), wq.view(FP4).t(), [xs, g], two, [ws, g.clone()], two]
    if recipe == "mxfp8":
        (xq, xs), (wq, ws) = mx_quantize(x, "fp8_e4m3"), mx_quantize(w, "fp8_e4m3")
        e8 = torch.float8_e8m0fnu
        return [xq, wq.t(), xs.view(e8), S.BlockWise1x32, ws.view(e8), S.BlockWise1x32]
    a8, b8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()
    if recipe == "1x128":
        return [
            a8,
            b8,
            torch.ones(m, 2),
            S.BlockWise1x128,
            torch.full((2, 8), 3.0),
            S.BlockWise1x128,
        ]
    return [a8, b8, torch.ones(m, 2), S.BlockWise1x128, torch.full((2, 1), 3.0), S.BlockWise128x128]


_ONE_SCALE = ["mat_a", "mat_b", "scale_a", "scale_b", "bias"]
_MISPLACED = [
    *((r, o) for r in ("1x128", "128x128b", "nvfp4", "mxfp8") for o in _ONE_SCALE),
    # the NVFP4 two-level form: the block scales ([0]) and the global scales ([1])
    *(("nvfp4-global", o) for o in ("mat_a", "mat_b", "bias")),
    *(("nvfp4-global", f"scale_{s}[{i}]") for s in "ab" for i in (0, 1)),
]


@pytest.mark.parametrize("m", [1, 12], ids=lambda m: f"M{m}")
@pytest.mark.parametrize(("recipe", "operand"), _MISPLACED, ids=[f"{r}-{o}" for r, o in _MISPLACED])
def test_scaled_mm_recipes_refuse_operands_off_the_cpu(recipe: str, operand: str, m: int) -> None:
    """A meta bias or ``scale_b`` of the 1x128 recipes was ignored (the result of a call
    without bias, or with ``scale_b`` 1); meta operands of the others raised untyped errors
    (KernelArgumentError, "Tensor.item() cannot be called on meta tensors", device
    mismatches)."""
    args = _recipe_args(recipe, m)
    kw: dict = {"output_dtype": torch.float32}
    if operand == "bias":
        kw["bias"] = torch.full((8,), 100.0, device="meta")
    elif operand.endswith("]"):  # one of a two-level operand's scales
        i, j = {"a": 2, "b": 4}[operand[6]], int(operand[-2])
        args[i] = [t.to("meta") if n == j else t for n, t in enumerate(args[i])]
    else:
        i = ["mat_a", "mat_b", "scale_a", "", "scale_b"].index(operand)
        args[i] = args[i].to("meta")
    msg = f"scaled_mm: {re.escape(operand)} must be on cpu, got meta"
    with pytest.raises(LowPrecisionError, match=msg):
        F.scaled_mm(*args, **kw)


def test_scaled_mm_recipes_take_cpu_operands_as_before() -> None:
    """The device check refuses nothing on the CPU: the 1x128 recipe with bias and scale_b
    matches the float64 reference."""
    from torchport.lowp.scaled_recipes import scaled_mm_reference

    for m in (1, 12):
        args = _recipe_args("1x128", m)
        bias = torch.full((8,), 100.0)
        got = F.scaled_mm(*args, bias=bias, output_dtype=torch.float32)
        want = scaled_mm_reference(*args, bias=bias, output_dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


_DERIVED = {
    "weight_norm": lambda lin: torch.nn.utils.parametrizations.weight_norm(lin),
    "orthogonal": lambda lin: torch.nn.utils.parametrizations.orthogonal(lin),
    "legacy_weight_norm": lambda lin: torch.nn.utils.weight_norm(lin),
    "legacy_spectral_norm": lambda lin: torch.nn.utils.spectral_norm(lin),
}


@pytest.mark.parametrize("kind", list(_DERIVED))
def test_quantize_skips_linears_with_a_derived_weight(kind: str) -> None:
    """A parametrized weight raised KeyError ("attribute 'weight' already exists") after the
    linear before it was swapped; a legacy hook's weight was reported quantized and every
    forward then failed (TypeError). Both are skipped with a reason; the rest is quantized."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the legacy weight_norm's deprecation warning)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 32), _DERIVED[kind](torch.nn.Linear(32, 32))
        )
    x = torch.randn(3, 32)
    with torch.no_grad():
        model(x)  # (spectral_norm's power iteration settles in training mode)
        model.eval()
        want_second = model[1](x)
    report = torchport.quantize_(model, MXWeightOnlyConfig())
    assert report.quantized == ["0"]
    why = "weight is parametrized" if kind in ("weight_norm", "orthogonal") else "not a Parameter"
    assert why in report.skipped["1"]
    assert isinstance(model[0].weight, LowPrecisionTensor)
    assert not isinstance(model[1].weight, LowPrecisionTensor)
    with torch.no_grad():
        model(x)  # (the forward failed after a legacy hook's linear was "quantized")
        torch.testing.assert_close(model[1](x), want_second)


def _nvfp4_dynamic_layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    torchport.quantize_(lin, NVFP4DynamicActivationNVFP4WeightConfig())
    return lin


@pytest.mark.parametrize("rows", [1, 12], ids=lambda r: f"rows{r}")
def test_export_of_a_dynamic_nvfp4_activation_layer(rows: int) -> None:
    """The per-tensor scale from the activation's amax was read as a float while traced:
    GuardOnDataDependentSymNode. The exported graph computes it at run time: eager's results
    for activations of other magnitudes (a constant scale would give others)."""
    lin = _nvfp4_dynamic_layer()
    mod = torch.export.export(lin, (torch.randn(rows, 64),)).module()
    with torch.no_grad():
        for scale in (1.0, 1e-3, 50.0):
            x = torch.randn(rows, 64) * scale
            # (decode rows: the exported graph dequantizes where eager's GEMV reads the codes)
            torch.testing.assert_close(mod(x), lin(x), rtol=1e-5, atol=1e-5 * scale)
        zero = torch.zeros(rows, 64)  # (amax 0: no per-tensor scale in eager, 1.0 traced)
        torch.testing.assert_close(mod(zero), lin(zero), rtol=0, atol=0)


def test_compiled_dynamic_nvfp4_activation_layer_does_not_recompile() -> None:
    """Each new activation amax recompiled (a guard on the float per-tensor scale), up to the
    recompile limit. Now the graphs compiled by the first call serve the later ones, with
    eager's bits."""
    from torch._dynamo.utils import counters

    lin = _nvfp4_dynamic_layer()
    torch._dynamo.reset()
    counters.clear()
    try:
        c = torch.compile(lin, backend="eager")
        with torch.no_grad():
            c(torch.randn(12, 64))
            graphs = counters["stats"]["unique_graphs"]
            for i in range(4):
                x = torch.randn(12, 64) * (i + 2)
                assert torch.equal(c(x), lin(x))
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        torch._dynamo.reset()


def test_traced_per_tensor_scale_is_bit_identical_to_eager() -> None:
    """The tensor form of the per-tensor scale (what a traced activation gets) quantizes and
    dequantizes to the float form's bits, 1.0 standing for "none" included."""
    torch.manual_seed(0)
    x = torch.randn(5, 64) * 7
    f = nvfp4.per_tensor_amax_to_scale(x.abs().max())
    t = nvfp4.per_tensor_amax_to_scale_tensor(x.abs().max())
    assert t.dtype == torch.float32 and t.dim() == 0 and float(t) == f
    for pts_f, pts_t in ((f, t), (None, torch.tensor(1.0))):
        qf, sf = nvfp4.nvfp4_quantize(x, pts_f)
        qt, st = nvfp4.nvfp4_quantize_traced(x, pts_t)
        assert torch.equal(qf, qt) and torch.equal(sf.view(torch.uint8), st.view(torch.uint8))
        assert torch.equal(
            nvfp4.nvfp4_dequantize(qf, sf, pts_f), nvfp4.nvfp4_dequantize_reference(qt, st, pts_t)
        )
