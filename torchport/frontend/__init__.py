"""torchport's compiler front end: declarative dynamic shapes (``@dynamic_spec``) for compile,
export and make_fx. Complex decomposition and small-kernel batching live in ``torchport.compiler``.
"""

from torchport.frontend.apply import SpecCompiled, export, make_fx
from torchport.frontend.dynamic_spec import (
    STATIC,
    Cond,
    DictSpec,
    DynamicSpecViolation,
    Expr,
    IntVar,
    ObjectSpec,
    ParamsSpec,
    SeqSpec,
    ShapesSpec,
    ShapeVar,
    TensorSpec,
    UnsupportedSpecError,
    dynamic_spec,
    resolve_spec,
)
from torchport.frontend.spec_binding import Binding, bind, check_call

__all__ = [
    "STATIC",
    "Binding",
    "Cond",
    "DictSpec",
    "DynamicSpecViolation",
    "Expr",
    "IntVar",
    "ObjectSpec",
    "ParamsSpec",
    "SeqSpec",
    "ShapeVar",
    "ShapesSpec",
    "SpecCompiled",
    "TensorSpec",
    "UnsupportedSpecError",
    "bind",
    "check_call",
    "dynamic_spec",
    "export",
    "make_fx",
    "resolve_spec",
]
