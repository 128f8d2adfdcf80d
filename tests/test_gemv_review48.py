"""GEMV input checks from the forty-eighth review: tensor-subclass weights, the custom ops'
activation checks, packed-weight parts against (N, K) and non-strided layouts.

Each case here crashed the process, corrupted the heap, returned other memory's bytes or raised an
untyped error before. The cases that crashed run in one child process (with a timeout), so that
a regression fails its test instead of killing pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchport import config
from torchport.gemv import GemvInputError, PackedWeight, gemv, gemv_packed, pack_dense
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

E_U8, E_F32 = torch.empty(0, dtype=torch.uint8), torch.empty(0)
N, K = 256, 512  # n * k below the tuning threshold: straight to the kernel

# --- cases that crashed: one child process ---------------------------------------------------------

CHILD = r"""
import sys, warnings
import torch, torch.nn.functional as F
import torchport
from torchport.gemv import GemvInputError, PackedWeight, gemv, gemv_packed
from torchport.lowp import NVFP4Tensor
from torch.testing._internal.two_tensor import TwoTensor

e_u8, e_f32 = torch.empty(0, dtype=torch.uint8), torch.empty(0)
torch.manual_seed(0)


def subclass_weight():
    # the kernel read the wrapper's null data pointer (SIGSEGV)
    w, w2, x, b = torch.randn(8, 32), torch.randn(8, 32), torch.randn(1, 32), torch.randn(8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = gemv(x, TwoTensor(w, w2), b)
    assert type(out) is TwoTensor, type(out)
    torch.testing.assert_close(out.a, F.linear(x, w, b))
    torch.testing.assert_close(out.b, F.linear(x, w2, b))
    assert any("the weight is a TwoTensor" in str(m.message) for m in seen), seen
    return "ok"


def subclass_parameter_bf16_x():
    # a TwoTensor made a Parameter (isinstance(., Parameter) is True for it), bf16 activations
    w, x = torch.randn(8, 32), torch.randn(2, 1, 32).bfloat16()
    p = torch.nn.Parameter(TwoTensor(w, w.clone()))
    with torch.no_grad():  # (with grad, the custom op's dispatch through TwoTensor served it)
        torch.testing.assert_close(gemv(x, p).a, F.linear(x.float(), w).bfloat16())
    out = gemv(x, p)
    assert type(out) is TwoTensor and out.dtype == torch.bfloat16, (type(out), out.dtype)
    torch.testing.assert_close(out.a, F.linear(x.float(), w).bfloat16())
    out.float().sum().backward()  # differentiable through the subclass's ops
    assert p.grad is not None and p.grad.shape == (8, 32)
    return "ok"


def dense_op_wide_x():
    # x's last dimension 8 * K: the kernel wrote 8 rows into a 1-row output (heap corruption)
    w, x = torch.randn(4096, 64), torch.randn(1, 64 * 8)
    for _ in range(50):
        torch.ops.torchport.gemv_dense(x, w, None)
    return "returned"


def packed_op_wide_x():
    pw = NVFP4Tensor.from_float(torch.randn(4096, 64)).gemv_pack()
    x = torch.randn(1, 64 * 8)
    for _ in range(50):
        torch.ops.torchport.gemv_packed(
            x, pw.data, pw.scales, pw.rowscale, pw.pts, pw.fmt, pw.n, pw.k, None, True
        )
    return "returned"


def nvfp4_no_scales():
    pw = PackedWeight("nvfp4", torch.zeros(256, 256, dtype=torch.uint8), e_u8, e_f32, 1.0, 256, 512, False)
    gemv_packed(torch.randn(1, 512), pw)
    return "returned"


def f32_short_large():
    pw = PackedWeight("f32", torch.randn(4), e_u8, e_f32, 1.0, 4096, 4096, False)
    gemv_packed(torch.randn(1, 4096), pw)
    return "returned"


def nvfp4_op_short():
    out = torch.ops.torchport.gemv_packed(
        torch.randn(1, 512), torch.zeros(2, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8),
        e_f32, 1.0, "nvfp4", 256, 512, None, True,
    )
    return "returned"


for name in sys.argv[1:]:
    try:
        result = globals()[name]()
    except GemvInputError as e:
        result = f"GemvInputError: {e}"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    print(f"{name} | {result}", flush=True)
"""

CRASHED = {
    "subclass_weight": "ok",
    "subclass_parameter_bf16_x": "ok",
    "dense_op_wide_x": r"GemvInputError: gemv: x's last dimension must equal the weight's K=64, "
    r"got shape \(1, 512\)",
    "packed_op_wide_x": r"GemvInputError: gemv: x's last dimension must equal the weight's K=64, "
    r"got shape \(1, 512\)",
    "nvfp4_no_scales": r"GemvInputError: gemv: nvfp4 scales for N=256, K=512 must be 8192 "
    r"contiguous elements, got shape \(0,\)",
    "f32_short_large": r"GemvInputError: gemv: f32 data for N=4096, K=4096 must be 16777216 "
    r"contiguous elements, got shape \(4,\)",
    "nvfp4_op_short": r"GemvInputError: gemv: nvfp4 data for N=256, K=512 must be 65536 "
    r"contiguous elements, got shape \(2,\)",
}


@pytest.fixture(scope="module")
def child_results() -> tuple[dict[str, str], str]:
    """Run every crash case in one child process (autotuning off: the kernels, not F.linear);
    a case after a crash is missing from the results, the crash's exit status in the log."""
    env = {**os.environ, "TORCHPORT_AUTOTUNE": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, *CRASHED],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    except subprocess.TimeoutExpired as e:  # (run() kills the child)
        return {}, f"timed out: {e.stdout!r} {e.stderr!r}"
    results = {}
    for line in proc.stdout.splitlines():
        name, sep, result = line.partition(" | ")
        if sep:
            results[name] = result
    return results, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("case", list(CRASHED))
def test_a_case_that_crashed_raises_or_runs(case: str, child_results) -> None:
    results, log = child_results
    assert case in results, f"{case} did not finish (a crash?): {log}"
    assert re.match(CRASHED[case], results[case]), results[case]


# --- the custom ops check the activation (in-process: they raise before any kernel call) ----------


def _dense_op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.torchport.gemv_dense(x, torch.randn(16, 64), None)


def _packed_op(x: torch.Tensor) -> torch.Tensor:
    pw = NVFP4Tensor.from_float(torch.randn(16, 64)).gemv_pack()
    return torch.ops.torchport.gemv_packed(
        x, pw.data, pw.scales, pw.rowscale, pw.pts, pw.fmt, pw.n, pw.k, None, True
    )


BAD_X = [
    # (id, x, message): a longer row read its first K values, a shorter one gave zeros, 20 rows
    # ran, float64/int64 were accepted (int64 output)
    (
        "K_100",
        torch.randn(1, 100),
        r"last dimension must equal the weight's K=64, got shape \(1, 100\)",
    ),
    (
        "K_10",
        torch.randn(1, 10),
        r"last dimension must equal the weight's K=64, got shape \(1, 10\)",
    ),
    ("rows_20", torch.randn(20, 64), r"at most 8 rows \(decode shapes\), got 20"),
    (
        "f64",
        torch.randn(1, 64, dtype=torch.float64),
        r"float32 or bfloat16 tensor, got torch.float64",
    ),
    ("i64", torch.ones(1, 64, dtype=torch.int64), r"float32 or bfloat16 tensor, got torch.int64"),
]


@pytest.mark.parametrize("op", [_dense_op, _packed_op], ids=["gemv_dense", "gemv_packed"])
@pytest.mark.parametrize("x,match", [c[1:] for c in BAD_X], ids=[c[0] for c in BAD_X])
def test_the_custom_ops_check_the_activation(op, x: torch.Tensor, match: str) -> None:
    with pytest.raises(GemvInputError, match=match):
        op(x)


@pytest.mark.parametrize("x,match", [c[1:] for c in BAD_X], ids=[c[0] for c in BAD_X])
def test_the_fake_implementations_check_the_activation(x: torch.Tensor, match: str) -> None:
    """A traced graph with a wrong K or dtype is refused with the eager error (the fakes
    returned an output of the wrong row count or dtype)."""
    pw = NVFP4Tensor.from_float(torch.randn(16, 64)).gemv_pack()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(torch.randn(16, 64))
        with pytest.raises(GemvInputError, match=match):
            torch.ops.torchport.gemv_dense(fx, fw, None)
        parts = [mode.from_tensor(t) for t in (pw.data, pw.scales, pw.rowscale)]
        with pytest.raises(GemvInputError, match=match):
            torch.ops.torchport.gemv_packed(fx, *parts, pw.pts, pw.fmt, 16, 64, None, True)


def test_the_fakes_still_propagate_shapes() -> None:
    """Fake decode shapes pass; meta inputs only propagate shapes (the op cannot run on meta)."""
    pw = NVFP4Tensor.from_float(torch.randn(16, 64)).gemv_pack()
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.randn(2, 1, 64))
        out = torch.ops.torchport.gemv_dense(fx, mode.from_tensor(torch.randn(16, 64)), None)
        assert out.shape == (2, 1, 16)
        parts = [mode.from_tensor(t) for t in (pw.data, pw.scales, pw.rowscale)]
        out = torch.ops.torchport.gemv_packed(fx, *parts, pw.pts, pw.fmt, 16, 64, None, True)
        assert out.shape == (2, 1, 16)
    meta = torch.randn(3, 64, device="meta")
    out = torch.ops.torchport.gemv_dense(meta, torch.randn(16, 64, device="meta"), None)
    assert out.shape == (3, 16) and out.is_meta


