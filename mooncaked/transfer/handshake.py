"""The data-connection handshake (wire version 2): every TCP data connection starts with it.

1. Client -> server HELLO: magic b"MCKD", wire version u8, a pad byte, cluster id length u16, the client's nonce;
   then the cluster id.
2. Server: a wrong magic, version or cluster id gets one error reply (tag 0) and the connection closes. Else the
   CHALLENGE: a reply (tag 0, STATUS_OK) whose message is the server's nonce followed, when the server has a
   secret, by its proof.
3. Client: with a secret it checks the server's proof, and refuses a server that gives none (it could be anyone
   listening on that port); then AUTH: a flag byte (has a proof) and the proof (zeros without a secret).
4. Server: with a secret, a missing or wrong proof gets one error reply and the connection closes; else a last
   reply (tag 0, STATUS_OK) whose message is the server's NIC advertisement (nics.py; empty without NICs), so
   only an authenticated client learns the server's addresses. Only then are request frames read: before it, no
   segment byte is read or written.

Proofs are those of `mooncaked.runtime.auth` under their own label, so an RPC proof is no data proof. Both sides run on
blocking sockets under the kernel timeouts of `wire.set_io_timeout`: a stalled peer is a TimeoutError.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field

from mooncaked.runtime import auth
from mooncaked.transfer import wire
from mooncaked.transfer.nics import Nic, decode_advert

DATA_AUTH_LABEL = b"mooncaked-data-v2"
HELLO = struct.Struct("<4sBxH16s")  # magic, wire version, pad, cluster id length, client nonce
AUTH = struct.Struct("<B32s")  # has proof, proof
MAGIC = b"MCKD"
MAX_CLUSTER_ID_BYTES = 256
HANDSHAKE_TAG = 0  # frames count from 1, so tag 0 is the handshake's
_LINGER_BYTES = 1 << 20
_LINGER_S = 1.0


@dataclass(frozen=True)
class DataCredentials:
    """Who this engine is to its peers: the cluster id and, when configured, the cluster secret."""

    cluster_id: str = ""
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.cluster_id.encode()) > MAX_CLUSTER_ID_BYTES:
            raise ValueError(f"cluster id longer than {MAX_CLUSTER_ID_BYTES} bytes")
        if self.secret is not None and not self.secret:
            raise ValueError("an empty secret authenticates nothing: give None or a non-empty secret")


class HandshakeRefused(wire.RemoteRejected):
    """The peer refused this side's handshake, or this side refused the peer's (not retryable elsewhere)."""


# ---- client side ------------------------------------------------------------------------------------------------

def client_handshake(sock: socket.socket, credentials: DataCredentials, endpoint: str) -> list[Nic]:
    """Authenticate a freshly connected data socket and return the server's NICs; HandshakeRefused or
    ConnectionError/TimeoutError if not."""
    client_nonce = auth.new_nonce()
    cluster_id = credentials.cluster_id.encode()
    sock.sendall(HELLO.pack(MAGIC, wire.WIRE_VERSION, len(cluster_id), client_nonce) + cluster_id)
    challenge = _expect_ok(sock, endpoint)
    if len(challenge) not in (auth.NONCE_BYTES, auth.NONCE_BYTES + auth.PROOF_BYTES):
        raise ConnectionError(f"{endpoint}: handshake challenge of {len(challenge)} bytes")
    server_nonce, server_proof = challenge[: auth.NONCE_BYTES], challenge[auth.NONCE_BYTES :]
    proof = bytes(auth.PROOF_BYTES)
    secret = credentials.secret
    if secret is not None:
        if not server_proof:
            raise HandshakeRefused(f"{endpoint} does not authenticate: configure cluster.secret_file there too")
        expected = auth.handshake_proof(secret, DATA_AUTH_LABEL, auth.SIDE_SERVER, credentials.cluster_id,
                                        client_nonce, server_nonce)
        if not auth.proofs_match(server_proof, expected):
            raise HandshakeRefused(f"{endpoint} failed to prove the cluster secret")
        proof = auth.handshake_proof(secret, DATA_AUTH_LABEL, auth.SIDE_CLIENT, credentials.cluster_id,
                                     client_nonce, server_nonce)
    sock.sendall(AUTH.pack(secret is not None, proof))
    advert = _expect_ok(sock, endpoint)
    try:
        return decode_advert(advert)
    except ValueError as exc:
        raise ConnectionError(f"{endpoint}: {exc}") from None


def _expect_ok(sock: socket.socket, endpoint: str) -> bytes:
    status, message = wire.recv_reply_bytes(sock, HANDSHAKE_TAG)
    if status != wire.STATUS_OK:
        raise HandshakeRefused(f"{endpoint} refused the data handshake: "
                               f"{message.decode(errors='replace')}")
    return message


# ---- server side ------------------------------------------------------------------------------------------------

def serve_handshake(sock: socket.socket, credentials: DataCredentials, advert: bytes = b"") -> str:
    """Run the server side, ending with `advert` (this engine's NICs); "" when the peer is accepted, else why not
    (the peer got one error reply)."""
    head = bytearray(HELLO.size)
    wire.recv_exactly(sock, memoryview(head))
    magic, version, cluster_id_len, client_nonce = HELLO.unpack(head)
    if magic != MAGIC:
        return _refuse(sock, wire.STATUS_UNAUTHENTICATED, "every data connection starts with the mooncaked data "
                       f"handshake (wire version {wire.WIRE_VERSION}); this peer sent something else")
    if version != wire.WIRE_VERSION:
        return _refuse(sock, wire.STATUS_BAD_REQUEST, f"wire version {version} is not supported (this side speaks "
                       f"{wire.WIRE_VERSION}): run the same mooncaked version on both ends")
    if cluster_id_len > MAX_CLUSTER_ID_BYTES:
        return _refuse(sock, wire.STATUS_BAD_REQUEST, f"cluster id longer than {MAX_CLUSTER_ID_BYTES} bytes")
    cluster_id = bytearray(cluster_id_len)
    wire.recv_exactly(sock, memoryview(cluster_id))
    if bytes(cluster_id) != credentials.cluster_id.encode():
        return _refuse(sock, wire.STATUS_UNAUTHENTICATED, "the cluster id is not this engine's")
    server_nonce = auth.new_nonce()
    secret = credentials.secret
    proof = b"" if secret is None else auth.handshake_proof(
        secret, DATA_AUTH_LABEL, auth.SIDE_SERVER, credentials.cluster_id, client_nonce, server_nonce)
    wire.send_reply_bytes(sock, HANDSHAKE_TAG, wire.STATUS_OK, server_nonce + proof)
    answer = bytearray(AUTH.size)
    wire.recv_exactly(sock, memoryview(answer))
    has_proof, client_proof = AUTH.unpack(answer)
    if secret is not None:
        expected = auth.handshake_proof(secret, DATA_AUTH_LABEL, auth.SIDE_CLIENT, credentials.cluster_id,
                                        client_nonce, server_nonce)
        if not has_proof:
            return _refuse(sock, wire.STATUS_UNAUTHENTICATED, "this engine requires the cluster secret: "
                           "configure cluster.secret_file on the client")
        if not auth.proofs_match(client_proof, expected):
            return _refuse(sock, wire.STATUS_UNAUTHENTICATED, "wrong cluster secret")
    wire.send_reply_bytes(sock, HANDSHAKE_TAG, wire.STATUS_OK, advert)
    return ""


def _refuse(sock: socket.socket, status: int, reason: str) -> str:
    """Send the one error reply, then close our side and discard what the peer still sends (bounded), so the
    reply is not lost to a reset."""
    wire.send_reply(sock, HANDSHAKE_TAG, status, reason)
    try:
        sock.shutdown(socket.SHUT_WR)
        scratch = bytearray(64 << 10)
        num_discarded, deadline = 0, time.monotonic() + _LINGER_S
        while num_discarded < _LINGER_BYTES and time.monotonic() < deadline:
            num_received = sock.recv_into(scratch)
            if num_received == 0:
                break
            num_discarded += num_received
    except OSError:
        pass
    return reason
