"""A cluster on one machine: engines on test hosts (network namespaces joined
by veth links, routed to each other through the root namespace), an etcd and
the proxy in the root namespace, every engine found through etcd.

Root only (test hosts). What crosses hosts here crosses a real link: the
proxy's HTTP to each engine, each engine's etcd lease, and the decode
engine's side channel and NIXL READs to the prefill engine on another host.
"""

from __future__ import annotations

import inspect
import itertools
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx2
import pytest
import trio

from trio_pd.testing import TestHost, open_etcd, open_test_hosts

from .http_clients import http_client
from .test_commands import ENV, INTERNAL_KEY, SECRET, running
from .test_openai import chat
from .test_serve import complete, deployment_client, open_deployment, prompts, scrape, stream

pytestmark = [
    pytest.mark.slow,
    pytest.mark.test_hosts,
    pytest.mark.skipif(os.geteuid() != 0, reason="test hosts need root"),
]

TTL = 2.0  # each engine's etcd lease, in seconds
PREFILLS = "trio_pd_serve_requests_total"
STREAM_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


async def test_serve_hosts_serves_across_hosts_what_one_engine_serves(tmp_path: Path) -> None:
    """``trio-pd serve --hosts 2``: prefill on one test host, decode on the other;
    greedy output through the proxy equals the decode engine's own, for 16
    prompts, completions and chat, streaming and not."""
    with trio.fail_after(240):
        async with (
            open_deployment(tmp_path, "--hosts", "2") as serving,
            deployment_client(60) as client,
        ):
            proxy, [prefill], [decode] = serving["proxy"], serving["prefill"], serving["decode"]
            assert prefill.startswith("http://198.18.0.2:")  # (engine k on host k mod 2)
            assert decode.startswith("http://198.18.1.2:")
            # (test_serve checks all 50 prompts on one host; across hosts, the
            # edge cases -- one byte, block boundaries, non-ASCII -- and 8 more)
            cases = prompts()[:16]
            mismatches: list[str] = []
            clients = trio.CapacityLimiter(8)

            async def one(i: int, prompt: str) -> None:
                body = {"prompt": prompt, "max_tokens": 1 + (i * 7) % 16, "temperature": 0}
                messages = {"messages": [{"role": "user", "content": prompt}]}
                chat_body = {**messages, "max_tokens": body["max_tokens"]}
                async with clients:
                    whole = (await complete(client, decode, **body))["choices"][0]["token_ids"]
                    whole_chat, _ = await chat(client, decode, chat_body, {})
                    answers = {
                        "completion": (await complete(client, proxy, **body))["choices"][0][
                            "token_ids"
                        ],
                        "streamed completion": await stream(client, proxy, **body),
                    }
                    chats = {
                        "chat": (await chat(client, proxy, chat_body, {}))[0],
                        "streamed chat": (
                            await chat(client, proxy, {**chat_body, **STREAM_WITH_USAGE}, {})
                        )[0],
                    }
                for kind, tokens in answers.items():
                    if tokens != whole:
                        mismatches.append(f"prompt {i} ({kind}): {tokens} != {whole}")
                for kind, tokens in chats.items():
                    if tokens != whole_chat:
                        mismatches.append(f"prompt {i} ({kind}): {tokens} != {whole_chat}")

            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(cases):
                    nursery.start_soon(one, i, prompt)
            assert mismatches == []
            # Every disaggregated answer was a pull across the hosts.
            on_decode = await scrape(client, decode)
            assert on_decode["trio_pd_pulls_succeeded_total"] == 4 * len(cases)
            assert on_decode["trio_pd_pulls_failed_total"] == 0
            serving["process"].send_signal(signal.SIGTERM)
            assert await serving["process"].wait() == 0


@attrs.define
class Outcome:
    """One request sent by :class:`Load`."""

    started: float
    ended: float
    status: int
    decode: str  # the decode engine that answered ("" if none did)
    error: str  # the proxy's error message ("" for a 200)


