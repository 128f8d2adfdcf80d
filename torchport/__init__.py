"""torchport: PyTorch 2.14's new systems on any machine, CPU first.

Subpackages: ``native`` (kernel toolchain), ``autotune``, ``ops``; ``config`` holds settings.
"""

from torchport import config
from torchport.version import __version__

__all__ = ["__version__", "config"]
