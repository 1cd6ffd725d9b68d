"""Public records (RemoteBlocks) and ConnectorConfig validation (no I/O)."""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import attrs
import pytest

from trio_pd._config import ConnectorConfig, Tuning, tuned
from trio_pd._core._public_values import (
    ConnectorStatistics,
    ConsumerStatistics,
    ProducerStatistics,
    RemoteBlocks,
)

BLOCKS = RemoteBlocks(
    engine_id="prefill-0", host="10.0.0.7", port=5600, block_ids=[4, 2, 9], request_id="cmpl-1"
)
PARAMS: dict[str, Any] = {
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_block_ids": [4, 2, 9],
    "remote_request_id": "cmpl-1",
}


# --- RemoteBlocks --------------------------------------------------------------


def test_remote_blocks_converts_block_ids_to_an_int_tuple() -> None:
    assert BLOCKS.block_ids == (4, 2, 9)


def test_kv_transfer_params_use_vllm_key_names_plus_the_incarnation() -> None:
    assert BLOCKS.to_kv_transfer_params() == {
        **PARAMS,
        "remote_incarnation": "",
        "tp_size": 1,
        "remote_token": "",
        "remote_exposure": 0,
    }


@pytest.mark.parametrize("bad", [-1, "2", True, 2**63, 1.5])
def test_a_bad_remote_exposure_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="remote_exposure"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_exposure": bad})
    assert RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_exposure": None}).exposure == 0


def test_kv_transfer_params_carry_the_tp_size_and_default_it_to_one() -> None:
    blocks = attrs.evolve(BLOCKS, tp_size=4)
    assert blocks.to_kv_transfer_params()["tp_size"] == 4
    assert RemoteBlocks.from_kv_transfer_params(blocks.to_kv_transfer_params()) == blocks
    assert RemoteBlocks.from_kv_transfer_params(PARAMS).tp_size == 1


@pytest.mark.parametrize(
    ("tp_size", "match"),
    [
        (0, "tp_size must be an int >= 1"),
        ("2", "tp_size must be an int"),
        (True, "tp_size"),
        (64, "leaves the TCP port range"),
    ],
)
def test_kv_transfer_params_bad_tp_size_is_rejected(tp_size: object, match: str) -> None:
    params = {**PARAMS, "remote_port": 65500, "tp_size": tp_size}
    with pytest.raises(ValueError, match=match):
        RemoteBlocks.from_kv_transfer_params(params)


def test_kv_transfer_params_carry_the_incarnation() -> None:
    blocks = RemoteBlocks("prefill-0", "10.0.0.7", 5600, [1], "cmpl-1", "ab12")
    params = blocks.to_kv_transfer_params()
    assert params["remote_incarnation"] == "ab12"
    assert RemoteBlocks.from_kv_transfer_params(params) == blocks


def test_kv_transfer_params_non_string_incarnation_is_rejected() -> None:
    with pytest.raises(ValueError, match="remote_incarnation must be a string"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_incarnation": 7})


def test_kv_transfer_params_round_trip() -> None:
    assert RemoteBlocks.from_kv_transfer_params(BLOCKS.to_kv_transfer_params()) == BLOCKS


def test_kv_transfer_params_extra_keys_are_ignored() -> None:
    params = {**PARAMS, "do_remote_decode": True, "remote_tp_size": 2}
    assert RemoteBlocks.from_kv_transfer_params(params) == BLOCKS


def test_kv_transfer_params_accept_empty_and_tuple_block_ids() -> None:
    assert RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_block_ids": []}).block_ids == ()
    tup = RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_block_ids": (1, 2)})
    assert tup.block_ids == (1, 2)


@pytest.mark.parametrize("key", sorted(PARAMS))
def test_kv_transfer_params_missing_key_is_named(key: str) -> None:
    params = {k: v for k, v in PARAMS.items() if k != key}
    with pytest.raises(ValueError, match=f"lacks '{key}'"):
        RemoteBlocks.from_kv_transfer_params(params)


@pytest.mark.parametrize("port", [0, -1, 65536, True, False, 5600.0, "5600", None])
def test_kv_transfer_params_bad_port_is_rejected(port: object) -> None:
    with pytest.raises(ValueError, match="remote_port must be a TCP port"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_port": port})


@pytest.mark.parametrize("port", [1, 65535])
def test_kv_transfer_params_port_range_is_inclusive(port: int) -> None:
    assert RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_port": port}).port == port


@pytest.mark.parametrize("ids", [[1, 2.0], [1, "2"], [True], [1, None], "12"])
def test_kv_transfer_params_non_int_block_ids_are_rejected(ids: object) -> None:
    with pytest.raises(ValueError, match="remote_block_ids must be a list of ints"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_block_ids": ids})


@pytest.mark.parametrize("ids", [7, None])
def test_kv_transfer_params_non_list_block_ids_are_rejected(ids: object) -> None:
    with pytest.raises(ValueError, match="remote_block_ids"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_block_ids": ids})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_engine_id", 7),
        ("remote_host", None),
        ("remote_host", b"10.0.0.7"),
        ("remote_request_id", 1),
    ],
)
def test_kv_transfer_params_non_string_ids_are_rejected(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=r"must be (strings|a string)"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, key: value})


