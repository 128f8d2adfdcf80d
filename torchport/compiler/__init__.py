"""torchport's compiler: a torch.compile backend whose FX passes are lists of rules.

``torchport.compile(model)`` or ``torch.compile(model, backend="torchport")``.
"""

from torchport.compiler.backend import (
    PRE_GRAD_PASSES,
    CompileOptionError,
    CompileReport,
    TorchportBackend,
    compile,
    last_report,
    register_backend,
    register_pre_grad_pass,
    report_count,
    reports,
)
from torchport.compiler.passes import (
    Pass,
    PassVerificationError,
    Rule,
    has_static_shape,
    is_call,
    is_plain_tensor,
    node_tensor_meta,
    run_passes,
    single_user,
    verify_graph,
)

register_backend()

from torchport.compiler import gemm_fusion  # noqa: E402  (registers the GEMM fusion pass)

__all__ = [
    "PRE_GRAD_PASSES",
    "CompileOptionError",
    "CompileReport",
    "Pass",
    "PassVerificationError",
    "Rule",
    "TorchportBackend",
    "compile",
    "gemm_fusion",
    "has_static_shape",
    "is_call",
    "is_plain_tensor",
    "last_report",
    "node_tensor_meta",
    "register_backend",
    "register_pre_grad_pass",
    "report_count",
    "reports",
    "run_passes",
    "single_user",
    "verify_graph",
]