def test_the_ops_still_serve_decode_shapes() -> None:
    torch.manual_seed(0)
    w, x, b = torch.randn(16, 64), torch.randn(2, 1, 64), torch.randn(16)
    torch.testing.assert_close(torch.ops.torchport.gemv_dense(x, w, b), F.linear(x, w, b))
    q = NVFP4Tensor.from_float(w)
    pw = q.gemv_pack()
    out = torch.ops.torchport.gemv_packed(
        x, pw.data, pw.scales, pw.rowscale, pw.pts, pw.fmt, pw.n, pw.k, b, False
    )
    torch.testing.assert_close(out, F.linear(x, q.dequantize(), b), rtol=1e-5, atol=1e-4)


# --- packed-weight parts against (N, K) (construction only: no kernel call) -------------------------


def _u8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


BAD_PARTS = [
    # (id, PackedWeight arguments, message)
    (
        "f32_short",
        ("f32", torch.randn(4), E_U8, E_F32),
        r"f32 data for N=256, K=512 must be 131072 contiguous elements, got shape \(4,\)",
    ),
    (
        "f32_uint8",
        ("f32", _u8(N, K), E_U8, E_F32),
        r"f32 data must be torch.float32, got torch.uint8",
    ),
    (
        "bf16_f32",
        ("bf16", torch.randn(N, K), E_U8, E_F32),
        r"bf16 data must be torch.bfloat16, got torch.float32",
    ),
    (
        "f32_strided",
        ("f32", torch.randn(K, N).t(), E_U8, E_F32),
        r"f32 data for N=256, K=512 must be 131072 contiguous elements, got shape \(256, 512\) stride \(1, 256\)",
    ),
    (
        "nvfp4_no_scales",
        ("nvfp4", _u8(N, K // 2), E_U8, E_F32),
        r"nvfp4 scales for N=256, K=512 must be 8192 contiguous",
    ),
    (
        "nvfp4_f32_codes",
        ("nvfp4", torch.zeros(N, K // 8), _u8(N, K // 16), E_F32),
        r"nvfp4 data must be 1-byte codes, got torch.float32",
    ),
    (
        "nvfp4_full_codes",
        ("nvfp4", _u8(N, K), _u8(N, K // 16), E_F32),
        r"nvfp4 data for N=256, K=512 must be 65536 contiguous elements, got shape \(256, 512\)",
    ),
    (
        "mxfp8_scales_f32",
        ("mxfp8_e4m3", _u8(N, K), torch.ones(N, K // 32), E_F32),
        r"mxfp8_e4m3 scales must be 1-byte codes, got torch.float32",
    ),
    (
        "fp8_no_rowscale",
        ("fp8_e4m3", _u8(N, K), E_U8, E_F32),
        r"fp8_e4m3 rowscale for N=256, K=512 must be 256 contiguous elements, got shape \(0,\)",
    ),
    (
        "fp8_rowscale_f64",
        ("fp8_e5m2", _u8(N, K), E_U8, torch.ones(N, dtype=torch.float64)),
        r"fp8_e5m2 rowscale must be torch.float32, got torch.float64",
    ),
    (
        "fp8_rowscale_strided",
        ("fp8_e4m3", _u8(N, K), E_U8, torch.ones(2 * N)[::2]),
        r"rowscale for N=256, K=512 must be 256 contiguous elements, got shape \(256,\) stride \(2,\)",
    ),
    (
        "meta_data",
        ("f32", torch.empty(N, K, device="meta"), E_U8, E_F32),
        r"a packed weight's data must be on cpu, got meta",
    ),
    (
        "sparse_data",
        ("f32", torch.zeros(N, K).to_sparse(), E_U8, E_F32),
        r"a packed weight's data must be a strided tensor, got layout torch.sparse_coo",
    ),
    (
        "bad_fmt",
        ("int4", _u8(N, K), E_U8, torch.ones(N)),
        r"a packed weight's format must be one of \(.*\), got 'int4'",
    ),
]


@pytest.mark.parametrize("args,match", [c[1:] for c in BAD_PARTS], ids=[c[0] for c in BAD_PARTS])
def test_packed_weight_parts_must_match_n_and_k(args: tuple, match: str) -> None:
    """Parts the kernel would read past their end (a crash, or other memory's bytes in the
    output), of the wrong element type, or a format the kernels lack (a bare AssertionError,
    gone under ``python -O``)."""
    with pytest.raises(GemvInputError, match=match):
        PackedWeight(*args, 1.0, N, K, False)


@pytest.mark.parametrize(
    "fmt,k,block", [("nvfp4", 24, 16), ("mxfp4", 48, 32), ("mxfp8_e5m2", 40, 32)]
)
def test_block_formats_need_k_a_multiple_of_the_block(fmt: str, k: int, block: int) -> None:
    """(The kernels and the dequantize reference count whole blocks per row.)"""
    data = _u8(N, k // 2 if fmt.endswith("fp4") else k)
    with pytest.raises(GemvInputError, match=f"{fmt} needs K a multiple of {block}, got K={k}"):
        PackedWeight(fmt, data, _u8(N, k // block + 1), E_F32, 1.0, N, k, False)


def test_the_packed_op_checks_the_parts_before_the_kernel() -> None:
    x = torch.randn(1, K)
    with pytest.raises(GemvInputError, match=r"fp8_e4m3 rowscale for N=256, K=512 must be 256"):
        torch.ops.torchport.gemv_packed(
            x, _u8(N, K), E_U8, torch.ones(1), 1.0, "fp8_e4m3", N, K, None, True
        )


def _lowp_weights(w: torch.Tensor) -> list[torch.Tensor]:
    return [
        Float8Tensor.from_float(w, torch.float8_e4m3fn, "row"),
        Float8Tensor.from_float(w, torch.float8_e5m2, "tensor"),
        NVFP4Tensor.from_float(w),
        NVFP4Tensor.from_float(w, per_tensor_scale=False),
        MXTensor.from_float(w, "fp4_e2m1"),
        MXTensor.from_float(w, "fp8_e4m3"),
        MXTensor.from_float(w, "fp8_e5m2"),
    ]


@pytest.mark.parametrize("hugepages", [False, True], ids=["plain", "hugepages"])
def test_every_format_s_own_packs_pass_the_check(hugepages: bool, monkeypatch) -> None:
    """The packs torchport makes (lowp's, huge-page copies of them, dense, rebuilt from their
    parts as the custom op and a captured graph do) meet the check and give F.linear's result."""
    from torchport.lowp import tensors

    torch.manual_seed(0)
    w, x = torch.randn(40, 96), torch.randn(3, 96)
    if hugepages:  # (every pack moved, however small)
        monkeypatch.setattr(tensors, "HUGEPAGE_MIN_BYTES", 0)
    with config.override(gemv_hugepages=hugepages):
        for q in _lowp_weights(w):
            pw = q.gemv_pack()
            rebuilt = PackedWeight(
                pw.fmt, pw.data, pw.scales, pw.rowscale, pw.pts, pw.n, pw.k, pw.int8
            )
            ref = F.linear(x, q.dequantize())
            for p in (pw, rebuilt):
                out = gemv_packed(x, p, allow_int8=False)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    for dense in (w, w.bfloat16()):
        pw = pack_dense(dense)
        torch.testing.assert_close(
            gemv_packed(x, pw), F.linear(x, dense.float()), rtol=1e-5, atol=1e-4
        )


# --- non-strided and non-tensor inputs ---------------------------------------------------------------

_W, _X = torch.randn(8, 32), torch.randn(1, 32)

with warnings.catch_warnings():  # (nested and CSR tensors warn that they are a prototype, beta)
    warnings.simplefilter("ignore")
    _NESTED = torch.nested.nested_tensor([torch.randn(32)])
    _W_CSR, _X_CSR = _W.to_sparse_csr(), _X.to_sparse_csr()

BAD_LAYOUTS = [
    # (id, gemv arguments, message): torch's untyped errors before, AttributeError for a list
    ("w_list", (_X, [[1.0] * 32] * 8), r"a dense weight must be a tensor, got list"),
    (
        "w_coo",
        (_X, _W.to_sparse()),
        r"a dense weight must be a strided tensor, got layout torch.sparse_coo",
    ),
    (
        "w_csr",
        (_X, _W_CSR),
        r"a dense weight must be a strided tensor, got layout torch.sparse_csr",
    ),
    (
        "w_mkldnn",
        (_X, _W.to_mkldnn()),
        r"a dense weight must be a strided tensor, got layout torch._mkldnn",
    ),
    ("x_coo", (_X.to_sparse(), _W), r"x must be a strided tensor, got layout torch.sparse_coo"),
    ("x_csr", (_X_CSR, _W), r"x must be a strided tensor, got layout torch.sparse_csr"),
    ("x_mkldnn", (_X.to_mkldnn(), _W), r"x must be a strided tensor, got layout torch._mkldnn"),
    ("x_nested", (_NESTED, _W), r"x must be a strided tensor, got a nested tensor"),
    (
        "x_coo_nvfp4",
        (_X.to_sparse(), NVFP4Tensor.from_float(_W)),
        r"x must be a strided tensor, got layout torch.sparse_coo",
    ),
    (
        "x_mkldnn_nvfp4",
        (_X.to_mkldnn(), NVFP4Tensor.from_float(_W)),
        r"x must be a strided tensor, got layout torch._mkldnn",
    ),
    (
        "bias_coo",
        (_X, _W, torch.randn(8).to_sparse()),
        r"bias must be a strided tensor, got layout torch.sparse_coo",
    ),
]


@pytest.mark.parametrize(
    "args,match", [c[1:] for c in BAD_LAYOUTS], ids=[c[0] for c in BAD_LAYOUTS]
)
def test_non_strided_inputs_are_refused(args: tuple, match: str) -> None:
    with torch.no_grad(), pytest.raises(GemvInputError, match=match):
        gemv(*args)


@pytest.mark.parametrize("layout", ["coo", "csr", "mkldnn", "nested"])
def test_a_settled_route_refuses_a_non_strided_x_of_its_shape(layout: str) -> None:
    """A route settled by plain calls served a sparse or mkldnn x of its shape and dtype (its
    run raised torch's errors); a nested x raised reading its shape."""
    pw = NVFP4Tensor.from_float(_W).gemv_pack()
    for _ in range(3):
        gemv_packed(_X, pw)
    assert pw.routes.get(True) is not None  # settled
    x = {
        "coo": _X.to_sparse,
        "csr": lambda: _X_CSR,
        "mkldnn": _X.to_mkldnn,
        "nested": lambda: _NESTED,
    }[layout]()
    with pytest.raises(GemvInputError, match="x must be a strided tensor"):
        gemv_packed(x, pw)
    torch.testing.assert_close(gemv_packed(_X, pw), gemv_packed(_X.clone(), pw))  # still serves
