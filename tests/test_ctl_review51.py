"""Review 51: eager switch/while_loop refuse input mutation; torch-compatible error classes;
scaled_mm's ±inf for scales whose product overflows float32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchport
import torchport.linalg as L
import torchport.nn.functional as TF
from torchport.control import SwitchError, WhileLoopError
from torchport.gemm import EpilogueError, EpilogueSpec, GemmInputError
from torchport.linalg import LinalgInputError
from torchport.lowp import scaled_mm, scaled_mm_reference

# --- 1. eager switch / while_loop: a write to an operand or carried tensor raises ---------------


def test_while_loop_body_writing_a_carried_tensor_raises() -> None:
    x = torch.zeros(3)
    with pytest.raises(WhileLoopError, match=r"body_fn modifies carried value 1 \(Tensor\(3,\)"):
        torchport.while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t.add_(1)), (0, x))


def test_while_loop_cond_writing_a_carried_tensor_raises() -> None:
    x = torch.zeros(3)
    with pytest.raises(WhileLoopError, match="cond_fn modifies carried value 1"):
        torchport.while_loop(
            lambda i, t: t.add_(1)[0] < 3, lambda i, t: (i + 1, t * 2), (torch.tensor(0), x)
        )


def test_while_loop_cond_writing_on_a_zero_trip_loop_raises() -> None:
    with pytest.raises(WhileLoopError, match="cond_fn modifies carried value 0"):
        torchport.while_loop(lambda t: bool(t.mul_(2).sum() > 9), lambda t: t, (torch.ones(2),))


def test_while_loop_names_the_flattened_leaf_written_through_a_view() -> None:
    x, y = torch.zeros(4), torch.zeros(2)
    with pytest.raises(WhileLoopError, match="body_fn modifies carried value 2"):
        torchport.while_loop(
            lambda i, c: i < 2,
            lambda i, c: (i + 1, {"y": c["y"] + 1, "x": c["x"][1:].zero_()}),
            (0, {"y": y, "x": x}),
        )


def test_while_loop_body_writing_a_later_iterations_value_raises() -> None:
    # iteration 0 returns a new tensor; iteration 1 writes to it (a carried value again)
    def body(i: int, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        return i + 1, (t.mul_(2) if i == 1 else t + 1)

    x = torch.zeros(3)
    with pytest.raises(WhileLoopError, match="body_fn modifies carried value 1"):
        torchport.while_loop(lambda i, t: i < 3, body, (0, x))
    assert x.tolist() == [0.0, 0.0, 0.0]


def test_while_loop_without_writes_is_unchanged() -> None:
    x = torch.zeros(3)
    out = torchport.while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t + 1), (0, x))
    assert out[0] == 3 and out[1].tolist() == [3.0, 3.0, 3.0] and x.tolist() == [0.0] * 3


@pytest.mark.parametrize("index", [1, torch.tensor(1), torch.tensor(5, dtype=torch.int8)], ids=str)
def test_switch_branch_writing_an_operand_raises(index: Any) -> None:
    x = torch.zeros(3)
    with pytest.raises(SwitchError, match=r"branch1 modifies operand leaf 0 \(Tensor\(3,\)"):
        torchport.switch(index, [lambda t: t + 1, lambda t: t.add_(5)], (x,))


def test_switch_names_the_flattened_operand_leaf() -> None:
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    with pytest.raises(SwitchError, match="branch0 modifies operand leaf 3"):
        torchport.switch(0, [lambda p, q: p[0] + q[1].neg_()], ((a, torch.ones(1)), (b, c)))


def test_switch_branch_writing_outside_its_operands_is_not_checked() -> None:
    # (the check covers operands; a closure's tensor is no operand)
    acc = torch.zeros(2)
    out = torchport.switch(0, [lambda t: acc.add_(t) * 1], (torch.ones(2),))
    assert out.tolist() == [1.0, 1.0] and acc.tolist() == [1.0, 1.0]


def test_inference_tensors_are_not_checked_and_do_not_crash() -> None:
    with torch.inference_mode():
        x, y = torch.zeros(3), torch.zeros(3)
        assert x.is_inference()
        out = torchport.switch(0, [lambda t: t.add_(1)], (x,))  # no version counter: not seen
        assert out.tolist() == [1.0] * 3
        res = torchport.while_loop(lambda i, t: i < 2, lambda i, t: (i + 1, t + 1), (0, y))
        assert res[1].tolist() == [2.0] * 3
    z = torch.zeros(3)  # a normal tensor keeps its counter under inference_mode
    with (
        torch.inference_mode(),
        pytest.raises(SwitchError, match="branch0 modifies operand leaf 1"),
    ):
        torchport.switch(0, [lambda a, b: b.add_(a)], (x, z))


# --- 2. typed input errors are RuntimeErrors too, as torch's; a non-tensor A is a TypeError -----


def _linear_bias() -> Any:
    return TF.linear(torch.randn(4, 5), torch.randn(3, 5), torch.randn(5))


CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "eigh non-square": (lambda: L.eigh(torch.ones(3, 4)), "square matrices"),
    "cholesky non-square": (lambda: L.cholesky(torch.ones(3, 4)), "square matrices"),
    "svd 1-D": (lambda: L.svd(torch.ones(3)), "at least 2 dimensions"),
    "svd int64": (lambda: L.svd(torch.ones(3, 3, dtype=torch.long)), "got torch.int64"),
    "qr mode": (lambda: L.qr(torch.ones(3, 3), mode="full"), "mode must be one of"),
    "eigh UPLO": (lambda: L.eigh(torch.eye(3), UPLO="X"), "UPLO must be 'L' or 'U', got 'X'"),
    "svd driver": (lambda: L.svd(torch.eye(3), driver="gesvd"), "driver= is only supported"),
    "linear K": (lambda: TF.linear(torch.randn(4, 6), torch.randn(3, 5)), "6"),
    "linear dtype": (
        lambda: TF.linear(torch.randn(4, 5).bfloat16(), torch.randn(3, 5)),
        "bfloat16",
    ),
    "linear bias": (_linear_bias, "bias of shape"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_inputs_are_caught_as_runtime_error_like_torchs(name: str) -> None:
    fn, msg = CASES[name]
    with pytest.raises(RuntimeError, match=msg) as info:
        fn()
    assert isinstance(info.value, ValueError)  # (still: code catching ValueError keeps working)
    assert isinstance(info.value, (LinalgInputError, GemmInputError))


def test_error_classes_are_value_and_runtime_errors() -> None:
    for cls in (LinalgInputError, GemmInputError, EpilogueError):
        assert issubclass(cls, ValueError) and issubclass(cls, RuntimeError), cls
    with pytest.raises(EpilogueError, match="unknown epilogue step 'nope'"):
        EpilogueSpec.decode("nope")


FNS: dict[str, Callable[..., Any]] = {
    "svd": L.svd,
    "svdvals": L.svdvals,
    "eigh": L.eigh,
    "eigvalsh": L.eigvalsh,
    "qr": L.qr,
    "cholesky": L.cholesky,
    "cholesky_ex": L.cholesky_ex,
}


@pytest.mark.parametrize("name", list(FNS))
def test_linalg_non_tensor_a_is_a_type_error_like_torchs(name: str) -> None:
    with pytest.raises(TypeError, match=rf"linalg\.{name}: A must be a torch.Tensor, got list"):
        FNS[name]([[1.0, 0.0], [0.0, 1.0]])


@pytest.mark.parametrize(
    "call, msg",
    [
        (lambda: L.eigh(torch.eye(2), UPLO=1), "UPLO must be 'L' or 'U', got 1"),
        (lambda: L.eigvalsh(torch.eye(2), UPLO=None), "UPLO must be 'L' or 'U', got None"),
        (lambda: L.qr(torch.eye(2), mode=1), "mode must be one of .*, got 1"),
        (lambda: L.svd(torch.eye(2), driver=1), "got 1"),
    ],
    ids=["eigh UPLO", "eigvalsh UPLO", "qr mode", "svd driver"],
)
def test_linalg_option_of_the_wrong_type_is_a_type_error(call: Callable[[], Any], msg: str) -> None:
    with pytest.raises(TypeError, match=msg):
        call()


# --- 3. scaled_mm: scales whose product overflows float32 give ±inf (not torch CPU's NaN) --------


@pytest.mark.parametrize("m", [4, 16], ids=["gemv", "gemm"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("s", [1e20, 1e30], ids=str)
def test_scaled_mm_overflowing_scale_product_gives_signed_inf(
    m: int, out_dtype: torch.dtype, s: float
) -> None:
    g = torch.Generator().manual_seed(0)
    e4 = torch.float8_e4m3fn
    a = (torch.randn(m, 16, generator=g) * 2).to(e4)
    a[1] = 0  # a zero sum stays 0 (0 · scale_a · scale_b)
    b = (torch.randn(8, 16, generator=g) * 2).to(e4).t()
    sa, sb = torch.tensor(s), torch.tensor(s)
    got = scaled_mm(a, b, sa, sb, out_dtype=out_dtype)
    exact = a.double() @ b.double()
    want = torch.where(exact == 0, 0.0, exact.sign() * torch.inf).to(out_dtype)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(scaled_mm_reference(a, b, sa, sb, out_dtype=out_dtype), want)


def test_scaled_mm_finite_product_of_large_terms_is_the_exact_value() -> None:
    # 448·1e17 squared overflows float32 term by term (torch's CPU kernel: NaN), the sum does not
    e4 = torch.float8_e4m3fn
    a = torch.tensor([[448.0, -448.0, 1.0]] * 16).to(e4)
    b = torch.tensor([[448.0], [448.0], [1.0]]).to(e4)
    sa = sb = torch.tensor(1e17)
    for rows in (4, 16):
        got = scaled_mm(a[:rows], b, sa, sb, out_dtype=torch.float32)
        ref = scaled_mm_reference(a[:rows], b, sa, sb, out_dtype=torch.float32)
        torch.testing.assert_close(got, ref)
        torch.testing.assert_close(got, torch.full((rows, 1), 1e34))
