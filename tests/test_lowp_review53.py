"""Review 53 of the quantized weights' decode GEMV.

1. A weight of at least ``HUGEPAGE_MIN_BYTES`` moved its codes to huge pages at its first
   decode call and rebound ``qdata``, also where the caller held the buffers it was built from
   (only another quantized tensor on the same storage kept it in place): a loader writing new
   codes and scales into those buffers in place left the weight reading its old codes beside
   the new scales (scales under a quarter of the size stayed shared). A weight now moves only
   where every inner tensor is its own alone, and then all of them or none.
2. An FP8 weight whose row scale times a code overflows float32 (an infinite scale among them):
   the decode GEMV (at most 8 rows) multiplied the row's float32 sum by the scale, ±inf, where
   ``F.linear`` on the dequantized weight and the prefill route give NaN for inf · 0 and
   inf − inf. Those rows' outputs are now torch's on every decode route (eager, settled route,
   ``gemv``, the custom op under autograd and ``torch.compile``, a captured graph).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchport
from torchport import config, lowp
from torchport.gemv import gemv
from torchport.gemv.hugepages import HUGE
from torchport.graphs import Graph
from torchport.lowp import Float8Tensor, NVFP4Tensor, fp8_dequantize, fp8_quantize_activation
from torchport.lowp import tensors as T


@pytest.fixture(autouse=True)
def _untuned():
    """The tuner's defaults: the numerics do not depend on the launch parameters."""
    with config.override(autotune=False):
        yield


# --- 1. huge pages only for memory the weight holds alone ----------------------------------------

N, K = 64, 256  # NVFP4: 8 KiB of codes, 1 KiB of block scales


