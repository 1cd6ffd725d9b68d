"""pytest fixtures for suites that test code built on trio_pd.

Enable them in a ``conftest.py``::

    pytest_plugins = ["trio_pd.testing.fixtures"]

They need pytest-trio (``trio_mode = true``, or mark the tests ``@pytest.mark.trio``).

* ``memory_fabric``: a fresh :class:`~trio_pd.testing.MemoryFabric`; open
  connectors with ``backend=memory_fabric.backend`` (and
  ``side_channel=memory_fabric.side_channel`` to leave ZeroMQ out too, and
  run under pytest-trio's ``autojump_clock``) and inject faults with
  ``memory_fabric.faults(engine_id)`` or ``memory_fabric.cut(engine_id)``.
* ``prefill_engine``: a running prefill engine in its own process (real NIXL,
  real side channel): a :class:`~trio_pd.testing.PrefillWorker` with the
  default :class:`~trio_pd.testing.WorkerSpec` (engine ``"prefill-0"``, 4
  regions x 64 blocks of float16 ``(16, 128)``). Override the
  ``prefill_spec`` fixture to change it. ``prefill_engine.kill()`` injects a
  crash; ``prefill_engine.expose(...)`` gives ``RemoteBlocks`` to pull.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trio_pd._harness._prefill_spec import WorkerSpec
from trio_pd._harness._prefill_worker import PrefillWorker, open_prefill_worker
from trio_pd.testing._memory import MemoryFabric


@pytest.fixture
def memory_fabric() -> MemoryFabric:
    return MemoryFabric()


@pytest.fixture
def prefill_spec() -> WorkerSpec:
    return WorkerSpec("prefill-0")


@pytest.fixture
async def prefill_engine(prefill_spec: WorkerSpec) -> AsyncIterator[PrefillWorker]:
    async with open_prefill_worker(prefill_spec) as worker:
        yield worker