def test_remote_blocks_is_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        BLOCKS.port = 1  # type: ignore[misc]


# --- ConnectorConfig -----------------------------------------------------------


def test_config_defaults() -> None:
    c = ConnectorConfig()
    assert (c.handshake_timeout, c.transfer_timeout, c.abort_timeout, c.close_timeout) == (
        5.0,
        30.0,
        120.0,
        5.0,
    )
    assert (c.max_concurrent_fetches, c.max_message_bytes) == (8, 1 << 20)
    assert (c.notification_poll_interval, c.idle_notification_poll_interval) == (0.002, 0.05)
    assert c.compatibility_key == ""
    assert c.nixl_backends == ("UCX",)
    assert dict(c.nixl_backend_params) == {}
    assert (c.nixl_sync_mode, c.nixl_num_threads) == ("rw", 0)
    t = c._tuning
    assert (t.poll_interval, t.poll_spin, t.inline_read_spin) == (0.0001, 0.0001, 0.0005)
    assert (t.max_descriptors_per_transfer, t.resolved_history) == (8192, 4096)
    assert t.nixl_progress_thread is False


def test_config_accepts_valid_values() -> None:
    c = ConnectorConfig(
        handshake_timeout=1,
        max_concurrent_fetches=1,
        nixl_backends=["UCX", "GDS"],
        nixl_sync_mode="strict",
        nixl_num_threads=4,
    )
    assert (c.handshake_timeout, c.max_concurrent_fetches) == (1, 1)
    assert c.nixl_backends == ("UCX", "GDS")
    assert (c.nixl_sync_mode, c.nixl_num_threads) == ("strict", 4)


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        ConnectorConfig(5.0)  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ConnectorConfig().handshake_timeout = 1.0  # type: ignore[misc]


POSITIVE = [
    "handshake_timeout",
    "transfer_timeout",
    "abort_timeout",
    "close_timeout",
    "notification_poll_interval",
    "idle_notification_poll_interval",
]


@pytest.mark.parametrize("name", POSITIVE)
@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, "5", None])
def test_config_timeouts_must_be_finite_and_positive(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0"):
        ConnectorConfig(**{name: value})


@pytest.mark.parametrize("name", ["max_concurrent_fetches", "max_message_bytes"])
@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "8", None])
def test_config_counts_must_be_ints_of_at_least_one(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        ConnectorConfig(**{name: value})


@pytest.mark.parametrize("mode", ["none", "RW", "", None])
def test_config_rejects_other_nixl_sync_modes(mode: object) -> None:
    with pytest.raises(ValueError, match="nixl_sync_mode"):
        ConnectorConfig(nixl_sync_mode=mode)  # type: ignore[arg-type]


def test_config_rejects_negative_nixl_num_threads() -> None:
    with pytest.raises(ValueError, match="nixl_num_threads"):
        ConnectorConfig(nixl_num_threads=-1)


def test_config_backend_params_are_frozen_copies_of_strings() -> None:
    source = {"UCX": {"ucx_error_handling_mode": "peer", "num_workers": 4}}
    c = ConnectorConfig(nixl_backend_params=source)
    assert c.nixl_backend_params == {"UCX": {"ucx_error_handling_mode": "peer", "num_workers": "4"}}
    source["UCX"]["num_workers"] = 8
    source["GDS"] = {}
    assert c.nixl_backend_params["UCX"]["num_workers"] == "4"
    assert "GDS" not in c.nixl_backend_params
    with pytest.raises(TypeError):
        c.nixl_backend_params["GDS"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        c.nixl_backend_params["UCX"]["num_workers"] = "1"  # type: ignore[index]


@pytest.mark.parametrize("value", [True, 1.5])
def test_config_nixl_num_threads_rejects_bools_and_floats(value: object) -> None:
    with pytest.raises(ValueError, match="nixl_num_threads"):
        ConnectorConfig(nixl_num_threads=value)  # type: ignore[arg-type]


def test_config_nixl_num_threads_rejects_strings() -> None:
    with pytest.raises(ValueError, match="nixl_num_threads"):
        ConnectorConfig(nixl_num_threads="2")  # type: ignore[arg-type]


# --- Tuning: the internal knobs a config carries --------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "poll_interval",
        "poll_spin",
        "inline_read_spin",
        "max_descriptors_per_transfer",
        "resolved_history",
        "nixl_progress_thread",
    ],
)
def test_the_tuning_knobs_are_not_public_config_fields(name: str) -> None:
    assert name not in attrs.fields_dict(ConnectorConfig)
    with pytest.raises(TypeError):
        ConnectorConfig(**{name: attrs.fields_dict(Tuning)[name].default})


