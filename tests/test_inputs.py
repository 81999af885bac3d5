"""hipmla.inputs: the benchmark shapes, seeded decode inputs, ragged batches."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hipmla.inputs import BENCH_SM_SCALE, benchmark_shapes, make_inputs, random_seq_lens


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
