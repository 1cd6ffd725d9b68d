"""CURVE keys: this engine's key pair and whom it trusts (no I/O).

:class:`CurveAuth` is part of the configuration (``ConnectorConfig.auth``),
so it lives below every package that reads the configuration; the ZAP
handler that enforces it is ``trio_pd._side_channel._auth``, and what CURVE
protects is said there. Keys are Z85 text, 40 characters, as
:func:`generate_keypair` (or ``trio-pd keygen``) makes them. Imports pyzmq
for its key functions and socket options only; opens no socket.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Container, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import zmq
import zmq.utils.z85

ZAP_DOMAIN = b"trio_pd"
ANY_ENGINE = "*"


def generate_keypair() -> tuple[str, str]:
    """A new CURVE key pair ``(public_key, secret_key)`` as Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def deployment_keypair(internal_key: str) -> tuple[str, str]:
    """The CURVE key pair ``(public_key, secret_key)`` derived from the deployment's
    internal key: the same on every engine that holds that key (for deployments
    without etcd, where no engine can publish a pair of its own)."""
    secret = hmac.new(internal_key.encode(), b"trio_pd curve v1", hashlib.sha256).digest()
    secret_z85 = zmq.utils.z85.encode(secret)
    return zmq.curve_public(secret_z85).decode(), secret_z85.decode()


class PeerKeys:
    """The deployment's public keys as membership reports them (mutable, no I/O):
    the decode engines' (the consumers a prefill engine lets in) and each
    prefill engine's (what a decode engine expects from it), replaced whole at
    every change of the verified members."""

    def __init__(self) -> None:
        self.consumers: frozenset[str] = frozenset()
        self.producers: Mapping[str, str] = MappingProxyType({})

    def update(self, consumers: Iterable[str], producers: Mapping[str, str]) -> None:
        self.consumers = frozenset(consumers)
        self.producers = MappingProxyType(dict(producers))


class _Allowed(Container[str]):
    def __init__(self, auth: CurveAuth) -> None:
        self._auth = auth

    def __contains__(self, key: object) -> bool:
        peers = self._auth.peers
        return key in self._auth.allowed_consumers or (peers is not None and key in peers.consumers)


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
        peers: the keys that membership reports, as they change (the
            consumers are allowed too; a producer's key there comes first).
    """

    public_key: str
    secret_key: str = attrs.field(repr=False)
    allowed_consumers: frozenset[str] = attrs.field(factory=frozenset, converter=_frozen_keys)
    producer_keys: Mapping[str, str] = attrs.field(
        factory=dict, converter=_frozen_mapping, eq=False
    )
    peers: PeerKeys | None = attrs.field(default=None, eq=False, repr=False)

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
        if self.peers is not None and engine_id in self.peers.producers:
            return self.peers.producers[engine_id]
        return self.producer_keys.get(engine_id, self.producer_keys.get(ANY_ENGINE))

    def allowed(self) -> Container[str]:
        """The consumer keys a prefill engine lets in now (``allowed_consumers``
        and those of ``peers``), for the ZAP handler."""
        return _Allowed(self)

    def configure_server(self, socket: zmq.Socket[Any]) -> None:
        """Make ``socket`` (the listener) a CURVE server that asks ZAP."""
        socket.curve_server = True
        socket.curve_publickey = self.public_key.encode()
        socket.curve_secretkey = self.secret_key.encode()
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
