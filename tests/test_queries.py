"""hipmla.queries: query tokens per sequence, the head counts, and causal visibility --
the checks every entry point (Decoder, emulator, reference) runs before anything launches."""

from __future__ import annotations

import numpy as np
import pytest

from hipmla.queries import HEAD_COUNTS, check_causal, check_heads, check_qo_indptr, heads_in_row, q_lens, visible
from hipmla.validate import INT32_MAX


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_every_served_head_count_passes(heads):
    assert check_heads(heads) == heads
    assert check_heads(np.int32(heads)) == heads


@pytest.mark.parametrize("heads", [0, -8, 17, 24, 48, 256, True, 16.0, "16", None])
def test_other_head_counts_are_argument_errors(heads):
    with pytest.raises(ValueError, match=r"^heads: expected 1 to 16, 32, 64 or 128 query heads, got "):
        check_heads(heads)


def test_a_row_holds_sixteen_heads_or_the_models_fewer():
    assert [heads_in_row(h) for h in HEAD_COUNTS] == list(range(1, 16)) + [16, 16, 16, 16]


def test_a_valid_qo_indptr_comes_back_as_int64():
    a = check_qo_indptr(np.array([0, 2, 2, 5], np.int32), batch=3, q_tokens=5)
    assert a.dtype == np.int64 and a.tolist() == [0, 2, 2, 5]
    assert check_qo_indptr(np.array([0, INT32_MAX], np.uint64), batch=1).tolist() == [0, INT32_MAX]


@pytest.mark.parametrize("qo, batch, q_tokens, exc, match", [
    (np.array([0.0, 1.0]), 1, None, TypeError, r"qo_indptr: expected integers, got dtype float64"),
    (np.array([0, 1, 2]), 1, None, ValueError, r"qo_indptr: expected 2 entries \(batch \+ 1\), got 3"),
    (np.array([0, -1]), 1, None, ValueError, r"qo_indptr: entries must lie in \[0, 2147483647\], qo_indptr\[1\] = -1"),
    (np.array([0, 2 ** 31]), 1, None, ValueError, r"qo_indptr\[1\] = 2147483648"),
    (np.array([0, 2 ** 32], np.uint64), 1, None, ValueError, r"qo_indptr\[1\] = 4294967296"),
    (np.array([1, 2]), 1, None, ValueError, r"qo_indptr: expected qo_indptr\[0\] = 0, got 1"),
    (np.array([0, 3, 2]), 2, None, ValueError,
     r"qo_indptr: must not decrease, qo_indptr\[2\] = 2 < qo_indptr\[1\] = 3"),
    (np.array([0, 2, 4]), 2, 5, ValueError, r"qo_indptr: the last entry must be the 5 query tokens of q, got 4"),
])
def test_bad_qo_indptr_says_what_and_where(qo, batch, q_tokens, exc, match):
    with pytest.raises(exc, match=match):
        check_qo_indptr(qo, batch, q_tokens)


def test_query_lengths():
    assert q_lens(None, 3).tolist() == [1, 1, 1]
    assert q_lens(np.array([0, 2, 2, 5]), 3).tolist() == [2, 0, 3]


def test_causal_needs_a_kv_token_per_query_token():
    check_causal([4, 0, 3], [4, 0, 1])
    with pytest.raises(ValueError, match=r"^kv_indptr: sequence 2 has 3 kv tokens but 4 query tokens"):
        check_causal([4, 0, 3], [1, 0, 4])


@pytest.mark.parametrize("seq_len, n", [(1, 1), (9, 1), (9, 4), (4, 4)])
def test_visible_is_causal_within_the_step(seq_len, n):
    seen = [visible(seq_len, n, j) for j in range(n)]
    assert seen[-1] == seq_len  # the step's last token sees the whole cache
    assert seen == list(range(seq_len - n + 1, seq_len + 1))  # one more token each
    assert min(seen) >= 1  # L >= n: each token sees at least itself
