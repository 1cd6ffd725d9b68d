"""Cluster membership on a real etcd: engines register under leases, a view watches.

The wire codec and the member table are tested without etcd; everything else
runs against a real ``etcd`` process (``trio_pd.testing.open_etcd``) that the
outage tests kill and start again on the same ports and data.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import shutil
from collections.abc import AsyncIterator, Callable

import attrs
import pytest
import trio

from trio_pd._harness import _etcd_server
from trio_pd._membership import (
    ClusterView,
    EtcdAccess,
    Member,
    MembershipConfig,
    MembershipError,
    register,
    signing_key,
    watch_members,
)
from trio_pd._membership import _etcd_wire as wire
from trio_pd._membership._etcd_client import EtcdClient
from trio_pd._membership._members import MemberTable, UnverifiedError
from trio_pd._serve.discovery import EngineAnnouncement, EngineSet, EtcdMembership
from trio_pd.testing import EtcdServer, EtcdUnavailable, open_etcd
from trio_pd.testing._registered_engine import open_registered_process

from .conftest import wait_until

PREFIX = "/trio_pd/"
TTL = 2.0  # etcd's minimum is 1 s with open_etcd's election timeout (2 s by default)
FAST = MembershipConfig(
    connect_timeout=1.0,
    request_timeout=2.0,
    probe_interval=0.3,
    retry_initial=0.05,
    retry_max=0.3,
    close_timeout=2.0,
)


def member(role: str, n: int, **changes: object) -> Member:
    fields: dict[str, object] = {
        "role": role,
        "engine_id": f"{role}-{n}",
        "url": f"http://127.0.0.1:{8100 + n}",
        "side_channel": f"127.0.0.1:{5600 + n}",
        "tp_size": 1,
        "model": "tiny-llama",
        "incarnation": f"inc-{n}",
    }
    return Member(**{**fields, **changes})  # type: ignore[arg-type]


def ids(view: ClusterView, role: str | None = None) -> set[str]:
    return {m.engine_id for m in view.members(role)}


async def wait_for(view: ClusterView, condition: Callable[[], bool]) -> None:
    while not condition():
        await view.changed.wait()


@pytest.fixture
async def etcd() -> AsyncIterator[EtcdServer]:
    async with open_etcd() as server:
        yield server


# ---- sans I/O ------------------------------------------------------------------


def test_prefix_range_end() -> None:
    assert wire.prefix_range_end(b"/trio_pd/") == b"/trio_pd0"
    assert wire.prefix_range_end(b"a\xff\xff") == b"b"
    assert wire.prefix_range_end(b"\xff") == b"\0"


def test_a_member_is_a_json_value_and_bad_values_say_why() -> None:
    m = member("prefill", 0, tp_size=2, side_channel="[fd00::17]:5600")
    assert Member.from_json(m.to_json()) == m
    assert m.key(PREFIX) == b"/trio_pd/prefill/prefill-0"
    extra = b'{"role": "decode", "engine_id": "d", "url": "http://h:1", "side_channel": "h:2",'
    assert Member.from_json(extra + b' "future_field": 1}').engine_id == "d"  # ignored
    for bad, why in [
        (b"\xff", "not JSON"),
        (b"[1, 2]", "not an object"),
        (b'{"role": "prefill"}', "missing engine_id, url, side_channel"),
        (m.to_json().replace(b'"tp_size": 2', b'"tp_size": "2"'), "tp_size"),
        (m.to_json().replace(b"[fd00::17]:5600", b"nowhere"), "side_channel"),
        (m.to_json().replace(b"[fd00::17]:5600", b"fd00::17"), "side_channel"),
        (m.to_json().replace(b'"prefill-0"', b'"a/b"'), "engine_id"),
    ]:
        with pytest.raises(ValueError, match=why):
            Member.from_json(bad)


def test_the_member_table_applies_events_and_reports_each_bad_version_once() -> None:
    table = MemberTable(PREFIX)
    good = member("decode", 1)
    key = good.key(PREFIX)
    bad_key = b"/trio_pd/decode/junk"
    kv = wire.KeyValue
    assert table.load([kv(key, good.to_json(), 5), kv(bad_key, b"junk", 6)])
    assert table.members() == (good,)
    assert len(table.take_problems()) == 1
    assert not table.load([kv(key, good.to_json(), 5), kv(bad_key, b"junk", 6)])
    assert table.take_problems() == []  # the same version: said once
    # A value that names another engine than its key is ignored too.
    moved = kv(b"/trio_pd/prefill/decode-1", good.to_json(), 7)
    assert not table.apply([wire.WatchEvent("put", moved)])
    assert "make the key" in table.take_problems()[0]
    assert table.apply([wire.WatchEvent("delete", kv(key))])
    assert table.members() == ()
    with pytest.raises(ValueError, match="end with '/'"):
        MemberTable("/trio_pd")


def test_watch_lines_parse_puts_deletes_compaction_and_errors() -> None:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    header = {"revision": "9"}
    line = {
        "result": {
            "header": header,
            "events": [
                {"kv": {"key": b64(b"k"), "value": b64(b"v"), "mod_revision": "8", "lease": "7"}},
                {"type": "DELETE", "kv": {"key": b64(b"k"), "mod_revision": "9"}},
            ],
        }
    }
    message = wire.parse_watch_message("e", line)
    assert [e.kind for e in message.events] == ["put", "delete"]
    assert message.events[0].kv == wire.KeyValue(b"k", b"v", 8, 7)
    compacted = {"result": {"header": {}, "canceled": True, "compact_revision": "4"}}
    assert wire.parse_watch_message("e", compacted).compact_revision == 4
    error = {"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}}
    with pytest.raises(MembershipError, match="no leader") as caught:
        wire.parse_watch_message("e", error)
    assert (caught.value.cause, caught.value.code) == ("rejected", 14)
    with pytest.raises(MembershipError, match="bad_response"):
        wire.parse_watch_message("e", {"result": {"header": {"revision": "x"}}})


def test_a_membership_error_names_its_cause_and_endpoint_and_pickles() -> None:
    error = MembershipError("http://127.0.0.1:2379/v3/kv/put", "rejected", "no lease", 5)
    assert str(error) == "etcd at http://127.0.0.1:2379/v3/kv/put: rejected: no lease"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.endpoint, copy.cause, copy.detail, copy.code) == (
        error.endpoint,
        "rejected",
        "no lease",
        5,
    )


# ---- against a real etcd ---------------------------------------------------------


async def test_open_etcd_without_the_binary_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(_etcd_server, "ETCD_PATHS", ())
    with pytest.raises(EtcdUnavailable, match="apt-get install etcd-server"):
        async with open_etcd():
            pass  # pragma: no cover


async def test_the_gateway_paths_leases_and_compaction(etcd: EtcdServer) -> None:
    with trio.fail_after(60):
        async with EtcdClient(etcd.url, FAST) as client:
            lease = await client.grant(1)
            assert lease.ttl >= 1
            assert await client.keepalive(lease.id) >= 1
            first = await client.put(b"/x/a", b"1", lease=lease.id)
            await client.put(b"/x/a", b"2", lease=lease.id)
            revision, kvs = await client.range_prefix(b"/x/")
            assert [(kv.key, kv.value, kv.lease) for kv in kvs] == [(b"/x/a", b"2", lease.id)]
            await client.revoke(lease.id)
            assert await client.keepalive(lease.id) == 0  # gone: TTL 0, not an error
            await client.revoke(lease.id)  # (idempotent)
            with pytest.raises(MembershipError) as caught:
                await client.put(b"/x/b", b"", lease=lease.id)
            assert (caught.value.cause, caught.value.code) == ("rejected", wire.NOT_FOUND)
            # A watch from a compacted revision is cancelled, saying where.
            await client._call("/v3/kv/compaction", {"revision": str(revision)})
            async with client.watch(b"/x/", first) as messages:
                last = [m async for m in messages][-1]
            assert last.canceled
            assert last.compact_revision == revision


async def test_engines_appear_and_a_clean_exit_removes_them_at_once(etcd: EtcdServer) -> None:
    with trio.fail_after(60):
        async with (
            watch_members(etcd.url, config=FAST) as view,
            register(etcd.url, member("prefill", 0), ttl=TTL, config=FAST) as p0,
            register(etcd.url, member("decode", 0), ttl=TTL, config=FAST),
        ):
            assert view.healthy
            await wait_for(view, lambda: ids(view) == {"prefill-0", "decode-0"})
            assert view.members("decode") == (member("decode", 0),)
            # The key lives under the registration's lease.
            async with EtcdClient(etcd.url, FAST) as client:
                _, kvs = await client.range_prefix(p0.key.encode())
            assert [kv.lease for kv in kvs] == [p0.lease_id]
            # A member that starts later is seen by the running view.
            async with register(etcd.url, member("prefill", 1), ttl=TTL, config=FAST):
                await wait_for(view, lambda: ids(view, "prefill") == {"prefill-0", "prefill-1"})
                left = trio.current_time()
            await wait_for(view, lambda: ids(view, "prefill") == {"prefill-0"})
            assert trio.current_time() - left < 0.5  # its key was deleted: no TTL to wait
            # withdraw() (the engine drains) takes it out before the block ends.
            await p0.withdraw()
            await wait_for(view, lambda: ids(view) == {"decode-0"})
            assert view.statistics().outages == 0


async def test_a_crashed_engine_disappears_within_its_ttl(etcd: EtcdServer) -> None:
    with trio.fail_after(60):
        async with watch_members(etcd.url, config=FAST) as view:
            engine = member("prefill", 7)
            async with open_registered_process(etcd.url, engine, prefix=PREFIX, ttl=TTL) as process:
                await wait_for(view, lambda: view.members() == (engine,))
                process.kill()
                killed = trio.current_time()
                await process.wait()
                await wait_for(view, lambda: view.members() == ())
                gone_after = trio.current_time() - killed
            assert 0.2 < gone_after < TTL + 1.0, gone_after  # its lease ran out
            assert view.healthy


async def test_the_view_keeps_its_members_while_etcd_is_down_and_catches_up(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_pd.membership")
    with trio.fail_after(60):
        async with (
            watch_members(etcd.url, config=FAST) as view,
            register(etcd.url, member("decode", 0), ttl=TTL, config=FAST) as registration,
        ):
            await wait_for(view, lambda: ids(view) == {"decode-0"})
            await etcd.kill()
            await wait_for(view, lambda: not view.healthy)
            assert ids(view) == {"decode-0"}  # the last view, kept
            assert view.last_error is not None
            assert view.last_error.cause in ("disconnected", "unreachable")
            assert etcd.url in str(view.statistics().last_error)
            await trio.sleep(3 * FAST.retry_max)  # reconnections fail meanwhile
            await wait_until(lambda: not registration.healthy, 0.02)  # its next keepalive
            assert registration.last_error is not None
            await etcd.start()
            await wait_for(view, lambda: view.healthy)
            # Changes after the restart are seen, and the registration carried on.
            async with register(etcd.url, member("prefill", 3), ttl=TTL, config=FAST):
                await wait_for(view, lambda: ids(view) == {"decode-0", "prefill-3"})
            await wait_until(lambda: registration.healthy, 0.02)
            assert registration.registrations == 1  # its lease survived the restart
            await trio.sleep(TTL + 0.5)
            assert ids(view) == {"decode-0"}
            assert view.statistics().outages == 1
    lost = [r for r in caplog.records if "lost etcd" in r.getMessage()]
    back = [r for r in caplog.records if "is back after" in r.getMessage()]
    assert (len(lost), len(back)) == (1, 1)  # once per outage, however many retries


async def test_a_lost_lease_is_registered_again(etcd: EtcdServer) -> None:
    with trio.fail_after(60):
        async with (
            watch_members(etcd.url, config=FAST) as view,
            register(etcd.url, member("prefill", 0), ttl=TTL, config=FAST) as registration,
        ):
            await wait_for(view, lambda: ids(view) == {"prefill-0"})
            lease = registration.lease_id
            assert lease is not None
            async with EtcdClient(etcd.url, FAST) as client:
                await client.revoke(lease)  # as if it had expired during a partition
            await wait_for(view, lambda: ids(view) == set())
            await wait_for(view, lambda: ids(view) == {"prefill-0"})
            # (the view can hear of it before the registration does)
            await wait_until(lambda: registration.registrations == 2, 0.01)
            assert registration.lease_id not in (None, lease)


async def test_malformed_values_are_ignored_with_a_warning(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_pd.membership")
    good = member("decode", 2)
    with trio.fail_after(60):
        async with EtcdClient(etcd.url, FAST) as client:
            await client.put(b"/trio_pd/decode/junk", b"not json")
            await client.put(good.key(PREFIX), good.to_json())
            async with watch_members(etcd.url, config=FAST) as view:  # read in the range
                assert view.members() == (good,)
                await client.put(b"/trio_pd/prefill/p", b'{"role": "prefill"}')  # watched
                await client.put(b"/trio_pd/prefill/q", member("decode", 9).to_json())
                broken = good.to_json().replace(b'"tp_size": 1', b'"tp_size": 0')
                await client.put(good.key(PREFIX), broken)  # a bad new version removes it
                await wait_for(view, lambda: view.members() == ())
                await client.put(good.key(PREFIX), good.to_json())  # and a good one is back
                await wait_for(view, lambda: view.members() == (good,))
                assert view.healthy
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    for key in ("decode/junk", "prefill/p", "prefill/q", "decode/decode-2"):
        assert f"/trio_pd/{key}" in warnings


async def test_etcd_unreachable_on_entry_is_a_membership_error(etcd: EtcdServer) -> None:
    url = etcd.url
    await etcd.kill()
    with trio.fail_after(60):
        with pytest.raises(MembershipError, match="unreachable") as caught:
            async with watch_members(url, config=FAST):
                pass  # pragma: no cover
        assert caught.value.endpoint.startswith(url)
        with pytest.raises(MembershipError, match="unreachable"):
            async with register(url, member("prefill", 0), config=FAST):
                pass  # pragma: no cover


# ---- registrations that prove themselves (issue 29) -------------------------------

INTERNAL_KEY = "the-deployments-internal-key-0123456789"
KEY = signing_key(INTERNAL_KEY)


def test_a_signed_value_verifies_and_any_change_or_another_key_does_not() -> None:
    m = member("decode", 0, curve_public_key="k" * 40, timestamp=1764700000.5)
    signed = m.to_json(KEY)
    assert Member.from_json(signed, KEY) == m
    assert Member.from_json(signed) == m  # (a reader without the key ignores the signature)
    forged = signed.replace(b"127.0.0.1:8100", b"203.0.113.9:8100")  # the URL changed
    for bad, why in [
        (m.to_json(), "not signed"),
        (forged, "does not verify"),
        (signed.replace(b'"tp_size": 1', b'"tp_size": 2'), "does not verify"),
        (signed.replace(b'"role"', b'"extra": 1, "role"'), "does not verify"),  # unknown, too
        (m.to_json(signing_key("another deployment's key 0123456789")), "does not verify"),
    ]:
        with pytest.raises(UnverifiedError, match=why):
            Member.from_json(bad, KEY)
    table = MemberTable(PREFIX, KEY)
    kv = wire.KeyValue
    assert table.load([kv(m.key(PREFIX), signed, 3), kv(b"/trio_pd/decode/evil", forged, 4)])
    assert table.members() == (m,)
    assert not table.load([kv(m.key(PREFIX), signed, 3), kv(b"/trio_pd/decode/evil", forged, 4)])
    assert table.unverified == 1  # (once per version)
    assert table.apply([wire.WatchEvent("put", kv(m.key(PREFIX), forged, 5))])
    assert table.members() == ()
    assert table.unverified == 2
    assert "does not verify" in table.take_problems()[-1]


async def test_a_forged_or_overwritten_registration_is_never_routed_to_and_is_put_back(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault 1: whoever writes etcd (without the internal key) cannot announce an
    engine, nor redirect a real one; the real engine puts its key back at once."""
    caplog.set_level(logging.WARNING, logger="trio_pd.membership")
    membership = EtcdMembership(etcd.url, ttl=TTL, internal_key=INTERNAL_KEY)
    real = EngineAnnouncement("decode-0", "decode", "http://127.0.0.1:8101", 1, "127.0.0.1:5601")
    attacker = "http://203.0.113.66:8100"
    seen: list[EngineSet] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(membership.hold_registration, real)
            first = await nursery.start(membership.watch_engines, seen.append)
            seen.append(first)
            assert first.decode == (real.url,)
            async with (
                EtcdClient(etcd.url, FAST) as client,
                watch_members(etcd.url, config=FAST, signing_key=KEY) as view,
            ):
                _, kv = await client.get(b"/trio_pd/decode/decode-0")
                assert kv is not None
                value = kv.value
                forged = value.replace(real.url.encode(), attacker.encode())
                # A copy of the real value with the URL changed, under a key of its own ...
                copy = forged.replace(b'"decode-0"', b'"decode-evil"')
                await client.put(b"/trio_pd/decode/decode-evil", copy)
                # ... and unsigned, as an attacker without the internal key writes it.
                plain = json.loads(value)
                del plain["signature"]
                plain.update(engine_id="decode-plain", url=attacker)
                await client.put(b"/trio_pd/decode/decode-plain", json.dumps(plain).encode())
                await wait_for(view, lambda: view.statistics().unverified == 2)
                # Overwriting the real engine's key: it is put back at once.
                await client.put(b"/trio_pd/decode/decode-0", forged)
                await wait_for(view, lambda: view.statistics().unverified == 3)
                await until_value(client, b"/trio_pd/decode/decode-0", value)
                await wait_for(view, lambda: ids(view) == {"decode-0"})
                # Deleting it: put back too.
                await client.delete(b"/trio_pd/decode/decode-0")
                await until_value(client, b"/trio_pd/decode/decode-0", value)
                await wait_for(view, lambda: ids(view) == {"decode-0"})
                assert [m.url for m in view.members()] == [real.url]
            nursery.cancel_scope.cancel()
    assert all(attacker not in engines.decode + engines.prefill for engines in seen), seen
    assert seen[-1].decode == (real.url,)
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("putting it back" in w for w in warnings) == 2
    # Once per bad version, in each of the two views (the proxy's and the test's).
    assert sum("does not verify" in w or "not signed" in w for w in warnings) == 2 * 3


