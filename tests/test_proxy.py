"""The P/D proxy's routing, retries, deadlines, request ids and metrics.

The proxy's contract is HTTP, so its engines here are small scripted HTTP
servers (hypercorn's trio worker, in this process): each answers a prefill
or a decode request after a delay or with a status the test sets, and
records what it saw. The proxy runs in this process too, behind its own
hypercorn server, and the client is a real HTTP client. The real engines
are tested through the proxy in ``tests/test_serve.py``.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import httpx2
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve

from trio_pd._cli.proxy import ProxyOptions
from trio_pd._serve.asgi import read_json, send_json
from trio_pd._serve.defaults import HOLD_MARGIN
from trio_pd._serve.dispatch import SecondLine, params_within
from trio_pd._serve.errors import HTTPError
from trio_pd._serve.proxy import Proxy, ProxyTimeouts, open_client
from trio_pd._serve.timing import PhaseTimes, parse
from trio_pd.testing import free_port_range

from .http_clients import http_client
from .test_serve import metrics

KV = {"remote_engine_id": "p", "remote_block_ids": [1], "do_remote_prefill": True}


@attrs.define
class Scripted:
    """An engine whose answers the test sets; it records what it saw."""

    delay: float = 0.0
    gate: trio.Event | None = None  # (if set: each answer waits for it, not delay)
    status: int = 200
    param: str | None = None  # (the error body's param, when status is not 200)
    seen: list[dict[str, Any]] = attrs.field(factory=list)
    request_ids: list[str] = attrs.field(factory=list)
    authorizations: list[str] = attrs.field(factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    server_timing: str = ""  # (sent as Server-Timing when set)
    kv: dict[str, Any] = attrs.field(factory=lambda: dict(KV))  # (a prefill's answer)
    # (answered first, one per request, before status: (status, error code))
    answers: list[tuple[int, str | None]] = attrs.field(factory=list)
    arrived: list[float] = attrs.field(factory=list)  # (trio.current_time() of each request)
    max_model_len: int = 4096  # (what its /v1/models says)
    first_lines: list[float] = attrs.field(factory=list)  # (concurrent dispatch: line 1's arrival)
    cancelled: int = 0  # (concurrent dispatch: requests whose second line never came)
    params_within: list[float] = attrs.field(factory=list)  # (concurrent: the header's seconds)

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["path"].startswith("/v1/models"):  # (as an engine lists its model)
            card = {"id": "tiny", "object": "model", "created": 0, "owned_by": "trio-pd"}
            card["max_model_len"] = self.max_model_len
            if scope["path"] == "/v1/models":
                await send_json(send, 200, {"object": "list", "data": [card]})
            else:
                await send_json(send, 200, card)
            return
        headers = dict(scope["headers"])
        within = params_within(scope["headers"])
        if within is None:
            body = await read_json(receive)
        else:  # (concurrent dispatch: the parameters follow as a second line)
            second = SecondLine(receive, within)
            body = await second.first()
            self.first_lines.append(trio.current_time())
            self.params_within.append(within)
            try:
                body = {**body, "kv_transfer_params": await second.params()}
            except HTTPError:  # (the prefill failed: the proxy closed the request)
                self.cancelled += 1
                return
        self.seen.append(body)
        self.arrived.append(trio.current_time())
        self.request_ids.append(headers.get(b"x-request-id", b"").decode())
        self.authorizations.append(headers.get(b"authorization", b"").decode())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await trio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        timing = [(b"server-timing", self.server_timing.encode())] if self.server_timing else []
        status, code = self.answers.pop(0) if self.answers else (self.status, None)
        if status != 200:
            error = {
                "error": {
                    "message": f"scripted {status}",
                    "type": "scripted",
                    "code": code,
                    "param": self.param,
                }
            }
            await send_json(send, status, error)
        elif body.get("kv_transfer_params", {}).get("do_remote_decode"):
            await send_json(send, 200, {"kv_transfer_params": self.kv}, timing)
        else:
            await send_json(send, 200, {"choices": [{"text": "ok"}]}, timing)


async def start_http(
    nursery: trio.Nursery, app: Any, shutdown_trigger: Callable[[], Awaitable[None]] | None = None
) -> str:
    """Serve ``app`` in ``nursery`` on a free loopback port; return its URL.

    Cancel the nursery to stop it, or await ``shutdown_trigger`` (hypercorn's
    graceful shutdown: its connections close as they end, not under a
    cancellation that leaves their sockets to the garbage collector)."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    binds = await nursery.start(
        functools.partial(serve, app, config, shutdown_trigger=shutdown_trigger)
    )
    return str(binds[0])


def closed_port_url() -> str:
    """A URL where nothing listens (connection refused): its port is below the
    ephemeral range, so that no listener on port 0 (the other test worker has
    many) is given it."""
    return f"http://127.0.0.1:{free_port_range(1)}"


@asynccontextmanager
async def proxy_for(
    prefill: list[str], decode: list[str], timeouts: ProxyTimeouts | None = None, **options: Any
) -> AsyncIterator[tuple[Proxy, str]]:
    """A proxy in front of ``prefill`` and ``decode`` (``options``: more of
    :class:`Proxy`'s keywords), served over HTTP while the block runs."""
    timeouts = timeouts or ProxyTimeouts()
    async with open_client(timeouts) as client, trio.open_nursery() as nursery:
        proxy = Proxy(prefill, decode, client, timeouts=timeouts, **options)
        url = await start_http(nursery, proxy.app())
        yield proxy, url
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def engines(count: int) -> AsyncIterator[tuple[list[Scripted], list[str]]]:
    scripted = [Scripted() for _ in range(count)]
    async with trio.open_nursery() as nursery:
        urls = [await start_http(nursery, engine.app) for engine in scripted]
        yield scripted, urls
        nursery.cancel_scope.cancel()


BODY = {"prompt": "hello", "max_tokens": 2}


