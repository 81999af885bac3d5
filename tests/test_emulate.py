"""hipmla.emulate: the modelled error of each Q precision against exact attention,
independence from the plan, the numerics of KERNELS.md on hand-built cases, and the
edge cases (one token, empty sequences)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from hipmla.emulate import (
    FAST_SCHEDULES,
    GFX942_SCHEDULE,
    GFX950_SCHEDULE,
    FastSchedule,
    emulate_decode,
    emulate_fast_item,
    f16_q,
    emulate_work_item,
    merge,
    quantize_q,
)
from hipmla.formats import quantize_kv, to_bf16
from hipmla.inputs import make_inputs
from hipmla.paging import KvLayout, gather, random_page_table, scatter
from hipmla.schedule import SplitPolicy, schedule
from hipmla.reference import mla_decode_reference

# Ragged lengths with an empty sequence, a single token, partial tiles and several tiles.
LENS = [300, 0, 1, 37, 128, 700, 65]


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture(scope="module", params=["bf16", "fp8", "mxfp4"])
def case(request):
    inp = make_inputs(LENS, request.param, seed=21)
    ref = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale)
    return inp, ref


# Measured on this data (seed 21, 16 heads, N(0,1), sm_scale 1/sqrt(576)), relative L2
# error of the output against the exact reference, for the bf16 / fp8 / mxfp4 caches:
#   bf16 Q   5.4e-4 / 1.6e-3 / 5.4e-4   (bf16 rounding of P dominates; with the fp8 cache
#            the one-token sequence adds bf16(v) != v, as 1/56-scaled values are not bf16)
#   fp8 Q    7.8e-3 / 7.9e-3 / 7.7e-3
#   mxfp4 Q  2.6e-2 / 2.6e-2 / 2.6e-2
# and max |LSE error| 8e-4 (bf16 Q), 0.19 (fp8 Q), 1.1 (mxfp4 Q; the 300-token sequence's
# largest score moves by that much). Bounds leave ~2x margin.
BOUNDS = {"bf16": (4e-3, 3e-3), "fp8": (2e-2, 0.4), "mxfp4": (6e-2, 2.2)}


def test_modelled_error_per_q_precision(case):
    inp, (ref_out, ref_lse) = case
    policy = SplitPolicy.for_device(80)
    live = np.flatnonzero(inp.seq_lens > 0)
    errors = {}
    for qp, (out_bound, lse_bound) in BOUNDS.items():
        out, lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy, q_precision=qp)
        assert out.dtype == ml_dtypes.bfloat16 and out.shape == (len(LENS), 16, 512)
        assert lse.dtype == np.float32 and lse.shape == (len(LENS), 16)
        errors[qp] = rel_l2(out[live].astype(np.float32), ref_out[live])
        lse_err = float(np.abs(lse[live] - ref_lse[live]).max())
        assert errors[qp] < out_bound, f"q_precision={qp}: relative L2 error {errors[qp]:.2e}"
        assert lse_err < lse_bound, f"q_precision={qp}: max LSE error {lse_err:.2e}"
    # what the Q precision costs: each cheaper format at least doubles the error
    assert 2 * errors["bf16"] < errors["fp8"] and 2 * errors["fp8"] < errors["mxfp4"], errors


def test_plans_with_different_cu_counts_agree(case):
    inp, _ = case
    one = SplitPolicy(target_items=1, min_split_tokens=1 << 20)
    many = SplitPolicy(target_items=608, min_split_tokens=128)
    assert schedule(inp.seq_lens, one).size == len(LENS)
    assert list(np.bincount(schedule(inp.seq_lens, many).seq)) == [3, 1, 1, 1, 1, 6, 1]  # one per 128 tokens
    for qp in ("bf16", "mxfp4"):
        out1, lse1 = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, one, q_precision=qp)
        out2, lse2 = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, many, q_precision=qp)
        o1, o2 = out1.astype(np.float32), out2.astype(np.float32)
        # measured: 6e-4 of the output scale, 4e-4 in LSE
        assert np.abs(o1 - o2).max() <= 1e-2 * np.abs(o1).max()
        np.testing.assert_allclose(lse2, lse1, rtol=1e-3, atol=1e-3)
        assert np.isneginf(lse1[1]).all() and np.isneginf(lse2[1]).all()


def test_seqs_subset_equals_full_rows(case):
    inp, _ = case
    policy = SplitPolicy.for_device(132)
    out, lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy)
    sel = [5, 1, 0]
    sub_out, sub_lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy, seqs=sel)
    np.testing.assert_array_equal(sub_out.view(np.uint16), out[sel].view(np.uint16))
    np.testing.assert_array_equal(sub_lse, lse[sel])


def test_empty_sequences_give_zero_and_neg_inf():
    inp = make_inputs([0, 5, 0], "mxfp4", seed=22, heads=4)
    for cus in (1, 256):
        out, lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, SplitPolicy.for_device(cus))
        assert (out[[0, 2]].astype(np.float32) == 0).all() and np.isneginf(lse[[0, 2]]).all()
        assert np.isfinite(lse[1]).all() and np.abs(out[1].astype(np.float32)).max() > 0
    only_empty = make_inputs([0], "bf16", seed=22, heads=2)
    out, lse = emulate_decode(only_empty.q, only_empty.kv, only_empty.layout, 0.1, SplitPolicy.for_device(8))
    assert out.shape == (1, 2, 512) and (out.astype(np.float32) == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_single_token_returns_bf16_of_v(fmt):
    # One token: m = s, p = bf16(exp2(0)) = 1, l = 1, acc = v, so out = bf16(v) and
    # lse = s * ln 2 = sm_scale * (q . k) up to the f32 roundings of the score.
    inp = make_inputs([2, 1], fmt, seed=23, heads=16, sm_scale=0.05)
    out, lse = emulate_decode(inp.q, inp.kv, inp.layout, 0.05, SplitPolicy.for_device(8))
    row = inp.kv.dequantize(slice(2, 3))[0]
    want = np.broadcast_to(row[:512].astype(ml_dtypes.bfloat16), (16, 512))
    # compared as values: the f32 accumulator turns a cache's -0 into +0, as the device does
    np.testing.assert_array_equal(out[1].astype(np.float32), want.astype(np.float32))
    score = 0.05 * (inp.q[1].astype(np.float64) @ row.astype(np.float64))
    np.testing.assert_allclose(lse[1], score, rtol=1e-6, atol=1e-6)


def test_probabilities_are_rounded_to_bf16():
    # Two tokens, scores 0 and t: KERNELS.md gives p1 = bf16(exp2(t * c)), l = 1 + p1,
    # lse = log2(l) * ln 2. Unrounded p1 would move lse by ~1e-3 relative: visible in f32.
    t = float(np.float32(-1.3).astype(ml_dtypes.bfloat16))
    k = np.zeros((2, 576), np.float32)
    k[0, 0] = 1.0  # score 0, V = e0
    k[1, 1] = 1.0  # V = e1
    k[1, 512] = t  # score t through the rope part
    kv = quantize_kv(k, "bf16")
    q = np.zeros((1, 1, 576), np.float32)
    q[0, 0, 512] = 1.0
    out, lse = emulate_decode(q, kv, np.array([0, 2], np.int32), 1.0, SplitPolicy.for_device(1))
    c = np.float32(np.float32(1.0) * np.float32(math.log2(math.e)))
    p1 = np.float32(np.float32(2.0 ** float(np.float32(t) * c)).astype(ml_dtypes.bfloat16))
    l = np.float32(1) + p1
    assert lse[0, 0] == pytest.approx(math.log(float(l)), rel=5e-7)
    assert abs(float(lse[0, 0]) - math.log1p(2.0 ** (t * math.log2(math.e)))) > 1e-5  # the rounding shows
    assert out[0, 0, 1] == (p1 / l).astype(ml_dtypes.bfloat16)
    assert out[0, 0, 0] == (np.float32(1) / l).astype(ml_dtypes.bfloat16)
    assert (out[0, 0, 2:].astype(np.float32) == 0).all()


def test_quantize_q():
    rng = np.random.default_rng(24)
    q = rng.standard_normal((3, 16, 576)).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(quantize_q(q, "bf16"), q)
    fn = quantize_q(q, "fp8")
    fnuz = quantize_q(q, "fp8", "e4m3fnuz")
    fp4 = quantize_q(q, "mxfp4")
    # block-relative bounds: rounding 2^-4 (e4m3), saturation of the top binade 1/8 (e4m3fn)
    for got, bound in ((fn, 0.125), (fnuz, 0.125), (fp4, 0.25)):
        blocks = np.abs(q.reshape(-1, 32)).max(axis=1, keepdims=True)
        assert (np.abs(got - q).reshape(-1, 32) <= bound * blocks).all()
    assert not np.array_equal(fn, fnuz)  # the variant reaches the quantizer (max 448 vs 240)
    assert rel_l2(fn, q) < rel_l2(fp4, q) / 3  # measured 2.9e-2 vs 1.1e-1
    with pytest.raises(ValueError, match=r"q_precision: .*'mxfp4'.*'int8'"):
        quantize_q(q, "int8")
    with pytest.raises(ValueError, match=r"fp8_variant: "):
        quantize_q(q, "fp8", "e5m2")


def test_argument_errors():
    inp = make_inputs([3, 4], "bf16", seed=25, heads=2)
    policy = SplitPolicy.for_device(8)
    with pytest.raises(ValueError, match=r"q: .*2 from kv_indptr.*1"):
        emulate_decode(inp.q[:1], inp.kv, inp.layout, 0.1, policy)
    with pytest.raises(ValueError, match=r"sm_scale: "):
        emulate_decode(inp.q, inp.kv, inp.layout, -1.0, policy)
    with pytest.raises(ValueError, match=r"kv_indptr: last entry 9 exceeds the 7 rows"):
        emulate_decode(inp.q, inp.kv, np.array([0, 3, 9], np.int32), 0.1, policy)
    with pytest.raises(ValueError, match=r"q_precision: "):
        emulate_decode(inp.q, inp.kv, inp.layout, 0.1, policy, q_precision="fp4")


@pytest.mark.parametrize("seqs, exc, match", [
    ([-1], ValueError, r"seqs: indices must lie in \[0, 3\), got -1"),  # not the last sequence
    ([-2], ValueError, r"got -2"),
    ([3], ValueError, r"got 3"),
    ([0.7], TypeError, r"seqs: expected integer sequence indices"),  # not sequence 0
    ([True], TypeError, r"seqs: expected integer"),
    ([[0, 1]], ValueError, r"seqs: expected a 1-D sequence"),
])
def test_seqs_are_checked_as_the_reference_checks_them(seqs, exc, match):
    inp = make_inputs([3, 4, 5], "bf16", seed=25, heads=2)
    policy = SplitPolicy.for_device(8)
    for run in (lambda: emulate_decode(inp.q, inp.kv, inp.layout, 0.1, policy, seqs=seqs),
                lambda: mla_decode_reference(inp.q, inp.kv, inp.layout, 0.1, seqs=seqs)):
        with pytest.raises(exc, match=match):
            run()
    out, lse = emulate_decode(inp.q, inp.kv, inp.layout, 0.1, policy, seqs=[])
    assert out.shape == (0, 2, 512) and lse.shape == (0, 2)


# --- the gfx950 fast path (whole 128-token tiles, four waves per tile) ---------------

FAST_LENS = [1000, 5, 0, 4096, 128, 300]


@pytest.fixture(scope="module")
def fast_case():
    inp = make_inputs(FAST_LENS, "mxfp4", seed=5)
    ref = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale)
    return inp, ref


def test_fast_plan_error_per_q_precision(fast_case):
    """The modelled error of the fast kernel's Q precisions against exact attention over
    the same MXFP4 cache, next to the portable path on the same data. Measured:
    relative L2 fp8 Q 1.1e-2 (max abs 9.4e-2), mxfp4 Q 4.0e-2 (max abs 0.31), the same
    as the portable path to 3 digits; bf16 Q (no fast kernel) would give 9.4e-4."""
    inp, (ref_out, ref_lse) = fast_case
    fast = SplitPolicy.for_device(64, fast_tile=128)
    portable = SplitPolicy.for_device(64)
    _has_fast_and_portable_items(inp.seq_lens, fast)
    live = np.flatnonzero(inp.seq_lens > 0)
    errors = {}
    for qp, bound in (("fp8", 2.5e-2), ("mxfp4", 8e-2)):
        out_f, lse_f = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, fast, q_precision=qp)
        out_p, lse_p = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, portable, q_precision=qp)
        errors[qp] = rel_l2(out_f[live].astype(np.float32), ref_out[live])
        assert errors[qp] < bound, f"q_precision={qp}: relative L2 error {errors[qp]:.2e}"
        f32_f, f32_p = out_f.astype(np.float32), out_p.astype(np.float32)
        assert np.abs(f32_f - f32_p).max() <= 2 ** -6 * np.abs(f32_p).max()
        np.testing.assert_allclose(lse_f, lse_p, rtol=0, atol=2e-3)  # measured 4.5e-4
        assert np.isneginf(lse_f[2]).all() and not out_f[2].astype(np.float32).any()
    # MXFP8 Q is the accurate choice: at least 2x below MXFP4 Q
    assert 2 * errors["fp8"] < errors["mxfp4"], errors


def test_one_wave_schedule_is_the_portable_tiling():
    """A one-wave schedule is plain tiled online softmax: the fast model reduces exactly
    to the portable one with the same tile, so only the wave split differs."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((16, 576)).astype(np.float32)
    k = rng.standard_normal((256, 576)).astype(np.float32)
    c = np.float32(1 / 24 * 1.4426950408889634)
    one = emulate_fast_item(q, k, c, FastSchedule(tile_tokens=128, waves=1))
    plain = emulate_work_item(q, k, c, tile=128)
    for a, b in ((one.acc, plain.acc), (one.m, plain.m), (one.l, plain.l)):
        np.testing.assert_array_equal(a, b)


