"""Exposure tokens: proof that a producer of this deployment issued a set of blocks (no I/O).

``kv_transfer_params`` travel from a prefill engine to a decode engine
through a proxy and the network: a request can name any engine, any block
ids, any request id. With a secret shared by the engines of one deployment
(``ConnectorConfig.exposure_secret``), the producer signs what it exposes --
engine, address, incarnation, TP size, request id and block ids -- with an
HMAC-SHA256 tag (``remote_token`` in ``kv_transfer_params``), and a consumer
checks the tag before it handshakes or reads anything. Parameters that no
producer issued (other block ids: another user's KV; another request id:
a way to release someone else's exposure; another engine or address) fail
their own request only, before any byte moves.

One HMAC over a few hundred bytes costs a few microseconds (measured in
``benchmarks/``: see the design page), far below a pull.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Final

import msgspec

DOMAIN: Final = b"trio_pd exposure token v2\0"
"""Separates these tags from any other use of the same secret."""

TOKEN_HEX_LENGTH: Final = 32
"""128 bits of the tag, in hex."""

_encoder = msgspec.msgpack.Encoder()


def exposure_token(
    secret: bytes,
    *,
    engine_id: str,
    host: str,
    port: int,
    incarnation: str,
    tp_size: int,
    request_id: str,
    block_ids: Sequence[int],
    exposure: int = 0,
) -> str:
    """The tag a producer attaches to one exposure (hex, :data:`TOKEN_HEX_LENGTH` long).

    ``exposure``: which exposure of ``request_id`` this is (``RemoteBlocks.exposure``).
    """
    message = _encoder.encode(
        [engine_id, host, port, incarnation, tp_size, request_id, list(block_ids), exposure]
    )
    digest = hmac.new(secret, DOMAIN + message, hashlib.sha256).hexdigest()
    return digest[:TOKEN_HEX_LENGTH]


def token_matches(expected: str, given: str) -> bool:
    """Whether ``given`` is ``expected`` (in constant time)."""
    return hmac.compare_digest(expected.encode(), given.encode())
