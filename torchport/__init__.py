"""torchport: PyTorch 2.14's new systems on any machine, CPU first.

Subpackages: ``native`` (kernel toolchain), ``autotune``, ``ops``, ``compiler``, ``control``
(``switch``, ``while_loop``), ``graphs`` (``Graph`` capture/replay, ``MemPool``); ``config`` holds
settings. ``torchport.compile`` is ``torch.compile`` with the torchport backend (registered as
``backend="torchport"`` on import).
"""

from torchport import config, graphs
from torchport.compiler import compile
from torchport.control import switch, while_loop
from torchport.frontend import (
    STATIC,
    DictSpec,
    DynamicSpecViolation,
    IntVar,
    ObjectSpec,
    ParamsSpec,
    SeqSpec,
    ShapesSpec,
    ShapeVar,
    TensorSpec,
    UnsupportedSpecError,
    dynamic_spec,
    export,
    make_fx,
)
from torchport.lowp import quantize_, scaled_mm
from torchport.version import __version__

__all__ = [
    "STATIC",
    "DictSpec",
    "DynamicSpecViolation",
    "IntVar",
    "ObjectSpec",
    "ParamsSpec",
    "SeqSpec",
    "ShapeVar",
    "ShapesSpec",
    "TensorSpec",
    "UnsupportedSpecError",
    "__version__",
    "compile",
    "config",
    "dynamic_spec",
    "export",
    "graphs",
    "make_fx",
    "quantize_",
    "scaled_mm",
    "switch",
    "while_loop",
]
