"""KV layout validation, descriptor math and block-id validation (no I/O)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pd._core._layout import KVLayout, as_block_ids, few_block_ids, layout_of_tensors


def layout(
    base_addrs: tuple[int, ...] = (1000, 50_000),
    block_lens: tuple[int, ...] = (64, 128),
    num_blocks: int = 4,
    dtype: str = "torch.float16",
) -> KVLayout:
    return KVLayout(
        base_addrs=base_addrs, block_lens=block_lens, num_blocks=num_blocks, dtype=dtype
    )


# --- KVLayout validation -------------------------------------------------------


def test_layout_converts_addresses_and_lengths_to_int_tuples() -> None:
    lay = KVLayout(base_addrs=[np.int64(10), 20], block_lens=np.array([4, 8]), num_blocks=3)
    assert lay.base_addrs == (10, 20)
    assert lay.block_lens == (4, 8)
    assert all(type(v) is int for v in (*lay.base_addrs, *lay.block_lens))
    assert lay.num_regions == 2
    assert lay.bytes_per_block_id == 12
    assert (lay.device_id, lay.mem_type, lay.dtype) == (0, "DRAM", "torch.uint8")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_addrs": (), "block_lens": ()}, "at least one region"),
        ({"base_addrs": (0, 100), "block_lens": (8,)}, "2 base addresses but 1 block lengths"),
        ({"num_blocks": 0}, "num_blocks must be >= 1"),
        ({"num_blocks": -3}, "num_blocks must be >= 1"),
        ({"block_lens": (8, 0)}, "block lengths must be >= 1"),
        ({"base_addrs": (-1, 100)}, "base addresses must be >= 0"),
        ({"base_addrs": (0,), "block_lens": (1,), "num_blocks": 2**31}, "index range"),
        (
            {"base_addrs": (0, 0, 0, 0), "block_lens": (1, 1, 1, 1), "num_blocks": 2**29},
            "4 regions x 536870912 blocks",
        ),
    ],
)
def test_layout_rejects_invalid_fields(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"base_addrs": (0, 100), "block_lens": (8, 8), "num_blocks": 4}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVLayout(**fields)  # type: ignore[arg-type]


def test_layout_accepts_the_largest_index_range() -> None:
    lay = KVLayout(base_addrs=(0,), block_lens=(1,), num_blocks=2**31 - 1)
    assert lay.num_blocks == 2**31 - 1


# --- descriptors ---------------------------------------------------------------


def test_descriptors_are_region_major_rows_of_address_length_device() -> None:
    lay = KVLayout(base_addrs=(1000, 50_000), block_lens=(64, 128), num_blocks=3, device_id=5)
    desc = lay.descriptors()
    assert desc.dtype == np.int64
    assert desc.tolist() == [
        [1000, 64, 5],
        [1064, 64, 5],
        [1128, 64, 5],
        [50_000, 128, 5],
        [50_128, 128, 5],
        [50_256, 128, 5],
    ]


def test_descriptor_row_r_times_num_blocks_plus_b_addresses_block_b_of_region_r() -> None:
    lay = KVLayout(base_addrs=(7, 1 << 40, 300), block_lens=(3, 4096, 5), num_blocks=11)
    desc = lay.descriptors()
    assert desc.shape == (3 * 11, 3)
    for r in range(3):
        for b in range(11):
            addr, length, dev = desc[r * 11 + b]
            assert addr == lay.base_addrs[r] + b * lay.block_lens[r]
            assert length == lay.block_lens[r]
            assert dev == 0


def test_descriptor_indices_are_region_major_in_block_id_order() -> None:
    lay = layout(num_blocks=10)
    idx = lay.descriptor_indices(np.array([7, 2, 9], dtype=np.int64))
    assert idx.dtype == np.int32
    assert idx.tolist() == [7, 2, 9, 17, 12, 19]


def test_descriptor_indices_of_no_blocks_is_empty() -> None:
    idx = layout().descriptor_indices(as_block_ids([], 4, "ids"))
    assert idx.shape == (0,)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_selected_descriptors_are_exactly_the_requested_blocks(data: st.DataObject) -> None:
    num_regions = data.draw(st.integers(1, 6), label="num_regions")
    num_blocks = data.draw(st.integers(1, 64), label="num_blocks")
    bases = data.draw(
        st.lists(st.integers(0, 2**40), min_size=num_regions, max_size=num_regions),
        label="bases",
    )
    lens = data.draw(
        st.lists(st.integers(1, 2**20), min_size=num_regions, max_size=num_regions),
        label="lens",
    )
    ids = data.draw(
        st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks), label="ids"
    )
    lay = KVLayout(base_addrs=bases, block_lens=lens, num_blocks=num_blocks)
    # (as an array or as the few ids themselves: up to 256 indices are
    # computed in Python, more with numpy -- both drawn here)
    checked = data.draw(st.sampled_from([as_block_ids, few_block_ids]), label="checked by")

    indices = lay.descriptor_indices(checked(ids, num_blocks, "ids"))
    selected = lay.descriptors()[indices]

    assert indices.dtype == np.int32
    expected = [(bases[r] + b * lens[r], lens[r]) for r in range(num_regions) for b in ids]
    assert [(int(a), int(n)) for a, n, _dev in selected] == expected


# --- mismatch ------------------------------------------------------------------


def test_mismatch_is_none_for_compatible_layouts_with_different_num_blocks() -> None:
    local = layout(base_addrs=(0, 4096), num_blocks=4)
    remote = layout(base_addrs=(999, 123_456), num_blocks=100)
    assert local.mismatch(remote) is None


def test_mismatch_names_the_region_counts() -> None:
    local = layout()
    remote = layout(base_addrs=(0, 1, 2), block_lens=(64, 128, 64))
    assert local.mismatch(remote) == "remote has 3 KV regions, local has 2"


def test_mismatch_names_the_first_region_with_another_block_length() -> None:
    local = KVLayout(base_addrs=(0, 0, 0), block_lens=(64, 128, 256), num_blocks=2)
    remote = KVLayout(base_addrs=(0, 0, 0), block_lens=(64, 96, 512), num_blocks=2)
    assert local.mismatch(remote) == (
        "region 1: remote blocks are 96 bytes, local blocks are 128 bytes"
    )


def test_mismatch_names_both_dtypes() -> None:
    local = layout(dtype="torch.float16")
    remote = layout(dtype="torch.bfloat16")
    assert local.mismatch(remote) == "remote dtype torch.bfloat16, local dtype torch.float16"


# --- as_block_ids --------------------------------------------------------------


def test_block_ids_come_back_as_int64_in_the_given_order() -> None:
    ids = as_block_ids([3, 0, 2], 4, "ids")
    assert ids.dtype == np.int64
    assert ids.tolist() == [3, 0, 2]


@pytest.mark.parametrize(
    "values",
    [
        np.array([1, 3], dtype=np.int8),
        np.array([1, 3], dtype=np.uint16),
        np.array([1, 3], dtype=np.int32),
        [np.int64(1), np.uint32(3)],
        (1, 3),
    ],
)
def test_block_ids_accept_numpy_and_python_ints(values: object) -> None:
    ids = as_block_ids(values, 4, "ids")  # type: ignore[arg-type]
    assert ids.dtype == np.int64
    assert ids.tolist() == [1, 3]


@pytest.mark.parametrize("values", [[], (), np.array([], dtype=np.int64)])
def test_empty_block_ids_are_accepted(values: object) -> None:
    ids = as_block_ids(values, 4, "ids")  # type: ignore[arg-type]
    assert ids.dtype == np.int64
    assert ids.shape == (0,)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([1.0, 2.0], "expected ints, got float64"),
        (np.array([1, 2], dtype=np.float32), "expected ints, got float32"),
        ([True, False], "expected ints, got bool"),
        ([[0, 1], [2, 3]], r"expected a flat sequence of ints, got shape \(2, 2\)"),
        (np.int64(2), r"expected a flat sequence of ints, got shape \(\)"),
        (["1", "2"], "expected ints"),
        ([0, -1, 2], r"block id -1 is outside \[0, 4\)"),
        ([0, 4], r"block id 4 is outside \[0, 4\)"),
        ([99, 0], r"block id 99 is outside \[0, 4\)"),
        ([1, 2, 1], "block ids repeat"),
    ],
)
def test_invalid_block_ids_raise_a_message_starting_with_what(values: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        as_block_ids(values, 4, "local block ids of request 'r1'")  # type: ignore[arg-type]
    assert str(info.value).startswith("local block ids of request 'r1': ")


@pytest.mark.parametrize("values", [[3, 0, 2], (1,), tuple(range(64))])
def test_a_few_valid_block_ids_come_back_as_they_were_given(values: list[int]) -> None:
    assert few_block_ids(values, 64, "ids") is values


@pytest.mark.parametrize("values", [list(range(65)), np.array([1, 2]), []])
def test_other_valid_block_ids_come_back_as_as_block_ids_makes_them(values: object) -> None:
    ids = few_block_ids(values, 65, "remote block ids")  # type: ignore[arg-type]
    assert isinstance(ids, np.ndarray)
    assert ids.tolist() == as_block_ids(values, 65, "ids").tolist()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([True, False], "expected ints, got bool"),
        ([0, 64], r"block id 64 is outside \[0, 64\)"),
        ([2, 2], "block ids repeat"),
        ([1.0], "expected ints, got float64"),
        ([[1]], "expected a flat sequence of ints"),
    ],
)
def test_invalid_block_ids_raise_what_as_block_ids_raises(values: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        few_block_ids(values, 64, "remote block ids")  # type: ignore[arg-type]
    assert str(info.value).startswith("remote block ids: ")


def test_block_id_range_ends_at_num_blocks_minus_one() -> None:
    assert as_block_ids([0, 9], 10, "ids").tolist() == [0, 9]
    with pytest.raises(ValueError, match="outside"):
        as_block_ids([10], 10, "ids")


# --- layout_of_tensors ---------------------------------------------------------


def test_layout_of_float16_tensors_has_their_addresses_and_block_bytes() -> None:
    caches = [
        torch.zeros((8, 16, 4), dtype=torch.float16),
        torch.zeros((8, 2, 3), dtype=torch.float16),
    ]
    lay = layout_of_tensors(caches)
    assert lay.base_addrs == (caches[0].data_ptr(), caches[1].data_ptr())
    assert lay.block_lens == (16 * 4 * 2, 2 * 3 * 2)
    assert lay.num_blocks == 8
    assert (lay.device_id, lay.mem_type, lay.dtype) == (0, "DRAM", "torch.float16")


def test_layout_of_tensors_addresses_match_each_block_in_memory() -> None:
    cache = torch.zeros((5, 3, 7), dtype=torch.float16)
    lay = layout_of_tensors([cache])
    desc = lay.descriptors()
    for b in range(5):
        assert desc[b, 0] == cache[b].data_ptr()
        assert desc[b, 1] == cache[b].numel() * cache.element_size()


def test_layout_of_one_dimensional_tensors_has_one_element_blocks() -> None:
    lay = layout_of_tensors([torch.zeros(6, dtype=torch.int32)])
    assert (lay.num_blocks, lay.block_lens, lay.dtype) == (6, (4,), "torch.int32")


def test_layout_of_no_tensors_is_an_error() -> None:
    with pytest.raises(ValueError, match="kv_caches is empty"):
        layout_of_tensors([])


def test_layout_of_a_zero_dimensional_tensor_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"kv_caches\[0\] has shape \(\)"):
        layout_of_tensors([torch.tensor(1.0)])


def test_layout_of_tensors_without_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match="no blocks"):
        layout_of_tensors([torch.zeros((0, 4)), torch.zeros((0, 4))])


def test_layout_of_a_non_contiguous_tensor_is_an_error() -> None:
    good = torch.zeros((4, 4), dtype=torch.float16)
    transposed = torch.zeros((4, 4), dtype=torch.float16).t()
    assert not transposed.is_contiguous()
    with pytest.raises(ValueError, match=r"kv_caches\[1\] is not contiguous"):
        layout_of_tensors([good, transposed])


def test_layout_of_tensors_with_different_num_blocks_is_an_error() -> None:
    caches = [torch.zeros((4, 2)), torch.zeros((4, 2)), torch.zeros((5, 2))]
    with pytest.raises(ValueError, match=r"kv_caches\[2\] has shape \(5, 2\).*num_blocks = 4"):
        layout_of_tensors(caches)


def test_layout_of_tensors_with_different_dtypes_is_an_error() -> None:
    caches = [torch.zeros((4, 2), dtype=torch.float16), torch.zeros((4, 2), dtype=torch.float32)]
    with pytest.raises(ValueError, match=r"kv_caches\[1\] is torch.float32 on cpu"):
        layout_of_tensors(caches)


def test_strided_rows_expand_to_the_full_descriptor_list() -> None:
    # NIXL expands (base, len, dev, stride, count) rows into count descriptors
    # each; the expansion must equal descriptors(), which the indices address.
    lay = KVLayout(base_addrs=[4096, 1 << 20, 1 << 30], block_lens=[64, 128, 64], num_blocks=5)
    rows = lay.strided_descriptors()
    assert rows.shape == (3, 5)
    expanded = np.concatenate(
        [
            np.stack(
                [
                    base + stride * np.arange(count),
                    np.full(count, length),
                    np.full(count, dev),
                ],
                axis=1,
            )
            for base, length, dev, stride, count in rows
        ]
    )
    assert np.array_equal(expanded, lay.descriptors())


def test_regions_that_partly_overlap_are_refused() -> None:
    base = torch.zeros((9, 16), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"kv_caches\[0\] and kv_caches\[1\] overlap"):
        layout_of_tensors([base[:8], base[1:]])


def test_the_same_tensor_twice_is_two_regions_over_the_same_memory() -> None:
    shared = torch.zeros((8, 16), dtype=torch.float16)
    layout = layout_of_tensors([shared, shared])
    assert layout.num_regions == 2
    assert layout.base_addrs[0] == layout.base_addrs[1]


# --- shared names --------------------------------------------------------------


def _fresh(text: str) -> str:
    """An equal string that is a new object (as a decoded reply's field is)."""
    return "".join(list(text))


def test_layouts_of_a_known_dtype_and_memory_type_share_one_string_each() -> None:
    a = layout(dtype=_fresh("torch.bfloat16"))
    b = KVLayout(
        base_addrs=(0,),
        block_lens=(8,),
        num_blocks=2,
        mem_type=_fresh("VRAM"),
        dtype=_fresh("torch.bfloat16"),
    )
    c = KVLayout(base_addrs=(0,), block_lens=(8,), num_blocks=2, mem_type=_fresh("VRAM"))
    assert a.dtype is b.dtype
    assert b.mem_type is c.mem_type


def test_a_name_a_peer_makes_up_is_kept_as_given_not_interned() -> None:
    # A forged reply's dtype or memory type (up to max_message_bytes each) must
    # not enter the interpreter's table of interned strings: on the free-threaded
    # builds (and early CPython 3.12 releases) interned strings are never freed.
    dtype, mem_type = _fresh("torch.forged-" + "x" * 100), _fresh("FORGED-" + "y" * 100)
    lay = KVLayout(base_addrs=(0,), block_lens=(8,), num_blocks=2, mem_type=mem_type, dtype=dtype)
    assert (lay.dtype, lay.mem_type) == (dtype, mem_type)
    assert sys.intern(_fresh(dtype)) is not lay.dtype, "the forged dtype was interned"
    assert sys.intern(_fresh(mem_type)) is not lay.mem_type, "the forged mem_type was interned"
