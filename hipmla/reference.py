"""Exact MLA decode on the host: the yardstick every kernel is measured against.

Attention is computed in float64 over the *dequantized* cache (so it measures a
kernel's arithmetic, not the cache format's loss), one query token per sequence:

    out[b, h]  = softmax(sm_scale * q[b, h] . K_b^T) V_b      K_b = rows of sequence b (576 wide)
    lse[b, h]  = ln(sum_j exp(sm_scale * q[b, h] . k_j))      natural log, float32

V is the first ``d_v`` = 512 columns of the same rows. An empty sequence has no keys:
its output is defined as zeros and its LSE as -inf (the identity of ``merge_states``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hipmla.formats import KVCache
from hipmla.validate import check_array, check_int, check_positive_finite

#: The model's shape, defined here once: query heads (DeepSeek-V3/R1 at TP8), Q/K width
#: (512 latent + 64 rope) and V width (the first 512 columns of a KV row).
HEADS = 16
D_QK = 576
D_V = 512


def check_q(q, name: str = "q", batch: int | None = None) -> np.ndarray:
    """Q as (b, h_q, 576) bf16 (ml_dtypes) or float32; returns float32 values."""
    check_array(q, name, ndim=3, contiguous=False)
    if q.dtype != ml_dtypes.bfloat16 and q.dtype != np.float32:
        raise TypeError(f"{name}: expected bfloat16 or float32, got {q.dtype}")
    if q.shape[2] != D_QK:
        raise ValueError(f"{name}: expected shape (batch, heads, {D_QK}), got {q.shape}")
    if batch is not None and q.shape[0] != batch:
        raise ValueError(
            f"{name}: expected one query row per sequence ({batch} from kv_indptr), got {q.shape[0]}"
        )
    qf = q.astype(np.float32)
    finite = np.isfinite(qf)
    if not finite.all():
        idx = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"{name}: NaN or Inf at index {idx}")
    return qf


def mla_decode_reference(
    q,
    kv: KVCache,
    layout,
    sm_scale: float,
    *,
    seqs=None,
    d_v: int = D_V,
    qo_indptr=None,
    magnitude: bool = False,
) -> tuple[np.ndarray, ...]:
    """Exact decode. Returns ``out (n, h_q, d_v)`` float32 and ``lse (n, h_q)`` float32
    (natural log) for the query tokens of the sequences ``seqs`` (default: all; n = batch
    with one query token per sequence). ``layout`` is a :class:`hipmla.paging.KvLayout`
    (a page table) or a host ``kv_indptr`` (contiguous rows). ``qo_indptr`` (host, ``batch
    + 1``): sequence s's query tokens are q rows ``qo_indptr[s] ..``, causal within the
    step (``hipmla.queries``); their rows of ``out`` follow in sequence order.

    ``magnitude=True`` appends ``mag (n, h_q, d_v)``: the same weights over ``|V|``, i.e.
    sum_t p_t |v_t| / sum_t p_t >= |out|. An error that is relative in each weight (a
    kernel's P rounded to bf16: 2^-9 each) moves an output by up to about that much times
    ``mag``, however much the signed terms cancel in ``out``: the scale for a tolerance."""
    from hipmla.paging import as_layout
    from hipmla.queries import check_causal, check_qo_indptr, q_lens, visible

    layout = as_layout(layout)
    batch = layout.batch
    if qo_indptr is None:
        qf = check_q(q, batch=batch)
        qo = np.arange(batch + 1, dtype=np.int64)
    else:
        qf = check_q(q)
        qo = check_qo_indptr(qo_indptr, batch, q_tokens=qf.shape[0])
        check_causal(layout.seq_lens(), q_lens(qo, batch))
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv: expected a hipmla.formats.KVCache, got {type(kv).__name__}")
    if kv.dim != D_QK:
        raise ValueError(f"kv: expected rows of {D_QK} values, got {kv.dim}")
    layout.check_cache(kv.rows)
    scale = check_positive_finite(sm_scale, "sm_scale")
    d_v = check_int(d_v, "d_v", 1, kv.dim)
    sel = select_seqs(seqs, batch)
    heads = qf.shape[1]
    tokens = np.concatenate([np.arange(qo[b], qo[b + 1]) for b in sel]) if sel.size else np.zeros(0, np.int64)
    out = np.zeros((tokens.size, heads, d_v), dtype=np.float32)
    lse = np.full((tokens.size, heads), -np.inf, dtype=np.float32)
    mag = np.zeros_like(out) if magnitude else None
    i = 0
    for b in sel:
        rows = layout.rows(int(b))
        n = int(qo[b + 1] - qo[b])
        k_all = kv.dequantize(rows).astype(np.float64) if rows.size else None
        for j in range(n):
            seen = visible(rows.size, n, j) if qo_indptr is not None else rows.size
            if seen > 0:
                k = k_all[:seen]
                s = (qf[qo[b] + j].astype(np.float64) @ k.T) * scale  # (heads, seen)
                m = s.max(axis=1, keepdims=True)
                e = np.exp(s - m)
                denom = e.sum(axis=1, keepdims=True)
                out[i] = (e @ k[:, :d_v]) / denom
                lse[i] = (m + np.log(denom))[:, 0]
                if mag is not None:
                    mag[i] = (e @ np.abs(k[:, :d_v])) / denom
            i += 1
    return (out, lse, mag) if magnitude else (out, lse)


def select_seqs(seqs, batch: int, *, allow_empty: bool = True) -> np.ndarray:
    """The sequence indices ``seqs`` of a batch of ``batch`` as int64 (all of them for
    None): a 1-D list of integers (0.5 must not become sequence 0, -1 not the last one)
    in ``[0, batch)``."""
    if seqs is None:
        return np.arange(batch, dtype=np.int64)
    arr = np.asarray(seqs)
    if arr.ndim != 1 or (arr.size == 0 and not allow_empty):
        want = "a 1-D sequence of sequence indices" + ("" if allow_empty else " (>= 1)")
        raise ValueError(f"seqs: expected {want}, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"seqs: expected integer sequence indices, got dtype {arr.dtype}")
    sel = arr.astype(np.int64)
    bad = sel[(sel < 0) | (sel >= batch)]
    if bad.size:
        raise ValueError(f"seqs: indices must lie in [0, {batch}), got {int(bad[0])}")
    return sel


def merge_states(
    out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Combine two attentions over disjoint key sets by their natural-log LSE.

    ``out_*`` (..., d) and ``lse_*`` (...). An empty side (LSE -inf) contributes nothing;
    both empty gives zeros and -inf. Exact in float64, returned as float32.
    """
    for name, o, l in (("out_a", out_a, lse_a), ("out_b", out_b, lse_b)):
        check_array(np.asarray(o), name, contiguous=False)
        if np.shape(o)[:-1] != np.shape(l):
            raise ValueError(f"{name}: leading shape {np.shape(o)[:-1]} must match its LSE shape {np.shape(l)}")
    if np.shape(out_a) != np.shape(out_b):
        raise ValueError(f"out_b: expected shape {np.shape(out_a)} like out_a, got {np.shape(out_b)}")
    la = np.asarray(lse_a, dtype=np.float64)
    lb = np.asarray(lse_b, dtype=np.float64)
    if np.isnan(la).any() or np.isnan(lb).any() or np.isposinf(la).any() or np.isposinf(lb).any():
        raise ValueError("lse_a/lse_b: LSE values must be finite or -inf")
    m = np.maximum(la, lb)
    safe_m = np.where(np.isneginf(m), 0.0, m)
    wa = np.exp(la - safe_m)
    wb = np.exp(lb - safe_m)
    total = wa + wb
    denom = np.where(total > 0, total, 1.0)
    out = (np.asarray(out_a, np.float64) * (wa / denom)[..., None]
           + np.asarray(out_b, np.float64) * (wb / denom)[..., None])
    lse = np.where(total > 0, safe_m + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return out.astype(np.float32), lse.astype(np.float32)
