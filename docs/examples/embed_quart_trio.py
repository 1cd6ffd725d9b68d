"""A decode engine as a quart-trio app (docs/embedding.md).

The connector is opened in ``before_serving`` and closed in
``after_serving`` -- by a task of its own, in the app's nursery, that owns
its ``async with`` from start to end. A request handler pulls with it.
``main`` serves the app with hypercorn on a free port, exposes blocks on a
prefill connector (in this process, as in ``hello.py``), posts their
``kv_transfer_params``, and stops the server.

Run it with ``python docs/examples/embed_quart_trio.py``.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from typing import Any

import httpx2
import torch
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import request
from quart_trio import QuartTrio

import trio_pd


class OwnedConnector:
    """A connector whose ``async with`` runs in a task of its own: ``open``
    starts that task and returns once the connector is open; ``close`` tells
    it to leave the block and waits until it has."""

    def __init__(self, engine_id: str, regions: list[torch.Tensor]) -> None:
        self.engine_id, self.regions = engine_id, regions
        self._leave, self._left = trio.Event(), trio.Event()

    async def open(self, nursery: trio.Nursery) -> trio_pd.Connector:
        conn: trio_pd.Connector = await nursery.start(self._own)
        return conn

    async def close(self) -> None:
        self._leave.set()
        await self._left.wait()

    async def _own(self, *, task_status: trio.TaskStatus[trio_pd.Connector]) -> None:
        try:
            async with trio_pd.open_connector(self.engine_id, self.regions) as conn:
                task_status.started(conn)
                await self._leave.wait()
        finally:
            self._left.set()


def create_app(kv: list[torch.Tensor]) -> QuartTrio:
    app = QuartTrio(__name__)
    owner = OwnedConnector("decode-0", kv)
    free_blocks = list(range(kv[0].shape[0]))

    @app.before_serving
    async def open_kv_connector() -> None:
        app.config["KV_CONNECTOR"] = await owner.open(app.nursery)  # quart-trio's nursery

    @app.after_serving
    async def close_kv_connector() -> None:
        await owner.close()  # (after hypercorn drained the requests)
        app.config["KV_CONNECTOR"] = None

    @app.post("/pull")
    async def pull() -> tuple[dict[str, Any], int]:
        conn: trio_pd.Connector = app.config["KV_CONNECTOR"]
        try:
            remote = trio_pd.RemoteBlocks.from_kv_transfer_params(await request.get_json())
        except ValueError as exc:  # not parameters a producer issued
            return {"error": str(exc)}, 400
        blocks = [free_blocks.pop() for _ in remote.block_ids]
        try:
            async with conn.hold(remote):
                result = await conn.pull(remote.request_id, blocks, remote)
            return {"bytes": result.bytes, "blocks": [kv[0][b].tolist() for b in blocks]}, 200
        except trio_pd.TrioPdError as exc:  # ParamsRejectedError, HandshakeError, ...
            return {"error": f"{type(exc).__name__}: {exc}"}, 502
        finally:  # (a real engine frees them when the request is done)
            app.nursery.start_soon(free_when_settled, conn, blocks)

    async def free_when_settled(conn: trio_pd.Connector, blocks: list[int]) -> None:
        await conn.wait_settled(blocks)  # at once, unless a transfer could not be stopped
        free_blocks.extend(blocks)

    return app


async def main() -> None:
    app = create_app([torch.zeros((8, 4), dtype=torch.float32)])
    config = Config()
    config.bind = ["127.0.0.1:0"]  # a free port
    config.accesslog, config.loglevel = None, "WARNING"
    stop = trio.Event()
    prefill_kv = [torch.arange(32, dtype=torch.float32).reshape(8, 4)]
    async with (
        trio_pd.open_connector("prefill-0", prefill_kv) as prefill,
        trio.open_nursery() as nursery,
    ):
        # start: returns once before_serving ran and the socket listens
        (url,) = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        params = prefill.expose("req-1", [5, 6]).to_kv_transfer_params()
        async with httpx2.AsyncClient() as client:
            response = await client.post(f"{url}/pull", json=params)
        print(f"decode answered {response.status_code}: {response.json()}")
        print("prefill side:", await prefill.wait_released("req-1"))
        stop.set()  # hypercorn drains, then after_serving closes the connector
    print(
        f"the server stopped and the decode connector closed: {app.config['KV_CONNECTOR'] is None}"
    )


if __name__ == "__main__":
    trio.run(main)
