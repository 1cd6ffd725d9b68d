"""Children driven over pipes, forked from the fork server or exec'd
(``trio_pd._harness._child_process``): both ways give the child the same
pipes, environment, working directory and exit status, and the parent can
kill and reap it."""

from __future__ import annotations

import json
import os
import signal
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from trio_pd._harness._child_process import ForkedChild, open_child, read_lines

MODULE = "tests.child_echo"
ROOT = str(Path(__file__).resolve().parents[1])


def env(**more: str) -> dict[str, str]:
    """The child's additions: this repository on its path (for ``tests``)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **more}


@pytest.fixture(params=["forked", "exec'd"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TRIO_PD_FORK_SERVER", "1" if request.param == "forked" else "0")
    return str(request.param)


async def _lines(process: object, n: int) -> list[bytes]:
    got = []
    async with aclosing(read_lines(process.stdout)) as lines:  # type: ignore[attr-defined]
        async for line in lines:
            got.append(line)
            if len(got) == n:
                break
    return got


async def test_a_child_gets_its_pipes_environment_directory_and_exit_status(
    way: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with trio.fail_after(60):
        async with open_child(MODULE, json.dumps({"exit": 3}), env=env(ECHO_ENV=way)) as child:
            assert isinstance(child, ForkedChild) == (way == "forked")
            assert child.pid != os.getpid()
            assert child.stdin is not None
            await child.stdin.send_all(b"hello\n")
            hello, echoed = await _lines(child, 2)
            assert json.loads(hello) == {"pid": child.pid, "cwd": str(tmp_path), "env": way}
            assert echoed == b"HELLO"
            await child.stdin.aclose()
            assert await child.wait() == 3
            assert child.returncode == 3


async def test_a_child_that_raises_exits_1_and_one_killed_is_reaped(
    way: str,
) -> None:
    with trio.fail_after(60):
        async with open_child(MODULE, "{}", env=env()) as child:
            assert child.stdin is not None
            await child.stdin.send_all(b"raise\n")
            assert await child.wait() == 1
        async with open_child(MODULE, "{}", env=env()) as child:
            await _lines(child, 1)
            child.kill()
            assert await child.wait() == -signal.SIGKILL
            child.kill()  # (reaped: nothing to signal, no error)
