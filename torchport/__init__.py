"""torchport: PyTorch 2.14's new systems on any machine, CPU first.

Subpackages: ``native`` (kernel toolchain), ``autotune``, ``ops``, ``compiler``; ``config`` holds
settings. ``torchport.compile`` is ``torch.compile`` with the torchport backend (registered as
``backend="torchport"`` on import).
"""

from torchport import config
from torchport.compiler import compile
from torchport.lowp import quantize_, scaled_mm
from torchport.version import __version__

__all__ = ["__version__", "compile", "config", "quantize_", "scaled_mm"]
