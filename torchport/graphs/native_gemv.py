"""Native replay tier, decode GEMV: ``torchport::gemv_packed`` / ``gemv_dense`` as direct C calls.

A quantized ``nn.Linear`` (NVFP4, MX, FP8 weights; :mod:`torchport.lowp`) called during a capture
records one ``torchport::gemv_packed`` op on plain tensors (packed data, scales, row scales); a
decode-shaped linear routed by ``torchport.compile`` records ``torchport::gemv_dense``. Here each
becomes a call, from the graph's C function, to the very kernel :func:`torchport.gemv.gemv_packed`
runs in eager mode for that problem (same launch plan, :func:`torchport.gemv.ops.native_launch`;
an all-threads plan on torch's thread count at replay), passed to the program as a function
pointer: replay reproduces the eager results bit for bit and no Python runs per linear.

Supported: float32 activations whose rows are contiguous, a float32 contiguous 1-D bias or none,
float32 contiguous output. Anything else (bfloat16 activations, a dense weight where ``F.linear``
won the tuning, native kernels off) leaves the capture to the TorchScript tier, which calls the
custom op through the dispatcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GEMV_ENTRY_TYPEDEF", "emit_gemv"]

# The exported signature shared by every GEMV kernel (torchport.gemv.kernels / fp4_kernel).
GEMV_ENTRY_TYPEDEF = (
    "typedef int (*tp_gemv_t)(const float *x, int64_t B, int64_t K, const void *w,\n"
    "    const uint8_t *scales, const float *rowscale, double pts, const float *bias,\n"
    "    int64_t has_bias, float *out, int64_t N, int64_t nthreads);\n"
)


def _contiguous(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.device.type == "cpu"


def _ptr(cg: Any, t: torch.Tensor | None) -> str:
    """C pointer to ``t``'s first element (``NULL`` for an absent or empty tensor)."""
    if t is None or t.numel() == 0:
        return "NULL"
    return cg.ref(t)[0]


def emit_gemv(cg: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
    """Emit the kernel call for a recorded ``gemv_packed`` / ``gemv_dense`` op."""
    from torchport.gemv.kernels import NONFINITE_STATUS, GemvKernel
    from torchport.gemv.ops import PackedWeight, _native_plan, native_launch, pack_dense

    names = (
        ("x", "w", "bias")
        if name == "gemv_dense"
        else ("x", "data", "scales", "rowscale", "pts", "fmt", "n", "k", "bias", "allow_int8")
    )
    a = dict(zip(names, args))
    a.update(kwargs)
    x, bias = a["x"], a.get("bias")
    # (gemv_packed's allow_int8 holds the pack's int8 flag too: see ops._gemv_checked)
    int8 = bool(a.get("allow_int8", True))
    if name == "gemv_dense":
        if not _contiguous(a["w"]):
            raise cg.unsupported("gemv_dense on a strided weight")
        pw = pack_dense(a["w"])
    else:
        data, scales, rowscale = a["data"], a["scales"], a["rowscale"]
        if not all(_contiguous(t) for t in (data, scales, rowscale)):
            raise cg.unsupported("gemv_packed on strided weight storage")
        pw = PackedWeight(a["fmt"], data, scales, rowscale, float(a["pts"]), a["n"], a["k"], int8)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not _contiguous(out):
        raise cg.unsupported("gemv output (float32, contiguous)")
    if x.dtype != torch.float32 or not _contiguous(x) or x.shape[-1] != pw.k:
        raise cg.unsupported("gemv activation (float32, contiguous rows)")
    if bias is not None and (
        bias.dtype != torch.float32 or not _contiguous(bias) or bias.shape != (pw.n,)
    ):
        raise cg.unsupported("gemv bias (float32, contiguous)")
    rows = x.numel() // pw.k if pw.k else 0
    launch = native_launch(pw, rows, int8)
    if launch is None:
        raise cg.unsupported("gemv without a native kernel for this problem")
    kernel = launch[0]
    plan = _native_plan(pw, rows, int8)  # native_launch's plan (cached), for its thread setting
    assert plan is not None
    # 1: one thread; 0: all of torch's threads, counted at replay as eager counts them per call
    # (native_launch's count, taken at capture, ran a replay after set_num_threads(1) on two)
    threads = str(plan.threads) if plan.threads else cg.replay_threads()
    fid = cg.add_fn(kernel._fn)  # type: ignore[attr-defined]
    code = cg.error(f"{name}: kernel {pw.fmt} (N={pw.n}, K={pw.k}) failed")
    call = (
        f"({cg.ref(x)[0]}, {rows}, {pw.k}, {_ptr(cg, pw.data)}, {_ptr(cg, pw.scales)}, "
        f"{_ptr(cg, pw.rowscale)}, {pw.pts!r}, {_ptr(cg, bias)}, {int(bias is not None)}, "
        f"{cg.ref(out)[0]}, {pw.n}, {threads})"
    )
    twin = kernel.float_twin() if isinstance(kernel, GemvKernel) else None
    if twin is None:
        cg.lines.append(f"  if (((tp_gemv_t)F[{fid}]){call}) return {code};")
        return
    # an int8-activation kernel hands non-finite activations back: its format's float kernel
    tid = cg.add_fn(twin._fn)
    cg.lines.append(f"  {{ int s_ = ((tp_gemv_t)F[{fid}]){call};")
    cg.lines.append(f"    if (s_ == {NONFINITE_STATUS}) s_ = ((tp_gemv_t)F[{tid}]){call};")
    cg.lines.append(f"    if (s_) return {code}; }}")
