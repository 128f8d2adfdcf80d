"""GEMM epilogues: what runs on the fp32 accumulator before the store, as data and as C.

A user writes an epilogue as a sequence of steps (:class:`Bias`, :class:`Relu`, :class:`Gelu`,
:class:`Silu`, :class:`Add`, :class:`Scale`, :class:`Cast`, or any callable). :func:`split` turns it
into a tensor-free, hashable :class:`EpilogueSpec` (part of the kernel's identity and of the custom
op's string argument), the list of tensor operands it reads, and the unsupported tail (callables)
that runs afterwards as ordinary torch ops.

Numerics: every fused step runs in float32 on the accumulator (bf16 operands widen exactly); the
result is rounded once to the output dtype (nearest-even for bf16, as torch). GELU (erf) is
``x Phi(x)``. In the AVX-512 ``vdpbf16ps`` kernels and the AVX-512 epilogue pass (which also
finishes any dtype's ATen arm and the K-split reductions) Phi is a degree-5 polynomial per interval
of width 1/2 on [-5.75, 5.75], its coefficients picked per lane from registers, and 0 / 1 beyond;
elsewhere (AVX2, and the fp32-accumulating AVX-512 tiles, whose M = 1 tiles apply the epilogue to
too few vectors to pay for loading the tables) it is ``1/2 + 1/2 erf(x /
sqrt2)`` with a vectorised erf ``x P(x^2) / Q(x^2)`` (one division), clamped to +-1/2 beyond |x| =
5.73. GELU (tanh) and SiLU are ``x / (1 + exp(-y))`` with a vectorised degree-5 exp and one
division. Measured against torch in float64 over [-12, 12] (step 1e-4): max absolute error 9.5e-7
(rational GELU), 5.1e-7 (GELU-tanh), 1.2e-6 (SiLU, at |x| ~ 4-8, where torch's own float32 SiLU
has the same); within 3e-7 |ref| + 1e-7 |x| for GELU-tanh and SiLU, 3e-7 |ref| + 2e-7 |x| for the
rational GELU (torch's float32 GELU itself reaches 1.04x the 1e-7 form). On every float32 in
[-10, 10] (normal outputs): the piecewise GELU's max absolute error 4.5e-7 (x = 4.18: the
product's rounding and Phi's 4.5e-8), at most 0.37 of 3e-7 |ref| + 1e-7 |x|; the rational's
1.33e-6 (x = 5.51), 0.95 of 3e-7 |ref| + 2e-7 |x|. Both GELUs give torch's float64
edges: -0 -> -0, -huge -> -0, -inf -> NaN, +inf -> inf, NaN -> NaN (torch's own float32 CPU GELU
gives NaN for +inf and inf for 3e38). A bfloat16 output's piecewise Phi is degree 4 (one FMA and
one table lookup fewer: bias+GELU+residual over the bare vdpbf16ps 8x32 kernel, M = 32
1024->4096, one thread, two interleaved pairs of 800-round medians, 1.061 and 1.055 at degree 5,
1.050 and 1.050 at degree 4; bias+residual without an activation 1.035 in the same scratch A/B, so
most of what is left is reading and adding those operands): Phi off by 7.4e-7 at most, and on every 2^-13 in [-10, 10] the bf16 GELU is within 0.57 bf16 ulp of the exact value
for x > -4 and 1 ulp on (-5.75, -4] (|GELU| < 1.3e-4 there), 1.7 % of the values one ulp off the
correctly rounded bf16 (degree 5: 0.2 %); over every float32 the worst are 0.582 and 1.007 ulp
(x = -3.83 and -5.48), and a fused Add that cancels most of the GELU exposes Phi's error (up to
2.1 bf16 ulp where degree 5 gives 0.6). On this machine (Zen 4, one thread, ``bench
gemm_activation``): AVX-512 piecewise GELU 0.205 ns per value (rational 0.28), GELU-tanh 0.28,
SiLU 0.22; AVX2 rational GELU 0.34.
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from torchport.native.launch import is_compiling_here

FUSABLE_DTYPES = (torch.float32, torch.bfloat16)
_DT_TAG = {torch.float32: "f32", torch.bfloat16: "bf16"}
_TAG_DT = {v: k for k, v in _DT_TAG.items()}


class EpilogueError(ValueError, RuntimeError):
    """An epilogue step or its operand does not meet the GEMM's requirements.

    Both ``ValueError`` and ``RuntimeError``, as :class:`~torchport.gemm.kernels.GemmInputError`:
    torch raises ``RuntimeError`` for the bad arguments of ``F.linear`` / ``addmm``, so
    ``except RuntimeError`` written against them catches it too."""


class _EpilogueTypeError(EpilogueError, TypeError):
    """An :class:`EpilogueError` of the wrong type (a list, a number or None for an operand
    tensor, a string for a scale), also a ``TypeError`` as torch raises it for the same argument
    of ``F.linear`` / ``torch.add`` / ``torch.mul`` (code catching torch's TypeError catches
    this too)."""


# --- user-facing steps ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Bias:
    """Add a bias vector: ``dim="col"`` broadcasts ``t[N]`` over rows, ``"row"`` ``t[M]`` over columns."""

    t: torch.Tensor
    dim: str = "col"


@dataclass(frozen=True)
class Relu:
    """``max(x, 0)`` (NaN propagates)."""


@dataclass(frozen=True)
class Gelu:
    """GELU; ``approximate="none"`` (erf) or ``"tanh"``, as :func:`torch.nn.functional.gelu`."""

    approximate: str = "none"


@dataclass(frozen=True)
class Silu:
    """``x * sigmoid(x)``."""


@dataclass(frozen=True, eq=False)
class Add:
    """Add a residual tensor of the output's shape ``[M, N]``."""

    t: torch.Tensor


