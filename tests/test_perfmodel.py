"""Tests of hipmla.perfmodel: each term of the model behaves as its docstring says, the
ranges are ordered, the calibration reproduces the H200 table, and the AMD predictions
keep to their floors. Pure arithmetic on the host schedule: no toolchain, no GPU, nothing
timed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hipmla import aot, cli
from hipmla import perfmodel as pm

# The gfx950 MXFP8-Q fast kernel's tile loop as hipmla.aot counts it (clang-22, 2026-12-01):
# counts of a real kernel, so the AMD predictions below run on realistic numbers without clang.
GFX950_COUNTS = aot.LoopCounts("k950", mfma=42, mfma_cycles=832, valu=724, transcendental=9, lds=98,
                               lds_bytes=42240, global_loads=12, salu=143, total=1019)
# The gfx942 bf16 kernel's 16-token tile loop, counted the same way (3-stage LDS ring).
GFX942_COUNTS = aot.LoopCounts("k942", mfma=17, mfma_cycles=272, valu=143, transcendental=2, lds=48,
                               lds_bytes=21248, global_loads=19, salu=97, total=324)


def mi355x() -> pm.KernelModel:
    return pm.amd_kernel(GFX950_COUNTS, 1, "gfx950", "mxfp4")


def mi300x(kv: str = "bf16") -> pm.KernelModel:
    return pm.amd_kernel(GFX942_COUNTS, 2, "gfx942", kv, tile_tokens=16)


def all_kernels() -> list[pm.KernelModel]:
    return [pm.sm90_kernel(kv) for kv in ("bf16", "fp8", "mxfp4")] + [mi355x(), mi300x()]


@pytest.fixture(scope="module")
def cal() -> pm.Calibration:
    return pm.fit_calibration()


# --- ranges and the floor ----------------------------------------------------------------


@pytest.mark.parametrize("calibration", ["roofline", "fitted"])
def test_every_term_is_an_ordered_range_and_the_floor_holds(calibration, cal):
    c = pm.ROOFLINE if calibration == "roofline" else cal
    for k in all_kernels():
        for b, n in pm.BENCHMARK_SHAPES:
            p = pm.predict(k, b, n, c)
            for name in ("hbm_us", "issue_us", "latency_us", "prologue_us", "merge_us", "launch_us", "total_us"):
                r = getattr(p, name)
                assert 0 <= r.low <= r.high, (k.name, b, n, name, r)
            # (a) nothing beats the bytes at the datasheet peak
            assert p.floor_us <= p.hbm_us.low <= p.total_us.low, (k.name, b, n)
            assert p.total_us.low == pytest.approx(p.launch_us.low + p.prologue_us.low + p.merge_us.low
                                                   + max(p.hbm_us.low, p.issue_us.low, p.latency_us.low))


def test_hbm_floor_is_the_bytes_at_the_datasheet_peak():
    tokens = 256 * 8192
    for kv, row in (("bf16", 1152), ("fp8", 576), ("mxfp4", 288 + 24)):
        p = pm.predict(pm.sm90_kernel(kv), 256, 8192)
        # KV at 4.8 TB/s plus Q, output and the split partials (written and read back: +8% at most)
        assert tokens * row / 4.8e12 * 1e6 < p.floor_us < 1.08 * tokens * row / 4.8e12 * 1e6, kv
        # the high end: what a read stream reaches (measured on the H200)
        assert p.hbm_us.high == pytest.approx(p.floor_us / pm.READ_FRACTION)
    assert pm.READ_FRACTION == pytest.approx(4203 / 4800)


def test_bytes_per_token_follow_the_cache_format_and_scale_stride():
    assert {kv: pm.token_bytes(kv) for kv in ("bf16", "fp8", "mxfp4")} == {"bf16": 1152, "fp8": 576, "mxfp4": 312}
    assert pm.amd_kernel(GFX942_COUNTS, 2, "gfx942", "mxfp4", scale_stride=18).token_bytes == 306
    with pytest.raises(ValueError, match="kv_format: expected one of bf16, fp8, mxfp4, got 'int4'"):
        pm.token_bytes("int4")
    with pytest.raises(ValueError, match="kv_format"):
        pm.sm90_kernel("int4")


# --- (b) issue ------------------------------------------------------------------------------


def test_issue_grows_with_the_work_and_falls_with_efficiency():
    k = mi355x()
    base = pm.predict(k, 256, 8192)
    heavier = replace(GFX950_COUNTS, valu=2 * GFX950_COUNTS.valu)
    heavy = pm.predict(pm.amd_kernel(heavier, 1, "gfx950", "mxfp4"), 256, 8192)
    assert heavy.issue_us.low > base.issue_us.low and heavy.hbm_us == base.hbm_us
    half = pm.predict(k, 256, 8192, pm.Calibration(0.5, 1.0, 0.0))
    assert half.issue_us.low == pytest.approx(2 * base.issue_us.low)
    # the high end: MFMA and VALU serial, at the loaded clock
    lo, hi = pm.amd_tile_cycles(GFX950_COUNTS)
    assert lo == max(832, 724 * 4 + 9 * 12, 42240 * 4 / 128) and hi == 832 + 724 * 4 + 9 * 12
    assert base.issue_us.high / base.issue_us.low == pytest.approx(hi / lo / pm.LOADED_CLOCK_FRACTION)


def test_sm90_issue_is_warps_times_instructions_over_schedulers():
    k = pm.sm90_kernel("mxfp4")
    assert k.tile_issue_cycles == (8 * 522 / 4, 8 * 522 / 4)
    assert (k.blocks_per_cu, k.stages, k.tile_tokens) == (2, 6, 32)
    # 64 x 8k: 4 items of 2048 tokens a sequence, 2 blocks on each busy SM -> 2 x 64 tiles
    p = pm.predict(k, 64, 8192)
    assert p.issue_us.low == pytest.approx(128 * 1044 / 1.98e9 * 1e6)


def test_a_small_batch_is_bound_by_its_items_not_by_bandwidth():
    # 4 x 1k in 16 items of 256 tokens (a 256-token floor): a few long chains, not bandwidth.
    for k in all_kernels():
        p = pm.predict(k, 4, 1024, split=(256, 0))
        assert p.issue_us.low > p.hbm_us.high, k.name


def test_the_split_policy_moves_the_prediction():
    # The decoder's 128-token floor cuts 4 x 1k in 32 items: half the busiest CU's tiles.
    k = pm.sm90_kernel("mxfp4")
    coarse, fine = pm.predict(k, 4, 1024, split=(256, 0)), pm.predict(k, 4, 1024)
    assert fine.issue_us.low == pytest.approx(coarse.issue_us.low / 2, rel=0.05)


def test_resident_blocks_share_the_cu():
    """Blocks resident on one CU share its issue units: the busiest CU's issue time is its
    tiles whichever way they are spread over its slots, and a lone block has it alone."""
    k = mi300x()
    one = pm.predict(replace(k, blocks_per_cu=1), 256, 8192)
    two = pm.predict(replace(k, blocks_per_cu=2), 256, 8192)
    assert two.issue_us.low == pytest.approx(one.issue_us.low, rel=0.02)  # same work per CU either way
    lone = pm.predict(replace(k, blocks_per_cu=2), 4, 1024)  # 16 items: one block on each busy CU
    assert lone.issue_us.low == pytest.approx(pm.predict(replace(k, blocks_per_cu=1), 4, 1024).issue_us.low)


# --- (c) memory latency (Little's law) -------------------------------------------------------


def test_more_stages_lower_the_latency_bound():
    k = pm.sm90_kernel("bf16")
    times = [pm.predict(replace(k, stages=s), 256, 8192).latency_us.low for s in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[0] == pytest.approx(8 * times[-1])


def test_latency_bound_is_bytes_over_what_the_cus_sustain():
    """A batch that fills every slot evenly: 264 sequences of 1024 tokens on 132 SMs x 2
    blocks. The bound is then the brief's bytes / (num_cus x in_flight / latency)."""
    k = pm.sm90_kernel("bf16")
    p = pm.predict(k, 264, 1024)
    kv_bytes = 264 * 1024 * k.token_bytes
    in_flight = k.stages * k.tile_tokens * k.token_bytes * k.blocks_per_cu
    for end, latency in zip(p.latency_us, pm.DRAM_LATENCY_S):
        assert end == pytest.approx(kv_bytes / (132 * in_flight / latency) * 1e6)
    assert pm.sustained_bytes_per_s(k, 2, 700e-9) == pytest.approx(in_flight / 700e-9)
    # a lone block has only its own ring in flight: per tile latency / stages
    lone = pm.predict(k, 4, 1024)  # 32 items of 128 tokens, one per SM
    assert lone.latency_us.low == pytest.approx(4 * 600e-9 / 2 * 1e6)


