"""The proxy against engines that answer in every malformed way (issue 30).

Whatever comes back from an engine -- a 200 without what the proxy needs, a
body that is not JSON or stops halfway, headers only, an error body whose
keys clash with the proxy's own -- the client gets JSON in OpenAI's error
shape with its ``X-Request-Id``, the request is counted under the outcome
its status says, and nothing escapes to the server as an exception. The
engines are an ``httpx2.MockTransport`` (the proxy's HTTP client is handed
one), so every case runs in this process, without sockets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx2
import pytest
import trio

from trio_pd._serve.proxy import Proxy, ProxyTimeouts

KV = {"remote_engine_id": "p", "remote_block_ids": [1], "do_remote_prefill": True}
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
OK = {"choices": [{"text": "ok"}]}

Answer = Callable[[], httpx2.Response]


def stops_after(*chunks: bytes) -> httpx2.ByteStream | Any:
    """A body that sends ``chunks`` and then breaks (the engine died mid-answer)."""

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            await trio.lowlevel.checkpoint()
            yield chunk
        raise httpx2.ReadError("connection reset by peer")

    return body()


async def call(
    app: Callable[..., Any], method: str, path: str, body: bytes, headers: Any = ()
) -> tuple[int, dict[bytes, bytes], Any]:
    """One request to the ASGI ``app``: its status, headers and body (JSON
    if it parses, else text); the application must not raise."""
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    await app(scope, receive, send)
    assert [m["type"] for m in sent][:1] == ["http.response.start"]
    assert not sent[-1].get("more_body"), "the answer never ended"
    data = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    try:
        answer = json.loads(data)
    except ValueError:
        answer = data
    return sent[0]["status"], dict(sent[0]["headers"]), answer


def streamed(response: httpx2.Response) -> httpx2.Response:
    """``response`` with its body not yet read (as a real transport gives it)."""
    if not isinstance(response.stream, httpx2.ByteStream):
        return response

    async def body() -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        yield response.content

    headers = [(k, v) for k, v in response.headers.items() if k != "content-length"]
    return httpx2.Response(response.status_code, headers=headers, content=body())


def raw(status: int, content: bytes, **headers: str) -> Answer:
    return lambda: httpx2.Response(status, content=content, headers=headers)


def as_json(status: int, body: Any) -> Answer:
    return lambda: httpx2.Response(status, json=body)


# Each: how the prefill engine answers, or how the decode engine does after a
# good prefill; the status the client gets; the outcome it is counted as.
PREFILL_ANSWERS: dict[str, tuple[Answer, int]] = {
    "200 headers only": (raw(200, b""), 502),
    "200 truncated JSON": (raw(200, b'{"kv_transfer_params": {"remote_'), 502),
    "200 not JSON": (raw(200, b"<html>hello</html>"), 502),
    "200 not UTF-8": (raw(200, b"\xff\xfe\x00"), 502),
    "200 nested too deeply": (raw(200, b"[" * 100_000), 502),
    "200 a list": (as_json(200, [KV]), 502),
    "200 without kv_transfer_params": (as_json(200, OK), 502),
    "200 kv_transfer_params null": (as_json(200, {"kv_transfer_params": None}), 502),
    "200 kv_transfer_params a string": (as_json(200, {"kv_transfer_params": "x"}), 502),
    "200 with an error body": (as_json(200, {"error": {"message": "boom"}}), 502),
    "200 stops halfway": (lambda: httpx2.Response(200, content=stops_after(b'{"kv')), 502),
    # (JSON has no NaN: the proxy could not pass such parameters on)
    "200 kv_transfer_params with a NaN": (
        raw(200, b'{"kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [NaN]}}'),
        502,
    ),
    "200 over 1 MiB": (
        raw(
            200,
            b'{"kv_transfer_params": {"do_remote_prefill": true, "x": "%s"}}' % (b"x" * (1 << 20)),
        ),
        502,
    ),
    "500 not UTF-8": (raw(500, b"\xff"), 502),
    "500 truncated JSON": (raw(500, b'{"error": {"mess'), 502),
    "400 error a string": (as_json(400, {"error": "bad"}), 400),
    "400 error a list": (as_json(400, {"error": [1, 2]}), 400),
    "400 error clashing keys": (
        as_json(
            400,
            {"error": {"message": "m", "status": 1, "kind": 2, "retry_after": "x", "type": 5}},
        ),
        400,
    ),
    "418 message an object": (as_json(418, {"error": {"message": {"nested": 1}}}), 418),
    "302 redirect": (lambda: httpx2.Response(302, headers={"location": "/elsewhere"}), 502),
    "503 headers only": (raw(503, b""), 503),
    "204 no content": (raw(204, b""), 502),
}
DECODE_ANSWERS: dict[str, tuple[Answer, int]] = {
    "500 headers only": (raw(500, b""), 502),
    "500 truncated JSON": (raw(500, b'{"error": {"mess'), 502),
    "409 code an object": (as_json(409, {"error": {"message": "m", "code": {"a": 1}}}), 409),
    "409 exposure_ended, message missing": (as_json(409, {"error": {"code": "x"}}), 409),
    "400 naming the prefill's remote_token": (
        as_json(
            400,
            {"error": {"message": "not issued", "param": "kv_transfer_params.remote_token"}},
        ),
        502,
    ),
    "401 internal key": (as_json(401, {"error": {"message": "no"}}), 502),
    "error stops halfway": (
        lambda: httpx2.Response(500, content=stops_after(b'{"error"')),
        502,
    ),
    "200 without a content type": (raw(200, json.dumps(OK).encode()), 200),
    "200 stream that stops": (
        lambda: httpx2.Response(
            200,
            content=stops_after(b'data: {"choices": []}\n\n'),
            headers={"content-type": "text/event-stream"},
        ),
        200,
    ),
    "200 headers only": (raw(200, b"", **{"content-type": "application/json"}), 200),
}


def outcome_of(status: int, body: Any) -> str:
    if status == 200:
        return "engine_error" if isinstance(body, str) and '"error"' in body else "ok"
    if status == 503:
        return "overloaded"
    return "client_error" if status < 500 else "engine_error"


def check_error_shape(body: Any) -> None:
    error = body["error"]
    assert isinstance(error["message"], str), body
    assert error["message"], body
    assert isinstance(error["type"], str), body
    assert {"param", "code"} <= set(error), body


async def one_request(
    prefill: Answer, decode: Answer, caplog: pytest.LogCaptureFixture
) -> tuple[int, dict[bytes, bytes], Any, Proxy]:
    async def handler(request: httpx2.Request) -> httpx2.Response:
        await trio.lowlevel.checkpoint()
        return streamed(prefill() if request.url.host == "prefill" else decode())

    client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    proxy = Proxy(["http://prefill"], ["http://decode"], client, timeouts=ProxyTimeouts(idle=1.0))
    async with client:
        status, headers, body = await call(
            proxy.app(),
            "POST",
            "/v1/completions",
            BODY,
            ((b"x-request-id", b"fuzz-1"),),
        )
    assert headers[b"x-request-id"] == b"fuzz-1"
    return status, headers, body, proxy


def counted(proxy: Proxy) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for metric in proxy.metrics.registry.collect()
        if metric.name == "trio_pd_proxy_requests"
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def good_prefill() -> httpx2.Response:
    return httpx2.Response(200, json={"kv_transfer_params": KV})


def good_decode() -> httpx2.Response:
    return httpx2.Response(200, json=OK)


@pytest.mark.parametrize("case", list(PREFILL_ANSWERS))
async def test_a_prefill_engine_answering_badly_is_a_json_error(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    answer, expected = PREFILL_ANSWERS[case]
    with trio.fail_after(10), caplog.at_level(logging.WARNING):
        status, _, body, proxy = await one_request(answer, good_decode, caplog)
    assert status == expected, body
    check_error_shape(body)
    assert counted(proxy) == {outcome_of(status, body): 1.0}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    if case.startswith("200"):  # (an unusable 200: the engine's fault, counted)
        assert body["error"]["type"] == "prefill_failed"
        assert body["error"]["engine"] == "http://prefill"


@pytest.mark.parametrize("case", list(DECODE_ANSWERS))
async def test_a_decode_engine_answering_badly_is_a_json_error(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    answer, expected = DECODE_ANSWERS[case]
    with trio.fail_after(10), caplog.at_level(logging.WARNING):
        status, headers, body, proxy = await one_request(good_prefill, answer, caplog)
    assert status == expected, body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    if status != 200:
        check_error_shape(body)
    elif case == "200 stream that stops":  # (its last event is the error)
        last = body.strip().rsplit("data: ", 1)[1]
        check_error_shape(json.loads(last))
    assert counted(proxy) == {outcome_of(status, body): 1.0}
    if case == "200 without a content type":
        assert headers[b"content-type"] == b"application/json"


async def test_the_exposure_secret_mismatch_is_a_deployment_fault_naming_both_engines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # (issue 30, fault 4: it used to be a 400 naming a field the client never sent)
    answer, _ = DECODE_ANSWERS["400 naming the prefill's remote_token"]
    with trio.fail_after(10):
        status, _, body, proxy = await one_request(good_prefill, answer, caplog)
    error = body["error"]
    assert (status, error["type"]) == (502, "deployment_error")
    assert (error["engine"], error["prefill_engine"]) == ("http://decode", "http://prefill")
    assert "remote_token" in error["message"]
    labels = {"role": "decode", "engine": "http://decode", "kind": "deployment"}
    assert proxy.metrics.registry.get_sample_value("trio_pd_proxy_engine_errors_total", labels) == 1
    assert counted(proxy) == {"engine_error": 1.0}


async def test_a_bug_is_a_json_500_with_the_request_id_not_a_bare_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> httpx2.Response:
        raise RuntimeError("a bug in the proxy's path")

    with trio.fail_after(10):
        status, _, body, proxy = await one_request(broken, good_decode, caplog)
    assert (status, body["error"]["type"]) == (500, "server_error")
    assert "fuzz-1" in body["error"]["message"]
    assert counted(proxy) == {"server_error": 1.0}
    assert "request fuzz-1: internal error" in caplog.text


@pytest.mark.parametrize("url", ["http://[::1", "ftp://x", "http://", "http://a b", "x"])
async def test_an_engine_url_no_request_can_be_built_to_is_left_out(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # (issue 30, fault 1: "http://[::1" made build_request raise InvalidURL: a bare 500)
    async def handler(request: httpx2.Request) -> httpx2.Response:
        await trio.lowlevel.checkpoint()
        return good_prefill() if request.url.host == "prefill" else good_decode()

    client = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
    proxy = Proxy(["http://prefill"], [url], client)
    assert proxy.engines("decode") == []
    assert f"decode engine {url!r} left out" in caplog.text
    with trio.fail_after(10):
        async with client:
            status, headers, body = await call(proxy.app(), "POST", "/v1/completions", BODY)
    assert status == 503, body
    check_error_shape(body)
    assert b"x-request-id" in headers
    assert counted(proxy) == {"overloaded": 1.0}
