"""hip_src/core/placement.h: which block runs which work item.

The schedule runs on the CPU harness (tests/host_harness.py) with the placement words
on: blocks run one after another, block b on "SM" b % sms (hipmla_host_sms), so an SM's
first block always claims before its second and the protocol's outcome is exact here.
On the H200 the same code runs in tests/test_decode_gpu.py (every GPU decode) and
scripts/sm90_timeline.py shows where the items ran.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from host_harness import HOST_PRELUDE, SCHEDULE_DUMP, SCHEDULE_FIELDS
from hipmla import kernels
from hipmla.kernels import DecodeParams, hip_src_dir, translation_unit
from hipmla.paging import KvLayout
from hipmla.schedule import SplitPolicy, schedule

CLANG = shutil.which("clang++-22")

DUMP_CONCURRENT = r"""
// Every block at once, as a GPU runs a wave: blocks [0, early) start first, the rest
// `delay_ms` later; block b on SM sm_of[b]. Out: the block's (seq, slot, begin).
extern "C" void dump_concurrent(MlaDecodeParams p, int grid, const int* sm_of, int early, int delay_ms, int* out) {
    hipmla::host_grid = unsigned(grid);
    hipmla::host_sm_map = sm_of;
    std::deque<std::barrier<>> bars;  // not movable: a deque grows without moving them
    std::vector<hipmla::ScheduleSmem<256>> sms(grid);
    for (int b = 0; b < grid; ++b) bars.emplace_back(256);
    std::vector<std::thread> pool;
    for (int b = 0; b < grid; ++b) {
        if (b == early) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        for (int t = 0; t < 256; ++t)
            pool.emplace_back([&, b, t] {
                hipmla::host_barrier = &bars[b];
                hipmla::host_block = unsigned(b);
                hipmla::host_thread = unsigned(t);
                const hipmla::WorkItem it = hipmla::schedule_item<256>(p, b, sms[b]);
                if (t == 0) {
                    out[3 * b] = it.seq;
                    out[3 * b + 1] = it.slot;
                    out[3 * b + 2] = it.begin;
                }
            });
    }
    for (auto& th : pool) th.join();
    hipmla::host_sm_map = nullptr;
}
"""


def test_header_matches_the_decoder():
    text = (hip_src_dir() / "core" / "placement.h").read_text()
    assert int(re.search(r"constexpr int PLACEMENT_HEADER = (\d+);", text).group(1)) == kernels.PLACEMENT_HEADER
    assert [kernels.placement_words(s) for s in (0, 1, 4, 5, 132)] == [4, 8, 8, 12, 136]


def _build(d, defines=()):
    if CLANG is None:
        pytest.skip("clang++-22 not installed (the harness uses clang vector types)")
    src = d / "placement.cpp"
    src.write_text(HOST_PRELUDE + translation_unit("core/schedule.h") + SCHEDULE_DUMP + DUMP_CONCURRENT)
    lib = d / "placement.so"
    subprocess.run([CLANG, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", *defines, str(src), "-o", str(lib)],
                   check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("placement"))


@pytest.fixture(scope="module")
def dump(lib):
    fn = lib.dump_schedule
    fn.argtypes = [DecodeParams, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return fn


@pytest.fixture(scope="module")
def dump_concurrent(lib):
    fn = lib.dump_concurrent
    fn.argtypes = [DecodeParams, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return fn


def _launch(dump, lens, policy: SplitPolicy, sms: int, words: np.ndarray | None, placement_sms: int | None = None):
    """Each block's (seq, slot, begin) of one launch, the placement words it left."""
    lens = np.asarray(lens)
    indptr = np.ascontiguousarray(KvLayout.contiguous(lens).kv_indptr, dtype=np.int32)
    grid = policy.max_items(lens.size)
    out = np.full((grid, SCHEDULE_FIELDS), -7, dtype=np.int32)
    p = DecodeParams(kv_indptr=indptr.ctypes.data, batch=lens.size, head_groups=1, q_tokens=lens.size,
                     placement=None if words is None else words.ctypes.data,
                     placement_sms=sms if placement_sms is None else placement_sms)
    p.set_split(policy)
    dump(p, grid, sms, out.ctypes.data)
    return out[:, [0, 3, 1]]  # seq, slot, begin