@dataclass(frozen=True, eq=False)
class Scale:
    """Multiply by a finite scalar, or by a vector along ``dim`` ("col": ``[N]``, "row": ``[M]``)."""

    value: float | torch.Tensor
    dim: str = "col"


@dataclass(frozen=True)
class Cast:
    """Round the result to ``dtype`` (float32 or bfloat16) at the store."""

    dtype: torch.dtype


Step = Bias | Relu | Gelu | Silu | Add | Scale | Cast | Callable[[torch.Tensor], torch.Tensor] | str

_NAMED: dict[str, Step] = {
    "relu": Relu(),
    "gelu": Gelu(),
    "gelu_tanh": Gelu("tanh"),
    "silu": Silu(),
}


# --- the tensor-free spec ------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One fused step: ``kind`` plus, for operand steps, the operand's dtype tag."""

    kind: str  # bias_col bias_row add scale_col scale_row scale relu gelu gelu_tanh silu
    dtype: str = ""  # f32/bf16 for operand steps
    value: float = 0.0  # scalar scale
    # compared and hashed with the value: 0.0 == -0.0, so the interned spec of Scale(-0.0) was
    # Scale(0.0)'s when that came first (a product times -0.0 came out +0.0)
    negative_zero: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        neg0 = self.value == 0.0 and math.copysign(1.0, self.value) < 0
        object.__setattr__(self, "negative_zero", neg0)


TRANSCENDENTAL_KINDS = ("gelu", "gelu_tanh", "silu")
OPERAND_KINDS = ("bias_col", "bias_row", "add", "scale_col", "scale_row")
# steps encoded by their name alone ("scale" is not one: it is encoded as "scale=<value>", and a
# bare "scale" decoded as a multiply by 0.0, which returned zeros)
PLAIN_KINDS = ("relu", "gelu", "gelu_tanh", "silu")


