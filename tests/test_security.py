"""Who may call: client keys on the proxy, the internal key on the engines,
CURVE on serve's side channels, and no key in any log."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

import trio_pd
from trio_pd._serve.errors import HTTPError
from trio_pd._serve.keys import BearerKeys
from trio_pd._serve.openai import MODEL_NAME

from .conftest import kv_cache
from .http_clients import http_client
from .test_proxy import BODY, engines, proxy_for
from .test_serve import metrics

CLIENT_KEY = "client-key-0123456789abcdef"
OTHER_KEY = "another-client-key-fedcba98"
INTERNAL_KEY = "internal-key-0123456789abcdef"


def headers_with(authorization: str | None, *more: str) -> list[tuple[bytes, bytes]]:
    values = [] if authorization is None else [authorization, *more]
    return [(b"authorization", v.encode()) for v in values]


@pytest.mark.parametrize(
    ("authorization", "why"),
    [
        (None, "no Authorization header"),
        (f"Basic {CLIENT_KEY}", "not 'Bearer <key>'"),
        ("Bearer ", "not 'Bearer <key>'"),
        ("Bearer wrong-key-0123456789abcdef", "the key is not valid here"),
        (f"Bearer {CLIENT_KEY}x", "the key is not valid here"),
        (f"Bearer {CLIENT_KEY[:-1]}", "the key is not valid here"),
    ],
)
def test_a_request_without_one_of_the_keys_is_a_401_that_shows_no_key(
    authorization: str | None, why: str
) -> None:
    keys = BearerKeys([CLIENT_KEY, OTHER_KEY], audience="client")
    with pytest.raises(HTTPError) as info:
        keys.check(headers_with(authorization))
    error = info.value
    assert error.status == 401
    assert error.body["error"]["code"] == "invalid_api_key"
    assert why in error.body["error"]["message"]
    assert (b"www-authenticate", b"Bearer") in error.headers
    assert CLIENT_KEY[:8] not in json.dumps(error.body)


def test_any_of_the_keys_is_accepted_and_the_keys_stay_hidden() -> None:
    keys = BearerKeys([CLIENT_KEY, OTHER_KEY], audience="client")
    keys.check(headers_with(f"Bearer {CLIENT_KEY}"))
    keys.check(headers_with(f"bearer   {OTHER_KEY}  "))
    with pytest.raises(HTTPError, match="several"):
        keys.check(headers_with(f"Bearer {CLIENT_KEY}", f"Bearer {OTHER_KEY}"))
    assert CLIENT_KEY not in repr(keys)
    assert keys.guards("/v1/completions")
    assert keys.guards("/v1/models")
    assert not keys.guards("/health")
    assert not keys.guards("/metrics")
    for bad in ([], ["short"], ["has a space in the middle!"]):
        with pytest.raises(ValueError, match="key") as info:
            BearerKeys(bad, audience="client")
        assert all(key not in str(info.value) for key in bad)


async def test_the_proxy_asks_clients_for_a_key_and_shows_engines_the_internal_one() -> None:
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], [p_url, d_url]),
            proxy_for(
                [p_url],
                [d_url],
                api_keys=BearerKeys([CLIENT_KEY], audience="client"),
                internal_key=INTERNAL_KEY,
            ) as (_, url),
            http_client(10) as client,
        ):
            for headers in ({}, {"Authorization": f"Bearer {INTERNAL_KEY}"}):
                answer = await client.post(f"{url}/v1/completions", json=BODY, headers=headers)
                assert answer.status_code == 401
                assert answer.json()["error"]["code"] == "invalid_api_key"
            assert (await client.get(f"{url}/v1/models")).status_code == 401
            assert prefill.seen == decode.seen == []  # (refused before any engine)
            # /health and /metrics stay open (probes and scrapers).
            assert (await client.get(f"{url}/health")).status_code == 200
            assert (await client.get(f"{url}/metrics")).status_code == 200
            client_auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
            answer = await client.post(f"{url}/v1/completions", json=BODY, headers=client_auth)
            assert answer.status_code == 200, answer.text
            # The engines see the internal key, never the client's.
            assert prefill.authorizations == decode.authorizations == [f"Bearer {INTERNAL_KEY}"]


async def early_answers(
    url: str, later: bytes | None, request: str = "POST /v1/completions"
) -> tuple[bytes, bytes]:
    """A ``request`` whose body comes 50 ms after its headers (``later``: then,
    instead of the rest of it, only that), then the same request whole on
    the same connection: the first answer, and the second's (or ``b""`` if
    the server closed the connection)."""
    body = json.dumps(BODY).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"{request} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head)
        await trio.sleep(0.05)
        await stream.send_all(body if later is None else later)
        first = await http_answer(stream)
        try:
            await stream.send_all(head + body)
            second = await http_answer(stream)
        except trio.BrokenResourceError:
            second = b""
    return first, second


async def http_answer(stream: trio.SocketStream) -> bytes:
    """One whole answer with a ``content-length`` (``b""`` at the end of the stream)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some()
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(rest) < length:
        chunk = await stream.receive_some()
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


