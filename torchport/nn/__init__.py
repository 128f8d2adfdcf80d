"""``torchport.nn``: module-level entry points mirroring ``torch.nn``."""

from torchport.nn import functional

__all__ = ["functional"]
