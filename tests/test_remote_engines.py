"""The consumer's table of remote engine records (``_remote_table.RemoteEngines``): no I/O."""

from __future__ import annotations

from collections.abc import ItemsView

import pytest

import trio_pd._consumer._remote_table as remote_engines
from trio_pd import EngineState, RemoteBlocks
from trio_pd._consumer._remote_table import RemoteEngines
from trio_pd._core._tensor_parallel import PullPart


def _remote(
    engine_id: str = "p", host: str = "10.0.0.1", port: int = 5000, tp: int = 1
) -> RemoteBlocks:
    return RemoteBlocks(engine_id, host, port, (0,), "r", "inc", tp_size=tp)


def test_a_record_per_rank_and_per_address_a_request_names() -> None:
    table = RemoteEngines()
    real = table.get_or_create(_remote(), PullPart(0), verify_interval=0.5)
    assert table.get_or_create(_remote(), PullPart(0), verify_interval=0.5) is real
    assert real.record.verify_interval == 0.5
    forged = table.get_or_create(_remote(port=6000), PullPart(0), verify_interval=0.5)
    rank_1 = table.get_or_create(_remote(tp=2), PullPart(1), verify_interval=0.5)
    assert len({id(real), id(forged), id(rank_1)}) == 3
    assert (rank_1.record.port, rank_1.remote_tp) == (5001, 2)
    assert ("p", "10.0.0.1", 5001, 2, 1) in table
    assert table[("p", "10.0.0.1", 5000, 1, 0)] is real


def test_an_engine_s_state_is_its_record_in_service_else_the_latest() -> None:
    table = RemoteEngines()
    assert table.engine_state("p") is EngineState.UNKNOWN
    real = table.get_or_create(_remote(), PullPart(0), verify_interval=0.5)
    table.get_or_create(_remote(port=6000), PullPart(0), verify_interval=0.5)
    real.record.state = EngineState.READY
    assert table.engine_state("p") is EngineState.READY  # (the forged one is later)
    assert table.ready_count() == 1
    real.record.state = EngineState.BACKOFF
    assert table.engine_state("p") is EngineState.UNKNOWN  # the latest: the forged one
    assert table.ready_count() == 0


def test_the_ranks_of_an_engine_are_those_at_its_base_port_and_tp_size() -> None:
    table = RemoteEngines()
    ranks = [table.get_or_create(_remote(tp=2), PullPart(r), verify_interval=0.5) for r in (0, 1)]
    table.get_or_create(_remote(tp=1), PullPart(0), verify_interval=0.5)  # another TP size
    table.get_or_create(_remote(port=7000, tp=2), PullPart(1), verify_interval=0.5)  # elsewhere
    assert table.ranks_of("p", "10.0.0.1", 2, 5000) == [(0, ranks[0]), (1, ranks[1])]


def test_past_the_bound_idle_records_are_forgotten_and_those_in_service_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote_engines, "MAX_RECORDS", 3)
    table = RemoteEngines()
    ready = table.get_or_create(_remote("a"), PullPart(0), verify_interval=0.5)
    ready.record.state = EngineState.READY
    for engine_id in ("b", "c"):
        table.get_or_create(_remote(engine_id), PullPart(0), verify_interval=0.5)
    assert len(table) == 3
    table.get_or_create(_remote("d"), PullPart(0), verify_interval=0.5)
    assert sorted(key[0] for key in table) == ["a", "d"]


def test_a_storm_of_engines_none_idle_costs_each_new_record_constant_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Thousands of (forged) engine ids at once, every one with an attempt in
    # flight: nothing is idle, so a pass that forgets idle records finds
    # nothing. Scanning the whole table again for every new record made the
    # storm quadratic (20,000 records in flight: 15 s of a blocked trio loop here).
    monkeypatch.setattr(remote_engines, "MAX_RECORDS", 8)
    examined = 0

    class Counting(dict[remote_engines.EngineKey, remote_engines.RemoteEngine]):
        def items(self) -> ItemsView[remote_engines.EngineKey, remote_engines.RemoteEngine]:  # type: ignore[override]
            nonlocal examined
            examined += len(self)
            return super().items()

    table = RemoteEngines()
    table._by_key = Counting()
    for i in range(2000):
        engine = table.get_or_create(_remote(f"e{i}"), PullPart(0), verify_interval=0.5)
        engine.record.state = EngineState.FETCHING
    assert len(table) == 2000  # (all in flight: none forgotten)
    assert examined <= 4 * 2000
    # Once they are idle, they are forgotten before the table doubles.
    for engine in table.values():
        engine.record.state = EngineState.BACKOFF
    for i in range(2000):
        engine = table.get_or_create(_remote(f"later{i}"), PullPart(0), verify_interval=0.5)
        engine.record.state = EngineState.BACKOFF
        if len(table) < 2000:
            break
    assert len(table) < 2000
    assert examined <= 4 * 4000