@attrs.define
class Load:
    """``clients`` clients sending short completions through the proxy, one
    after another each, until cancelled; every outcome recorded."""

    client: httpx2.AsyncClient
    proxy: str
    decode_engines: Callable[[], dict[str, str]]  # engine name (in completion ids) -> URL
    outcomes: list[Outcome] = attrs.Factory(list)
    in_flight: dict[int, float] = attrs.Factory(dict)  # request number -> when it started
    _ids: Any = attrs.Factory(itertools.count)

    async def run(self, clients: int = 4) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(self._client)

    async def _client(self) -> None:
        while True:
            started, number = trio.current_time(), next(self._ids)
            body = {"prompt": f"request {number} across hosts", "max_tokens": 4}
            self.in_flight[number] = started
            try:
                response = await self.client.post(f"{self.proxy}/v1/completions", json=body)
            except httpx2.TransportError as exc:  # (the proxy itself never fails here)
                self.outcomes.append(Outcome(started, trio.current_time(), 0, "", repr(exc)))
                continue
            finally:
                del self.in_flight[number]
            outcome = Outcome(started, trio.current_time(), response.status_code, "", "")
            if response.status_code == 200:
                engine_id = response.json()["id"]
                outcome.decode = next(
                    (url for name, url in self.decode_engines().items() if name in engine_id), "?"
                )
            else:
                outcome.error = response.json()["error"]["message"]
            self.outcomes.append(outcome)

    def since(self, moment: float) -> list[Outcome]:
        """The requests started at or after ``moment``."""
        return [o for o in self.outcomes if o.started >= moment]

    def settled_until(self, moment: float) -> bool:
        """Whether every request started by ``moment`` has ended (and is recorded)."""
        return all(started > moment for started in self.in_flight.values())

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]


async def health(client: httpx2.AsyncClient, proxy: str) -> dict[str, Any]:
    answer: dict[str, Any] = (await client.get(f"{proxy}/health")).json()
    return answer


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], seconds: float, what: str
) -> None:
    """Poll ``condition`` (sync or async) every 0.1 s until it is true
    (AssertionError naming ``what`` after ``seconds``)."""

    async def holds() -> bool:
        result = condition()
        return await result if inspect.isawaitable(result) else result

    try:
        with trio.fail_after(seconds):
            while not await holds():  # noqa: ASYNC110  (state behind HTTP: polled)
                await trio.sleep(0.1)
    except trio.TooSlowError:
        raise AssertionError(f"not within {seconds} s: {what}") from None


@asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """Three routed test hosts: a prefill engine on host 0 and a decode engine on
    each of hosts 1 and 2, registered on an etcd here, and a proxy here that
    finds them there (short deadlines, so that a partition shows in seconds)."""
    async with (
        open_test_hosts(3, routed=True) as hosts,
        open_etcd(addresses=[host.root_address for host in hosts]) as etcd,
    ):

        def engine(host: TestHost, role: str, name: str) -> tuple[list[str], Path, str]:
            args = ["engine", "--role", role, "--engine-id", name, "--port", "0"]
            args += ["--host", host.address, "--num-blocks", "64", "--grace", "3"]
            args += ["--etcd", etcd.url_at(host.root_address), "--etcd-ttl", str(TTL)]
            return args, tmp_path / f"{name}.json", host.netns

        # (the internal key: signed registrations, and CURVE with each engine's own pair)
        env = {**ENV, "TRIO_PD_EXPOSURE_SECRET": SECRET, "TRIO_PD_INTERNAL_KEY": INTERNAL_KEY}
        proxy_args = ["proxy", "--port", "0", "--etcd", etcd.url, "--etcd-ttl", str(TTL)]
        proxy_args += ["--connect-timeout", "1", "--first-byte-timeout", "3"]
        async with (
            running(
                engine(hosts[0], "prefill", "prefill-a"),
                engine(hosts[1], "decode", "decode-a"),
                engine(hosts[2], "decode", "decode-b"),
                env=env,
            ) as [(_, prefill), (_, decode_a), (decode_b_process, decode_b)],
            running((proxy_args, tmp_path / "proxy.json"), env=env) as [(_, proxy)],
        ):
            yield {
                "hosts": hosts,
                "etcd": etcd,
                "engine": engine,
                "env": env,
                "proxy": proxy["url"],
                "prefill": prefill["url"],
                "decode": {"decode-a": decode_a["url"], "decode-b": decode_b["url"]},
                "decode_b_process": decode_b_process,
            }


