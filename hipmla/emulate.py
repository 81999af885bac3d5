"""numpy model of the device kernels' numerics (hip_src/KERNELS.md, "Numerics").

It follows the kernels' rounding points — Q quantized as the kernel does, scores in
f32, the running max per tile of ``TILE_TOKENS``, P rounded to bf16, f32 accumulation,
one partial per work item of the same device schedule (:mod:`hipmla.schedule`), the
LSE merge the last item of a split sequence does, bf16 output rounded nearest-even — so device output can be compared
against it tightly. What it does not model is the order of f32 summation inside a dot
product; scores are formed in f64 and rounded once to f32, the closest any order gets.

Work items of the fast kernels follow their schedule (:class:`FastSchedule`, one per
arch in ``FAST_SCHEDULES``): on gfx950 each 128-token tile is cut in four 32-token
quarters, quarter w to wave w; every wave keeps its own online softmax over its quarters
(running max per quarter) and the four states are merged like the in-kernel merge merges
partials, before the item writes its output or partial. gfx942's kernel keeps one state
per block over 16-token tiles (a schedule of one wave). The fast kernels
mask a partial last tile (tokens past the item's end score -inf, so P = 0), so they take
items of any length: with a policy's ``fast_tile`` the items of whole tiles go to the
fast schedule, with ``emulate_decode(..., fast_any_length=True)`` every item does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hipmla.formats import FP8_VARIANTS, KVCache, mx_fake_quantize, to_bf16
from hipmla.paging import KvLayout, as_layout
from hipmla.reference import D_V, check_q, select_seqs
from hipmla.schedule import SplitPolicy, row_shape, schedule
from hipmla.validate import check_choice, check_positive_finite

TILE_TOKENS = 64
Q_PRECISIONS = ("bf16", "fp8", "mxfp4")
#: What the tensor-core products take: bf16 (every kernel but one), or f16 (the sm_90
#: kernel for an fp8 cache, whose e4m3 codes the hardware converts to f16): see f16_q.
PRODUCTS = ("bf16", "f16")
LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)


@dataclass(frozen=True)
class Partial:
    """One work item's state: unnormalised ``acc (h, d_v)``, running max ``m (h)`` in
    log2 units and sum ``l (h)``, all f32 (the kernels' scratch layout)."""

    acc: np.ndarray
    m: np.ndarray
    l: np.ndarray


def quantize_q(q: np.ndarray, q_precision: str, fp8_variant: str = "e4m3fn") -> np.ndarray:
    """Q as the kernel sees it after its own quantization (f32 values)."""
    check_choice(q_precision, "q_precision", Q_PRECISIONS)
    if q_precision == "bf16":
        return np.asarray(q, dtype=np.float32)
    element = "e2m1" if q_precision == "mxfp4" else check_choice(fp8_variant, "fp8_variant", FP8_VARIANTS)
    return mx_fake_quantize(q, element, rule="floor")


def f16_q(q: np.ndarray) -> np.ndarray:
    """Q as f16 products see it (float64): each head's values (the last axis) times 2^k,
    rounded to f16 nearest-even (subnormals kept), times 2^-k, with k = min(141 - E, 126)
    and E the largest exponent field of the head's values (hip_src/decode/split_sm90.hip,
    q_exponent): the head's largest |q| times 2^k lies in [2^14, 2^15), so every bf16 value
    within 2^-29 of it comes back unchanged."""
    q32 = np.asarray(q, dtype=np.float32)
    e = ((q32.view(np.uint32) >> 23) & 0xFF).max(axis=-1, keepdims=True).astype(np.int64)
    k = np.minimum(141 - e, 126).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (q32.astype(np.float64) * np.exp2(k)).astype(np.float32).astype(np.float16)
    return scaled.astype(np.float64) * np.exp2(-k)


def emulate_work_item(
    qf: np.ndarray, k: np.ndarray, scale_log2: np.float32, tile: int = TILE_TOKENS, d_v: int = D_V,
    products: str = "bf16",
) -> Partial:
    """Online softmax over ``k (n, 576)`` (f32 values) in tiles, for all heads of ``qf``.
    ``products="f16"``: the bf16 P enter P.V as f16 (exact for P >= 2^-17), while l sums
    the bf16 values, as the sm_90 kernel does for an fp8 cache (its Q is :func:`f16_q`'s,
    which the caller passes in ``qf``)."""
    heads = qf.shape[0]
    n = k.shape[0]
    if n == 0:
        return Partial(
            np.zeros((heads, d_v), np.float32),
            np.full(heads, -np.inf, np.float32),
            np.zeros(heads, np.float32),
        )
    s = ((qf.astype(np.float64) @ k.T.astype(np.float64)).astype(np.float32) * scale_log2).astype(np.float32)
    n_tiles = -(-n // tile)
    pad = n_tiles * tile - n
    tile_max = np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf).reshape(heads, n_tiles, tile).max(axis=2)
    m_run = np.maximum.accumulate(tile_max, axis=1)  # running max after each tile
    m_tok = np.repeat(m_run, tile, axis=1)[:, :n]
    p = to_bf16(np.exp2(s - m_tok)).astype(np.float32)
    m_final = m_run[:, -1:]
    # Rescaling by alpha at every later tile telescopes to one factor per tile.
    w_tile = np.exp2(m_run - m_final).astype(np.float32)
    w_tok = np.repeat(w_tile, tile, axis=1)[:, :n]
    pw = p * w_tok
    l = pw.sum(axis=1, dtype=np.float32)
    if check_choice(products, "products", PRODUCTS) == "f16":
        pw = p.astype(np.float16).astype(np.float32) * w_tok
    acc = (pw @ k[:, :d_v]).astype(np.float32)
    return Partial(acc, m_final[:, 0].astype(np.float32), l)


@dataclass(frozen=True)
class FastSchedule:
    """How a fast kernel walks a work item of whole tiles: ``waves`` waves each take
    ``tile_tokens / waves`` consecutive tokens of every tile."""

    tile_tokens: int
    waves: int

    @property
    def quarter(self) -> int:
        return self.tile_tokens // self.waves


#: hip_src/decode/split_mfma_gfx950.hip (Q quantized as the portable kernel does it).
GFX950_SCHEDULE = FastSchedule(tile_tokens=128, waves=4)
#: hip_src/decode/split_mfma_gfx942.hip keeps ONE online softmax per block (its 4 waves
#: split the dimensions and add their partial scores), the running max moving every 16
#: tokens: one "wave" of 16-token quarters, i.e. emulate_work_item(tile=16). Every other
#: rounding point is the portable kernel's (KV dequantized exactly to bf16, P to bf16).
GFX942_SCHEDULE = FastSchedule(tile_tokens=16, waves=1)
#: The schedule of each arch's fast kernel (hipmla.kernels.FAST_SOURCES).
FAST_SCHEDULES = {"gfx950": GFX950_SCHEDULE, "gfx942": GFX942_SCHEDULE}
#: hip_src/decode/split_sm90.hip keeps ONE online softmax per block (its 8 warps split the
#: dimensions and exchange partial scores), with the running max moving every 32 tokens:
#: its numerics are emulate_work_item(tile=SM90_TILE_TOKENS), i.e.
#: ``emulate_decode(..., tile_tokens=SM90_TILE_TOKENS)`` with a policy without fast_tile,
#: and for an fp8 cache ``products="f16"`` (``hipmla.kernels.sm90_split_kernel(kv).products``).
SM90_TILE_TOKENS = 32


def merge(parts: list[Partial]) -> Partial:
    """States over disjoint token sets merged into one (max-weighted, f32, in list order)."""
    m = np.stack([p.m for p in parts])
    big_m = m.max(axis=0)
    safe = np.where(np.isneginf(big_m), np.float32(0), big_m)
    w = np.exp2(m - safe).astype(np.float32)
    l = np.zeros_like(parts[0].l)
    acc = np.zeros_like(parts[0].acc)
    for wi, p in zip(w, parts):
        l = (l + wi * p.l).astype(np.float32)
        acc = (acc + wi[:, None] * p.acc).astype(np.float32)
    return Partial(acc, big_m.astype(np.float32), l)


def emulate_fast_item(
    qf: np.ndarray, k: np.ndarray, scale_log2: np.float32, schedule: FastSchedule = GFX950_SCHEDULE,
    d_v: int = D_V,
) -> Partial:
    """One fast-kernel item over ``k (n, 576)``, any ``n >= 0``: each wave's quarters as
    their own online softmax, then the waves merged in order.

    Wave w takes tokens ``t`` with ``(t % tile) // quarter == w``. Only the last tile may
    be partial, so every quarter of a wave but its last is whole and a wave's tokens in
    order are exactly the kernel's quarter steps: the running max moves per ``quarter``
    tokens of the wave. The kernel's masked tokens (past ``n``: score -inf, P = 0, V of a
    valid row) add exact zeros, so leaving them out is what it computes; a wave with no
    token keeps m = -inf (the kernel's -FLT_MAX start gives the same weight 0 in the
    merge), l = 0, acc = 0, and ``n = 0`` gives the empty state (output 0, LSE -inf)."""
    n = k.shape[0]
    token = np.arange(n)
    wave_of = (token % schedule.tile_tokens) // schedule.quarter
    parts = [emulate_work_item(qf, k[wave_of == w], scale_log2, schedule.quarter, d_v)
             for w in range(schedule.waves)]
    return merge(parts)


def finalize(acc: np.ndarray, m: np.ndarray, l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 output and natural-log LSE from one (merged) state; empty gives 0 and -inf."""
    empty = l <= 0
    denom = np.where(empty, np.float32(1), l)
    out = np.where(empty[..., None], np.float32(0), acc / denom[..., None])
    lse = np.where(empty, -np.inf, (m + np.log2(denom)) * LN2).astype(np.float32)
    return to_bf16(out), lse


def combine(parts: list[Partial]) -> tuple[np.ndarray, np.ndarray]:
    """The in-kernel merge of a split sequence: partials by their running max, in slot
    order, then finalize."""
    m = np.stack([p.m for p in parts])
    big_m = m.max(axis=0)
    safe = np.where(np.isneginf(big_m), np.float32(0), big_m)
    w = np.exp2(m - safe).astype(np.float32)
    l = (w * np.stack([p.l for p in parts])).sum(axis=0, dtype=np.float32)
    acc = (w[..., None] * np.stack([p.acc for p in parts])).sum(axis=0, dtype=np.float32)
    return finalize(acc, big_m, l)


def emulate_decode(
    q,
    kv: KVCache,
    layout: KvLayout | np.ndarray,
    sm_scale: float,
    policy: SplitPolicy,
    *,
    q_precision: str = "bf16",
    q_fp8_variant: str | None = None,
    seqs=None,
    tile_tokens: int = TILE_TOKENS,
    fast_schedule: FastSchedule = GFX950_SCHEDULE,
    fast_any_length: bool = False,
    qo_indptr=None,
    products: str = "bf16",
    row_heads: int = 16,
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted device output ``(n, h, 512)`` bf16 and LSE ``(n, h)`` f32 for the query
    tokens of the sequences ``seqs`` (default all; n = batch with one query token per
    sequence), the step cut into items by ``policy`` as the device cuts it: one row (16
    heads of one query token, or below 16 heads several tokens' heads; causal:
    ``hipmla.queries``) per item. ``layout`` is a
    :class:`~hipmla.paging.KvLayout` (or a host ``kv_indptr`` for contiguous rows);
    ``qo_indptr`` as in :func:`hipmla.reference.mla_decode_reference`. ``q_fp8_variant``
    is the e4m3 flavour the target quantizes fp8 Q to (default: the cache's). Items of
    whole ``policy.fast_tile`` tiles follow ``fast_schedule``; the rest the portable
    kernel's tiles. ``fast_any_length``: the masked fast kernel takes every item, any
    length (a policy without ``fast_tile``, as the decoder launches it on gfx950/gfx942),
    so every item follows ``fast_schedule``. ``products``: what the tensor-core products
    take (:data:`PRODUCTS`; ``"f16"``: Q through :func:`f16_q`, P into P.V as f16).
    ``row_heads``: rows of heads x query tokens one schedule row holds (the 64-row sm_90a
    kernel: 64; a multiple of 16 that divides the heads or that they divide): the split is
    the device's for heads / row_heads rows a query token, or below row_heads heads for
    rows of several query tokens (``hipmla.schedule.row_shape``: row_heads // heads rounded
    down to a power of two; the 16-head kernels below 16 heads too),
    and each item serves its row's 16-head groups, each with its own softmax and merge over
    what its query token sees of the item's tokens."""
    from hipmla.queries import check_causal, check_heads, check_qo_indptr, head_groups, q_lens, visible

    if not isinstance(fast_any_length, (bool, np.bool_)):
        raise TypeError(f"fast_any_length: expected a bool, got {type(fast_any_length).__name__}")
    if fast_any_length and policy.fast_tile:
        raise ValueError(
            f"fast_any_length: the masked fast kernel takes every item, so the policy cuts no "
            f"tail items (fast_tile must be 0, got {policy.fast_tile})"
        )
    if policy.fast_tile and policy.fast_tile != fast_schedule.tile_tokens:
        raise ValueError(
            f"fast_schedule: the policy's fast items are {policy.fast_tile}-token tiles, "
            f"the schedule walks {fast_schedule.tile_tokens}-token tiles"
        )
    layout = as_layout(layout)
    if qo_indptr is None:
        qf = check_q(q, batch=layout.batch)
        qo, nq = np.arange(layout.batch + 1, dtype=np.int64), None
    else:
        qf = check_q(q)
        qo = check_qo_indptr(qo_indptr, layout.batch, q_tokens=qf.shape[0])
        nq = q_lens(qo, layout.batch)
        check_causal(layout.seq_lens(), nq)
    heads = qf.shape[1]
    # A row is 16 heads; fewer heads are one row.
    groups = head_groups(check_heads(heads, "q.shape[1]"))
    width = heads // groups
    if isinstance(row_heads, bool) or not isinstance(row_heads, (int, np.integer)) or row_heads < 16 \
            or row_heads % 16 or (row_heads != 16 and heads % row_heads and (heads < 16 or row_heads % heads)):
        raise ValueError(f"row_heads: expected a multiple of 16 that divides the {heads} heads or that they "
                         f"divide, got {row_heads!r}")
    # Schedule rows a query token, or query tokens a row (fewer than 16 heads are one row).
    sched_groups, row_tokens = row_shape(heads, int(row_heads))
    per_row = groups // sched_groups  # 16-head groups of a schedule row
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv: expected a hipmla.formats.KVCache, got {type(kv).__name__}")
    layout.check_cache(kv.rows)
    scale_log2 = np.float32(np.float32(check_positive_finite(sm_scale, "sm_scale")) * LOG2E)
    qq = quantize_q(qf, q_precision, q_fp8_variant or kv.fp8_variant)
    if check_choice(products, "products", PRODUCTS) == "f16":
        if fast_any_length or policy.fast_tile:
            raise ValueError("products: the fast schedules take bf16 products only")
        qq = f16_q(qq)
    sel = select_seqs(seqs, layout.batch)
    lens = layout.seq_lens()
    items = schedule(lens, policy, q_lens=nq, head_groups=sched_groups, row_tokens=row_tokens)
    tokens = [np.arange(qo[b], qo[b + 1]) for b in sel]
    n_out = int(sum(t.size for t in tokens))
    out = np.empty((n_out, heads, D_V), dtype=to_bf16(0).dtype)
    lse = np.empty((n_out, heads), dtype=np.float32)
    i = 0
    for b, toks in zip(sel, tokens):
        for t in toks:
            j_q = int(t - qo[b])
            sees = visible(int(lens[b]), int(qo[b + 1] - qo[b]), j_q)
            row_first = int(qo[b]) + j_q // row_tokens * row_tokens  # the row's first query token
            for g in range(groups):
                parts = []
                h = slice(width * g, width * (g + 1))
                qrow = qq[t, h]
                for j in items.items_of_row(row_first * sched_groups + g // per_row):
                    # A row of several query tokens covers what its last one sees; the
                    # kernel masks the rest of the item for the earlier ones.
                    t1 = min(int(items.end[j]), sees)
                    t0 = min(int(items.begin[j]), t1)
                    k = kv.dequantize(layout.rows(int(b), t0, t1))
                    # The kernel that runs the item is chosen by the item's length, not by
                    # what this token sees of it (an earlier token of a row sees fewer).
                    length = int(items.end[j]) - int(items.begin[j])
                    if fast_any_length or (policy.fast_tile and length > 0 and length % policy.fast_tile == 0):
                        parts.append(emulate_fast_item(qrow, k, scale_log2, fast_schedule))
                    else:
                        parts.append(emulate_work_item(qrow, k, scale_log2, tile_tokens, products=products))
                if len(parts) == 1:
                    out[i, h], lse[i, h] = finalize(parts[0].acc, parts[0].m, parts[0].l)
                else:
                    out[i, h], lse[i, h] = combine(parts)
            i += 1
    return out, lse
