"""Each row of ``ERROR_STATUSES`` is what the servers answer, and no site
picks a status of its own.

Three layers:

* every row, through the engine's or the proxy's ASGI application in this
  process: the exception is raised where the server meets it -- the
  engine's ``generation`` (the seam behind which the connector and the pool
  run), the proxy's HTTP client (an ``httpx2.MockTransport``, the client the
  proxy is handed) -- and the answer must be the row's status, ``type``,
  ``param``, extra keys, ``Retry-After`` and metric;
* most rows for real: engines with real connectors (a prefill whose pool is
  full, a pull from an engine that is not the one claimed, block ids out of
  the producer's range), the proxy in front of a closed port, a slow engine
  and one that hangs up;
* the sources: in ``app.py``, ``engine.py``, ``asgi.py`` and ``proxy.py`` no
  ``except`` builds an ``HTTPError`` itself, and every class such a handler
  answers has a row.

The rendered table (``docs/serving.md``) is checked by the ``-W`` docs build.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import re
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

from trio_pd import (
    ExposureEndedError,
    HandshakeError,
    IncompatibleEngineError,
    ParamsRejectedError,
    TransferError,
)
from trio_pd._cli import _parser
from trio_pd._serve import app as app_module
from trio_pd._serve import asgi as asgi_module
from trio_pd._serve import engine as engine_module
from trio_pd._serve import prefilling as prefilling_module
from trio_pd._serve import proxy as proxy_module
from trio_pd._serve.app import build_app
from trio_pd._serve.engine import Engine, EngineSettings
from trio_pd._serve.errors import (
    ERROR_STATUSES,
    BodyNotJSON,
    DeploymentFault,
    ErrorStatus,
    ExposureEnded,
    HTTPError,
    MalformedAnswer,
    ParamsInUse,
    StreamStalled,
    error_status,
    http_error,
)
from trio_pd._serve.model import ModelConfig, TinyLlama
from trio_pd._serve.pool import OutOfBlocks
from trio_pd._serve.proxy import Proxy, ProxyTimeouts

from .http_clients import http_client
from .test_openai import call, lifespan
from .test_proxy import BODY, closed_port_url, engines, proxy_for

App = Callable[..., Awaitable[None]]
KV = {"remote_engine_id": "p", "remote_block_ids": [1], "do_remote_prefill": True}
ENDED = {"error": {"message": "engine d: ended", "type": "x", "code": "exposure_ended"}}

# One exception of each row's class, as the server meets it. (None: raised by
# the server itself -- a body that is not JSON, a deadline, a stall.)
SAMPLES: dict[type[BaseException], BaseException | None] = {
    BodyNotJSON: None,
    ParamsRejectedError: ParamsRejectedError("r", "remote_token", "not issued here"),
    ParamsInUse: ParamsInUse("request 'r' is already held"),
    HandshakeError: HandshakeError("p", "no answer"),
    IncompatibleEngineError: IncompatibleEngineError("p", "protocol version 9"),
    TransferError: TransferError("r", [1], "the backend failed"),
    ExposureEndedError: ExposureEndedError(
        "r", [1], "the producer answered that it expired", outcome="expired"
    ),
    ExposureEnded: None,  # (the proxy's, after a decode engine's second exposure_ended)
    OutOfBlocks: OutOfBlocks("2 KV blocks needed, none freed in 0.2 s"),
    MalformedAnswer: MalformedAnswer("no kv_transfer_params object"),
    DeploymentFault: DeploymentFault("not issued here (kv_transfer_params.remote_token)"),
    httpx2.ConnectError: httpx2.ConnectError("connection refused"),
    httpx2.ConnectTimeout: httpx2.ConnectTimeout("no connection in 5 s"),
    trio.TooSlowError: None,
    httpx2.TimeoutException: httpx2.WriteTimeout("the write timed out"),
    StreamStalled: None,
    httpx2.HTTPError: httpx2.RemoteProtocolError("the engine hung up"),
    Exception: RuntimeError("a bug"),
}


def check_answer(
    row: ErrorStatus,
    answer: tuple[int, dict[bytes, bytes], Any],
    **values: Any,
) -> dict[str, Any]:
    """``answer`` (status, headers, body) is ``row``'s, filled with ``values``."""
    status, headers, body = answer
    error: dict[str, Any] = body["error"]
    assert status == row.status, body
    assert error["type"] == row.type.format(**values)
    assert error["param"] == (row.param.format(**values) if row.param else None)
    assert error["code"] == row.code
    assert headers.get(b"retry-after") == (
        str(row.retry_after).encode() if row.retry_after is not None else None
    )
    assert set(row.extra) <= set(error), error
    return error


