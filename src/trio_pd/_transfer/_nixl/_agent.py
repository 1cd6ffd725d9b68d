"""The local NIXL agent's life: created with its memory registered, released at close.

Both run in worker threads (creating the first agent of a process starts
UCX: 0.4-1.6 s measured here).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from trio_pd._transfer._backend import BackendError
from trio_pd._transfer._nixl._errors import nixl_call
from trio_pd._transfer._nixl._remotes import release_remote

if TYPE_CHECKING:
    import torch

    from trio_pd._config import ConnectorConfig
    from trio_pd._core._layout import KVLayout

logger = logging.getLogger("trio_pd.nixl")


def create_agent(
    agent_name: str,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    config: ConnectorConfig,
) -> tuple[Any, Any, Any]:
    """Create the agent and its backends, register ``kv_caches`` and prepare
    the local descriptor list (a worker thread); on failure release what was made.

    Returns ``(agent, registration, local descriptor list)``.
    """
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = {
        "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    }[config.nixl_sync_mode]

    def create() -> Any:
        agent_config = nixl_agent_config(
            enable_prog_thread=config._tuning.nixl_progress_thread, backends=[], sync_mode=sync
        )
        return nixl_agent(agent_name, agent_config)

    agent = nixl_call(f"creating NIXL agent {agent_name!r}", create)
    for backend in config.nixl_backends:
        params = dict(config.nixl_backend_params.get(backend, {}))
        if config.nixl_num_threads and "num_threads" not in params:
            params["num_threads"] = str(config.nixl_num_threads)
            if backend == "UCX":
                params.setdefault("split_batch_size", "1")
        call = f"creating NIXL backend {backend!r} of agent {agent_name!r}"
        nixl_call(call, agent.create_backend, backend, params)
    # A tensor passed for several regions (layers that share a KV cache) is
    # registered once: registering it twice crashes NIXL on deregistration.
    unique = list({int(t.data_ptr()): t for t in kv_caches}.values())
    descriptors = layout.strided_descriptors()
    registration = nixl_call("registering KV caches", agent.register_memory, unique)
    try:
        local_dlist = nixl_call(
            "registering KV caches",
            agent.prep_xfer_dlist,
            "NIXL_INIT_AGENT",
            descriptors,
            layout.mem_type,
        )
    except BackendError:
        try:
            nixl_call("deregister_memory", agent.deregister_memory, registration)
        except BackendError as exc:
            logger.error("deregistering after a failed open: %s", exc)
        raise
    return agent, registration, local_dlist


def release_agent(
    agent_name: str,
    agent: Any,
    remotes: list[tuple[str, Any]],
    views: list[Any],
    local_dlist: Any,
    registration: Any,
) -> None:
    """Unload every remote agent, release the descriptor lists and deregister
    the memory (a worker thread, at close), best effort; log what failed."""
    errors: list[str] = []

    def attempt(what: str, fn: Callable[[], object]) -> None:
        try:
            nixl_call(what, fn)
        except BackendError as exc:  # best effort: release the rest regardless
            errors.append(f"{what}: {exc.nixl_error or exc}")

    for name, dlist in remotes:
        attempt(f"unload {name}", functools.partial(release_remote, agent, name, dlist))
    for handle in views:  # (and the transfer handles an inline read could not release)
        attempt("release a local view's list or a stuck transfer handle", handle.release)
    attempt("release local descriptor list", local_dlist.release)
    attempt("deregister memory", lambda: agent.deregister_memory(registration))
    if errors:
        logger.warning("agent %s closed with errors: %s", agent_name, "; ".join(errors))