async def test_a_value_left_out_unverified_sets_the_views_changed_event(
    etcd: EtcdServer,
) -> None:
    """A forged value changes no member but does change ``statistics().unverified``:
    ``changed`` fires for it, so waiting on the event for the count cannot hang
    (it did, when the forged value's event came after the waiter had read the count)."""
    forged = member("decode", 0).to_json(b"not the deployment's key")
    with trio.fail_after(30):
        async with (
            watch_members(etcd.url, config=FAST, signing_key=KEY) as view,
            EtcdClient(etcd.url, FAST) as client,
        ):
            changed = view.changed
            assert view.statistics().unverified == 0
            await client.put(member("decode", 0).key(PREFIX), forged)
            await changed.wait()
            assert view.statistics().unverified == 1
            assert view.members() == ()


async def until_value(client: EtcdClient, key: bytes, value: bytes | None) -> None:
    """Until ``key`` holds ``value`` (``None``: absent)."""
    while True:
        _, kv = await client.get(key)
        if (kv.value if kv else None) == value:
            return
        await trio.sleep(0.02)


async def test_an_engine_id_that_a_live_engine_holds_cannot_register(etcd: EtcdServer) -> None:
    """Fault 3: a second engine with the same id fails at start (etcd transaction);
    the first keeps its key, and a forged value squatting an id does not block it."""
    first = member("prefill", 0, incarnation="first")
    second = member("prefill", 0, incarnation="second", url="http://127.0.0.1:9999")
    with trio.fail_after(60):
        async with (
            watch_members(etcd.url, config=FAST, signing_key=KEY) as view,
            register(etcd.url, first, ttl=TTL, config=FAST, signing_key=KEY) as registration,
        ):
            with pytest.raises(MembershipError) as caught:
                async with register(etcd.url, second, ttl=TTL, config=FAST, signing_key=KEY):
                    pass  # pragma: no cover
            assert caught.value.cause == "conflict"
            assert "'prefill-0' is held by a live engine (http://127.0.0.1:8100" in str(
                caught.value
            )
            await trio.sleep(0.2)
            assert view.members() == (first,)
            assert (registration.registrations, registration.restorations) == (1, 0)
        # A value that is no registration of the deployment does not hold the id.
        async with EtcdClient(etcd.url, FAST) as client:
            await client.put(first.key(PREFIX), first.to_json())  # (unsigned)
            async with (
                watch_members(etcd.url, config=FAST, signing_key=KEY) as view,
                register(etcd.url, second, ttl=TTL, config=FAST, signing_key=KEY),
            ):
                await wait_for(view, lambda: view.members() == (second,))


