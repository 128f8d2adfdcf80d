"""Structured control flow: :func:`switch` (N-way branch) and :func:`while_loop`."""

from torchport.control.switch import SwitchError, switch, switch_op, switch_reference
from torchport.control.while_loop import WhileLoopError, while_loop, while_loop_reference

__all__ = [
    "SwitchError",
    "WhileLoopError",
    "switch",
    "switch_op",
    "switch_reference",
    "while_loop",
    "while_loop_reference",
]
