"""hipmla.inputs: the benchmark shapes, seeded decode inputs, ragged batches."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hipmla.inputs import (BENCH_SM_SCALE, benchmark_shapes, make_inputs, make_sampled_inputs, random_cache,
                           random_seq_lens)


def test_benchmark_shapes():
    shapes = benchmark_shapes()
    names = [s.name for s in shapes]
    assert sorted(names) == sorted(["4x1k", "4x8k", "32x1k", "32x8k", "64x1k", "64x8k", "256x1k", "256x8k"])
    for s in shapes:
        assert s.seq_lens.shape == (s.batch,) and (s.seq_lens == s.kv_len).all()
    assert BENCH_SM_SCALE == pytest.approx(1 / 24)  # 1 / sqrt(576)


@pytest.mark.parametrize(
    "fmt, data_shape, data_dtype, scales_shape",
    [
        ("bf16", (140, 576), np.uint16, None),
        ("fp8", (140, 576), np.uint8, None),
        ("mxfp4", (140, 288), np.uint8, (140, 24)),  # padded scale rows by default
    ],
)
def test_make_inputs_layout(fmt, data_shape, data_dtype, scales_shape):
    inp = make_inputs([100, 0, 40], fmt, seed=1)
    assert inp.q.shape == (3, 16, 576) and inp.q.dtype == ml_dtypes.bfloat16
    assert inp.kv_indptr.dtype == np.int32 and list(inp.kv_indptr) == [0, 100, 100, 140]
    assert inp.batch == 3 and list(inp.seq_lens) == [100, 0, 40]
    assert inp.kv.format == fmt and inp.kv.data.shape == data_shape and inp.kv.data.dtype == data_dtype
    assert (inp.kv.scales is None) if scales_shape is None else (inp.kv.scales.shape == scales_shape)
    assert inp.sm_scale == BENCH_SM_SCALE
    kv = inp.kv.dequantize()
    # N(0,1) through the format: mean ~0, std ~1 (mxfp4 and fp8 are coarse but unbiased)
    assert abs(float(kv.mean())) < 0.05 and 0.85 < float(kv.std()) < 1.15
    q = inp.q.astype(np.float32)
    assert abs(float(q.mean())) < 0.05 and 0.9 < float(q.std()) < 1.1


def test_make_inputs_options():
    inp = make_inputs([10], "mxfp4", seed=2, heads=4, sm_scale=0.3, scale_stride=18, rule="floor")
    assert inp.q.shape == (1, 4, 576) and inp.kv.scales.shape == (10, 18) and inp.sm_scale == 0.3
    fnuz = make_inputs([10], "fp8", seed=2, fp8_variant="e4m3fnuz")
    assert fnuz.kv.fp8_variant == "e4m3fnuz" and fnuz.kv.fp8_scale == pytest.approx(8 / 240)
    assert np.isfinite(fnuz.kv.dequantize()).all()
    empty = make_inputs([0, 0], "fp8", seed=2)
    assert empty.kv.rows == 0 and list(empty.kv_indptr) == [0, 0, 0]
    with pytest.raises(ValueError, match=r"kv_format: .*'int4'"):
        make_inputs([10], "int4")
    with pytest.raises(ValueError, match=r"seq_lens: "):
        make_inputs([-1], "bf16")


@pytest.mark.parametrize("kw, match", [
    ({"seed": -1}, r"seed: expected an integer >= 0, got -1"),
    ({"seed": 1.5}, r"seed: expected an integer >= 0, got 1.5"),
    ({"heads": 0}, r"heads: expected an integer in \[1, 1024\].*got 0"),
    ({"heads": True}, r"heads: .*got True"),
    ({"heads": 2000}, r"heads: .*got 2000"),
])
def test_make_inputs_names_a_bad_seed_or_head_count(kw, match):
    """As make_sampled_inputs does: the argument named, not numpy's message from inside."""
    with pytest.raises(ValueError, match=match):
        make_inputs([10], "bf16", **kw)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_make_inputs_is_deterministic_per_seed(fmt):
    a = make_inputs([70, 5], fmt, seed=3)
    b = make_inputs([70, 5], fmt, seed=3)
    c = make_inputs([70, 5], fmt, seed=4)
    for x, y in ((a.q, b.q), (a.kv.data, b.kv.data)):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    assert not np.array_equal(a.q.view(np.uint16), c.q.view(np.uint16))
    assert not np.array_equal(a.kv.data, c.kv.data)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(a.kv.scales, b.kv.scales)