@pytest.mark.parametrize("server", ["engine", "proxy"])
@pytest.mark.parametrize(
    ("request_line", "status"), [("POST /v1/completions", b"401"), ("GET /health", b"200")]
)
async def test_an_answer_before_the_body_came_keeps_the_connection_or_says_it_closes(
    server: str, request_line: str, status: bytes
) -> None:
    """An answer that starts before the request's body was read (a missing
    key; a route that takes no body, here with one): the server reads the
    rest of the body first, so the connection takes the client's next
    request (hypercorn closed it without a word, and a client's next request
    on it was cut: a flaky test found it); a body that does not come whole
    within the drain's bound gets ``connection: close``, which tells the
    client not to send another."""
    from trio_pd._serve import asgi
    from trio_pd._serve.app import build_app

    from .test_decode_first import engine, serving

    guard = BearerKeys([INTERNAL_KEY], audience="internal")
    with trio.fail_after(30):
        async with (
            engines(2) as (_, [p_url, d_url]),
            proxy_for([p_url], [d_url], api_keys=BearerKeys([CLIENT_KEY], audience="client")) as (
                _,
                proxy_url,
            ),
            serving(build_app(engine("e0", keys={"internal_keys": guard}))) as [engine_url],
        ):
            url = proxy_url if server == "proxy" else engine_url
            answered = b"HTTP/1.1 " + status
            first, second = await early_answers(url, None, request_line)
            assert first.startswith(answered), first
            assert b"connection: close" not in first.lower()
            assert second.startswith(answered), second  # (the connection took it)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(asgi, "DRAIN_SECONDS", 0.05)
                first, second = await early_answers(url, b"{", request_line)  # (never whole)
            assert first.startswith(answered), first
            assert b"connection: close" in first.lower()
            assert second == b""


async def test_a_request_body_is_waited_for_only_where_it_can_keep_the_connection() -> None:
    """What :class:`~trio_pd._serve.asgi.RequestBody` reads before an answer:
    the rest of a body, except for a 408, 413 or 429 or a body it must not
    drain (``connection: close`` at once); nothing where the headers
    announce no body, every ``content-length`` and ``transfer-encoding``
    counted."""
    from trio_pd._serve.asgi import RequestBody

    parts = [b"{", b"}"]

    async def receive() -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        body = parts.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(parts)}

    def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
        return {"headers": list(headers)}

    sized = (b"content-length", b"2")
    for status in (408, 413, 429):
        assert await RequestBody(receive, scope(sized)).finish(status) == [
            (b"connection", b"close")
        ]
    assert await RequestBody(receive, scope(sized), drain=False).finish(401) == [
        (b"connection", b"close")
    ]
    assert parts == [b"{", b"}"]  # (nothing was read)
    assert await RequestBody(receive, scope(sized)).finish(401) == []
    assert parts == []  # (read to its end)
    chunked = scope((b"content-length", b"0"), (b"transfer-encoding", b"chunked"))
    assert not RequestBody(receive, chunked).ended
    assert RequestBody(receive, scope((b"content-length", b"0"))).ended
    assert RequestBody(receive, scope()).ended


