"""msgpack RPC between mooncaked roles: the public names.

Lifecycle of a call:
  1. A service declares its `Method`s (name, request and reply `Message` dataclasses) next to its code; a server
     registers handlers for them (RpcServer.add_method) and listens on TCP and/or a Unix socket.
  2. A client (RpcClient) connects lazily, a pool of connections per address; each connection starts with a
     handshake: protocol version, role, instance, cluster id and, with a cluster secret, a mutual HMAC-SHA256
     challenge-response over fresh nonces.
  3. Calls are 4-byte length-prefixed msgpack frames: {id, method, args, timeout_s} -> {id, result} or
     {id, code, message}; streams send {id, item}... then {id, end}. The deadline travels with the call; the
     client raises DeadlineExceeded and the server cancels the handler past it. A client that gives up sends
     {id} in a cancel frame and the server cancels the handler.
  4. Anything malformed, oversized, unauthenticated or unknown closes only that connection, with a logged reason.
  5. RpcServer.stop(drain_timeout_s) stops accepting, drains, cancels the rest; RpcClient.close() closes the pool.

Other packages import only the names below. Inside: `protocol` (the message base, Method, the frames and the
services every role serves), `codec` / `codec_fields` (message encoding), `frames` (framing, handshake proofs,
deadlines), `server` / `server_conn` / `calls`, `client` / `client_conn`, `errors`.
"""

from mooncaked.rpc.client import RpcClient
from mooncaked.rpc.errors import (ERRORS_BY_CODE, Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                                  ResourceExhausted, RpcError, Unauthenticated, Unavailable)
from mooncaked.rpc.frames import DEFAULT_MAX_FRAME_BYTES, FramedProtocol
from mooncaked.rpc.protocol import (HEALTH, INFO, HealthReply, HealthRequest, InfoReply, InfoRequest, Message, Method,
                                    ProtocolError, ReqT, RespT, decode_message, encode_message)
from mooncaked.rpc.server import RpcServer
from mooncaked.rpc.server_conn import CallContext

__all__ = [
    "CallContext", "Cancelled", "DEFAULT_MAX_FRAME_BYTES", "DeadlineExceeded", "ERRORS_BY_CODE", "FramedProtocol",
    "HEALTH", "HealthReply", "HealthRequest", "INFO", "InfoReply", "InfoRequest", "Internal", "InvalidArgument",
    "Message", "Method", "NotFound", "ProtocolError", "ReqT", "RespT", "ResourceExhausted", "RpcClient", "RpcError",
    "RpcServer", "Unauthenticated", "Unavailable", "decode_message", "encode_message",
]
