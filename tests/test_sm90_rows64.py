"""The sm_90a kernel of 64 query rows a work item (hip_src/decode/split_sm90_rows64.hip).

CPU: the specs (an MXFP4 and an fp8 cache, bf16 Q) and when the decoder picks them, the
builds (ptxas: no spills, sizeof(Smem) is the shared memory the spec launches with), the
kernel whole on the CPU harness (tests/host_sm90a.h) against the emulator, and their
emulator schedule (a schedule row of 64
heads, or of 64 / heads query tokens below 64 heads, each 16-head group its own softmax,
causal bound and merge). GPU (``gpu``): ragged paged batches of 64 and 128 heads, and of
16 and 32 heads with ragged query tokens (MTP), split rows merged in the kernel, against
that emulator; a wrong build fails its known-answer check.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from hipmla import kernels, selftest
from hipmla.emulate import emulate_decode
from hipmla.formats import KVCache
from hipmla.inputs import make_inputs, random_cache
from hipmla.paging import random_page_table
from hipmla.reference import mla_decode_reference
from hipmla.schedule import SplitPolicy, schedule
import test_kernels
from p_flips import assert_within_p_flips
from test_kernels import run_on_host

SPECS = {kv: kernels.sm90_rows64_kernel(kv) for kv in kernels.ROWS64_FORMATS}
SPEC = SPECS["mxfp4"]
SM_SCALE = 1 / 24


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("kv_format", kernels.ROWS64_FORMATS)
def test_spec(kv_format):
    spec = SPECS[kv_format]
    assert spec.symbol == f"hipmla_decode_split_sm90_rows64_{kv_format}_qbf16"
    assert spec.source == "decode/split_sm90_rows64.hip" and spec.archs == ("sm_90",)
    assert spec.compile_arch("sm_90") == "sm_90a"
    assert kernels.sm90_split_kernel(kv_format).compile_arch("sm_90") == "sm_90"
    assert spec.row_heads == 64 and spec.softmax_tile == 64 and spec.tile_tokens == 0 and spec.block_threads == 256
    assert kernels.variant_of(spec) == (kv_format, "bf16")
    # bf16 products for fp8 too (the 16-head kernel's are f16): the emulator's default
    assert spec.products == "bf16"
    # one block an SM: its dynamic shared memory + 1 KiB reserved within an H100/H200 SM's 228 KiB
    assert spec.dynamic_shared_bytes + 1024 <= 228 * 1024
    assert SPECS["fp8"].dynamic_shared_bytes == 211968 and SPEC.dynamic_shared_bytes == 212992


@pytest.mark.parametrize("kv_format", ["bf16", "int4", None])
def test_no_spec_for_other_caches(kv_format):
    with pytest.raises(ValueError, match="kv_format: expected one of fp8, mxfp4"):
        kernels.sm90_rows64_kernel(kv_format)
    with pytest.raises(ValueError, match="kv_format"):
        kernels.sm90_rows64_shared_bytes(kv_format)


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kv_format,q_precision", [("mxfp4", "bf16"), ("mxfp4", "fp8"), ("fp8", "bf16"),
                                                   ("fp8", "mxfp4"), ("bf16", "bf16")])
def test_decoder_picks_it_for_mxfp4_or_fp8_bf16_q_and_64_rows_a_sequence(kv_format, q_precision, heads, q_len):
    chosen = kernels.decoder_kernel("sm_90", kv_format, q_precision, heads, q_len)
    if kv_format in ("mxfp4", "fp8") and q_precision == "bf16" and heads * q_len >= kernels.ROWS64_MIN_ROWS:
        assert chosen == SPECS[kv_format]
    else:
        assert chosen == kernels.sm90_split_kernel(kv_format, q_precision)
    # Not on AMD: the arch's fast or portable kernel, whatever the heads.
    assert kernels.decoder_kernel("gfx942", kv_format, q_precision, heads, q_len).source != SPEC.source


@pytest.mark.parametrize("heads,groups,row_tokens", [(16, 1, 4), (32, 1, 2), (64, 1, 1), (128, 2, 1)])
def test_schedule_rows_for_each_head_count(heads, groups, row_tokens):
    """p.head_groups and p.row_tokens: 64 query rows a schedule row at every head count."""
    assert SPEC.serves_heads(heads) and kernels.check_serves(SPEC, "sm_90", "mxfp4", "bf16", heads) is SPEC
    assert SPEC.schedule_rows(heads) == (groups, row_tokens)
    assert heads * groups * row_tokens // max(heads // 64, 1) == 64 * groups
    sixteen = kernels.sm90_split_kernel("mxfp4")
    assert sixteen.schedule_rows(heads) == (heads // 16, 1)
    assert not SPEC.serves_heads(8) and not SPEC.serves_heads(48)


def test_the_selftest_plan_checks_it_with_64_heads():
    plan = selftest.device_plan("sm_90", ("mxfp4",))
    assert (SPEC, "decoder") in plan and (SPECS["fp8"], "decoder") not in plan
    assert (SPECS["fp8"], "decoder") in selftest.device_plan("sm_90", ("fp8",))
    assert selftest.case_shapes(SPECS["fp8"]) == [(64, 1), (16, 4)]
    case = selftest.known_case("mxfp4", heads=SPEC.row_heads)
    assert case.q.shape[1] == 64
    assert selftest.broken(SPEC).defines[-1] == (selftest.BREAK_DEFINE, "1")
    # ... and with 16 heads x 4 query tokens: rows of 4, 3 and 1 query tokens, an empty one.
    assert selftest.case_shapes(SPEC) == [(64, 1), (16, 4)]
    assert selftest.case_shapes(kernels.sm90_split_kernel("mxfp4")) == [(16, 1), (8, 4)]
    mtp = selftest.known_case("mxfp4", heads=16, q_len=4)
    assert np.diff(mtp.qo_indptr).tolist() == [0, 1, 4, 3, 4, 3] and mtp.q.shape == (15, 16, 576)
    assert np.array_equal(mtp.kv.data, case.kv.data) and np.array_equal(mtp.layout.kv_indices, case.layout.kv_indices)
    split = schedule(mtp.layout.seq_lens(), SplitPolicy.for_device(132, items_per_cu=1, lone=True, fit=True),
                     q_lens=np.diff(mtp.qo_indptr), row_tokens=4)
    assert sorted(set(split.queries.tolist())) == [1, 3, 4] and split.n_items.max() >= 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("kv_format", kernels.ROWS64_FORMATS)
def test_ptxas_no_spills_and_shared_size_matches(tmp_path, kv_format):
    spec = SPECS[kv_format]
    tu = tmp_path / "k.cu"
    tu.write_text(kernels.translation_unit(spec.source))
    defines = spec.options("sm_90")
    done = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-Xptxas", "-v", *defines, "-x", "cu", str(tu),
                           "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in done.stderr, done.stderr
    assert int(re.search(r"Used (\d+) registers", done.stderr).group(1)) <= 255
    host = tmp_path / "size.cu"
    host.write_text(tu.read_text() + '\n#include <cstdio>\nint main() { std::printf("%zu\\n", '
                    "sizeof(hipmla::sm90r::Smem)); return 0; }\n")
    exe = tmp_path / "size"
    done = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", *defines, "-x", "cu", str(host),
                           "-o", str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout) == \
        spec.dynamic_shared_bytes


def test_source_rejects_other_specialisations():
    source = kernels.translation_unit(SPEC.source)
    assert "reads an fp8 or mxfp4 cache with bf16 Q only" in source
    assert re.search(r"constexpr int TILE = (\d+);", source.split("namespace sm90r")[1]).group(1) == \
        str(kernels.SM90_ROWS64_TILE)


# ----------------------------------------------------------------------------- on the CPU harness

#: The CPU harness's builds (a fixture of tests/test_kernels.py).
host_kernels = test_kernels.host_kernels
#: Lengths around the 64-token tile; split into items of 64-token multiples.
HOST_LENS = np.array([0, 1, 63, 65, 130, 300, 37])
HOST_POLICY = SplitPolicy(target_items=8, min_split_tokens=64, align_tokens=64)


@pytest.mark.parametrize("kv_format,heads,q_lens", [
    (kv, heads, q_lens) for kv in kernels.ROWS64_FORMATS for heads, q_lens in ((64, None), (16, (1, 4, 3, 0, 2, 4, 5)))
] + [("mxfp4", 128, None), ("mxfp4", 32, (2, 1, 0, 3, 2, 2, 1))])
def test_kernel_on_cpu_matches_emulator(host_kernels, kv_format, heads, q_lens):
    """The 64-row kernel, whole, on the CPU (tests/host_sm90a.h: wgmma from the operands'
    descriptors and swizzled shared memory): 64 heads, 128 (two rows a query token), and
    16 / 32 heads x ragged query tokens (rows of 4, 3, 2, 1 and 0 tokens, each warp's
    causal mask), paged, split items merged in the kernel; against the emulator (64-token
    tiles, rows of 64). On every CI machine, not only on a GPU."""
    rng = np.random.default_rng(heads + len(kv_format))
    n_q = np.ones(HOST_LENS.size, np.int64) if q_lens is None else np.array(q_lens)
    lens = HOST_LENS + n_q
    qo = None if q_lens is None else np.concatenate([[0], np.cumsum(n_q)])
    layout = random_page_table(lens, 16, rng, spare_pages=3)
    kv = with_odd_fp8_scale(random_cache((int(layout.kv_indices.max()) + 1) * 16, kv_format, rng, scale_stride=24))
    q = rng.standard_normal((int(n_q.sum()), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    spec = SPECS[kv_format]
    assert schedule(lens, HOST_POLICY, q_lens=None if qo is None else n_q,
                    row_tokens=spec.schedule_rows(heads)[1]).n_items.max() >= 2
    errors = np.zeros(1, np.int32)
    out, lse, counters = run_on_host(host_kernels, q, kv, layout, HOST_POLICY, SM_SCALE, "bf16", "sm_90", errors,
                                     qo=qo, spec=spec)
    emu_out, emu_lse = emulate_decode(q, kv, layout, SM_SCALE, HOST_POLICY, tile_tokens=64, row_heads=64,
                                      qo_indptr=qo)
    assert errors[0] == 0 and (counters == 0).all() and np.isfinite(out).all()
    v_max = float(np.abs(kv.dequantize(np.arange(kv.rows))[:, :512]).max())
    assert_within_p_flips(out.astype(ml_dtypes.bfloat16), lse, emu_out, emu_lse, v_max,
                          f"rows64 {kv_format} {heads} heads on the CPU")


def test_a_wrong_build_on_cpu_is_off_the_emulator(host_kernels):
    """The harness runs what it is given: the self-test's broken build (output x 1.5) of
    the fp8 kernel fails the same comparison."""
    rng = np.random.default_rng(9)
    layout = random_page_table(HOST_LENS + 1, 16, rng, spare_pages=3)
    kv = random_cache((int(layout.kv_indices.max()) + 1) * 16, "fp8", rng)
    q = rng.standard_normal((HOST_LENS.size, 64, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    out, lse, _ = run_on_host(host_kernels, q, kv, layout, HOST_POLICY, SM_SCALE, "bf16", "sm_90",
                              spec=selftest.broken(SPECS["fp8"]))
    emu_out, emu_lse = emulate_decode(q, kv, layout, SM_SCALE, HOST_POLICY, tile_tokens=64, row_heads=64)
    with pytest.raises(AssertionError, match="off the emulator"):
        assert_within_p_flips(out.astype(ml_dtypes.bfloat16), lse, emu_out, emu_lse, 8.0, "broken")


# ----------------------------------------------------------------------------- the emulated schedule


def test_row_heads_64_splits_by_64_head_rows():
    """A 64-head schedule row: heads / 64 rows a query token for the split, every 16-head
    group of a row with that row's items (not the 16-head schedule's)."""
    lens = np.array([0, 1, 63, 64, 65, 700, 3000])
    inputs = make_inputs(lens, "mxfp4", seed=11, heads=128, sm_scale=SM_SCALE)
    policy = SplitPolicy.for_device(8)
    wide, narrow = (schedule(lens, policy, head_groups=g) for g in (2, 8))
    assert wide.size != narrow.size  # the two splits differ for this batch
    out, lse = emulate_decode(inputs.q, inputs.kv, inputs.layout, SM_SCALE, policy, tile_tokens=64, row_heads=64)
    ref_out, ref_lse = mla_decode_reference(inputs.q, inputs.kv, inputs.layout, SM_SCALE)
    err = np.abs(out.astype(np.float32) - ref_out)
    assert (err <= 2e-2 * (1 + np.abs(ref_out))).all()
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~fin).all() and np.abs(lse[fin] - ref_lse[fin]).max() < 1e-2
    # With no split at all (one item a row) the row size cannot matter.
    whole = SplitPolicy(target_items=1, min_split_tokens=1 << 20)
    a = emulate_decode(inputs.q, inputs.kv, inputs.layout, SM_SCALE, whole, tile_tokens=64, row_heads=64)
    b = emulate_decode(inputs.q, inputs.kv, inputs.layout, SM_SCALE, whole, tile_tokens=64)
    assert np.array_equal(a[0].view(np.uint16), b[0].view(np.uint16)) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("kv_format,heads", [("mxfp4", 16), ("mxfp4", 32), ("fp8", 16)])
def test_row_heads_64_below_64_heads_rows_of_query_tokens(kv_format, heads):
    """Below 64 heads a schedule row is 64 / heads query tokens: ragged query counts (rows
    of fewer tokens too), each query token causal within the row's items; against exact
    attention, and with no split the same bits as one query token a row."""
    rng = np.random.default_rng(heads)
    q_lens = np.array([1, 2, 3, 4, 5, 7, 0, 9])
    lens = q_lens + np.array([0, 1, 60, 64, 70, 700, 5, 2000])
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    layout = random_page_table(lens, 16, rng, spare_pages=3)
    kv = random_cache(int(layout.kv_indices.max() + 1) * 16, kv_format, rng, scale_stride=24)
    q = rng.standard_normal((int(qo[-1]), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    policy = SplitPolicy.for_device(40, items_per_cu=1)
    split = schedule(lens, policy, q_lens=q_lens, row_tokens=64 // heads)
    assert split.n_items.max() >= 2 and (split.queries < 64 // heads).any()
    out, lse = emulate_decode(q, kv, layout, SM_SCALE, policy, tile_tokens=64, row_heads=64, qo_indptr=qo)
    ref_out, ref_lse = mla_decode_reference(q, kv, layout, SM_SCALE, qo_indptr=qo)
    assert np.isfinite(ref_lse).all()
    err = np.abs(out.astype(np.float32) - ref_out)
    assert (err <= 2e-2 * (1 + np.abs(ref_out))).all()
    assert np.abs(lse - ref_lse).max() < 1e-2
    whole = SplitPolicy(target_items=1, min_split_tokens=1 << 20)
    a = emulate_decode(q, kv, layout, SM_SCALE, whole, tile_tokens=64, row_heads=64, qo_indptr=qo)
    b = emulate_decode(q, kv, layout, SM_SCALE, whole, tile_tokens=64, qo_indptr=qo)
    assert np.array_equal(a[0].view(np.uint16), b[0].view(np.uint16)) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("row_heads", [0, 8, 48, 96, True])
def test_row_heads_must_divide_the_heads(row_heads):
    inputs = make_inputs(np.array([5]), "mxfp4", heads=128)
    with pytest.raises(ValueError, match="row_heads"):
        emulate_decode(inputs.q, inputs.kv, inputs.layout, SM_SCALE, SplitPolicy.for_device(4), row_heads=row_heads)


# ----------------------------------------------------------------------------- on the GPU

def test_the_p_flip_allowance_is_narrow():
    rng = np.random.default_rng(3)
    emu = (rng.standard_normal((8, 16, 512)) * 4).astype(ml_dtypes.bfloat16)
    lse = rng.standard_normal((8, 16)).astype(np.float32)
    dev = emu.copy()
    dev[1, 2, :2] = (emu[1, 2, :2].astype(np.float32) + 0.3).astype(ml_dtypes.bfloat16)  # two outputs, one flip
    assert_within_p_flips(dev, lse, emu, lse, 24.0, "flip")
    with pytest.raises(AssertionError):  # past one flip's reach
        far = emu.copy()
        far[1, 2, 0] = np.float32(emu[1, 2, 0]) + 1.0
        assert_within_p_flips(far, lse, emu, lse, 24.0, "far")
    with pytest.raises(AssertionError):  # a whole head's row is a bug, not a flip
        row = emu.copy()
        row[1, 2] = (emu[1, 2].astype(np.float32) + 0.3).astype(ml_dtypes.bfloat16)
        assert_within_p_flips(row, lse, emu, lse, 24.0, "row")
    with pytest.raises(AssertionError):  # the LSE keeps its own bound
        assert_within_p_flips(dev, lse + 0.01, emu, lse, 24.0, "lse")


def with_odd_fp8_scale(kv: KVCache) -> KVCache:
    """An fp8 cache's codes with a tensor scale that is no power of two (random_cache's is
    1/64), so the scores' and O's products by it round; other caches as they are."""
    if kv.format != "fp8":
        return kv
    return KVCache("fp8", kv.data, fp8_scale=0.0173, fp8_variant=kv.fp8_variant)


def test_the_odd_fp8_scale_is_no_power_of_two():
    kv = with_odd_fp8_scale(random_cache(4, "fp8", np.random.default_rng(0)))
    assert kv.fp8_scale == np.float32(0.0173) and np.frexp(np.float32(kv.fp8_scale))[0] != 0.5
    mx = random_cache(4, "mxfp4", np.random.default_rng(0))
    assert with_odd_fp8_scale(mx) is mx


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", kernels.ROWS64_FORMATS)
@pytest.mark.parametrize("heads", [64, 128])
def test_ragged_paged_batch_against_the_emulator(heads, kv_format):
    """Lengths around the 64-token tile (0, 1, 63, 64, 65), items split 2-16 ways and merged
    in the kernel, shuffled 16-row pages with one shared: the decoder runs this kernel and
    matches its emulator within the bounds every kernel's self-test holds it to."""
    from hipmla import decode

    rng = np.random.default_rng(heads)
    lens = np.array([0, 1, 63, 64, 65, 129, 700, 3000, 9000, 20000])
    layout = random_page_table(lens, 16, rng, spare_pages=7, shared=1)
    pool = with_odd_fp8_scale(random_cache((int(layout.kv_indices.max()) + 1) * 16, kv_format, rng, scale_stride=24))
    q = rng.standard_normal((lens.size, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    with decode.Decoder(kv_format, SM_SCALE, heads=heads, max_batch=lens.size) as dec:
        if dec.device.arch.split(":")[0] != "sm_90":
            pytest.skip(f"an sm_90 kernel; this device is {dec.device.arch}")
        assert dec.kernel_symbol == SPECS[kv_format].symbol and dec.tile_tokens == 64
        split = schedule(lens, dec.policy, head_groups=heads // 64)
        assert split.n_items.max() >= 2
        v_max = float(np.abs(pool.dequantize(np.arange(pool.rows))[:, :512]).max())
        for _ in range(2):  # and again on the merge counters the first step left
            out, lse = dec.decode(q, pool, layout)
            emu_out, emu_lse = dec.emulate(q, pool, layout)
            assert np.isfinite(out.astype(np.float32)).all()
            assert_within_p_flips(out, lse, emu_out, emu_lse, v_max, f"rows64 {kv_format} {heads} heads")
        dec.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", kernels.ROWS64_FORMATS)
@pytest.mark.parametrize("heads", [16, 32])
def test_ragged_query_tokens_against_the_emulator(heads, kv_format):
    """MTP below 64 heads: rows of 64 / heads query tokens, ragged query counts (0-9, so rows
    of fewer tokens, and an empty query range), lengths around the tile, items split and
    merged, paged: the decoder given q_len runs this kernel and matches its emulator."""
    from hipmla import decode

    rng = np.random.default_rng(100 + heads)
    q_lens = np.array([1, 2, 3, 4, 5, 7, 0, 9, 4, 4, 6])
    lens = q_lens + np.array([0, 1, 60, 64, 70, 700, 5, 2000, 9000, 20000, 129])
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    layout = random_page_table(lens, 16, rng, spare_pages=7, shared=1)
    pool = with_odd_fp8_scale(random_cache((int(layout.kv_indices.max()) + 1) * 16, kv_format, rng, scale_stride=24))
    q = rng.standard_normal((int(qo[-1]), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    with decode.Decoder(kv_format, SM_SCALE, heads=heads, max_batch=lens.size, max_q_tokens=int(qo[-1]),
                        q_len=64 // heads) as dec:
        if dec.device.arch.split(":")[0] != "sm_90":
            pytest.skip(f"an sm_90 kernel; this device is {dec.device.arch}")
        assert dec.kernel_symbol == SPECS[kv_format].symbol
        split = schedule(lens, dec.policy, q_lens=q_lens, row_tokens=64 // heads)
        assert split.n_items.max() >= 2
        v_max = float(np.abs(pool.dequantize(np.arange(pool.rows))[:, :512]).max())
        for _ in range(2):  # and again on the merge counters the first step left
            out, lse = dec.decode(q, pool, layout, qo_indptr=qo)
            emu_out, emu_lse = dec.emulate(q, pool, layout, qo_indptr=qo)
            assert np.isfinite(out.astype(np.float32)).all()
            assert_within_p_flips(out, lse, emu_out, emu_lse, v_max, f"rows64 {kv_format} {heads} heads x MTP")
        dec.check_errors()


@pytest.mark.gpu
def test_an_fp8_nan_code_makes_its_sequence_nan():
    """The e4m3fn NaN codes (0x7f, 0xff) enter K' as NaN (the hardware's e4m3 convert; bits
    placed by hand would give 480), so a sequence that sees one -- in the latent dims (K and
    V) or the rope dims (K only) -- outputs NaN, as the emulator does; the others are
    untouched and match it."""
    from hipmla import decode

    rng = np.random.default_rng(7)
    lens = np.array([100, 300, 70])
    layout = random_page_table(lens, 16, rng, spare_pages=2)
    clean = random_cache((int(layout.kv_indices.max()) + 1) * 16, "fp8", rng)
    data = clean.data.copy()
    data[layout.rows(1, 7, 8)[0], 3] = 0x7F
    data[layout.rows(2, 69, 70)[0], 540] = 0xFF
    pool = KVCache("fp8", data, fp8_scale=clean.fp8_scale, fp8_variant=clean.fp8_variant)
    q = rng.standard_normal((lens.size, 64, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    with decode.Decoder("fp8", SM_SCALE, heads=64, max_batch=lens.size) as dec:
        if dec.device.arch.split(":")[0] != "sm_90":
            pytest.skip(f"an sm_90 kernel; this device is {dec.device.arch}")
        assert dec.kernel_symbol == SPECS["fp8"].symbol
        out, lse = dec.decode(q, pool, layout)
        emu_out, emu_lse = dec.emulate(q, pool, layout)
    assert np.isnan(out[1:].astype(np.float32)).all() and np.isnan(lse[1:]).all()
    assert np.isnan(emu_out[1:].astype(np.float32)).all()
    assert np.isfinite(out[0].astype(np.float32)).all()
    v_max = float(np.abs(clean.dequantize(np.arange(clean.rows))[:, :512]).max())
    assert_within_p_flips(out[:1], lse[:1], emu_out[:1], emu_lse[:1], v_max, "the clean sequence")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", kernels.ROWS64_FORMATS)
def test_a_wrong_build_fails_its_check(kv_format):
    from hipmla import runtime

    if runtime.device_info(0).arch.split(":")[0] != "sm_90":
        pytest.skip("an sm_90 kernel")
    verdict = selftest.check_kernel(selftest.broken(SPECS[kv_format]), use_cache=False)
    assert not verdict.passed and "off the emulator" in verdict.message
    assert selftest.check_kernel(SPECS[kv_format], use_cache=False).passed