def test_tuned_changes_only_the_knobs_named() -> None:
    base = ConnectorConfig(handshake_timeout=2.0)
    c = tuned(base, poll_spin=0, resolved_history=8)
    assert (c._tuning.poll_spin, c._tuning.resolved_history) == (0, 8)
    assert c._tuning.inline_read_spin == base._tuning.inline_read_spin
    assert attrs.evolve(c, _tuning=base._tuning) == base
    assert attrs.evolve(c, handshake_timeout=3.0)._tuning == c._tuning
    assert c != base


def test_tuning_interval_must_be_finite_and_positive() -> None:
    for value in [0, -1.0, math.nan, math.inf, "5", None]:
        with pytest.raises(ValueError, match="poll_interval must be a finite number > 0"):
            Tuning(poll_interval=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["poll_spin", "inline_read_spin"])
@pytest.mark.parametrize("value", [-0.001, math.nan, math.inf, "0"])
def test_tuning_spins_must_be_finite_and_non_negative(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
        Tuning(**{name: value})


@pytest.mark.parametrize("name", ["max_descriptors_per_transfer", "resolved_history"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0, None])
def test_tuning_counts_must_be_ints_of_at_least_one(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        Tuning(**{name: value})


def test_vllm_style_nulls_mean_absent_and_a_token_must_be_a_string() -> None:
    params = {**PARAMS, "remote_incarnation": None, "remote_token": None, "tp_size": None}
    parsed = RemoteBlocks.from_kv_transfer_params(params)
    assert (parsed.incarnation, parsed.token, parsed.tp_size) == ("", "", 1)
    signed = RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_token": "ab" * 16})
    assert signed.token == "ab" * 16
    assert RemoteBlocks.from_kv_transfer_params(signed.to_kv_transfer_params()) == signed
    with pytest.raises(ValueError, match="remote_token"):
        RemoteBlocks.from_kv_transfer_params({**PARAMS, "remote_token": 7})


# --- statistics ------------------------------------------------------------------


def _roles() -> tuple[ConsumerStatistics, ProducerStatistics]:
    consumer = ConsumerStatistics(
        **{
            f.name: {"timeout": 2} if f.name == "handshake_failures_by_cause" else i + 1
            for i, f in enumerate(attrs.fields(ConsumerStatistics))
            if f.name != "backend_stuck_call"
        },
        backend_stuck_call="add_remote_agent",
    )
    producer = ProducerStatistics(
        **{f.name: 100 + i for i, f in enumerate(attrs.fields(ProducerStatistics))}
    )
    return consumer, producer


def test_connector_statistics_are_both_roles_counters_flat() -> None:
    consumer, producer = _roles()
    stats = ConnectorStatistics.of_roles(consumer, producer)
    assert (stats.pulls_succeeded, stats.exposures_released) == (
        consumer.pulls_succeeded,
        producer.exposures_released,
    )
    assert stats.handshake_failures_by_cause == {"timeout": 2}
    assert stats.backend_stuck_call == "add_remote_agent"
    assert (stats.consumer, stats.producer) == (consumer, producer)
    assert type(stats.consumer) is ConsumerStatistics
    assert stats == ConnectorStatistics.of_roles(consumer, producer)
    assert stats != ConnectorStatistics.of_roles(consumer, attrs.evolve(producer, confirmations=0))
    assert stats != consumer  # (equal only to a ConnectorStatistics)
    names = [f.name for f in attrs.fields(ConnectorStatistics)]
    roles = [
        f.name for role in (ConsumerStatistics, ProducerStatistics) for f in attrs.fields(role)
    ]
    assert names == roles  # each counter declared once, in its role; consumer first
    with pytest.raises(TypeError):
        ConsumerStatistics(*attrs.astuple(consumer, recurse=False))  # type: ignore[misc]


@pytest.mark.parametrize("cls", [ConsumerStatistics, ProducerStatistics, ConnectorStatistics])
def test_every_counter_is_described_once_in_its_docstring(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    described = re.findall(r"^    (\w+): ", doc[doc.index("Attributes:") :], re.M)
    assert described == [f.name for f in attrs.fields(cls)]
