"""hipmla.plan: the invariants every plan must keep (coverage, slots, alignment, balance,
order, size) over many random ragged batches, edge cases and CU counts; validation."""

from __future__ import annotations

import numpy as np
import pytest

from hipmla.inputs import random_seq_lens
from hipmla.plan import (
    DEFAULT_ITEMS_PER_CU,
    DEFAULT_MIN_SPLIT_TOKENS,
    DecodePlan,
    indptr_from_lengths,
    lengths_from_indptr,
    make_plan,
    split_size,
)

CU_COUNTS = (1, 8, 80, 132, 256, 304)
EDGE_BATCHES = {
    "batch1": [1000],
    "all_empty": [0, 0, 0],
    "one_empty": [0],
    "one_huge": [3, 0, 1_000_000, 5],
    "tile_edges": [1, 127, 128, 129, 255, 256, 257],
    "uniform": [8192] * 4,
    "many_short": [1] * 300,
}


def check_plan(plan: DecodePlan, lens: np.ndarray, **plan_kwargs) -> None:
    """``plan_kwargs``: the keyword arguments ``make_plan`` got besides ``num_cus``."""
    items_per_cu = plan_kwargs.get("items_per_cu", DEFAULT_ITEMS_PER_CU)
    lens = np.asarray(lens, dtype=np.int64)
    batch = lens.shape[0]
    work, slots = plan.work, plan.seq_slots
    align = plan.align_tokens
    for name, arr in (("work", work), ("seq_slots", slots), ("seq_lens", plan.seq_lens), ("kv_indptr", plan.kv_indptr)):
        assert arr.dtype == np.int32 and arr.flags.c_contiguous, name
    assert work.ndim == 2 and work.shape[1] == 4
    assert slots.shape == (batch + 1,) and slots[0] == 0
    np.testing.assert_array_equal(plan.seq_lens, lens)
    np.testing.assert_array_equal(plan.kv_indptr, np.concatenate([[0], np.cumsum(lens)]))
    seq, t0, t1, slot = (work[:, i].astype(np.int64) for i in range(4))
    assert ((seq >= 0) & (seq < batch)).all()
    assert ((0 <= t0) & (t0 <= t1) & (t1 <= lens[seq])).all()

    chunk = split_size(lens, plan.num_cus, **plan_kwargs)
    assert (t1 - t0 <= chunk).all(), f"an item is longer than split_size {chunk}"
    assert plan.n_work <= plan.num_cus * items_per_cu + batch
    assert (np.diff(t1 - t0) <= 0).all(), "items must be ordered longest first"

    used_slots = []
    for b in range(batch):
        mine = np.flatnonzero(seq == b)
        assert mine.size >= 1, f"sequence {b} has no work item"
        order = mine[np.argsort(t0[mine])]
        b0, b1 = t0[order], t1[order]
        if lens[b] == 0:
            assert mine.size == 1 and b0[0] == b1[0] and slot[mine[0]] == -1
        else:
            # exact cover of [0, len) by non-empty, abutting ranges
            assert b0[0] == 0 and b1[-1] == lens[b] and (b1 > b0).all()
            np.testing.assert_array_equal(b0[1:], b1[:-1])
            assert (b1[:-1] % align == 0).all(), "inner boundaries must be tile-aligned"
            sizes = b1 - b0
            assert sizes.max() - sizes.min() <= align, f"sequence {b} unbalanced: {sizes}"
        n_slots = slots[b + 1] - slots[b]
        if mine.size == 1:
            assert slot[mine[0]] == -1 and n_slots == 0
        else:
            assert n_slots == mine.size
            np.testing.assert_array_equal(np.sort(slot[mine]), np.arange(slots[b], slots[b + 1]))
            used_slots.extend(slot[mine])
    assert sorted(used_slots) == list(range(plan.n_slots))
    assert plan.needs_combine == (plan.n_slots > 0)
    assert plan.total_tokens == lens.sum()
    np.testing.assert_array_equal(plan.splits_per_seq(), np.bincount(seq, minlength=batch))


