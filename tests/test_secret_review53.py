"""An empty job secret is refused, not replaced by the default (session 53).

``secret or default_secret()`` took ``b''`` as "not given": a caller who meant to pin an
explicit (if empty) secret got the user's default instead, with no sign of it.
"""

from __future__ import annotations

import pytest

from torchport.distributed._control import default_secret, job_secret
from torchport.distributed.ft.lighthouse import Lighthouse
from torchport.distributed.ft.manager import Manager
from torchport.distributed.reconfigure import ReconfigurableGroup, ReconfigureError


def test_job_secret_takes_bytes_defaults_none_and_refuses_the_rest() -> None:
    assert job_secret(b"k") == b"k"
    assert job_secret(None) == default_secret()
    with pytest.raises(ValueError, match=r"secret must be non-empty bytes.*got b''"):
        job_secret(b"")
    with pytest.raises(TypeError, match=r"secret must be bytes.*got str"):
        job_secret("key")


def test_an_empty_secret_is_refused_by_every_server_and_client() -> None:
    with pytest.raises(ValueError, match="non-empty bytes"):
        Lighthouse(secret=b"")
    with pytest.raises(ValueError, match="non-empty bytes"):
        Manager(
            lighthouse=("127.0.0.1", 1),
            replica_id="r0",
            state_dict=dict,
            load_state_dict=lambda _s: None,
            secret=b"",
        )
    with pytest.raises(ReconfigureError, match="non-empty bytes"):
        ReconfigurableGroup(secret=b"")
    with pytest.raises(ReconfigureError, match=r"secret must be bytes.*got bytearray"):
        ReconfigurableGroup(secret=bytearray(b"k"))