def test_random_seq_lens():
    batches = [random_seq_lens(np.random.default_rng(seed)) for seed in range(20)]
    for lens in batches:
        assert lens.ndim == 1 and np.issubdtype(lens.dtype, np.integer)
        assert 1 <= lens.size <= 300 and lens.min() >= 0 and lens.max() <= 20000
    every = np.concatenate(batches)
    assert (every == 0).any(), "some sequences must be empty"
    assert (every % 128 != 0).mean() > 0.5, "most lengths should not be tile multiples"
    assert every.max() > 10000, "a few long sequences are expected"
    assert len({b.size for b in batches}) > 10, "batch sizes should vary"
    np.testing.assert_array_equal(random_seq_lens(np.random.default_rng(5)), batches[5])


def test_random_seq_lens_honours_its_limits():
    for seed in range(5):
        lens = random_seq_lens(np.random.default_rng(seed), max_batch=50, max_len=100)
        assert 1 <= lens.size <= 50
        assert lens.max() <= 100, f"max_len=100 but seed {seed} gave a length of {lens.max()}"


# --- make_sampled_inputs: the sampled sequences of a batch, without the rest ---------------


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_sampled_inputs_keep_each_sequence_at_its_length(fmt):
    lens = [300, 0, 5000, 70]
    inp = make_sampled_inputs(lens, [2, 0, 1], fmt, seed=1)
    assert inp.q.shape == (3, 16, 576) and inp.q.dtype == ml_dtypes.bfloat16
    assert list(inp.seq_lens) == [5000, 300, 0] and list(inp.kv_indptr) == [0, 5000, 5300, 5300]
    assert inp.kv.rows == 5300 and inp.kv.format == fmt and inp.sm_scale == BENCH_SM_SCALE
    if fmt == "mxfp4":
        assert inp.kv.scales.shape == (5300, 24)
    kv = inp.kv.dequantize()
    assert abs(float(kv.mean())) < 0.05 and 0.85 < float(kv.std()) < 1.15


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_sampled_sequence_data_depends_on_seed_and_sequence_only(fmt):
    lens = np.full(64, 9000)  # longer than one generation block (8192 rows)
    both = make_sampled_inputs(lens, [5, 40], fmt, seed=3)
    alone = make_sampled_inputs(lens, [40], fmt, seed=3)
    other_batch = make_sampled_inputs(np.full(41, 9000), [40], fmt, seed=3)
    for x in (alone, other_batch):
        np.testing.assert_array_equal(x.q.view(np.uint16), both.q[1:].view(np.uint16))
        np.testing.assert_array_equal(x.kv.data, both.kv.data[9000:])
        if fmt == "mxfp4":
            np.testing.assert_array_equal(x.kv.scales, both.kv.scales[9000:])
    assert not np.array_equal(both.kv.data[:9000], both.kv.data[9000:])
    reseeded = make_sampled_inputs(lens, [40], fmt, seed=4)
    assert not np.array_equal(reseeded.kv.data, alone.kv.data)
    assert not np.array_equal(reseeded.q.view(np.uint16), alone.q.view(np.uint16))


def test_sampled_inputs_options_and_empty():
    inp = make_sampled_inputs([10, 20], [1], "mxfp4", seed=2, heads=4, sm_scale=0.3, scale_stride=18)
    assert inp.q.shape == (1, 4, 576) and inp.kv.scales.shape == (20, 18) and inp.sm_scale == 0.3
    fnuz = make_sampled_inputs([10], [0], "fp8", fp8_variant="e4m3fnuz")
    assert fnuz.kv.fp8_variant == "e4m3fnuz" and fnuz.kv.fp8_scale == pytest.approx(8 / 240)
    empty = make_sampled_inputs([0, 0], [0, 1], "fp8")
    assert empty.kv.rows == 0 and list(empty.kv_indptr) == [0, 0, 0]


