"""A serving process's heap after start-up: out of the garbage collector's way.

Every serving process -- ``trio-pd engine``'s (:func:`~.process.serve_engine`
with ``freeze_heap``), the proxy's in ``trio-pd proxy`` and ``trio-pd serve``
(:func:`~trio_pd._cli.proxy.serve_proxy` with ``freeze_heap``) -- calls
:func:`freeze_start_up_heap` once it has started, before it reports ready;
the demo and the benchmarks do the same, and an embedding server should
too (docs/performance.md, "The garbage collector"). Neither function does it
unless asked: a caller whose process goes on with other work (a test, say)
would freeze that work's objects with it.
"""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> None:
    """Collect once, then :func:`gc.freeze` every object left, so that a full
    collection later scans only what was made since.

    A full collection of an engine process's heap (torch's and numpy's
    modules, the model, hypercorn, httpx2, the connectors: about 180,000
    tracked objects) took 79-95 ms on the trio thread on this project's
    2-core machine; after the freeze, under 0.1 ms. Python runs one whenever
    the objects that survived the younger collections since the last one
    reach a quarter of the long-lived ones: rarely in steady serving, but
    each one stalls every request in flight. What it costs: cycles among
    start-up objects that become garbage later are never collected (start-up
    objects live as long as the process anyway). The collection before the
    freeze takes as long as a full one, once."""
    gc.collect()
    gc.freeze()
