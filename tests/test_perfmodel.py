"""Tests of hipmla.perfmodel: the predicted time per decode step from a kernel's counted
tile loop. Pure arithmetic on the host schedule: no toolchain, no GPU, nothing timed."""

from __future__ import annotations

import pytest

from hipmla import aot
from hipmla import perfmodel as pm


def test_prediction_is_the_slower_of_memory_and_issue():
    counts = aot.LoopCounts("k", mfma=42, mfma_cycles=832, valu=600, transcendental=9, lds=88,
                            lds_bytes=40000, global_loads=11, salu=100, total=900)
    big = pm.predict(counts, 1, 256, 8192)
    # 256 x 8192 tokens x 306 B at 8 TB/s, plus Q, output and the planner's two partials
    # per sequence (written and read back: +5%)
    assert 256 * 8192 * 306 / 8e12 * 1e6 < big.hbm_us < 1.08 * 256 * 8192 * 306 / 8e12 * 1e6
    lo, hi = big.compute_us
    assert lo < hi and big.predicted_us == (max(big.hbm_us, lo), max(big.hbm_us, hi))
    # twice the VALU work: the issue bound grows, the memory bound does not
    heavy = pm.predict(aot.LoopCounts("k", 42, 832, 1200, 9, 88, 40000, 11, 100, 1500), 1, 256, 8192)
    assert heavy.compute_us[0] > lo and heavy.hbm_us == big.hbm_us
    # a small batch is bound by its longest item, not by bandwidth
    small = pm.predict(counts, 1, 4, 1024)
    assert small.compute_us[0] > small.hbm_us


def test_prediction_reads_bytes_per_token_of_the_cache_format():
    counts = aot.LoopCounts("k", mfma=136, mfma_cycles=2176, valu=400, transcendental=9, lds=2,
                            lds_bytes=512, global_loads=100, salu=100, total=700)
    tokens = 256 * 8192
    for kv, row in (("bf16", 1152), ("fp8", 576), ("mxfp4", 288 + 18)):
        p = pm.predict(counts, 1, 256, 8192, device=pm.MI300X, kv_format=kv)
        # plus Q, output and the split partials (written and read back: +10% at most)
        assert tokens * row / 5.3e12 * 1e6 < p.hbm_us < 1.1 * tokens * row / 5.3e12 * 1e6, kv
    assert pm.DEVICES == {"gfx950": pm.MI355X, "gfx942": pm.MI300X}
    assert (pm.MI300X.num_cus, pm.MI300X.clock_hz) == (304, 2.1e9)
    with pytest.raises(ValueError, match="kv_format: expected one of bf16, fp8, mxfp4, got 'int4'"):
        pm.predict(counts, 1, 4, 1024, kv_format="int4")
