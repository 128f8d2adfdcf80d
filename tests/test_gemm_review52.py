"""Review 52: a non-tensor operand of the GEMM API is a ``TypeError`` as torch's is; the settled
GEMM table keys on the ISA level the ``isa`` setting resolves to; the A/B tools' file and
``--variant`` options are usage errors when bad. Nothing here is timed: the tuner is asked for
ATen only, and the tools' parsers run, their benchmarks do not."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchport import benchmarks, config, native
from torchport.gemm import Add, Bias, EpilogueError, GemmInputError, Scale, mm
from torchport.nn.functional import linear

mm_mod = importlib.import_module("torchport.gemm.mm")

# --- item 1: non-tensor operands are TypeErrors --------------------------------------------------

_A, _B, _W = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5, 4)
NON_TENSORS = {
    "list": [[1.0] * 4] * 3,
    "int": 3,
    "float": 2.0,
    "None": None,
    "ndarray": np.ones((3, 4), np.float32),
}
# (call, the torch call it stands for or None, torchport's error class, message)
CALLS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any] | None, type, str]] = {
    "mm a": (lambda v: mm(v, _B), lambda v: torch.mm(v, _B), GemmInputError, "mm: a must be a"),
    "mm b": (lambda v: mm(_A, v), lambda v: torch.mm(_A, v), GemmInputError, "mm: b must be a"),
    "linear input": (
        lambda v: linear(v, _W),
        lambda v: F.linear(v, _W),
        GemmInputError,
        "linear: input and weight must be tensors",
    ),
    "linear weight": (
        lambda v: linear(_A, v),
        lambda v: F.linear(_A, v),
        GemmInputError,
        "linear: input and weight must be tensors",
    ),
    "op a": (
        lambda v: torch.ops.torchport.gemm(v, _B, [], ""),
        None,
        GemmInputError,
        "gemm: a must be a torch.Tensor",
    ),
}
# the operands where None means "none" (no bias): every other non-tensor
OPERAND_CALLS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any] | None, type, str]] = {
    "linear bias": (
        lambda v: linear(_A, _W, v),
        lambda v: F.linear(_A, _W, v),
        GemmInputError,
        "linear: bias must be a tensor or None",
    ),
    "linear 1-D weight bias": (
        lambda v: linear(_A, _W[0], v),
        lambda v: F.linear(_A, _W[0], v),
        GemmInputError,
        "linear: bias must be a tensor or None",
    ),
    "mm bias": (
        lambda v: mm(_A, _B, bias=v),
        lambda v: torch.addmm(v, _A, _B),
        EpilogueError,
        "epilogue step 0 bias must be a tensor",
    ),
    "Add": (
        lambda v: mm(_A, _B, epilogue=[Add(v)]),
        None,  # (torch.add takes a number)
        EpilogueError,
        "epilogue step 0 residual must be a tensor",
    ),
    "Bias": (
        lambda v: mm(_A, _B, epilogue=[Bias(v)]),
        None,
        EpilogueError,
        "epilogue step 0 bias must be a tensor",
    ),
    "linear 3-D Add": (  # (was an AttributeError: 'list' object has no attribute 'dim')
        lambda v: linear(torch.randn(2, 3, 4), _W, epilogue=[Add(v)]),
        None,
        EpilogueError,
        "epilogue step 0 residual must be a tensor",
    ),
    "Add after a callable, 3-D": (  # (apply_tail: the same AttributeError)
        lambda v: linear(torch.randn(2, 3, 4), _W, epilogue=[torch.relu, Add(v)]),
        None,
        EpilogueError,
        "residual must be a tensor",
    ),
}
CASES = [
    (call, kind)
    for call in CALLS
    for kind in NON_TENSORS
    if not (call == "op a" and kind != "None")  # (the dispatcher refuses those first)
] + [(call, kind) for call in OPERAND_CALLS for kind in NON_TENSORS if kind != "None"]


@pytest.mark.parametrize(("call", "kind"), CASES, ids=[f"{c}-{k}" for c, k in CASES])
def test_a_non_tensor_operand_is_a_type_error(call, kind):
    """These raised GemmInputError / EpilogueError (ValueError and RuntimeError) where torch
    raises TypeError: now they are also TypeErrors (still the package's classes and still
    RuntimeErrors, as the dispatcher's refusal of a non-tensor op argument is)."""
    fn, torch_fn, ours, message = {**CALLS, **OPERAND_CALLS}[call]
    value = NON_TENSORS[kind]
    if torch_fn is not None:
        with pytest.raises(TypeError):
            torch_fn(value)
    with pytest.raises(TypeError, match=message) as e:
        fn(value)
    assert isinstance(e.value, ours) and isinstance(e.value, RuntimeError)


@pytest.mark.parametrize("value", [[1.0], "x", None, True], ids=repr)
def test_a_scale_of_another_type_is_a_type_error(value):
    with pytest.raises(TypeError, match="scale must be a number or tensor, got") as e:
        mm(_A, _B, epilogue=[Scale(value)])
    assert isinstance(e.value, EpilogueError)


def test_tensor_valued_bad_inputs_stay_value_errors():
    """Only the type of a non-tensor changed: a tensor of the wrong shape is no TypeError."""
    for call in (lambda: mm(_A, _A), lambda: mm(_A, _B, bias=torch.randn(3))):
        with pytest.raises(ValueError, match="must") as e:
            call()
        assert not isinstance(e.value, TypeError)


def test_a_meta_and_a_non_tensor_names_the_non_tensor():
    # it blamed a's device: "mm: a must be on device 'cpu', got meta"
    with pytest.raises(TypeError, match=r"mm: b must be a torch\.Tensor, got list"):
        mm(torch.empty(3, 4, device="meta"), [1.0])


# --- item 2: the settled table keys on the resolved ISA level ------------------------------------


@pytest.fixture
def settles(fresh_cache, monkeypatch):
    """The ``isa`` setting each tuner question (``mm._choose``) was asked under; ATen only, so
    nothing compiles or is timed."""
    if not native.enabled():
        pytest.skip("no native toolchain: nothing settles")
    asked: list[str] = []
    real = mm_mod._choose

    def counting(*a, **k):
        asked.append(config.get("isa"))
        return real(*a, **k)

    monkeypatch.setattr(mm_mod, "_choose", counting)
    # (from the environment, not an override: outside one the state is memoized per stamp)
    monkeypatch.setenv("TORCHPORT_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN")
    monkeypatch.delenv("TORCHPORT_ISA", raising=False)
    return asked


def _call() -> None:
    mm(torch.randn(7, 24), torch.randn(24, 40))


def test_auto_and_its_resolved_level_settle_once_under_override(settles):
    level = native.cpu_info().isa
    with config.override(isa="auto"):
        _call()
    with config.override(isa=level):
        _call()  # settled again under the setting's raw value: a second tuner question
    assert settles == ["auto"]
    if level != "scalar":  # another level is another state
        with config.override(isa="scalar"):
            _call()
        assert settles == ["auto", "scalar"]


def test_auto_and_its_resolved_level_settle_once_from_the_environment(settles, monkeypatch):
    for value in ("auto", native.cpu_info().isa, "auto"):
        monkeypatch.setenv("TORCHPORT_ISA", value)
        _call()
    assert settles == ["auto"]
    config._generation[0] += 1  # what any assignment does: the stamp changes, the values the
    _call()  # settings resolve to do not, so no new state either
    assert settles == ["auto"]


# --- items 3 and 4: the A/B tools' options -------------------------------------------------------


@pytest.mark.parametrize(
    "what, message",
    [
        ("missing.py", "cannot read '{}': No such file or directory"),
        (".", "cannot read '{}': Is a directory"),
        ("other.txt", "'{}' is not a copy of torchport/gemm/templates.py"),
        ("broken.py", "cannot load '{}'"),
    ],
)
def test_against_a_bad_file_is_a_usage_error(tmp_path, capsys, parse_only, what, message):
    """--against was loaded after our side's library was built: a missing file was a
    FileNotFoundError traceback, a name without .py an AssertionError."""
    (tmp_path / "other.txt").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def (\n")
    path = str(tmp_path / what) if what != "." else str(tmp_path)
    assert benchmarks.run_benchmark("gemm_activation", ["--against", path]) == 2
    assert f"error: argument --against: {message.format(path)}" in capsys.readouterr().err


def test_against_a_templates_copy_parses(parse_only):
    path = mm_mod.__file__.replace("mm.py", "templates.py")
    with pytest.raises(parse_only) as e:
        benchmarks.run_benchmark("gemm_activation", ["--against", path])
    assert e.value.args[0].against.VW == importlib.import_module("torchport.gemm.templates").VW


@pytest.mark.parametrize(
    "variants, message",
    [
        (["a=x>>y", "a=z>>w"], "'a' is repeated in 'a=z>>w'"),
        (["m64_k64", "b=x>>y", "m64_k64"], "'m64_k64' is repeated in 'm64_k64'"),
        (["m64_k64", "m64_k64=x>>y"], "'m64_k64' is repeated in 'm64_k64=x>>y'"),
        (["aten=x>>y"], "must not be as_built (the source as built's row) or aten"),
        (["as_built=x>>y"], "must not be as_built"),
    ],
)
def test_amx_ab_refuses_a_repeated_or_taken_variant_name(capsys, parse_only, variants, message):
    """A later --variant of a name replaced the earlier one in the results, unreported (and
    'aten' was replaced by --aten's row, 'as_built' replaced the source as built)."""
    argv = [arg for v in variants for arg in ("--variant", v)]
    assert benchmarks.run_benchmark("gemm_amx_ab", argv) == 2
    assert "error: argument --variant: " in (err := capsys.readouterr().err) and message in err


def test_amx_ab_distinct_variants_parse(parse_only):
    argv = ["--variant", "a=x>>y", "--variant", "m64_k64", "--variant", "m32_k64"]
    with pytest.raises(parse_only) as e:
        benchmarks.run_benchmark("gemm_amx_ab", argv)
    assert e.value.args[0].variant == ["a=x>>y", "m64_k64", "m32_k64"]