async def until(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (another task makes it so; bound it with a scope)."""
    while True:
        if condition():
            return
        await trio.sleep(0.01)


async def test_requests_go_to_the_engine_with_fewest_in_flight() -> None:
    with trio.fail_after(30):
        async with (
            engines(3) as ([prefill, slow, fast], urls),
            proxy_for(urls[:1], urls[1:]) as (
                _,
                proxy,
            ),
        ):
            slow.gate = trio.Event()  # (the slow engine answers when the test says so)
            url = f"{proxy}/v1/completions"
            async with http_client(10) as client, trio.open_nursery() as nursery:

                async def proxy_in_flight() -> float:
                    page = metrics((await client.get(f"{proxy}/metrics")).text)
                    return page["trio_pd_proxy_requests_in_flight"]

                # Requests one at a time until the slow engine holds one (equal
                # engines take turns: the first or the second goes there) ...
                for sent in itertools.count(1):
                    nursery.start_soon(functools.partial(client.post, url, json=BODY))
                    await until(lambda sent=sent: len(slow.seen) + len(fast.seen) == sent)
                    if slow.seen:
                        break
                    while await proxy_in_flight():  # noqa: ASYNC110 -- another task's count
                        await trio.sleep(0.01)
                # ... then, while it keeps it, every request goes to the fast one.
                for _ in range(15):
                    while await proxy_in_flight() > 1:  # noqa: ASYNC110 -- (the last answer
                        await trio.sleep(0.01)  # reaches us before the proxy stops counting it)
                    response = await client.post(url, json=BODY)
                    assert response.status_code == 200
                assert (len(slow.seen), slow.in_flight) == (1, 1)
                slow.gate.set()
            assert len(fast.seen) >= 15
            assert len(prefill.seen) == len(slow.seen) + len(fast.seen)


async def test_a_request_id_is_passed_on_returned_and_minted_when_missing() -> None:
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:]) as (
                _,
                proxy,
            ),
        ):
            async with http_client(10) as client:
                url = f"{proxy}/v1/completions"
                response = await client.post(url, json=BODY, headers={"X-Request-Id": "abc-123"})
                assert response.headers["x-request-id"] == "abc-123"
                for bad in ("", "with space", "x" * 200):
                    response = await client.post(url, json=BODY, headers={"X-Request-Id": bad})
                    minted = response.headers["x-request-id"]
                    assert len(minted) == 32
                    assert int(minted, 16) >= 0
                response = await client.post(url, json={"prompt": ""})  # errors carry it too
                assert response.status_code == 400
                assert len(response.headers["x-request-id"]) == 32
            assert prefill.request_ids[0] == decode.request_ids[0] == "abc-123"
            assert prefill.request_ids[1:] == decode.request_ids[1:]
            assert len(set(prefill.request_ids)) == 4


async def test_a_clients_own_kv_transfer_params_never_reach_an_engine() -> None:
    # (docs/security.md: replayed parameters are stopped by keeping them from
    # clients; the proxy sends each engine only what it made itself)
    replayed = {**KV, "remote_request_id": "someone-elses", "do_remote_prefill": True}
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
            http_client(10) as client,
        ):
            for route, body in (
                ("completions", {**BODY, "kv_transfer_params": replayed}),
                (
                    "chat/completions",
                    {
                        "messages": [{"role": "user", "content": "hi"}],
                        "kv_transfer_params": replayed,
                    },
                ),
            ):
                response = await client.post(f"{proxy}/v1/{route}", json=body)
                assert response.status_code == 200, response.text
            assert [b["kv_transfer_params"] for b in prefill.seen] == [
                {"do_remote_decode": True}
            ] * 2
            assert [b["kv_transfer_params"] for b in decode.seen] == [KV] * 2


def test_phase_times_and_server_timing_values() -> None:
    now = [0.0]
    times = PhaseTimes(clock=lambda: now[0])
    with times.phase("prefill"):
        now[0] += 0.0025

    def failing() -> None:
        with times.phase("decode"):  # (timed however it ends)
            now[0] += 0.001
            raise RuntimeError

    with pytest.raises(RuntimeError):
        failing()
    with times.phase("prefill"):  # (a retry adds to the phase)
        now[0] += 0.0005
    times.relay("decode.", "pull;dur=1.25, hold;desc=x, junk, ;dur=1, cpu;dur=-1, a b;dur=2")
    times.relay("decode.", None)
    assert times.as_dict() == pytest.approx({"prefill": 3.0, "decode": 1.0, "decode.pull": 1.25})
    assert times.header() == (
        b"server-timing",
        b"prefill;dur=3.000, decode;dur=1.000, decode.pull;dur=1.250",
    )
    assert parse(times.header()[1].decode()) == times.as_dict()
    assert parse("") == {}


async def test_the_answer_says_where_the_time_went_engines_phases_relayed() -> None:
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
            http_client(10) as client,
        ):
            prefill.server_timing = "forward;dur=2.5, expose;dur=0.5"
            decode.server_timing = "pull;dur=1.25, something odd"
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200
            timing = parse(response.headers["server-timing"])
            phases = ["prefill", "prefill.forward", "prefill.expose", "decode", "decode.pull"]
            assert list(timing) == phases
            assert (timing["prefill.forward"], timing["prefill.expose"]) == (2.5, 0.5)
            assert timing["decode.pull"] == 1.25
            assert min(timing["prefill"], timing["decode"]) >= 0
            # Engines that say nothing: the proxy's own phases alone.
            prefill.server_timing = decode.server_timing = ""
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert list(parse(response.headers["server-timing"])) == ["prefill", "decode"]


async def test_an_engine_that_refuses_is_passed_over_and_counted() -> None:
    with trio.fail_after(30):
        refusing = closed_port_url()
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for([refusing, urls[0]], [refusing, urls[1]]) as (_, proxy),
            http_client(10) as client,
        ):
            for _ in range(4):
                response = await client.post(f"{proxy}/v1/completions", json=BODY)
                assert response.status_code == 200, response.text
            assert (len(prefill.seen), len(decode.seen)) == (4, 4)
            while True:  # (each request is counted as its handler ends, just after it answered)
                counted = metrics((await client.get(f"{proxy}/metrics")).text)
                if counted.get("trio_pd_proxy_requests_total{outcome=ok}") == 4:
                    break
                await trio.sleep(0.01)
            refused = "trio_pd_proxy_engine_errors_total{engine=%s,kind=refused,role=%s}"
            assert counted[refused % (refusing, "prefill")] >= 1
            assert counted[refused % (refusing, "decode")] >= 1
            assert counted["trio_pd_proxy_requests_total{outcome=ok}"] == 4
            assert counted["trio_pd_proxy_request_seconds_count"] == 4
            assert counted["trio_pd_proxy_time_to_first_byte_seconds_count"] == 4
            assert counted["trio_pd_proxy_requests_in_flight"] == 0


async def test_a_slow_engine_is_a_504_naming_the_phase_and_is_not_retried() -> None:
    timeouts = ProxyTimeouts(prefill=0.3, first_byte=0.3, idle=0.3)
    with trio.fail_after(30):
        async with (
            engines(3) as ([slow, other, decode], urls),
            proxy_for(urls[:2], urls[2:], timeouts) as (_, proxy),
            http_client(10) as client,
        ):
            slow.delay = other.delay = 1.0
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 504
            error = response.json()["error"]
            assert error["message"].endswith("no answer within 0.3 s")
            # Sent once: the work may have been done; not passed to the other.
            assert len(slow.seen) + len(other.seen) == 1
            slow.delay = other.delay = 0.0
            decode.delay = 1.0
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 504
            assert "not even the first byte" in response.json()["error"]["message"]
            assert len(decode.seen) == 1
            # A busy engine is not marked down: the next request still goes there.
            decode.delay = 0.0
            assert (await client.post(f"{proxy}/v1/completions", json=BODY)).status_code == 200


async def test_each_phase_has_its_own_deadline_not_the_gap_between_chunks() -> None:
    # A prefill or a decode slower than the idle gap but within its phase's
    # deadline is served (the client's read timeout used to cut it at idle).
    timeouts = ProxyTimeouts(prefill=2.0, first_byte=2.0, idle=0.2)
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], timeouts) as (_, proxy),
            http_client(10) as client,
        ):
            prefill.delay = decode.delay = 0.6
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text


async def test_503s_are_503s_a_prefill_503_is_tried_elsewhere_a_decode_503_is_not() -> None:
    with trio.fail_after(30):
        async with (
            engines(4) as ([draining, prefill, full, decode], urls),
            proxy_for(urls[:2], urls[2:]) as (_, proxy),
            http_client(10) as client,
        ):
            draining.status = 503
            full.status = 503
            statuses = []
            for _ in range(6):
                response = await client.post(f"{proxy}/v1/completions", json=BODY)
                statuses.append(response.status_code)
                if response.status_code == 503:
                    assert response.headers["retry-after"] == "1"
                    assert json.loads(response.text)["error"]["engine"] == urls[2]
            assert len(prefill.seen) == 6  # every prefill 503 was tried elsewhere
            assert len(full.seen) + len(decode.seen) == 6  # decode: once each
            assert 200 in statuses
            assert 503 in statuses
            assert 502 not in statuses


async def test_health_and_engine_sets_that_change() -> None:
    with trio.fail_after(30):
        async with (
            engines(2) as (_, urls),
            proxy_for([], []) as (router, proxy),
            http_client(10) as client,
        ):
            health = await client.get(f"{proxy}/health")
            assert health.status_code == 503
            assert health.json()["status"] == "no engines"
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 503
            router.set_engines("prefill", urls[:1])
            router.set_engines("decode", urls[1:])
            assert (await client.get(f"{proxy}/health")).status_code == 200
            assert (await client.post(f"{proxy}/v1/completions", json=BODY)).status_code == 200
            wrong = await client.get(f"{proxy}/v1/completions")
            assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
            assert (await client.get(f"{proxy}/nothing")).status_code == 404


async def test_the_proxy_follows_engines_registered_on_etcd_and_outlives_etcd() -> None:
    from trio_pd._membership import Member, register
    from trio_pd._serve.discovery import EtcdMembership
    from trio_pd.testing import open_etcd

    with trio.fail_after(20):
        async with (
            open_etcd() as etcd,
            engines(3) as ([prefill, decode, late], urls),
            proxy_for([], []) as (router, proxy),
            http_client(10) as client,
        ):

            def member(role: str, url: str) -> Member:
                return Member(role, f"{role}-{url.rsplit(':', 1)[1]}", url, "127.0.0.1:1")

            async with (
                register(etcd.url, member("prefill", urls[0]), ttl=2.0),
                register(etcd.url, member("decode", urls[1]), ttl=2.0),
                trio.open_nursery() as nursery,
            ):
                router.follow(
                    await nursery.start(EtcdMembership(etcd.url).watch_engines, router.follow)
                )
                await until(lambda: bool(router.engines("prefill") and router.engines("decode")))
                assert (await client.post(f"{proxy}/v1/completions", json=BODY)).is_success
                # A decode engine that registers later is used without a restart.
                async with register(etcd.url, member("decode", urls[2]), ttl=2.0):
                    await until(lambda: len(router.engines("decode")) == 2)
                    for _ in range(6):
                        response = await client.post(f"{proxy}/v1/completions", json=BODY)
                        assert response.is_success
                    assert late.seen
                # etcd goes away: the proxy keeps its last view and says so.
                await etcd.kill()
                await until(lambda: router.membership_problem is not None)
                health = await client.get(f"{proxy}/health")
                assert health.status_code == 200
                assert "etcd unreachable" in health.json()["membership"]
                assert (await client.post(f"{proxy}/v1/completions", json=BODY)).is_success
                await etcd.start()
                await until(lambda: router.membership_problem is None)
                assert "membership" not in (await client.get(f"{proxy}/health")).json()
                nursery.cancel_scope.cancel()
            assert prefill.seen
            assert decode.seen


# ---- only its own bytes (issue 28) --------------------------------------------------
#
# A decode engine whose pull finds the prefill's exposure over answers 409
# ``exposure_ended`` (tests/test_error_statuses.py: the engine's row); the
# scripted engines here stand in for it, which is the seam: the proxy's
# contract is that answer.


@contextmanager
def unanswered_url() -> Iterator[str]:
    """A URL whose connections are never made (a partitioned host, as TCP sees
    it): a listener whose backlog is full and never accepted, so the kernel
    drops further SYNs and a connect waits until its own timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        fillers: list[socket.socket] = []
        try:
            while True:  # (until a connect is not made: the backlog is full)
                probe = socket.socket()
                probe.settimeout(0.2)
                fillers.append(probe)
                try:
                    probe.connect(address)
                except TimeoutError:
                    break
            yield f"http://127.0.0.1:{address[1]}"
        finally:
            for filler in fillers:
                filler.close()


def sample(proxy: Proxy, name: str, **labels: str) -> float:
    return proxy.metrics.registry.get_sample_value(name, labels) or 0.0


ENDED = (409, "exposure_ended")


async def test_an_exposure_ended_answer_is_prefilled_again_once_then_decoded() -> None:
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (router, proxy),
            http_client(10) as client,
        ):
            decode.answers = [ENDED]
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert (len(prefill.seen), len(decode.seen)) == (2, 2)
            assert sample(router, "trio_pd_proxy_reprefills_total", reason="exposure_ended") == 1


