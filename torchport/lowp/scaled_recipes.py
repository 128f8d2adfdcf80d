"""``torch.nn.functional.scaled_mm`` (2.14's recipe-based scaled GEMM) on the CPU.

2.14's ``F.scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a,
swizzle_b, bias, output_dtype, contraction_dim, use_fast_accum)`` names each operand's scaling
with a :class:`ScalingType` (torch's own enum, re-exported here) and runs the block-scaled recipes
only on CUDA (torch 2.13's CPU build takes tensor-wise and row-wise FP8 and refuses the rest).
:func:`scaled_mm` takes the same arguments and runs every recipe pair torch's CUDA path accepts:

============================  ===========================  ======================================
recipes (a, b)                operands                     scales (per operand)
============================  ===========================  ======================================
TensorWise, TensorWise        float8                       float32, one element
RowWise, RowWise              float8                       float32 ``(M, 1)`` and ``(1, N)``
BlockWise1x16 (NVFP4)         ``float4_e2m1fn_x2``         float8_e4m3fn, one per 16 along K,
                                                           optionally ``[blocks, global]`` with
                                                           recipes ``[BlockWise1x16, TensorWise]``
BlockWise1x32 (MX)            float8 or float4_e2m1fn_x2   float8_e8m0fnu, one per 32 along K
BlockWise1x128 / 128x128      float8                       float32 (DeepSeek-style blocks; a's
                                                           ``(M, ⌈K/128⌉)``, b's ``(⌈K/128⌉, N)``
                                                           or ``(⌈K/128⌉, ⌈N/128⌉)``)
============================  ===========================  ======================================

``mat_b`` is ``[K, N]`` (for FP4, ``[K/2, N]`` bytes), usually the transpose of a row-major weight
``[N, K]``; a block-scaled operand's scales follow that row-major matrix (rows ``M`` for ``a``,
``N`` for ``b``), as torch's. ``SwizzleType.SWIZZLE_32_4_4`` scales are in the cuBLAS blocked
layout (rows padded to 128, scale columns to 4; see :func:`to_blocked_scales`); ``NO_SWIZZLE`` (or
``swizzle=None``) scales are row-major ``[rows, ⌈K/block⌉]``, padded or not. The CUDA build
insists on swizzled NVFP4 scales; here both layouts are taken.

How it runs: tensor-wise and row-wise FP8 go to :func:`torchport.scaled_mm` (the native FP8 GEMV
at M ≤ 8, the GEMM engine's panels above). A block-scaled ``a`` is dequantized natively first;
NVFP4 and MX ``b`` is read in place by the decode GEMV at M ≤ 8 and goes through
:func:`torchport.lowp.block_scaled_mm` above (native per-panel dequantization, engine GEMM). The 1x128 / 128x128 recipes
dequantize ``a`` and decode ``b`` one float32 row panel at a time (thread scratch) for the
autotuned panel GEMM of ``block_scaled_mm``. Float32 accumulation throughout; ``bias`` is added in
float32 before the cast to ``output_dtype``. ``use_fast_accum`` is accepted and changes nothing.
:func:`scaled_mm_reference` is the float64 reference the tests compare against.

Weights multiplied again and again are better kept as :class:`~torchport.lowp.NVFP4Tensor` /
:class:`~torchport.lowp.MXTensor` (``torchport.quantize_``): those keep their packed form for the
decode GEMV and the prefill panels across calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as _F

from torchport import gemm, native
from torchport.gemv import MAX_ROWS, gemv_packed
from torchport.lowp import mx, nvfp4
from torchport.lowp.formats import (
    FP8_DTYPES,
    LowPrecisionError,
    e2m1_to_f32,
    e4m3_to_f32,
    e8m0_to_f32,
    unpack_fp4,
)
from torchport.lowp.scaled_mm import OUT_DTYPES, _panel_gemm, block_scaled_mm
from torchport.lowp.scaled_mm import scaled_mm as _scaled_mm

if TYPE_CHECKING:  # (imported where used: tensors imports this package's modules)
    from torchport.lowp.tensors import LowPrecisionTensor

ScalingType = _F.ScalingType
SwizzleType = _F.SwizzleType

FP4 = torch.float4_e2m1fn_x2
_BLOCK = {ScalingType.BlockWise1x16: 16, ScalingType.BlockWise1x32: 32}
_SCALE_DTYPE = {
    ScalingType.BlockWise1x16: torch.float8_e4m3fn,
    ScalingType.BlockWise1x32: torch.float8_e8m0fnu,
}
# (recipe of a, recipe of b) pairs torch's CUDA path accepts (the NVFP4 two-level form is
# BlockWise1x16 with a TensorWise second scale on each side)
PAIRS = (
    (ScalingType.TensorWise, ScalingType.TensorWise),
    (ScalingType.RowWise, ScalingType.RowWise),
    (ScalingType.BlockWise1x16, ScalingType.BlockWise1x16),
    (ScalingType.BlockWise1x32, ScalingType.BlockWise1x32),
    (ScalingType.BlockWise1x128, ScalingType.BlockWise1x128),
    (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128),
    (ScalingType.BlockWise128x128, ScalingType.BlockWise1x128),
)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil(a, b) * b


# --- the cuBLAS blocked scale layout (SWIZZLE_32_4_4) --------------------------------------------


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major block scales ``[rows, cols]`` → the flat ``SWIZZLE_32_4_4`` layout.

    Rows are padded with zeros to a multiple of 128 and columns to a multiple of 4; each 128 × 4
    tile (tiles in row-major order) is stored as 32 lines of 16 bytes, line ``r % 32`` holding
    the tile's rows ``r % 32``, ``+32``, ``+64``, ``+96``, four scales each. That is where a
    Blackwell tensor core reads them (cuBLAS "1D block scaling factors layout")."""
    if scales.dim() != 2:
        raise LowPrecisionError(f"to_blocked_scales: scales must be 2-D, got {tuple(scales.shape)}")
    rows, cols = scales.shape
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    u = _bytes(scales)  # one-byte scales moved as uint8 (float8 has few CPU kernels)
    padded = u.new_zeros(rp, cp)
    padded[:rows, :cols] = u
    # [row tile, r4, r32, col tile, c] -> [row tile, col tile, r32, r4, c]
    tiles = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(scales.dtype)


