"""One engine process: hypercorn's trio worker serving the engine's app until a signal.

``python -m trio_pd._serve.process SETTINGS_JSON`` (``trio-pd serve`` starts
one per engine).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import torch
import trio
from prometheus_client import disable_created_metrics

from .app import build_app
from .engine import Engine, EngineSettings
from .model import ModelConfig, TinyLlama


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trio_pd._serve.process SETTINGS_JSON``: run one engine until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="trio_pd._serve.process")
    parser.add_argument("settings", help="EngineSettings as JSON")
    args = parser.parse_args(argv)
    settings = EngineSettings(**json.loads(args.settings))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    trio.run(serve_engine, settings)


async def serve_engine(settings: EngineSettings, grace: float = 10.0) -> None:
    """Serve until SIGTERM or SIGINT, then drain: stop accepting, let requests
    finish (at most ``grace`` s), close the connector."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    disable_created_metrics()  # type: ignore[no-untyped-call]  # (a process of its own)
    engine = Engine(settings, TinyLlama(ModelConfig()))
    config = Config()
    config.bind = [f"{settings.host}:{settings.http_port}"]
    config.graceful_timeout = grace
    config.accesslog = None
    stop = trio.Event()
    app: Any = build_app(engine)  # (hypercorn's ASGI types are stricter than plain dicts)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def until_signal() -> None:
                async for _ in signals:
                    engine.accepting = False
                    stop.set()
                    return

            nursery.start_soon(until_signal)
            binds = await nursery.start(
                functools.partial(serve, app, config, shutdown_trigger=stop.wait)
            )
            if settings.ready_file:
                write_json_atomically(settings.ready_file, {"url": binds[0]})
            await stop.wait()
            # (serve drains and returns; until_signal has returned)


def write_json_atomically(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that a reader never sees half of it."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(data, f)
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