async def test_a_decode_engine_that_keeps_answering_exposure_ended_gets_one_reprefill() -> None:
    # (a hostile or broken decode engine cannot make the proxy loop)
    with trio.fail_after(30):
        async with (
            engines(3) as ([prefill, decode, other], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (router, proxy),
            http_client(10) as client,
        ):
            decode.status = other.status = 409
            decode.answers = other.answers = [ENDED] * 10
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert (error["code"], error["type"]) == ("exposure_ended", "decode_failed")
            assert "scripted 409" in error["message"]
            # Two prefills, two decodes: the exposure is gone for every decode
            # engine, so the other one is never tried with it.
            assert len(prefill.seen) == 2
            assert len(decode.seen) + len(other.seen) == 2
            assert sample(router, "trio_pd_proxy_reprefills_total", reason="exposure_ended") == 1
            errors = "trio_pd_proxy_engine_errors_total"
            counted = sum(
                sample(router, errors, role="decode", engine=url, kind="exposure_ended")
                for url in urls[1:]
            )
            assert counted == 1


async def test_no_decode_starts_after_the_exposures_lease_could_have_run_out() -> None:
    # Issue 28, finding 2: the first decode engine never answers the
    # connection, and the connect timeout (5 s) is longer than the exposure's
    # lease (2 s): the proxy used to wait it out, then decode on the next
    # engine with an expired exposure -- whose blocks another request's
    # prefill may have taken. Now the connection is cut to what the lease
    # leaves (minus the hold margin), and the request is prefilled again.
    timeouts = ProxyTimeouts(connect=5.0)
    with trio.fail_after(30), unanswered_url() as partitioned:
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], [partitioned, urls[1]], timeouts) as (router, proxy),
            http_client(10) as client,
        ):
            prefill.kv = {**KV, "remote_lease_initial": 2.0}  # (the hold margin: 1 s)
            started = trio.current_time()
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert trio.current_time() - started < timeouts.connect
            assert len(prefill.seen) == 2
            assert len(decode.seen) == 1
            # The decode started within the second exposure's lease, less the margin
            # (arrival times are the engines'; the answer left the prefill just before).
            assert decode.arrived[0] - prefill.arrived[1] < 2.0 - HOLD_MARGIN
            assert sample(router, "trio_pd_proxy_reprefills_total", reason="lease") == 1
            refused = "trio_pd_proxy_engine_errors_total"
            labels = {"role": "decode", "engine": partitioned, "kind": "refused"}
            assert sample(router, refused, **labels) == 1


