"""``trio-pd serve --dispatch decode-first`` in its own process: no proxy,
clients call the decode engines, each decode-first in front of every prefill
engine (real processes, CURVE key files of the run, a real HTTP client).

One deployment for the whole module (each start costs seconds): its answers
are one engine's, token for token; its decode engine asks clients for the
deployment's client keys (``--api-key`` and ``TRIO_PD_API_KEY``, which
``serve`` hands to it in its environment) and its prefill engine keeps
refusing them; SIGTERM lets a request in flight finish, drains the decode
engine, then the prefill engine, and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import httpx2
import pytest
import trio

from .http_clients import http_client
from .test_decode_first import PROMPTS, auth, chat, stream
from .test_serve import INTERNAL_KEY, metrics

pytestmark = pytest.mark.slow

FLAG_KEY = "a-client-key-given-as-a-flag-0123"
ENV_KEY = "a-client-key-in-the-environment-45"


async def test_serve_decode_first_answers_what_one_engine_would_and_drains_in_order(
    tmp_path: Path,
) -> None:
    ready_file, log = tmp_path / "ready.json", tmp_path / "serve.log"
    command = [
        *[sys.executable, "-m", "trio_pd", "serve", "--dispatch", "decode-first"],
        *["--port", "0", "--ready-file", str(ready_file), "--api-key", FLAG_KEY],
    ]
    env = {
        **os.environ,
        "NIXL_LOG_LEVEL": "WARN",
        "TRIO_PD_INTERNAL_KEY": INTERNAL_KEY,
        "TRIO_PD_API_KEY": ENV_KEY,
    }
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out
        )
    try:
        with trio.fail_after(120):
            while not ready_file.exists():  # (another process writes it)
                assert process.poll() is None, log.read_text()
                await trio.sleep(0.05)
            ready = json.loads(ready_file.read_text())
            [prefill], [decode] = ready["prefill"], ready["decode"]
            # What clients call is explicit: the decode engine; there is no proxy.
            assert ready["dispatch"] == "decode-first"
            assert ready["clients"] == [decode]
            assert ready["proxy"] is None
            async with http_client(60) as client:
                await keys_are_asked_for(client, prefill, decode)
                await answers_are_one_engines(client, prefill, decode)
                await sigterm_drains_the_decode_engine_then_the_prefill_engine(
                    client, decode, process
                )
    finally:
        with trio.move_on_after(40, shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
    text = log.read_text()
    assert process.returncode == 0, text
    assert not ready_file.exists()
    assert "decode-first without client keys" not in text  # (the engine got them)
    order = [
        "serving: clients call the decode engines",
        "draining the decode engines",
        "engine decode-0 stopped",
        "draining the prefill engines",
        "engine prefill-0 stopped",
    ]
    at = [text.index(line) for line in order]
    assert at == sorted(at), text


async def keys_are_asked_for(client: httpx2.AsyncClient, prefill: str, decode: str) -> None:
    """The decode engine takes each client key (the flag's, the variable's),
    not the internal key; the prefill engine the internal key alone."""
    body = {"prompt": "who may call?", "max_tokens": 2}
    for headers, status in [
        ({}, 401),
        (auth(INTERNAL_KEY), 401),  # (it faces clients: it sends this key, takes none)
        (auth(FLAG_KEY), 200),
        (auth(ENV_KEY), 200),
    ]:
        answer = await client.post(f"{decode}/v1/completions", json=body, headers=headers)
        assert answer.status_code == status, answer.text
    for key in (FLAG_KEY, ENV_KEY):
        answer = await client.post(f"{prefill}/v1/completions", json=body, headers=auth(key))
        assert answer.status_code == 401, answer.text


async def answers_are_one_engines(client: httpx2.AsyncClient, prefill: str, decode: str) -> None:
    """Completions and chat, streamed and not: what the decode engine answers
    is what the prefill engine answers serving the request whole."""
    client.headers.update(auth(FLAG_KEY))
    whole_headers = auth(INTERNAL_KEY)
    served = 0
    for i, prompt in enumerate(PROMPTS):
        for path, body in (
            ("/v1/completions", {"prompt": prompt}),
            ("/v1/chat/completions", chat(prompt)),
        ):
            body = {**body, "max_tokens": 2 + 3 * i}
            whole = await client.post(f"{prefill}{path}", json=body, headers=whole_headers)
            assert whole.status_code == 200, whole.text
            expected = whole.json()["choices"][0]["token_ids"]
            answer = await client.post(f"{decode}{path}", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == expected
            ids, _, _ = await stream(client, decode, path, body)
            assert ids == expected
            served += 2
    # Each was prefilled on the prefill engine and pulled over the side
    # channel (CURVE, with the key files serve wrote), none served whole here.
    on_decode = metrics((await client.get(f"{decode}/metrics")).text)
    assert on_decode["trio_pd_pulls_succeeded_total"] == served + 2  # (+ the keys' two)
    assert on_decode["trio_pd_pulls_failed_total"] == 0
    assert on_decode.get("trio_pd_serve_requests_total{kind=whole,outcome=ok}", 0) == 0


async def sigterm_drains_the_decode_engine_then_the_prefill_engine(
    client: httpx2.AsyncClient, decode: str, process: trio.Process
) -> None:
    """A request in flight when SIGTERM arrives (its first token streamed, the
    pull and the decode still to come) finishes whole; then serve exits 0."""
    body = {"prompt": "drain me", "max_tokens": 300, "stream": True}
    tokens, done = 0, False
    async with (
        client.stream("POST", f"{decode}/v1/completions", json=body) as response,
        aclosing(response.aiter_lines()) as lines,
    ):
        assert response.status_code == 200
        async for line in lines:
            if line.startswith("data: {"):
                if not tokens:  # the first token, the prefill engine's: before the pull
                    process.send_signal(signal.SIGTERM)
                tokens += 1
            done = done or line == "data: [DONE]"
    assert (tokens, done) == (300, True)
    with trio.fail_after(60):
        await process.wait()
