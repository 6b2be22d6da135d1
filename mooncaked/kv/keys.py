"""Block keys: the one definition of prefix-block identity (docs/design.md section 5).

1. A model namespace folds the model id, dtype and block size into 16 bytes, so two models never share a key.
2. Requests that may share KV only with each other (one tenant's, or one `cache_salt`'s, as vLLM defines it)
   get an isolated namespace: the model's with their isolation tag folded in (`isolation_tag`,
   `isolated_namespace`); the empty tag keeps the model's namespace, shared by everyone.
3. Block key i = blake2b-128(key i-1 || namespace || the block's token ids as little-endian uint32).
4. Only full blocks get keys; a prompt of n tokens has n // block_size keys.

Every role and the simulator call these functions; a second definition would silently break cache-aware routing.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence

KEY_BYTES = 16
_ROOT_KEY = bytes(KEY_BYTES)


def model_namespace(model_id: str, dtype: str, block_size: int, kv_geometry: str) -> bytes:
    """16-byte namespace for one (model, dtype, block size, KV geometry) combination: objects of different layouts
    (an MLA latent, GQA K/V of other head counts) never share a key, even under one model id."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    text = f"mooncaked/v1|{model_id}|{dtype}|{block_size}|{kv_geometry}".encode()
    return hashlib.blake2b(text, digest_size=KEY_BYTES).digest()


def isolation_tag(*, tenant: str | None = None, cache_salt: str | None = None) -> bytes:
    """16 bytes naming who may share KV (b"": everyone). Different tenants or salts never share a tag."""
    if tenant is None and cache_salt is None:
        return b""
    text = json.dumps([tenant, cache_salt], ensure_ascii=True)  # unambiguous, whatever the strings hold
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES, person=b"mooncaked-isolat").digest()


def isolated_namespace(namespace: bytes, tag: bytes) -> bytes:
    """The namespace of requests with isolation `tag` (the model's own namespace for b"")."""
    if not tag:
        return namespace
    return hashlib.blake2b(namespace + tag, digest_size=KEY_BYTES).digest()


def block_keys(token_ids: Sequence[int], block_size: int, namespace: bytes) -> list[bytes]:
    """Chained keys of every full block of `token_ids`; key i identifies blocks 0..i together."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = array("I", token_ids)  # uint32: vocabularies fit; raises OverflowError on negative ids
    if tokens.itemsize != 4:
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "big":
        tokens.byteswap()
    num_blocks = len(tokens) // block_size
    keys: list[bytes] = []
    parent = _ROOT_KEY
    for i in range(num_blocks):
        block = tokens[i * block_size : (i + 1) * block_size]
        hasher = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        hasher.update(namespace)
        hasher.update(block.tobytes())
        parent = hasher.digest()
        keys.append(parent)
    return keys
