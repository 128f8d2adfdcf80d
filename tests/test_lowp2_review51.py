"""Quantized linears, from the review of session 51 (second part).

- A bias that is an inference tensor (a model built or quantized under
  ``torch.inference_mode()``, the usual decode setup) made every decode call with 1-8 rows raise
  ``RuntimeError: Inference tensors do not track version counter.``: the settled route read the
  bias's version counter. It keeps -1 for an inference bias and checks its shape instead.
- An integer or complex activation with an NVFP4 / MX weight that quantizes activations gave
  a truncated / real-only result (torch refuses both); an FP8 activation-quantizing weight
  refused it with a message about ``out_dtype``, and a 0-d one raised an IndexError. Every type
  now refuses both with a LowPrecisionError.
- ``F.linear`` took any bias that broadcasts to the output's shape, refused a ``[1, N]`` bias
  with a 1-D input (torch gives ``[N]``) and took a ``[3, 1]`` bias with an input
  ``[2, 3, K]`` (torch refuses it): torch's own rule now decides (``_linear_bias_target``).
- ``NVFP4Tensor.from_float`` / ``quantize_`` of a meta weight with a per-tensor scale (and a
  meta activation with a dynamic per-tensor scale) raised torch's untyped "Tensor.item() cannot
  be called on meta tensors": the input is checked before its amax is read.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import torchport
from torchport.gemv import GemvInputError, gemv
from torchport.lowp import (
    Float8Tensor,
    Float8WeightOnlyConfig,
    LowPrecisionError,
    MXTensor,
    MXWeightOnlyConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    NVFP4Tensor,
    NVFP4WeightOnlyConfig,
)

E4M3 = torch.float8_e4m3fn
CONFIGS = {
    "fp8": Float8WeightOnlyConfig(),
    "nvfp4": NVFP4WeightOnlyConfig(),
    "mx": MXWeightOnlyConfig(),
}


# --- 1. an inference-tensor bias on the decode route ---------------------------------------------


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_model_quantized_under_inference_mode_decodes(kind: str) -> None:
    """Every decode call (1-8 rows) raised; the route now settles and serves such a bias, with
    the bits of the same call with an ordinary copy of the bias."""
    torch.manual_seed(0)
    with torch.inference_mode():
        lin = torch.nn.Linear(64, 32).eval()
        torchport.quantize_(lin, CONFIGS[kind])
    assert lin.bias.is_inference()
    plain_bias = lin.bias.clone()  # (outside inference mode: an ordinary tensor)
    for rows in (1, 2, 8, 9):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            want = F.linear(x, lin.weight, plain_bias)
        for mode in (torch.inference_mode, torch.no_grad):
            for _ in range(3):  # settle, then serve
                with mode():
                    assert torch.equal(lin(x), want)
        if rows <= 8:
            assert lin.weight._route is not None  # (the decode route took the bias)


def test_gemv_with_an_inference_bias() -> None:
    """``torchport.gemv.gemv(x, Float8Tensor, bias)`` raised from its second call on."""
    torch.manual_seed(1)
    with torch.inference_mode():
        b = torch.randn(32)
    q = Float8Tensor.from_float(torch.randn(32, 64))
    x = torch.randn(2, 64)
    with torch.no_grad():
        want = gemv(x, q, b.clone())
        for _ in range(3):
            assert torch.equal(gemv(x, q, b), want)
            assert torch.equal(F.linear(x, q, b), want)


def test_an_inference_bias_written_or_resized_after_the_route_settled() -> None:
    """The route reads a float32 inference bias where it lives (an in-place write is seen); a
    shrinking ``resize_`` keeps its storage and no version counter shows it: its shape is
    checked (the kernel would read N values from a 16-element bias)."""
    torch.manual_seed(2)
    q = Float8Tensor.from_float(torch.randn(32, 64))
    x = torch.randn(2, 64)
    with torch.inference_mode():
        b = torch.randn(32)
        for _ in range(3):
            y1 = F.linear(x, q, b)
        b.add_(1.0)
        torch.testing.assert_close(F.linear(x, q, b), y1 + 1.0)
        b.resize_(16)
        with pytest.raises(GemvInputError, match=r"bias must have shape \(32,\), got \(16,\)"):
            F.linear(x, q, b)


# --- 2. activations of a non-floating dtype or no dimension --------------------------------------


def _weights() -> dict[str, torch.Tensor]:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    return {
        "fp8": Float8Tensor.from_float(w),
        "fp8_act": Float8Tensor.from_float(w, act_dtype=E4M3),
        "nvfp4": NVFP4Tensor.from_float(w),
        "nvfp4_act": NVFP4Tensor.from_float(w, act_per_tensor_scale=True),
        "nvfp4_act_nopts": NVFP4Tensor.from_float(w, act_per_tensor_scale=False),
        "mx": MXTensor.from_float(w),
        "mx_act": MXTensor.from_float(w, act_elem="fp4_e2m1"),
        "mx_act_fp8": MXTensor.from_float(w, act_elem="fp8_e4m3"),
    }


WEIGHTS = list(_weights())


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.bool], ids=str)
@pytest.mark.parametrize("rows", [2, 12], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("kind", WEIGHTS)
def test_a_non_float_activation_is_refused(kind: str, rows: int, dtype: torch.dtype) -> None:
    """The activation-quantizing NVFP4 / MX weights returned the product truncated to integers
    or a complex input's real part alone (torch refuses both)."""
    w = _weights()[kind]
    x = torch.randint(-3, 4, (rows, 64)).to(dtype)
    msg = rf"F.linear with a {type(w).__name__}: x must be a floating-point tensor, got {dtype}"
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(LowPrecisionError, match=msg):
            F.linear(x, w)


