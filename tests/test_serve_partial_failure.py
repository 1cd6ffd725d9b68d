"""``trio-pd serve`` under partial failure (issue 16's serving repros).

Before: a request that could never fit took the prefill pool from 128 to 34
free blocks and failed the next ordinary request; under 40 concurrent
clients, 8 requests got 502 and 8 exposures stayed pending; a full decode
pool was reported as "overloaded" (502 through the proxy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

from .test_serve import complete, deployment_client, open_deployment, scrape

pytestmark = pytest.mark.slow

POOL = 128  # KV blocks per engine: 2048 tokens


async def wait_for(client: httpx2.AsyncClient, engine: str, name: str, value: float) -> None:
    """Until ``engine``'s metric ``name`` reads ``value`` (bound it with a cancel scope)."""
    while True:
        if (await scrape(client, engine)).get(name) == value:
            return
        await trio.sleep(0.05)


async def test_overload_impossible_and_forged_requests_strand_nothing(tmp_path: Path) -> None:
    async with open_deployment(tmp_path, "--num-blocks", str(POOL)) as serving:
        proxy, [prefill], [decode] = serving["proxy"], serving["prefill"], serving["decode"]
        with trio.fail_after(120):
            async with deployment_client(60) as client:
                prompt = "y" * 40
                response = await client.post(
                    f"{prefill}/v1/completions",
                    json={"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}},
                )
                params: dict[str, Any] = response.json()["kv_transfer_params"]
                assert params["remote_token"]
                forged = [
                    ({**params, "remote_block_ids": [b + 1 for b in params["remote_block_ids"]]},
                     400, "kv_transfer_params.remote_token"),
                    ({**params, "remote_incarnation": "0" * 16}, 400,
                     "kv_transfer_params.remote_token"),
                    ({**params, "remote_block_ids": [7, 7, 7]}, 400,
                     "kv_transfer_params.remote_token"),
                    ({**params, "remote_block_ids": [1]}, 400,
                     "kv_transfer_params.remote_token"),  # (the count is checked after)
                ]  # fmt: skip
                for fake, status, param in forged:
                    response = await client.post(
                        f"{decode}/v1/completions",
                        json={"prompt": prompt, "kv_transfer_params": fake},
                    )
                    assert response.status_code == status, response.text
                    assert response.json()["error"]["param"] == param
                # The real parameters still work: the forgeries harmed nothing.
                response = await client.post(
                    f"{decode}/v1/completions",
                    json={"prompt": prompt, "max_tokens": 3, "kv_transfer_params": params},
                )
                assert response.status_code == 200, response.text
                # Real parameters for another prompt: a 400 naming the block ids,
                # and the prefill engine gets its blocks back (abandoned).
                response = await client.post(
                    f"{prefill}/v1/completions",
                    json={"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}},
                )
                other = response.json()["kv_transfer_params"]
                response = await client.post(
                    f"{decode}/v1/completions",
                    json={"prompt": "z" * 100, "kv_transfer_params": other},
                )
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "kv_transfer_params.remote_block_ids"
                with trio.fail_after(5):
                    await wait_for(client, prefill, "trio_pd_exposures_abandoned_total", 1)
                # Bad bodies are 4xx with a JSON error, never a 500.
                for raw in (json.dumps({"prompt": "\ud800abc"}), '{"prompt": 5}', "[]"):
                    response = await client.post(f"{proxy}/v1/completions", content=raw)
                    assert 400 <= response.status_code < 500, raw
                    assert response.json()["error"]["message"]

                # A request that can never fit: a 400 before any prefill.
                body = {"prompt": "x" * 1500, "max_tokens": 1000}
                response = await client.post(f"{proxy}/v1/completions", json=body)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == "max_tokens"
                assert "2500 tokens" in error["message"]
                on_prefill = await scrape(client, prefill)
                assert on_prefill["trio_pd_serve_kv_blocks_free"] == POOL
                # (two prefills so far: the parameter checks' own)
                assert on_prefill["trio_pd_serve_requests_total{kind=prefill,outcome=ok}"] == 2
                assert (await complete(client, proxy, prompt="ordinary", max_tokens=4))["usage"]

                # 40 clients whose requests cannot all fit in the decode pool
                # at once: they wait for blocks (admission), none is a 502,
                # and nothing is stranded afterwards.
                statuses: list[int] = []

                async def one(i: int) -> None:
                    # 800-900 tokens of prompt: two requests fill the decode pool
                    body = {"prompt": f"client {i:02d} " * (80 + i % 5), "max_tokens": 20 + i}
                    response = await client.post(f"{proxy}/v1/completions", json=body)
                    statuses.append(response.status_code)
                    if response.status_code == 503:
                        assert response.headers["retry-after"] == "1"
                    else:
                        assert response.status_code == 200, response.text

                async with trio.open_nursery() as nursery:
                    for i in range(40):
                        nursery.start_soon(one, i)
                assert 502 not in statuses
                assert statuses.count(200) >= 30, statuses
                with trio.fail_after(10):
                    await wait_for(client, prefill, "trio_pd_serve_kv_blocks_free", POOL)
                    await wait_for(client, decode, "trio_pd_serve_kv_blocks_free", POOL)
                on_prefill = await scrape(client, prefill)
                assert on_prefill["trio_pd_exposures_pending"] == 0
                assert on_prefill["trio_pd_exposures_expired_total"] == 0


async def test_a_client_gone_while_its_decode_waits_gives_the_prefill_blocks_back(
    tmp_path: Path,
) -> None:
    async with open_deployment(tmp_path, "--num-blocks", str(POOL)) as serving:
        proxy, [prefill], [decode] = serving["proxy"], serving["prefill"], serving["decode"]
        with trio.fail_after(120):
            async with deployment_client(60) as client:
                # One long request takes most of the decode pool ...
                big = {"prompt": "b" * 1000, "max_tokens": 1000, "stream": True}
                async with (
                    trio.open_nursery() as nursery,
                    client.stream("POST", f"{proxy}/v1/completions", json=big) as first,
                ):
                    assert first.status_code == 200
                    # ... so the next one waits for decode blocks, holding its
                    # prefill's exposure (renewed past lease_initial, 5 s) ...
                    waiting = {"prompt": "w" * 100, "max_tokens": 500}

                    async def gives_up() -> None:
                        with trio.move_on_after(1.0):
                            await client.post(f"{proxy}/v1/completions", json=waiting)

                    nursery.start_soon(gives_up)
                    await trio.sleep(0.5)
                    assert (await scrape(client, decode))["trio_pd_holds_active"] == 1
                    # ... and when its client hangs up, the prefill engine gets
                    # the blocks back at once (abandoned), not at lease expiry.
                    with trio.fail_after(2.0):
                        await wait_for(client, prefill, "trio_pd_exposures_abandoned_total", 1)
                        await wait_for(client, prefill, "trio_pd_serve_kv_blocks_free", POOL)
                    nursery.cancel_scope.cancel()
                on_decode = await scrape(client, decode)
                assert on_decode.get("trio_pd_abandons_failed_total", 0) == 0
