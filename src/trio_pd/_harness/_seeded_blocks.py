"""Deterministic block contents, for verification across processes (no I/O).

The producer fills a request's blocks from a seed; the consumer, knowing only
the seed, computes what it must have received and compares byte for byte. The
same seed gives the same bytes in every process (numpy's PCG64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch


def block_bytes(region: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A ``(num_blocks, bytes_per_block)`` uint8 view of one region."""
    import torch

    flat = region.view(torch.uint8) if region.element_size() > 1 else region
    arr: npt.NDArray[np.uint8] = flat.reshape(region.shape[0], -1).numpy()
    return arr.view(np.uint8)


def expected_blocks(
    seed: int, block_lens: Sequence[int], count: int
) -> list[npt.NDArray[np.uint8]]:
    """For each region, the ``(count, block_len)`` bytes that ``seed`` stands for."""
    return [
        np.random.default_rng([seed, region]).integers(
            0, 256, size=(count, block_len), dtype=np.uint8
        )
        for region, block_len in enumerate(block_lens)
    ]


def fill_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], seed: int) -> None:
    """Write ``seed``'s contents into ``block_ids`` of every region (CPU tensors)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    views = [block_bytes(t) for t in kv_caches]
    for view, content in zip(
        views, expected_blocks(seed, [v.shape[1] for v in views], ids.size), strict=True
    ):
        view[ids] = content


def mismatched_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], seed: int
) -> list[int]:
    """The ids among ``block_ids`` whose bytes differ from ``seed``'s contents."""
    ids = np.asarray(block_ids, dtype=np.int64)
    bad = np.zeros(ids.size, dtype=bool)
    views = [block_bytes(t) for t in kv_caches]
    for view, content in zip(
        views, expected_blocks(seed, [v.shape[1] for v in views], ids.size), strict=True
    ):
        bad |= (view[ids] != content).any(axis=1)
    out: list[int] = ids[bad].tolist()
    return out


# ---- head-aware contents, for tensor-parallel engines ------------------------
#
# With tensor parallelism a block's heads are spread over ranks, and a decode
# rank's block is assembled from parts of several prefill ranks' blocks (or a
# part of one). So the contents are defined per (region, block, *global*
# head): rank r of an engine holds global heads r*H .. r*H + H - 1. Any head
# that lands in the wrong place, block or rank is caught.

_MIX = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser: a fast, well-mixed hash of 64-bit integers."""
    with np.errstate(over="ignore"):
        x = x + _MIX
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def expected_heads(
    seed: int,
    region: int,
    block_ids: Sequence[int],
    global_heads: Sequence[int],
    head_bytes: int,
) -> npt.NDArray[np.uint8]:
    """The ``(len(block_ids), len(global_heads), head_bytes)`` bytes ``seed`` stands for."""
    blocks = np.asarray(block_ids, dtype=np.uint64)[:, None, None]
    heads = np.asarray(global_heads, dtype=np.uint64)[None, :, None]
    offsets = np.arange(head_bytes, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        start = np.asarray([(seed * 1_000_003 + region) % 2**64], dtype=np.uint64)
        key = _splitmix(start)
        key = _splitmix(key + blocks * np.uint64(0x100000001B3))
        key = _splitmix(key + heads * np.uint64(0xC2B2AE3D27D4EB4F))
        return (_splitmix(key + offsets) & np.uint64(0xFF)).astype(np.uint8)


def _head_bytes(region: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A ``(num_blocks, kv_heads, bytes_per_head)`` view of one region (HND)."""
    if region.dim() < 2:
        raise ValueError("head-aware contents need tensors shaped (blocks, kv_heads, ...)")
    return block_bytes(region).reshape(region.shape[0], region.shape[1], -1)


def fill_heads(
    kv_caches: Sequence[torch.Tensor], tp_rank: int, block_ids: Sequence[int], seed: int
) -> None:
    """Write ``seed``'s head-aware contents into ``block_ids`` of rank ``tp_rank``'s regions."""
    for region, tensor in enumerate(kv_caches):
        view = _head_bytes(tensor)
        heads = np.arange(view.shape[1]) + tp_rank * view.shape[1]
        view[np.asarray(block_ids, dtype=np.int64)] = expected_heads(
            seed, region, block_ids, heads, view.shape[2]
        )


def mismatched_heads(
    kv_caches: Sequence[torch.Tensor],
    tp_rank: int,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    seed: int,
) -> list[int]:
    """The ids among ``local_ids`` whose heads differ from what rank ``tp_rank`` must hold.

    ``local_ids[k]`` was pulled from the producer's ``remote_ids[k]``, which
    the producer ranks filled with :func:`fill_heads` and ``seed``.
    """
    local = np.asarray(local_ids, dtype=np.int64)
    bad = np.zeros(local.size, dtype=bool)
    for region, tensor in enumerate(kv_caches):
        view = _head_bytes(tensor)
        heads = np.arange(view.shape[1]) + tp_rank * view.shape[1]
        want = expected_heads(seed, region, remote_ids, heads, view.shape[2])
        bad |= (view[local] != want).reshape(local.size, -1).any(axis=1)
    out: list[int] = local[bad].tolist()
    return out