async def test_a_lease_too_short_for_any_decode_is_one_reprefill_then_an_answer() -> None:
    # Every decode engine partitioned: one more prefill (its lease may be
    # enough for the next engine), then the refusal -- never a loop.
    timeouts = ProxyTimeouts(connect=5.0)
    with trio.fail_after(30), unanswered_url() as one, unanswered_url() as two:
        async with (
            engines(1) as ([prefill], urls),
            proxy_for(urls, [one, two], timeouts) as (router, proxy),
            http_client(10) as client,
        ):
            prefill.kv = {**KV, "remote_lease_initial": 1.6}
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["type"] == "decode_failed"
            assert error["engine"] in (one, two)
            assert len(prefill.seen) == 2
            assert sample(router, "trio_pd_proxy_reprefills_total", reason="lease") == 1
        # One decode engine, and it is partitioned: no other engine would read
        # a second prefill's exposure, so none is made.
        async with (
            engines(1) as ([prefill], urls),
            proxy_for(urls, [one], timeouts) as (router, proxy),
            http_client(10) as client,
        ):
            prefill.kv = {**KV, "remote_lease_initial": 1.6}
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 502, response.text
            assert len(prefill.seen) == 1


@pytest.mark.parametrize("lease", ["7", -1.0, 0, True, None, [5], {}, 1e300], ids=repr)
async def test_a_prefill_answers_lease_that_is_not_a_duration_is_the_default(lease: Any) -> None:
    # (the prefill engine's answer is trusted, but never crashes the proxy:
    # what is not a positive finite number of seconds reads as the default)
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, _], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
            http_client(10) as client,
        ):
            prefill.kv = {**KV, "remote_lease_initial": lease}
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert len(prefill.seen) == 1


async def test_a_clients_own_kv_transfer_params_change_no_check() -> None:
    # Issue 28, finding 7: a client's {"do_remote_decode": true} made the
    # proxy skip min_tokens (not checked on a prefill); the decode engine then
    # refused the request after the prefill had exposed its blocks.
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
            http_client(10) as client,
        ):
            for own in (
                {"do_remote_decode": True},
                {"do_remote_decode": True, "do_remote_prefill": True},
                {"do_remote_prefill": True, "remote_block_ids": ["x"]},
                None,
            ):
                for route, body in (
                    ("completions", {**BODY, "min_tokens": 500}),
                    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2, "min_completion_tokens": 3}),
                ):  # fmt: skip
                    request = {**body, "kv_transfer_params": own}
                    response = await client.post(f"{proxy}/v1/{route}", json=request)
                    assert response.status_code == 400, (own, response.text)
                    assert response.json()["error"]["param"] in (
                        "min_tokens",
                        "min_completion_tokens",
                    )
            assert prefill.seen == []
            assert decode.seen == []
            # Malformed or hostile parameters of a client's own are not looked at
            # (the proxy sets them): the request is served as without them.
            for own in (5, "x", [1], {"remote_lease_initial": 1e300, "do_remote_decode": "yes"}):
                response = await client.post(
                    f"{proxy}/v1/completions", json={**BODY, "kv_transfer_params": own}
                )
                assert response.status_code == 200, (own, response.text)
            assert [b["kv_transfer_params"] for b in prefill.seen] == [
                {"do_remote_decode": True}
            ] * 4
            assert [b["kv_transfer_params"] for b in decode.seen] == [KV] * 4


