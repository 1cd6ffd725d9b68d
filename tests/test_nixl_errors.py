"""NIXL's exceptions at the backend boundary: the one table, and the chaining rule.

NIXL's exception classes live in a CUDA-specific binding module, so the
table (``_transfer._nixl._errors``) knows them by class name; these tests
raise stand-ins of the same names. The rule under test: the mapped
:class:`BackendError` names the call and NIXL's error, and chains nothing
(NIXL's exception is neither its ``__cause__`` nor its ``__context__``: its
traceback would keep the calling thread's frames, and the NIXL handles in
them, alive). The reads run through a real :class:`NixlBackend` (its driver
thread, its inline reads) on the scripted agent of ``test_driver``; the
real-NIXL failures (a killed producer) are in ``test_inline`` and
``test_failures``.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import attrs
import numpy as np
import pytest
import trio

import trio_pd
from trio_pd._core._layout import layout_of_tensors
from trio_pd._core._protocol import encode_notification
from trio_pd._transfer._backend import BackendClosing, BackendError, RemoteAgent, TransferTimeout
from trio_pd._transfer._nixl._errors import NIXL_ERRORS, nixl_call, nixl_error, release_or_keep
from trio_pd._transfer._nixl._notifications import NotificationPoller

from .conftest import kv_cache
from .test_driver import CONFIG, Handle, ScriptedAgent


def nixl_exception(name: str, message: str = "") -> Exception:
    """An instance of a stand-in class named like one of NIXL's."""
    cls: type[Exception] = type(name, (Exception,), {})
    return cls(message)


class nixlRemoteDisconnectError(Exception):
    """Named as NIXL's (the table knows NIXL's classes by name)."""


# ---- the table --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NIXL_ERRORS))
def test_each_nixl_error_type_maps_to_a_backend_error_naming_the_call_and_the_error(
    name: str,
) -> None:
    error = nixl_error("make_prepped_xfer", nixl_exception(name, "NIXL_ERR_SOMETHING"))
    assert type(error) is BackendError
    assert str(error) == f"make_prepped_xfer: {name}: NIXL_ERR_SOMETHING"
    assert error.nixl_error == f"{name}: NIXL_ERR_SOMETHING"
    assert error.peer_lost is (name == "nixlRemoteDisconnectError")
    assert error.settled is None