def from_blocked_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked_scales`: the ``[rows, cols]`` scales of a blocked layout."""
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    if blocked.numel() != rp * cp:
        raise LowPrecisionError(
            f"from_blocked_scales: a swizzled scale for {rows} rows x {cols} blocks must have "
            f"{rp} * {cp} = {rp * cp} elements, got {blocked.numel()}"
        )
    tiles = _bytes(blocked).reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, cp)[:rows, :cols].view(blocked.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


# --- argument normalisation and checks -----------------------------------------------------------


def _as_list(v: Any) -> list[Any]:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _err(msg: str) -> LowPrecisionError:
    return LowPrecisionError(f"scaled_mm: {msg}")


def _check_cpu(name: str, t: torch.Tensor) -> None:
    # (the kernels read data pointers as host memory; a meta operand has none to read)
    if t.device.type != "cpu":
        raise _err(f"{name} must be on cpu, got {t.device}")


class _Operand:
    """One operand as the row-major matrix ``[rows, K]`` its scales describe, its recipe and its
    scales (block scales unswizzled to ``[rows, ⌈K/block⌉]``)."""

    def __init__(
        self,
        name: str,
        mat: torch.Tensor,
        rows_major: torch.Tensor,
        scales: list[Any],
        recipes: list[Any],
        swizzles: list[Any],
        k: int,
    ) -> None:
        self.name, self.mat, self.data, self.k = name, mat, rows_major, k
        self.rows = rows_major.shape[0]
        if not scales or len(scales) != len(recipes):
            raise _err(
                f"{name}: give one scale per recipe, got {len(scales)} scale(s) and "
                f"{len(recipes)} recipe(s)"
            )
        if swizzles and len(swizzles) != len(scales):
            raise _err(
                f"swizzle_{name[-1]} must have {len(scales)} value(s) (one per scale) or be "
                f"None, got {len(swizzles)}"
            )
        for r in recipes:
            if not isinstance(r, ScalingType):
                raise _err(f"scale_recipe_{name[-1]} entries must be ScalingType, got {r!r}")
        for s in swizzles:
            if not isinstance(s, SwizzleType):
                raise _err(f"swizzle_{name[-1]} entries must be SwizzleType, got {s!r}")
        for i, s in enumerate(scales):
            if not isinstance(s, torch.Tensor):
                raise _err(f"scale_{name[-1]} must be tensors, got {type(s).__name__}")
            _check_cpu(f"scale_{name[-1]}" + (f"[{i}]" if len(scales) > 1 else ""), s)
        self.recipe = recipes[0]
        self.global_scale: torch.Tensor | None = None
        if len(recipes) == 2:
            if tuple(recipes) != (ScalingType.BlockWise1x16, ScalingType.TensorWise):
                raise _err(
                    f"{name}: two scales are the NVFP4 form [BlockWise1x16, TensorWise], got "
                    f"{[r.name for r in recipes]}"
                )
            g = scales[1]
            if g.dtype != torch.float32 or g.numel() != 1:
                raise _err(
                    f"{name}: the TensorWise global scale must be one float32 element, got "
                    f"{g.dtype} {tuple(g.shape)}"
                )
            self.global_scale = g
        elif len(recipes) > 2:
            raise _err(f"{name}: at most two scales (NVFP4 blocks + global), got {len(recipes)}")
        swz = swizzles[0] if swizzles else SwizzleType.NO_SWIZZLE
        self.scale = self._check_scale(scales[0], swz)

    def _check_scale(self, s: torch.Tensor, swz: Any) -> torch.Tensor:
        r, name, k, rows = self.recipe, self.name, self.k, self.rows
        fp4 = self.mat.dtype == FP4
        if r in _BLOCK:
            block = _BLOCK[r]
            if r == ScalingType.BlockWise1x16 and not fp4:
                raise _err(
                    f"{name}: BlockWise1x16 (NVFP4) needs float4_e2m1fn_x2 data, got {self.mat.dtype}"
                )
            if r == ScalingType.BlockWise1x32 and not (fp4 or self.mat.dtype in FP8_DTYPES):
                raise _err(
                    f"{name}: BlockWise1x32 (MX) needs float8 or float4_e2m1fn_x2 data, got "
                    f"{self.mat.dtype}"
                )
            want = _SCALE_DTYPE[r]
            if s.dtype not in (want, torch.uint8):
                raise _err(f"{name}: {r.name} scales must be {want}, got {s.dtype}")
            cols = _ceil(k, block)
            if swz == SwizzleType.SWIZZLE_32_4_4:
                if not s.is_contiguous():
                    raise _err(f"{name}: swizzled scales must be contiguous")
                return from_blocked_scales(s.reshape(-1), rows, cols)
            if tuple(s.shape) == (rows, cols):
                return s
            rp, cp = _round_up(rows, 128), _round_up(cols, 4)
            if tuple(s.shape) == (rp, cp):  # the padded row-major form
                return s[:rows, :cols]
            # flat, either form; any other shape would be read in another orientation (a b
            # operand's [K blocks, N] as [N, K blocks]), so it is refused
            if s.dim() == 1 and s.numel() == rows * cols:
                return s.reshape(rows, cols)
            if s.dim() == 1 and s.numel() == rp * cp:
                return s.reshape(rp, cp)[:rows, :cols]
            raise _err(
                f"{name}: {r.name} scales (NO_SWIZZLE) must be [{rows}, {cols}] (one per {block} "
                f"along K={k}, {rows} rows), padded [{rp}, {cp}], or either flattened, got "
                f"{tuple(s.shape)}"
            )
        if fp4 or self.mat.dtype not in FP8_DTYPES:
            raise _err(f"{name}: {r.name} scaling needs float8 data, got {self.mat.dtype}")
        if swz != SwizzleType.NO_SWIZZLE:  # (torch's CPU build refuses every swizzle)
            raise _err(
                f"{name}: a swizzle applies to BlockWise1x16 / BlockWise1x32 scales only, got "
                f"{swz.name} for {r.name}"
            )
        if s.dtype != torch.float32:
            raise _err(f"{name}: {r.name} scales must be float32, got {s.dtype}")
        if r == ScalingType.TensorWise:
            if s.numel() != 1:
                raise _err(f"{name}: a TensorWise scale has one element, got {tuple(s.shape)}")
            return s.reshape(())  # (any shape of one element; b's is transposed below)
        if r == ScalingType.RowWise:
            want_shape = (rows, 1) if name == "mat_a" else (1, rows)
        elif r == ScalingType.BlockWise1x128:
            want_shape = (rows, _ceil(k, 128)) if name == "mat_a" else (_ceil(k, 128), rows)
        else:  # BlockWise128x128
            want_shape = (
                (_ceil(rows, 128), _ceil(k, 128))
                if name == "mat_a"
                else (_ceil(k, 128), _ceil(rows, 128))
            )
        if tuple(s.shape) != want_shape:
            raise _err(f"{name}: {r.name} scale must have shape {want_shape}, got {tuple(s.shape)}")
        # b's scales are given in b's [K, N] orientation: keep them as [rows (N), K blocks]
        return s if name == "mat_a" else s.t()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The operand's values ``[rows, K]`` in ``dtype`` (float64: the reference's exact
        decode; float32: native kernels where the format has one)."""
        r, k = self.recipe, self.k
        if r in _BLOCK:
            block = _BLOCK[r]
            q = self.data.view(torch.uint8)
            native_ok = dtype == torch.float32 and k % block == 0
            if native_ok and r == ScalingType.BlockWise1x16:
                pts = None if self.global_scale is None else float(self.global_scale.item())
                return nvfp4.nvfp4_dequantize(q, self.scale.contiguous(), pts)
            if native_ok:
                elem = self._mx_elem()
                return mx.mx_dequantize(q, self.scale.contiguous(), elem)
            if self.mat.dtype == FP4:
                vals = e2m1_to_f32(unpack_fp4(q))[:, :k].to(dtype)
            else:
                vals = self.data.to(dtype)
            sb = self.scale.view(torch.uint8)
            sf = e4m3_to_f32(sb) if r == ScalingType.BlockWise1x16 else e8m0_to_f32(sb)
            s = sf.to(dtype).repeat_interleave(block, dim=1)[:, :k]
            if self.global_scale is not None:
                s = s * self.global_scale.to(dtype).reshape(())
            return vals * s
        vals = self.data.to(dtype)
        s = self.scale.to(dtype)
        if r == ScalingType.TensorWise:
            return vals * s.reshape(())
        if r == ScalingType.RowWise:
            return vals * s.reshape(-1, 1)
        if r == ScalingType.BlockWise1x128:
            return vals * s.repeat_interleave(128, dim=1)[:, :k]
        full = s.repeat_interleave(128, dim=0)[: self.rows].repeat_interleave(128, dim=1)
        return vals * full[:, :k]

    def panel_decoder(self) -> Callable[[int, int], torch.Tensor]:
        """``decode(lo, hi)``: float32 rows ``lo:hi`` of this FP8 operand with its 1x128 or
        128x128 scales applied, in a per-thread scratch buffer reused by the next panel."""
        k, kb = self.k, _ceil(self.k, 128)
        rows, scale = self.data, self.scale.float()
        block_rows = self.recipe == ScalingType.BlockWise128x128

        def decode(lo: int, hi: int) -> torch.Tensor:
            h = hi - lo
            out = native.thread_scratch("lowp.fp8_blocks", h * kb * 128, torch.float32)
            panel = out[: h * kb * 128].view(h, kb, 128)
            if k % 128:
                panel[:, -1, k % 128 :] = 0.0
            panel.view(h, kb * 128)[:, :k].copy_(rows[lo:hi])
            s = scale[torch.arange(lo, hi) // 128] if block_rows else scale[lo:hi]
            panel.mul_(s[:, :, None])
            return panel.view(h, kb * 128)[:, :k]

        return decode

    def _mx_elem(self) -> str:
        if self.mat.dtype == FP4:
            return "fp4_e2m1"
        return "fp8_e4m3" if self.mat.dtype == torch.float8_e4m3fn else "fp8_e5m2"

    def outer_global_scale(self) -> float | None:
        """An NVFP4 global scale the weight tensor cannot carry (zero, negative or not finite:
        :class:`~torchport.lowp.NVFP4Tensor` takes positive finite ones only), to be applied to
        the product instead, as torch takes any value; None when there is none or it can."""
        if self.global_scale is None:
            return None
        g = float(self.global_scale.item())
        return None if 0.0 < g < math.inf else g

    def as_weight(self) -> LowPrecisionTensor:
        """``b`` as a torchport NVFP4/MX weight ``[N, K]`` for :func:`block_scaled_mm` (an
        :meth:`outer_global_scale` left out)."""
        from torchport.lowp.tensors import MXTensor, NVFP4Tensor

        if self.recipe == ScalingType.BlockWise1x16:
            pts = None if self.global_scale is None else float(self.global_scale.item())
            if self.outer_global_scale() is not None:
                pts = None
            scale = self.scale.contiguous().view(torch.float8_e4m3fn)
            return NVFP4Tensor(self.data.view(torch.uint8), scale, pts, torch.float32)
        data = self.data if self.mat.dtype in FP8_DTYPES else self.data.view(torch.uint8)
        scale = self.scale.contiguous().view(torch.uint8)
        return MXTensor(data, scale, self._mx_elem(), torch.float32)


def _prepare(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: Any,
    scale_recipe_a: Any,
    scale_b: Any,
    scale_recipe_b: Any,
    swizzle_a: Any,
    swizzle_b: Any,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype | None,
    contraction_dim: Sequence[int],
) -> tuple[_Operand, _Operand, torch.Tensor | None, torch.dtype]:
    for name, t in (("mat_a", mat_a), ("mat_b", mat_b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _err(f"{name} must be a 2-D tensor, got {got}")
        if t.dtype not in (*FP8_DTYPES, FP4):
            raise _err(f"{name} must be float8 or float4_e2m1fn_x2, got {t.dtype}")
        _check_cpu(name, t)
    if (mat_a.dtype == FP4) != (mat_b.dtype == FP4):
        raise _err(
            f"mat_a and mat_b must both be FP4 or both float8, got {mat_a.dtype}, {mat_b.dtype}"
        )
    cd = tuple(int(d) for d in contraction_dim)
    if cd not in ((), (1, 0)):
        raise _err(f"contraction_dim must be () or (1, 0) (mat_a [M, K] @ mat_b [K, N]), got {cd}")
    if mat_a.shape[1] != mat_b.shape[0]:
        raise _err(
            f"mat_a and mat_b shapes cannot be multiplied ({tuple(mat_a.shape)} and "
            f"{tuple(mat_b.shape)})"
        )
    k = mat_a.shape[1] * (2 if mat_a.dtype == FP4 else 1)
    ra, rb = _as_list(scale_recipe_a), _as_list(scale_recipe_b)
    if not ra or not rb or (ra[0], rb[0]) not in PAIRS:
        names = [getattr(r, "name", r) for r in ra], [getattr(r, "name", r) for r in rb]
        raise _err(
            f"recipes {names[0]} x {names[1]} are not a supported pair; supported: "
            + ", ".join(f"{x.name} x {y.name}" for x, y in PAIRS)
        )
    a = _Operand("mat_a", mat_a, mat_a, _as_list(scale_a), ra, _as_list(swizzle_a), k)
    b = _Operand("mat_b", mat_b, mat_b.t(), _as_list(scale_b), rb, _as_list(swizzle_b), k)
    if (a.global_scale is None) != (b.global_scale is None):
        raise _err("the NVFP4 global (TensorWise) scale must be given for both operands or neither")
    n = mat_b.shape[1]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.numel() != n or not bias.is_floating_point():
            got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else bias
            raise _err(f"bias must be a floating-point tensor of {n} elements, got {got}")
        _check_cpu("bias", bias)
        bias = bias.reshape(n)
    od = mat_a.dtype if output_dtype is None else output_dtype  # (None: mat_a's, as torch)
    if output_dtype is None and od not in OUT_DTYPES:
        raise _err(
            f"output_dtype None means mat_a's dtype, {od}, which is no output dtype; give one of "
            f"{OUT_DTYPES}"
        )
    if od not in OUT_DTYPES:
        raise _err(f"output_dtype must be one of {OUT_DTYPES}, got {od}")
    return a, b, bias, od


def _cast(acc: torch.Tensor, bias: torch.Tensor | None, od: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    # torch's own cast, as torch's scaled GEMMs: E4M3FN saturates, E5M2 overflows to inf
    return acc.float().to(od) if od in FP8_DTYPES else acc.to(od)


def scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor | list[torch.Tensor],
    scale_recipe_a: Any,
    scale_b: torch.Tensor | list[torch.Tensor],
    scale_recipe_b: Any,
    swizzle_a: Any = None,
    swizzle_b: Any = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = torch.bfloat16,
    contraction_dim: Sequence[int] = (),
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """2.14's ``torch.nn.functional.scaled_mm`` on the CPU, every recipe pair (module docstring).

    ``(decode(mat_a, scale_a) @ decode(mat_b, scale_b) + bias)`` in ``output_dtype`` (default
    bfloat16; None: ``mat_a``'s dtype, as torch, an error for FP4 operands; an FP8 output
    saturates). Raises :class:`~torchport.lowp.LowPrecisionError` naming
    the requirement and the value for any argument torch's CUDA path would refuse."""
    a, b, bias, od = _prepare(
        mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
        swizzle_a, swizzle_b, bias, output_dtype, contraction_dim,
    )  # fmt: skip
    m, n = mat_a.shape[0], mat_b.shape[1]
    if m == 0 or n == 0 or a.k == 0:
        return _cast(torch.zeros(m, n), bias, od)
    if a.recipe in (ScalingType.TensorWise, ScalingType.RowWise):
        return _scaled_mm(mat_a, mat_b, a.scale, b.scale.t(), bias=bias, out_dtype=od)
    if a.recipe in _BLOCK and a.k % _BLOCK[a.recipe] == 0:
        x = a.dequantize(torch.float32)
        outer = b.outer_global_scale()
        if outer is not None and not math.isfinite(outer):
            # an infinite or NaN global scale meets every element of b, as the reference (and a's
            # global scale) has it: 0 * inf is NaN, a sum of +inf and -inf too
            return _cast(gemm.mm(x, b.dequantize(torch.float32).t()), bias, od)
        if m <= MAX_ROWS:  # decode: the GEMV reads b's bytes, nothing is decoded to memory
            # (float32 activations kept exact: they are already quantized values)
            # (the weight tensor's own pack: b's bytes and scales as they are, no decode)
            pw = b.as_weight()._make_pack()
            acc = gemv_packed(x, pw, allow_int8=False)
            return _cast(acc if outer is None else acc * outer, bias, od)
        if outer is not None:
            acc = block_scaled_mm(x, b.as_weight(), out_dtype=torch.float32)
            return _cast(acc * outer, bias, od)
        return block_scaled_mm(x, b.as_weight(), bias=_bias32(bias), out_dtype=od)
    if a.recipe in _BLOCK:  # NVFP4/MX with K not a multiple of the block: decode, then engine
        acc = gemm.mm(a.dequantize(torch.float32), b.dequantize(torch.float32).t())
        return _cast(acc, bias, od)
    # 1x128 / 128x128 FP8: b decoded one float32 row panel at a time into this thread's scratch
    # (a whole fresh float32 weight per call cost its page faults: 4096^2 at M=1, 170 ms against
    # 103 for dequantize-then-bf16-linear), multiplied by the autotuned panel GEMM
    x = a.dequantize(torch.float32)
    eager = native.eager_fast_path(x, *(() if bias is None else (bias,)))
    tag = f"fp8:{b.recipe.name}:{str(mat_b.dtype).removeprefix('torch.')}"
    acc = _panel_gemm(
        x, b.panel_decoder(), n, a.k, lambda lo, hi: [], _bias32(bias), od, eager, tag
    )
    return _cast(acc, None, od)


def _bias32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()


def scaled_mm_reference(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor | list[torch.Tensor],
    scale_recipe_a: Any,
    scale_b: torch.Tensor | list[torch.Tensor],
    scale_recipe_b: Any,
    swizzle_a: Any = None,
    swizzle_b: Any = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = torch.bfloat16,
    contraction_dim: Sequence[int] = (),
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """:func:`scaled_mm` in float64 from plain-torch decodes (same checks, same result dtype)."""
    a, b, bias, od = _prepare(
        mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
        swizzle_a, swizzle_b, bias, output_dtype, contraction_dim,
    )  # fmt: skip
    acc = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    return _cast(acc, bias, od)


__all__ = [
    "PAIRS",
    "ScalingType",
    "SwizzleType",
    "from_blocked_scales",
    "scaled_mm",
    "scaled_mm_reference",
    "to_blocked_scales",
]
