"""torchport.distributed: fault tolerance on any c10d backend (gloo today).

Modules: :mod:`~torchport.distributed.flight_recorder` (per-op ring buffer and dumps),
:mod:`~torchport.distributed.fr_analyze` (``torchport fr analyze``),
:mod:`~torchport.distributed.reconfigure` (2.14's ``_reconfigure`` API),
:mod:`~torchport.distributed.window` (one-sided RMA windows) and
:mod:`~torchport.distributed.ft` (fault-tolerant data-parallel training).
"""

from torchport.distributed._control import AuthError, CommError, PeerFailure
from torchport.distributed.reconfigure import (
    ReconfigurableGroup,
    ReconfigureError,
    ReconfigureOptions,
    _get_reconfigure_handle,
    _reconfigure,
    _supports_reconfigure,
    init_process_group,
)
from torchport.distributed.window import Window, WindowError, _new_window, _supports_window

__all__ = [
    "AuthError",
    "CommError",
    "PeerFailure",
    "ReconfigurableGroup",
    "ReconfigureError",
    "ReconfigureOptions",
    "Window",
    "WindowError",
    "_get_reconfigure_handle",
    "_new_window",
    "_reconfigure",
    "_supports_reconfigure",
    "_supports_window",
    "init_process_group",
]