@pytest.mark.parametrize("kind", WEIGHTS)
def test_a_scalar_activation_is_refused(kind: str) -> None:
    """The FP8 activation-quantizing weight raised an IndexError (torch: "both arguments to
    linear need to be at least 1D")."""
    w = _weights()[kind]
    msg = r"x must have at least 1 dimension \(the last one of the weight's K=64\), got a scalar"
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(LowPrecisionError, match=msg):
            F.linear(torch.tensor(1.0), w)


# --- 3. torch's rule for a bias that is not [N] --------------------------------------------------


N, K = 8, 16


def _x(shape: tuple[int, ...], contiguous: bool) -> torch.Tensor:
    if contiguous:
        return torch.randn(shape)
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


def _bias(shape: tuple[int, ...], layout: str) -> torch.Tensor:
    if layout == "strided" and shape:
        return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    if layout == "expanded":
        return torch.randn(()).expand(shape)
    return torch.randn(shape)


X_SHAPES = [(K,), (3, K), (2, 3, K), (3, 2, K), (1, 1, K), (0, 2, K), (2, 1, 3, K)]
B_SHAPES = [
    (),
    (1,),
    (N,),
    (3,),
    (1, N),
    (1, 1),
    (3, 1),
    (6, 1),
    (N, 1),
    (2, N),
    (3, N),
    (6, N),
    (1, 1, N),
    (1, 1, 1),
    (2, 3, N),
    (3, 2, N),
    (2, 1, N),
    (2, 3, 1),
    (1, 3, 2, N),
]


@pytest.mark.parametrize("x_contiguous", [True, False], ids=["x_contig", "x_strided"])
@pytest.mark.parametrize("x_shape", X_SHAPES, ids=lambda s: "x" + "x".join(map(str, s)))
def test_a_bias_is_taken_as_torch_takes_it(x_shape: tuple[int, ...], x_contiguous: bool) -> None:
    """Accepted or refused, and the result's shape and values, as torch's ``F.linear`` with the
    dequantized weight, for biases of 0-4 dimensions, contiguous, strided or expanded."""
    torch.manual_seed(4)
    q = Float8Tensor.from_float(torch.randn(N, K))
    wd = q.dequantize()
    for b_shape, layout in itertools.product(B_SHAPES, ("contiguous", "strided", "expanded")):
        x, b = _x(x_shape, x_contiguous), _bias(b_shape, layout)
        try:
            want = F.linear(x, wd, b)
        except RuntimeError:
            want = None
        case = (x_shape, x_contiguous, b_shape, layout)
        with torch.no_grad():
            if want is None:
                with pytest.raises((LowPrecisionError, GemvInputError), match="bias"):
                    F.linear(x, q, b)
                continue
            got = F.linear(x, q, b)
        assert got.shape == want.shape, case
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(case))


def test_a_1d_input_with_a_row_bias_and_a_rows_bias_refused() -> None:
    """The reviewer's cases: ``[K]`` with ``[1, N]`` gives ``[N]`` (was a GemvInputError), with
    gradients; a contiguous ``[2, 3, K]`` refuses ``[3, 1]`` (torch adds it to the ``[6, N]``
    rows), a strided one takes it (torch adds it to the output)."""
    torch.manual_seed(5)
    k = 32  # (an MX block)
    for q in (
        Float8Tensor.from_float(torch.randn(N, k)),
        NVFP4Tensor.from_float(torch.randn(N, k), act_per_tensor_scale=True),
        MXTensor.from_float(torch.randn(N, k)),
    ):
        x = torch.randn(k)
        b = torch.randn(1, N, requires_grad=True)
        y = F.linear(x, q, b)
        with torch.no_grad():
            plain = F.linear(x, q)
        assert y.shape == (N,)
        torch.testing.assert_close(y.detach(), plain + b.detach()[0])
        y.sum().backward()
        assert torch.equal(b.grad, torch.ones(1, N))
        b31 = torch.randn(3, 1)
        with torch.no_grad():
            msg = r"the bias must broadcast to the product as rows \(6, 8\) .* got shape \(3, 1\)"
            with pytest.raises(LowPrecisionError, match=msg):
                F.linear(torch.randn(2, 3, k), q, b31)
            xs = torch.randn(2, 3, 2 * k)[..., ::2]
            torch.testing.assert_close(F.linear(xs, q, b31), F.linear(xs, q) + b31)


# --- 4. a meta weight quantized to NVFP4 with a per-tensor scale ---------------------------------


def test_nvfp4_of_a_meta_weight_is_refused_before_its_amax_is_read() -> None:
    msg = "nvfp4_quantize: input must be on cpu, got meta"
    with pytest.raises(LowPrecisionError, match=msg):
        NVFP4Tensor.from_float(torch.empty(32, 64, device="meta"))
    for cfg in (NVFP4WeightOnlyConfig(), NVFP4DynamicActivationNVFP4WeightConfig()):
        lin = torch.nn.Linear(64, 32, device="meta")
        with pytest.raises(LowPrecisionError, match=msg):
            torchport.quantize_(lin, cfg)
    # a meta activation with a dynamic per-tensor scale
    w = NVFP4Tensor.from_float(torch.randn(32, 64), act_per_tensor_scale=True)
    for rows in (2, 12):
        with torch.no_grad(), pytest.raises(LowPrecisionError, match=msg):
            F.linear(torch.randn(rows, 64, device="meta"), w)
