"""The server side of one connection's handshake (no I/O: the connection sends what it returns).

1. Hello (protocol version, role, instance, cluster id, client nonce): checked against the server; the answer is
   a Challenge (server nonce, and the server's HMAC proof when a secret is configured).
2. Auth (the client's proof, when the server has a secret): checked in constant time; the answer is Welcome,
   which makes the connection ready for calls.
3. Any other frame, or a check that fails, raises the RpcError that the connection sends (as an error frame with
   id 0) before it closes.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from mooncaked.rpc.calls import ServerHost
from mooncaked.rpc.errors import InvalidArgument, Unauthenticated
from mooncaked.rpc.frames import NONCE_BYTES, handshake_proof
from mooncaked.rpc.protocol import PROTOCOL_VERSION, Auth, Challenge, Hello, ProtocolError, Welcome, decode_frame


class ServerHandshake:
    """Owns one connection's handshake state: both nonces, the peer's identity and whether Hello was seen."""

    def __init__(self, server: ServerHost) -> None:
        self.server = server
        self.peer_role = ""
        self.peer_instance = ""
        self._client_nonce = b""
        self._server_nonce = b""
        self._is_hello_done = False

    def step(self, frame: Any) -> Challenge | Welcome:
        """The answer to one handshake frame; raises the RpcError that refuses the connection."""
        try:
            message = decode_frame(frame)
        except ProtocolError as exc:
            raise InvalidArgument(f"bad handshake frame: {exc}") from None
        if not self._is_hello_done and type(message) is Hello:
            return self._on_hello(message)
        if self._is_hello_done and type(message) is Auth:
            return self._on_auth(message)
        raise InvalidArgument(f"unexpected {message.TYPE!r} frame during the handshake")

    def _on_hello(self, hello: Hello) -> Challenge:
        server = self.server
        if hello.protocol_version != PROTOCOL_VERSION:
            raise InvalidArgument(f"protocol version {hello.protocol_version} is not {PROTOCOL_VERSION}; "
                                  "run the same mooncaked version on both ends")
        if hello.cluster_id != server.cluster_id:
            raise Unauthenticated(f"cluster id {hello.cluster_id!r} is not this server's {server.cluster_id!r}")
        if len(hello.client_nonce) != NONCE_BYTES:
            raise InvalidArgument(f"client nonce must be {NONCE_BYTES} bytes")
        self.peer_role, self.peer_instance = hello.role, hello.instance
        self._client_nonce, self._server_nonce = hello.client_nonce, os.urandom(NONCE_BYTES)
        proof = b""
        if server.secret is not None:
            proof = handshake_proof(server.secret, b"server", server.cluster_id, self._client_nonce,
                                    self._server_nonce)
        self._is_hello_done = True
        return Challenge(PROTOCOL_VERSION, server.role, server.instance, self._server_nonce, proof)

    def _on_auth(self, auth: Auth) -> Welcome:
        server = self.server
        if server.secret is not None:
            expected = handshake_proof(server.secret, b"client", server.cluster_id, self._client_nonce,
                                       self._server_nonce)
            if not auth.proof:
                raise Unauthenticated("this server requires the cluster secret; configure it on the client")
            if not hmac.compare_digest(auth.proof, expected):
                raise Unauthenticated("wrong cluster secret")
        return Welcome(server.max_frame_bytes, server.max_inflight_calls)

