"""KV-cache layout and descriptor math (no I/O).

A *region* is one registered KV tensor (a layer's K, say); dimension 0 of every
region indexes blocks, and all regions have the same number of blocks. Block
``b`` of region ``r`` is the byte range ``base[r] + b * block_len[r]`` of length
``block_len[r]``. NIXL descriptor lists hold one descriptor per (region, block),
region-major: descriptor index ``r * num_blocks + b``. A pull of blocks
``src`` into blocks ``dst`` pairs local index ``r * n_local + dst[k]`` with remote
index ``r * n_remote + src[k]`` for every region ``r``: the same order on both
sides, so the k-th local descriptor receives the k-th remote one.

Everything here is vectorised with numpy: no per-block Python loops.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

BlockIds = npt.NDArray[np.int64]
"""A validated one-dimensional array of block ids."""

_INDEX_LIMIT = np.iinfo(np.int32).max


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


_SHARED_NAMES: dict[str, str] = {
    name: name
    for name in (
        "DRAM",
        "VRAM",
        *(
            f"torch.{kind}"
            for kind in (
                "float16",
                "bfloat16",
                "float32",
                "float64",
                "float8_e4m3fn",
                "float8_e4m3fnuz",
                "float8_e5m2",
                "float8_e5m2fnuz",
                "uint8",
                "int8",
                "int16",
                "int32",
                "int64",
                "bool",
            )
        ),
    )
}
"""The dtypes and memory types a layout shares one string of (a decoder keeps a
layout per remote engine). Not ``sys.intern``: a peer names these in its reply,
and interned strings are never freed on some interpreters (free-threaded builds,
early CPython 3.12 releases); a name not here is kept as given."""


def _shared_name(name: str) -> str:
    return _SHARED_NAMES.get(name, name)


@attrs.frozen
class KVLayout:
    """Where a KV cache lies in memory, as NIXL needs to know it.

    A layout may also be a *view* of the heads of every block (see
    :meth:`head_slice`): then each block is ``block_lens[r]`` bytes at
    ``base_addrs[r] + b * block_strides[r]``.

    Attributes:
        base_addrs: start address of each region.
        block_lens: bytes per block of each region.
        num_blocks: blocks per region (the same for all regions).
        device_id: NIXL device id (0 for host memory).
        mem_type: NIXL memory type, ``"DRAM"`` or ``"VRAM"``.
        dtype: element type of the regions, e.g. ``"torch.bfloat16"``. (It and
            ``mem_type`` are one shared string per known name, see
            ``_SHARED_NAMES``: a decoder keeps a layout per remote engine.)
        block_strides: bytes from one block to the next in each region
            (default: ``block_lens``, blocks back to back).
        kv_heads: KV heads per block (dimension 1 of the region tensors,
            the "HND" layout), 0 if unknown. Needed only when the engines'
            tensor-parallel sizes differ.
    """

    base_addrs: tuple[int, ...] = attrs.field(converter=_int_tuple)
    block_lens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    num_blocks: int
    device_id: int = 0
    mem_type: str = attrs.field(default="DRAM", converter=_shared_name)
    dtype: str = attrs.field(default="torch.uint8", converter=_shared_name)
    block_strides: tuple[int, ...] = attrs.field(
        converter=_int_tuple,
        default=attrs.Factory(lambda self: self.block_lens, takes_self=True),
    )
    kv_heads: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.base_addrs:
            raise ValueError("a KV layout needs at least one region")
        if len(self.base_addrs) != len(self.block_lens):
            raise ValueError(
                f"{len(self.base_addrs)} base addresses but {len(self.block_lens)} block lengths"
            )
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if min(self.block_lens) < 1:
            raise ValueError(f"block lengths must be >= 1, got {self.block_lens}")
        if min(self.base_addrs) < 0:
            raise ValueError("base addresses must be >= 0")
        if len(self.block_strides) != len(self.block_lens) or any(
            stride < length
            for stride, length in zip(self.block_strides, self.block_lens, strict=True)
        ):
            raise ValueError(
                f"block strides {self.block_strides} must match the regions and be at "
                f"least the block lengths {self.block_lens}"
            )
        if self.kv_heads < 0:
            raise ValueError(f"kv_heads must be >= 0, got {self.kv_heads}")
        if self.num_regions * self.num_blocks > _INDEX_LIMIT:
            raise ValueError(
                f"{self.num_regions} regions x {self.num_blocks} blocks exceed NIXL's index range"
            )

    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)

    @property
    def bytes_per_block_id(self) -> int:
        """Bytes moved per block id (one block in every region)."""
        return sum(self.block_lens)

    def descriptors(self) -> npt.NDArray[np.int64]:
        """All ``num_regions * num_blocks`` descriptors as an ``N x 3`` array.

        Rows are ``(address, length, device_id)``, region-major. This is what
        NIXL expands :meth:`strided_descriptors` into; the indices of
        :meth:`descriptor_indices` point into it.
        """
        bases = np.asarray(self.base_addrs, dtype=np.int64)
        lens = np.asarray(self.block_lens, dtype=np.int64)
        strides = np.asarray(self.block_strides, dtype=np.int64)
        blocks = np.arange(self.num_blocks, dtype=np.int64)
        out = np.empty((self.num_regions, self.num_blocks, 3), dtype=np.int64)
        out[:, :, 0] = bases[:, None] + blocks[None, :] * strides[:, None]
        out[:, :, 1] = lens[:, None]
        out[:, :, 2] = self.device_id
        return out.reshape(-1, 3)

    def strided_descriptors(self) -> npt.NDArray[np.int64]:
        """The same descriptors, one ``N x 5`` row per region, for ``prep_xfer_dlist``.

        Rows are ``(base, block_len, device_id, stride, count)``: ``count``
        blocks of ``block_len`` bytes, ``stride`` bytes apart. NIXL expands
        them itself, so preparing a descriptor list costs one row per region
        instead of one per block (64 x 4096 blocks: 0.1 ms instead of 10 ms,
        and no long hold of the GIL).
        """
        out = np.empty((self.num_regions, 5), dtype=np.int64)
        out[:, 0] = self.base_addrs
        out[:, 1] = self.block_lens
        out[:, 2] = self.device_id
        out[:, 3] = self.block_strides
        out[:, 4] = self.num_blocks
        return out

    def head_slice(self, index: int, count: int) -> KVLayout:
        """The view of the ``index``-th of ``count`` equal parts of every block's heads.

        With the heads in dimension 1 of each block ("HND"), a part of the
        heads is one contiguous byte range of each block: this view's blocks
        are those ranges, ``block_strides`` apart as before. ``count == 1``
        is the layout itself.

        Raises:
            ValueError: the heads (or block bytes) do not split into ``count``
                parts, or ``index`` is not in ``range(count)``.
        """
        if not 0 <= index < count:
            raise ValueError(f"head slice {index} of {count} does not exist")
        if count == 1:
            return self
        if self.kv_heads % count or any(length % count for length in self.block_lens):
            raise ValueError(
                f"{self.kv_heads} KV heads per block ({self.block_lens} bytes) do not "
                f"split into {count} equal parts"
            )
        parts = [length // count for length in self.block_lens]
        return attrs.evolve(
            self,
            base_addrs=[
                base + index * part for base, part in zip(self.base_addrs, parts, strict=True)
            ],
            block_lens=parts,
            block_strides=self.block_strides,
            kv_heads=self.kv_heads // count,
        )

    def descriptor_indices(self, block_ids: BlockIds | Sequence[int]) -> npt.NDArray[np.int32]:
        """Descriptor indices of ``block_ids`` in every region, region-major.

        ``block_ids`` must already be validated (see ``as_block_ids`` and
        ``few_block_ids``). A few indices (most pulls' -- up to
        ``_FEW_INDICES``) are computed in Python and made an array once:
        each numpy call has a fixed cost, several times this arithmetic on
        a core that has just run other code (a NIXL call, the scheduler).
        """
        num_regions = self.num_regions
        if len(block_ids) * num_regions <= _FEW_INDICES:
            ids = block_ids.tolist() if isinstance(block_ids, np.ndarray) else block_ids
            step = self.num_blocks
            return np.array(
                [region * step + b for region in range(num_regions) for b in ids], dtype=np.int32
            )
        offsets = _region_offsets(num_regions, self.num_blocks)
        return (offsets + np.asarray(block_ids).astype(np.int32)).reshape(-1)

    def mismatch(self, remote: KVLayout) -> str | None:
        """Why blocks of ``remote`` cannot be copied into this layout, or ``None``.

        Regions pair up by position, so their count and per-block byte sizes
        must be equal; ``num_blocks`` may differ. The dtype must be equal too.
        """
        if remote.num_regions != self.num_regions:
            return f"remote has {remote.num_regions} KV regions, local has {self.num_regions}"
        if remote.block_lens != self.block_lens:
            pairs = zip(self.block_lens, remote.block_lens, strict=True)
            diff = next(i for i, (a, b) in enumerate(pairs) if a != b)
            return (
                f"region {diff}: remote blocks are {remote.block_lens[diff]} bytes, "
                f"local blocks are {self.block_lens[diff]} bytes"
            )
        if remote.dtype != self.dtype:
            return f"remote dtype {remote.dtype}, local dtype {self.dtype}"
        return None


_FEW_INDICES = 256
"""Descriptor indices that ``KVLayout.descriptor_indices`` computes in Python."""


@functools.lru_cache(maxsize=64)
def _region_offsets(num_regions: int, num_blocks: int) -> npt.NDArray[np.int32]:
    """``region * num_blocks`` as an ``(num_regions, 1)`` int32 column (read-only)."""
    offsets = (np.arange(num_regions, dtype=np.int32) * num_blocks)[:, None]
    offsets.flags.writeable = False
    return offsets


_NO_BLOCKS: BlockIds = np.empty(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False


def as_block_ids(
    values: Sequence[int] | npt.ArrayLike, num_blocks: int, what: str, of: str | None = None
) -> BlockIds:
    """Validate block ids and return them as an int64 array.

    Raises:
        ValueError: ``values`` is not a flat sequence of integers, has an id
            outside ``[0, num_blocks)``, or repeats an id. The message starts
            with ``what``, followed by ``of`` quoted if given (``what="local
            block ids of request", of="r1"``: ``"local block ids of request
            'r1'"``; put together only for the message, not for every call).
    """
    if _few_valid_ints(values, num_blocks):
        return np.array(values, dtype=np.int64)
    if of is not None:
        what = f"{what} {of!r}"
    arr: npt.NDArray[Any] = np.asarray(values)
    if arr.size == 0:
        return _NO_BLOCKS  # (one read-only array for every notify-only pull)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a flat sequence of ints, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected ints, got {arr.dtype}")
    ids = arr.astype(np.int64, copy=False)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_blocks:
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise ValueError(f"{what}: block id {bad} is outside [0, {num_blocks})")
    if _repeats(ids):
        raise ValueError(f"{what}: block ids repeat")
    return ids


def few_block_ids(
    values: Sequence[int], num_blocks: int, what: str, of: str | None = None
) -> Sequence[int] | BlockIds:
    """``as_block_ids``'s checks and errors, without making an array of a few ids.

    A short list or tuple of valid ids is returned as it is (a tuple, such
    as ``RemoteBlocks.block_ids``, if the caller needs it never to change);
    anything else as :func:`as_block_ids` returns it. For ids that only go
    to :meth:`KVLayout.descriptor_indices`.

    Raises:
        ValueError: as :func:`as_block_ids`.
    """
    if _few_valid_ints(values, num_blocks):
        return values
    return as_block_ids(values, num_blocks, what, of)


def _few_valid_ints(values: object, num_blocks: int) -> bool:
    """Whether ``values`` is a short list or tuple of distinct ints in range: most
    pulls' few ids from JSON, checked in Python at a quarter of numpy's fixed
    cost (anything else takes numpy's path, and its errors)."""
    if not isinstance(values, list | tuple) or not 0 < len(values) <= 64:
        return False
    for v in values:  # (a plain loop: a generator would cost a frame per id)
        if type(v) is not int or not 0 <= v < num_blocks:
            return False
    return len(set(values)) == len(values)


def _repeats(ids: BlockIds) -> bool:
    """Whether an id occurs twice (a set for the few ids of most pulls: np.unique
    costs about 15 us even for two)."""
    if ids.size <= 64:
        return len(set(ids.tolist())) != ids.size
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def layout_of_tensors(kv_caches: Sequence[torch.Tensor]) -> KVLayout:
    """Describe ``kv_caches`` (one region each) as a :class:`KVLayout`.

    Raises:
        ValueError: no tensors, a non-contiguous or zero-dimensional tensor,
            different numbers of blocks, devices or dtypes across regions,
            or regions that partly overlap. The *same* tensor may appear
            more than once (layers that share a KV cache): it is one region
            per appearance, registered with the backend once.
    """
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: give at least one region")
    first = kv_caches[0]
    num_blocks = int(first.shape[0]) if first.dim() > 0 else 0
    bases: list[int] = []
    lens: list[int] = []
    for i, t in enumerate(kv_caches):
        if t.dim() == 0 or int(t.shape[0]) != num_blocks:
            raise ValueError(
                f"kv_caches[{i}] has shape {tuple(t.shape)}; every region needs "
                f"dimension 0 = num_blocks = {num_blocks}"
            )
        if not t.is_contiguous():
            raise ValueError(f"kv_caches[{i}] is not contiguous")
        if t.device != first.device or t.dtype != first.dtype:
            raise ValueError(
                f"kv_caches[{i}] is {t.dtype} on {t.device}; "
                f"kv_caches[0] is {first.dtype} on {first.device}"
            )
        bases.append(int(t.data_ptr()))
        lens.append(int(t[0].numel() * t.element_size()) if num_blocks else 0)
    if num_blocks < 1:
        raise ValueError("kv_caches have no blocks (dimension 0 is empty)")
    _check_overlaps(bases, [length * num_blocks for length in lens])
    heads = {int(t.shape[1]) if t.dim() > 1 else 0 for t in kv_caches}
    is_cuda = first.device.type == "cuda"
    return KVLayout(
        base_addrs=bases,
        block_lens=lens,
        num_blocks=num_blocks,
        device_id=int(first.device.index or 0) if is_cuda else 0,
        mem_type="VRAM" if is_cuda else "DRAM",
        dtype=str(first.dtype),
        kv_heads=heads.pop() if len(heads) == 1 else 0,
    )


def _check_overlaps(bases: Sequence[int], sizes: Sequence[int]) -> None:
    """Raise if two regions overlap without being the same memory."""
    spans = sorted(set(zip(bases, sizes, strict=True)))
    for (base, size), (next_base, next_size) in itertools.pairwise(spans):
        if next_base < base + size:
            first = bases.index(base)
            second = bases.index(next_base)
            raise ValueError(
                f"kv_caches[{first}] and kv_caches[{second}] overlap "
                f"({size} bytes at {base:#x}, {next_size} bytes at {next_base:#x}); "
                "pass the same tensor for shared layers, never views into one another"
            )
