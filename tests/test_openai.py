"""The engine's OpenAI surface: request parsing, response shapes, routes, and one
real deployment (chat, whole and disaggregated, as vLLM's P/D proxy sends it).

Every bad input is a 4xx with OpenAI's JSON error naming the field -- the
parsers are fuzzed for it -- and disaggregated chat gives the same tokens as
one engine serving the whole request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from trio_pd._serve import app as app_module
from trio_pd._serve.app import build_app
from trio_pd._serve.engine import Engine, EngineSettings
from trio_pd._serve.errors import HTTPError
from trio_pd._serve.fields import CHAT, CHAT_NEUTRAL, COMPLETIONS, COMPLETIONS_NEUTRAL, KV_TYPES
from trio_pd._serve.model import ModelConfig, TinyLlama
from trio_pd._serve.openai import (
    MAX_TOKENS,
    MODEL_NAME,
    GenerationRequest,
    chat_prompt,
    parse_chat_request,
    parse_completions_request,
    request_id_from_headers,
)
from trio_pd._serve.responses import Shapes, model_list

from .test_serve import INTERNAL_KEY, deployment_client, open_deployment

Parser = Callable[[object], GenerationRequest]
HELLO = [{"role": "user", "content": "Hello"}]
VLLM_PREFILL_PARAMS = {  # what vLLM's P/D proxy sends a prefill engine
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def error_of(parse: Parser, body: object) -> dict[str, Any]:
    """The error body of a request that ``parse`` refuses (with its status)."""
    with pytest.raises(HTTPError) as info:
        parse(body)
    return {"status": info.value.status, **info.value.body["error"]}


# ---- parsing ------------------------------------------------------------------------


def test_a_completions_request_parses_to_its_tokens_and_defaults() -> None:
    request = parse_completions_request({"prompt": "hé", "model": MODEL_NAME})
    assert request == GenerationRequest(list("hé".encode()), 16)
    assert parse_completions_request({"prompt": [104, 105]}).prompt == [104, 105]
    assert parse_completions_request({"prompt": ["hi"]}).prompt == [104, 105]  # (a batch of one)
    assert parse_completions_request(
        {"prompt": "hi", "max_tokens": 3, "stream": True}
    ) == GenerationRequest([104, 105], 3, True)
    for prompt in ["", [], [256], [-1], [True], None, 7, {"a": 1}]:
        assert error_of(parse_completions_request, {"prompt": prompt})["param"] == "prompt"
    assert "no batches" in error_of(parse_completions_request, {"prompt": ["a", "b"]})["message"]


def test_the_chat_template_is_the_documented_one() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
            {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": []},
            {"role": "user", "content": "", "name": "bob"},
        ]
    }
    text = "<|system|>\nBe brief.\n<|user|>\na\nb\n<|assistant|>\nok\n<|user|>\n\n<|assistant|>\n"
    assert parse_chat_request(body).prompt == list(text.encode())
    assert chat_prompt([("user", "Hi")]) == "<|user|>\nHi\n<|assistant|>\n"
    unprompted = parse_chat_request({**body, "add_generation_prompt": False}).prompt
    assert bytes(unprompted).decode() == text.removesuffix("<|assistant|>\n")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"role": "developer", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0]",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls"),
        ([{"role": "user", "content": "x", "colour": "red"}], "messages[0].colour"),
        ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
    ],
)
def test_bad_chat_messages_are_a_400_naming_the_message_field(messages: Any, param: str) -> None:
    error = error_of(parse_chat_request, {"messages": messages})
    assert (error["status"], error["param"]) == (400, param)
    assert param in error["message"]


@pytest.mark.parametrize(
    ("field", "value", "chat"),
    [
        ("n", 2, False),
        ("n", 2, True),
        ("logprobs", 1, False),
        ("logprobs", True, True),
        ("top_logprobs", 3, True),
        ("echo", True, False),
        ("best_of", 2, False),
        ("logit_bias", {"65": 5}, False),
        ("suffix", "end", False),
        ("tools", [{"type": "function", "function": {"name": "f"}}], True),
        ("tool_choice", "auto", True),
        ("stop", "\n", False),
        ("stop", ["x"], True),
        ("top_p", 0.5, False),
        ("presence_penalty", 1, True),
        ("response_format", {"type": "json_object"}, True),
        ("use_beam_search", True, False),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(field: str, value: Any, chat: bool) -> None:
    parse, base = (
        (parse_chat_request, {"messages": HELLO})
        if chat
        else (parse_completions_request, {"prompt": "hi"})
    )
    error = error_of(parse, {**base, field: value})
    assert (error["status"], error["param"], error["code"]) == (400, field, "unsupported_value")
    assert f"{field}=" in error["message"]


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    neutral: dict[str, Any] = {
        "n": 1,
        "logprobs": None,
        "echo": False,
        "best_of": 1,
        "stop": [],
        "top_p": 1.0,
        "top_k": -1,
        "logit_bias": {},
        "suffix": None,
    }
    assert parse_completions_request({"prompt": "hi", **neutral}).max_tokens == 16
    chat = {
        "logprobs": False,
        "top_logprobs": 0,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "parallel_tool_calls": True,
    }
    assert parse_chat_request({"messages": HELLO, **chat}).max_tokens == 16
    # Several at once: all are named.
    error = error_of(parse_completions_request, {"prompt": "hi", "n": 3, "echo": True})
    assert "n=3" in error["message"]
    assert "echo=true" in error["message"]


@pytest.mark.parametrize("value", [False, True, 0.7, 1, "0", [0], float("nan")])
def test_only_temperature_zero_is_accepted_and_no_boolean(value: object) -> None:
    error = error_of(parse_completions_request, {"prompt": "hi", "temperature": value})
    assert (error["status"], error["param"]) == (400, "temperature")


def test_temperature_zero_or_null_is_greedy() -> None:
    for value in (0, 0.0, -0.0, None):
        assert parse_completions_request({"prompt": "hi", "temperature": value}).prompt


def test_a_model_other_than_the_served_one_is_a_404_as_openai_does() -> None:
    error = error_of(parse_chat_request, {"messages": HELLO, "model": "gpt-4o"})
    assert error == {
        "status": 404,
        "message": f"The model `gpt-4o` does not exist (this engine serves `{MODEL_NAME}`)",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert error_of(parse_chat_request, {"messages": HELLO, "model": 1})["status"] == 400
    assert parse_chat_request({"messages": HELLO, "model": None}).prompt


def test_max_tokens_and_min_tokens() -> None:
    chat = {"messages": HELLO}
    assert parse_chat_request({**chat, "max_tokens": 5}).max_tokens == 5
    # max_completion_tokens wins (vLLM's proxy sets both to 1 for the prefill).
    assert parse_chat_request({**chat, "max_tokens": 5, "max_completion_tokens": 7}).max_tokens == 7
    assert parse_chat_request({**chat, "max_tokens": None}).max_tokens == 16
    for field in ("max_tokens", "max_completion_tokens"):
        for value in (0, MAX_TOKENS + 1, 2.0, True, "5", 10**400):
            assert error_of(parse_chat_request, {**chat, field: value})["param"] == field
    ok = {**chat, "max_tokens": 8, "min_tokens": 8, "min_completion_tokens": None}
    assert parse_chat_request(ok).max_tokens == 8
    error = error_of(parse_chat_request, {**ok, "min_tokens": 9})
    assert (error["param"], error["message"]) == (
        "min_tokens",
        "min_tokens must be an integer in [0, 8], got 9",
    )
    # A prefill generates nothing: a P/D proxy that sets max_tokens 1 may leave min_tokens.
    prefill = {**ok, "max_tokens": 1, "min_tokens": 8, "kv_transfer_params": VLLM_PREFILL_PARAMS}
    assert parse_chat_request(prefill).kind == "prefill"


def test_kv_transfer_params_as_vllm_sends_them() -> None:
    request = parse_completions_request(
        {"prompt": "hi", "kv_transfer_params": VLLM_PREFILL_PARAMS, "min_tokens": None}
    )
    assert (request.kind, request.kv_transfer_params) == ("prefill", VLLM_PREFILL_PARAMS)
    decode = {
        "do_remote_prefill": True,
        "do_remote_decode": None,
        "remote_engine_id": "p",
        "remote_host": "h",
        "remote_port": 5,
        "remote_block_ids": [1, 2],
        "remote_request_id": "r",
        "remote_incarnation": None,
        "remote_token": None,
        "tp_size": None,
        "some_connector_key": {"x": 1},
    }
    assert (
        parse_completions_request({"prompt": "hi", "kv_transfer_params": decode}).kind == "decode"
    )
    for params in (None, {}, {"do_remote_decode": False, "do_remote_prefill": None}):
        whole = {"prompt": "hi", "kv_transfer_params": params}
        assert parse_completions_request(whole).kind == "whole"
    bad: list[tuple[object, str]] = [
        ([], "kv_transfer_params"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "do_remote_prefill"),
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"remote_port": "80"}, "remote_port"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_block_ids": [2**70]}, "remote_block_ids"),
        ({"remote_block_ids": "1"}, "remote_block_ids"),
        ({"tp_size": True}, "tp_size"),
    ]
    for value, param in bad:
        body: dict[str, Any] = {"prompt": "hi", "kv_transfer_params": value}
        expected = param if value == [] else f"kv_transfer_params.{param}"
        assert error_of(parse_completions_request, body)["param"] == expected


def test_stream_options_and_unknown_fields() -> None:
    chat = {"messages": HELLO}
    request = parse_chat_request(
        {**chat, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert (request.stream, request.include_usage) == (True, True)
    # Without stream they are accepted (P/D proxies turn streaming off for the prefill).
    assert parse_chat_request({**chat, "stream_options": {"include_usage": True}}).stream is False
    for options, param in [
        ("yes", "stream_options"),
        ({"include_usage": 1}, "stream_options.include_usage"),
        ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
        ({"colour": 1}, "stream_options.colour"),
    ]:
        assert error_of(parse_chat_request, {**chat, "stream_options": options})["param"] == param
    # Unknown top-level fields are ignored, as vLLM does; the server logs them.
    odd = {**chat, "colour": "red", "seed": 4, "user": "u", "ignore_eos": True, "metadata": {}}
    assert parse_chat_request(odd).ignored == ("colour",)
    assert error_of(parse_chat_request, {**chat, "seed": "4"})["param"] == "seed"


def test_lone_surrogates_anywhere_are_a_400_naming_where() -> None:
    for body, param in [
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": "a", "user": "\udfff"}, "user"),
        (
            {"prompt": "a", "kv_transfer_params": {"remote_host": "\ud800"}},
            "kv_transfer_params.remote_host",
        ),
        ({"prompt": "a", "x": [{"y": ["\ud800"]}]}, "x[0].y[0]"),
        ({"prompt": "a", "\ud800": 1}, "a field name"),
    ]:
        error = error_of(parse_completions_request, body)
        assert (error["status"], error["param"]) == (400, param)
        assert "not valid Unicode" in error["message"]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud834"}]}]}
    assert error_of(parse_chat_request, body)["param"] == "messages[0].content[0].text"


def test_the_request_id_comes_from_x_request_id_when_usable() -> None:
    assert (
        request_id_from_headers([(b"authorization", b"Bearer k"), (b"x-request-id", b"a-1")])
        == "a-1"
    )
    for bad in (b"", b"a b", b"a\x00", b"\xff", b"x" * 129):
        minted = request_id_from_headers([(b"x-request-id", bad)])
        assert len(minted) == 32
        assert int(minted, 16) >= 0
    assert request_id_from_headers([]) != request_id_from_headers([])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([b"x-request-id", b"X-Request-ID", b"other"]), st.binary()),
        max_size=3,
    )
)
def test_any_headers_give_a_usable_request_id(headers: list[tuple[bytes, bytes]]) -> None:
    request_id = request_id_from_headers(headers)
    assert 0 < len(request_id) <= 128
    assert request_id.isascii()
    assert request_id.isprintable()
    assert " " not in request_id


# ---- the fuzz: any body is a valid parse or a 4xx, never another exception ----------

_ints = st.one_of(st.integers(), st.sampled_from([0, 1, 16, 2**64, -(2**63), 10**100, 10**4000]))
_texts = st.one_of(
    st.text(max_size=8),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates
    st.sampled_from([MODEL_NAME, "user", "assistant", "system", "text", "none", "auto"]),
)
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(), _texts)
_field_names = sorted({*COMPLETIONS, *CHAT, *COMPLETIONS_NEUTRAL, *CHAT_NEUTRAL})
_keys = st.one_of(st.sampled_from([*_field_names, *KV_TYPES, "role", "content", "type"]), _texts)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)


_plausible = st.one_of(
    st.none(), st.booleans(), st.integers(-1, 20), st.just(MODEL_NAME), st.just([]), st.just({})
)


_typed_values: dict[type, st.SearchStrategy[Any]] = {
    bool: st.sampled_from([True, True, False, None]),
    str: st.none() | st.text(max_size=5),
    int: st.none() | st.integers(0, 70_000),
    list: st.none() | st.lists(st.integers(0, 100), max_size=3),
}


def _value(draw: st.DrawFn) -> object:
    """A value for a known field: mostly a plausible one, sometimes anything."""
    return draw(_plausible if draw(st.integers(0, 3)) else _json)


@st.composite
def _bodies(draw: st.DrawFn) -> object:
    """Mostly valid bodies with a few fields (or nested values) replaced."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_json)
    body: dict[str, Any] = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    for name in draw(st.lists(st.sampled_from(_field_names), max_size=4, unique=True)):
        body[name] = _value(draw)
    if draw(st.integers(0, 3)) == 0:
        message: dict[str, Any] = {
            "role": draw(st.sampled_from(["user", "system"])),
            "content": "c",
        }
        message[draw(_keys)] = _value(draw)
        body["messages"] = [message, *draw(st.lists(_json, max_size=2))]
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from(sorted(KV_TYPES)), max_size=6, unique=True))
        body["kv_transfer_params"] = {
            key: draw(_json if draw(st.integers(0, 9)) == 0 else _typed_values[KV_TYPES[key]])
            for key in keys
        }
    if draw(st.integers(0, 3)) == 0:
        keys = draw(st.lists(_keys | st.just("include_usage"), max_size=2, unique=True))
        body["stream_options"] = {key: _value(draw) for key in keys}
    return body


