"""msgpack RPC between mooncaked roles: the public names.

Lifecycle of a call:
  1. A server registers handlers (RpcServer.add_method) for `Method`s of mooncaked.protocol and listens on TCP
     and/or a Unix socket (start_tcp / start_unix).
  2. A client (RpcClient) connects lazily, a pool of connections per address; each connection starts with a
     handshake: protocol version, role, instance, cluster id and, with a cluster secret, a mutual HMAC-SHA256
     challenge-response over fresh nonces.
  3. Calls are 4-byte length-prefixed msgpack frames: {id, method, args, timeout_s} -> {id, result} or
     {id, code, message}; streams send {id, item}... then {id, end}. The deadline travels with the call; the
     client raises DeadlineExceeded and the server cancels the handler past it. A client that gives up sends
     {id} in a cancel frame and the server cancels the handler.
  4. Anything malformed, oversized, unauthenticated or unknown closes only that connection, with a logged reason.
  5. RpcServer.stop(drain_timeout_s) stops accepting, drains, cancels the rest; RpcClient.close() closes the pool.

Implementation: rpc_codec (message encoding), rpc_frames (framing, deadlines), rpc_server / rpc_server_conn /
rpc_calls, rpc_client / rpc_client_conn, rpc_errors.
"""

from mooncaked.rpc_client import RpcClient
from mooncaked.rpc_errors import (ERRORS_BY_CODE, Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                                  ResourceExhausted, RpcError, Unauthenticated, Unavailable)
from mooncaked.rpc_frames import DEFAULT_MAX_FRAME_BYTES
from mooncaked.rpc_server import RpcServer
from mooncaked.rpc_server_conn import CallContext

__all__ = [
    "CallContext", "Cancelled", "DEFAULT_MAX_FRAME_BYTES", "DeadlineExceeded", "ERRORS_BY_CODE", "Internal",
    "InvalidArgument", "NotFound", "ResourceExhausted", "RpcClient", "RpcError", "RpcServer", "Unauthenticated",
    "Unavailable",
]
