"""torchport: PyTorch 2.14's new systems on any machine, CPU first.

Subpackages: ``native`` (kernel toolchain), ``autotune``, ``ops``, ``compiler``, ``control``
(``switch``, ``while_loop``), ``graphs`` (``Graph`` capture/replay, ``MemPool``); ``config`` holds
settings. ``torchport.compile`` is ``torch.compile`` with the torchport backend (registered as
``backend="torchport"`` on import).
"""

import inspect
import sys

import torch.distributed as dist

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


def _forget_captured_world() -> None:
    """Give back the default process group that ``torch.distributed.nn.functional`` captured.

    That module's functions take ``group=group.WORLD`` as a default argument, evaluated when the
    module is imported, and importing torchport imports it (through ``torch._dynamo``). Imported
    after ``init_process_group``, the defaults held the default group itself, so
    ``destroy_process_group()`` no longer freed it: a gloo group's worker threads ran on into
    interpreter exit, and one still releasing the tensors of the last collective there took the
    GIL and aborted the process ("terminate called without an active exception": Python ends a
    thread that takes the GIL during finalization, and the unwind crossed a noexcept frame; seen
    in 1 of 40 runs of a one-rank gloo script under load). ``None`` is the default those
    functions get when imported before ``init_process_group``: the default group of the moment.
    """
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None or not dist.is_available():
        return
    for fn in vars(functional).values():
        defaults = fn.__defaults__ if inspect.isfunction(fn) else None
        if defaults is not None and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )


_forget_captured_world()
