"""FP8 decode GEMVs with activations of any finite magnitude (review of session 46).

The float kernel multiplied the activations by the raw FP8 code values (E5M2 up to 57344, E4M3
decoded as ``value * 2**-8`` and the row sum times 256 in float32) and applied the row scale
last: from ``|x| ~ 6e33`` (E5M2) or ``~ 1e36`` (E4M3) the float32 products or sums overflowed
to infinity where ``F.linear(x, dequantized_weight)`` is finite; the shift-decode E4M3 kernel's
``K % 32`` tail did the same from ``|x| ~ 7.6e35``, and so could the ``vdpbf16ps`` E4M3 kernels
(AVX512-BF16) with bf16-valued activations. Results must be finite wherever the float32
reference is, and within the GEMV's stated tolerance of the float64 one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchport import config, native
from torchport.gemv import gemv_reference
from torchport.gemv import ops as gops
from torchport.gemv.bf16_kernel import amx_dp_ready, gemv_bf16_dp_kernel
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.kernels import gemv_kernel
from torchport.lowp import Float8Tensor, Float8WeightOnlyConfig, quantize_

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# from subnormal activations to the float32 maximum
MAGNITUDES = [1e-44, 1e-30, 1.0, 1e20, 1e34, 1e37, 3e38]


def _kernels(fmt: str) -> dict[str, object]:
    """Every FP8 GEMV kernel this CPU runs for ``fmt``: the float kernel (one-row and four-row
    loops, and its scalar build) and, for E4M3, the shift-decode kernel's builds and, with
    AVX512-BF16, the ``vdpbf16ps`` ones (which take bf16-valued activations)."""
    info = native.cpu_info()
    out: dict[str, object] = {"scalar": gemv_kernel(fmt, "scalar", 512, 0)}
    if info.isa != "scalar":
        out |= {f"float_r{r}": gemv_kernel(fmt, info.isa, 512, r) for r in (0, 1)}
        if fmt == "fp8_e4m3":
            shift = {
                f"shift_r{r}": gemv_fp8_shift_kernel(info.isa, 2048, rows=r) for r in (1, 2, 4)
            }
            out |= shift
    if fmt == "fp8_e4m3" and info.isa == "avx512" and info.has_avx512_bf16:
        out["dp"] = gemv_bf16_dp_kernel("avx512", weights=fmt)
        if amx_dp_ready():
            out["dpamx"] = gemv_bf16_dp_kernel("avx512", weights=fmt, amx=True)
    return out


def _run(kern: object, x: torch.Tensor, pw: gops.PackedWeight) -> torch.Tensor:
    """One kernel call as the GEMV makes it (a call handed back runs on the float kernel)."""
    out = torch.empty(x.shape[0], pw.n)
    gops._launch(kern, x, pw, None, out, 2)
    return out


def _check(out: torch.Tensor, x: torch.Tensor, wd: torch.Tensor, what: str) -> None:
    fin = F.linear(x, wd).isfinite()  # (beyond float32's range the result may be infinite)
    assert bool(out.isfinite()[fin].all()), f"{what}: inf/NaN where F.linear is finite"
    err = (out.double() - gemv_reference(x.double(), wd.double())).abs()[fin]
    mag = (x.double().abs() @ wd.double().abs().T)[fin]
    worst = float((err / (mag + 1e-300)).max()) if err.numel() else 0.0
    assert bool((err <= 1e-5 * mag + 1e-30).all()), f"{what}: relative error {worst}"


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape", [(9, 31), (37, 100), (21, 1056)], ids=str)  # tails, K blocks
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fp8_gemv_kernels_take_activations_of_any_magnitude(fmt, shape, rows) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * k + rows)
    w = Float8Tensor.from_float(torch.randn(n, k, generator=g) * 1e-3, FP8[fmt[4:]], "row")
    pw, wd = w.gemv_pack(), w.dequantize()
    for name, kern in _kernels(fmt).items():
        for mag in MAGNITUDES:
            x = torch.randn(rows, k, generator=g)
            x = (x / x.abs().amax(1, keepdim=True) * mag).bfloat16().float()  # (dp: bf16 values)
            _check(_run(kern, x, pw), x, wd, f"{name} |x|={mag}")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_gemv_rows_of_different_magnitudes_in_one_call(fmt) -> None:
    """Each activation row is rescaled on its own (a row within range is read as it is)."""
    g = torch.Generator().manual_seed(3)
    w = Float8Tensor.from_float(torch.randn(24, 160, generator=g) * 1e-3, FP8[fmt[4:]], "row")
    pw, wd = w.gemv_pack(), w.dequantize()
    mags = torch.tensor([3e38, 1e-44, 1.0, 1e34, 1e-30, 7.0, 2.0**64, 2.0**-64]).reshape(8, 1)
    x = torch.randn(8, 160, generator=g)
    x = (x / x.abs().amax(1, keepdim=True) * mags).bfloat16().float()
    for name, kern in _kernels(fmt).items():
        _check(_run(kern, x, pw), x, wd, name)


@pytest.mark.parametrize("dtype", list(FP8), ids=str)
@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("isa", ["native", "scalar"])
def test_fp8_linear_decode_matches_f_linear_for_huge_activations(dtype, granularity, isa) -> None:
    """The public path: an ``nn.Linear`` quantized to FP8 (weight-only), one to eight rows."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(100, 48, bias=False)
    quantize_(lin, Float8WeightOnlyConfig(dtype=FP8[dtype], granularity=granularity))
    wd = lin.weight.dequantize()
    with config.override(**({} if isa == "native" else {"isa": isa})), torch.no_grad():
        for rows in range(1, 9):
            for mag in (1e34, 1e37, 3e38, 1e-44):
                x = torch.randn(rows, 100)
                x = x / x.abs().amax(1, keepdim=True) * mag
                _check(lin(x), x, wd, f"{rows} rows |x|={mag}")
