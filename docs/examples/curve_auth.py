"""Authenticate the side channel with ZeroMQ CURVE.

The producer admits only the consumer keys it lists; the consumer checks the
producer's key. A consumer whose key is not listed gets no metadata -- so no
memory addresses -- and a clear ``HandshakeError`` at once.

Run it with ``python docs/examples/curve_auth.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch
import trio

import trio_pd


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 4096), dtype=torch.uint8) for _ in range(2)]


async def main() -> None:
    # `trio-pd keygen` prints the same thing as JSON.
    prefill_pub, prefill_sec = trio_pd.generate_keypair()
    decode_pub, decode_sec = trio_pd.generate_keypair()
    stranger_pub, stranger_sec = trio_pd.generate_keypair()

    producer_auth = trio_pd.CurveAuth(
        public_key=prefill_pub, secret_key=prefill_sec, allowed_consumers={decode_pub}
    )
    decoder_auth = trio_pd.CurveAuth(
        public_key=decode_pub, secret_key=decode_sec, producer_keys={"prefill-0": prefill_pub}
    )
    stranger_auth = trio_pd.CurveAuth(
        public_key=stranger_pub, secret_key=stranger_sec, producer_keys={"*": prefill_pub}
    )

    def config(auth: trio_pd.CurveAuth) -> trio_pd.ConnectorConfig:
        return trio_pd.ConnectorConfig(auth=auth, handshake_timeout=2.0)

    async with (
        trio_pd.open_connector("prefill-0", kv_cache(), config=config(producer_auth)) as prefill,
        trio_pd.open_connector("decode-0", kv_cache(), config=config(decoder_auth)) as decoder,
        trio_pd.open_connector("stranger", kv_cache(), config=config(stranger_auth)) as stranger,
    ):
        remote = prefill.expose("req-1", [3, 4])
        result = await decoder.pull("req-1", [0, 1], remote)
        print(f"allowed consumer: pulled {result.bytes} bytes")

        with trio.fail_after(1):
            try:
                await stranger.pull("req-1", [0, 1], remote)
            except trio_pd.HandshakeError as exc:
                print("stranger:", exc.reason.split(": ", 1)[1])

        stats = prefill.statistics()
        print(f"producer: {stats.listener_requests} served, {stats.listener_auth_failures} refused")


if __name__ == "__main__":
    trio.run(main)
