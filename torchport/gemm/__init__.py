"""CPU GEMM engine: generated kernels with fused epilogues, autotuned against ATen.

``torchport.gemm.mm(a, b, bias=..., epilogue=[...])`` is the entry point; the compiler pass in
:mod:`torchport.compiler.gemm_fusion` rewrites ``linear``/``mm``/``addmm``/``matmul`` + epilogue
chains in ``torch.compile`` graphs into the same custom op (``torch.ops.torchport.gemm``).
"""

from torchport.gemm.epilogue import (
    Add,
    Bias,
    Cast,
    EpilogueError,
    EpilogueSpec,
    Gelu,
    Relu,
    Scale,
    Silu,
)
from torchport.gemm.kernels import Config, GemmInputError, mm_aten, mm_reference
from torchport.gemm.mm import candidates, choose, decisions, gemm_op, mm
from torchport.gemm.pack import pack_b, pack_b_reference, pack_cache

__all__ = [
    "Add",
    "Bias",
    "Cast",
    "Config",
    "EpilogueError",
    "EpilogueSpec",
    "Gelu",
    "GemmInputError",
    "Relu",
    "Scale",
    "Silu",
    "candidates",
    "choose",
    "decisions",
    "gemm_op",
    "mm",
    "mm_aten",
    "mm_reference",
    "pack_b",
    "pack_b_reference",
    "pack_cache",
]
