"""The smallest complete use of trio_pd: a prefill and a decode connector.

Run it with ``python docs/examples/hello.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch
import trio

import trio_pd


async def main() -> None:
    # One region each: 8 blocks of 4 float32 values (16 bytes per block).
    prefill_kv = [torch.arange(32, dtype=torch.float32).reshape(8, 4)]
    decode_kv = [torch.zeros((8, 4), dtype=torch.float32)]
    async with (
        trio_pd.open_connector("prefill-0", prefill_kv) as prefill,
        trio_pd.open_connector("decode-0", decode_kv) as decode,
    ):
        # Prefill side: hold blocks 5 and 6 for a decoder; say where they are.
        params = prefill.expose("req-1", [5, 6]).to_kv_transfer_params()
        # Decode side: pull them into local blocks 0 and 1 (handshake on first use).
        remote = trio_pd.RemoteBlocks.from_kv_transfer_params(params)
        result = await decode.pull("req-1", [0, 1], remote)
        print(f"pulled {result.bytes} bytes:", decode_kv[0][:2].tolist())
        print("prefill side:", await prefill.wait_released("req-1"))


if __name__ == "__main__":
    trio.run(main)
