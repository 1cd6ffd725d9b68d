"""Across hosts: UCX over TCP on a veth link to a test host, and partitions.

The prefill engine runs in a network namespace (a test host), the decoder in
a process of its own in the root namespace (UCX reads the routing table once
per process, so the decoder must start after the link exists). UCX is forced
to TCP so that the data plane crosses the link; the link's byte counters
prove it did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

import trio_pd
from trio_pd._harness._prefill_spec import config_overrides
from trio_pd.testing import (
    PrefillWorker,
    TestHost,
    TestHostsUnavailable,
    WorkerError,
    WorkerSpec,
    open_prefill_worker,
    open_test_hosts,
)

pytestmark = [pytest.mark.slow, pytest.mark.test_hosts]

TCP = {"UCX_TLS": "tcp"}
SPEC = {"regions": 4, "blocks": 64, "block_shape": (16384,), "dtype": "float16"}  # 32 KiB blocks
CONFIG = trio_pd.ConnectorConfig(
    handshake_timeout=2.0,
    transfer_timeout=3.0,
    close_timeout=2.0,
    abort_timeout=3.0,
    backoff_initial=0.2,
    backoff_max=0.4,
)


@asynccontextmanager
async def far_and_near() -> AsyncIterator[tuple[TestHost, PrefillWorker, PrefillWorker]]:
    """A prefill engine on a test host, and a decoder here, both on UCX over TCP."""
    overrides = config_overrides(CONFIG)
    async with open_test_hosts(1) as [host]:
        far = WorkerSpec(
            "far", host=host.address, netns=host.netns, env=TCP, config=overrides, **SPEC
        )
        near = WorkerSpec("decoder", env=TCP, config=overrides, **SPEC)
        async with open_prefill_worker(far) as prefill, open_prefill_worker(near) as decoder:
            yield host, prefill, decoder


async def test_the_data_plane_crosses_the_link_over_tcp() -> None:
    with trio.fail_after(120):
        async with far_and_near() as (host, prefill, decoder):
            remote = await prefill.expose("r", list(range(64)), seed=3)
            assert remote.host == host.address
            before = host.link_bytes()
            result = await decoder.pull("r", list(range(64)), remote, seed=3)
            assert result["mismatched"] == []
            assert result["bytes"] == 64 * 4 * 32768
            assert host.link_bytes() - before >= result["bytes"]
            assert await prefill.wait_released("r") is trio_pd.Released.READ


async def test_a_partition_before_the_handshake_then_a_restored_link() -> None:
    with trio.fail_after(120):
        async with far_and_near() as (host, prefill, decoder):
            first = await prefill.expose("first", [1, 2], seed=5)
            await host.cut()
            started = trio.current_time()
            with pytest.raises(WorkerError) as info:
                await decoder.pull("first", [1, 2], first, seed=5)
            assert info.value.error_type == "HandshakeError"
            assert "no reply" in str(info.value)
            assert trio.current_time() - started < CONFIG.handshake_timeout + 1.0
            await host.restore()
            await trio.sleep(CONFIG.backoff_max)  # the backoff after the failure
            again = await prefill.expose("again", [3, 4], seed=6)
            result = await decoder.pull("again", [3, 4], again, seed=6)
            assert result["mismatched"] == []


async def test_a_partition_mid_pull_fails_it_in_bounded_time_and_the_producer_expires_it() -> None:
    inside = WorkerSpec("inside", env=TCP, config=config_overrides(CONFIG), **SPEC)
    with trio.fail_after(120):
        async with far_and_near() as (host, prefill, decoder):
            # A consumer on the producer's own host: the cut does not reach it.
            inside = attrs.evolve(inside, netns=host.netns, host=host.address)
            async with open_prefill_worker(inside) as neighbour:
                warm = await prefill.expose("warm", [0], seed=1)
                await decoder.pull("warm", [0], warm, seed=1)  # handshake, UCX wire-up
                await host.limit_rate("40mbit")  # 8 MiB: about 1.7 s on this link
                big = await prefill.expose("big", list(range(64)), seed=2)
                async with trio.open_nursery() as nursery:

                    async def cut_soon() -> None:
                        await trio.sleep(0.3)
                        await host.cut()

                    nursery.start_soon(cut_soon)
                    started = trio.current_time()
                    with pytest.raises(WorkerError) as info:
                        await decoder.pull("big", list(range(64)), big, seed=2)
                assert info.value.error_type == "TransferError"
                assert "64 local blocks" in str(info.value)
                bound = CONFIG.transfer_timeout + CONFIG.close_timeout + 1.0
                assert trio.current_time() - started < bound
                # The transfer could not be stopped (its peer is unreachable):
                # the error says that its blocks may still change, and the
                # agent was given up (the next pull handshakes again).
                assert "did not stop" in str(info.value)
                assert "may still be written" in str(info.value)
                assert (await decoder.statistics())["transfers_unsettled"] == 1
                # The producer keeps serving the consumer it can still reach...
                near = await prefill.expose("near", [7], seed=8)
                result = await neighbour.pull("near", [7], near, seed=8)
                assert result["mismatched"] == []
                # ...and the cut-off consumer's exposure expires.
                assert await prefill.wait_released("big") is trio_pd.Released.EXPIRED
                # After the link is back, the stuck transfer ends and its
                # bytes land, long after the pull failed: only then do its
                # blocks settle. (Block 7 is what the producer holds *now*:
                # it refilled it for "near" meanwhile; the late READ copied that.)
                await host.restore()
                assert set(await decoder.wait_settled("big", seed=2)) <= {7}
                assert (await decoder.statistics())["transfers_unsettled"] == 0
                # The cut-off consumer is served again.
                after = await prefill.expose("after", [5], seed=7)
                result = await decoder.pull("after", [5], after, seed=7)
                assert result["mismatched"] == []


async def test_an_engine_started_while_its_link_is_down_waits_for_it_then_is_reachable() -> None:
    # NIXL advertises only the interfaces up when its agent is created: an
    # engine started during a cut advertised loopback only and stayed
    # unreachable for its life (the soak found it). The connector now waits
    # for the interface of its advertised address before creating the agent.
    overrides = config_overrides(CONFIG)
    with trio.fail_after(120):
        async with open_test_hosts(1) as [host]:
            await host.cut()
            far = WorkerSpec(
                "far", host=host.address, netns=host.netns, env=TCP, config=overrides, **SPEC
            )
            near = WorkerSpec("decoder", env=TCP, config=overrides, **SPEC)

            restored = trio.Event()

            async def restore_soon() -> None:
                await trio.sleep(3.0)
                await host.restore()  # (the link up, then the routes back)
                restored.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(restore_soon)
                async with (
                    open_prefill_worker(far) as prefill,  # (ready once its link is)
                    open_prefill_worker(near) as decoder,
                ):
                    await restored.wait()  # (the engine may be up before the routes are)
                    remote = await prefill.expose("r", [1, 2], seed=4)
                    result = await decoder.pull("r", [1, 2], remote, seed=4)
                    assert result["mismatched"] == []


async def test_without_root_test_hosts_fail_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(TestHostsUnavailable, match="test hosts need root"):
        async with open_test_hosts(1):
            pass  # pragma: no cover