def test_more_latency_raises_the_latency_bound():
    k = pm.sm90_kernel("fp8")
    slow = replace(k, device=replace(k.device, dram_latency_s=pm.Range(1.2e-6, 1.6e-6)))
    assert pm.predict(slow, 256, 8192).latency_us.low == pytest.approx(2 * pm.predict(k, 256, 8192).latency_us.low)


# --- (d) prologue and merge, (e) launch ------------------------------------------------------


def test_merge_grows_with_slots_and_vanishes_without_a_split():
    dev = pm.H200
    assert pm.merge_time(dev, 0) == (0, 0) and pm.merge_time(dev, 1) == (0, 0)
    times = [pm.merge_time(dev, n) for n in (2, 4, 8, 32)]
    for a, b in zip(times, times[1:]):
        assert b.low > a.low and b.high > a.high
    # 1 round trip a slot at the low latency .. 2 at the high, plus the release and the atomic
    assert pm.merge_time(dev, 4) == pytest.approx(((2 + 4) * 150e-9, (2 + 8) * 300e-9))
    # in a prediction: 32 x 8k splits each sequence in 8 slots, 4 x 1k in 4 (256-token floor)
    k = pm.sm90_kernel("bf16")
    assert pm.predict(k, 32, 8192).merge_us.low > pm.predict(k, 4, 1024, split=(256, 0)).merge_us.low