@dataclass(frozen=True)
class EpilogueSpec:
    """The fused part of an epilogue: ordered ops and the output dtype ("" = the inputs')."""

    ops: tuple[Op, ...] = ()
    out: str = ""

    def encode(self) -> str:
        """Stable string form (custom-op argument and cache key); computed once per spec
        (eager calls encode their interned spec on every call)."""
        enc = self.__dict__.get("_encoded")
        if enc is None:
            enc = self._encode()
            object.__setattr__(self, "_encoded", enc)  # a cache, not a field
        return enc

    def _encode(self) -> str:
        parts = []
        for op in self.ops:
            if op.kind == "scale":
                parts.append(f"scale={op.value!r}")
            elif op.dtype:
                parts.append(f"{op.kind}:{op.dtype}")
            else:
                parts.append(op.kind)
        if self.out:
            parts.append(f"out={self.out}")
        return ";".join(parts)

    @property
    def deferrable(self) -> bool:
        """True when the epilogue has a transcendental step (GELU, SiLU): for a few rows the
        kernel then applies it in one pass after the tiles instead of inside each tile."""
        return any(op.kind in TRANSCENDENTAL_KINDS for op in self.ops)

    @staticmethod
    def decode(text: str) -> EpilogueSpec:
        """Inverse of :meth:`encode`; raises :class:`EpilogueError` on a malformed string."""
        return _decode(text)

    @property
    def n_operands(self) -> int:
        return sum(1 for op in self.ops if op.kind in OPERAND_KINDS)

    def out_dtype(self, default: torch.dtype) -> torch.dtype:
        return _TAG_DT[self.out] if self.out else default


@functools.lru_cache(maxsize=1024)
def _decode(text: str) -> EpilogueSpec:
    """Parse an encoded spec (cached: the custom op decodes its string argument on every call)."""
    ops: list[Op] = []
    out = ""
    for part in [p for p in text.split(";") if p]:
        if part.startswith("out="):
            out = part[4:]
            if out not in _TAG_DT:
                raise EpilogueError(f"epilogue output dtype must be f32 or bf16, got {out!r}")
        elif part.startswith("scale="):
            try:
                v = float(part[6:])
            except ValueError:
                raise EpilogueError(f"epilogue scale must be a number, got {part!r}") from None
            if not math.isfinite(v):
                raise EpilogueError(f"epilogue scale must be finite, got {part!r}")
            ops.append(Op("scale", value=v))
        elif ":" in part:
            kind, dt = part.split(":", 1)
            if kind not in OPERAND_KINDS or dt not in _TAG_DT:
                raise EpilogueError(f"unknown epilogue step {part!r}")
            ops.append(Op(kind, dt))
        elif part in PLAIN_KINDS:
            ops.append(Op(part))
        elif part == "scale":
            raise EpilogueError(f"epilogue scale must be given as 'scale=<number>', got {part!r}")
        else:
            raise EpilogueError(f"unknown epilogue step {part!r}")
    return EpilogueSpec(tuple(ops), out)


@dataclass
class Split:
    """Result of :func:`split`: fused spec, its operands, and the unfused tail."""

    spec: EpilogueSpec
    operands: list[torch.Tensor] = field(default_factory=list)
    tail: list[Step] = field(default_factory=list)


