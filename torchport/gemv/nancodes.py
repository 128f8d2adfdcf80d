"""E4M3 NaN codes in FP8 weights packed per call: a row scan whose clean result is remembered.

The GEMV's register decodes (half-precision and integer-shift) read E4M3's NaN codes 0x7F/0xFF
as ±480: a per-element check would cost vector instructions in loops tuned per instruction.
torch's cast reads NaN, and one NaN code makes every product of its weight row NaN. A cached
pack (``Float8Tensor.gemv_pack``) scans its codes once and gives such rows a NaN row scale.
Packs made per call -- ``torchport.scaled_mm``'s decode route (``b``'s columns are the rows)
and the ``torchport::gemv_packed`` custom op (``torch.compile``, autograd) -- call
:func:`nan_rowscale`, which does the same from a scan remembered per weight memory.

A scan that finds no NaN code is remembered under the codes' address, shape, strides and
version counter, valid while their storage is the same object; a weight with NaN codes is
scanned on every call (only a clean result is kept, so a stale entry can only leave a NaN
code read as finite, never a NaN where the weight has none). Writes that move no version
counter are not seen: through ``.data``, and to inference tensors (torch keeps no version for
them). Reference: :func:`e4m3_nan_rows_reference`.
"""

from __future__ import annotations

import math
import weakref

import torch

from torchport.native.launch import is_compiling_here

# clean scans: (address, shape, strides, version) -> the storage they were made on
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


def _key(codes: torch.Tensor) -> tuple[object, ...]:
    try:
        version = codes._version
    except RuntimeError:  # an inference tensor: no version counter (its writes are not seen)
        version = -1
    return (codes.data_ptr(), codes.shape, codes.stride(), version)


def nan_rowscale(codes: torch.Tensor, rowscale: torch.Tensor) -> torch.Tensor:
    """``rowscale [N]`` with NaN for the rows of the E4M3 ``codes [N, K]`` holding a NaN code
    (a new tensor; ``rowscale`` itself where there are none). Codes without real storage (fake
    or traced tensors) are returned as they are: the custom op scans them when it runs. (Traced
    in this thread only: another thread's compile skipped the scan, and the NaN rows read as
    finite values.)"""
    if type(codes) is not torch.Tensor or codes.numel() == 0 or is_compiling_here():
        return rowscale
    key = _key(codes)
    storage = codes.untyped_storage()
    ref = _CLEAN.get(key)
    if ref is not None and ref() is storage:
        return rowscale
    with torch.no_grad():
        nan = e4m3_nan_rows(codes)
    # (read through NumPy: bool(tensor) is refused while a graph captures)
    if not bool(nan.any().numpy()):
        if len(_CLEAN) >= MAX_CLEAN:
            _CLEAN.clear()
        _CLEAN[key] = weakref.ref(storage)
        return rowscale
    return rowscale.masked_fill(nan, math.nan)
