"""The error model of the ``torchport`` backend: every failure is a typed value.

A communicator that fails keeps its first error; :meth:`TorchportProcessGroup.get_error` returns
it and every later operation raises it again (wrapped in :class:`CommunicatorErrorState`), so a
broken group never hangs and never returns wrong data. The kinds:

- :class:`CommTimeoutError`: an operation did not complete within its (per-op or per-group)
  timeout;
- :class:`CommError`: a local communication failure (socket closed, bad frame, shm failure);
  :class:`CommAbortedError` when this rank called ``abort()``;
- :class:`RemoteError`: a peer aborted, timed out or failed and told us so;
  :class:`PeerLeftError` when an operation needed a peer that left the job (its goodbye was
  read);
- :class:`CollectiveMismatchError`: ranks issued different collectives (op, dtype, size, root).

All derive from ``torch.distributed.DistBackendError`` so callers that catch torch's own
distributed errors catch ours too.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import DistBackendError


class TorchportDistError(DistBackendError):
    """Base class of every error raised by the ``torchport`` backend."""


class CommTimeoutError(TorchportDistError, TimeoutError):
    """An operation exceeded its timeout."""


class CommError(TorchportDistError):
    """A local communication failure."""


class CommAbortedError(CommError):
    """The communicator was aborted on this rank."""


class RemoteError(TorchportDistError):
    """A peer failed or aborted; the message names the peer and its reason."""


class PeerLeftError(RemoteError):
    """An operation needed a peer that left the job: it closed its connections with a goodbye
    (``destroy_process_group`` or its process's exit) after everything it sent had been
    received, and what the operation waited for was not among it. (Defined in
    ``transport_tcp`` before; it is still importable from there and from
    ``torchport.distributed``.)"""


class CollectiveMismatchError(TorchportDistError, ValueError):
    """Ranks issued mismatched collectives (different op, dtype, size or root)."""


class CommunicatorErrorState(TorchportDistError):
    """The communicator already failed; its first error is the ``__cause__``."""


class WireError(CommError, ValueError):
    """A received frame violates the wire format (magic, version, kind or length bound)."""


class ConnectTimeoutError(CommError, CommTimeoutError):
    """Opening a control connection timed out (the peer accepted nothing or stopped answering
    the handshake): a :class:`CommError` for callers that handle any failed connection, and a
    :class:`CommTimeoutError` for those that tell a timeout from a refusal."""


class AuthError(CommError):
    """A peer failed authentication (wrong secret, rank or job)."""


class CollectiveArgumentError(TorchportDistError, ValueError):
    """A collective was called with arguments it cannot accept (the message says which)."""


def clip_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a one-line report of a peer's value (an
    int whose repr would raise, past 4300 digits, is described by its size)."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:
        return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except ValueError:  # (such an int nested in a list)
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_int(v: Any) -> bool:
    """An int that is no bool (a peer's ``true`` is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)