def test_fast_waves_see_interleaved_quarters():
    """Wave w owns tokens 32w..32w+31 of every tile: a large score in wave 2's quarter of
    the second tile leaves the other waves' running max alone, and the merge restores
    the exact softmax weights (checked against a dense f64 softmax)."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((16, 576)).astype(np.float32) * 0.1
    k = rng.standard_normal((256, 576)).astype(np.float32)
    k[128 + 64 + 5] = q[0] * 50  # tile 1, wave 2
    c = np.float32(1.0)
    part = emulate_fast_item(q, k, c, GFX950_SCHEDULE)
    s = (q.astype(np.float64) @ k.T.astype(np.float64)) * float(c)
    assert part.m[0] == pytest.approx(s[0].max(), rel=1e-6)
    p = np.exp2(s - s.max(axis=1, keepdims=True))
    want = (p @ k[:, :512]) / p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(part.acc / part.l[:, None], want, rtol=0, atol=2e-2 * np.abs(want).max())


# --- masked partial tiles: the fast kernels take items of any length ------------------


def _whole_tile_model(qf, k, c, sched):
    """The fast model as it was before masked tails (whole tiles only), frozen here."""
    n = k.shape[0]
    assert n > 0 and n % sched.tile_tokens == 0
    wave_of = (np.arange(n) % sched.tile_tokens) // sched.quarter
    return merge([emulate_work_item(qf, k[wave_of == w], c, sched.quarter) for w in range(sched.waves)])


def _kernel_walk(qf, k, c, sched):
    """The masked kernels' loop, step by step (hip_src/decode/split_mfma_gfx9*.hip): every
    wave walks ceil(n / tile) tiles; a token past the item's end reads the row of the
    item's last token (arch/cdna.h quarter_rows) and scores -inf (masked_score); the
    running max starts at -FLT_MAX (running_max_start); alpha rescales l and acc per
    quarter; the waves merge by exp2(m_w - M) in wave order."""
    n, heads = k.shape[0], qf.shape[0]
    lowest = np.float32(-np.finfo(np.float32).max)
    states = []
    for w in range(sched.waves):
        m = np.full(heads, lowest, np.float32)
        l = np.zeros(heads, np.float32)
        acc = np.zeros((heads, 512), np.float32)
        for t0 in range(0, n, sched.tile_tokens):
            tok = t0 + sched.quarter * w + np.arange(sched.quarter)
            rows = k[np.minimum(tok, n - 1)]  # clamped: never a row outside the item
            s = ((qf.astype(np.float64) @ rows.T.astype(np.float64)).astype(np.float32) * c).astype(np.float32)
            s = np.where(tok < n, s, np.float32(-np.inf))
            m_new = np.maximum(m, s.max(axis=1))
            alpha = np.exp2(m - m_new).astype(np.float32)
            pr = np.exp2(s - m_new[:, None]).astype(ml_dtypes.bfloat16).astype(np.float32)
            assert (pr[:, tok >= n] == 0).all()  # masked tokens add exact zeros
            l = (l * alpha + pr.sum(axis=1, dtype=np.float32)).astype(np.float32)
            acc = (acc * alpha[:, None] + pr @ rows[:, :512]).astype(np.float32)
            m = m_new
        states.append((m, l, acc))
    big_m = np.max([st[0] for st in states], axis=0)
    big_l = np.zeros(heads, np.float32)
    big_acc = np.zeros((heads, 512), np.float32)
    for m, l, acc in states:
        wt = np.exp2(m - big_m).astype(np.float32)
        big_l = (big_l + wt * l).astype(np.float32)
        big_acc = (big_acc + wt[:, None] * acc).astype(np.float32)
    return big_m, big_l, big_acc


@pytest.mark.parametrize("n", [128, 256, 640])
def test_masked_fast_model_equals_the_whole_tile_model(n):
    """(a) Whole tiles: the any-length model is the whole-tile model, bit for bit."""
    rng = np.random.default_rng(n)
    q = rng.standard_normal((16, 576)).astype(np.float32)
    k = rng.standard_normal((n, 576)).astype(np.float32)
    c = np.float32(1 / 24 * 1.4426950408889634)
    for sched in (GFX950_SCHEDULE, GFX942_SCHEDULE):
        got, want = emulate_fast_item(q, k, c, sched), _whole_tile_model(q, k, c, sched)
        for a, b in ((got.acc, want.acc), (got.m, want.m), (got.l, want.l)):
            np.testing.assert_array_equal(a, b)


def test_any_length_routing_equals_whole_tile_routing_on_whole_tiles():
    """(a) A batch of whole tiles (and an empty sequence): routing every item to the fast
    schedule (fast_tile 0, as the decoder launches the masked kernels) gives the bits of
    the fast_tile = 128 plan, whose items are the same."""
    lens = [128, 0, 1024, 256, 4096]
    inp = make_inputs(lens, "mxfp4", seed=31)
    for cus in (1, 64):
        whole = SplitPolicy.for_device(cus, fast_tile=128)
        anyl = SplitPolicy.for_device(cus)
        a = schedule(lens, whole)
        b = schedule(lens, anyl)
        np.testing.assert_array_equal(a.begin, b.begin)
        np.testing.assert_array_equal(a.end, b.end)
        x = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, whole, q_precision="fp8")
        y = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, anyl, q_precision="fp8", fast_any_length=True)
        np.testing.assert_array_equal(x[0].view(np.uint16), y[0].view(np.uint16))
        np.testing.assert_array_equal(x[1], y[1])


PARTIAL_LENS = [1, 31, 32, 33, 127, 129, 300]


@pytest.mark.parametrize("n", PARTIAL_LENS)
def test_masked_fast_item_is_exact_attention_within_bf16(n):
    """(b) Partial tiles: m is the exact max, l the dense f64 softmax sum within the bf16
    rounding of P (each p_j within 2^-9 relative), acc / l the exact attention within
    that; and the model is what the masked kernel loop computes (_kernel_walk: clamped
    rows, -inf scores, -FLT_MAX start), m bit for bit."""
    rng = np.random.default_rng(100 + n)
    q = rng.standard_normal((16, 576)).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    k = rng.standard_normal((n, 576)).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    c = np.float32(np.float32(1 / 24) * np.float32(1.4426950408889634))
    for sched in (GFX950_SCHEDULE, GFX942_SCHEDULE):
        part = emulate_fast_item(q, k, c, sched)
        s = (q.astype(np.float64) @ k.T.astype(np.float64)) * float(c)
        m = s.max(axis=1)
        pexact = np.exp2(s - m[:, None])
        np.testing.assert_allclose(part.m, m, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(part.l, pexact.sum(axis=1), rtol=2 ** -9, atol=0)
        want = (pexact @ k[:, :512].astype(np.float64)) / pexact.sum(axis=1, keepdims=True)
        got = part.acc.astype(np.float64) / part.l[:, None]
        assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()
        wm, wl, wacc = _kernel_walk(q, k, c, sched)
        np.testing.assert_array_equal(part.m, wm)
        np.testing.assert_allclose(part.l, wl, rtol=1e-6)
        np.testing.assert_allclose(part.acc, wacc, rtol=1e-5, atol=1e-5 * np.abs(wacc).max())


def test_masked_fast_decode_of_partial_tiles_against_exact_attention():
    """(b) Whole decodes of partial-tile sequences on the masked fast path (bf16 Q and
    cache: the gfx942 kernel's numerics): bf16 outputs within bf16 rounding of exact
    attention (mla_decode_reference), LSE within 2e-3, the same lengths split or not."""
    inp = make_inputs(PARTIAL_LENS + [0], "bf16", seed=32)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale)
    for policy in (SplitPolicy.for_device(1), SplitPolicy(target_items=64, min_split_tokens=128)):
        out, lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy,
                                  fast_schedule=GFX942_SCHEDULE, fast_any_length=True)
        o = out.astype(np.float32)
        for i in range(len(PARTIAL_LENS)):
            scale = np.abs(ref_out[i]).max()
            assert np.abs(o[i] - ref_out[i]).max() <= 2 ** -7 * scale, (PARTIAL_LENS[i], policy)
        np.testing.assert_allclose(lse[:-1], ref_lse[:-1], rtol=0, atol=2e-3)  # measured 8.6e-4
        assert not o[-1].any() and np.isneginf(lse[-1]).all()


def test_masked_fast_empty_item():
    """(c) An empty item: acc 0, l 0, m -inf, so output 0 and LSE -inf."""
    q = np.ones((16, 576), np.float32)
    for sched in (GFX950_SCHEDULE, GFX942_SCHEDULE):
        part = emulate_fast_item(q, np.zeros((0, 576), np.float32), np.float32(1), sched)
        assert not part.acc.any() and not part.l.any() and np.isneginf(part.m).all()
    inp = make_inputs([0, 5, 0], "mxfp4", seed=33, heads=16)
    out, lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, SplitPolicy.for_device(4),
                              q_precision="fp8", fast_any_length=True)
    assert not out[[0, 2]].astype(np.float32).any() and np.isneginf(lse[[0, 2]]).all()
    assert np.isfinite(lse[1]).all()


@pytest.mark.parametrize("arch, kv_format, q_precision", [
    ("gfx950", "mxfp4", "fp8"), ("gfx950", "mxfp4", "mxfp4"),
    ("gfx942", "bf16", "bf16"), ("gfx942", "fp8", "bf16"), ("gfx942", "mxfp4", "bf16"),
])
def test_masked_fast_plan_matches_the_two_kernel_plan(arch, kv_format, q_precision):
    """Ragged lengths with tails: every item on the masked fast kernel (fast_tile 0) is as
    close to exact attention as the fast + portable plan, and close to it (the tails'
    running max moves per 32 tokens of a wave (gfx950) or 16 of the block (gfx942) instead
    of per 64)."""
    variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    inp = make_inputs(FAST_LENS, kv_format, seed=6, fp8_variant=variant)
    ref_out, _ = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale)
    live = np.flatnonzero(inp.seq_lens > 0)
    sched = FAST_SCHEDULES[arch]
    two = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale,
                         SplitPolicy.for_device(64, fast_tile=sched.tile_tokens),
                         q_precision=q_precision, fast_schedule=sched)
    one = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, SplitPolicy.for_device(64),
                         q_precision=q_precision, fast_schedule=sched, fast_any_length=True)
    e_two = rel_l2(two[0][live].astype(np.float32), ref_out[live])
    e_one = rel_l2(one[0][live].astype(np.float32), ref_out[live])
    assert e_one < 1.1 * e_two + 1e-4, (e_one, e_two)
    f_one, f_two = one[0].astype(np.float32), two[0].astype(np.float32)
    assert np.abs(f_one - f_two).max() <= 2 ** -6 * np.abs(f_two).max()
    np.testing.assert_allclose(one[1], two[1], rtol=0, atol=2e-3)
    assert np.isneginf(one[1][2]).all() and not f_one[2].any()


def test_fast_any_length_needs_a_policy_without_tail_items(fast_case):
    inp, _ = fast_case
    with pytest.raises(ValueError, match="fast_any_length: .*fast_tile must be 0, got 128"):
        emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, SplitPolicy.for_device(8, fast_tile=128),
                       fast_any_length=True)
    with pytest.raises(TypeError, match="fast_any_length: expected a bool"):
        emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, SplitPolicy.for_device(8), fast_any_length=1)


def test_schedule_must_match_the_policy(fast_case):
    inp, _ = fast_case
    policy = SplitPolicy.for_device(64, fast_tile=128)
    with pytest.raises(ValueError, match="fast_schedule: the policy's fast items are 128-token tiles"):
        emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy, fast_schedule=FastSchedule(256, 4))


def _has_fast_and_portable_items(lens, policy: SplitPolicy) -> None:
    s = schedule(lens, policy)
    length = s.end - s.begin
    whole = (length > 0) & (length % policy.fast_tile == 0)
    assert whole.any() and (~whole).any()


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_paged_layout_gives_the_same_bits_as_contiguous(page_size):
    """The emulator reads rows through the page table: a pool in random page order with
    shared prefix pages gives exactly the output of the same tokens laid out in a row."""
    rng = np.random.default_rng(page_size)
    lens = np.array([0, 1, 300, 2049, 128, 77])
    inp = make_inputs(lens, "mxfp4", seed=page_size)
    layout = random_page_table(lens, page_size, rng, spare_pages=4)
    pool = scatter(inp.kv, layout)
    policy = SplitPolicy.for_device(8, fast_tile=128)
    a = emulate_decode(inp.q, pool, layout, inp.sm_scale, policy, q_precision="fp8")
    b = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy, q_precision="fp8")
    np.testing.assert_array_equal(a[0].view(np.uint16), b[0].view(np.uint16))
    np.testing.assert_array_equal(a[1], b[1])
    shared = random_page_table(lens, page_size, rng, shared=2)
    pool2 = scatter(inp.kv, random_page_table(lens, page_size, rng))  # any pool with data
    contiguous_kv, contiguous = gather(pool2, shared)
    c = emulate_decode(inp.q, pool2, shared, inp.sm_scale, policy)
    d = emulate_decode(inp.q, contiguous_kv, contiguous, inp.sm_scale, policy)
    np.testing.assert_array_equal(c[0].view(np.uint16), d[0].view(np.uint16))


# --- the gfx942 fast path (bf16 Q, every cache format, the same four-wave schedule) ----


@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
def test_gfx942_fast_plan_error_per_cache(kv_format):
    """The modelled error of the gfx942 fast kernel (bf16 Q; fp8 as e4m3fnuz) against exact
    attention over the same cache, next to the portable path on the same data. Measured
    (seed 5) relative L2: bf16 9.4e-4, fp8 1.9e-3, mxfp4 9.4e-4, within 1% of the portable
    path; max |out - portable| 1.1e-3 of the largest output; |LSE - exact| <= 1.0e-3,
    |LSE - portable| <= 6.8e-4 (a different running max changes which P round where)."""
    inp = make_inputs(FAST_LENS, kv_format, seed=5, fp8_variant="e4m3fnuz")
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale)
    fast = SplitPolicy.for_device(304, fast_tile=GFX942_SCHEDULE.tile_tokens)
    portable = SplitPolicy.for_device(304)
    _has_fast_and_portable_items(inp.seq_lens, fast)
    live = np.flatnonzero(inp.seq_lens > 0)
    out_f, lse_f = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, fast, fast_schedule=FAST_SCHEDULES["gfx942"])
    out_p, lse_p = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, portable)
    err_f = rel_l2(out_f[live].astype(np.float32), ref_out[live])
    err_p = rel_l2(out_p[live].astype(np.float32), ref_out[live])
    assert err_f < 4e-3, f"{kv_format}: relative L2 error {err_f:.2e}"
    assert abs(err_f - err_p) < 0.05 * err_p, (err_f, err_p)
    f32_f, f32_p = out_f.astype(np.float32), out_p.astype(np.float32)
    assert np.abs(f32_f - f32_p).max() <= 2 ** -7 * np.abs(f32_p).max()
    np.testing.assert_allclose(lse_f[live], ref_lse[live], rtol=0, atol=2e-3)
    np.testing.assert_allclose(lse_f, lse_p, rtol=0, atol=2e-3)
    assert np.isneginf(lse_f[2]).all() and not f32_f[2].any()


def test_gfx942_schedule_is_one_block_state_over_16_token_tiles():
    """gfx950's four waves each keep a state over their 32-token quarters of 128-token
    tiles; gfx942's block keeps one state over 16-token tiles, which as a one-wave schedule
    is exactly emulate_work_item with 16-token tiles (the merge of one state changes no bit)."""
    assert GFX950_SCHEDULE == FastSchedule(tile_tokens=128, waves=4) and GFX950_SCHEDULE.quarter == 32
    assert GFX942_SCHEDULE == FastSchedule(tile_tokens=16, waves=1) and GFX942_SCHEDULE.quarter == 16
    assert FAST_SCHEDULES == {"gfx950": GFX950_SCHEDULE, "gfx942": GFX942_SCHEDULE}
    rng = np.random.default_rng(3)
    q = rng.standard_normal((16, 576)).astype(np.float32)
    scale = np.float32(1 / 24 * 1.4426950408889634)
    for n in (0, 1, 15, 16, 17, 100):
        k = rng.standard_normal((n, 576)).astype(np.float32)
        a, b = emulate_fast_item(q, k, scale, GFX942_SCHEDULE), emulate_work_item(q, k, scale, tile=16)
        for x, y in ((a.acc, b.acc), (a.m, b.m), (a.l, b.l)):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), n


# --- the accuracy README states (scripts/accuracy_sweep.py, 200 ragged batches) ---------------

#: 200-batch sweep (2026-12-01), max over batches: relative L2 bf16 2.2e-3, fp8 3.2e-2,
#: mxfp4 0.123; |LSE error| 1.3e-3, 6.0e-2, 0.27. Bounds: those maxima with ~40% margin.
SWEEP_BOUNDS = {"bf16": (3e-3, 2e-3), "fp8": (4.5e-2, 9e-2), "mxfp4": (0.17, 0.4)}


def test_a_slice_of_the_accuracy_sweep_stays_in_the_stated_bounds():
    """The first batches of the sweep README quotes: the emulator's error against exact
    attention stays within the bounds derived from the 200-batch maxima."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "accuracy_sweep.py"
    spec = importlib.util.spec_from_file_location("accuracy_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    errors = sweep.sweep(configs=8, sample=2)
    for qp, (rel_bound, lse_bound) in SWEEP_BOUNDS.items():
        rel = max(r[0] for r in errors[qp])
        lse = max(r[1] for r in errors[qp])
        assert rel < rel_bound and lse < lse_bound, (qp, rel, lse)
    # the Q precisions keep their order on serving-like lengths too
    med = {qp: float(np.median([r[0] for r in errors[qp]])) for qp in SWEEP_BOUNDS}
    assert 5 * med["bf16"] < med["fp8"] and 2 * med["fp8"] < med["mxfp4"], med


# ----------------------------------------------------------------------------- f16 products


def test_f16_q_keeps_each_heads_bf16_values_within_its_range():
    """Q through f16 products: each head times its own power of two, so a head at either end
    of the bf16 range comes back bit for bit; only values far below their head's largest
    round (to f16's subnormal grid, times the head's 2^-k)."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 4, 576)).astype(np.float32)
    q *= np.exp2([-120.0, -30.0, 0.0, 100.0])[None, :, None]
    q = to_bf16(q).astype(np.float32)
    out = f16_q(q)
    assert out.dtype == np.float64 and np.array_equal(out, q)
    # A head whose values span 2^40: the small ones land below f16's normals and round.
    span = q.copy()
    span[:, 2, ::2] = to_bf16(span[:, 2, ::2] * 2.0 ** -40).astype(np.float32)
    out = f16_q(span)
    assert np.array_equal(out[:, 2, 1::2], span[:, 2, 1::2]) and np.array_equal(out[:, [0, 1, 3]], span[:, [0, 1, 3]])
    small = span[:, 2, ::2].astype(np.float64)
    k = 141 - ((span[:, 2:3].view(np.uint32) >> 23) & 0xFF).max(axis=-1).astype(np.float64)  # per token
    grid = np.exp2(-24 - k)  # f16's subnormal step, scaled back
    assert (np.abs(out[:, 2, ::2] - small) <= grid / 2).all() and (out[:, 2, ::2] != small).any()
    # Zeros stay zeros (the exponent clamps at 126), non-finite values stay non-finite.
    edge = np.zeros((1, 2, 576), np.float32)
    edge[0, 1, 0], edge[0, 1, 1], edge[0, 1, 2] = np.inf, np.nan, 1.0
    got = f16_q(edge)
    assert (got[0, 0] == 0).all() and np.isposinf(got[0, 1, 0]) and np.isnan(got[0, 1, 1])


def test_f16_products_round_p_to_f16_only_for_pv():
    """products="f16": l sums the bf16 P as before; P.V takes them as f16, which differs
    only for P below 2^-17 (here one weight of ~2^-20 carries a whole column)."""
    q = np.zeros((1, 576), np.float32)
    q[0, 0] = 1.0
    k = np.zeros((2, 576), np.float32)
    k[0, 0], k[1, 0] = 0.0, -20.7  # scores 0 and -20.7 (scale 1): P = 1 and ~2^-20.7
    k[1, 5] = 1.0                  # column 5 only from the small weight
    k[0, 6] = k[1, 6] = 1.0
    a = emulate_work_item(q, k, np.float32(1.0), tile=32)
    b = emulate_work_item(q, k, np.float32(1.0), tile=32, products="f16")
    p_small = to_bf16(np.exp2(np.float32(-20.7))).astype(np.float32)
    assert np.array_equal(a.l, b.l) and np.array_equal(a.m, b.m)
    assert a.acc[0, 5] == p_small and b.acc[0, 5] == np.float32(np.float16(p_small)) and a.acc[0, 5] != b.acc[0, 5]
    with pytest.raises(ValueError, match="products"):
        emulate_work_item(q, k, np.float32(1.0), products="fp8")


def test_a_row_of_several_query_tokens_follows_the_kernel_that_runs_its_item():
    """8 heads x 2 query tokens share a row: the item of whole 128-token fast tiles runs on
    the fast kernel, which masks the first token's last kv token; so both tokens follow the
    fast kernel's schedule (as when it runs every item), though the first sees 255 tokens,
    no whole number of tiles. Chosen by what the token saw, the first went to the portable
    kernel's 64-token tiles."""
    rng = np.random.default_rng(1)
    kv = quantize_kv(rng.standard_normal((256, 576), dtype=np.float32), "bf16")
    q = (rng.standard_normal((2, 8, 576), dtype=np.float32) * 3).astype(ml_dtypes.bfloat16)
    layout, qo = KvLayout.contiguous(np.array([256])), np.array([0, 2])
    fast = SplitPolicy.for_device(1, fast_tile=128)
    s = schedule([256], fast, q_lens=[2], row_tokens=2)
    assert s.size == 2 and (s.queries == 2).all() and ((s.end - s.begin) % 128 == 0).all()
    out, lse = emulate_decode(q, kv, layout, 1 / 24, fast, qo_indptr=qo, fast_schedule=GFX950_SCHEDULE)
    every, every_lse = emulate_decode(q, kv, layout, 1 / 24, SplitPolicy.for_device(1), qo_indptr=qo,
                                      fast_schedule=GFX950_SCHEDULE, fast_any_length=True)
    assert np.array_equal(out.view(np.uint16), every.view(np.uint16)) and np.array_equal(lse, every_lse)
    portable, _ = emulate_decode(q, kv, layout, 1 / 24, SplitPolicy.for_device(1), qo_indptr=qo)
    assert not np.array_equal(out[0].view(np.uint16), portable[0].view(np.uint16))
