"""A decode engine as a plain ASGI app under hypercorn (docs/embedding.md).

The app's *lifespan* owns the connector, and inside it a nursery for the
tasks that outlive a request; each HTTP request is a task of hypercorn's
that pulls with that connector. ``main`` serves it on a free port, exposes
blocks on a prefill connector (in this process, as in ``hello.py``), posts
their ``kv_transfer_params`` to the app, and stops the server.

Run it with ``python docs/examples/embed_hypercorn.py``.
"""

from __future__ import annotations

import functools
import json
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from typing import Any

import httpx2
import torch
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

import trio_pd

Scope = dict[str, Any]
Receive = Any  # (hypercorn's ASGI callables; plain dicts here)
Send = Any


class DecodeApp:
    """An ASGI app: ``POST /pull`` with a request's ``kv_transfer_params``."""

    def __init__(self, engine_id: str, kv: list[torch.Tensor]) -> None:
        self.engine_id, self.kv = engine_id, kv
        self.free_blocks = list(range(kv[0].shape[0]))
        self.conn: trio_pd.Connector | None = None  # (set while the server runs)
        self.nursery: trio.Nursery | None = None
        self.closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http" and scope["path"] == "/pull":
            await self.pull(receive, send)
        else:
            await respond(send, 404, {"error": "not found"})

    async def lifespan(self, receive: Receive, send: Send) -> None:
        """One task for the server's life: open, serve, close -- in one block."""
        assert (await receive())["type"] == "lifespan.startup"
        async with (
            trio_pd.open_connector(self.engine_id, self.kv) as self.conn,
            trio.open_nursery() as self.nursery,  # tasks that outlive a request
        ):
            await send({"type": "lifespan.startup.complete"})  # now requests come
            await receive()  # lifespan.shutdown: hypercorn drained the requests
            self.nursery.cancel_scope.cancel()
        self.conn, self.nursery, self.closed = None, None, True
        await send({"type": "lifespan.shutdown.complete"})

    async def pull(self, receive: Receive, send: Send) -> None:
        """One request, one task (hypercorn's): pull the blocks its params name."""
        assert self.conn is not None  # (the lifespan opened it)
        assert self.nursery is not None
        try:
            remote = trio_pd.RemoteBlocks.from_kv_transfer_params(
                json.loads(await read_body(receive))
            )
        except ValueError as exc:  # not JSON, or not parameters a producer issued
            return await respond(send, 400, {"error": str(exc)})
        blocks = [self.free_blocks.pop() for _ in remote.block_ids]
        try:
            async with self.conn.hold(remote):
                result = await self.conn.pull(remote.request_id, blocks, remote)
            data = [self.kv[0][block].tolist() for block in blocks]
            await respond(send, 200, {"bytes": result.bytes, "blocks": data})
        except trio_pd.TrioPdError as exc:  # ParamsRejectedError, HandshakeError, ...
            await respond(send, 502, {"error": f"{type(exc).__name__}: {exc}"})
        finally:  # (a real engine frees them when the request is done)
            self.nursery.start_soon(self.free_when_settled, self.conn, blocks)

    async def free_when_settled(self, conn: trio_pd.Connector, blocks: list[int]) -> None:
        await conn.wait_settled(blocks)  # at once, unless a transfer could not be stopped
        self.free_blocks += blocks


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def respond(send: Send, status: int, answer: object) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


async def main() -> None:
    app = DecodeApp("decode-0", [torch.zeros((8, 4), dtype=torch.float32)])
    config = Config()
    config.bind = ["127.0.0.1:0"]  # a free port
    config.accesslog, config.loglevel = None, "WARNING"
    stop = trio.Event()
    prefill_kv = [torch.arange(32, dtype=torch.float32).reshape(8, 4)]
    async with (
        trio_pd.open_connector("prefill-0", prefill_kv) as prefill,
        trio.open_nursery() as nursery,
    ):
        # start: returns once the lifespan started and the socket listens
        (url,) = await nursery.start(
            functools.partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        params = prefill.expose("req-1", [5, 6]).to_kv_transfer_params()
        async with httpx2.AsyncClient() as client:
            response = await client.post(f"{url}/pull", json=params)
        print(f"decode answered {response.status_code}: {response.json()}")
        print("prefill side:", await prefill.wait_released("req-1"))
        stop.set()  # hypercorn drains, then the lifespan closes the connector
    print(f"the server stopped and the decode connector closed: {app.closed}")


if __name__ == "__main__":
    trio.run(main)
