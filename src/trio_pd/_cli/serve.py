"""``trio-pd serve``: prefill and decode engine processes behind a P/D proxy.

The command's nursery owns everything: one task per engine process (each an
HTTP server with its own connector, see ``trio_pd._serve.process``) and the
proxy's HTTP server in this process. SIGINT or SIGTERM drains it in order:
the proxy stops accepting and finishes its in-flight requests (at most
``--grace`` s), then every engine gets SIGTERM and drains the same way
(closing its connector last); an engine that outlives the grace period is
killed.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import httpx2
import trio
from rich.console import Console
from rich.table import Table

from .._serve.engine import EXPOSURE_SECRET_ENV, EngineSettings
from .._serve.model import ModelConfig
from .._serve.openai import MAX_MODEL_LEN
from .._serve.process import write_json_atomically
from .._serve.proxy import Proxy


class ServeError(Exception):
    """The deployment could not start (an engine failed before it was ready)."""


@attrs.frozen
class ServeOptions:
    """What ``trio-pd serve`` runs (its command-line options)."""

    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    ready_file: str = ""
    grace: float = 10.0
    num_blocks: int = 1024
    start_timeout: float = 120.0

    def max_model_len(self) -> int:
        """What every engine can hold: the model's context, or the pool if smaller."""
        return min(MAX_MODEL_LEN, self.num_blocks * ModelConfig().block_size)

    def check(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode need at least one engine each")
        if self.grace <= 0:
            raise ValueError("--grace must be > 0")
        heads = ModelConfig().kv_heads
        for flag, tp in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            if tp < 1 or heads % tp:
                raise ValueError(f"{flag} {tp} must divide the model's {heads} KV heads")


async def run_serve(options: ServeOptions, console: Console) -> None:
    """Run the deployment until SIGINT or SIGTERM, then drain it.

    Raises:
        ServeError: an engine exited before it was ready.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    secret = secrets.token_bytes(32)  # this deployment's exposure secret
    roles = [("prefill", i) for i in range(options.prefill)]
    roles += [("decode", i) for i in range(options.decode)]
    with (
        tempfile.TemporaryDirectory(prefix="trio-pd-serve-") as scratch,
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
    ):
        async with trio.open_nursery() as nursery:
            engines = trio.CancelScope()
            draining = trio.Event()
            watcher = trio.CancelScope()

            async def watch_signals() -> None:
                # Every signal is consumed here (none is left to re-raise at exit).
                with watcher:
                    async for signum in signals:
                        name = signal.Signals(signum).name
                        if draining.is_set():
                            console.print(f"{name}: already draining (within --grace)")
                        else:
                            console.print(f"{name}: draining the proxy")
                            draining.set()

            nursery.start_soon(watch_signals)

            async def run_engines() -> None:
                with engines:
                    async with trio.open_nursery() as engine_nursery:
                        for role, index in roles:
                            settings = EngineSettings(
                                engine_id=f"{role}-{index}",
                                http_port=0,
                                host=options.host,
                                num_blocks=options.num_blocks,
                                ready_file=str(Path(scratch) / f"{role}-{index}.json"),
                                tp_size=options.prefill_tp
                                if role == "prefill"
                                else options.decode_tp,
                            )
                            engine_nursery.start_soon(
                                _engine_process, settings, options.grace, console, secret
                            )
                draining.set()  # (no engine is left: nothing to serve)
                watcher.cancel()

            nursery.start_soon(run_engines)
            with (
                console.status(f"starting {len(roles)} engines"),
                trio.fail_after(options.start_timeout),
            ):
                urls = await _wait_until_ready(scratch, roles)
            prefill = [urls[f"prefill-{i}"] for i in range(options.prefill)]
            decode = [urls[f"decode-{i}"] for i in range(options.decode)]
            stop = trio.Event()
            async with (
                httpx2.AsyncClient(timeout=httpx2.Timeout(60.0, connect=5.0)) as client,
                trio.open_nursery() as proxy_nursery,
            ):
                proxy = Proxy(prefill, decode, client, max_model_len=options.max_model_len())
                config = Config()
                config.bind = [f"{options.host}:{options.port}"]
                config.graceful_timeout = options.grace
                config.accesslog = None
                app: Any = proxy.app()
                binds = await proxy_nursery.start(
                    functools.partial(serve, app, config, shutdown_trigger=stop.wait)
                )
                ready = {"proxy": binds[0], "prefill": prefill, "decode": decode}
                if options.ready_file:
                    write_json_atomically(options.ready_file, ready)
                console.print(_endpoints_table(ready))
                console.print("[bold green]serving[/]: Ctrl-C or SIGTERM drains and stops")
                await draining.wait()
                proxy.accepting = False
                stop.set()
                # Leaving the block waits for serve() to return: the proxy drained.
            console.print("draining the engines")
            engines.cancel()  # each engine process gets SIGTERM (see _engine_process)
    console.print("[bold]stopped[/]")


async def _engine_process(
    settings: EngineSettings, grace: float, console: Console, secret: bytes
) -> None:
    """Run one engine process until cancelled, then SIGTERM it (SIGKILL after ``grace``).

    Raises:
        ServeError: it exited before it was ready (which stops the deployment).
    """

    async def terminate(process: trio.Process) -> None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace + 5):
            await process.wait()
            return
        console.print(f"[red]engine {settings.engine_id} did not stop in time: killed[/]")
        process.kill()

    command = [
        sys.executable,
        "-m",
        "trio_pd._serve.process",
        json.dumps(attrs.asdict(settings)),
    ]
    env = {
        **os.environ,
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        EXPOSURE_SECRET_ENV: secret.hex(),  # (the engines of this deployment share it)
    }
    result = await trio.run_process(
        command, check=False, deliver_cancel=terminate, env=env, stdin=subprocess.DEVNULL
    )
    if not await trio.Path(settings.ready_file).exists():
        raise ServeError(
            f"engine {settings.engine_id} exited with status {result.returncode} before it "
            "accepted requests (its output is above)"
        )
    console.print(f"[yellow]engine {settings.engine_id} exited with status {result.returncode}[/]")


async def _wait_until_ready(scratch: str, roles: list[tuple[str, int]]) -> dict[str, str]:
    """Each engine's URL, from the ready file it writes once it accepts requests
    (bound it with a cancel scope)."""
    urls: dict[str, str] = {}
    while len(urls) < len(roles):
        for role, index in roles:
            name = f"{role}-{index}"
            path = Path(scratch) / f"{name}.json"
            if name not in urls and path.exists():
                urls[name] = json.loads(path.read_text())["url"]
        await trio.sleep(0.05)
    return urls


def _endpoints_table(ready: dict[str, Any]) -> Table:
    table = Table(title="trio-pd serve")
    table.add_column("role")
    table.add_column("URL")
    table.add_row("proxy", ready["proxy"])
    for role in ("prefill", "decode"):
        for url in ready[role]:
            table.add_row(role, url)
    return table