def _deeply_nested(depth: int, value: object = "\ud800") -> object:
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=250, deadline=None)
@given(body=_bodies(), chat=st.booleans())
@example(body={"prompt": "x", "max_tokens": 10**4000, "n": 10**4000}, chat=False)
def test_any_body_parses_or_is_a_4xx_never_another_exception(body: object, chat: bool) -> None:
    outcome = parse_or_4xx(body, chat)
    event(outcome)


def test_bodies_nested_deeper_than_python_recurses_are_a_4xx() -> None:
    # (not hypothesis examples: it could not print them)
    parse_or_4xx({"prompt": _deeply_nested(5000), "n": _deeply_nested(5000)}, chat=False)
    parse_or_4xx({"prompt": "x", "n": _deeply_nested(5000, "")}, chat=False)
    parse_or_4xx({"messages": [{"role": "user", "content": _deeply_nested(5000)}]}, chat=True)
    parse_or_4xx({"messages": _deeply_nested(5000, {})}, chat=True)


def parse_or_4xx(body: object, chat: bool) -> str:
    """Parse ``body``: a valid request, or an :class:`HTTPError` with a 4xx (which)."""
    parse = parse_chat_request if chat else parse_completions_request
    try:
        request = parse(body)
    except HTTPError as exc:
        return checked_error(exc)
    assert request.prompt
    assert all(0 <= t < 256 for t in request.prompt)
    assert 1 <= request.max_tokens <= MAX_TOKENS
    assert request.kind in ("prefill", "decode", "whole")
    json.dumps(request.kv_transfer_params).encode()
    return f"parsed: {request.kind}"


