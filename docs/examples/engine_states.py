"""Drive a remote engine's state machine by hand: no trio, no sockets, no NIXL.

``trio_pd._engines`` is sans-IO: it takes the time as an argument and returns
what to do, so every rule can be exercised in a plain function, like this.
(It is an internal module: this example is for contributors.)

Run it with ``python docs/examples/engine_states.py``.
"""

from __future__ import annotations

import random

import msgspec

from trio_pd._engines import Backoff, EngineEvent, EngineRecord, InvalidTransition
from trio_pd._errors import HandshakeError
from trio_pd._protocol import EngineMetadata


def show(record: EngineRecord, what: str) -> None:
    print(f"{what:<36} -> {record.state.name}")


def main() -> None:
    rng = random.Random(0)
    backoff = Backoff(initial=1.0, maximum=30.0, jitter=0.0)
    record = EngineRecord("prefill-0", "10.0.0.7", 5600)
    show(record, "new record")

    action = record.on_pull("", now=0.0)
    show(record, f"pull at t=0 says {action.name}")

    error = HandshakeError("prefill-0", "no reply within 5 s")
    delay = record.failed(error, now=5.0, backoff=backoff, rng=rng)
    show(record, f"handshake failed, retry in {delay:g} s")

    action = record.on_pull("", now=5.5)
    show(record, f"pull at t=5.5 says {action.name}")

    action = record.on_pull("", now=6.5)
    show(record, f"pull at t=6.5 says {action.name}")

    metadata = EngineMetadata(
        engine_id="prefill-0",
        incarnation="a1b2",
        agent_name="prefill-0#a1b2",
        agent_metadata=b"...",
        num_blocks=64,
        base_addrs=[4096],
        block_lens=[2048],
        device_id=0,
        mem_type="DRAM",
        dtype="torch.float16",
        kv_heads=0,
        tp_rank=0,
        tp_size=1,
    )
    record.metadata_received(metadata, metadata.layout())
    show(record, "metadata received")
    record.loaded()
    show(record, "remote agent loaded")

    action = record.on_pull("a1b2", now=7.0)
    show(record, f"pull of a1b2 says {action.name}")

    # A request names another incarnation: forged, or the engine restarted.
    action = record.on_pull("f0f0", now=8.0)
    show(record, f"pull of f0f0 says {action.name}")
    outcome = record.metadata_received(metadata, metadata.layout())  # still a1b2
    show(record, f"the engine answers a1b2: {outcome.name}")
    action = record.on_pull("f0f0", now=8.1)
    print(f"pull of f0f0 says {action.name}:", record.why_gone("f0f0"))
    action = record.on_pull("e5e5", now=8.2)
    print(f"pull of e5e5 (within the interval) says {action.name}")

    restarted = msgspec.structs.replace(metadata, incarnation="c3d4", agent_name="prefill-0#c3d4")
    action = record.on_pull("c3d4", now=9.5)
    show(record, f"pull of c3d4 says {action.name}")
    outcome = record.metadata_received(restarted, restarted.layout())
    show(record, f"the engine answers c3d4: {outcome.name}")
    record.loaded()
    print("retired incarnations:", list(record.retired_incarnations))
    action = record.on_pull("a1b2", now=9.6)
    print(f"pull of a1b2 says {action.name}:", record.why_gone("a1b2"))

    try:
        record.apply(EngineEvent.LOADED)  # not in TRANSITIONS: a bug
    except InvalidTransition as exc:
        print("InvalidTransition:", exc)


if __name__ == "__main__":
    main()
