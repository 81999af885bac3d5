"""Which query tokens belong to which sequence, and which kv tokens each one sees.

A step has ``t_q`` query tokens: with no ``qo_indptr`` one per sequence (token ``i`` is
sequence ``i``'s), else sequence ``s`` owns tokens ``qo_indptr[s] .. qo_indptr[s+1] - 1``
(multi-token prediction / speculative decoding: 1 to 8 per sequence, ragged). Within the
step attention is causal: query token ``j`` (0-based) of a sequence with ``L`` kv tokens
and ``n`` query tokens sees its first ``L - n + j + 1`` kv tokens, so ``L >= n`` is
required (the step's own tokens are already in the cache). Every kernel computes 16 heads
of one query token at a time: a *row* (``hipmla.schedule``); a model of fewer heads (8 at
DeepSeek-V3's TP16) shares a row among several query tokens of a sequence
(``hipmla.schedule.row_shape``).
"""

from __future__ import annotations

import numpy as np

from hipmla.validate import INT32_MAX, check_array

#: Query heads a decoder may serve below 16 (DeepSeek-V3/R1 at TP16 or TP32, Kimi K2's 64 at
#: TP8 or TP16): the kernels of 16-head rows share each row among query tokens (the row's
#: other heads get zero Q and write nothing).
PADDED_HEADS = tuple(range(1, 16))
#: Query heads a decoder may serve (DeepSeek-V3/R1's 128 at TP8, TP4, TP2, TP1; fewer padded).
HEAD_COUNTS = PADDED_HEADS + (16, 32, 64, 128)
#: Largest ``q_len`` hint a Decoder takes (64 query tokens fill the 64-row kernel at any head count).
MAX_Q_LEN = 64


def head_groups(heads: int) -> int:
    """Rows of 16 heads a query token takes (``p.head_groups`` of the 16-head kernels): one
    below 16 heads."""
    return max(int(heads) // 16, 1)


def heads_in_row(heads: int) -> int:
    """Heads of q / out / lse in one 16-head row (``p.heads_in_row``): all 16, or the model's
    fewer."""
    return min(int(heads), 16)


def check_heads(heads, name: str = "heads") -> int:
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or int(heads) not in HEAD_COUNTS:
        raise ValueError(f"{name}: expected 1 to 16, 32, 64 or 128 query heads, got {heads!r}")
    return int(heads)


def check_qo_indptr(qo_indptr, batch: int, q_tokens: int | None = None, name: str = "qo_indptr") -> np.ndarray:
    """A host ``qo_indptr`` as int64: ``batch + 1`` non-decreasing int32 offsets from 0
    (to ``q_tokens``, the rows of q, when given)."""
    check_array(qo_indptr, name, ndim=1, contiguous=False)
    a = np.asarray(qo_indptr)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.shape[0] != batch + 1:
        raise ValueError(f"{name}: expected {batch + 1} entries (batch + 1), got {a.shape[0]}")
    wide = a.astype(np.uint64) if a.dtype.kind == "u" else a.astype(np.int64)
    out_of_range = (wide > INT32_MAX) if a.dtype.kind == "u" else ((wide < 0) | (wide > INT32_MAX))
    if out_of_range.any():
        i = int(np.flatnonzero(out_of_range)[0])
        raise ValueError(f"{name}: entries must lie in [0, {INT32_MAX}], {name}[{i}] = {int(wide[i])}")
    a = wide.astype(np.int64)
    if a[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] = 0, got {int(a[0])}")
    down = np.flatnonzero(np.diff(a) < 0)
    if down.size:
        i = int(down[0])
        raise ValueError(f"{name}: must not decrease, {name}[{i + 1}] = {int(a[i + 1])} < {name}[{i}] = {int(a[i])}")
    if q_tokens is not None and int(a[-1]) != q_tokens:
        raise ValueError(f"{name}: the last entry must be the {q_tokens} query tokens of q, got {int(a[-1])}")
    return a


def q_lens(qo_indptr: np.ndarray | None, batch: int) -> np.ndarray:
    """Query tokens per sequence (1 each without ``qo_indptr``)."""
    return np.ones(batch, np.int64) if qo_indptr is None else np.diff(np.asarray(qo_indptr, np.int64))


def check_causal(seq_lens, lens_q, name: str = "kv_indptr") -> None:
    """Every sequence has at least as many kv tokens as query tokens (``L >= n``)."""
    kv = np.asarray(seq_lens, np.int64)
    nq = np.asarray(lens_q, np.int64)
    short = np.flatnonzero(kv < nq)
    if short.size:
        s = int(short[0])
        raise ValueError(f"{name}: sequence {s} has {int(kv[s])} kv tokens but {int(nq[s])} query tokens "
                         f"(qo_indptr); each query token must see itself, so kv tokens >= query tokens")


def visible(seq_len: int, n: int, j: int) -> int:
    """kv tokens query token ``j`` of ``n`` sees in a sequence of ``seq_len``."""
    return seq_len - n + j + 1