def test_prologue_is_one_item_at_best_and_every_item_of_a_slot_at_worst():
    assert pm.prologue_time(pm.H200, 1) == pytest.approx((3 * 600e-9, 3 * 800e-9))
    assert pm.prologue_time(pm.H200, 3) == pytest.approx((3 * 600e-9, 3 * 3 * 800e-9))
    # 256 x 8k on the H200: 512 items on 264 slots, so a slot runs two
    p = pm.predict(pm.sm90_kernel("mxfp4"), 256, 8192)
    assert p.prologue_us == pytest.approx((1.8, 4.8))


def test_launch_adds_to_both_ends():
    k = pm.sm90_kernel("fp8")
    a = pm.predict(k, 64, 8192, pm.Calibration(0.5, 0.9, 0.0))
    b = pm.predict(k, 64, 8192, pm.Calibration(0.5, 0.9, 20e-6))
    assert b.total_us.low - a.total_us.low == pytest.approx(20) and b.total_us.high - a.total_us.high == pytest.approx(20)


def test_placement_deals_items_longest_first_over_all_slots():
    # 256 x 8k on 132 SMs x 2: 512 items of 4096 tokens (128 tiles); 116 SMs get 4, 16 get 3
    p = pm.place(132, 2, 32, 256, 8192)
    assert (p.split_items, p.merge_slots, p.cu_tiles, p.slot_items) == (512, 2, 4 * 128, 2)
    assert p.tokens_per_resident_block == 2 * 4096
    # no split: 264 sequences of 1024 tokens, one item each
    q = pm.place(132, 2, 32, 264, 1024)
    assert (q.split_items, q.merge_slots, q.slot_items) == (0, 0, 1)


# --- calibration ---------------------------------------------------------------------------


def test_measured_table_has_its_provenance():
    m = pm.H200_MEASURED
    assert (m.device, m.date, m.commit, m.script) == ("NVIDIA H200", "2026-12-01", "efe9567", "scripts/sm90_trial.py")
    assert "no L2 flush" in m.method and "median of 20" in m.method
    assert len(m.points) == 12 and {kv for kv, *_ in m.points} == {"bf16", "fp8", "mxfp4"}
    assert ("mxfp4", 64, 8192, 162.9) in m.points and ("bf16", 256, 8192, 641.0) in m.points


def test_calibration_reproduces_the_measured_table(cal):
    for r, (kv, b, n, t) in zip(pm.log_residuals(cal), pm.H200_MEASURED.points):
        assert abs(r) <= math.log(pm.CALIBRATION_TOLERANCE), (kv, b, n, t, math.exp(r))
    # the factors are physical, and the fitted issue efficiency agrees with Nsight Compute's
    # IPC (1.98 of 4 at mxfp4 64 x 8k), which the fit never saw
    assert 0 < cal.issue_efficiency <= 1 and 0 < cal.stream_efficiency <= 1 and cal.launch_s > 0
    assert cal.issue_efficiency == pytest.approx(pm.SM90_MEASURED_IPC / 4, rel=0.1)


def test_calibration_is_a_least_squares_minimum(cal):
    def sse(c: pm.Calibration) -> float:
        return sum(r * r for r in pm.log_residuals(c))

    best = sse(cal)
    for field in ("issue_efficiency", "stream_efficiency", "launch_s"):
        for f in (0.97, 1.03):
            moved = replace(cal, **{field: getattr(cal, field) * f})
            if moved.stream_efficiency <= 1:
                assert sse(moved) >= best, (field, f)