def _operand(t: Any, what: str | tuple[int, str], shape: tuple[int, ...]) -> torch.Tensor:
    """Validate an operand tensor; ``what`` names it (``(idx, kind)``: "epilogue step idx kind",
    formatted only for an error message, since this runs per operand on every eager call)."""
    if type(t) is torch.Tensor and t.is_cpu and t.dtype in FUSABLE_DTYPES and t.shape == shape:
        return t
    if not isinstance(what, str):
        what = f"epilogue step {what[0]} {what[1]}"
    if not isinstance(t, torch.Tensor):
        raise _EpilogueTypeError(f"{what} must be a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise EpilogueError(f"{what} must be on cpu, got {t.device}")
    if t.dtype not in FUSABLE_DTYPES:
        raise EpilogueError(f"{what} must be float32 or bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise EpilogueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")
    return t


def as_steps(steps: Sequence[Step] | Step | None) -> list[Step]:
    """Normalise an epilogue argument (None, one step, or a sequence of steps) to a list."""
    if steps is None:
        return []
    if isinstance(steps, (list, tuple)):
        return list(steps)
    return [cast(Step, steps)]


@functools.cache
def _op(kind: str, dtype: str) -> Op:
    """Interned :class:`Op` (split runs per eager call: no dataclass construction per step)."""
    return Op(kind, dtype)


@functools.cache
def _spec(ops: tuple[Op, ...], out: str) -> EpilogueSpec:
    """Interned :class:`EpilogueSpec`."""
    return EpilogueSpec(ops, out)


_PLAIN_OPS: dict[Step, Op] = {
    Relu(): Op("relu"),
    Gelu(): Op("gelu"),
    Gelu("tanh"): Op("gelu_tanh"),
    Silu(): Op("silu"),
}
_PLAIN_OPS.update({name: _PLAIN_OPS[step] for name, step in _NAMED.items()})
_STEP_TYPES = (Bias, Relu, Gelu, Silu, Add, Scale, Cast)


# the parameter-free steps (names, Relu(), Gelu(...), Silu()) as they appear in _FAST_SPECS keys
_PLAIN_CODES: dict[Step, str] = {step: op.kind for step, op in _PLAIN_OPS.items()}

# specs (and their encodings) of epilogues made of parameter-free steps and Add residuals, per
# (the bias's dtype or None, then per step its _PLAIN_CODES code or, for an Add, the residual's
# dtype): such a call (a linear layer with an activation, a residual, or both) skips the walk
# over its steps. Entries come from full splits that fused every step, so a key's dtypes are
# fusable ones; the operands' type, device and shape are checked on every call (_fast_key).
_FAST_SPECS: dict[tuple[Any, ...], tuple[EpilogueSpec, str]] = {}
# Operand types the fast path takes: plain tensors and a layer's nn.Parameter (a linear layer's
# bias); other subclasses (fake, quantized, functional tensors) take the full split.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _fast_key(
    steps: Sequence[Step] | Step | None, m: int, n: int, bias: torch.Tensor | None
) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """The :data:`_FAST_SPECS` key of an epilogue and its operands (bias first), or None when a
    step is of another kind or an operand is not a CPU tensor of the right shape (the full
    :func:`split` then fuses it or raises its error)."""
    if type(steps) is list or type(steps) is tuple:
        seq: Sequence[Any] = steps
    else:
        seq = () if steps is None else (steps,)
    operands: list[torch.Tensor] = []
    key: list[Any] = [None]
    if bias is not None:
        if type(bias) not in _PLAIN_TENSORS or not bias.is_cpu or bias.shape != (n,):
            return None
        key[0] = bias.dtype
        operands.append(bias)
    try:
        for step in seq:
            if type(step) is Add:
                t = step.t
                if type(t) not in _PLAIN_TENSORS or not t.is_cpu or t.shape != (m, n):
                    return None
                key.append(t.dtype)
                operands.append(t)
            else:
                code = _PLAIN_CODES.get(step)
                if code is None:
                    return None
                key.append(code)
    except TypeError:  # an unhashable step (a callable, a Gelu with an unhashable field)
        return None
    return tuple(key), operands


def fast_split(
    steps: Sequence[Step] | Step | None, m: int, n: int, bias: torch.Tensor | None
) -> tuple[str, list[torch.Tensor]] | None:
    """``(encoded spec, operands)`` of an epilogue that :func:`split` has seen before in this
    form (parameter-free steps and residuals, :data:`_FAST_SPECS`), else None: the eager GEMM's
    per-call path, without :class:`Split` or the walk over the steps."""
    if is_compiling_here():  # (a traced read of the cache guarded on its contents)
        return None
    fk = _fast_key(steps, m, n, bias)
    if fk is None:
        return None
    hit = _FAST_SPECS.get(fk[0])
    return None if hit is None else (hit[1], fk[1])