async def test_an_engine_whose_id_was_taken_meanwhile_comes_back_when_the_other_leaves(
    etcd: EtcdServer,
) -> None:
    """Fault 3, the other way round: another engine registered the id (say our lease
    lapsed in a partition); ours waits, and is back once that one's key is gone."""
    first = member("decode", 0, incarnation="first")
    second = member("decode", 0, incarnation="second", url="http://127.0.0.1:9999")
    with trio.fail_after(60):
        async with (
            watch_members(etcd.url, config=FAST, signing_key=KEY) as view,
            register(etcd.url, first, ttl=TTL, config=FAST, signing_key=KEY) as registration,
            EtcdClient(etcd.url, FAST) as client,
        ):
            await wait_for(view, lambda: view.members() == (first,))
            lease = await client.grant(10)
            await client.put(second.key(PREFIX), second.to_json(KEY), lease=lease.id)
            await wait_for(view, lambda: view.members() == (second,))
            await trio.sleep(TTL)  # first's renewals see the id held, and leave it
            assert view.members() == (second,)
            assert registration.restorations == 0
            await client.revoke(lease.id)  # the other engine dies
            await wait_for(view, lambda: view.members() == (first,))
            await wait_until(lambda: registration.registrations == 2, 0.01)
            await trio.sleep(0.2)
            assert registration.restorations == 0  # (the other's delete was no attack)