def test_best_launch_solves_the_one_dimensional_fit():
    lows, highs = [10.0, 50.0, 100.0], [12.0, 60.0, 110.0]
    measured = [math.sqrt(lo * hi) for lo, hi in zip(lows, highs)]
    assert pm.best_launch(lows, highs, measured) == pytest.approx(0, abs=1e-6)
    shifted = [math.sqrt((lo + 7) * (hi + 7)) for lo, hi in zip(lows, highs)]
    assert pm.best_launch(lows, highs, shifted) == pytest.approx(7, abs=1e-6)


# --- AMD predictions with the H200's factors -------------------------------------------------


def test_mi355x_prediction_keeps_to_its_floor(cal):
    p = pm.predict(mi355x(), 256, 8192, cal)
    assert p.device == "MI355X" and p.total_us.low >= p.floor_us
    # the floor: 256 x 8192 tokens x 312 B at 8 TB/s, plus Q, output and partials
    assert 256 * 8192 * 312 / 8e12 * 1e6 < p.floor_us < 1.08 * 256 * 8192 * 312 / 8e12 * 1e6
    for b, n in pm.BENCHMARK_SHAPES:
        q = pm.predict(mi355x(), b, n, cal)
        assert q.floor_us <= q.total_us.low <= q.total_us.high


def test_amd_kernels_sit_on_their_datasheet_devices():
    assert pm.DEVICES == {"gfx950": pm.MI355X, "gfx942": pm.MI300X, "sm_90": pm.H200}
    assert (pm.MI300X.num_cus, pm.MI300X.clock_hz, pm.MI300X.hbm_bytes_per_s) == (304, 2.1e9, 5.3e12)
    assert (pm.MI355X.num_cus, pm.MI355X.clock_hz, pm.MI355X.hbm_bytes_per_s) == (256, 2.4e9, 8.0e12)
    assert (pm.H200.num_cus, pm.H200.clock_hz, pm.H200.hbm_bytes_per_s) == (132, 1.98e9, 4.8e12)
    assert mi355x().blocks_per_cu == 1 and mi300x().blocks_per_cu == 2
    assert (mi355x().stages, mi300x().stages) == (2, 2)
    assert mi300x().tile_bytes == 16 * 1152  # a 16-token bf16 tile


def test_calibration_report_labels_the_amd_numbers_as_predictions(cal):
    text = pm.calibration_report([mi355x(), mi300x("fp8")])
    assert text.count("PREDICTED MI355X") == 1 and text.count("PREDICTED MI300X") == 1
    assert "not measured" in text and "PREDICTIONS, not measurements" in text
    assert "efe9567" in text and "2026-12-01" in text and "scripts/sm90_trial.py" in text
    assert f"issue efficiency   {cal.issue_efficiency:.3f}" in text
    for kv, b, n, t in pm.H200_MEASURED.points:
        assert any(line.split()[:2] == [kv, f"{b}x{n}"] and f"{t:.1f}" in line for line in text.splitlines())
    for b, n in pm.BENCHMARK_SHAPES:
        assert text.count(f"{b:>3}x{n:<5}") >= 2  # one row per AMD kernel
    # without AMD kernels: the H200 calibration alone, no AMD device named
    alone = pm.calibration_report()
    assert "PREDICTED" not in alone and "MI355X" not in alone and "MI300X" not in alone


def test_model_command(capsys):
    assert cli.main(["model", "--arch", "none"]) == 0
    out = capsys.readouterr().out
    assert "predicted (calibrated) vs measured" in out and "issue efficiency" in out
    for bad in (",", "none,gfx950", "gfx90a"):  # 'none' stands alone
        with pytest.raises(SystemExit) as e:
            cli.main(["model", "--arch", bad])
        assert e.value.code == 2 and "argument --arch: expected comma-separated targets" in capsys.readouterr().err


def test_model_command_without_clang_says_why(monkeypatch, capsys):
    def no_clang(*args, **kwargs):
        raise aot.ToolchainNotFound("no clang here")

    monkeypatch.setattr(aot, "fast_kernel_models", no_clang)
    assert cli.main(["model", "--arch", "gfx950"]) == 2
    captured = capsys.readouterr()
    assert "hipmla model: no clang here" in captured.err and captured.out == ""


def test_gfx950_bf16_q_has_one_buffer_in_flight():
    # split_mfma_gfx950.hip: bf16 Q keeps one quarter buffer per wave, quantized Q two.
    assert pm.amd_stages("gfx950", "hipmla_decode_split_gfx950_mxfp4_qbf16") == 1.0
    assert pm.amd_stages("gfx950", "hipmla_decode_split_gfx950_mxfp4_qfp8") == 2.0
    # split_mfma_gfx942.hip: a 3-stage ring, two tiles in flight behind the one computed.
    assert pm.amd_stages("gfx942", "hipmla_decode_split_gfx942_bf16_qbf16") == 2.0
