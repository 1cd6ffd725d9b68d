"""Speak trio_pd's side-channel protocol without trio_pd.

The client below uses only pyzmq and msgspec, as another implementation
would: it asks a trio_pd producer for its handshake metadata, checks the
reply the way the protocol page says, and shows the error replies. It runs in
a worker thread because it uses a plain blocking ZeroMQ socket.

Run it with ``python docs/examples/wire_protocol.py``.
"""

from __future__ import annotations

import hashlib
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import msgspec
import torch
import trio
import zmq

import trio_pd

PROTOCOL_VERSION = 5


def compatibility_hash(compatibility_key: str) -> str:
    return hashlib.sha256(f"trio_pd\0{PROTOCOL_VERSION}\0{compatibility_key}".encode()).hexdigest()


def ask(endpoint: str, request: dict[str, object]) -> dict[str, object]:
    """One request/reply exchange: [empty frame, msgpack map] both ways."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)  # milliseconds
        sock.connect(endpoint)
        sock.send_multipart([b"", msgspec.msgpack.encode(request)])
        empty, payload = sock.recv_multipart()
        assert empty == b""
        reply: dict[str, object] = msgspec.msgpack.decode(payload)
        return reply


def client(endpoint: str, engine_id: str, compatibility_key: str) -> None:
    request = {
        "type": "metadata_request",
        "protocol_version": PROTOCOL_VERSION,
        "engine_id": engine_id,
        "consumer_engine_id": "my-own-decoder",
    }
    reply = ask(endpoint, request)
    # 1. the envelope: type and protocol version
    print("reply:", reply["type"], "version", reply["protocol_version"])
    # 2. the compatibility hash, before the payload is even decoded
    print("hash matches:", reply["compatibility_hash"] == compatibility_hash(compatibility_key))
    # 3. only then the engine metadata, nested as msgpack bytes
    raw = reply["engine_metadata"]
    assert isinstance(raw, bytes)
    metadata = msgspec.msgpack.decode(raw)
    print("engine:", metadata["engine_id"], "| fields:", ", ".join(sorted(metadata)))
    print(
        f"layout: {len(metadata['base_addrs'])} regions x {metadata['num_blocks']} blocks "
        f"of {metadata['block_lens'][0]} bytes, {metadata['mem_type']}, {metadata['dtype']}"
    )

    # Requests the producer cannot serve get an error reply that says why.
    for change in ({"protocol_version": 1}, {"engine_id": "someone-else"}, {"type": "hello"}):
        error = ask(endpoint, {**request, **change})
        print(f"{change} -> {error['type']} {error['code']}: {error['reason']}")


async def main() -> None:
    kv = [torch.zeros((32, 16, 128), dtype=torch.float16) for _ in range(4)]
    config = trio_pd.ConnectorConfig(compatibility_key="my-model@rev-7")
    async with trio_pd.open_connector("prefill-0", kv, config=config) as producer:
        host, port = producer.address
        await trio.to_thread.run_sync(client, f"tcp://{host}:{port}", "prefill-0", "my-model@rev-7")
        print("listener:", producer.statistics().listener_requests, "served,", end=" ")
        print(producer.statistics().listener_rejects, "rejected")
    # What a consumer sends through NIXL once its READ of a request is complete:
    request_id = "req-42"  # the producer's remote_request_id
    readers = 1  # ranks of the consumer's engine that read this producer rank
    encoded = request_id.encode()
    print("notification:", b"trio_pd:5:%d:%d:%s" % (readers, len(encoded), encoded))


if __name__ == "__main__":
    trio.run(main)
