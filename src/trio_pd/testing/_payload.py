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