def test_the_defaults_table_is_the_defaults_module() -> None:
    from pathlib import Path

    from trio_pd._serve import defaults
    from trio_pd._serve.engine import EngineSettings

    text = (Path(__file__).parent.parent / "docs" / "timeouts.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([\d.]+) \|", text, re.MULTILINE))
    names = [name for name in vars(defaults) if name.isupper()]
    assert sorted(rows) == sorted(names)
    for name in names:
        assert float(rows[name]) == getattr(defaults, name), name
    # The rule the table states holds for the defaults, and the commands use them.
    defaults.check_lease(defaults.LEASE_INITIAL, defaults.CONNECT_TIMEOUT, defaults.HOLD_MARGIN)
    defaults.check_admission(defaults.ADMISSION_TIMEOUT, defaults.ABORT_TIMEOUT)
    assert defaults.CONNECT_TIMEOUT + defaults.HOLD_MARGIN <= defaults.LEASE_INITIAL
    assert defaults.decode_attempts(5.0, 2.0, 1.0) == 2
    assert ProxyTimeouts().connect == defaults.CONNECT_TIMEOUT
    assert EngineSettings("e", 0).lease_initial == defaults.LEASE_INITIAL


# ---- what the proxy saw: /health, memory of failed engines (issue 30) ---------------


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
async def test_health_says_failing_when_every_engine_of_a_role_failed_its_last_request(
    dispatch: str,
) -> None:
    # Issue 30, fault 3: a role whose only engine refuses: every request a 5xx,
    # and /health said 200 ok.
    refusing = closed_port_url()
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], [refusing], dispatch=dispatch) as (router, proxy),
            http_client(10) as client,
        ):
            assert (await client.get(f"{proxy}/health")).status_code == 200  # (untried)
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 502, response.text
            health = await client.get(f"{proxy}/health")
            assert health.status_code == 503
            assert (health.json()["status"], health.json()["failing"]) == ("failing", ["decode"])
            # Within its backoff the engine is not tried, nor is any prefill made.
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            error = response.json()["error"]
            assert (error["type"], error["role"]) == ("unavailable", "decode")
            assert response.headers["x-request-id"]
            # (concurrent: the refused decode request cancelled the prefill, which
            # may not have reached its engine)
            assert len(prefill.seen) == 1 if dispatch == "sequential" else len(prefill.seen) <= 1
            assert sample(router, "trio_pd_proxy_requests_total", outcome="overloaded") == 1
            # The engine comes back (here: the set changes to a live one): healthy again.
            router.set_engines("decode", urls[1:])
            assert (await client.post(f"{proxy}/v1/completions", json=BODY)).status_code == 200
            assert (await client.get(f"{proxy}/health")).json()["status"] == "ok"
            assert len(decode.seen) == 1


async def test_an_exposure_secret_mismatch_is_a_deployment_fault_and_health_degraded() -> None:
    # Issue 30, fault 4: it was a 400 invalid_request_error naming
    # kv_transfer_params.remote_token (which the client never sent), counted
    # as client_error, /health ok.
    with trio.fail_after(30):
        async with (
            engines(2) as ([_, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (router, proxy),
            http_client(10) as client,
        ):
            decode.status, decode.param = 400, "kv_transfer_params.remote_token"
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            assert error["type"] == "deployment_error"
            assert (error["engine"], error["prefill_engine"]) == (urls[1], urls[0])
            health = await client.get(f"{proxy}/health")
            assert (health.status_code, health.json()["status"]) == (503, "degraded")
            [fault] = health.json()["faults"]
            assert (fault["prefill"], fault["decode"]) == (urls[0], urls[1])
            assert "remote_token" in fault["error"]
            labels = {"role": "decode", "engine": urls[1], "kind": "deployment"}
            assert sample(router, "trio_pd_proxy_engine_errors_total", **labels) == 1
            assert sample(router, "trio_pd_proxy_requests_total", outcome="client_error") == 0
            # Fixed (the engines agree again): the next request clears it.
            decode.status, decode.param = 200, None
            assert (await client.post(f"{proxy}/v1/completions", json=BODY)).status_code == 200
            assert (await client.get(f"{proxy}/health")).json()["status"] == "ok"


async def test_a_role_with_no_live_engine_is_a_503_naming_it_not_a_502_to_a_dead_url() -> None:
    from trio_pd._serve.discovery import EngineSet as Registered

    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, _], urls),
            proxy_for([], []) as (router, proxy),
            http_client(10) as client,
        ):
            router.follow(Registered((urls[0],), (urls[1],)))
            assert (await client.post(f"{proxy}/v1/completions", json=BODY)).status_code == 200
            # The decode engine's key is deleted (or its lease expired): none is left.
            router.follow(Registered((urls[0],), ()))
            assert router.engines("decode") == []
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["role"] == "decode"
            assert len(prefill.seen) == 1  # (no prefill for a request nobody can decode)
            health = await client.get(f"{proxy}/health")
            assert health.status_code == 503
            assert (health.json()["status"], health.json()["missing"]) == ("no engines", ["decode"])
            # While etcd itself is unreachable, the last view stays.
            router.follow(Registered((urls[0],), (urls[1],)))
            router.follow(Registered((), (), "etcd unreachable (x): routing by the last view"))
            assert (router.engines("prefill"), router.engines("decode")) == ([urls[0]], [urls[1]])
            assert (await client.get(f"{proxy}/health")).status_code == 200


