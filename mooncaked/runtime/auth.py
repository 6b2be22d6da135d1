"""Proofs of the cluster secret, shared by the RPC handshake and the transfer engine's data handshake.

1. Each side of a new connection sends a fresh random nonce (`new_nonce`).
2. Each side proves that it knows the secret with `handshake_proof`: HMAC-SHA256 over the protocol's label, the
   side ("client" or "server"), the cluster id and both nonces. The side stops a peer from reflecting a proof back;
   the label stops a proof made for one protocol from being accepted by the other; the nonces stop replays.
3. The receiver compares with `proofs_match` (constant time).

The secret itself never crosses the wire and is never logged.
"""

from __future__ import annotations

import hmac
import os

NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
SIDE_CLIENT = b"client"
SIDE_SERVER = b"server"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def handshake_proof(secret: bytes, label: bytes, side: bytes, cluster_id: str, client_nonce: bytes,
                    server_nonce: bytes) -> bytes:
    """HMAC-SHA256 proving knowledge of `secret` on one side of one connection of protocol `label`."""
    text = label + b"|" + side + b"|" + cluster_id.encode() + b"|" + client_nonce + server_nonce
    return hmac.new(secret, text, "sha256").digest()


def proofs_match(given: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(given, expected)
