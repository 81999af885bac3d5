"""hipmla.reference: exact decode against a plain Python loop, empty sequences, the
``seqs`` subset, the LSE merge, and argument validation."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from hipmla.formats import quantize_kv
from hipmla.inputs import make_inputs
from hipmla.reference import merge_states, mla_decode_reference

SM_SCALE = 0.07  # larger than 1/sqrt(576) so the softmax is far from flat


def loop_reference(q: np.ndarray, kv_rows: np.ndarray, indptr: np.ndarray, sm_scale: float):
    """Per sequence, head and token with math.exp: the definition, nothing vectorised."""
    qf = q.astype(np.float64)
    batch, heads = qf.shape[0], qf.shape[1]
    out = np.zeros((batch, heads, 512))
    lse = np.full((batch, heads), -math.inf)
    for b in range(batch):
        rows = [kv_rows[r].astype(np.float64) for r in range(indptr[b], indptr[b + 1])]
        if not rows:
            continue
        for h in range(heads):
            scores = [math.fsum(qf[b, h] * k) * sm_scale for k in rows]
            m = max(scores)
            weights = [math.exp(s - m) for s in scores]
            total = math.fsum(weights)
            out[b, h] = sum(w * k[:512] for w, k in zip(weights, rows)) / total
            lse[b, h] = m + math.log(total)
    return out, lse


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_matches_loop_on_ragged_batch(fmt):
    lens = [3, 0, 5, 1, 2]
    inp = make_inputs(lens, fmt, seed=11, heads=2, sm_scale=SM_SCALE)
    out, lse = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, SM_SCALE)
    want_out, want_lse = loop_reference(inp.q, inp.kv.dequantize(), inp.kv_indptr, SM_SCALE)
    assert out.shape == (5, 2, 512) and out.dtype == np.float32
    assert lse.shape == (5, 2) and lse.dtype == np.float32
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    # a one-token sequence returns its V row and LSE = score
    np.testing.assert_allclose(out[3], np.broadcast_to(inp.kv.dequantize()[8, :512], (2, 512)), rtol=1e-6)


def test_float32_q_gives_same_result_as_bf16_q():
    inp = make_inputs([4, 7], "bf16", seed=12, heads=3)
    a = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, SM_SCALE)
    b = mla_decode_reference(inp.q.astype(np.float32), inp.kv, inp.kv_indptr, SM_SCALE)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_seqs_subset_equals_full_rows():
    inp = make_inputs([50, 0, 130, 7, 64], "mxfp4", seed=13, heads=4)
    out, lse = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale)
    sel = [4, 1, 2]
    sub_out, sub_lse = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale, seqs=sel)
    np.testing.assert_array_equal(sub_out, out[sel])
    np.testing.assert_array_equal(sub_lse, lse[sel])
    none_out, none_lse = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale, seqs=[])
    assert none_out.shape == (0, 4, 512) and none_lse.shape == (0, 4)
    with pytest.raises(ValueError, match=r"seqs: .*\[0, 5\)"):
        mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, inp.sm_scale, seqs=[5])


def halves_and_whole(n: int, split: int, seed: int):
    """References over tokens [0, split), [split, n) and [0, n) of one sequence."""
    rng = np.random.default_rng(seed)
    kv = quantize_kv(rng.standard_normal((n, 576)).astype(np.float32), "bf16")
    q = rng.standard_normal((1, 16, 576)).astype(np.float32).astype(ml_dtypes.bfloat16)
    two, two_lse = mla_decode_reference(np.concatenate([q, q]), kv, np.array([0, split, n], np.int32), SM_SCALE)
    whole, whole_lse = mla_decode_reference(q, kv, np.array([0, n], np.int32), SM_SCALE)
    return (two[0], two_lse[0]), (two[1], two_lse[1]), (whole[0], whole_lse[0])


def test_merge_of_halves_equals_whole():
    a, b, whole = halves_and_whole(200, 77, seed=14)
    out, lse = merge_states(*a, *b)
    scale = np.abs(whole[0]).max()
    np.testing.assert_allclose(out, whole[0], rtol=0, atol=2e-6 * scale)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-6)
    # the halves alone are clearly different from the whole: the merge does real work
    assert np.abs(a[0] - whole[0]).max() > 100 * 2e-6 * scale


def test_merge_is_symmetric():
    a, b, _ = halves_and_whole(90, 30, seed=15)
    ab = merge_states(*a, *b)
    ba = merge_states(*b, *a)
    np.testing.assert_array_equal(ab[0], ba[0])
    np.testing.assert_array_equal(ab[1], ba[1])


def test_merge_with_empty_side_is_identity():
    a, _, _ = halves_and_whole(40, 20, seed=16)
    empty = (np.zeros_like(a[0]), np.full_like(a[1], -np.inf))
    for out, lse in (merge_states(*a, *empty), merge_states(*empty, *a)):
        np.testing.assert_allclose(out, a[0], rtol=1e-7, atol=0)
        np.testing.assert_array_equal(lse, a[1])
    out, lse = merge_states(*empty, *empty)
    assert (out == 0).all() and np.isneginf(lse).all() and out.dtype == np.float32


def test_merge_elementwise_mixture_of_empty_and_full():
    out_a = np.float32([[1.0, 2.0], [3.0, 4.0]])
    out_b = np.float32([[5.0, 6.0], [7.0, 8.0]])
    out, lse = merge_states(out_a, np.float32([0.0, -np.inf]), out_b, np.float32([0.0, 1.0]))
    np.testing.assert_allclose(out, [[3.0, 4.0], [7.0, 8.0]], rtol=1e-7)
    np.testing.assert_allclose(lse, [math.log(2.0), 1.0], rtol=1e-7)


def test_merge_shape_errors():
    o = np.zeros((2, 3, 8), np.float32)
    l = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"out_a: .*\(2, 3\).*\(2, 4\)"):
        merge_states(o, np.zeros((2, 4), np.float32), o, l)
    with pytest.raises(ValueError, match=r"out_b: "):
        merge_states(o, l, o, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"out_b: .*\(2, 3, 8\)"):
        merge_states(o, l, np.zeros((2, 3, 4), np.float32), l)
    with pytest.raises(ValueError, match=r"lse_a/lse_b: "):
        merge_states(o, np.full((2, 3), np.nan, np.float32), o, l)
    with pytest.raises(ValueError, match=r"lse_a/lse_b: "):
        merge_states(o, l, o, np.full((2, 3), np.inf, np.float32))


# ----------------------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def small():
    return make_inputs([3, 2], "bf16", seed=17, heads=2)


def test_q_errors(small):
    q = small.q
    with pytest.raises(ValueError, match=r"q: .*576.*\(2, 2, 512\)"):
        mla_decode_reference(q[:, :, :512], small.kv, small.kv_indptr, SM_SCALE)
    with pytest.raises(ValueError, match=r"q: .*2 from kv_indptr.*3"):
        mla_decode_reference(np.concatenate([q, q[:1]]), small.kv, small.kv_indptr, SM_SCALE)
    with pytest.raises(TypeError, match=r"q: .*float16"):
        mla_decode_reference(q.astype(np.float16), small.kv, small.kv_indptr, SM_SCALE)
    with pytest.raises(ValueError, match=r"q: expected 3 dimensions"):
        mla_decode_reference(q[0], small.kv, small.kv_indptr, SM_SCALE)


@pytest.mark.parametrize(
    "indptr, message",
    [
        ([0, 3, 2], r"kv_indptr: must be non-decreasing"),
        ([1, 3, 5], r"kv_indptr: must start at 0, got 1"),
        ([0, 3, 6], r"kv_indptr: last entry 6 exceeds the 5 rows"),
    ],
)
def test_indptr_errors(small, indptr, message):
    with pytest.raises(ValueError, match=message):
        mla_decode_reference(small.q, small.kv, np.array(indptr, np.int32), SM_SCALE)


def test_kv_and_scale_errors(small):
    with pytest.raises(TypeError, match=r"kv: .*KVCache.*ndarray"):
        mla_decode_reference(small.q, small.kv.data, small.kv_indptr, SM_SCALE)
    with pytest.raises(TypeError, match=r"kv_indptr: .*int32.*float64"):
        mla_decode_reference(small.q, small.kv, small.kv_indptr.astype(np.float64), SM_SCALE)
    for bad in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"sm_scale: "):
            mla_decode_reference(small.q, small.kv, small.kv_indptr, bad)
    with pytest.raises(TypeError, match=r"sm_scale: "):
        mla_decode_reference(small.q, small.kv, small.kv_indptr, None)


def test_magnitude_bounds_the_output_and_equals_it_for_nonnegative_v():
    inp = make_inputs([5, 0, 9], "mxfp4", seed=13, heads=2, sm_scale=SM_SCALE)
    out, lse, mag = mla_decode_reference(inp.q, inp.kv, inp.kv_indptr, SM_SCALE, magnitude=True)
    assert mag.shape == out.shape and mag.dtype == np.float32
    assert (mag >= np.abs(out) - 1e-6).all() and (mag > np.abs(out) + 1e-3).any()
    assert (mag[1] == 0).all()
    rows = np.abs(inp.kv.dequantize())
    kv = quantize_kv(rows, "bf16")
    out, _, mag = mla_decode_reference(inp.q, kv, inp.kv_indptr, SM_SCALE, magnitude=True)
    np.testing.assert_allclose(mag, out, rtol=1e-6)


def test_the_rounding_of_p_scales_with_magnitude_not_with_the_output():
    """Two heavy tokens whose V cancel: the kernels' bf16 P (the emulator's numerics) moves
    the output far past REFERENCE_TOL * (1 + |ref|) and stays within REFERENCE_TOL * (1 +
    magnitude): why the checks against exact attention take ``magnitude`` as their scale."""
    from hipmla.cli import REFERENCE_TOL, compare
    from hipmla.emulate import emulate_decode
    from hipmla.schedule import SplitPolicy

    rows = np.zeros((2, 576), np.float32)
    rows[1, 512] = -3.0              # score of token 1: -3 * sm_scale below token 0's
    p1 = math.exp(-3.0 * SM_SCALE)   # its exact weight, not a bf16 value
    rows[0, :512] = 100.0
    rows[1, :512] = -100.0 / p1      # exact attention: out ~ 0
    kv = quantize_kv(rows, "bf16")
    q = np.zeros((1, 16, 576), np.float32)
    q[:, :, 512] = 1.0
    indptr = np.array([0, 2])
    ref_out, ref_lse, ref_mag = mla_decode_reference(q, kv, indptr, SM_SCALE, magnitude=True)
    emu_out, emu_lse = emulate_decode(q.astype(ml_dtypes.bfloat16), kv, indptr, SM_SCALE, SplitPolicy.for_device(132))
    err = np.abs(np.asarray(emu_out, np.float32) - ref_out)
    tol = REFERENCE_TOL["bf16"]
    assert (err > tol * (1 + np.abs(ref_out))).all()
    assert (err <= tol * (1 + ref_mag)).all() and (err <= 2 ** -8 * ref_mag).all()
    assert compare(emu_out, emu_lse, ref_out, ref_lse, ref_mag, tol)[2] == 0.0