@pytest.mark.parametrize("num_cus", CU_COUNTS)
def test_random_batches(num_cus):
    for seed in range(12):
        lens = random_seq_lens(np.random.default_rng(seed))
        check_plan(make_plan(lens, num_cus), lens)


@pytest.mark.parametrize("name", list(EDGE_BATCHES))
@pytest.mark.parametrize("num_cus", CU_COUNTS)
def test_edge_batches(name, num_cus):
    lens = np.array(EDGE_BATCHES[name], dtype=np.int64)
    check_plan(make_plan(lens, num_cus), lens)


@pytest.mark.parametrize("items_per_cu, min_split, align", [(1, 1, 64), (4, 128, 128), (3, 1000, 256), (2, 1, 16)])
def test_other_parameters(items_per_cu, min_split, align):
    for seed in range(4):
        lens = random_seq_lens(np.random.default_rng(100 + seed))
        for num_cus in (8, 304):
            kwargs = {"items_per_cu": items_per_cu, "min_split_tokens": min_split, "align_tokens": align}
            plan = make_plan(lens, num_cus, **kwargs)
            assert plan.align_tokens == align
            check_plan(plan, lens, **kwargs)


def test_long_sequences_get_split_and_fill_the_gpu():
    # 608 items wanted, but no split below DEFAULT_MIN_SPLIT_TOKENS: 8192 / 256 each
    plan = make_plan([8192] * 4, 304)
    assert plan.needs_combine
    assert list(plan.splits_per_seq()) == [8192 // DEFAULT_MIN_SPLIT_TOKENS] * 4
    assert make_plan([8192] * 4, 80).n_work >= 80  # 4 sequences still give every CU an item
    plan = make_plan([3, 0, 1_000_000, 5], 80)
    per_seq = plan.splits_per_seq()
    assert per_seq[2] >= 80 * DEFAULT_ITEMS_PER_CU - 3 and list(per_seq[[0, 1, 3]]) == [1, 1, 1]
    assert make_plan([8192] * 4, 1, items_per_cu=1).n_work == 4  # one CU: no point in splitting


def test_large_batch_is_not_split():
    # at least num_cus * items_per_cu sequences: every CU is busy without splitting
    plan = make_plan([1024] * 700, 304)
    assert plan.n_work == 700 and not plan.needs_combine and (plan.work[:, 3] == -1).all()


def test_accepts_int32_and_lists():
    a = make_plan(np.array([5, 300, 0], np.int32), 8)
    b = make_plan([5, 300, 0], 8)
    np.testing.assert_array_equal(a.work, b.work)
    np.testing.assert_array_equal(a.seq_slots, b.seq_slots)


def test_indptr_round_trip():
    lens = np.array([4, 0, 9, 1])
    indptr = indptr_from_lengths(lens)
    assert indptr.dtype == np.int32 and list(indptr) == [0, 4, 4, 13, 14]
    np.testing.assert_array_equal(lengths_from_indptr(indptr), lens)
    with pytest.raises(ValueError, match=r"seq_lens: total tokens .* int32"):
        indptr_from_lengths([2**31 - 1, 1])
    with pytest.raises(ValueError, match=r"kv_indptr: must be non-decreasing"):
        lengths_from_indptr(np.array([0, 5, 3], np.int32))


@pytest.mark.parametrize(
    "lens, exc, message",
    [
        ([4, -1, 3], ValueError, r"seq_lens: lengths must be >= 0, seq_lens\[1\] = -1"),
        ([1.0, 2.0], TypeError, r"seq_lens: expected integers, got dtype float64"),
        ([[1, 2], [3, 4]], ValueError, r"seq_lens: expected a 1-D .* shape \(2, 2\)"),
        ([], ValueError, r"seq_lens: expected a 1-D sequence of >= 1"),
    ],
)
def test_bad_lengths(lens, exc, message):
    with pytest.raises(exc, match=message):
        make_plan(lens, 8)


@pytest.mark.parametrize("kwargs, name", [
    ({"num_cus": 0}, "num_cus"),
    ({"num_cus": -3}, "num_cus"),
    ({"num_cus": 2.5}, "num_cus"),
    ({"num_cus": 8, "items_per_cu": 0}, "items_per_cu"),
    ({"num_cus": 8, "align_tokens": 0}, "align_tokens"),
    ({"num_cus": 8, "min_split_tokens": 0}, "min_split_tokens"),
])
def test_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected an integer >= 1"):
        make_plan([10, 20], **kwargs)


# --- routing between the fast kernel (whole 128-token tiles) and the portable one -------

@pytest.mark.parametrize("lens, cus", [([1000, 5, 0, 4096, 128, 300], 8), ([8192] * 4, 256),
                                       ([127, 129, 255, 256, 257], 3), ([0, 0], 4)])
def test_fast_plan_covers_every_token_once_with_whole_fast_tiles(lens, cus):
    plan = make_plan(lens, cus, fast_tile_tokens=128)
    fast, rest = plan.fast_work, plan.portable_work
    assert fast.shape[0] == plan.n_fast and rest.shape[0] == plan.n_portable == plan.n_work - plan.n_fast
    assert ((fast[:, 2] - fast[:, 1]) % 128 == 0).all() and (fast[:, 2] > fast[:, 1]).all()
    # portable items: tails shorter than a tile, or empty sequences
    assert ((rest[:, 2] - rest[:, 1]) < 128).all()
    for b, n in enumerate(lens):
        items = plan.work[plan.work[:, 0] == b]
        items = items[np.argsort(items[:, 1])]
        assert items[0, 1] == 0 and items[-1, 2] == n and (items[1:, 1] == items[:-1, 2]).all()
        slots = sorted(items[:, 3].tolist())
        if len(items) == 1:
            assert slots == [-1]
        else:
            assert slots == list(range(plan.seq_slots[b], plan.seq_slots[b + 1]))
    assert sorted(np.concatenate([plan.work[:, 3][plan.work[:, 3] >= 0]]).tolist()) == list(range(plan.n_slots))


def test_fast_items_come_first_longest_first():
    plan = make_plan([1000, 5, 4096, 300], 8, fast_tile_tokens=128)
    lengths = plan.work[:, 2] - plan.work[:, 1]
    assert (np.diff(lengths[: plan.n_fast]) <= 0).all() and (np.diff(lengths[plan.n_fast:]) <= 0).all()
    # 1000 = 896 fast + 104 tail; 300 = 256 + 44; 5 stays portable and unsplit
    tails = sorted(map(tuple, plan.portable_work[:, :3].tolist()))
    assert tails == [(0, 896, 1000), (1, 0, 5), (3, 256, 300)]
    assert plan.work[plan.work[:, 0] == 1][0, 3] == -1


def test_without_a_fast_kernel_nothing_changes():
    lens = [1000, 5, 0, 4096, 128, 300]
    old = make_plan(lens, 8)
    new = make_plan(lens, 8, fast_tile_tokens=0)
    assert old.n_fast == new.n_fast == 0 and old.fast_tile_tokens == 0
    np.testing.assert_array_equal(old.work, new.work)
    np.testing.assert_array_equal(old.portable_work, old.work)
    # benchmark shapes are whole tiles: everything goes to the fast kernel, no extra slots
    bench = make_plan([1024] * 4, 256, fast_tile_tokens=128)
    plain = make_plan([1024] * 4, 256)
    assert bench.n_fast == bench.n_work and bench.n_slots == plain.n_slots


@pytest.mark.parametrize("bad", [-1, 1.5, True, "128"])
def test_fast_tile_tokens_is_checked(bad):
    with pytest.raises(ValueError, match="fast_tile_tokens: expected an integer >= 0"):
        make_plan([10], 4, fast_tile_tokens=bad)


def test_plan_arrays_are_read_only():
    plan = make_plan(np.array([5000, 0, 77]), 8, fast_tile_tokens=128)
    for name in ("work", "seq_slots", "seq_lens", "kv_indptr"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(plan, name)[0] = 1