def _codes(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 codes and block scales of a random weight, each its own storage."""
    g = torch.Generator().manual_seed(seed)
    q, s = lowp.nvfp4_quantize(torch.randn(N, K, generator=g))
    return q.clone(), s.clone()


def _moved(t: torch.Tensor) -> bool:
    return t.data_ptr() % HUGE == 0


@pytest.fixture(params=["codes", "all"], ids=["codes-only-large", "codes-and-scales-large"])
def huge(request, monkeypatch):
    """The move threshold: at the codes' size (the scales, an eighth of it, stay where they
    are, as in the report: 4096x2048) or 0 (both move)."""
    at = N * K // 2 if request.param == "codes" else 0
    monkeypatch.setattr(T, "HUGEPAGE_MIN_BYTES", at)
    with config.override(gemv_hugepages=True):
        yield request.param


@pytest.mark.parametrize("held", ["both", "codes", "scales", "view", "slice"])
def test_a_weight_keeps_reading_the_buffers_the_caller_writes(held, huge) -> None:
    """The caller builds the weight from buffers it keeps (``held``: both, one of them, a view of
    the codes, a larger buffer the codes are a slice of), decodes once, then writes new codes
    and scales into its buffers in place (a weight-sync loader): the next decode reads them.
    Before, the first call moved the codes (and scales from a quarter of the threshold) and
    the weight read its old codes beside the new scales."""
    qa, sa = _codes(1)
    qb, sb = _codes(2)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3))
    codes = qa
    if held == "slice":
        buf = torch.zeros(2 * N, K // 2, dtype=torch.uint8)
        buf[:N] = qa
        codes = buf[:N]
    holds_scales = held in ("both", "scales")
    w = NVFP4Tensor(codes, sa if holds_scales else sa.clone(), None, torch.float32)
    kept = {
        "both": [codes, sa],
        "codes": [codes],
        "scales": [sa],
        "view": [codes[: N // 2]],
        "slice": [codes._base],
    }[held]
    del qa, sa, codes  # (what is not in kept: the weight's alone)
    ptrs = (w.qdata.data_ptr(), w.scale.data_ptr())
    with torch.no_grad():
        F.linear(x, w)
    with torch.no_grad():  # the caller's in-place load, through what it holds
        if held in ("both", "codes"):
            kept[0].copy_(qb)
        elif held == "view":
            kept[0].copy_(qb[: N // 2])
            w.qdata[N // 2 :].copy_(qb[N // 2 :])
        elif held == "slice":
            kept[0][:N].copy_(qb)
        else:
            w.qdata.copy_(qb)
        (kept[-1] if holds_scales else w.scale).copy_(sb)
        ref = NVFP4Tensor(qb.clone(), sb.clone(), None, torch.float32)
        assert torch.equal(F.linear(x, w), F.linear(x, ref))
    # nothing moved: not the held tensor, and not the other one beside it (all or nothing)
    assert (w.qdata.data_ptr(), w.scale.data_ptr()) == ptrs
    assert not _moved(w.qdata) and not _moved(w.scale)


@pytest.mark.parametrize("how", ["quantize_", "from_float"])
@pytest.mark.parametrize(
    "cfg",
    [
        lowp.NVFP4WeightOnlyConfig(),
        lowp.Float8WeightOnlyConfig(),
        lowp.Float8WeightOnlyConfig(granularity="tensor"),
        lowp.MXWeightOnlyConfig(),
        lowp.NVFP4DynamicActivationNVFP4WeightConfig(),
    ],
    ids=["nvfp4", "fp8-row", "fp8-tensor", "mxfp4", "nvfp4-act"],
)
def test_a_freshly_quantized_weight_still_moves_to_huge_pages(cfg, how, monkeypatch) -> None:
    """The common case keeps its huge pages: a weight quantized by ``quantize_`` (owned by the
    module) or ``from_float`` holds its inner tensors alone and moves at its first decode call,
    codes and (one-byte) scales together, with the values it had."""
    monkeypatch.setattr(T, "HUGEPAGE_MIN_BYTES", 0)
    torch.manual_seed(4)
    m = nn.Linear(K, N)
    if how == "quantize_":
        torchport.quantize_(m, cfg)
        w = m.weight
    else:
        kind = type(cfg).__name__
        if kind.startswith("NVFP4"):
            w = NVFP4Tensor.from_float(m.weight.detach())
        elif kind.startswith("Float8"):
            w = Float8Tensor.from_float(m.weight.detach(), granularity=cfg.granularity)
        else:
            w = lowp.MXTensor.from_float(m.weight.detach())
    before = w.dequantize()
    x = torch.randn(1, K)
    with config.override(gemv_hugepages=True), torch.no_grad():
        F.linear(x, w)
    assert _moved(w.qdata)
    assert _moved(w.scale) == (w.scale.element_size() == 1)  # (FP8's float32 scale stays)
    assert torch.equal(w.dequantize(), before)


# --- 2. FP8 row scales past float32's range --------------------------------------------------------

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
BAD_ROWS = (1, 4)


def _fp8_weight(
    dtype: torch.dtype, gran: str, value: float, act: torch.dtype | None = None
) -> Float8Tensor:
    """An FP8 ``[6, 64]`` weight whose codes are all positive (so a positive activation gives
    torch's +inf, not NaN, in a row scaled past float32) with rows :data:`BAD_ROWS` (row-wise)
    or the whole tensor scaled by ``value``."""
    g = torch.Generator().manual_seed(5)
    q = Float8Tensor.from_float(torch.rand(6, 64, generator=g) + 0.1, dtype, gran)
    s = q.scale.clone()
    if gran == "row":
        s[list(BAD_ROWS)] = value
    else:
        s.fill_(value)
    return Float8Tensor(q.qdata, s, torch.float32, act)


def _activations(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(rows, 64, generator=g)
    return [x.abs() + 0.1, x]  # one sign (torch: ±inf), both signs (torch: NaN)


def _agree(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The same NaN, +inf and -inf entries, the finite ones equal within float32 rounding."""
    out, ref = out.float(), ref.float()
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(out), kind(ref)), (kind.__name__, out, ref)
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e36])
@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_fp8_scale_past_float32_decode_matches_torch(dtype, gran, value) -> None:
    """Every decode route, and the prefill (9 rows), gives ``F.linear(x, w.dequantize())``'s
    NaN and infinities: eager (first call and settled route), ``gemv``, an activation that
    requires grad (the custom op), inference mode, bf16 activations, with and without bias.
    1e36 times E4M3's 448 or E5M2's 57344 overflows float32 too: the dequantized weight holds
    ±inf there."""
    w = _fp8_weight(dtype, gran, value)
    wd = w.dequantize()
    for rows in (2, 9):
        for x in _activations(rows):
            for bias in (None, torch.randn(6)):
                ref = F.linear(x, wd, bias)
                with torch.no_grad():
                    _agree(F.linear(x, w, bias), ref)
                    _agree(F.linear(x, w, bias), ref)  # (the settled route)
                    if rows <= 8:
                        _agree(gemv(x, w, bias), ref)
                    with torch.inference_mode():
                        _agree(F.linear(x, w, bias), ref)
                    xb = x.bfloat16()
                    _agree(F.linear(xb, w, bias), F.linear(xb.float(), wd, bias).bfloat16())
                xg = x.clone().requires_grad_()
                _agree(F.linear(xg, w, bias).detach(), ref)
                if rows <= 8:
                    _agree(gemv(xg, w, bias).detach(), ref)


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("gran", ["row", "tensor"])
def test_fp8_dynamic_activation_with_an_infinite_scale_matches_torch(gran, value) -> None:
    """With FP8 activations (quantized per call), decode (the dequantized activation through the
    GEMV) and prefill (``scaled_mm``, which scales the operands first as ``torch._scaled_mm``)
    give torch's values for the quantized activation and weight at every batch size."""
    w = _fp8_weight(E4, gran, value, act=E4)
    for rows in (1, 9):
        for x in _activations(rows):
            xq, xs = fp8_quantize_activation(x, E4, gran)
            ref = F.linear(fp8_dequantize(xq, xs), w.dequantize())
            with torch.no_grad():
                _agree(F.linear(x, w), ref)
                _agree(F.linear(x, w), ref)


@pytest.mark.parametrize(("gran", "value"), [("row", float("inf")), ("tensor", float("-inf"))])
def test_fp8_infinite_scale_under_compile_matches_torch(gran, value) -> None:
    """``torch.compile`` traces the decode to the ``gemv_packed`` custom op on a pack it builds
    per call: the op finds the overflowing rows when it runs (it gave ±inf)."""
    w = _fp8_weight(E4, gran, value)
    f = torch.compile(lambda a: F.linear(a, w), backend="eager")
    for x in _activations(2):
        with torch.no_grad():
            _agree(f(x), F.linear(x, w.dequantize()))


def test_fp8_infinite_scale_in_a_captured_graph_matches_torch() -> None:
    """A captured graph's native tier called the kernel alone (±inf): such a weight's GEMV is
    left to the tier that calls the custom op, whose replay gives torch's values."""
    w = _fp8_weight(E4, "row", float("inf"))
    x = torch.zeros(2, 64)
    gr = Graph()
    with torch.no_grad(), gr:
        y = F.linear(x, w)
    assert gr.tier != "native"
    for new in _activations(2):
        x.copy_(new)
        gr.replay()
        _agree(y, F.linear(x, w.dequantize()))
