"""The design page's task-tree picture (docs/diagrams/task-tree.dot) and its
table of the connector nursery's tasks are written by hand; this test keeps
them true. It opens a real connector (NIXL, ZeroMQ, CURVE on, so that every
task it can run is running: a handshake waits on a peer that never answers,
a request is held), walks trio's task tree, and checks that the tasks of the
connector's nursery are exactly the ones the picture draws in its producer
and consumer boxes, and the ones the table lists."""

from __future__ import annotations

import re
from pathlib import Path

import trio
import zmq

import trio_pd

from .conftest import kv_cache, wait_until

TASK_TREE = Path(__file__).parent.parent / "docs" / "diagrams" / "task-tree.dot"

DRAWN_AS = {
    "ZAP handler": "trio_pd._side_channel._zmq_channel.ZmqSideChannel.serve_auth",
    "listener": "trio_pd._producer._producer.Producer.serve_listener",
    "notification task": "trio_pd._producer._producer.Producer.collect_notifications",
    "handshake task": "trio_pd._consumer._pulls.Consumer.run_handshakes",
    "heartbeat task": "trio_pd._consumer._leases.Leases.run",
    "fetch workers": "trio_pd._consumer._fetch_queue.AttemptRunner._fetch_worker",
    "watchdog": "trio_pd._consumer._fetch_queue.AttemptRunner._watch_deadlines",
}
"""Each task box of the picture (its bold first line) and the function its task runs."""

KEYS = trio_pd.generate_keypair()


def drawn_tasks() -> set[str]:
    """The bold first lines of the boxes inside the picture's producer and
    consumer clusters: the connector's own tasks."""
    text = TASK_TREE.read_text()
    boxes: set[str] = set()
    for cluster in re.findall(r"subgraph cluster_\w+ \{(.*?)\n  \}", text, re.DOTALL):
        boxes |= set(re.findall(r"<b>([^<]+)</b>", cluster))
    return boxes


def tabled_tasks() -> set[str]:
    """The first column of design.md's table of the connector nursery's tasks."""
    text = (TASK_TREE.parent.parent / "design.md").read_text()
    table = text.split("| task | started | does | owns |", 1)[1].split("\n\n", 1)[0]
    return {row.split("|")[1].strip() for row in table.strip().splitlines()[1:]}


def connector_tasks() -> set[str]:
    """The names of the tasks in the one connector nursery that the current
    task opened (the nursery whose tasks include a listener)."""
    [names] = [
        names
        for nursery in trio.lowlevel.current_task().child_nurseries
        if DRAWN_AS["listener"] in (names := {child.name for child in nursery.child_tasks})
    ]
    return names


async def test_the_task_tree_picture_draws_every_task_of_the_connectors_nursery() -> None:
    auth = trio_pd.CurveAuth(
        public_key=KEYS[0],
        secret_key=KEYS[1],
        allowed_consumers={KEYS[0]},
        producer_keys={"*": KEYS[0]},
    )
    config = trio_pd.ConnectorConfig(auth=auth, handshake_timeout=30.0)
    # A peer that completes ZeroMQ's CURVE handshake (libzmq's I/O thread does
    # that) but never answers a request: the handshake to it waits, so its
    # fetch worker and the watchdog are running while the tree is walked.
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.curve_server = True
    silent.curve_secretkey = KEYS[1].encode()
    silent.curve_publickey = KEYS[0].encode()
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with trio.fail_after(30):
            async with (
                trio_pd.open_connector("tree", kv_cache(blocks=8), config=config) as connector,
                trio.open_nursery() as nursery,
            ):
                mine = connector.expose("r", [1])
                nowhere = trio_pd.RemoteBlocks("silent", "127.0.0.1", port, [0], "x", "i")
                nursery.start_soon(connector.pull, "waits", [0], nowhere)
                async with connector.hold(mine):
                    # (until the handshake's tasks started: a TooSlowError
                    # here means the fetch worker or the watchdog never ran)
                    transient = {DRAWN_AS["fetch workers"], DRAWN_AS["watchdog"]}
                    await wait_until(lambda: transient <= connector_tasks())
                    running = connector_tasks()
                nursery.cancel_scope.cancel()
    finally:
        silent.close()
        context.term()
    assert drawn_tasks() == set(DRAWN_AS), "the picture's task boxes changed: update DRAWN_AS"
    assert tabled_tasks() == set(DRAWN_AS), "design.md's table of the nursery's tasks differs"
    assert running == set(DRAWN_AS.values())
