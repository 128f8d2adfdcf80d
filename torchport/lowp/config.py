"""``torchport.quantize_(model, config)``: swap ``nn.Linear`` weights for quantized tensors.

Configs are keyword-only frozen dataclasses validated on construction (torchao's config names):

- :class:`Float8WeightOnlyConfig` — FP8 weights, high-precision activations;
- :class:`Float8DynamicActivationFloat8WeightConfig` — FP8 weights, activations quantized at run
  time with the weights' granularity (per row or per tensor) at every batch size, as torchao's:
  prefill through :func:`torchport.scaled_mm`, decode (one to eight rows) through the FP8 GEMV on
  the dequantized activation; a NaN or infinity in an activation row makes that row's outputs NaN
  (every output, with per-tensor scaling) at every batch size, as torchao's quantization and
  ``torch._scaled_mm`` do;
- :class:`NVFP4WeightOnlyConfig` — NVFP4 weights (optional per-tensor scale);
- :class:`MXWeightOnlyConfig` — MXFP4 / MXFP8 weights;

  (the FP4 decode GEMV, one to eight activation rows, quantizes the activations to int8 per 32
  elements by default — ``amax / 127``, round half to even: errors of 5–7e-3 of the largest
  output were measured at K = 4096, so a row's result can differ between a batch of eight rows
  and one of nine, which takes the GEMM; ``torchport.config.gemv_fp4_int8 = False`` or
  ``TORCHPORT_GEMV_FP4_INT8=0`` keeps float32 activations)
- :class:`NVFP4DynamicActivationNVFP4WeightConfig` — NVFP4 weights and NVFP4 activations quantized
  per token per 16-block at run time (optional dynamic per-tensor scale);
- :class:`MXDynamicActivationMXWeightConfig` — MX weights and MX activations per token per 32-block.

With activation quantization the GEMV/GEMM multiplies the quantized operands (see
:mod:`torchport.lowp.tensors`). Quantized weights are frozen; ``F.linear`` stays differentiable in
its input (gradient through the dequantized weight, straight-through activation quantization).

A linear whose ``in_features`` is not a multiple of the format's block size is left alone and
counted in the returned report (never padded silently).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from torchport.lowp import mx
from torchport.lowp.formats import FP8_DTYPES, LowPrecisionError
from torchport.lowp.tensors import Float8Tensor, LowPrecisionTensor, MXTensor, NVFP4Tensor


def _check_bool(cfg: object, name: str) -> None:
    """A flag field must be a bool: ``NVFP4Tensor.from_float`` reads a number as a fixed
    per-tensor scale (``1`` would mean a scale of 1.0) and other values fail later, untyped."""
    value = getattr(cfg, name)
    if not isinstance(value, bool):
        raise LowPrecisionError(
            f"{type(cfg).__name__}: {name} must be True or False, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True)
class Float8WeightOnlyConfig:
    """FP8 weights (``dtype``) with per-row or per-tensor scales."""

    dtype: torch.dtype = torch.float8_e4m3fn
    granularity: str = "row"

    def __post_init__(self) -> None:
        if self.dtype not in FP8_DTYPES:
            raise LowPrecisionError(f"dtype must be float8_e4m3fn or float8_e5m2, got {self.dtype}")
        if self.granularity not in ("row", "tensor"):
            raise LowPrecisionError(
                f"granularity must be 'row' or 'tensor', got {self.granularity!r}"
            )

    block = 1

    def quantize(self, w: torch.Tensor) -> LowPrecisionTensor:
        return Float8Tensor.from_float(w, self.dtype, self.granularity)


@dataclass(frozen=True, kw_only=True)
class Float8DynamicActivationFloat8WeightConfig(Float8WeightOnlyConfig):
    """FP8 weights and FP8 activations (dynamic scale, per row or per tensor as the weights'),
    quantized at every batch size (decode GEMV and prefill GEMM alike). Non-finite activations
    are not rejected: torchao's arithmetic gives the rows holding a NaN or an infinity (with
    per-tensor scaling: the whole input) a NaN or infinite scale, and their outputs are NaN
    (:func:`torchport.lowp.fp8.fp8_quantize_activation`)."""

    activation_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.activation_dtype not in FP8_DTYPES:
            raise LowPrecisionError(
                f"activation_dtype must be float8_e4m3fn or float8_e5m2, got {self.activation_dtype}"
            )

    def quantize(self, w: torch.Tensor) -> LowPrecisionTensor:
        return Float8Tensor.from_float(w, self.dtype, self.granularity, self.activation_dtype)


@dataclass(frozen=True, kw_only=True)
class NVFP4WeightOnlyConfig:
    """NVFP4 weights; ``use_per_tensor_scale`` adds torchao's FP32 per-tensor scale. Decode
    (one to eight rows) quantizes the activations to int8 unless ``config.gemv_fp4_int8`` is
    off (module docstring)."""

    use_per_tensor_scale: bool = True
    block = 16

    def __post_init__(self) -> None:
        _check_bool(self, "use_per_tensor_scale")

    def quantize(self, w: torch.Tensor) -> LowPrecisionTensor:
        return NVFP4Tensor.from_float(w, per_tensor_scale=self.use_per_tensor_scale)


@dataclass(frozen=True, kw_only=True)
class MXWeightOnlyConfig:
    """MX weights with element type ``elem`` (``fp4_e2m1``, ``fp8_e4m3``, ``fp8_e5m2``). With
    ``fp4_e2m1``, decode (one to eight rows) quantizes the activations to int8 unless
    ``config.gemv_fp4_int8`` is off (module docstring)."""

    elem: str = "fp4_e2m1"
    block = 32

    def __post_init__(self) -> None:
        if self.elem not in mx.ELEMS:
            raise LowPrecisionError(f"elem must be one of {mx.ELEMS}, got {self.elem!r}")

    def quantize(self, w: torch.Tensor) -> LowPrecisionTensor:
        return MXTensor.from_float(w, self.elem)


@dataclass(frozen=True, kw_only=True)
class NVFP4DynamicActivationNVFP4WeightConfig(NVFP4WeightOnlyConfig):
    """NVFP4 weights and NVFP4 activations; ``use_dynamic_per_tensor_scale`` gives each
    activation a per-tensor scale from its amax (torchao's ``NVFP4MMConfig.DYNAMIC``)."""

    use_dynamic_per_tensor_scale: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bool(self, "use_dynamic_per_tensor_scale")

    def quantize(self, w: torch.Tensor) -> LowPrecisionTensor:
        return NVFP4Tensor.from_float(
            w,
            per_tensor_scale=self.use_per_tensor_scale,
            act_per_tensor_scale=self.use_dynamic_per_tensor_scale,
        )


@dataclass(frozen=True, kw_only=True)
class MXDynamicActivationMXWeightConfig(MXWeightOnlyConfig):
    """MX weights (``elem``) and MX activations (``activation_elem``, default: same as ``elem``)."""

    activation_elem: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.activation_elem is not None and self.activation_elem not in mx.ELEMS:
            raise LowPrecisionError(
                f"activation_elem must be one of {mx.ELEMS} or None, got {self.activation_elem!r}"
            )

    def quantize(self, w: torch.Tensor) -> LowPrecisionTensor:
        return MXTensor.from_float(w, self.elem, self.activation_elem or self.elem)


Config = (
    Float8WeightOnlyConfig
    | Float8DynamicActivationFloat8WeightConfig
    | NVFP4WeightOnlyConfig
    | MXWeightOnlyConfig
    | NVFP4DynamicActivationNVFP4WeightConfig
    | MXDynamicActivationMXWeightConfig
)


@dataclass
class QuantizeReport:
    """What ``quantize_`` did: qualified names of swapped and skipped linears."""

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def quantize_(
    model: nn.Module,
    config: Config,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> QuantizeReport:
    """Quantize the weights of ``model``'s ``nn.Linear`` modules in place (inference only).

    ``filter_fn(module, fqn)`` chooses linears (default: all). Weights become
    ``nn.Parameter(<quantized tensor>, requires_grad=False)``; biases stay as they are. Linears
    sharing one weight Parameter (tied weights) share one quantized Parameter after. A weight
    also held by a module that is not quantized (an ``nn.Embedding`` tied to the output linear, a
    linear ``filter_fn`` leaves out) is skipped with a warning: the tie is kept.
    """
    if not isinstance(model, nn.Module):
        raise LowPrecisionError(
            f"quantize_: model must be an nn.Module, got {type(model).__name__}"
        )
    if not hasattr(config, "quantize"):
        raise LowPrecisionError(f"quantize_: unsupported config {type(config).__name__}")
    report = QuantizeReport()
    # every weight is quantized before any is swapped: a weight that cannot be (a NaN) raises
    # naming its module and leaves the model as it was (it was left half quantized)
    todo: list[tuple[str, nn.Linear, torch.Tensor]] = []
    # by the float weight's id: a weight tied between linears is quantized once and shared
    # (each linear got a quantized copy of its own, splitting the tie)
    quantized: dict[int, torch.Tensor] = {}
    chosen = [
        (fqn, mod)
        for fqn, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and (filter_fn is None or filter_fn(mod, fqn))
    ]
    untouched = _untouched_holders(model, {id(mod) for _, mod in chosen})
    for fqn, mod in chosen:
        if parametrize.is_parametrized(mod, "weight"):
            # (the weight is computed from the parametrization's own parameters on each access:
            # assigning one raised KeyError after earlier linears had been swapped)
            report.skipped[fqn] = "weight is parametrized (torch.nn.utils.parametrize)"
            continue
        if "weight" not in mod._parameters:
            # the legacy nn.utils.weight_norm / spectral_norm hooks delete the Parameter and
            # set a plain tensor before each forward, which then refused the quantized one
            report.skipped[fqn] = "weight is not a Parameter (set by a forward pre-hook)"
            continue
        w = mod.weight
        if isinstance(w, LowPrecisionTensor):
            report.skipped[fqn] = "already quantized"
            continue
        if isinstance(w, nn.parameter.UninitializedParameter):
            report.skipped[fqn] = "uninitialized (lazy) weight: run a forward first"
            continue
        if w.dtype not in (torch.float32, torch.bfloat16):
            report.skipped[fqn] = f"weight dtype {w.dtype} (needs float32 or bfloat16)"
            continue
        if w.shape[1] % config.block:
            report.skipped[fqn] = (
                f"in_features {w.shape[1]} is not a multiple of block {config.block}"
            )
            continue
        if w.numel() == 0:
            report.skipped[fqn] = f"empty weight {tuple(w.shape)}"
            continue
        others = untouched.get(id(w))
        if others:
            # the float Parameter stays where quantize_ does not reach (tied input/output
            # embeddings): quantizing here would split the tie and keep both copies
            why = f"weight shared with {', '.join(others)}, which quantize_ does not quantize"
            report.skipped[fqn] = why
            warnings.warn(f"quantize_: skipped {fqn!r}: {why} (the tie is kept)", stacklevel=2)
            continue
        q = quantized.get(id(w))
        if q is None:
            try:
                q = quantized[id(w)] = config.quantize(w.detach())
            except LowPrecisionError as e:
                raise type(e)(f"quantize_: module {fqn!r} (nothing was swapped): {e}") from e
        todo.append((fqn, mod, q))
    params: dict[int, nn.Parameter] = {}  # one Parameter per quantized weight
    for fqn, mod, q in todo:
        p = params.get(id(q))
        if p is None:
            p = params[id(q)] = nn.Parameter(q, requires_grad=False)
        mod.weight = p
        report.quantized.append(fqn)
    return report


def _untouched_holders(model: nn.Module, chosen: set[int]) -> dict[int, list[str]]:
    """By Parameter id: the slots (``fqn.name``) holding it that quantize_ leaves as they are,
    i.e. any slot but the weight of a chosen linear (modules reached twice count under every
    name)."""
    held: dict[int, list[str]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if name == "weight" and id(mod) in chosen:
                continue
            slot = f"{fqn}.{name}" if fqn else name
            held.setdefault(id(p), []).append(f"{slot} ({type(mod).__name__})")
    return held
