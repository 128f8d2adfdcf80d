"""NaN codes in weights packed per call: scans whose clean results are remembered.

The GEMV's register decodes (half-precision and integer-shift) read E4M3's NaN codes 0x7F/0xFF
as ±480: a per-element check would cost vector instructions in loops tuned per instruction.
torch's cast reads NaN, and one NaN code makes every product of its weight row NaN. A cached
pack (``Float8Tensor.gemv_pack``, ``MXTensor.gemv_pack``) scans its codes once: an FP8 weight's
rows with one get a NaN row scale, an MXFP8 E4M3 weight's blocks with one the E8M0 NaN scale
0xFF (the float kernel's E8M0 table reads NaN). Likewise the int8-activation kernels of NVFP4
and MXFP4 read NaN block scales (E4M3 0x7F/0xFF, E8M0 0xFF) as finite or infinite values where
the float kernels' tables read NaN: a cached pack that holds one is marked for the float kernel
(``PackedWeight.int8``). (E2M1 and E5M2 elements need nothing: E2M1 has no NaN code, and the
kernels decode E5M2's NaN codes as NaN.)

Packs made per call -- ``torchport.scaled_mm``'s decode route (``b``'s columns are the rows)
and the ``torchport::gemv_packed`` custom op (``torch.compile`` traces a quantized weight's
pack without scanning it; autograd) -- call :func:`nan_rowscale`, :func:`mx_nan_scales` and
:func:`nan_block_scales`, which do the same from a scan remembered per weight memory.

A scan that finds no NaN code is remembered under the codes' address, shape, strides, version
counter and format (E4M3 or E8M0), valid while their storage is the same object; codes with a
NaN code are scanned on every call (only a clean result is kept, so a stale entry can only
leave a NaN code read as finite, never a NaN where the weight has none). Writes that move no
version counter are not seen: through ``.data``, and to inference tensors (torch keeps no
version for them). References: :func:`e4m3_nan_rows_reference`,
:func:`e4m3_nan_blocks_reference`, :func:`e8m0_nan_reference`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from torchport.native.launch import is_compiling_here, tensor_version

# clean scans: (format, address, shape, strides, version) -> the storage they were made on
_CLEAN: dict[tuple[object, ...], weakref.ref[torch.UntypedStorage]] = {}
MAX_CLEAN = 256  # entries kept (cleared when full: each lookup is one dict get)


def e4m3_nan_rows_reference(codes: torch.Tensor) -> torch.Tensor:
    """Whether each row of the E4M3 bytes ``codes [N, K]`` holds a NaN code (torch's cast)."""
    return codes.view(torch.float8_e4m3fn).float().isnan().any(1)


def e4m3_nan_rows(codes: torch.Tensor) -> torch.Tensor:
    """:func:`e4m3_nan_rows_reference` as two max reductions: the NaN codes are the largest
    bytes as int8 (127) and as uint8 (255)."""
    u8 = codes.view(torch.uint8)
    return (u8.view(torch.int8).amax(1) == 127) | (u8.amax(1) == 255)


def e4m3_nan_blocks_reference(codes: torch.Tensor, block: int) -> torch.Tensor:
    """Whether each ``block`` bytes along the rows of the E4M3 bytes ``codes [N, K]`` hold a
    NaN code, ``[N, K / block]`` (torch's cast)."""
    nan = codes.view(torch.float8_e4m3fn).float().isnan()
    return nan.reshape(codes.shape[0], -1, block).any(2)


def e4m3_nan_blocks(codes: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`e4m3_nan_blocks_reference` as :func:`e4m3_nan_rows` on rows of ``block``."""
    return e4m3_nan_rows(codes.reshape(-1, block)).reshape(codes.shape[0], -1)


def e8m0_nan_reference(scales: torch.Tensor) -> torch.Tensor:
    """Whether each E8M0 byte of ``scales`` is the NaN code (torch's cast)."""
    return scales.view(torch.float8_e8m0fnu).float().isnan()


def _key(codes: torch.Tensor, fmt: str) -> tuple[object, ...]:
    # (-1 for an inference tensor: no version counter, its writes are not seen)
    return (fmt, codes.data_ptr(), codes.shape, codes.stride(), tensor_version(codes))


def _scan(
    codes: torch.Tensor, fmt: str, find: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """``find(codes)``, a bool tensor marking what holds a NaN code of ``fmt`` ("e4m3" or
    "e8m0"), or None where nothing does (remembered: see the module docstring) or ``codes`` have
    no real storage (fake or traced tensors: the custom op scans them when it runs; traced in
    this thread only: another thread's compile skipped the scan, and NaN codes read as finite
    values)."""
    if type(codes) is not torch.Tensor or codes.numel() == 0 or is_compiling_here():
        return None
    key = _key(codes, fmt)
    storage = codes.untyped_storage()
    ref = _CLEAN.get(key)
    if ref is not None and ref() is storage:
        return None
    with torch.no_grad():
        nan = find(codes)
    # (read through NumPy: bool(tensor) is refused while a graph captures)
    if not bool(nan.any().numpy()):
        if len(_CLEAN) >= MAX_CLEAN:
            _CLEAN.clear()
        _CLEAN[key] = weakref.ref(storage)
        return None
    return nan


def nan_rowscale(codes: torch.Tensor, rowscale: torch.Tensor) -> torch.Tensor:
    """``rowscale [N]`` with NaN for the rows of the E4M3 ``codes [N, K]`` holding a NaN code
    (a new tensor; ``rowscale`` itself where there are none)."""
    nan = _scan(codes, "e4m3", e4m3_nan_rows)
    return rowscale if nan is None else rowscale.masked_fill(nan, math.nan)


def mx_nan_scales(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The E8M0 ``scales [N, K / block]`` with the NaN code 0xFF for the blocks of the MXFP8
    E4M3 ``codes [N, K]`` holding an E4M3 NaN code (a new tensor; ``scales`` itself where there
    are none)."""
    nan = _scan(codes, "e4m3", lambda c: e4m3_nan_blocks(c, block))
    if nan is None:
        return scales
    return scales.view(torch.uint8).masked_fill(nan.reshape(scales.shape), 255).view(scales.dtype)


def _e4m3_nan_any(codes: torch.Tensor) -> torch.Tensor:
    return e4m3_nan_rows(codes.reshape(1, -1))


def _e8m0_nan_any(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8).amax() == 255


def nan_block_scales(scales: torch.Tensor, fmt: str) -> bool:
    """Whether the block scales of an ``nvfp4`` pack (E4M3 bytes) or an MX pack (E8M0 bytes)
    hold a NaN code. False for scales without real storage (see :func:`_scan`)."""
    if fmt == "nvfp4":
        return _scan(scales, "e4m3", _e4m3_nan_any) is not None
    return _scan(scales, "e8m0", _e8m0_nan_any) is not None