def split(
    steps: Sequence[Step] | Step | None, m: int, n: int, *, bias: torch.Tensor | None = None
) -> Split:
    """Validate ``steps`` for an ``[m, n]`` output and separate the fusable prefix.

    Fusion stops at the first step that is not one of the fused kinds (a callable); it and every
    later step form the tail, applied with torch ops after the kernel. ``bias`` (optional) is a
    leading ``Bias(bias, "col")`` step (step 0), without building the step per call. Epilogues
    of parameter-free steps and residuals take their spec from :data:`_FAST_SPECS` after the
    first call (their operands still checked on every call).
    """
    if is_compiling_here():
        # traced (torch.compile, export; in this thread: torch.compiler.is_compiling() is true
        # in every thread while one compiles): the module-level caches stay out of it -- dynamo
        # guarded on _FAST_SPECS ("key not in it", then the trace added the key: every compiled
        # function compiled twice) and on the whole set of compiled-in scale constants (any new
        # constant anywhere recompiled it, up to the recompile limit)
        return _split(steps, m, n, bias)
    fk = _fast_key(steps, m, n, bias)
    if fk is not None:
        hit = _FAST_SPECS.get(fk[0])
        if hit is not None:
            return Split(hit[0], fk[1], [])
    sp = _split(steps, m, n, bias)
    if fk is not None and not sp.tail and len(_FAST_SPECS) < 1024:
        _FAST_SPECS[fk[0]] = (sp.spec, sp.spec.encode())
    return sp


def _split(steps: Sequence[Step] | Step | None, m: int, n: int, bias: torch.Tensor | None) -> Split:
    # traced: the uncached builders (dynamo warned about each functools.cache call it traced)
    op_of, spec_of = (_op.__wrapped__, _spec.__wrapped__) if is_compiling_here() else (_op, _spec)
    ops: list[Op] = []
    operands: list[torch.Tensor] = []
    tail: list[Step] = []
    out = ""
    if bias is not None:
        t = _operand(bias, (0, "bias"), (n,))
        ops.append(op_of("bias_col", _DT_TAG[t.dtype]))
        operands.append(t)
    for idx, step in enumerate(as_steps(steps), 0 if bias is None else 1):
        if isinstance(step, type) and step in _STEP_TYPES:  # a class, not a step: it was taken
            raise EpilogueError(  # for a callable tail (epilogue=[Gelu] returned a Gelu object)
                f"epilogue step {idx} is the class {step.__name__}, not a step: pass an "
                f"instance, e.g. {step.__name__}()"
            )
        if tail or out:
            if isinstance(step, str):
                step = _named(step)
            # (after a callable the value may have another shape: its steps check then)
            if isinstance(step, (Bias, Add, Scale)) and not any(map(is_user_callable, tail)):
                _check_step_operands(step, m, n)
            tail.append(step)
            continue
        try:
            plain = _PLAIN_OPS.get(step)  # named or parameter-free steps (the common case)
        except TypeError:  # an unhashable callable
            plain = None
        if plain is not None:
            ops.append(plain)
            continue
        if isinstance(step, str):
            step = _named(step)
        if isinstance(step, Bias):
            if step.dim not in ("col", "row"):
                raise EpilogueError(f"Bias.dim must be 'col' or 'row', got {step.dim!r}")
            length = n if step.dim == "col" else m
            t = _operand(step.t, (idx, "bias"), (length,))
            ops.append(op_of(f"bias_{step.dim}", _DT_TAG[t.dtype]))
            operands.append(t)
        elif isinstance(step, Add):
            t = _operand(step.t, (idx, "residual"), (m, n))
            ops.append(op_of("add", _DT_TAG[t.dtype]))
            operands.append(t)
        elif isinstance(step, Scale):
            if isinstance(step.value, torch.Tensor):
                grad = step.value.requires_grad and torch.is_grad_enabled()
                # a constant scalar's value goes into the kernel's code, but while tracing
                # (torch.compile, export) reading it is data-dependent (float() of a traced
                # tensor stopped a fullgraph compile): there it takes the learnable scalar's
                # route, a broadcast column; so does a meta or fake scalar (a meta call's
                # stand-in), which has no value to read
                if (
                    step.value.dim() == 0
                    and not grad
                    and not is_compiling_here()
                    and not _is_fake(step.value)
                ):
                    _scalar_scale(_finite(float(step.value), idx), n, ops, operands)
                    continue
                if step.dim not in ("col", "row"):
                    raise EpilogueError(f"Scale.dim must be 'col' or 'row', got {step.dim!r}")
                length = n if step.dim == "col" else m
                value = step.value
                if value.dim() == 0:  # a learnable scalar: a broadcast column, so it gets a grad
                    if value.dtype not in FUSABLE_DTYPES:  # (a float constant had none); the
                        value = value.float()  # constant route took any dtype's value
                    value = value.reshape(1).expand(length)
                t = _operand(value, (idx, "scale"), (length,))
                ops.append(op_of(f"scale_{step.dim}", _DT_TAG[t.dtype]))
                operands.append(t)
            else:
                # any real number (a numpy scalar too, as torch's own ``x * c`` takes), not bool
                num = step.value
                if isinstance(num, bool) or not isinstance(num, numbers.Real):
                    raise _EpilogueTypeError(
                        f"epilogue step {idx}: scale must be a number or tensor, got {num!r}"
                    )
                try:
                    v = float(num)
                except OverflowError:  # an int beyond float's range (was raised untyped)
                    raise EpilogueError(
                        f"epilogue step {idx}: scale must be finite, got {num!r}"
                    ) from None
                _scalar_scale(_finite(v, idx), n, ops, operands)
        elif isinstance(step, Gelu):
            raise EpilogueError(
                f"Gelu.approximate must be 'none' or 'tanh', got {step.approximate!r}"
            )
        elif isinstance(step, Cast):
            if step.dtype not in FUSABLE_DTYPES:
                raise EpilogueError(f"Cast dtype must be float32 or bfloat16, got {step.dtype}")
            out = _DT_TAG[step.dtype]
        elif callable(step):
            tail.append(step)
        else:
            raise EpilogueError(f"epilogue step {idx} is not a known step: {step!r}")
    return Split(spec_of(tuple(ops), out), operands, tail)


