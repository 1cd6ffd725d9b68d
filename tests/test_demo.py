"""The main job, as a user runs it: ``trio-pd demo`` and ``trio-pd keygen``."""

from __future__ import annotations

import json
import os
import sys

import pytest
import trio

import trio_pd

SMALL = [
    "--prefill-engines", "2", "--requests", "12", "--regions", "4", "--blocks", "64",
    "--block-bytes", "4096", "--max-prompt-blocks", "8", "--json",
]  # fmt: skip


async def _run(*args: str) -> tuple[int, dict[str, object]]:
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, "-m", "trio_pd", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}


async def test_the_demo_pulls_and_verifies_every_request() -> None:
    code, summary = await _run("demo", *SMALL)
    assert code == 0
    assert summary["verified"] is True
    assert summary["requests_ok"] == 12
    assert summary["requests_failed"] == summary["requests_corrupt"] == 0
    assert summary["handshakes"] == 2
    assert summary["bytes_pulled"] > 0
    # After the run, the same pull through trio_pd and as one raw NIXL READ on
    # the decoder's own agent (the figures are machine-dependent: only that
    # both were measured, on the largest pull's blocks).
    assert summary["vs_raw_bytes"] == 8 * 4 * 4096
    assert summary["vs_raw_engine"] == "prefill-0"
    for key in ("vs_raw_trio_pd_gb_per_s", "vs_raw_nixl_gb_per_s", "trio_pd_vs_raw"):
        assert isinstance(summary[key], float), key
    assert summary["vs_raw_repetitions"] == 5


async def test_the_demo_survives_a_killed_engine_and_goes_on_behind_a_slow_link() -> None:
    # prefill-0 behind 50 ms of latency each way, prefill-1 killed after 4 requests
    code, summary = await _run(
        "demo", *SMALL, "--kill-engine-after", "4", "--slow-engine-delay", "0.05"
    )
    assert code == 0  # failures were injected: expected, reported, nothing corrupt
    assert summary["faults_injected"] is True
    assert summary["requests_corrupt"] == 0
    assert summary["requests_failed"] >= 1
    assert summary["requests_ok"] >= 4
    assert summary["errors"]
    assert all("prefill-1" in str(e) for e in summary["errors"])  # type: ignore[attr-defined]
    assert summary["handshake_ms_max"] >= 100  # several round trips of 2 x 50 ms
    # Per engine: the slow but healthy prefill-0 served all its requests, not
    # held up by the killed prefill-1; the pulls that read prefill-1 failed with
    # trio_pd's own errors (the engine died between its prefill and the pull).
    per_engine = summary["per_engine"]
    assert isinstance(per_engine, dict)
    healthy, killed = per_engine["prefill-0"], per_engine["prefill-1"]
    assert (healthy["requests_ok"], healthy["requests_failed"]) == (6, 0)
    assert healthy["pull_p99_ms"] < 5000  # not a handshake_timeout behind the dead engine
    assert killed["requests_failed"] >= 1
    by_type = summary["errors_by_type"]
    assert isinstance(by_type, dict)
    assert by_type.keys() & {"HandshakeError", "TransferError"}, by_type
    assert summary["vs_raw_engine"] == "prefill-0"  # (its pulls go through the slow link)


async def test_keygen_prints_a_usable_key_pair() -> None:
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "trio_pd", "keygen"], capture_stdout=True
        )
    keys = json.loads(done.stdout)
    auth = trio_pd.CurveAuth(public_key=keys["public_key"], secret_key=keys["secret_key"])
    assert auth.public_key == keys["public_key"]


async def test_the_demo_with_tensor_parallel_engines_verifies_every_head() -> None:
    code, summary = await _run("demo", *SMALL, "--prefill-tp", "2", "--decode-tp", "4")
    assert code == 0
    assert summary["verified"] is True
    assert summary["requests_ok"] == 12
    assert summary["requests_corrupt"] == 0
    assert (summary["prefill_tp"], summary["decode_tp"]) == (2, 4)
    assert summary["handshakes"] == 2 * 4  # each decode rank: its prefill rank of 2 engines
    assert summary["trio_pd_vs_raw"] is None  # (a rank's heads are not one READ)


async def test_the_demo_refuses_options_it_cannot_run() -> None:
    code, _ = await _run("demo", "--prefill-tp", "3")
    assert code != 0


@pytest.mark.test_hosts
async def test_the_demo_across_test_hosts_over_tcp() -> None:
    code, summary = await _run("demo", *SMALL, "--hosts", "2")
    assert code == 0
    assert summary["verified"] is True
    assert summary["hosts"] == 2
    assert summary["requests_ok"] == 12