def checked_error(exc: HTTPError) -> str:
    """``exc`` is a 4xx with OpenAI's error body (its status and field, for statistics)."""
    assert 400 <= exc.status < 500
    error = exc.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    json.dumps(exc.body).encode()  # (the body can be sent)
    return f"{exc.status} {str(error['param']).split('.')[0].split('[')[0]}"


# ---- response shapes ------------------------------------------------------------------


def test_response_shapes() -> None:
    shapes = Shapes("chatcmpl-r", chat=True, prompt_tokens=10, created=5)
    whole = shapes.whole("hi", [104, 105])
    assert whole["object"] == "chat.completion"
    assert whole["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "token_ids": [104, 105],
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert whole["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    first = shapes.first_chunk()
    assert first is not None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunk = shapes.chunk("h", [104], last=True, include_usage=True)
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["usage"] is None
    assert chunk["choices"][0]["finish_reason"] == "length"
    assert shapes.usage_chunk(2)["choices"] == []
    text = Shapes("cmpl-r", chat=False, prompt_tokens=1)
    assert text.first_chunk() is None
    [choice] = text.chunk("h", [104], last=False, include_usage=False)["choices"]
    assert choice == {
        "index": 0,
        "text": "h",
        "token_ids": [104],
        "logprobs": None,
        "finish_reason": None,
    }
    assert model_list(2048)["data"][0]["max_model_len"] == 2048


# ---- the application in this process: routes, ids, the catch-all ---------------------


async def call(
    app: Callable[..., Awaitable[None]],
    method: str,
    path: str,
    body: bytes = b"",
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> tuple[int, dict[bytes, bytes], Any]:
    """One request to the ASGI ``app``: its status, headers and body (JSON if it is)."""
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
    start, data = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    head = dict(start["headers"])
    if head[b"content-type"] != b"text/event-stream":  # (a whole answer says its length)
        assert int(head[b"content-length"]) == len(data)
    return start["status"], head, json.loads(data) if b"json" in head[b"content-type"] else data


@pytest.fixture
def app() -> Callable[..., Awaitable[None]]:
    """An engine's app with no connector: generation requests get as far as a 503."""
    engine = Engine(EngineSettings("e0", http_port=0, num_blocks=8), TinyLlama(ModelConfig()))
    return build_app(engine)


async def test_routes_methods_and_request_ids(app: Callable[..., Awaitable[None]]) -> None:
    status, headers, body = await call(
        app, "GET", "/v1/models", headers=((b"x-request-id", b"r1"),)
    )
    assert (status, headers[b"x-request-id"]) == (200, b"r1")
    assert body["data"][0]["id"] == MODEL_NAME
    assert body["data"][0]["max_model_len"] == 8 * 16  # (the pool is smaller than the model)
    assert (await call(app, "GET", f"/v1/models/{MODEL_NAME}"))[2]["object"] == "model"
    status, _, body = await call(app, "GET", "/v1/models/gpt-4")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    for method, path, allow in [
        ("GET", "/v1/completions", b"POST"),
        ("PUT", "/v1/chat/completions", b"POST"),
        ("POST", "/v1/models", b"GET"),
        ("DELETE", "/health", b"GET"),
    ]:
        status, headers, body = await call(app, method, path)
        assert (status, headers[b"allow"]) == (405, allow)
        assert body["error"]["code"] == "method_not_allowed"
        assert len(headers[b"x-request-id"]) == 32  # (minted)
    status, _, body = await call(app, "POST", "/v2/nothing")
    assert (status, set(body["error"])) == (404, {"message", "type", "param", "code"})
    # Bad bodies are 400s before the engine's state matters; good ones, a 503 here.
    for raw, status in [
        (b"[" * 100_000, 400),
        (b"\xff", 400),
        (b"[]", 400),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 503),
    ]:
        assert (await call(app, "POST", "/v1/chat/completions", raw))[0] == status


async def test_an_unexpected_exception_is_a_logged_json_500(
    app: Callable[..., Awaitable[None]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(body: object) -> GenerationRequest:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "parse_chat_request", broken)
    with caplog.at_level(logging.ERROR, "trio_pd.serve"):
        status, headers, body = await call(
            app, "POST", "/v1/chat/completions", b"{}", ((b"x-request-id", b"bug-1"),)
        )
    assert (status, headers[b"x-request-id"]) == (500, b"bug-1")
    assert body["error"]["type"] == "server_error"
    assert "bug-1" in body["error"]["message"]
    assert "a bug" not in body["error"]["message"]  # (the log has it, not the client)
    [record] = caplog.records
    assert "bug-1" in record.getMessage()
    assert record.exc_info is not None


@asynccontextmanager
async def lifespan(app: Callable[..., Awaitable[None]]) -> AsyncIterator[None]:
    """Run ``app``'s lifespan (its connectors open) around the block."""
    to_app, app_receives = trio.open_memory_channel[dict[str, Any]](1)
    app_sends, from_app = trio.open_memory_channel[dict[str, Any]](1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, {"type": "lifespan"}, app_receives.receive, app_sends.send)
        await to_app.send({"type": "lifespan.startup"})
        assert (await from_app.receive())["type"] == "lifespan.startup.complete"
        yield
        await to_app.send({"type": "lifespan.shutdown"})
        assert (await from_app.receive())["type"] == "lifespan.shutdown.complete"


async def test_kv_transfer_params_of_a_tp_size_this_engine_cannot_read_are_a_400() -> None:
    # (before the hold: a decode engine of TP 2 cannot read a producer of TP 3)
    settings = EngineSettings("d0", http_port=0, num_blocks=16, tp_size=2)
    app = build_app(Engine(settings, TinyLlama(ModelConfig())))
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_block_ids": [1],
        "remote_request_id": "r",
        "tp_size": 3,
    }
    body = json.dumps({"prompt": "y" * 17, "kv_transfer_params": params}).encode()
    with trio.fail_after(30):
        async with lifespan(app):
            status, _, answer = await call(app, "POST", "/v1/completions", body)
    assert (status, answer["error"]["param"]) == (400, "kv_transfer_params.tp_size")
    assert "tensor-parallel sizes 3 (remote) and 2 (local)" in answer["error"]["message"]


# ---- a real deployment ------------------------------------------------------------------

CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, int]]] = [
    ([{"role": "user", "content": "Hello, trio"}], {"max_tokens": 6}),
    (
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "KV-Cache über NIXL: 日本語"},
        ],
        {"max_completion_tokens": 9},
    ),
    (
        [
            {"role": "user", "content": [{"type": "text", "text": t} for t in ("one", "two")]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "y" * 40},
        ],
        {"max_tokens": 12},
    ),
    ([{"role": "user", "content": ""}], {"max_tokens": 3, "max_completion_tokens": 5}),
]


