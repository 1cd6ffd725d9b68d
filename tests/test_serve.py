"""``trio-pd serve`` in its own process, through a real HTTP client.

The proof vLLM uses for its connector: greedy output through the P/D proxy
(prefill on one engine, KV pulled over NIXL, decode on another) equals the
output of one engine serving the whole request, token for token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from trio_pd._serve.timing import parse as parse_server_timing

from .http_clients import http_client

pytestmark = pytest.mark.slow

BLOCK = 16  # tokens per KV block (the model's default)
NUM_BLOCKS = 1024  # KV blocks per engine (trio-pd serve's default)
MAX_TOKENS = 1024


INTERNAL_KEY = "the-tests-internal-key-0123456789"
"""The deployments' internal key here: the tests also call the engines directly."""


def deployment_client(timeout: float) -> httpx2.AsyncClient:
    """A client for a deployment's proxy *and* its engines (it shows the internal
    key, which the engines require on /v1/* and the proxy ignores without client keys).

    Its idle connections expire before the servers close them (``http_client``)."""
    return http_client(timeout, headers={"Authorization": f"Bearer {INTERNAL_KEY}"})


@asynccontextmanager
async def open_deployment(tmp_path: Path, *options: str) -> AsyncIterator[dict[str, Any]]:
    """``trio-pd serve`` with ``options`` (its internal key :data:`INTERNAL_KEY`):
    its ready file, then SIGTERM and exit."""
    ready = tmp_path / "ready.json"
    command = [sys.executable, "-m", "trio_pd", "serve", "--port", "0", "--ready-file", str(ready)]
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_INTERNAL_KEY": INTERNAL_KEY}
    process = await trio.lowlevel.open_process(
        [*command, *options], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(120):
            while not ready.exists():  # (another process writes it)
                assert process.poll() is None, "trio-pd serve exited before it was ready"
                await trio.sleep(0.05)
        yield {**json.loads(ready.read_text()), "process": process}
    finally:
        with trio.move_on_after(40, shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(30):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """``trio-pd serve --prefill 1 --decode 1 --dispatch concurrent`` (the tests
    on it also run a sequential proxy, the default, in front of its engines)."""
    async with open_deployment(tmp_path, "--dispatch", "concurrent") as serving:
        yield serving


async def scrape(client: httpx2.AsyncClient, engine: str) -> dict[str, float]:
    return metrics((await client.get(f"{engine}/metrics")).text)


def prompts() -> list[str]:
    """50 prompts: one byte, shorter than a block, ending exactly on block boundaries
    (the KV a prefill engine computes is all but the last token), long, non-ASCII."""
    fixed = [
        "a",
        "hi",
        "x" * BLOCK,
        "y" * (BLOCK + 1),  # 16 tokens of KV: exactly one block
        "z" * (2 * BLOCK + 1),  # exactly two blocks
        "w" * (2 * BLOCK + 2),
        "disaggregated prefill and decode, on trio " * 8,
        "KV-Cache über NIXL: ÄÖÜ ß 日本語 🙂",
    ]
    varied = [f"prompt {i}: " + "the quick brown fox " * (i % 7) + str(i * i) for i in range(42)]
    return fixed + varied


async def complete(client: httpx2.AsyncClient, url: str, **body: Any) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def stream(client: httpx2.AsyncClient, url: str, **body: Any) -> list[int]:
    tokens: list[int] = []
    done = False
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        async with aclosing(r.aiter_lines()) as lines:
            async for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    tokens += json.loads(line[len("data: ") :])["choices"][0]["token_ids"]
    assert done, "the stream ended without [DONE]"
    return tokens


def metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, by name and labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


@asynccontextmanager
async def sequential_proxy(deployment: dict[str, Any]) -> AsyncIterator[str]:
    """A second proxy, in this process, in front of ``deployment``'s engines,
    dispatching sequentially (the default; the deployment's own dispatches
    concurrently):
    its URL while the block runs."""
    from trio_pd._serve.proxy import Proxy, open_client

    from .test_proxy import start_http

    stop = trio.Event()
    async with open_client() as upstream, trio.open_nursery() as nursery:
        proxy = Proxy(
            deployment["prefill"],
            deployment["decode"],
            upstream,
            internal_key=INTERNAL_KEY,
            dispatch="sequential",
        )
        yield await start_http(nursery, proxy.app(), stop.wait)
        # Gracefully: the block's client has closed its connections, and
        # hypercorn closes its side as each ends (cancelled, a connection
        # still closing would leave its socket to the garbage collector).
        stop.set()


async def test_the_proxy_serves_exactly_what_one_engine_would(
    deployment: dict[str, Any],
) -> None:
    """Through the proxy (concurrent dispatch, and sequential dispatch -- the
    default -- by a second proxy), every answer is one engine's, token for token."""
    proxy, [prefill], [decode] = deployment["proxy"], deployment["prefill"], deployment["decode"]
    # (the ready file says what clients call: the proxy)
    assert (deployment["dispatch"], deployment["clients"]) == ("concurrent", [proxy])
    cases = prompts()
    through_proxy: dict[int, list[int]] = {}
    sequentially: dict[int, list[int]] = {}
    on_one_engine: dict[int, list[int]] = {}
    streamed: dict[int, list[int]] = {}
    clients = trio.CapacityLimiter(32)  # 32 concurrent clients
    with trio.fail_after(180):
        async with (
            sequential_proxy(deployment) as sequential,
            deployment_client(60) as client,
            trio.open_nursery() as nursery,
        ):

            async def one(i: int, prompt: str) -> None:
                async with clients:
                    max_tokens = 1 + (i * 7) % 24
                    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                    pd = await complete(client, proxy, **body)
                    whole = await complete(client, decode, **body)
                    through_proxy[i] = pd["choices"][0]["token_ids"]
                    on_one_engine[i] = whole["choices"][0]["token_ids"]
                    assert pd["usage"]["completion_tokens"] == max_tokens
                    if i % 5 == 0:
                        streamed[i] = await stream(client, proxy, **body)
                    if i % 2 == 0:
                        answer = await complete(client, sequential, **body)
                        sequentially[i] = answer["choices"][0]["token_ids"]

            for i, prompt in enumerate(cases):
                nursery.start_soon(one, i, prompt)
        assert through_proxy == on_one_engine
        assert all(streamed[i] == through_proxy[i] for i in streamed)
        assert sequentially == {i: through_proxy[i] for i in sequentially}
        assert len(set(map(tuple, through_proxy.values()))) > 25  # (not one constant answer)

        # The metrics count the work done, in Prometheus' text format.
        async with deployment_client(10) as client:
            on_decode = metrics((await client.get(f"{decode}/metrics")).text)
            on_prefill = metrics((await client.get(f"{prefill}/metrics")).text)
        disaggregated = len(cases) + len(streamed) + len(sequentially)
        assert on_decode["trio_pd_pulls_succeeded_total"] == disaggregated
        assert on_decode["trio_pd_pulls_failed_total"] == 0
        assert on_decode["trio_pd_serve_requests_total{kind=decode,outcome=ok}"] == disaggregated
        assert on_decode["trio_pd_serve_requests_total{kind=whole,outcome=ok}"] == len(cases)
        assert on_decode["trio_pd_serve_pull_seconds_count"] == disaggregated
        assert on_decode["trio_pd_engines_ready"] == 1
        assert on_prefill["trio_pd_serve_requests_total{kind=prefill,outcome=ok}"] == disaggregated
        with trio.fail_after(10):  # (the last notifications may still be on their way)
            while on_prefill["trio_pd_exposures_released_total"] < disaggregated:
                await trio.sleep(0.05)
                async with deployment_client(10) as client:
                    on_prefill = metrics((await client.get(f"{prefill}/metrics")).text)
        assert on_prefill["trio_pd_exposures_pending"] == 0

        # SIGTERM drains and stops everything cleanly.
        process = deployment["process"]
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await process.wait() == 0


async def bad_requests_get_clear_errors_and_the_engines_keep_serving(
    deployment: dict[str, Any],
) -> None:
    proxy, [decode] = deployment["proxy"], deployment["decode"]
    with trio.fail_after(60):
        async with deployment_client(30) as client:
            for body, status, words in [
                ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
                ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
                ({"prompt": "hi", "temperature": 0.7}, 400, "temperature"),
                ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
            ]:
                for url in (proxy, decode):
                    response = await client.post(f"{url}/v1/completions", json=body)
                    assert response.status_code == status
                    assert words in response.json()["error"]["message"]
            response = await client.post(f"{proxy}/v1/completions", content=b"{not json")
            assert response.status_code == 400
            assert (await client.get(f"{proxy}/v2/nothing")).status_code == 404

            # A decode request for blocks that no prefill engine of this
            # deployment exposed (no token, an engine that does not exist):
            # a 400 naming the field, before anything is sent.
            gone = {
                "do_remote_prefill": True,
                "remote_engine_id": "prefill-gone",
                "remote_host": "127.0.0.1",
                "remote_port": 9,  # (nothing listens: connection refused)
                "remote_block_ids": [0],
                "remote_request_id": "r-gone",
            }
            response = await client.post(
                f"{decode}/v1/completions",
                json={"prompt": "y" * (BLOCK + 1), "kv_transfer_params": gone},
            )
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "kv_transfer_params.remote_token"
            assert "'remote_token'" in error["message"]
            # Parameters that are malformed, or do not fit the prompt, are the
            # client's error.
            response = await client.post(
                f"{decode}/v1/completions",
                json={"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}},
            )
            assert response.status_code == 400
            assert "lacks" in response.json()["error"]["message"]
            response = await client.post(
                f"{decode}/v1/completions",
                json={
                    "prompt": "short",
                    "kv_transfer_params": {**gone, "remote_block_ids": [0, 1]},
                },
            )
            assert response.status_code == 400  # (unsigned: refused before the count)
            assert response.json()["error"]["param"] == "kv_transfer_params.remote_token"
            # The deployment still serves.
            body = {"prompt": "still here", "max_tokens": 3}
            assert (await complete(client, proxy, **body))["usage"]["completion_tokens"] == 3


async def a_client_that_disconnects_cancels_its_request_end_to_end(
    deployment: dict[str, Any],
) -> None:
    proxy, [prefill], [decode] = deployment["proxy"], deployment["prefill"], deployment["decode"]
    body = json.dumps({"prompt": "y" * 40, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    host, port = proxy.removeprefix("http://").rsplit(":", 1)
    ok, disconnected = (
        f"trio_pd_serve_requests_total{{kind=decode,outcome={outcome}}}"
        for outcome in ("ok", "disconnected")
    )
    async with deployment_client(30) as client:
        before = await scrape(client, decode)
    with trio.fail_after(60):
        # A bare HTTP/1.1 client: it reads until the first token, then hangs up.
        tcp = await trio.open_tcp_stream(host, int(port))
        async with tcp:
            await tcp.send_all(
                b"POST /v1/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: "
                b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            received = b""
            while b"data: " not in received:
                received += await tcp.receive_some()
            assert received.startswith(b"HTTP/1.1 200")
        async with deployment_client(30) as client:
            # The decode engine saw the disconnect and stopped; every KV block
            # went back to both pools (the exposure was read before decoding).
            while True:
                on_decode, on_prefill = await scrape(client, decode), await scrape(client, prefill)
                if on_decode.get(disconnected, 0) > before.get(disconnected, 0):
                    break
                await trio.sleep(0.05)
            assert on_decode.get(ok, 0) == before.get(ok, 0)
            while on_prefill["trio_pd_serve_kv_blocks_free"] < NUM_BLOCKS:
                await trio.sleep(0.05)
                on_prefill = await scrape(client, prefill)
            assert on_decode["trio_pd_serve_kv_blocks_free"] == NUM_BLOCKS
            pulled = "trio_pd_pulls_succeeded_total"
            assert on_decode[pulled] == before.get(pulled, 0) + 1


async def sigterm_lets_requests_in_flight_finish_then_stops(
    deployment: dict[str, Any],
) -> None:
    proxy, process = deployment["proxy"], deployment["process"]
    body = {"prompt": "drain me", "max_tokens": 400, "stream": True}  # (about 1 s)
    tokens, done = 0, False
    with trio.fail_after(60):
        async with (
            deployment_client(30) as client,
            client.stream("POST", f"{proxy}/v1/completions", json=body) as response,
            aclosing(response.aiter_lines()) as lines,
        ):
            async for line in lines:
                if line.startswith("data: {"):
                    if not tokens:  # the first token: the request is decoding
                        process.send_signal(signal.SIGTERM)
                    tokens += 1
                done = done or line == "data: [DONE]"
        assert (tokens, done) == (400, True)
        assert await process.wait() == 0


async def answers_say_where_their_time_went(deployment: dict[str, Any]) -> None:
    """Each answer's ``Server-Timing`` names the phases before its first token:
    the proxy's two requests and, relayed under their role, the engines' own
    phases; an engine serving a request whole names its admission and forward."""
    proxy, [decode] = deployment["proxy"], deployment["decode"]
    body = {"prompt": "where did the time go?", "max_tokens": 3}
    prefill = ["prefill", "prefill.admission", "prefill.forward", "prefill.expose"]
    # (the deployment's proxy dispatches concurrently: the decode engine's first
    # phase is its wait for its parameters, the body's second line)
    pulled = ["decode", "decode.params", "decode.hold", "decode.admission", "decode.pull"]
    with trio.fail_after(60):
        async with deployment_client(30) as client:
            for url, phases in [(proxy, [*prefill, *pulled]), (decode, ["admission", "forward"])]:
                for stream in (True, False):
                    request = client.stream(
                        "POST", f"{url}/v1/completions", json={**body, "stream": stream}
                    )
                    async with request as response:
                        assert response.status_code == 200
                        timing = parse_server_timing(response.headers["server-timing"])
                        if url == decode and not stream:  # (a whole answer: its length, unchunked)
                            assert "transfer-encoding" not in response.headers
                            assert int(response.headers["content-length"]) > 0
                    assert list(timing) == phases, (url, stream)
                    assert all(ms >= 0 for ms in timing.values())


async def test_bad_requests_a_client_that_disconnects_and_sigterm_on_one_deployment(
    deployment: dict[str, Any],
) -> None:
    """Four stories on one deployment (each start costs seconds): answers say
    where their time went; bad requests get clear errors and the engines keep
    serving; a client that disconnects cancels its request end to end (every
    block back in both pools); SIGTERM lets a request in flight finish, then
    stops."""
    await answers_say_where_their_time_went(deployment)
    await bad_requests_get_clear_errors_and_the_engines_keep_serving(deployment)
    await a_client_that_disconnects_cancels_its_request_end_to_end(deployment)
    await sigterm_lets_requests_in_flight_finish_then_stops(deployment)


async def test_a_prefill_engine_killed_under_load_fails_only_its_requests(
    tmp_path: Path,
) -> None:
    with trio.fail_after(120):
        async with open_deployment(tmp_path, "--prefill", "2") as serving:
            proxy, [alive, doomed] = serving["proxy"], serving["prefill"]
            async with deployment_client(30) as client:
                pid = (await client.get(f"{doomed}/health")).json()["pid"]
                outcomes: list[tuple[int, str]] = []

                async def one(i: int) -> None:
                    body = {"prompt": f"request {i} " * 3, "max_tokens": 24}
                    response = await client.post(f"{proxy}/v1/completions", json=body)
                    outcomes.append((response.status_code, response.text))

                async with trio.open_nursery() as nursery:
                    for i in range(40):
                        nursery.start_soon(one, i)
                        if i == 20:
                            os.kill(pid, signal.SIGKILL)
                        await trio.sleep(0.01)
                failed = [text for status, text in outcomes if status != 200]
                assert len(outcomes) - len(failed) >= 20
                for text in failed:  # each says which engine, and why
                    error = json.loads(text)["error"]
                    assert error["type"] in ("prefill_failed", "decode_failed")
                    assert "prefill-1" in error["message"] or doomed in error["message"]
                # The proxy goes on with the engine that is left.
                for i in range(10):
                    answer = await complete(client, proxy, prompt=f"after {i}", max_tokens=4)
                    assert answer["usage"]["completion_tokens"] == 4
                assert (await client.get(f"{alive}/health")).status_code == 200
                # serve killed outright: its engines notice and drain by themselves.
                serving["process"].kill()
                with trio.fail_after(10):
                    while True:  # (until the engine no longer listens)
                        try:
                            await client.get(f"{alive}/health")
                        except httpx2.TransportError:
                            break
                        await trio.sleep(0.05)


# (2, 1) here; decode ranks that each read a part of a prefill rank, and every
# other mix, across processes: tests/test_tensor_parallel.py)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1)])
async def test_tensor_parallel_engines_of_different_sizes_serve_the_same_tokens(
    tmp_path: Path, prefill_tp: int, decode_tp: int
) -> None:
    options = ["--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)]
    with trio.fail_after(120):
        async with (
            open_deployment(tmp_path, *options) as serving,
            deployment_client(60) as client,
        ):
            proxy, [decode] = serving["proxy"], serving["decode"]
            for i, prompt in enumerate(prompts()[:12]):
                body = {"prompt": prompt, "max_tokens": 8 + i}
                pd = await complete(client, proxy, **body)
                whole = await complete(client, decode, **body)
                assert pd["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
            on_decode = await scrape(client, decode)
            # Every decode rank pulled (from the prefill ranks holding its heads).
            assert on_decode["trio_pd_pulls_succeeded_total"] == 12 * decode_tp
            assert on_decode["trio_pd_engines_ready"] == max(prefill_tp, decode_tp)


async def test_a_decode_engine_that_died_is_skipped(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with (
            open_deployment(tmp_path, "--decode", "2") as serving,
            deployment_client(30) as client,
        ):
            proxy, [alive, dead] = serving["proxy"], serving["decode"]
            pid = (await client.get(f"{dead}/health")).json()["pid"]
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(10):
                while True:  # (until its port refuses connections)
                    try:
                        await client.get(f"{dead}/health")
                    except httpx2.ConnectError:
                        break
                    except httpx2.TransportError:
                        pass  # (its old connection was reset)
                    await trio.sleep(0.05)
            # Every request is served: the dead engine never saw one.
            for i in range(6):
                answer = await complete(client, proxy, prompt=f"still served {i}", max_tokens=4)
                assert answer["usage"]["completion_tokens"] == 4
            on_alive = await scrape(client, alive)
            assert on_alive["trio_pd_serve_requests_total{kind=decode,outcome=ok}"] == 6
            # The deployment served on, but an engine failed: serve's exit says so.
            serving["process"].send_signal(signal.SIGTERM)
            assert await serving["process"].wait() == 1