async def test_a_request_tries_at_most_max_attempts_engines_and_remembers_refusals() -> None:
    # Issue 30, fault 2: with many refusing members each request tried them all.
    with trio.fail_after(30):
        first = free_port_range(40)
        refusing = [f"http://127.0.0.1:{first + i}" for i in range(40)]
        async with (
            engines(2) as ([_prefill, decode], urls),
            proxy_for([*refusing, urls[0]], urls[1:]) as (router, proxy),
            http_client(10) as client,
        ):
            refused = 0.0
            statuses = []
            for _ in range(20):
                response = await client.post(f"{proxy}/v1/completions", json=BODY)
                statuses.append(response.status_code)
                assert response.status_code in (200, 502, 503), response.text
                now = sum(
                    sample(router, "trio_pd_proxy_engine_errors_total", role="prefill",
                           engine=url, kind="refused")
                    for url in refusing
                )  # fmt: skip
                assert now - refused <= 3  # (--max-attempts)
                refused = now
            assert 200 in statuses
            assert refused <= len(refusing)  # (each at most once: within its backoff)
            assert len(decode.seen) == statuses.count(200)


async def test_black_holed_decode_candidates_cost_one_connect_timeout_not_one_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trio_pd._serve import routing

    monkeypatch.setattr(routing, "BACKOFF_FIRST", 60.0)  # (the test's requests fit in it)
    timeouts = ProxyTimeouts(connect=0.5)
    with trio.fail_after(30), unanswered_url() as a, unanswered_url() as b, unanswered_url() as c:
        async with (
            engines(2) as ([_prefill, decode], urls),
            proxy_for(urls[:1], [urls[1], a, b, c], timeouts) as (router, proxy),
            http_client(10) as client,
        ):
            started = trio.current_time()
            statuses = [
                (await client.post(f"{proxy}/v1/completions", json=BODY)).status_code
                for _ in range(10)
            ]
            took = trio.current_time() - started
            for url in (a, b, c):
                labels = {"role": "decode", "engine": url, "kind": "refused"}
                assert sample(router, "trio_pd_proxy_engine_errors_total", **labels) == 1
            # 3 connect timeouts in all (once each), then only the live engine:
            # each of the 10 requests used to pay them again after DOWN_FOR.
            assert took < 3 * timeouts.connect + 3.0
            assert statuses.count(200) >= 9  # (one request may meet all three first)
            assert len(decode.seen) == statuses.count(200)


async def test_v1_models_through_the_proxy_with_the_openai_client() -> None:
    # Issue 30, fault 5: the proxy answered 404, so models.list() failed through it.
    import openai

    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, _decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
        ):
            prefill.max_model_len = 2048  # (the deployment holds what every engine holds)

            def listed() -> tuple[list[Any], Any]:
                client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="unused", max_retries=0)
                with client:
                    return list(client.models.list()), client.models.retrieve("tiny")

            models, tiny = await trio.to_thread.run_sync(listed)
            assert [m.id for m in models] == ["tiny"]
            assert tiny.id == "tiny"
            assert tiny.model_extra == {"max_model_len": 2048}
            async with http_client(10) as client:
                missing = await client.get(f"{proxy}/v1/models/other")
                assert missing.status_code == 404
                assert missing.json()["error"]["code"] == "model_not_found"
                assert missing.headers["x-request-id"]
                wrong = await client.post(f"{proxy}/v1/models")
                assert (wrong.status_code, wrong.headers["allow"]) == (405, "GET")
        # No engine that answers: a JSON 503, not a 404.
        async with (
            proxy_for([closed_port_url()], [closed_port_url()]) as (_, proxy),
            http_client(10) as client,
        ):
            response = await client.get(f"{proxy}/v1/models")
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "unavailable"


async def test_clients_that_trickle_their_bodies_are_cut_off_and_capped_per_address() -> None:
    # Issue 30, fault 6: a body trickled byte by byte held its connection
    # forever; 300 of them starved the proxy of file descriptors.
    async def trickle(url: str, answers: list[bytes]) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000\r\n\r\n{"
            )
            answer = b""
            with trio.move_on_after(5):  # (a byte every 0.1 s: forever, for the old proxy)
                while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                    with trio.move_on_after(0.1):
                        data = await stream.receive_some()
                        if not data:
                            break
                        answer += data
                    if not answer:
                        await stream.send_all(b" ")
            answers.append(answer)

    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, _], urls),
            proxy_for(urls[:1], urls[1:], body_timeout=0.5, max_client_requests=4) as (_, proxy),
            http_client(10) as client,
        ):
            answers: list[bytes] = []
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(trickle, proxy, answers)
                await trio.sleep(0.2)
                # Meanwhile /health answers, and so does a whole request once a slot frees.
                assert (await client.get(f"{proxy}/health")).status_code == 200
            took = trio.current_time() - started
            statuses = sorted(int(a.split(b" ", 2)[1]) for a in answers)
            assert statuses == [408] * 4 + [429] * 6, answers
            assert took < 3.0
            for answer in answers:
                head, body = answer.split(b"\r\n\r\n", 1)
                assert b"x-request-id" in head.lower()
                assert json.loads(body)["error"]["message"]
            assert prefill.seen == []
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text


def test_the_engine_sets_memory_backoff_attempts_and_health_on_its_own_clock() -> None:
    from trio_pd._serve.routing import BACKOFF_CAP, FAILED_FOR, EngineSet

    engines = EngineSet(["a", "b", "c"])
    assert len(engines.candidates(0.0, limit=2)) == 2
    backoffs = [engines.refused("a", 0.0) for _ in range(8)]
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 16.0, BACKOFF_CAP, BACKOFF_CAP, BACKOFF_CAP]
    assert "a" not in engines.candidates(29.0)
    assert "a" in engines.candidates(30.0)
    engines.answered("a")  # (an answer resets it)
    assert engines.refused("a", 0.0) == 1.0
    for engine in ("b", "c"):
        engines.refused(engine, 0.0)
    assert engines.candidates(0.5) == []
    assert engines.retry_in(0.5) == 0.5
    # Health: failing while every engine's failure is remembered, not after.
    assert engines.failing(0.5)
    assert not engines.failing(1.0)  # (their backoffs ended: untried again)
    for engine in ("a", "b", "c"):
        engines.failed(engine, 10.0)
    assert engines.failing(10.0 + FAILED_FOR - 0.1)
    assert not engines.failing(10.0 + FAILED_FOR)
    engines.failed("a", 20.0)
    assert not engines.failing(20.0)  # (b and c: no recent failure)
    # Engines that leave are forgotten; an empty role is never "failing".
    engines.update([])
    assert not engines.failing(20.0)
    assert engines.candidates(20.0) == []


