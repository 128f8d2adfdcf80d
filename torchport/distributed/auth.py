"""Peer authentication: a per-job secret from the store, HMAC-SHA256 challenge-response.

Rank 0 of the root communicator draws a 32-byte secret (``secrets.token_bytes``) and puts it in
the rendezvous store; every rank reads it. A connecting client proves it knows the secret and
binds its claimed rank into the proof; the server answers with its own proof, so both sides
authenticate each other. Nonces are fresh per connection, so a recorded exchange cannot be
replayed. Anyone who can reach the port but not the store is rejected (and counted).

Exchange (every message a framed, length-bounded :mod:`wire` frame)::

    client -> HELLO(src=rank, payload=nonce_c)
    server -> CHALLENGE(payload=nonce_s + mac(secret, "srv", nonce_c, nonce_s, server_rank))
    client -> PROOF(payload=mac(secret, "cli", nonce_s, nonce_c, client_rank))
    server -> ACCEPT
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
MAC_BYTES = 32
SECRET_BYTES = 32


def new_secret() -> bytes:
    """A fresh per-job secret."""
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    """A fresh per-connection nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def mac(secret: bytes, role: bytes, first: bytes, second: bytes, rank: int) -> bytes:
    """HMAC-SHA256 over a role label, both nonces and the claimed rank."""
    msg = role + b"|" + first + b"|" + second + b"|" + rank.to_bytes(4, "little")
    return hmac.new(secret, msg, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, got)
