"""Tensor parallelism: which remote ranks and head slices one pull reads (no I/O).

An engine with tensor-parallel size ``T`` is ``T`` ranks; rank ``r`` holds
``1/T`` of the KV heads, in its own memory, behind its own agent and its own
side channel (``base port + r``). Every block of every region is laid out
heads-first ("HND": dimension 1 of the region tensors indexes KV heads), so a
part of a block's heads is one contiguous byte range.

Decode rank ``d`` of ``Td`` ranks, pulling from an engine of ``Tp`` ranks,
reads (vLLM's conventions):

* ``Td == Tp``: remote rank ``d``, whole blocks into whole blocks;
* ``Td > Tp`` (``k = Td // Tp``): remote rank ``d // k``, the ``d % k``-th of
  ``k`` head slices of each remote block, into whole local blocks;
* ``Tp > Td`` (``k = Tp // Td``): remote ranks ``d*k ... d*k + k - 1``, whole
  remote blocks into the ``j``-th of ``k`` head slices of each local block.

:func:`plan_pull` says this as data; :func:`tp_mismatch` says why two engines
cannot be paired; :func:`part_layouts` gives the two layout views a part
copies between. The docs' picture of the mapping is drawn from
:func:`plan_pull`.
"""

from __future__ import annotations

import functools

import attrs

from trio_pd._core._layout import KVLayout


@attrs.frozen
class HeadSlice:
    """The ``index``-th of ``count`` equal parts of a block's heads (``count == 1``: all)."""

    index: int = 0
    count: int = 1


WHOLE = HeadSlice()


@attrs.frozen
class PullPart:
    """One remote rank's share of a pull.

    Attributes:
        remote_rank: the remote rank to read.
        remote_slice: the part of each remote block that is read.
        local_slice: the part of each local block that it lands in.
    """

    remote_rank: int
    remote_slice: HeadSlice = WHOLE
    local_slice: HeadSlice = WHOLE


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Raise ``ValueError`` unless ``tp_rank`` is in ``range(tp_size)``, ``tp_size >= 1``."""
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside range({tp_size})")


def sizes_mismatch(local_tp: int, remote_tp: int) -> str | None:
    """Why TP sizes ``local_tp`` and ``remote_tp`` cannot be paired, or ``None``."""
    if max(local_tp, remote_tp) % min(local_tp, remote_tp):
        return (
            f"tensor-parallel sizes {remote_tp} (remote) and {local_tp} (local): "
            "one must divide the other"
        )
    return None


@functools.lru_cache(maxsize=64)  # (every pull asks; a connector meets few TP sizes)
def plan_pull(local_rank: int, local_tp: int, remote_tp: int) -> tuple[PullPart, ...]:
    """The parts of a pull by local rank ``local_rank`` of ``local_tp`` from ``remote_tp`` ranks.

    Raises:
        ValueError: the sizes do not divide (see :func:`sizes_mismatch`) or
            ``local_rank`` is outside ``range(local_tp)``.
    """
    check_tp(local_rank, local_tp)
    check_tp(0, remote_tp)
    mismatch = sizes_mismatch(local_tp, remote_tp)
    if mismatch is not None:
        raise ValueError(mismatch)
    if local_tp == remote_tp:
        return (PullPart(local_rank),)
    if local_tp > remote_tp:
        k = local_tp // remote_tp
        return (PullPart(local_rank // k, remote_slice=HeadSlice(local_rank % k, k)),)
    k = remote_tp // local_tp
    return tuple(PullPart(local_rank * k + j, local_slice=HeadSlice(j, k)) for j in range(k))


def readers_per_remote_rank(local_tp: int, remote_tp: int) -> int:
    """How many ranks of one consumer engine read each remote rank (``Td // Tp``, at least 1)."""
    return max(1, local_tp // remote_tp)


def part_layouts(local: KVLayout, remote: KVLayout, part: PullPart) -> tuple[KVLayout, KVLayout]:
    """The (local, remote) layout views that ``part`` copies between.

    Raises:
        ValueError: a layout's heads do not split as the part needs.
    """
    local_view = local.head_slice(part.local_slice.index, part.local_slice.count)
    remote_view = remote.head_slice(part.remote_slice.index, part.remote_slice.count)
    return local_view, remote_view


def tp_mismatch(local: KVLayout, local_tp: int, remote: KVLayout, remote_tp: int) -> str | None:
    """Why a remote rank of ``remote`` cannot feed this rank, or ``None``.

    With equal TP sizes, the layouts must match as they always had to
    (:meth:`KVLayout.mismatch`). With different sizes, the KV heads must be
    known on both sides (HND tensors), the total KV heads of the two engines
    equal (``H_p * Tp == H_d * Td``), and the head slices a part copies must
    have equal bytes per region and the same dtype.
    """
    mismatch = sizes_mismatch(local_tp, remote_tp)
    if mismatch is not None:
        return mismatch
    if local_tp == remote_tp:
        return local.mismatch(remote)
    if not local.kv_heads or not remote.kv_heads:
        return (
            "heterogeneous tensor parallelism needs KV caches shaped "
            "(num_blocks, num_kv_heads, ...) on both sides; the KV heads of "
            f"{'the remote' if not remote.kv_heads else 'this'} engine are unknown"
        )
    if remote.kv_heads * remote_tp != local.kv_heads * local_tp:
        return (
            f"total KV heads differ: remote {remote.kv_heads} x TP {remote_tp}, "
            f"local {local.kv_heads} x TP {local_tp}"
        )
    part = plan_pull(0, local_tp, remote_tp)[0]
    try:
        local_view, remote_view = part_layouts(local, remote, part)
    except ValueError as exc:
        return str(exc)
    mismatch = local_view.mismatch(remote_view)
    return None if mismatch is None else f"per head slice: {mismatch}"