# ---- concurrent dispatch (issue 33) -------------------------------------------------


async def test_concurrent_dispatch_sends_the_decode_request_while_the_prefill_runs() -> None:
    # The decode request's first line (the request, no parameters) reaches its
    # engine while the prefill is still running; the parameters follow as the
    # second line once the prefill answered, and the answer is relayed as before.
    gate = trio.Event()
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (router, proxy),
            http_client(10) as client,
            trio.open_nursery() as nursery,
        ):
            prefill.gate = gate
            answers: list[httpx2.Response] = []

            async def ask() -> None:
                answers.append(await client.post(f"{proxy}/v1/completions", json=BODY))

            nursery.start_soon(ask)
            await until(lambda: bool(decode.first_lines))
            assert prefill.in_flight == 1  # (the prefill has not answered)
            assert decode.seen == []  # (nor has the decode request its parameters)
            gate.set()
            await until(lambda: bool(answers))
            assert answers[0].status_code == 200, answers[0].text
            assert decode.seen == [{**BODY, "kv_transfer_params": KV}]
            assert decode.first_lines[0] < decode.arrived[0]
            # (what the engine may wait for its parameters: every prefill attempt's
            # connect and prefill timeouts, and a second)
            timeouts = ProxyTimeouts()
            assert decode.params_within == [3 * (timeouts.connect + timeouts.prefill) + 1]
            assert sample(router, "trio_pd_proxy_requests_total", outcome="ok") == 1


@pytest.mark.parametrize(
    ("status", "delay", "answered", "words"),
    [
        (500, 0.0, 502, "prefill engine"),
        (400, 0.0, 400, "scripted 400"),
        (200, 1.0, 504, "no answer within 0.3 s"),
    ],
)
async def test_a_prefill_that_fails_ends_the_concurrent_decode_request_at_once(
    status: int, delay: float, answered: int, words: str
) -> None:
    # The decode request went out with the prefill: when the prefill fails
    # (an error answer, or no answer in time) the client gets the prefill's
    # error, naming the request and the engine, and the decode request is
    # closed -- its engine sees it end before any parameters, and frees it.
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], ProxyTimeouts(prefill=0.3), dispatch="concurrent") as (
                _,
                proxy,
            ),
            http_client(10) as client,
        ):
            prefill.status, prefill.delay = status, delay
            headers = {"x-request-id": "failed-prefill-1"}
            response = await client.post(f"{proxy}/v1/completions", json=BODY, headers=headers)
            assert response.status_code == answered, response.text
            assert response.headers["x-request-id"] == "failed-prefill-1"
            error = response.json()["error"]
            assert words in error["message"]
            assert error["engine"] == urls[0]
            with trio.fail_after(5):
                await until(lambda: decode.cancelled == 1)
            assert decode.seen == []
            assert len(decode.first_lines) == 1
            # The proxy goes on: the next request is served.
            prefill.status, prefill.delay = 200, 0.0
            response = await client.post(f"{proxy}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text


async def test_a_decode_engine_that_refuses_while_the_prefill_runs_is_passed_over() -> None:
    # A refused connection, found while the prefill still runs: the next decode
    # engine gets the request, and the prefill is made once.
    gate = trio.Event()
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], [closed_port_url(), urls[1]], dispatch="concurrent") as (
                router,
                proxy,
            ),
            http_client(10) as client,
            trio.open_nursery() as nursery,
        ):
            prefill.gate = gate
            answers: list[httpx2.Response] = []
            for _ in range(2):  # (the refusing engine comes first in one of them)

                async def ask() -> None:
                    answers.append(await client.post(f"{proxy}/v1/completions", json=BODY))

                nursery.start_soon(ask)
            await until(lambda: len(decode.first_lines) == 2)
            assert prefill.in_flight == 2
            gate.set()
            await until(lambda: len(answers) == 2)
            assert [a.status_code for a in answers] == [200, 200]
            assert (len(prefill.seen), len(decode.seen)) == (2, 2)
            refused = {"role": "decode", "engine": router.engines("decode")[0], "kind": "refused"}
            assert sample(router, "trio_pd_proxy_engine_errors_total", **refused) == 1