# Batches of at most 8 (the schedule's one-barrier scan), 45 (the two-level scan) and 300
# (thread 255 owns a sequence, its claim beside its own loads), each with at most as many
# rows as SMs (placement_pays).
@pytest.mark.parametrize("lens, sms", [([8192] * 8, 132), ([8192] * 8, 100), ([1024] * 4, 16),
                                       ([3000, 10, 0, 5000, 700] * 9, 45), ([512] * 300, 300)])
def test_every_item_runs_once_and_the_first_blocks_of_the_sms_run_the_first(dump, lens, sms):
    policy = SplitPolicy.for_device(132)
    words = np.zeros(kernels.placement_words(sms), dtype=np.int32)
    s = schedule(lens, policy)
    for launch in range(2):  # the words reset themselves: a second launch is the same
        got = _launch(dump, lens, policy, sms, words)
        grid = got.shape[0]
        assert not words.any(), f"launch {launch}: placement words left {words[words != 0]}"
        with_item = got[:, 0] >= 0
        slots = np.sort(got[with_item, 1])
        np.testing.assert_array_equal(slots, np.arange(s.size))  # every item, once
        # Blocks run in order, block b on SM b % sms: blocks 0 .. sms - 1 are the SMs' first
        # and claim 0 .. sms - 1; the rest claim after them in block order.
        claim = np.where(with_item, got[:, 1], -1)
        firsts = min(sms, grid)
        np.testing.assert_array_equal(claim[:min(firsts, s.size)], np.arange(min(firsts, s.size)))
        if s.size > firsts:
            np.testing.assert_array_equal(claim[firsts:s.size], np.arange(firsts, s.size))
        # the item a block claimed is the host model's item of that number
        b = np.flatnonzero(with_item)
        np.testing.assert_array_equal(got[b, 0], s.seq[got[b, 1]])
        np.testing.assert_array_equal(got[b, 2], s.begin[got[b, 1]])


def test_second_blocks_run_the_first_items_of_an_sm_that_never_gets_a_block(dump):
    # placement_sms counts one SM more than the blocks reach (SMs held by other work, a
    # partitioned GPU): item `sms` of the first items would be that SM's first block's; a
    # second block past the grid's seconds takes it (a gap claim). Every item runs once,
    # and the words reset (the SM word no block came to stays 0).
    lens, sms = [1024] * 4, 6
    policy = SplitPolicy.for_device(132)
    words = np.zeros(kernels.placement_words(sms + 1), dtype=np.int32)
    got = _launch(dump, lens, policy, sms, words, placement_sms=sms + 1)
    s = schedule(lens, policy)
    assert not words.any()
    np.testing.assert_array_equal(np.sort(got[got[:, 0] >= 0, 1]), np.arange(s.size))
    assert got[-1, 1] == sms  # the last block's: the missing SM's item


def test_block_of_an_sm_past_the_words_counts_as_a_second_block(dump):
    # %smid at or past placement_sms (a device with more SMs than the decoder counted):
    # such a block takes the items after the first ones; nothing is written past the words.
    lens, sms = [1024] * 4, 12
    policy = SplitPolicy.for_device(132)
    words = np.zeros(kernels.placement_words(4) + 8, dtype=np.int32)  # 8 guard words past 4 SMs
    got = _launch(dump, lens, policy, sms, words[:kernels.placement_words(4)], placement_sms=4)
    assert not words.any()
    s = schedule(lens, policy)
    np.testing.assert_array_equal(np.sort(got[got[:, 0] >= 0, 1]), np.arange(s.size))


def test_a_step_of_more_rows_than_sms_leaves_the_words_alone(dump):
    # placement_pays: more rows than SMs means more items than SMs, where the order the
    # blocks claim in cannot matter: item i is block i's, and no atomic touches the words
    # (their SM words hold 7 here, which a claim would have counted on).
    lens, sms = [300] * 9, 8
    policy = SplitPolicy.for_device(132)
    words = np.zeros(kernels.placement_words(sms), dtype=np.int32)
    words[kernels.PLACEMENT_HEADER:] = 7
    got = _launch(dump, lens, policy, sms, words)
    n = schedule(lens, policy).size
    np.testing.assert_array_equal(got[:n, 1], np.arange(n))
    assert (words[:kernels.PLACEMENT_HEADER] == 0).all() and (words[kernels.PLACEMENT_HEADER:] == 7).all()