def test_a_remote_disconnect_means_the_peer_is_lost() -> None:
    error = nixl_error("transfer", nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"))
    assert error.peer_lost
    assert str(error) == "transfer: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"


@pytest.mark.parametrize(
    ("exc", "text"),
    [
        (ValueError("odd"), "ValueError: odd"),
        (nixl_exception("nixlBrandNewError"), "nixlBrandNewError"),
    ],
)
def test_an_unknown_exception_maps_to_a_plain_backend_error_naming_it(
    exc: Exception, text: str
) -> None:
    error = nixl_error("send_notif", exc)
    assert type(error) is BackendError
    assert str(error) == f"send_notif: {text}"
    assert error.nixl_error == text
    assert not error.peer_lost


def test_the_table_knows_every_exception_type_of_the_installed_nixl() -> None:
    """A NIXL release that adds a type fails here: decide what it means."""
    bindings = pytest.importorskip("nixl._bindings")
    names = {
        name
        for name, value in vars(bindings).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    assert "nixlRemoteDisconnectError" in names
    assert names <= set(NIXL_ERRORS)


# ---- the chaining rule ------------------------------------------------------------


class Pinned:
    """What a NIXL call's frame holds (a handle, which holds the agent)."""


def fails_holding(pinned: list[weakref.ref[Pinned]], name: str) -> Callable[[], NoReturn]:
    """A NIXL call that fails with ``name``, a handle in its frame."""

    def call() -> NoReturn:
        handle = Pinned()  # (a local of the frame NIXL's traceback keeps)
        pinned.append(weakref.ref(handle))
        raise nixl_exception(name, "NIXL_ERR_REMOTE_DISCONNECT")

    return call


def test_a_mapped_error_chains_nothing_and_keeps_nothing_of_the_call_alive() -> None:
    pinned: list[weakref.ref[Pinned]] = []
    with pytest.raises(BackendError) as info:
        nixl_call("check_xfer_state", fails_holding(pinned, "nixlRemoteDisconnectError"))
    error = info.value
    assert error.__cause__ is None
    assert error.__context__ is None  # (not merely suppressed)
    assert str(error) == "check_xfer_state: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"
    assert error.peer_lost
    gc.collect()
    assert pinned[0]() is None  # the caller holds the error, and nothing of NIXL's frames


def test_a_mapped_error_raised_while_handling_another_chains_that_one_only() -> None:
    def release_in_a_handler() -> None:
        try:
            raise KeyError("the caller's own")
        except KeyError:
            nixl_call("release", fails_holding([], "nixlNotFoundError"))

    with pytest.raises(BackendError) as info:
        release_in_a_handler()
    assert isinstance(info.value.__context__, KeyError)
    assert info.value.__context__.__context__ is None


@pytest.mark.parametrize(
    "own", [BackendError("already mapped"), TransferTimeout(), BackendClosing()], ids=repr
)
def test_trio_pds_own_exceptions_pass_through_unchanged(own: Exception) -> None:
    def call() -> NoReturn:
        raise own

    with pytest.raises(type(own)) as info:
        nixl_call("anything", call)
    assert info.value is own


def test_a_call_that_succeeds_returns_its_result() -> None:
    assert nixl_call("get_agent_metadata", lambda: b"metadata") == b"metadata"


async def test_a_notification_poll_raises_the_mapped_error() -> None:
    class Failing:
        def get_new_notifs(self) -> NoReturn:
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    poller = NotificationPoller(lambda: Failing(), CONFIG, threading.Event(), in_a_thread)
    with pytest.raises(BackendError) as info:
        await poller.notifications(0.0)
    assert (
        str(info.value) == "get_new_notifs: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"
    )
    assert info.value.peer_lost
    assert (info.value.__cause__, info.value.__context__) == (None, None)


async def in_a_thread(limiter: trio.CapacityLimiter, fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)


# ---- what a read raises (a NixlBackend on a scripted agent) -------------------------


class Releasable:
    def release(self) -> None:
        pass


class Agent(ScriptedAgent):
    """The scripted agent, with what a backend's own life needs besides."""

    name = "scripted"

    def deregister_memory(self, registration: object) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        pass


@asynccontextmanager
async def nixl_backend(
    agent: Agent, config: trio_pd.ConnectorConfig = CONFIG
) -> AsyncIterator[tuple[trio_pd.NixlBackend, RemoteAgent]]:
    layout = layout_of_tensors(kv_cache(regions=1, blocks=8, block_shape=(64,)))
    backend = trio_pd.NixlBackend(agent, Releasable(), Releasable(), layout, config)
    remote = RemoteAgent("p", "i1", "producer", layout, layout, Releasable(), Releasable())
    remote.posted = True  # (read from before: its READs may go inline)
    try:
        yield backend, remote
    finally:
        backend.begin_close()
        with trio.fail_after(5, shield=True):
            await backend.aclose()


async def read(backend: trio_pd.NixlBackend, remote: RemoteAgent, blocks: list[int]) -> None:
    indices = np.asarray(blocks, dtype=np.int32)
    await backend.read(remote, indices, indices, encode_notification("r"))


INLINE = CONFIG
DRIVER = attrs.evolve(CONFIG, inline_read_bytes=0)


@pytest.mark.parametrize("config", [INLINE, DRIVER], ids=["inline", "driver"])
@pytest.mark.parametrize("where", ["make_prepped_xfer", "transfer", "check_xfer_state"])
async def test_a_read_raises_the_mapped_error_chaining_nothing(
    config: trio_pd.ConnectorConfig, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = Agent()

    def disconnected(*args: object) -> NoReturn:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    monkeypatch.setattr(agent, where, disconnected)
    with trio.fail_after(5):
        async with nixl_backend(agent, config) as (backend, remote):
            with pytest.raises(BackendError) as info:
                await read(backend, remote, [1])
            assert backend.reads_inline == (
                1 if config is INLINE and where != "make_prepped_xfer" else 0
            )
    error = info.value
    assert str(error) == f"{where}: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"
    assert error.peer_lost
    assert error.nixl_error == "nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"
    assert (error.__cause__, error.__context__) == (None, None)


async def test_a_read_past_its_deadline_raises_transfer_timeout() -> None:
    agent = Agent()
    agent.transfer_seconds = 0.1
    agent.script = lambda handle: setattr(handle, "polls", 2)
    config = attrs.evolve(DRIVER, transfer_timeout=0.05)
    with trio.fail_after(5):
        async with nixl_backend(agent, config) as (backend, remote):
            with pytest.raises(TransferTimeout) as info:
                await read(backend, remote, [1])
    assert (info.value.__cause__, info.value.__context__) == (None, None)


async def test_a_cancelled_read_raises_cancelled_not_an_error() -> None:
    agent = Agent()
    ends = threading.Event()
    agent.script = lambda handle: setattr(handle, "forever", ends)

    async def end_after_the_cancel() -> None:
        await trio.sleep(0.1)
        ends.set()

    with trio.fail_after(5):
        async with nixl_backend(agent, DRIVER) as (backend, remote):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(end_after_the_cancel)
                with trio.move_on_after(0.05) as scope:
                    await read(backend, remote, [1])  # (waits, shielded, for the end)
            assert scope.cancelled_caught
            [handle] = agent.posted
            assert handle.released
            assert backend.transfers_unsettled == 0


async def test_a_read_of_a_closing_backend_raises_backend_closing() -> None:
    agent = Agent()
    agent.script = lambda handle: setattr(handle, "polls", 10)
    with trio.fail_after(5):
        async with nixl_backend(agent, DRIVER) as (backend, remote):
            backend.begin_close()
            with pytest.raises(BackendClosing):
                await read(backend, remote, [1])


def test_a_handle_nixl_refuses_to_release_is_kept_and_logged_with_nixls_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(self: Handle) -> NoReturn:
        raise nixl_exception("nixlNotAllowedError", "still running")

    monkeypatch.setattr(Handle, "release", refuse)
    handle, kept = Handle([1], b""), []
    release_or_keep(handle, kept)
    assert kept == [handle]
    assert (
        "transfer handle could not be released (nixlNotAllowedError: still running); "
        "kept until close"
    ) in caplog.text