def _is_fake(t: torch.Tensor) -> bool:
    """True for a tensor without values to read: a meta tensor, a fake tensor."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def _named(name: str) -> Step:
    step = _NAMED.get(name)
    if step is None:
        raise EpilogueError(f"unknown epilogue step {name!r}; known: {sorted(_NAMED)}")
    return step


def _check_step_operands(step: Bias | Add | Scale, m: int, n: int) -> None:
    if isinstance(step, Add):
        _operand(step.t, "residual", (m, n))


# A constant scale is compiled into the kernel (its library and its tuning key), so each new
# value costs a compilation (~0.5 s) and, beyond SMALL_M rows, a tuning (1.6-2.7 s measured at
# M=64), and its library stays loaded: a scale that changed on every call (a schedule, a
# temperature) compiled on every call. The first SCALE_CONSTANTS distinct values are compiled in;
# any later one is passed as a [N] column operand (one kernel for all of them).
SCALE_CONSTANTS = 16
_scale_constants: set[str] = set()  # float.hex() of the values compiled in (keeps -0.0 apart)


def _scalar_scale(v: float, n: int, ops: list[Op], operands: list[torch.Tensor]) -> None:
    """Append a constant scale ``v`` (finite) to ``ops``: compiled in while it is one of the
    first :data:`SCALE_CONSTANTS` values, else a float32 column operand of ``n`` copies."""
    key = v.hex()
    if is_compiling_here():  # (see split: no guard on the set; a traced graph's
        ops.append(Op("scale", value=v))  # constants are as many as its source spells out)
        return
    if key in _scale_constants or len(_scale_constants) < SCALE_CONSTANTS:
        _scale_constants.add(key)
        ops.append(Op("scale", value=v))
    else:
        ops.append(_op("scale_col", "f32"))
        operands.append(torch.full((n,), v, dtype=torch.float32))


def _finite(v: float, idx: int) -> float:
    # math, not torch.isfinite(torch.tensor(v)): under torch.compile the tensor's test was a
    # data-dependent branch, which stopped a fullgraph compile of mm(..., [Scale(0.5)])
    if not math.isfinite(v):
        raise EpilogueError(f"epilogue step {idx}: scale must be finite, got {v}")
    return v


# --- torch implementations (reference, ATen anchor, unfused tail) --------------------------------


def apply_torch(
    z: torch.Tensor, spec: EpilogueSpec, operands: Sequence[torch.Tensor], first: int = 0
) -> torch.Tensor:
    """Apply the fused steps ``spec.ops[first:]`` with torch ops in ``z``'s dtype (no final
    cast); ``operands`` are those of the applied steps."""
    it = iter(operands)
    for op in spec.ops[first:] if first else spec.ops:
        k = op.kind
        if k == "bias_col":
            z = z + next(it).to(z.dtype)
        elif k == "bias_row":
            z = z + next(it).to(z.dtype)[:, None]
        elif k == "add":
            z = z + next(it).to(z.dtype)
        elif k == "scale_col":
            # in the wider of the two dtypes, rounded once: a float32 scale column (a scalar
            # Scale past SCALE_CONSTANTS) cast to bf16 first turned 0.1 into 0.10009765625,
            # unlike eager's (a @ b) * 0.1 and the kernels' float32 epilogue
            z = (z * next(it)).to(z.dtype)
        elif k == "scale_row":
            z = (z * next(it)[:, None]).to(z.dtype)
        elif k == "scale":
            z = z * op.value
        elif k == "relu":
            z = torch.relu(z)
        elif k == "gelu":
            z = torch.nn.functional.gelu(z)
        elif k == "gelu_tanh":
            z = torch.nn.functional.gelu(z, approximate="tanh")
        else:
            assert k == "silu", k
            z = torch.nn.functional.silu(z)
    return z


def is_user_callable(step: Step) -> bool:
    """True for a step :func:`split` leaves to the tail as it stands: a callable that is not one
    of the step classes (``epilogue=[Gelu]``, the class, is an error there)."""
    return callable(step) and not (isinstance(step, type) and step in _STEP_TYPES)


def apply_tail(y: torch.Tensor, tail: Sequence[Step]) -> torch.Tensor:
    """Run the unfused remainder of an epilogue as ordinary torch ops.

    ``y`` may be N-D (:func:`torchport.nn.functional.linear` passes its ``[..., N]`` output, so a
    callable sees the shape the caller expects): a known step then applies to its rows
    ``[prod(...), N]`` (a residual of ``y``'s full shape is taken as is)."""
    for step in tail:
        if isinstance(step, str):
            step = _named(step)
        if isinstance(step, Cast):
            y = y.to(step.dtype)
        elif isinstance(step, (Bias, Add, Scale, Relu, Gelu, Silu)):
            shape = y.shape
            if y.dim() < 1:
                raise EpilogueError(
                    f"epilogue step {step!r} needs a result of at least 1-D, got 0-D"
                )
            m, n = math.prod(shape[:-1]), shape[-1]
            if (  # (a non-tensor residual: split's typed error, not an AttributeError)
                isinstance(step, Add)
                and y.dim() != 2
                and isinstance(step.t, torch.Tensor)
                and step.t.shape == shape
            ):
                step = Add(step.t.reshape(m, n))
            sp = split([step], m, n)
            # as the torch op it stands for: a float32 operand after a Cast to bfloat16 gives
            # a float32 result (apply_torch reads operands in the value's dtype)
            user = (
                step.t
                if isinstance(step, (Bias, Add))
                else step.value
                if isinstance(step, Scale) and isinstance(step.value, torch.Tensor)
                else None
            )
            if user is not None and torch.result_type(y, user) != y.dtype:
                y = y.to(torch.result_type(y, user))
            y = apply_torch(y.reshape(m, n), sp.spec, sp.operands).reshape(shape)
        else:
            assert callable(step)
            y = step(y)
    return y


# --- C emission ----------------------------------------------------------------------------------


def emit_c(spec: EpilogueSpec) -> tuple[str, str]:
    """(vector body, scalar body) applying ``spec`` to ``v``/``s`` at row ``i``, column ``j``.

    The bodies use the template vocabulary (VADD, VMUL, VSET1, VZERO, VMAX, VLOAD_f32/bf16,
    SLOAD_f32/bf16, tp_vgelu, tp_vgelu_tanh, tp_vsilu and their scalar forms) and the operand
    tables ``ep`` (pointers) and ``eld`` (row strides).
    """
    vec: list[str] = []
    sca: list[str] = []
    q = 0
    for op in spec.ops:
        k, dt = op.kind, op.dtype
        ct = "float" if dt == "f32" else "uint16_t"
        p = f"((const {ct} *)ep[{q}])"
        if k in ("bias_col", "scale_col"):
            f, g = ("VADD", "+") if k == "bias_col" else ("VMUL", "*")
            vec.append(f"v = {f}(v, VLOAD_{dt}({p} + j));")
            sca.append(f"s = s {g} SLOAD_{dt}({p} + j);")
        elif k in ("bias_row", "scale_row"):
            f, g = ("VADD", "+") if k == "bias_row" else ("VMUL", "*")
            vec.append(f"v = {f}(v, VSET1(SLOAD_{dt}({p} + i)));")
            sca.append(f"s = s {g} SLOAD_{dt}({p} + i);")
        elif k == "add":
            vec.append(f"v = VADD(v, VLOAD_{dt}({p} + i * eld[{q}] + j));")
            sca.append(f"s = s + SLOAD_{dt}({p} + i * eld[{q}] + j);")
        elif k == "scale":
            c = _c_float(op.value)
            vec.append(f"v = VMUL(v, VSET1({c}));")
            sca.append(f"s = s * {c};")
        elif k == "relu":
            vec.append("v = VMAX(VZERO(), v);")
            sca.append("s = s < 0.0f ? 0.0f : s;")
        else:
            vec.append(f"v = tp_v{k}(v);")
            sca.append(f"s = tp_s{k}(s);")
        if k in OPERAND_KINDS:
            q += 1
    return "\n        ".join(vec), "\n        ".join(sca)


def _c_float(v: float) -> str:
    """C float literal of ``v`` rounded once to float32 (nearest-even, as torch rounds a
    Python scalar for a float32 tensor): ``repr(v) + "f"`` is a decimal the compiler rounds to
    float32 itself, a second rounding of the double (1 + 2**-24, halfway between two floats,
    printed 1.0000000596046448 became 1 + 2**-23 where torch gives 1.0). A value beyond
    float32's range is an infinity, as torch's float32 product with it."""
    try:
        f = struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:  # (raised only where the rounding overflows)
        return "__builtin_inff()" if v > 0 else "(-__builtin_inff())"
    return f"{f.hex()}f"  # exact: a float32 value, in hex, needs no further rounding


def emit_prefetch(spec: EpilogueSpec) -> str:
    """C body prefetching, for row ``i`` and columns ``[j, j + nr)``, what the epilogue will read
    there: every line of the residuals' (``[M, N]``) and column vectors' (bias, scale) spans and
    a row vector's element ``i``. Issued before a tile's K loop (or a row block's weight stream),
    so the loads at its store do not each wait for memory (``ep``/``eld`` as in :func:`emit_c`).

    Before, only a residual's first and last element were prefetched and the column bias not at
    all: a cold bias line, and the inner lines of a span wider than two lines (the row-streaming
    driver's 64-column blocks), were each a full memory latency at the store."""
    lines: list[str] = []
    q = 0
    for op in spec.ops:
        ct = "float" if op.dtype == "f32" else "uint16_t"
        per_line = 16 if op.dtype == "f32" else 32  # elements per 64-byte line
        base = f"((const {ct} *)ep[{q}])"
        span = {"add": f"{base} + i * eld[{q}] + j", "bias_col": f"{base} + j"}
        span["scale_col"] = span["bias_col"]
        if op.kind in span:
            lines.append(
                f"{{ const {ct} *p = {span[op.kind]}; for (int64_t c = 0; c < nr; c += "
                f"{per_line}) VPREFETCH(p + c); VPREFETCH(p + nr - 1); }}"
            )
        elif op.kind in ("bias_row", "scale_row"):
            lines.append(f"VPREFETCH({base} + i);")
        if op.kind in OPERAND_KINDS:
            q += 1
    return "\n        ".join(lines)