@pytest.mark.parametrize("groups", [1, 2])
def test_the_protocol_runs_up_to_as_many_rows_as_sms(dump, groups):
    # rows = sequences x head_groups (query tokens x head_groups with qo_indptr): at E rows
    # the blocks claim (the SM words, 7 at the start, are counted on and reset to 0), at
    # E + 1 they are left alone.
    sms = 12
    policy = SplitPolicy.for_device(132)
    for rows, claimed in ((sms, True), (sms + 2, False)):
        lens = np.full(rows // groups, 900)
        words = np.zeros(kernels.placement_words(sms), dtype=np.int32)
        words[kernels.PLACEMENT_HEADER:] = 7
        indptr = np.ascontiguousarray(KvLayout.contiguous(lens).kv_indptr, dtype=np.int32)
        grid = policy.max_items(rows)
        out = np.full((grid, SCHEDULE_FIELDS), -7, dtype=np.int32)
        p = DecodeParams(kv_indptr=indptr.ctypes.data, batch=lens.size, head_groups=groups, q_tokens=lens.size,
                         placement=words.ctypes.data, placement_sms=sms)
        p.set_split(policy)
        dump(p, grid, sms, out.ctypes.data)
        assert (words[kernels.PLACEMENT_HEADER:] == (0 if claimed else 7)).all(), (rows, words)
        n = schedule(lens, policy, head_groups=groups).size
        np.testing.assert_array_equal(np.sort(out[out[:, 0] >= 0, 3]), np.arange(n))


def test_without_placement_words_item_i_is_block_i(dump):
    lens = [8192] * 8
    policy = SplitPolicy.for_device(132)
    got = _launch(dump, lens, policy, 5, None)
    n = schedule(lens, policy).size
    np.testing.assert_array_equal(got[:n, 1], np.arange(n))
    assert (got[n:, 0] == -1).all()


def test_second_blocks_that_come_first_let_the_first_blocks_of_other_sms_claim(dump_concurrent):
    # The case the protocol exists for: blocks 0 and 1 come to SM 0 first (as the H200 put
    # two of 8 x 8k's first 128 blocks on one SM), the other SMs' blocks 50 ms later. One
    # of blocks 0, 1 is SM 0's second and takes an item past the first 4 (none), so the
    # step's 4 items run on 4 SMs -- item i of block i put items 0 and 1 both on SM 0.
    lens = [256, 256]  # 2 items each with min_split_tokens 128: 4 items
    policy = SplitPolicy(target_items=8, min_split_tokens=128)
    s = schedule(lens, policy)
    assert s.size == 4
    grid = policy.max_items(len(lens))  # 10 blocks
    sm_of = np.array([0, 0, 1, 2, 3, 1, 2, 3, 0, 1][:grid], dtype=np.int32)
    indptr = np.ascontiguousarray(KvLayout.contiguous(np.asarray(lens)).kv_indptr, dtype=np.int32)
    words = np.zeros(kernels.placement_words(4), dtype=np.int32)
    for launch in range(2):
        out = np.full((grid, 3), -7, dtype=np.int32)
        p = DecodeParams(kv_indptr=indptr.ctypes.data, batch=len(lens), head_groups=1, q_tokens=len(lens),
                         placement=words.ctypes.data, placement_sms=4)
        p.set_split(policy)
        dump_concurrent(p, grid, sm_of.ctypes.data, 2, 50, out.ctypes.data)
        assert not words.any(), f"launch {launch}: placement words left {words[words != 0]}"
        with_item = np.flatnonzero(out[:, 0] >= 0)
        np.testing.assert_array_equal(np.sort(out[with_item, 1]), np.arange(4))
        assert len(set(sm_of[with_item])) == 4, f"launch {launch}: items on SMs {sm_of[with_item]}"
        np.testing.assert_array_equal(out[with_item, 0], s.seq[out[with_item, 1]])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
def test_gpu_claimed_items_give_the_bits_of_item_i_on_block_i(kv_format):
    # On the GPU: a step with fewer items than SMs (8 x 2k: 128 items, the band where the
    # hardware put two on one SM) and a ragged one with more, decoded with the placement
    # on and off. Which block runs an item changes no bit of the output; the words are
    # zero after every step (the launch's last claim reset them). The other GPU tests run
    # with the placement on (the decoder's default) against the emulator.
    from hipmla import decode, runtime
    from hipmla.inputs import make_inputs

    steps = [np.full(8, 2048), np.array([2048] * 8 + [300, 5000, 0, 77, 129, 1, 9000] * 9)]
    with decode.Decoder(kv_format, 1 / 24, max_batch=80) as on, \
            decode.Decoder(kv_format, 1 / 24, max_batch=80, placement=False) as off:
        if on.device.platform != "nvidia":
            pytest.skip("placement runs on NVIDIA only (an AMD block does not know its CU)")
        words = runtime.DeviceArray((kernels.placement_words(on.device.num_cus),), np.int32,
                                    ptr=on._params.placement)
        for i, lens in enumerate(steps):
            inputs = make_inputs(lens, kv_format, seed=40 + i, fp8_variant=on.fp8_variant, sm_scale=1 / 24)
            want_out, want_lse = off.decode(inputs.q, inputs.kv, inputs.layout)
            for rep in range(3):
                out, lse = on.decode(inputs.q, inputs.kv, inputs.layout)
                left = words.to_host()
                assert not left.any(), f"step {i} rep {rep}: placement words left {left[left != 0]}"
                np.testing.assert_array_equal(out.view(np.uint16), want_out.view(np.uint16))
                np.testing.assert_array_equal(lse.view(np.uint32), want_lse.view(np.uint32))


@pytest.mark.parametrize("seed", range(6))
def test_concurrent_blocks_on_random_sms_run_every_item_once(dump_concurrent, seed):
    # Blocks all at once on random SMs, some SMs counted but never reached (gap claims
    # racing the first blocks that come late), items fewer or more than SMs: every item
    # runs exactly once, the words reset after every launch, and with every counted SM
    # reached, a step of at most that many items runs one item an SM.
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 700, size=int(rng.integers(1, 4)))
    policy = SplitPolicy(target_items=int(rng.integers(2, 9)), min_split_tokens=128)
    s = schedule(lens, policy)
    grid = policy.max_items(len(lens))
    if seed % 2:  # every counted SM reached, at least as many as items
        counted = reached = int(rng.integers(s.size, grid + 1))
    else:
        counted = int(rng.integers(max(2, len(lens)), 7))
        reached = int(rng.integers(1, counted))
    indptr = np.ascontiguousarray(KvLayout.contiguous(lens).kv_indptr, dtype=np.int32)
    words = np.zeros(kernels.placement_words(counted), dtype=np.int32)
    checked = []
    for launch in range(3):
        # every reached SM gets a block (then a permutation), the rest anywhere
        sm_of = rng.integers(0, reached, size=grid).astype(np.int32)
        if grid >= reached:
            sm_of[:reached] = np.arange(reached)
            rng.shuffle(sm_of)
        out = np.full((grid, 3), -7, dtype=np.int32)
        p = DecodeParams(kv_indptr=indptr.ctypes.data, batch=len(lens), head_groups=1, q_tokens=len(lens),
                         placement=words.ctypes.data, placement_sms=counted)
        p.set_split(policy)
        dump_concurrent(p, grid, sm_of.ctypes.data, grid, 0, out.ctypes.data)
        assert not words.any(), f"launch {launch}: placement words left {words[words != 0]}"
        with_item = np.flatnonzero(out[:, 0] >= 0)
        np.testing.assert_array_equal(np.sort(out[with_item, 1]), np.arange(s.size))
        np.testing.assert_array_equal(out[with_item, 0], s.seq[out[with_item, 1]])
        if len(set(sm_of.tolist())) == counted and s.size <= min(counted, grid):
            checked.append(seed)
            assert len(set(sm_of[with_item])) == s.size, (sm_of[with_item], s.size)
    if seed % 2:  # every counted SM reached: the one-item-an-SM check ran
        assert checked, "the case never had at most as many items as SMs"