# ---- a deployment: trio-pd serve with a client key ------------------------------------


@pytest.mark.slow
async def test_a_deployment_serves_only_key_holders_and_its_side_channels_only_its_engines(
    tmp_path: Path,
) -> None:
    import openai

    ready, log = tmp_path / "ready.json", tmp_path / "serve.log"
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_API_KEY": CLIENT_KEY}
    command = [sys.executable, "-m", "trio_pd", "serve", "--port", "0", "--ready-file", str(ready)]
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    try:
        with trio.fail_after(120):
            while not ready.exists():  # (serve writes it)
                assert process.poll() is None, log.read_text()
                await trio.sleep(0.05)
            serving = json.loads(ready.read_text())
            async with http_client(30) as client:
                internal_key = await _checks(client, serving, openai)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(10, shield=True):
                await process.wait()
    # No key, client or internal, in anything the deployment logged.
    text = log.read_text()
    assert "engine decode-0: SIGTERM: draining" in text  # (the engines' lines are in it)
    for key in (CLIENT_KEY, internal_key):
        assert key not in text


async def _checks(client: httpx2.AsyncClient, serving: dict[str, Any], openai: Any) -> str:
    """The deployment's checks; returns its internal key (read from an engine's environment)."""
    proxy, [prefill], [decode] = serving["proxy"], serving["prefill"], serving["decode"]
    body = {"prompt": "only for key holders", "max_tokens": 4}
    # No key, a wrong key: 401 from the proxy, in OpenAI's shape.
    for headers in ({}, {"Authorization": f"Bearer {OTHER_KEY}"}):
        answer = await client.post(f"{proxy}/v1/completions", json=body, headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["type"] == "invalid_request_error"
    # OpenAI's client with the key: completions and chat, streamed and not.
    tokens = await trio.to_thread.run_sync(_openai_calls, openai, proxy, CLIENT_KEY)
    assert tokens["completion"] == tokens["streamed completion"]
    assert tokens["chat"] == tokens["streamed chat"]
    with pytest.raises(openai.AuthenticationError):
        await trio.to_thread.run_sync(_openai_calls, openai, proxy, OTHER_KEY)
    # A client that goes around the proxy is refused by the engines, even
    # with a client key (and the engines' /health stays open).
    # (each on a connection of its own: an engine answers a refused request
    # without reading its body and hypercorn may then close the connection,
    # which the pool could reuse first -- seen once in a clean-clone run as
    # "Server disconnected without sending a response")
    for engine in (prefill, decode):
        for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}):
            headers = {**headers, "Connection": "close"}
            answer = await client.post(f"{engine}/v1/completions", json=body, headers=headers)
            assert answer.status_code == 401
            assert "serves its deployment's proxy only" in answer.json()["error"]["message"]
    health = (await client.get(f"{prefill}/health")).json()
    internal_key = _environment(health["pid"])["TRIO_PD_INTERNAL_KEY"]
    inside = {"Authorization": f"Bearer {internal_key}"}
    answer = await client.post(f"{decode}/v1/completions", json=body, headers=inside)
    assert answer.status_code == 200, answer.text
    # A side-channel peer without the deployment's keys gets nothing, and is counted.
    stranger_keys = trio_pd.generate_keypair()
    stranger = trio_pd.CurveAuth(
        public_key=stranger_keys[0],
        secret_key=stranger_keys[1],
        producer_keys={"*": health["curve_public_key"]},
    )
    params = {
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": health["side_channel_port"],
        "remote_block_ids": [0],
        "remote_request_id": "spy",
    }
    config = trio_pd.ConnectorConfig(auth=stranger, handshake_timeout=2.0)
    async with trio_pd.open_connector("spy", kv_cache(blocks=4), config=config) as spy:
        remote = trio_pd.RemoteBlocks.from_kv_transfer_params(params)
        with pytest.raises(trio_pd.HandshakeError, match="rejected our CURVE key"):
            await spy.pull("spy", [0], remote)
    counted = metrics((await client.get(f"{prefill}/metrics")).text)
    assert counted["trio_pd_listener_auth_failures_total"] >= 1
    return internal_key