class _AnyId(str):
    """Equal to any request id."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)

    __hash__ = str.__hash__


ANY_ID = _AnyId()


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    body = parse_chat_request({"messages": messages})
    return len(body.prompt)


async def chat(
    client: httpx2.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[list[int], dict[str, Any]]:
    """A chat completion's tokens and usage, streamed or not as ``body`` says."""
    if not body.get("stream"):
        response = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == headers.get("X-Request-Id", ANY_ID)
        data = response.json()
        assert (data["object"], data["model"]) == ("chat.completion", MODEL_NAME)
        [choice] = data["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == bytes(choice["token_ids"]).decode()
        return choice["token_ids"], data["usage"]
    events: list[Any] = []
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["x-request-id"] == headers.get("X-Request-Id", ANY_ID)
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    assert events[-1] == "[DONE]"
    chunks, last = events[:-1], events[-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    text = "".join(choice["delta"].get("content", "") for c in chunks for choice in c["choices"])
    assert text == bytes(tokens).decode()
    with_tokens = [c for c in chunks if c["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in with_tokens[1:]] == [None] * (
        len(tokens) - 1
    ) + ["length"]
    assert last["choices"] == []  # (stream_options.include_usage)
    return tokens, last["usage"]


@pytest.mark.slow
async def test_a_deployment_serves_the_openai_surface_and_disaggregated_chat(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with (
            open_deployment(tmp_path) as serving,
            deployment_client(30) as client,
        ):
            [prefill], [decode] = serving["prefill"], serving["decode"]
            for engine in (prefill, decode):
                models = (await client.get(f"{engine}/v1/models")).json()
                assert models["object"] == "list"
                assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [
                    (MODEL_NAME, 2048)
                ]

            # Every bad input: a 4xx, OpenAI's JSON error naming the field.
            chat_url = f"{decode}/v1/chat/completions"
            hello: dict[str, Any] = {"messages": HELLO}
            surrogate = b'{"messages": [{"role": "user", "content": "a\\udc00"}]}'
            cases: list[tuple[str, str, object, int, str | None]] = [
                ("POST", chat_url, {**hello, "n": 2}, 400, "n"),
                ("POST", chat_url, {**hello, "logprobs": True}, 400, "logprobs"),
                ("POST", chat_url, {**hello, "temperature": False}, 400, "temperature"),
                ("POST", chat_url, surrogate, 400, "messages[0].content"),
                ("POST", f"{decode}/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt"),
                ("POST", chat_url, {**hello, "model": "gpt-4o"}, 404, "model"),
                (
                    "POST",
                    chat_url,
                    {"messages": [{"role": "user", "content": "x" * 2040}]},
                    400,
                    "max_tokens",
                ),
                ("POST", chat_url, b"[" * 200_000, 400, None),
                ("GET", f"{decode}/v1/completions", None, 405, None),
                ("GET", f"{decode}/v1/nothing", None, 404, None),
            ]
            for method, url, body, status, param in cases:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                response = await client.request(method, url, content=content)
                assert response.status_code == status, (body, response.text)
                assert response.headers["content-type"] == "application/json"
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["param"] == param, error
            assert response.headers["x-request-id"]
            response = await client.get(f"{decode}/v1/completions")
            assert response.headers["allow"] == "POST"

            # Chat, whole on one engine (streamed and not), and disaggregated by
            # hand as vLLM's P/D proxy does it: the same tokens, the right usage.
            async def conversation(i: int) -> None:
                messages, limits = CONVERSATIONS[i]
                body: dict[str, Any] = {"messages": messages, "model": MODEL_NAME, **limits}
                body["temperature"] = 0
                wanted = limits.get("max_completion_tokens", limits.get("max_tokens", 16))
                prompt = prompt_tokens(messages)
                usage = {
                    "prompt_tokens": prompt,
                    "completion_tokens": wanted,
                    "total_tokens": prompt + wanted,
                }
                whole, whole_usage = await chat(client, decode, body, {})
                assert (len(whole), whole_usage) == (wanted, usage)
                streaming = {**body, "stream": True, "stream_options": {"include_usage": True}}
                assert await chat(client, decode, streaming, {}) == (whole, usage)

                rid = f"conversation-{i}"
                # (vLLM's proxy sends its OPENAI_API_KEY as a Bearer token: the engines'
                # internal key)
                headers = {"Authorization": f"Bearer {INTERNAL_KEY}", "X-Request-Id": rid}
                # The prefill request, as vLLM's P/D proxy makes it.
                first = {**(streaming if i % 2 else body), "stream": False, "max_tokens": 1}
                first["kv_transfer_params"] = VLLM_PREFILL_PARAMS
                if "max_completion_tokens" in first:
                    first["max_completion_tokens"] = 1
                first.pop("stream_options", None)
                url = f"{prefill}/v1/chat/completions"
                response = await client.post(url, json=first, headers=headers)
                assert response.status_code == 200, response.text
                assert response.headers["x-request-id"] == rid
                prefilled = response.json()
                assert rid in prefilled["id"]
                assert prefilled["object"] == "chat.completion"
                assert prefilled["usage"]["prompt_tokens"] == usage["prompt_tokens"]
                kv = prefilled["kv_transfer_params"]
                assert kv["do_remote_prefill"] is True
                second = {
                    **(streaming if i % 2 else body),
                    "kv_transfer_params": kv,
                    "min_tokens": None,
                    "min_completion_tokens": None,
                }
                assert await chat(client, decode, second, headers) == (whole, usage)
                # And through the deployment's own P/D proxy.
                proxied = streaming if i % 2 else body
                assert await chat(client, serving["proxy"], proxied, headers) == (whole, usage)

            async with trio.open_nursery() as nursery:
                for i in range(len(CONVERSATIONS)):
                    nursery.start_soon(conversation, i)


@pytest.mark.parametrize(
    ("grace", "waits_for"),
    [(5.0, "the lease"), (0.3, "--grace")],
)
async def test_a_prefill_engine_closes_its_connectors_only_once_its_exposures_resolved(
    grace: float, waits_for: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A decode engine elsewhere may still be pulling what this one exposed:
    # the shutdown waits until the exposure resolves (here: its 1 s lease,
    # with no reader), or until --grace is over (then it says so).
    settings = EngineSettings(
        "p0",
        http_port=0,
        num_blocks=16,
        lease_initial=1.0,
        lease_renewal=1.0,
        heartbeat_interval=0.3,
        grace=grace,
    )
    engine = Engine(settings, TinyLlama(ModelConfig()))
    app = build_app(engine)
    body = {"prompt": "x" * 40, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    with trio.fail_after(30):
        async with lifespan(app):
            status, _, answer = await call(
                app, "POST", "/v1/completions", json.dumps(body).encode()
            )
            assert status == 200, answer
            assert engine.exposures_unresolved.value == 1
            closing = trio.current_time()
        closed = trio.current_time() - closing
    if waits_for == "the lease":
        assert 0.5 <= closed < 4.0
        assert engine.exposures_unresolved.value == 0
        assert "not yet read" not in caplog.text
    else:
        assert 0.2 <= closed < 0.9
        assert "engine p0: closing with 1 exposures not yet read (--grace is over)" in caplog.text
