"""trio_pd under an engine loop that is not trio (docs/embedding.md).

An engine's step loop is plain synchronous Python (vLLM's is). Each engine
runs trio_pd in a trio thread of its own, and the loop talks to it only
through ``trio.from_thread.run_sync``, with calls shaped like vLLM's
connector API: ``request_finished`` (prefill: expose, answer the params),
``start_load_kv`` (decode: start pulls), ``get_finished`` (both: which
requests are done). Every piece of the bridge's state is touched on the
trio thread only, so it needs no lock. The KV caches have vLLM's shape:
one ``(2, blocks, block_size, kv_heads, head_size)`` tensor per layer.

Run it with ``python docs/examples/engine_bridge.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import threading
import time
from typing import Any

import torch
import trio

import trio_pd

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 2, 16, 16, 2, 8


def vllm_kv_caches() -> list[torch.Tensor]:
    """One tensor per layer, as vLLM's FlashAttention backend allocates them."""
    shape = (2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)  # 2: K and V
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)]


def regions(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """trio_pd's regions: K and V of each layer, dimension 0 the blocks.
    ``layer[0]`` is a view (no copy) and contiguous: registering it registers
    the engine's own memory."""
    return [layer[kv] for layer in kv_caches for kv in (0, 1)]


class TrioBridge:
    """A connector in a trio thread of its own, driven from a synchronous loop."""

    def __init__(self, engine_id: str, kv_caches: list[torch.Tensor]) -> None:
        self._engine_id, self._regions = engine_id, regions(kv_caches)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name=engine_id)
        self._sending: set[str] = set()  # (the trio thread's: released exposures)
        self._receiving: dict[str, str] = {}  # (the trio thread's: request -> outcome)

    # ---- called from the engine's loop ----------------------------------

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def request_finished(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        """Prefill: keep ``block_ids`` for a decoder; the params for the proxy."""
        return self._call(self._expose, request_id, block_ids)

    def start_load_kv(self, request_id: str, block_ids: list[int], params: dict[str, Any]) -> None:
        """Decode: start pulling ``params``' blocks into ``block_ids``; returns at once."""
        self._call(self._nursery.start_soon, self._pull, request_id, block_ids, params)

    def get_finished(self) -> tuple[set[str], dict[str, str]]:
        """Prefill requests whose blocks may be reused, and decode requests
        whose pull ended (with how), since the last call."""
        return self._call(self._take_finished)

    def close(self) -> None:
        self._call(self._nursery.cancel_scope.cancel)
        self._thread.join()

    def _call(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    # ---- the trio thread -------------------------------------------------

    async def _main(self) -> None:
        async with (
            trio_pd.open_connector(self._engine_id, self._regions) as self._conn,
            trio.open_nursery() as self._nursery,
        ):
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()  # until close() cancels the nursery

    def _expose(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        remote = self._conn.expose(request_id, block_ids)
        self._nursery.start_soon(self._wait_released, request_id)
        return remote.to_kv_transfer_params()

    async def _wait_released(self, request_id: str) -> None:
        await self._conn.wait_released(request_id)  # READ, ABANDONED or EXPIRED
        self._sending.add(request_id)

    async def _pull(self, request_id: str, block_ids: list[int], params: dict[str, Any]) -> None:
        remote = trio_pd.RemoteBlocks.from_kv_transfer_params(params)
        try:
            async with self._conn.hold(remote):
                await self._conn.pull(request_id, block_ids, remote)
            outcome = "loaded"
        except trio_pd.TransferError as exc:
            await self._conn.wait_settled(block_ids)  # nothing writes them any more
            outcome = f"failed: {exc.reason}"
        except trio_pd.HandshakeError as exc:  # nothing was read
            outcome = f"failed: {exc.reason}"
        except ValueError as exc:  # params no producer issued: nothing was read
            outcome = f"rejected: {exc}"
        self._receiving[request_id] = outcome

    def _take_finished(self) -> tuple[set[str], dict[str, str]]:
        sending, self._sending = self._sending, set()
        receiving, self._receiving = self._receiving, {}
        return sending, receiving


def main() -> None:
    prefill_kv, decode_kv = vllm_kv_caches(), vllm_kv_caches()
    for layer, tensor in enumerate(prefill_kv):  # "the forward pass" of two requests
        tensor[:, 3:5] = layer + 1
    prefill, decode = TrioBridge("prefill-0", prefill_kv), TrioBridge("decode-0", decode_kv)
    prefill.start()
    decode.start()
    try:
        params = prefill.request_finished("req-a", [3, 4])
        decode.start_load_kv("req-a", [0, 1], params)
        loaded: dict[str, str] = {}
        released: set[str] = set()
        steps = 0
        while "req-a" not in loaded or "req-a" not in released:
            time.sleep(0.01)  # one engine step (a forward pass of the batch)
            steps += 1
            released |= prefill.get_finished()[0]
            loaded |= decode.get_finished()[1]
        print(f"decode: req-a {loaded['req-a']}; prefill: req-a released")
        pairs = zip(decode_kv, prefill_kv, strict=True)
        same = all(torch.equal(d[:, 0:2], p[:, 3:5]) for d, p in pairs)
        print(f"K and V of every layer arrived: {same}")
        print(f"the engine loop kept stepping meanwhile: {steps > 1}")
    finally:
        decode.close()
        prefill.close()


if __name__ == "__main__":
    main()