def _openai_calls(openai: Any, proxy: str, key: str) -> dict[str, list[str]]:
    """OpenAI's own (synchronous) client, in a thread: the texts it got."""
    prompt, messages = "the openai client", [{"role": "user", "content": "hello"}]
    model = MODEL_NAME
    texts: dict[str, list[str]] = {}
    # (closed on the way out: its kept connection would otherwise be closed
    # by the garbage collector, a ResourceWarning in whichever test it runs)
    with openai.OpenAI(base_url=f"{proxy}/v1", api_key=key, max_retries=0, timeout=30) as client:
        done = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
        texts["completion"] = [done.choices[0].text]
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True
        )
        texts["streamed completion"] = ["".join(c.choices[0].text for c in stream if c.choices)]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=5)
        texts["chat"] = [chat.choices[0].message.content]
        chunks = client.chat.completions.create(
            model=model, messages=messages, max_tokens=5, stream=True
        )
        texts["streamed chat"] = [
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ]
    return texts


def _environment(pid: int) -> dict[str, str]:
    """A process's environment (root, or the same user)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)


async def test_an_engine_that_refuses_the_proxys_key_is_a_502_not_the_clients_401() -> None:
    # (the deployment's keys disagree: the client's key was fine)
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, _], [p_url, d_url]),
            proxy_for([p_url], [d_url], internal_key=INTERNAL_KEY) as (_, url),
            http_client(10) as client,
        ):
            prefill.status = 401
            answer = await client.post(f"{url}/v1/completions", json=BODY)
            assert answer.status_code == 502
            error = answer.json()["error"]
            assert error["type"] == "prefill_failed"
            assert "internal key is not this engine's" in error["message"]
            errors = metrics((await client.get(f"{url}/metrics")).text)
            assert (
                errors[
                    f"trio_pd_proxy_engine_errors_total{{engine={p_url},kind=status,role=prefill}}"
                ]
                == 1
            )


def test_serve_refuses_a_client_key_that_is_the_internal_key() -> None:
    from trio_pd._cli.serve import ServeOptions

    keys = BearerKeys([CLIENT_KEY], audience="client")
    with pytest.raises(ValueError, match="must not be the engines' internal key"):
        ServeOptions(api_keys=keys, internal_key=CLIENT_KEY).check()
    ServeOptions(api_keys=keys, internal_key=INTERNAL_KEY).check()


async def test_a_forged_registration_in_etcd_gets_no_request_and_no_key() -> None:
    """Fault 1 end to end: whoever writes etcd without the internal key announces
    a prefill and a decode engine at its own server; the proxy sends it nothing."""
    from trio_pd._cli.proxy import ProxyOptions, serve_proxy
    from trio_pd._membership import Member
    from trio_pd._membership._etcd_client import EtcdClient
    from trio_pd._serve.discovery import EtcdMembership
    from trio_pd.testing import open_etcd

    received: list[bytes] = []

    async def attacker(stream: trio.SocketStream) -> None:
        async with stream:
            received.append(await stream.receive_some())
            await stream.send_all(b"HTTP/1.1 500 Owned\r\ncontent-length: 0\r\n\r\n")

    with trio.fail_after(30):
        async with open_etcd() as etcd, trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, attacker, 0, host="127.0.0.1")
            )
            url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            async with EtcdClient(etcd.url) as client:
                for role in ("prefill", "decode"):
                    forged = Member(role, f"{role}-0", url, "127.0.0.1:5600", incarnation="x")
                    await client.put(forged.key("/trio_pd/"), forged.to_json())
            stop = trio.Event()
            options = ProxyOptions(port=0, internal_key=INTERNAL_KEY)
            membership = EtcdMembership(etcd.url, internal_key=INTERNAL_KEY)
            proxy_url = await nursery.start(
                functools.partial(serve_proxy, options, None, stop.wait, membership=membership)
            )
            async with http_client(10) as http:
                answer = await http.post(f"{proxy_url}/v1/completions", json=BODY)
            assert answer.status_code >= 500  # (no engine of the deployment)
            stop.set()
            nursery.cancel_scope.cancel()
    assert received == []  # (not even a connection: no prompt, no internal key)


async def test_a_cluster_from_the_internal_key_has_curve_and_a_foreign_connector_reads_nothing(
    tmp_path: Path,
) -> None:
    """Fault 2: engines started the documented way (--etcd, the internal key, no
    CURVE files) make their own pairs and publish them signed; the deployment
    serves, and a foreign connector (no keys) reads no block and is counted."""
    from trio_pd.testing import open_etcd

    from .test_commands import ENV, SECRET, running
    from .test_serve import complete

    env = {**ENV, "TRIO_PD_EXPOSURE_SECRET": SECRET, "TRIO_PD_INTERNAL_KEY": INTERNAL_KEY}
    p, d, x = (tmp_path / f"{name}.json" for name in ("prefill", "decode", "proxy"))
    with trio.fail_after(90):
        async with open_etcd() as etcd:
            engine = ["engine", "--port", "0", "--num-blocks", "16", "--etcd", etcd.url]
            async with (
                running(
                    ([*engine, "--role", "prefill"], p), ([*engine, "--role", "decode"], d), env=env
                ) as [(_, prefill), _],
                running((["proxy", "--port", "0", "--etcd", etcd.url], x), env=env) as [(_, proxy)],
                http_client(30) as client,
            ):
                answer = await complete(client, proxy["url"], prompt="hello", max_tokens=4)
                assert len(answer["choices"][0]["token_ids"]) == 4
                health = (await client.get(f"{prefill['url']}/health")).json()
                assert health["curve_public_key"]
                params = {
                    "remote_engine_id": "prefill-0",
                    "remote_host": "127.0.0.1",
                    "remote_port": health["side_channel_port"],
                    "remote_block_ids": [0],
                    "remote_request_id": "spy",
                }
                foreign = trio_pd.ConnectorConfig(handshake_timeout=1.0)  # (no keys at all)
                async with trio_pd.open_connector("spy", kv_cache(blocks=4), config=foreign) as spy:
                    remote = trio_pd.RemoteBlocks.from_kv_transfer_params(params)
                    with pytest.raises(trio_pd.HandshakeError):
                        await spy.pull("spy", [0], remote)
                counted = metrics((await client.get(f"{prefill['url']}/metrics")).text)
                assert counted["trio_pd_listener_auth_failures_total"] >= 1


def test_serve_no_curve_is_passed_to_its_engines_which_refuse_plain_text_otherwise() -> None:
    from trio_pd._cli.engine_processes import EngineProcess
    from trio_pd._cli.serve import ServeOptions, _engine_command

    engine = EngineProcess("prefill", 0, "/tmp/ready.json")
    plain = _engine_command(ServeOptions(curve=False), engine, None, {})
    assert "--no-curve" in plain
    files = {"prefill-0": ["--curve-key-file=k", "--curve-peers-file=p"]}
    curved = _engine_command(ServeOptions(), engine, None, files)
    assert "--no-curve" not in curved
    assert "--curve-key-file=k" in curved