async def test_a_client_cannot_send_the_second_line_itself() -> None:
    # The second line is the proxy's: a client's two-line body is not JSON (a
    # 400 before any engine works), a client's own X-Trio-PD-Params-Within is
    # not passed on, and a client's kv_transfer_params never reach an engine
    # (test_a_clients_own_kv_transfer_params_never_reach_an_engine).
    two_lines = json.dumps(BODY) + "\n" + json.dumps({"kv_transfer_params": KV}) + "\n"
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
            http_client(10) as client,
        ):
            header = {"x-trio-pd-params-within": "0.001"}
            for content in (two_lines, two_lines.encode().replace(b"\n", b"\r\n")):
                response = await client.post(
                    f"{proxy}/v1/completions", content=content, headers=header
                )
                assert response.status_code == 400, response.text
                assert "not JSON" in response.json()["error"]["message"]
            assert prefill.seen == decode.seen == []
            # A body whose strings hold newlines: they stay inside line 1.
            body = {**BODY, "prompt": 'one\ntwo\n{"kv_transfer_params": {}}\n', "user": "\u2028"}
            response = await client.post(f"{proxy}/v1/completions", json=body, headers=header)
            assert response.status_code == 200, response.text
            assert decode.seen == [{**body, "kv_transfer_params": KV}]
            assert decode.params_within[0] > 1


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e999"])
async def test_a_body_with_a_number_json_has_not_is_a_400_before_any_engine(
    dispatch: str, number: str
) -> None:
    # Python's parser takes NaN and Infinity (and 1e999 as inf); the proxy's
    # client cannot send them on (JSON has no such number): that was a 500
    # "internal error". It is the client's request that is wrong.
    content = '{"prompt": "hello", "max_tokens": 2, "metadata": {"x": [NUMBER]}}'.replace(
        "NUMBER", number
    )
    with trio.fail_after(30):
        async with (
            engines(2) as ([prefill, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch=dispatch) as (router, proxy),
            http_client(10) as client,
        ):
            response = await client.post(f"{proxy}/v1/completions", content=content)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert "not JSON" in error["message"]
            assert "finite" in error["message"]
            assert prefill.seen == decode.seen == decode.first_lines == []
            assert sample(router, "trio_pd_proxy_requests_total", outcome="client_error") == 1


async def test_a_body_under_the_limit_stays_under_it_on_its_way_to_the_decode_engine() -> None:
    # 700 KB of "é" (2 bytes each in UTF-8) in a field the engines ignore: the
    # body is under the 1 MiB limit, and the prefill request carries it so.
    # The decode request's first line escaped every non-ASCII character (6
    # bytes each): 2.1 MB, which the decode engine refused (413, naming the
    # client's body as too large) after its prefill had been made.
    body = {**BODY, "user": "\u00e9" * 350_000}
    content = json.dumps(body, ensure_ascii=False).encode()
    assert len(content) < 1 << 20
    with trio.fail_after(30):
        async with (
            engines(2) as ([_, decode], urls),
            proxy_for(urls[:1], urls[1:], dispatch="concurrent") as (_, proxy),
            http_client(10) as client,
        ):
            response = await client.post(f"{proxy}/v1/completions", content=content)
            assert response.status_code == 200, response.text
            assert decode.seen == [{**body, "kv_transfer_params": KV}]


async def test_lines_that_come_a_few_bytes_at_a_time_are_read_whole() -> None:
    # A slow sender's lines arrive in pieces (a newline at a piece's start or
    # end, a piece with the end of one line and the start of the next), with
    # reads cancelled and resumed between them: no byte is lost.
    body = {**BODY, "user": "u" * 1000}
    data = json.dumps(body).encode() + b"\n" + json.dumps({"kv_transfer_params": KV}).encode()
    data += b"\n"
    for size in (1, 2, 3, 7):
        pieces = [data[i : i + size] for i in range(0, len(data), size)]

        async def receive(pieces: list[bytes] = pieces) -> dict[str, Any]:
            await trio.sleep(0.0001 if len(pieces) % 50 == 0 else 0)
            piece = pieces.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

        with trio.fail_after(30):
            second = SecondLine(receive, 30)
            assert await second.first() == body
            while second.value is None:
                with trio.move_on_after(0.0005):  # (cancelled mid-line, then resumed)
                    await second.params()
            assert second.value == KV


async def test_clients_close_idle_connections_before_the_engines_do() -> None:
    """A request sent on a connection that the server is closing fails with
    "Server disconnected without sending a response" (a full benchmark run
    saw it on decode requests after an idle spell: the proxy's client and
    hypercorn both kept idle connections 5 s). The clients now let go first.
    (The pool's expiry is httpx2's private attribute: checked where it is set.)"""
    from trio_pd._serve import defaults
    from trio_pd._serve.prefilling import open_prefiller

    assert defaults.CLIENT_KEEP_ALIVE < defaults.SERVER_KEEP_ALIVE
    async with (
        open_client() as client,
        open_prefiller(["http://p:1"], prefill_timeout=1, internal_key=None, caller="c") as p,
    ):
        for pool in (client._transport._pool, p._client._transport._pool):  # type: ignore[attr-defined]
            assert pool._keepalive_expiry == defaults.CLIENT_KEEP_ALIVE


def test_the_tests_clients_let_go_of_idle_connections_first_too() -> None:
    """The tests' own clients of real servers are made by ``http_client``, which
    keeps idle connections less long than the servers: a test that waits out a
    5 s lease and then sends a request would otherwise race the server's close."""
    from pathlib import Path

    made = re.compile(r"httpx2\.AsyncClient\((?!transport=)")  # (mocked transports aside)
    tests = Path(__file__).parent
    makers = {path.name for path in tests.glob("*.py") if made.search(path.read_text())}
    assert makers == {"http_clients.py"}


async def test_the_parameters_are_read_once_the_body_ended() -> None:
    """Line 2 is taken once the body's end came too, so that no answer can
    end while the request is still arriving: a server that closes such a
    connection has it reset, and the proxy lost the end of a stream (seen
    in a full run once the decode engine's answer could end within a
    millisecond of line 2). A third line in a later part of the body is a 400."""
    lines = json.dumps(BODY).encode() + b"\n" + json.dumps({"kv_transfer_params": KV}).encode()
    for rest, refused in ((b"", False), (b"{}\n", True)):
        send, parts = trio.open_memory_channel[dict[str, Any]](3)
        second = SecondLine(parts.receive, 30)
        got: list[object] = []

        async def read(second: SecondLine = second, got: list[object] = got) -> None:
            try:
                got.append(await second.params())
            except HTTPError as exc:
                got.append(exc)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await send.send({"type": "http.request", "body": lines + b"\n", "more_body": True})
                assert await second.first() == BODY
                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                assert got == []  # (line 2 is whole: the body has not ended)
                await send.send({"type": "http.request", "body": rest, "more_body": False})
        if refused:
            [error] = got
            assert isinstance(error, HTTPError)
            assert "more than two lines" in str(error)
        else:
            assert got == [KV]


@pytest.mark.parametrize("prefill", [math.inf, 1200.0])
async def test_prefill_attempts_longer_than_a_decode_engine_waits_are_refused_at_start(
    prefill: float,
) -> None:
    # A concurrent decode request waits for its second line at most
    # MOST_PARAMS_WITHIN (an hour); the header offers the prefill's attempts.
    # With --prefill-timeout inf the header said "inf" (every request a 400
    # from its decode engine, after its prefill); past an hour the engine gave
    # up (408) while the prefill still ran. Now such a proxy does not start.
    timeouts = ProxyTimeouts(prefill=prefill)
    options = ProxyOptions(timeouts=timeouts, dispatch="concurrent")
    async with open_client(timeouts) as client:
        with pytest.raises(ValueError, match="--prefill-timeout"):
            Proxy(["http://p"], ["http://d"], client, timeouts=timeouts, dispatch="concurrent")
        with pytest.raises(ValueError, match="--prefill-timeout"):
            options.check()
        Proxy(["http://p"], ["http://d"], client, timeouts=timeouts, dispatch="sequential")
        attrs.evolve(options, dispatch="sequential").check()
