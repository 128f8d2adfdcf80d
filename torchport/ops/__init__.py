"""Small native kernel families (each with a reference beside it)."""

from torchport.ops.elementwise import axpy, axpy_reference, rowsum, rowsum_reference

__all__ = ["axpy", "axpy_reference", "rowsum", "rowsum_reference"]
