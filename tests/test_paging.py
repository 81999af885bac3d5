"""hipmla.paging: the map from (sequence, token) to cache row, contiguous or paged."""

from __future__ import annotations

import numpy as np
import pytest

from hipmla.formats import quantize_kv
from hipmla.paging import KvLayout, as_layout, check_page_size, gather, random_page_table, scatter
from hipmla.validate import MAX_SEQ_TOKENS


def test_contiguous_rows():
    lay = KvLayout.contiguous([3, 0, 2])
    assert list(lay.kv_indptr) == [0, 3, 3, 5] and not lay.paged
    assert list(lay.rows(0)) == [0, 1, 2] and list(lay.rows(1)) == [] and list(lay.rows(2)) == [3, 4]
    assert list(lay.seq_lens()) == [3, 0, 2] and lay.max_row() == 4


def test_paged_rows_follow_the_page_table():
    # sequence 0: pages 5, 2 (4 rows a page), 3 rows used in page 2; sequence 1: empty;
    # sequence 2: page 5 again (shared) with 1 row
    lay = KvLayout(np.array([0, 2, 2, 3], np.int32), np.array([5, 2, 5], np.int32),
                   np.array([3, 1, 1], np.int32), page_size=4)
    assert list(lay.seq_lens()) == [7, 0, 1]
    assert list(lay.rows(0)) == [20, 21, 22, 23, 8, 9, 10]
    assert list(lay.rows(2)) == [20]
    assert list(lay.rows(0, 3, 6)) == [23, 8, 9]
    assert lay.max_row() == 23
    lay.check_cache(24)
    with pytest.raises(ValueError, match=r"kv_indices: page 5 \(kv_indices\[0\]\) ends past the 23 rows"):
        lay.check_cache(23)


@pytest.mark.parametrize("kwargs, words", [
    (dict(kv_indices=np.array([0], np.int32)), "a page table needs both"),
    (dict(kv_indices=np.array([-1], np.int32), kv_last_page_len=np.array([1], np.int32)), "page ids must be >= 0"),
    (dict(kv_indices=np.array([0], np.int32), kv_last_page_len=np.array([5], np.int32), page_size=4),
     r"kv_last_page_len: expected 1..4"),
    (dict(kv_indices=np.array([0], np.int32), kv_last_page_len=np.array([0], np.int32), page_size=4),
     r"kv_last_page_len\[0\] = 0"),
    (dict(kv_indices=np.zeros(0, np.int32), kv_last_page_len=np.array([1], np.int32)), "exceeds the 0 entries"),
    (dict(kv_indices=np.array([0], np.int32), kv_last_page_len=np.array([1, 1], np.int32)), "kv_last_page_len"),
    (dict(kv_indices=np.array([0.0]), kv_last_page_len=np.array([1], np.int32)), "kv_indices"),
    (dict(page_size=3), "page_size"),
    (dict(page_size=16), "page_size: 16 given without a page table"),
])
def test_bad_layouts_name_themselves(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        KvLayout(np.array([0, 1], np.int32), **kwargs)


def test_a_sequence_past_the_most_tokens_is_refused():
    # The kernels count an item's tokens and tiles in int32, safe up to MAX_SEQ_TOKENS (2^30);
    # every int32 check passes here. Shared pages make such a sequence cheap to describe.
    assert MAX_SEQ_TOKENS == 1 << 30
    pages = (1 << 23) + 1
    with pytest.raises(ValueError, match=r"sequence 0 has 1073741952 tokens .*\(1073741824, 2\^30\)"):
        KvLayout(np.array([0, pages], np.int32), np.zeros(pages, np.int32), np.array([128], np.int32), 128)
    with pytest.raises(ValueError, match="sequence 0 has 1073741825 tokens"):
        KvLayout(np.array([0, pages], np.int32), np.zeros(pages, np.int32), np.array([1], np.int32), 128)
    lay = KvLayout(np.array([0, 1 << 23], np.int32), np.zeros(1 << 23, np.int32), np.array([128], np.int32), 128)
    assert lay.seq_lens()[0] == MAX_SEQ_TOKENS
    # Contiguous rows: the same bound on each sequence (the rows themselves may reach 2^31 - 1).
    with pytest.raises(ValueError, match="kv_indptr: sequence 1 has 1073741825 tokens"):
        KvLayout(np.array([0, 5, 5 + MAX_SEQ_TOKENS + 1], np.int64))
    assert KvLayout(np.array([0, MAX_SEQ_TOKENS, 2 * MAX_SEQ_TOKENS - 1], np.int64)).seq_lens().tolist() == \
        [MAX_SEQ_TOKENS, MAX_SEQ_TOKENS - 1]
    with pytest.raises(ValueError, match=r"seq_lens: lengths must lie in \[0, 1073741824\]"):
        KvLayout.contiguous([3, MAX_SEQ_TOKENS + 1])


@pytest.mark.parametrize("bad", [0, 3, 256, True, 2.0, "16"])
def test_page_size_is_a_power_of_two_up_to_128(bad):
    with pytest.raises(ValueError, match="page_size"):
        check_page_size(bad)
    assert [check_page_size(1 << k) for k in range(8)] == [1, 2, 4, 8, 16, 32, 64, 128]


def test_random_page_table_permutes_and_shares():
    rng = np.random.default_rng(0)
    lens = np.array([100, 0, 64, 33, 200])
    lay = random_page_table(lens, 16, rng, spare_pages=10, shared=2)
    assert list(lay.seq_lens()) == list(lens)
    used = lay.kv_indices[: lay.kv_indptr[-1]]
    assert len(set(used.tolist())) < used.size  # some page appears twice
    assert not np.array_equal(np.sort(used), used)  # not in order


def test_scatter_then_gather_is_the_identity():
    rng = np.random.default_rng(1)
    lens = np.array([5, 0, 40, 17])
    kv = quantize_kv(rng.standard_normal((62, 576), dtype=np.float32), "mxfp4", scale_stride=24)
    lay = random_page_table(lens, 8, rng, spare_pages=3)
    pool = scatter(kv, lay)
    back, contiguous = gather(pool, lay)
    assert np.array_equal(back.data, kv.data) and np.array_equal(back.scales, kv.scales)
    assert list(contiguous.kv_indptr) == [0, 5, 5, 45, 62]


def test_as_layout_takes_an_indptr():
    assert list(as_layout(np.array([0, 2], np.int32)).seq_lens()) == [2]
    with pytest.raises(ValueError, match="kv_indptr"):
        as_layout(np.array([1, 2], np.int32))
