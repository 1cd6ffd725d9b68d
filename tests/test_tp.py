"""Tensor-parallel mapping and head-slice views (no I/O)."""

from __future__ import annotations

import re

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trio_pd._core._layout import KVLayout, layout_of_tensors
from trio_pd._core._tensor_parallel import (
    HeadSlice,
    PullPart,
    check_tp,
    part_layouts,
    plan_pull,
    readers_per_remote_rank,
    tp_mismatch,
)


def layout(heads: int, head_bytes: int = 64, regions: int = 2, blocks: int = 8) -> KVLayout:
    return KVLayout(
        base_addrs=[1 << 20 * (r + 1) for r in range(regions)],
        block_lens=[heads * head_bytes] * regions,
        num_blocks=blocks,
        dtype="torch.float16",
        kv_heads=heads,
    )


@pytest.mark.parametrize(
    ("rank", "local_tp", "remote_tp", "parts"),
    [
        (0, 1, 1, [PullPart(0)]),
        (1, 2, 2, [PullPart(1)]),
        (0, 2, 1, [PullPart(0, remote_slice=HeadSlice(0, 2))]),
        (1, 2, 1, [PullPart(0, remote_slice=HeadSlice(1, 2))]),
        (3, 4, 2, [PullPart(1, remote_slice=HeadSlice(1, 2))]),
        (
            0,
            1,
            2,
            [PullPart(0, local_slice=HeadSlice(0, 2)), PullPart(1, local_slice=HeadSlice(1, 2))],
        ),
        (
            1,
            2,
            4,
            [PullPart(2, local_slice=HeadSlice(0, 2)), PullPart(3, local_slice=HeadSlice(1, 2))],
        ),
    ],
)
def test_the_plan_follows_vllms_conventions(
    rank: int, local_tp: int, remote_tp: int, parts: list[PullPart]
) -> None:
    assert list(plan_pull(rank, local_tp, remote_tp)) == parts


@st.composite
def _tp_pairs(draw: st.DrawFn) -> tuple[int, int, int]:
    small = draw(st.sampled_from([1, 2, 4]))
    factor = draw(st.sampled_from([1, 2, 4]))
    big = small * factor
    local_tp, remote_tp = draw(st.permutations([small, big]))
    heads = big * draw(st.integers(1, 3))
    return local_tp, remote_tp, heads


@given(_tp_pairs())
def test_every_head_lands_once_in_the_rank_that_owns_it(pair: tuple[int, int, int]) -> None:
    # Global head h lives on remote rank h // Hp and on local rank h // Hd;
    # following every part of every local rank moves each head exactly once,
    # into the right place.
    local_tp, remote_tp, total = pair
    local_heads, remote_heads = total // local_tp, total // remote_tp
    moved: list[tuple[int, int]] = []  # (global head read, global head written)
    for rank in range(local_tp):
        for part in plan_pull(rank, local_tp, remote_tp):
            n_remote = remote_heads // part.remote_slice.count
            n_local = local_heads // part.local_slice.count
            assert n_remote == n_local
            for i in range(n_remote):
                read = part.remote_rank * remote_heads + part.remote_slice.index * n_remote + i
                written = rank * local_heads + part.local_slice.index * n_local + i
                moved.append((read, written))
    assert sorted(moved) == [(h, h) for h in range(total)]


@given(_tp_pairs())
def test_each_remote_rank_is_read_by_readers_per_remote_rank_local_ranks(
    pair: tuple[int, int, int],
) -> None:
    local_tp, remote_tp, _ = pair
    readers = [0] * remote_tp
    for rank in range(local_tp):
        for part in plan_pull(rank, local_tp, remote_tp):
            readers[part.remote_rank] += 1
    assert readers == [readers_per_remote_rank(local_tp, remote_tp)] * remote_tp