@pytest.mark.parametrize("seqs, kw, exc, match", [
    ([4], {}, ValueError, r"seqs: indices must lie in \[0, 4\), got 4"),
    ([-1], {}, ValueError, r"seqs: indices must lie in \[0, 4\), got -1"),
    ([], {}, ValueError, r"seqs: expected a 1-D sequence of sequence indices \(>= 1\)"),
    ([[0]], {}, ValueError, r"seqs: expected a 1-D sequence"),
    ([0.5], {}, TypeError, r"seqs: expected integer sequence indices"),
    ([0], {"seed": -1}, ValueError, r"seed: expected an integer >= 0, got -1"),
    ([0], {"seed": 1.5}, ValueError, r"seed: expected an integer >= 0"),
    ([0], {"kv_format": "int4"}, ValueError, r"kv_format: .*'int4'"),
])
def test_sampled_inputs_reject_bad_arguments(seqs, kw, exc, match):
    kw = {"kv_format": "bf16", **kw}
    with pytest.raises(exc, match=match):
        make_sampled_inputs([10, 10, 10, 10], seqs, kw.pop("kv_format"), **kw)


def test_sampled_inputs_with_several_query_tokens_and_heads():
    one = make_sampled_inputs([300, 40, 9], [0, 2], "bf16", seed=3)
    many = make_sampled_inputs([300, 40, 9], [0, 2], "bf16", seed=3, heads=32, q_len=4)
    assert one.qo_indptr is None and one.q.shape == (2, 16, 576)
    assert many.q.shape == (8, 32, 576) and list(many.qo_indptr) == [0, 4, 8]
    np.testing.assert_array_equal(many.kv.data, one.kv.data)  # the cache does not depend on Q
    with pytest.raises(ValueError, match="sequence 1 has 9 kv tokens but 10 query tokens"):
        make_sampled_inputs([300, 40, 9], [0, 2], "bf16", q_len=10)
    with pytest.raises(ValueError, match="heads"):
        make_sampled_inputs([300], [0], "bf16", heads=0)


def test_spread_sample_takes_the_ends_the_longest_and_an_empty_one():
    from hipmla.inputs import spread_sample

    assert list(spread_sample(np.array([5, 0, 7, 99, 3, 4, 1, 0, 2]), 3)) == [0, 1, 3, 4, 8]


@pytest.mark.parametrize("rows", [0, 1, 1025, 3000])  # around random_cache's 1024-row chunks
def test_random_cache_codes(rows):
    """Seeded, every row filled, and the value ranges its docstring promises: bf16 of
    magnitude 2^-4 .. 2^3 with both signs, every exponent and random mantissas; fp8 with
    every code but the variant's NaN; MXFP4 block scales 2^-8 .. 2^2."""
    caches = {fmt: random_cache(rows, fmt, np.random.default_rng(9)) for fmt in ("bf16", "fp8", "mxfp4")}
    for fmt, kv in caches.items():
        again = random_cache(rows, fmt, np.random.default_rng(9))
        assert np.array_equal(kv.data, again.data), f"{fmt}: not reproducible from its seed"
        vals = kv.dequantize()
        assert vals.shape == (rows, 576) and np.isfinite(vals).all(), fmt
    bits = caches["bf16"].data
    mag = np.abs(caches["bf16"].data.view(ml_dtypes.bfloat16).astype(np.float32))
    assert ((mag >= 2.0 ** -4) & (mag < 2.0 ** 3)).all()
    if rows >= 1025:
        assert set(np.unique((bits >> 7) & 0xFF).tolist()) == set(range(123, 130))  # every exponent
        assert 0.45 < float((bits >> 15).mean()) < 0.55  # both signs
        assert len(np.unique(bits & 0x7F)) == 128  # every mantissa
        assert not (bits[1024] == bits[0]).all()  # chunks are not copies
    scales = caches["mxfp4"].scales[:, :18].astype(int) - 127
    assert ((scales >= -8) & (scales <= 2)).all()
    assert not ((caches["fp8"].data & 0x7F) == 0x7F).any()
    fnuz_cache = random_cache(rows, "fp8", np.random.default_rng(9), fp8_variant="e4m3fnuz")
    fnuz = fnuz_cache.data
    assert not (fnuz == 0x80).any() and np.isfinite(fnuz_cache.dequantize()).all()
    if rows >= 1025:
        assert len(np.unique(fnuz)) == 255 and len(np.unique(caches["fp8"].data)) == 254  # every other code