ETCD_PASSWORD = "etcd-root-password-for-the-test"


async def test_etcd_with_tls_and_its_own_authentication(etcd: EtcdServer) -> None:
    """etcd as operators run it: HTTPS (a CA made by the test) and users; a token
    that expired is renewed; a wrong password or CA says so on entry."""
    del etcd  # (this test runs its own)
    with trio.fail_after(60):
        async with open_etcd(tls=True, password=ETCD_PASSWORD) as secure:
            assert secure.url.startswith("https://")
            access = EtcdAccess(ca_file=secure.ca_file, user="root", password=ETCD_PASSWORD)
            membership = EtcdMembership(
                secure.url,
                ttl=TTL,
                internal_key=INTERNAL_KEY,
                ca_file=secure.ca_file,
                user="root",
                password=ETCD_PASSWORD,
            )
            real = EngineAnnouncement("decode-0", "decode", "http://127.0.0.1:8101", 1)
            async with trio.open_nursery() as nursery:
                await nursery.start(membership.hold_registration, real)
                engines = await nursery.start(membership.watch_engines, lambda _: None)
                assert engines.decode == (real.url,)
                nursery.cancel_scope.cancel()
            async with EtcdClient(secure.url, FAST, access) as client:
                await client.put(b"/trio_pd/x", b"1")
                await trio.sleep(2.5)  # the token expires unused
                await client.put(b"/trio_pd/x", b"2")  # renewed
            for bad, cause, words in [
                (attrs.evolve(access, password="wrong"), "rejected", "authentication failed"),
                (EtcdAccess(user="root", password=ETCD_PASSWORD), "unreachable", "TLS: "),
                (EtcdAccess(ca_file=secure.ca_file), "rejected", "user name is empty"),
            ]:
                with pytest.raises(MembershipError) as caught:
                    async with register(secure.url, member("decode", 1), config=FAST, access=bad):
                        pass  # pragma: no cover
                assert caught.value.cause == cause
                assert words in str(caught.value)
                assert "\n" not in str(caught.value)
