"""CURVE authentication end to end: real sockets, real connectors."""

from __future__ import annotations

import pytest
import trio
import zmq

import trio_pd
from trio_pd._core import _protocol as protocol
from trio_pd._side_channel._zmq import TrioZmqSocket

from .conftest import kv_cache

PRODUCER = trio_pd.generate_keypair()
FRIEND = trio_pd.generate_keypair()
STRANGER = trio_pd.generate_keypair()


def _producer_config() -> trio_pd.ConnectorConfig:
    auth = trio_pd.CurveAuth(
        public_key=PRODUCER[0], secret_key=PRODUCER[1], allowed_consumers={FRIEND[0]}
    )
    return trio_pd.ConnectorConfig(auth=auth)


def _consumer_config(keys: tuple[str, str], producer_key: str | None) -> trio_pd.ConnectorConfig:
    producer_keys = {} if producer_key is None else {"*": producer_key}
    auth = trio_pd.CurveAuth(public_key=keys[0], secret_key=keys[1], producer_keys=producer_keys)
    return trio_pd.ConnectorConfig(auth=auth, handshake_timeout=2.0)


async def test_an_allowed_consumer_pulls_over_an_authenticated_channel() -> None:
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=8), config=_producer_config()) as producer,
            trio_pd.open_connector(
                "d", kv_cache(blocks=8), config=_consumer_config(FRIEND, PRODUCER[0])
            ) as consumer,
        ):
            await consumer.pull("r", [0, 1], producer.expose("r", [2, 3]))
            assert await producer.wait_released("r") is trio_pd.Released.READ
            stats = producer.statistics()
            assert stats.listener_requests == 1
            assert stats.listener_auth_failures == 0


@pytest.mark.parametrize(
    ("consumer_config", "match"),
    [
        (_consumer_config(STRANGER, PRODUCER[0]), "rejected our CURVE key"),
        (
            trio_pd.ConnectorConfig(handshake_timeout=2.0),
            "security mechanism mismatch|only one side uses CURVE",
        ),
        (_consumer_config(FRIEND, None), "no CURVE public key configured"),
        (_consumer_config(FRIEND, STRANGER[0]), "within 2 s|wrong producer key"),
    ],
    ids=["unknown-consumer", "plain-text-consumer", "no-producer-key", "impostor-producer-key"],
)
async def test_consumers_without_the_right_keys_get_nothing(
    consumer_config: trio_pd.ConnectorConfig, match: str
) -> None:
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=8), config=_producer_config()) as producer,
            trio_pd.open_connector("d", kv_cache(blocks=8), config=consumer_config) as consumer,
        ):
            remote = producer.expose("r", [2])
            with pytest.raises(trio_pd.HandshakeError, match=match) as info:
                await consumer.pull("r", [0], remote)
            assert info.value.engine_id == "p"
            assert producer.statistics().listener_requests == 0
            assert consumer.statistics().handshake_failures_by_cause.keys() <= {
                "refused",
                "timeout",
            }


async def test_a_plain_text_client_receives_no_bytes_at_all() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with trio.fail_after(30):
            async with trio_pd.open_connector(
                "p", kv_cache(blocks=8), config=_producer_config()
            ) as producer:
                socket = TrioZmqSocket(context.socket(zmq.DEALER))
                async with socket:
                    socket.zmq_socket.setsockopt(zmq.LINGER, 0)
                    socket.zmq_socket.connect(f"tcp://127.0.0.1:{producer.address[1]}")
                    # (the send too may wait: the listener drops the plain-text
                    # handshake, and while the DEALER has no connection left to
                    # queue to, ZeroMQ makes a send wait -- seen on a loaded CI)
                    with trio.move_on_after(1.0) as scope:
                        await socket.send_multipart([b"", protocol.encode_request("p", "spy")])
                        await socket.receive_multipart()
                    assert scope.cancelled_caught
                # nor does a raw TCP client see anything but ZeroMQ's greeting
                stream = await trio.open_tcp_stream(*producer.address)
                async with stream:
                    await stream.send_all(
                        b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 16
                    )
                    received = b""
                    with trio.move_on_after(1.0):
                        async for chunk in stream:
                            received += chunk
                    assert b"metadata" not in received
                    assert b"agent" not in received
                assert producer.statistics().listener_requests == 0
    finally:
        context.destroy(linger=0)


def test_curve_auth_rejects_a_mismatched_key_pair() -> None:
    with pytest.raises(ValueError, match="does not belong"):
        trio_pd.CurveAuth(public_key=FRIEND[0], secret_key=STRANGER[1])