@pytest.mark.parametrize(
    ("rank", "size", "match"),
    [
        (0, 0, "tp_size must be >= 1"),
        (2, 2, r"outside range\(2\)"),
        (-1, 2, "outside"),
        (True, 2, "must be an int"),
    ],
)
def test_bad_ranks_and_sizes_are_value_errors(rank: object, size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_tp(rank, size)  # type: ignore[arg-type]


def test_sizes_that_do_not_divide_cannot_be_planned() -> None:
    with pytest.raises(ValueError, match="one must divide the other"):
        plan_pull(0, 3, 2)


def test_a_head_slice_is_a_strided_view_of_every_block() -> None:
    full = layout(heads=4, head_bytes=16, regions=2, blocks=3)
    view = full.head_slice(1, 2)
    assert view.block_lens == (32, 32)
    assert view.block_strides == (64, 64)
    assert view.kv_heads == 2
    rows = view.descriptors()
    base = full.base_addrs[0] + 32
    assert rows[:3, 0].tolist() == [base, base + 64, base + 128]
    assert rows[:3, 1].tolist() == [32, 32, 32]
    strided = view.strided_descriptors()
    assert strided[0].tolist() == [base, 32, 0, 64, 3]
    assert full.head_slice(0, 1) is full


def test_heads_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        layout(heads=4).head_slice(0, 3)
    with pytest.raises(ValueError, match="does not exist"):
        layout(heads=4).head_slice(2, 2)


def test_the_kv_heads_come_from_dimension_1() -> None:
    assert layout_of_tensors([torch.zeros((4, 8, 16, 32))]).kv_heads == 8
    assert layout_of_tensors([torch.zeros((4, 256))]).kv_heads == 256
    assert layout_of_tensors([torch.zeros((4,))]).kv_heads == 0


@pytest.mark.parametrize(
    ("local", "local_tp", "remote", "remote_tp", "match"),
    [
        (layout(4), 2, layout(8), 1, None),
        (layout(8), 1, layout(4), 2, None),
        (layout(4), 2, layout(4), 2, None),
        (layout(4), 3, layout(4), 2, "one must divide the other"),
        (layout(4), 2, layout(4), 1, r"total KV heads differ: remote 4 x TP 1, local 4 x TP 2"),
        (layout(4, head_bytes=32), 2, layout(8), 1, "per head slice: region 0"),
        (
            attrs.evolve(layout(4), kv_heads=0),
            2,
            layout(8),
            1,
            "KV heads of this engine are unknown",
        ),
        (layout(4), 2, layout(2), 2, "region 0: remote blocks are 128 bytes"),
    ],
)
def test_engines_that_cannot_be_paired_say_why(
    local: KVLayout, local_tp: int, remote: KVLayout, remote_tp: int, match: str | None
) -> None:
    reason = tp_mismatch(local, local_tp, remote, remote_tp)
    if match is None:
        assert reason is None
    else:
        assert reason is not None
        assert re.search(match, reason), reason


def test_part_layouts_pair_equal_sized_views() -> None:
    local, remote = layout(2), layout(4)
    [part] = plan_pull(1, 2, 1)
    local_view, remote_view = part_layouts(local, remote, part)
    assert local_view is local
    assert remote_view.block_lens == local.block_lens
    assert remote_view.base_addrs[0] == remote.base_addrs[0] + local.block_lens[0]


def test_head_payloads_catch_a_head_from_the_wrong_rank_or_block() -> None:
    from trio_pd.testing import fill_heads, mismatched_heads

    rank0 = [torch.zeros((4, 2, 8), dtype=torch.float16) for _ in range(2)]
    fill_heads(rank0, 0, [0, 1, 2, 3], seed=3)
    assert mismatched_heads(rank0, 0, [0, 1, 2, 3], [0, 1, 2, 3], 3) == []
    assert mismatched_heads(rank0, 1, [0, 1], [0, 1], 3) == [0, 1]  # rank 1's heads differ
    assert mismatched_heads(rank0, 0, [0, 1], [1, 0], 3) == [0, 1]  # blocks swapped
    assert mismatched_heads(rank0, 0, [0], [0], 4) == [0]  # another seed
    rank0[1][2, 1, 0] += 1  # one element of one head of one region
    assert mismatched_heads(rank0, 0, [0, 1, 2, 3], [0, 1, 2, 3], 3) == [2]
