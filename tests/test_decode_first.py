"""The prefill engine's first token, and decode-first engines.

A prefill engine runs the prompt's last token too and answers with the first
generated token (in its completion, and as ``kv_transfer_params.first_token``):
the decode engine starts from it. A decode-first engine (``--prefill-url``)
takes clients' requests itself, runs each one's prefill on a prefill engine,
streams that first token once it holds the blocks, then pulls and decodes.

Real engines (real NIXL agents and ZeroMQ side channels), served over HTTP
by hypercorn in this process; the same output as one engine serving the
whole request, token for token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx2
import pytest
import trio

from trio_pd._serve.app import build_app
from trio_pd._serve.engine import Engine, EngineSettings
from trio_pd._serve.keys import BearerKeys
from trio_pd._serve.model import ModelConfig, TinyLlama, tokenize
from trio_pd._serve.openai import FIRST_TOKEN_PARAM
from trio_pd._serve.timing import parse as parse_server_timing

from .http_clients import http_client
from .test_proxy import closed_port_url, start_http, until

INTERNAL = "the-internal-key-of-these-tests"
CLIENT = "a-client-key-of-these-tests-0123"
MODEL = TinyLlama(ModelConfig())  # (one model for every engine here: its weights are seeded)


def engine(engine_id: str, **settings: Any) -> Engine:
    keys = settings.pop("keys", {})
    return Engine(EngineSettings(engine_id, http_port=0, num_blocks=64, **settings), MODEL, **keys)


@asynccontextmanager
async def serving(*apps: Callable[..., Awaitable[None]]) -> AsyncIterator[list[str]]:
    """``apps`` over HTTP while the block runs (their lifespans with them)."""
    async with trio.open_nursery() as nursery:
        yield [await start_http(nursery, app) for app in apps]
        nursery.cancel_scope.cancel()


Sends = Callable[[Callable[[dict[str, Any]], Awaitable[None]]], Any]
"""What a prefill engine's answers go through: given the server's ``send``,
the ``send`` its application calls (to rewrite or hold back a message)."""


@asynccontextmanager
async def deployment(
    prefill: Engine | None = None, sends: Sends | None = None, **decode_settings: Any
) -> AsyncIterator[tuple[Engine, Engine, str, str]]:
    """A prefill engine (``prefill``, or a fresh one; its answers through
    ``sends``) and a decode-first engine in front of it: both, and their
    URLs (the prefill engine also serves whole requests, as one engine)."""
    prefill = prefill or engine("p0")
    real = build_app(prefill)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        wrapped = sends is not None and scope["type"] == "http"
        await real(scope, receive, sends(send) if wrapped else send)

    async with serving(app) as [prefill_url]:
        decode = engine("d0", prefill_urls=(prefill_url,), **decode_settings)
        async with serving(build_app(decode)) as [decode_url]:
            yield prefill, decode, prefill_url, decode_url


async def stream(client: httpx2.AsyncClient, url: str, path: str, body: dict[str, Any]) -> Any:
    """A streamed request: its token ids, its events and its ``Server-Timing``."""
    ids: list[int] = []
    events = []
    async with (
        client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response,
        aclosing(response.aiter_lines()) as lines,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in lines:
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                events.append(event)
                for choice in event["choices"]:
                    ids += choice["token_ids"]
    return ids, events, parse_server_timing(response.headers.get("server-timing", ""))


PROMPTS = ["a", "x" * 15, "y" * 16, "z" * 17, "tell me about trio nurseries " * 3]


async def test_a_prefill_engine_answers_the_first_token_a_single_engine_would() -> None:
    prefill = engine("p0")
    async with serving(build_app(prefill)) as [url], http_client(30) as client:
        with trio.fail_after(60):
            for prompt in PROMPTS:
                body = {"prompt": prompt, "max_tokens": 1}
                whole = (await client.post(f"{url}/v1/completions", json=body)).json()
                remote = {**body, "kv_transfer_params": {"do_remote_decode": True}}
                answer = (await client.post(f"{url}/v1/completions", json=remote)).json()
                [token] = whole["choices"][0]["token_ids"]
                assert answer["choices"][0]["token_ids"] == [token]
                assert answer["choices"][0]["text"] == chr(token)
                assert answer["kv_transfer_params"][FIRST_TOKEN_PARAM] == token
                # (every prompt position is in the blocks, its last token's too)
                blocks = ModelConfig().blocks_for(len(tokenize(prompt)))
                assert len(answer["kv_transfer_params"]["remote_block_ids"]) == blocks


async def test_a_decode_first_engine_serves_what_one_engine_would() -> None:
    """Completions and chat, streamed or not, 1 to 9 tokens, prompts across
    block boundaries: the same tokens as the prefill engine serving them whole."""
    async with (
        deployment() as (prefill, decode, prefill_url, decode_url),
        http_client(30) as client,
    ):
        with trio.fail_after(120):
            for i, prompt in enumerate(PROMPTS):
                for path, body in (
                    ("/v1/completions", {"prompt": prompt}),
                    ("/v1/chat/completions", chat(prompt)),
                ):
                    body = {**body, "max_tokens": 1 + 2 * i}
                    whole = await client.post(f"{prefill_url}{path}", json=body)
                    expected = whole.json()["choices"][0]["token_ids"]
                    answer = await client.post(f"{decode_url}{path}", json=body)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["choices"][0]["token_ids"] == expected
                    assert answer.json()["usage"]["completion_tokens"] == len(expected)
                    ids, events, _ = await stream(client, decode_url, path, body)
                    assert ids == expected
                    assert events[-1]["choices"][0]["finish_reason"] == "length"
            # Every exposure was read -- but the four of one token, whose
            # answer is the prefill's token: given back --, nothing left.
            [producer] = prefill.connectors
            read = 4 * (len(PROMPTS) - 1)
            await until(lambda: producer.statistics().exposures_released == read)
            await until(lambda: producer.statistics().exposures_abandoned == 4)
            assert producer.statistics().exposures_pending == 0
            await until(lambda: prefill.pool.free == prefill.pool.num_blocks)
            await until(lambda: decode.pool.free == decode.pool.num_blocks)


async def test_the_first_token_is_streamed_before_the_pull() -> None:
    """The stream's headers (with its first token) leave once the blocks are
    held: their ``Server-Timing`` has the prefill and the hold, not yet the pull."""
    async with deployment() as (_, _, _, decode_url), http_client(30) as client:
        with trio.fail_after(60):
            body = {"prompt": "the first token comes from the prefill", "max_tokens": 4}
            _, events, timing = await stream(client, decode_url, "/v1/completions", body)
    assert {"prefill", "prefill.forward", "hold"} <= set(timing)
    assert not {"pull", "admission"} & set(timing)
    assert len(events) == 4  # (the first token's event, then the three decoded here)


async def test_a_decode_first_engine_refuses_kv_transfer_params_from_clients() -> None:
    """A client's parameters -- a replay of another request's, say -- are a
    400, and the exposure they name is not abandoned (its reader still reads it)."""
    async with (
        deployment() as (prefill, decode, prefill_url, decode_url),
        http_client(30) as client,
    ):
        given_back: list[object] = []
        real_give_back = decode.give_back

        def give_back(body: object) -> None:
            given_back.append(body)
            real_give_back(body)

        decode.give_back = give_back  # type: ignore[method-assign]  # (a spy: it still gives back)
        with trio.fail_after(60):
            body = {"prompt": "someone else's request", "max_tokens": 2}
            remote = {**body, "kv_transfer_params": {"do_remote_decode": True}}
            exposed = await client.post(f"{prefill_url}/v1/completions", json=remote)
            params = exposed.json()["kv_transfer_params"]
            for sent in ({**body, "kv_transfer_params": params}, remote):
                refused = await client.post(f"{decode_url}/v1/completions", json=sent)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["param"] == "kv_transfer_params"
                assert "decode-first" in error["message"]
            assert given_back == []  # (what would abandon it)
            [producer] = prefill.connectors
            assert producer.statistics().exposures_abandoned == 0
            assert producer.statistics().exposures_pending == 1


async def test_a_prefill_engine_that_cannot_be_reached_is_a_502_naming_it() -> None:
    """... and the engine's /health says so: 503 ``failing`` while its every
    prefill engine failed its last request (it cannot serve one then)."""
    dead = closed_port_url()
    decode = engine("d0", prefill_urls=(dead,))
    async with serving(build_app(decode)) as [url], http_client(30) as client:
        with trio.fail_after(30):
            before = await client.get(f"{url}/health")
            answer = await client.post(f"{url}/v1/completions", json={"prompt": "hi"})
            after = await client.get(f"{url}/health")
    assert before.status_code == 200, before.text
    assert (before.json()["status"], before.json()["prefill"]) == ("ok", 1)
    assert after.status_code == 503, after.text
    assert (after.json()["status"], after.json()["failing"]) == ("failing", ["prefill"])
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert (error["engine"], error["type"]) == (dead, "prefill_failed")
    # (a decode-first request is a decode request in the metrics, failed prefill or not)
    counted = decode.registry.get_sample_value(
        "trio_pd_serve_requests_total", {"kind": "decode", "outcome": "error"}
    )
    assert counted == 1


async def test_keys_clients_present_theirs_the_engine_sends_the_internal_one() -> None:
    internal = BearerKeys([INTERNAL], audience="internal")
    prefill = engine("p0", keys={"internal_keys": internal})
    async with serving(build_app(prefill)) as [prefill_url]:
        for sent, status in ((INTERNAL, 200), ("not-the-internal-key-0123", 502)):
            decode = engine(
                "d0",
                prefill_urls=(prefill_url,),
                keys={
                    "internal_keys": internal,
                    "client_keys": BearerKeys([CLIENT], audience="client"),
                    "internal_key": sent,
                },
            )
            async with serving(build_app(decode)) as [url], http_client(30) as c:
                with trio.fail_after(60):
                    body = {"prompt": "keys", "max_tokens": 2}
                    bare = await c.post(f"{url}/v1/completions", json=body)
                    assert bare.status_code == 401  # (no client key)
                    internal_only = await c.post(
                        f"{url}/v1/completions", json=body, headers=auth(INTERNAL)
                    )
                    assert internal_only.status_code == 401  # (it faces clients)
                    answer = await c.post(f"{url}/v1/completions", json=body, headers=auth(CLIENT))
                    assert answer.status_code == status, answer.text
                    if status == 502:
                        assert (
                            "refused decode-first engine d0 (401)"
                            in answer.json()["error"]["message"]
                        )


def chat(prompt: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("forged", [999, -1, "a", True, 1.5])
async def test_a_bad_first_token_from_the_prefill_engine_is_a_502_and_its_blocks_go_back(
    forged: object,
) -> None:
    """The prefill engine's parameters are the deployment's, not the client's:
    a first token out of the vocabulary is a deployment fault naming both
    engines, and the exposure is given back at once (not left to its lease)."""

    def forging(send: Any) -> Any:
        async def rewrite(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                answer = json.loads(message["body"])
                answer["kv_transfer_params"][FIRST_TOKEN_PARAM] = forged
                message = {**message, "body": json.dumps(answer).encode()}
            elif message["type"] == "http.response.start":  # (the length changes)
                headers = [h for h in message["headers"] if h[0].lower() != b"content-length"]
                message = {**message, "headers": headers}
            await send(message)

        return rewrite

    async with (
        deployment(sends=forging) as (prefill, decode, prefill_url, url),
        http_client(30) as client,
    ):
        with trio.fail_after(30):
            body = {"prompt": "forged", "max_tokens": 3, "stream": True}
            answer = await client.post(f"{url}/v1/completions", json=body)
            assert answer.status_code == 502, answer.text
            error = answer.json()["error"]
            assert error["type"] == "deployment_error"
            assert (error["engine"], error["prefill_engine"]) == ("d0", prefill_url)
            assert f"kv_transfer_params.{FIRST_TOKEN_PARAM}" in error["message"]
            [producer] = prefill.connectors
            # (at once, not after its lease: 5 s)
            await until(lambda: producer.statistics().exposures_abandoned == 1)
            await until(lambda: prefill.pool.free == prefill.pool.num_blocks)
            await until(lambda: decode.pool.free == decode.pool.num_blocks)


@pytest.mark.parametrize("draining", [False, True])
async def test_a_request_refused_for_its_shape_abandons_no_client_parameters(
    draining: bool,
) -> None:
    """Parameters a client sent in a request refused before they are looked
    at (a bad field, a draining engine, a two-line body with a malformed
    first line) are not given back: a decode-first engine's clients'
    parameters are never its own, and a replay must not end another's exposure."""
    async with (
        deployment() as (prefill, decode, prefill_url, decode_url),
        http_client(30) as client,
    ):
        given_back: list[object] = []
        decode.give_back = given_back.append  # type: ignore[method-assign]  # (a spy)
        with trio.fail_after(60):
            body = {"prompt": "someone else's request", "max_tokens": 2}
            remote = {**body, "kv_transfer_params": {"do_remote_decode": True}}
            exposed = await client.post(f"{prefill_url}/v1/completions", json=remote)
            params = exposed.json()["kv_transfer_params"]
            decode.accepting = not draining
            line = json.dumps({"kv_transfer_params": params}).encode() + b"\n"
            for sent, status in (
                ({"json": {**body, "max_tokens": 0, "kv_transfer_params": params}}, 400),
                ({"json": {**body, "prompt": 5, "kv_transfer_params": params}}, 400),
                (
                    {
                        "content": b"{not json\n" + line,
                        "headers": {"x-trio-pd-params-within": "5"},
                    },
                    400,
                ),
            ):
                refused = await client.post(f"{decode_url}/v1/completions", **sent)
                assert refused.status_code == status, refused.text
            assert given_back == []
            [producer] = prefill.connectors
            assert producer.statistics().exposures_abandoned == 0
            assert producer.statistics().exposures_pending == 1


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_request_that_can_never_run_here_is_a_400_before_its_prefill(
    streamed: bool,
) -> None:
    """Prompt plus max_tokens over what this engine's pool holds (the prefill
    engine needs only the prompt's blocks): refused before the prefill runs
    -- and not a stream that starts with the first token, then fails."""
    async with (
        deployment() as (prefill, _, _, decode_url),
        http_client(30) as client,
    ):
        with trio.fail_after(60):
            # (600 + 600 tokens: 75 blocks, the pool has 64; each alone is fine)
            body = {"prompt": "x" * 600, "max_tokens": 600, "stream": streamed}
            answer = await client.post(f"{decode_url}/v1/completions", json=body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "max_tokens"
            [producer] = prefill.connectors
            assert producer.statistics().exposures_released == 0
            assert producer.statistics().exposures_abandoned == 0
            assert producer.statistics().exposures_pending == 0


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_prefill_engine_with_another_exposure_secret_is_a_deployment_fault(
    streamed: bool,
) -> None:
    """The token check of the prefill engine's parameters fails here (the
    engines sign with different secrets): a 502 naming both engines, not a
    400 blaming a client that sent no parameters."""
    prefill = engine("p0", keys={"exposure_secret": b"a" * 32})
    async with (
        deployment(prefill, keys={"exposure_secret": b"b" * 32}) as (_, decode, prefill_url, url),
        http_client(30) as client,
    ):
        with trio.fail_after(30):
            body = {"prompt": "secret", "max_tokens": 3, "stream": streamed}
            answer = await client.post(f"{url}/v1/completions", json=body)
            assert answer.status_code == 502, answer.text
            error = answer.json()["error"]
            assert error["type"] == "deployment_error"
            assert (error["engine"], error["prefill_engine"]) == ("d0", prefill_url)
            assert "kv_transfer_params['remote_token']" in error["message"]
            await until(lambda: decode.pool.free == decode.pool.num_blocks)


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_exposure_that_ended_before_the_pull_is_prefilled_again(streamed: bool) -> None:
    """The prefill's answer comes after its exposure's lease ran out (its first
    answer is held back until the producer counted the expiry): the pull finds
    it over, and the engine prefills once more, as the proxy does. A stream
    that already carries the first token goes on with the second prefill's
    KV, without sending that token again; the answer is one engine's."""
    prefill = engine("p0", lease_initial=0.05)
    held_back = True  # (not yet: the answer to hold back is the decode-first engine's)

    def late_once(send: Any) -> Any:
        async def answer(message: dict[str, Any]) -> None:
            nonlocal held_back
            if message["type"] == "http.response.start" and not held_back:
                held_back = True
                [producer] = prefill.connectors
                await until(lambda: producer.statistics().exposures_expired == 1)
            await send(message)

        return answer

    async with (
        deployment(prefill, late_once) as (_, decode, prefill_url, url),
        http_client(30) as client,
    ):
        with trio.fail_after(30):
            body = {"prompt": "a late answer", "max_tokens": 4}
            whole = await client.post(f"{prefill_url}/v1/completions", json=body)
            expected = whole.json()["choices"][0]["token_ids"]
            held_back = False
            if streamed:
                ids, events, _ = await stream(client, url, "/v1/completions", body)
                assert len(events) == 4  # (the first token once)
            else:
                answer = await client.post(f"{url}/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                ids = answer.json()["choices"][0]["token_ids"]
            assert ids == expected
            [consumer] = decode.connectors
            assert consumer.statistics().pulls_exposure_ended == 1
            assert consumer.statistics().pulls_succeeded == 1
            await until(lambda: prefill.pool.free == prefill.pool.num_blocks)
            await until(lambda: decode.pool.free == decode.pool.num_blocks)


@pytest.mark.parametrize("streamed", [False, True])
async def test_one_token_is_the_prefills_and_nothing_is_pulled(streamed: bool) -> None:
    """With ``max_tokens`` 1 the prefill engine's token is the whole answer: the
    exposure is given back at once (not after its lease: 60 s here), and the
    decode engine admits nothing and pulls nothing."""
    async with (
        deployment(engine("p0", lease_initial=60.0)) as (prefill, decode, prefill_url, url),
        http_client(30) as client,
    ):
        with trio.fail_after(30):
            body = {"prompt": "just one", "max_tokens": 1, "stream": streamed}
            whole = await client.post(f"{prefill_url}/v1/completions", json=body)
            if streamed:
                expected = [
                    json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"]
                    for line in whole.text.splitlines()
                    if line.startswith("data: {")
                ]
                ids, _, timing = await stream(client, url, "/v1/completions", body)
                assert [ids] == expected
                assert "pull" not in timing
            else:
                expected = whole.json()["choices"][0]["token_ids"]
                answer = await client.post(f"{url}/v1/completions", json=body)
                assert answer.json()["choices"][0]["token_ids"] == expected
            [producer], [consumer] = prefill.connectors, decode.connectors
            await until(lambda: producer.statistics().exposures_abandoned == 1)
            await until(lambda: prefill.pool.free == prefill.pool.num_blocks)
            assert consumer.statistics().pulls_succeeded == 0
            assert decode.pool.free == decode.pool.num_blocks