# ---- every row, raised where the server meets it --------------------------------


def test_every_row_has_a_sample_that_lands_on_it() -> None:
    assert set(SAMPLES) == set(ERROR_STATUSES)
    for cls, sample in SAMPLES.items():
        if sample is not None:
            assert error_status(sample) is ERROR_STATUSES[cls], cls


def an_engine(engine_id: str = "e0", **settings: Any) -> Engine:
    return Engine(
        EngineSettings(engine_id, http_port=0, **{"num_blocks": 8, **settings}),
        TinyLlama(ModelConfig()),
    )


def raising(exc: BaseException) -> Callable[..., Any]:
    """An ``Engine.generation`` that fails with ``exc`` (as a pull or the pool would)."""

    @asynccontextmanager
    async def generation(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        await trio.lowlevel.checkpoint()
        raise exc
        yield  # pragma: no cover

    return generation


async def engine_answer(cls: type[BaseException]) -> None:
    engine = an_engine()
    app = build_app(engine)
    row = ERROR_STATUSES[cls]
    if cls is BodyNotJSON:
        answer = await call(app, "POST", "/v1/completions", b"\xff")
        check_answer(row, answer)
        return
    sample = SAMPLES[cls]
    assert sample is not None
    engine.accepting = True  # (no connector: the seam stands in for everything behind it)
    engine.generation = raising(sample)  # type: ignore[method-assign]
    answer = await call(app, "POST", "/v1/completions", _json(BODY), ((b"x-request-id", b"r1"),))
    error = check_answer(row, answer, exc=sample, cls=type(sample).__name__)
    values = {"engine": "e0", "remote_engine": None, "remote_request": None, "request_id": "r1"}
    assert error["message"] == row.message.format(exc=sample, **values)


def mock_proxy(
    handler: Callable[[httpx2.Request], Any], **timeouts: float
) -> tuple[Proxy, httpx2.AsyncClient]:
    """A proxy whose client's requests ``handler`` answers (one engine per role)."""
    client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    proxy = Proxy(["http://prefill"], ["http://decode"], client, timeouts=ProxyTimeouts(**timeouts))
    return proxy, client


async def proxy_answer(cls: type[BaseException]) -> None:
    sample = SAMPLES[cls]
    role = "decode" if cls in (StreamStalled, ExposureEnded, DeploymentFault) else "prefill"
    timeouts: dict[str, float] = {}

    async def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.host == "prefill" and role == "decode":
            return httpx2.Response(200, json={"kv_transfer_params": KV})
        if cls is ExposureEnded:  # (every time: the proxy prefills again once, no more)
            return httpx2.Response(409, json=ENDED)
        if cls is MalformedAnswer:  # (a 200 without kv_transfer_params)
            return httpx2.Response(200, json={"choices": []})
        if cls is DeploymentFault:  # (the decode engine refuses what the prefill issued)
            refused = {"message": "not issued here", "param": "kv_transfer_params.remote_token"}
            return httpx2.Response(400, json={"error": {**refused, "type": "x"}})
        if cls is trio.TooSlowError:
            await trio.sleep_forever()
        if cls is StreamStalled:

            async def stalls() -> AsyncIterator[bytes]:
                await trio.sleep_forever()
                yield b""  # pragma: no cover

            return httpx2.Response(500, content=stalls())
        assert sample is not None
        raise sample

    if cls is trio.TooSlowError:
        timeouts["prefill"] = 0.01
    if cls is StreamStalled:
        timeouts["idle"] = 0.01
    proxy, client = mock_proxy(handler, **timeouts)
    async with client:
        answer = await call(proxy.app(), "POST", "/v1/completions", _json(BODY))
    row = ERROR_STATUSES[cls]
    name = type(sample).__name__ if sample is not None else cls.__name__
    error = check_answer(row, answer, role=role, cls=name)
    if "engine" in row.extra:
        assert error["engine"] == f"http://{role}"
    if cls is DeploymentFault:
        assert error["prefill_engine"] == "http://prefill"
    if cls is Exception:  # (the catch-all: it names the request, and says no more)
        assert answer[1][b"x-request-id"].decode() in error["message"]
    if row.counted is not None:
        labels = {"role": role, "engine": f"http://{role}", "kind": row.counted}
        counted = proxy.metrics.registry.get_sample_value(
            "trio_pd_proxy_engine_errors_total", labels
        )
        assert counted == 1, labels


@pytest.mark.parametrize("cls", list(ERROR_STATUSES), ids=lambda cls: cls.__name__)
async def test_each_row_is_what_its_servers_answer(cls: type[BaseException]) -> None:
    row = ERROR_STATUSES[cls]
    with trio.fail_after(30):
        if "engine" in row.where:
            await engine_answer(cls)
        if "proxy" in row.where:
            if cls is BodyNotJSON:
                proxy, client = mock_proxy(lambda request: httpx2.Response(500))
                async with client:
                    answer = await call(proxy.app(), "POST", "/v1/completions", b"{no")
                check_answer(row, answer)
            else:
                await proxy_answer(cls)


def test_an_escaping_exception_is_the_catch_all_row_whatever_its_class() -> None:
    # (a ParamsRejectedError that escaped would need fields its own row names)
    escaped = ParamsRejectedError("r", "remote_token", "escaped")
    error = http_error(escaped, row_of=Exception, request_id="r")
    assert (error.status, error.body["error"]["type"]) == (500, "server_error")
    with pytest.raises(LookupError):
        error_status(KeyboardInterrupt())  # (a BaseException: never answered)


# ---- rows for real -----------------------------------------------------------------


async def test_real_connectors_answer_their_rows() -> None:
    """A prefill whose pool is full (503), a pull from an engine that is not the
    one claimed (502 ``IncompatibleEngineError``), block ids out of the
    producer's range (400: checked once the handshake is done)."""
    prefill = an_engine("p0", num_blocks=2, admission_timeout=0.2)
    decode = an_engine("d0")
    p_app, d_app = build_app(prefill), build_app(decode)
    prompt = "y" * 31  # (30 tokens of KV, and one more: both of the prefill's blocks)
    expose = {"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}}
    with trio.fail_after(60):
        async with lifespan(p_app), lifespan(d_app):
            status, _, body = await call(p_app, "POST", "/v1/completions", _json(expose))
            assert status == 200, body
            params = body["kv_transfer_params"]
            full = await call(p_app, "POST", "/v1/completions", _json(expose))
            check_answer(ERROR_STATUSES[OutOfBlocks], full)

            async def decode_with(**changed: Any) -> tuple[int, dict[bytes, bytes], Any]:
                request = {"prompt": prompt, "kv_transfer_params": {**params, **changed}}
                return await call(d_app, "POST", "/v1/completions", _json(request))

            impostor = await decode_with(remote_engine_id="not-" + params["remote_engine_id"])
            error = check_answer(
                ERROR_STATUSES[IncompatibleEngineError], impostor, cls="IncompatibleEngineError"
            )
            assert error["remote_engine"] == "not-" + params["remote_engine_id"]
            out_of_range = await decode_with(remote_block_ids=[7, 8])
            error = check_answer(
                ERROR_STATUSES[ParamsRejectedError],
                out_of_range,
                exc=ParamsRejectedError("r", "remote_block_ids", ""),
            )


def _json(body: object) -> bytes:
    return json.dumps(body).encode()


async def test_a_real_proxy_answers_its_rows() -> None:
    """Every engine refusing (502), a slow prefill (504), one that hangs up (502)."""

    async def hangs_up(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            serving = functools.partial(trio.serve_tcp, hangs_up, 0, host="127.0.0.1")
            [listener] = await nursery.start(serving)
            rude = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            refusing = closed_port_url()
            async with (
                engines(2) as ([slow, _], urls),
                http_client(10) as client,
            ):
                slow.delay = 1.0
                cases = [
                    ([refusing], httpx2.ConnectError, ProxyTimeouts()),
                    (urls[:1], trio.TooSlowError, ProxyTimeouts(prefill=0.2)),
                    ([rude], httpx2.HTTPError, ProxyTimeouts()),
                ]
                for prefill, cls, timeouts in cases:
                    async with proxy_for(prefill, urls[1:], timeouts) as (proxy, url):
                        response = await client.post(f"{url}/v1/completions", json=BODY)
                        row = ERROR_STATUSES[cls]
                        headers = {k.encode(): v.encode() for k, v in response.headers.items()}
                        answer = (response.status_code, headers, response.json())
                        error = check_answer(row, answer, role="prefill")
                        assert error["engine"] == prefill[0]
                        labels = {"role": "prefill", "engine": prefill[0], "kind": row.counted}
                        assert proxy.metrics.registry.get_sample_value(
                            "trio_pd_proxy_engine_errors_total", labels
                        )
            nursery.cancel_scope.cancel()


# ---- every site uses the table --------------------------------------------------------

SITES = [app_module, engine_module, asgi_module, proxy_module, prefilling_module]


def _handlers(module: types.ModuleType) -> list[tuple[int, list[type], ast.ExceptHandler]]:
    """Each ``except`` of ``module`` with the classes it catches (evaluated there)."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = eval(ast.unparse(node.type), vars(module))  # (names of the module)
            classes = list(caught) if isinstance(caught, tuple) else [caught]
            found.append((node.lineno, classes, node))
    return found


def _answered(handler: ast.ExceptHandler) -> list[ast.expr]:
    """The exceptions that ``handler`` answers from the table: the first
    argument of ``http_error``, the third of ``Proxy._engine_error``, the
    second of ``Prefiller.error``."""
    answered = []
    for node in ast.walk(handler):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name == "http_error":
                answered.append(node.args[0])
            elif name == "_engine_error":
                answered.append(node.args[2])
            elif name == "error" and ast.unparse(node.func) == "self.error":  # (Prefiller's)
                answered.append(node.args[1])
    return answered


def _own_row(cls: type) -> ErrorStatus:
    return next(ERROR_STATUSES[c] for c in cls.__mro__ if c in ERROR_STATUSES)


def site_problems(module: types.ModuleType, answered: set[type]) -> list[str]:
    """What in ``module`` answers an exception without the table (adding the
    classes it answers through the table to ``answered``)."""
    problems = []
    for line, classes, handler in _handlers(module):
        where = f"{module.__name__}:{line}"
        built = [n for n in ast.walk(handler) if isinstance(n, ast.Call)]
        if any(ast.unparse(n.func) == "HTTPError" for n in built):
            problems.append(f"{where}: an HTTPError built in an except: use ERROR_STATUSES")
        for exc in _answered(handler):
            if isinstance(exc, ast.Name) and exc.id == handler.name:
                mine = classes  # (the caught exception itself)
            elif isinstance(exc, ast.Call):  # (a table's class, raised for what was caught)
                mine = [eval(ast.unparse(exc.func), vars(module))]
            else:
                problems.append(f"{where}: answers {ast.unparse(exc)}")
                continue
            for cls in mine:
                answered.add(cls)
                if _own_row(cls) is ERROR_STATUSES[Exception] and cls is not Exception:
                    problems.append(f"{where}: {cls.__name__} has no row of its own")
    return problems


def test_no_site_picks_a_status_of_its_own_and_every_row_is_answered() -> None:
    answered: set[type] = set()
    problems = [p for module in SITES for p in site_problems(module, answered)]
    assert not problems, "\n".join(problems)
    # Every row is answered by a handler: its class or a base of it
    # (IncompatibleEngineError, as a HandshakeError), or raised into one
    # (ParamsInUse: by Engine.generation, into the app's PULL_ERRORS).
    for cls in ERROR_STATUSES:
        assert any(issubclass(cls, c) for c in answered) or cls in app_module.PULL_ERRORS, cls


def test_a_site_that_picks_its_own_status_is_found(tmp_path: Path) -> None:
    (tmp_path / "planted_site.py").write_text(
        "from trio_pd._serve.errors import HTTPError, http_error\n\n"
        "def parse(text: str) -> int:\n"
        "    try:\n"
        "        return int(text)\n"
        "    except ValueError:\n"
        "        raise HTTPError(400, 'not a number', 'invalid_request_error')\n"
        "    except KeyError as exc:\n"
        "        raise http_error(exc)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import planted_site
    finally:
        sys.path.remove(str(tmp_path))
    assert site_problems(planted_site, set()) == [
        "planted_site:6: an HTTPError built in an except: use ERROR_STATUSES",
        "planted_site:8: KeyError has no row of its own",
    ]


def test_the_flags_the_rows_name_are_the_proxys() -> None:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            proxy = action.choices["proxy"]
    flags = {option for action in proxy._actions for option in action.option_strings}
    named = {f for row in ERROR_STATUSES.values() for f in re.findall(r"--[a-z-]+", row.meaning)}
    assert named
    assert named <= flags, named - flags


def test_an_http_error_is_openais_shape() -> None:
    error = HTTPError(503, "m", "overloaded", retry_after=1, engine="e")
    assert error.body == {
        "error": {"message": "m", "type": "overloaded", "param": None, "code": None, "engine": "e"}
    }
    assert error.headers == [(b"retry-after", b"1")]