@pytest.mark.cluster  # (nox -s cluster: about 25 s, kept out of the suite's time)
async def test_a_cluster_on_etcd_rides_out_etcd_restarts_joins_partitions_and_crashes(
    tmp_path: Path,
) -> None:
    with trio.fail_after(180):
        async with (
            cluster(tmp_path) as c,
            http_client(30) as client,
            trio.open_nursery() as nursery,
        ):
            proxy, etcd, hosts = c["proxy"], c["etcd"], c["hosts"]
            decode_a, decode_b = c["decode"]["decode-a"], c["decode"]["decode-b"]
            load = Load(client, proxy, lambda: c["decode"])
            nursery.start_soon(load.run)

            def both_decode_engines_serve() -> bool:
                recent = {o.decode for o in load.since(trio.current_time() - 1)}
                return {decode_a, decode_b} <= recent

            await wait_for(both_decode_engines_serve, 15, "both decode engines take requests")

            # etcd stops and starts again: the proxy serves by its last view,
            # the leases survive, and no request fails.
            await etcd.stop()
            await trio.sleep(0.5)
            await etcd.start()
            await trio.sleep(0.5)
            assert load.failures() == []
            assert (await health(client, proxy)) == {"status": "ok", "prefill": 1, "decode": 2}

            # A new prefill engine on host 0 registers and takes requests.
            joined = c["engine"](hosts[0], "prefill", "prefill-b")
            async with running(joined, env=c["env"]) as [(_, new)]:

                async def it_serves() -> bool:
                    served = await scrape(client, new["url"])
                    return bool(served.get(f"{PREFILLS}{{kind=prefill,outcome=ok}}", 0) > 0)

                await wait_for(it_serves, 15, "the new prefill engine serves")
                assert (await health(client, proxy))["prefill"] == 2
            assert load.failures() == []

            # Partition decode-b's host: it drops out of etcd within its TTL
            # (no keep-alive gets through); the requests it held fail with a
            # 504 naming it, and no request after that goes to it or fails.
            cut = trio.current_time()
            await hosts[2].cut()

            async def one_decode_engine_left() -> bool:
                return bool((await health(client, proxy))["decode"] == 1)

            await wait_for(one_decode_engine_left, TTL + 3, "decode-b leaves etcd")
            gone = trio.current_time()
            # (a request decode-b held ends at the proxy's 3 s first-byte deadline)
            await wait_for(lambda: load.settled_until(gone), 5, "decode-b's requests end")
            await trio.sleep(0.5)
            during = load.failures()
            assert during, "nothing was in flight at decode-b when its host was cut"
            for failure in during:
                assert failure.status == 504, failure
                assert decode_b in failure.error, failure
                assert cut - 0.5 <= failure.started <= gone, failure
            after = load.since(gone + 0.5)
            assert after
            assert all(o.status == 200 and o.decode == decode_a for o in after), after
            # Restored, it registers again and takes requests again.
            await hosts[2].restore()
            await wait_for(both_decode_engines_serve, 15, "decode-b serves again when restored")
            # Right after the link is back, decode-b's first pull may still meet
            # its UCX endpoint to prefill-a from before the cut (the agent is
            # then given up and the next pull handshakes again): such a failure
            # is decode-b's own, and names it.
            settled = trio.current_time()
            await wait_for(lambda: load.settled_until(settled), 5, "requests before it end")
            aftermath = load.failures()[len(during) :]
            for failure in aftermath:
                assert decode_b in failure.error, failure
            assert len(aftermath) <= 4, aftermath
            during += aftermath

            # SIGKILL decode-b under load: only the requests it held fail,
            # each naming it; the proxy passes over it at once (its port
            # refuses) and it leaves etcd within its TTL.
            c["decode_b_process"].kill()
            await c["decode_b_process"].wait()
            killed = trio.current_time()  # (dead: SIGKILL lands a moment after kill())
            await wait_for(one_decode_engine_left, TTL + 3, "the killed decode-b leaves etcd")
            await wait_for(lambda: load.settled_until(killed), 5, "decode-b's requests end")
            await trio.sleep(0.5)
            crash = load.failures()[len(during) :]
            for failure in crash:
                assert failure.status == 502, failure
                assert decode_b in failure.error, failure
                assert failure.started <= killed, failure  # (it held it when it died)
            after = load.since(killed + 0.5)
            assert after
            assert all(o.status == 200 and o.decode == decode_a for o in after), after
            nursery.cancel_scope.cancel()
