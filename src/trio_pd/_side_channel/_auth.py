"""CURVE authentication of the side channel.

Without it, anyone who can reach a producer's side channel receives its KV
cache's memory addresses and NIXL agent metadata, and can then read that
memory over RDMA. With :class:`CurveAuth` configured:

* the producer's listener is a CURVE server: traffic is encrypted, and a ZAP
  handler (a trio task of the connector) admits only consumers whose public
  key is in ``allowed_consumers``; others get no metadata at all;
* the consumer is a CURVE client that knows each producer's public key
  (``producer_keys``, by engine id, ``"*"`` for any) and so cannot be fooled
  by an impostor at the producer's address.

Keys are Z85 text, 40 characters, as :func:`generate_keypair` (or
``trio-pd keygen``) makes them. ZAP is ZeroMQ's authentication protocol
(RFC 27): libzmq sends each handshake's credentials to the socket bound at
``inproc://zeromq.zap.01`` in the same context and waits for a verdict.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import trio
import zmq
import zmq.utils.z85

from trio_pd._side_channel._zmq import TrioZmqSocket

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"trio_pd"
ANY_ENGINE = "*"


def generate_keypair() -> tuple[str, str]:
    """A new CURVE key pair ``(public_key, secret_key)`` as Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def _check_key(what: str, key: str) -> None:
    if not isinstance(key, str) or len(key) != 40:
        raise ValueError(f"{what} must be a 40-character Z85 CURVE key")
    try:
        zmq.utils.z85.decode(key.encode())
    except (ValueError, KeyError, IndexError, UnicodeEncodeError, struct.error):
        raise ValueError(f"{what} is not valid Z85") from None


def _frozen_keys(keys: Iterable[str]) -> frozenset[str]:
    return frozenset(keys)


def _frozen_mapping(keys: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(keys))


@attrs.frozen(kw_only=True)
class CurveAuth:
    """This engine's CURVE key pair and whom it trusts.

    Attributes:
        public_key: this engine's public key (Z85).
        secret_key: this engine's secret key (Z85).
        allowed_consumers: producer side: public keys of the consumers that
            may fetch this engine's metadata. Empty: nobody may.
        producer_keys: consumer side: the public key of each producer, by
            engine id; the key ``"*"`` applies to engines not named.
    """

    public_key: str
    secret_key: str = attrs.field(repr=False)
    allowed_consumers: frozenset[str] = attrs.field(factory=frozenset, converter=_frozen_keys)
    producer_keys: Mapping[str, str] = attrs.field(
        factory=dict, converter=_frozen_mapping, eq=False
    )

    def __attrs_post_init__(self) -> None:
        _check_key("public_key", self.public_key)
        _check_key("secret_key", self.secret_key)
        if zmq.curve_public(self.secret_key.encode()).decode() != self.public_key:
            raise ValueError("public_key does not belong to secret_key")
        for key in self.allowed_consumers:
            _check_key("an allowed consumer key", key)
        for engine_id, key in self.producer_keys.items():
            _check_key(f"the producer key of {engine_id!r}", key)

    def producer_key(self, engine_id: str) -> str | None:
        """The public key to expect from ``engine_id``, or ``None`` if unknown."""
        return self.producer_keys.get(engine_id, self.producer_keys.get(ANY_ENGINE))

    def configure_server(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` (the listener) a CURVE server that asks ZAP."""
        socket.curve_server = True
        socket.curve_publickey = self.public_key.encode()
        socket.curve_secretkey = self.secret_key.encode()
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def zap_verdict(frames: list[bytes], allowed: frozenset[str]) -> tuple[list[bytes], str | None]:
    """Decide one ZAP request (no I/O).

    Returns:
        ``(reply_frames, refusal)``: the ZAP reply, and ``None`` if the client
        was admitted or a one-line reason if not.
    """
    if len(frames) < 6:
        return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""], "malformed ZAP request"
    version, request_id, _domain, address, _identity, mechanism = frames[:6]
    credentials = frames[6:]
    refusal: str | None = None
    user = b""
    if mechanism != b"CURVE":
        refusal = f"mechanism {mechanism.decode(errors='replace')} is not CURVE"
    elif len(credentials) != 1 or len(credentials[0]) != 32:
        refusal = "malformed CURVE credentials"
    else:
        key = zmq.utils.z85.encode(credentials[0]).decode()
        if key in allowed:
            user = key.encode()
        else:
            refusal = f"consumer key {key} from {address.decode(errors='replace')} not allowed"
    status = (b"200", b"OK") if refusal is None else (b"400", b"not allowed")
    return [version, request_id, *status, user, b""], refusal


async def serve_zap(
    context: zmq.Context[zmq.Socket[bytes]],
    allowed: frozenset[str],
    on_refusal: Callable[[str], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ZAP requests for ``context`` until cancelled (socket closed on exit).

    Must be started (``nursery.start``) before the CURVE listener binds, so no
    handshake finds the handler missing.
    """
    socket = TrioZmqSocket(context.socket(zmq.REP))
    async with socket:
        socket.zmq_socket.setsockopt(zmq.LINGER, 0)
        socket.zmq_socket.bind(ZAP_ENDPOINT)
        task_status.started()
        while True:
            frames = await socket.receive_multipart()
            reply, refusal = zap_verdict(frames, allowed)
            if refusal is not None:
                on_refusal(refusal)
            await socket.send_multipart(reply)
