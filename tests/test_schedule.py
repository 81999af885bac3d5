"""hipmla.schedule: the host model of the device-side split, and the device code itself.

The decode grid derives its work items on the device (hip_src/core/schedule.h); the
emulator, the grid size and the scratch size use the host model. Here the header runs
on the CPU (tests/host_harness.py) block by block and must give the model's items.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess

import numpy as np
import pytest

from host_harness import HOST_PRELUDE, SCHEDULE_DUMP, SCHEDULE_FIELDS
from hipmla.inputs import random_seq_lens
from hipmla.kernels import DecodeParams, translation_unit
from hipmla.paging import KvLayout, random_page_table
from hipmla.schedule import SplitPolicy, check_lens, fit_chunk, schedule, split_chunk

CLANG = shutil.which("clang++-22")


def _check_invariants(lens: np.ndarray, policy: SplitPolicy) -> None:
    s = schedule(lens, policy)
    assert s.size <= policy.max_items(lens.shape[0])
    if s.lone:
        assert s.size <= policy.lone_items
        assert split_chunk(int(lens.sum()), policy) < policy.lone_below_tokens
        policy = dataclasses.replace(policy, max_ranges=policy.lone_max_ranges)  # its cap below
    for b, n in enumerate(lens):
        items = s.items_of(b)
        assert items.size >= 1
        assert (s.n_items[items] == items.size).all()
        assert (s.first_slot[items] == items[0]).all()
        assert list(items) == list(range(items[0], items[0] + items.size))  # consecutive slots
        assert s.begin[items[0]] == 0 and s.end[items[-1]] == n
        assert (s.begin[items[1:]] == s.end[items[:-1]]).all()  # a partition in token order
        assert ((s.end[items] > s.begin[items]) | (n == 0)).all()
        if policy.max_ranges:
            cap = max(policy.max_ranges, -(-int(n) // policy.long_range_tokens))
            assert items.size <= cap + (1 if policy.fast_tile else 0)
        longest = s.chunk  # a capped sequence: its align units shared among max_ranges ranges
        if policy.max_ranges:
            units = -(-int(n) // policy.align_tokens)
            longest = max(longest, -(-units // policy.max_ranges) * policy.align_tokens)
        assert (s.end[items] - s.begin[items] <= longest).all()
        assert (s.begin[items] % policy.align_tokens == 0).all() or policy.fast_tile
        if policy.fast_tile:
            length = s.end[items] - s.begin[items]
            assert ((length % policy.fast_tile == 0) | (length < policy.fast_tile)).all()
    assert list(s.seq) == sorted(s.seq)


@pytest.mark.parametrize("fast_tile", [0, 128])
@pytest.mark.parametrize("max_ranges", [0, 1, 16])
def test_schedule_partitions_every_ragged_batch(fast_tile, max_ranges):
    rng = np.random.default_rng(fast_tile + max_ranges)
    for _ in range(60):
        lens = random_seq_lens(rng, max_batch=300, max_len=20000)
        policy = SplitPolicy.for_device(int(rng.integers(1, 300)), fast_tile=fast_tile)
        _check_invariants(lens, dataclasses.replace(policy, min_split_tokens=int(rng.choice([128, 256])),
                                                    max_ranges=max_ranges))


@pytest.mark.parametrize("lone_max_ranges", [0, 32])
def test_lone_split_partitions_every_ragged_batch(lone_max_ranges):
    rng = np.random.default_rng(11 + lone_max_ranges)
    took = 0
    for _ in range(80):
        lens = random_seq_lens(rng, max_batch=int(rng.choice([8, 300])), max_len=int(rng.choice([3000, 20000])))
        policy = SplitPolicy.for_device(int(rng.integers(1, 300)), fast_tile=int(rng.choice([0, 128])), lone=True)
        policy = dataclasses.replace(policy, lone_max_ranges=lone_max_ranges,
                                     lone_below_tokens=int(rng.choice([256, 1024, 4096])))
        _check_invariants(lens, policy)
        took += schedule(lens, policy).lone
    assert 10 < took < 70  # both splits ran


def test_lone_split_takes_short_items_one_to_a_cu():
    lone = SplitPolicy.for_device(132, lone=True)
    usual = SplitPolicy.for_device(132)
    assert (lone.lone_items, lone.lone_below_tokens, lone.lone_max_ranges) == (132, 1024, 32)
    assert usual.lone_items == 0
    # 4 x 8k: the usual split caps a row at 16 ranges (64 items, half the SMs idle); the
    # lone one aims at 132 items: 256-token chunks, 32 ranges a row.
    s = schedule([8192] * 4, lone)
    assert s.lone and s.chunk == 256 and s.size == 128 and set((s.end - s.begin).tolist()) == {256}
    assert schedule([8192] * 4, usual).size == 64
    # 8 x 8k: 256 items of 256 tokens with 32 ranges a row, 128 of 512 one to an SM.
    assert schedule([8192] * 8, lone).size == 128
    assert schedule([8192] * 8, dataclasses.replace(usual, max_ranges=32)).size == 256
    # 32 x 1k: 8 ranges of 128 a row (256 items), or 4 of 256.
    assert schedule([1024] * 32, usual).size == 256 and schedule([1024] * 32, lone).size == 128
    # Long items keep two to an SM: 32 x 8k's usual chunk is 1024 tokens.
    assert schedule([8192] * 32, lone).size == schedule([8192] * 32, usual).size == 256
    # A ragged batch whose lone split needs more items than SMs keeps the usual split:
    # 4 x 32k + 60 x 500 (usual chunk 640) would get 4 x 26 + 60 = 164 lone items.
    mix = [32768] * 4 + [500] * 60
    assert schedule(mix, lone).chunk == schedule(mix, usual).chunk == 640 and not schedule(mix, lone).lone
    wide = schedule(mix, dataclasses.replace(lone, lone_items=240))  # chunk 768: 4 x 43 + 60 items
    assert wide.lone and wide.chunk == 768 and wide.size == 232
    # Both sides of lone_items: 4 x 1k gets 8 lone items of 512 tokens (lone_items 8);
    # one more sequence makes 9, so the usual split runs (chunk 384: 3 ranges a row).
    p = SplitPolicy(target_items=16, min_split_tokens=128, lone_items=8, lone_max_ranges=0)
    s = schedule([1024] * 4, p)
    assert s.lone and s.chunk == 512 and s.size == 8
    s = schedule([1024] * 4 + [1], p)
    assert not s.lone and s.chunk == 384 and s.size == 4 * 3 + 1
    # max_items bounds the lone split too where lone_items is above target_items: 8k
    # tokens in ranges of 128, 32 of them (lone_max_ranges), against 4 usual items.
    big = SplitPolicy(target_items=4, min_split_tokens=128, lone_items=64, lone_below_tokens=4096)
    s = schedule([8192], big)
    assert s.lone and s.size == 32 and big.max_items(1) == 65


def test_fit_takes_the_first_longer_chunk_that_fits_the_target():
    usual = SplitPolicy.for_device(132, fit=True)
    assert usual.fit and usual.target_items == 264 and not SplitPolicy.for_device(132).fit
    no_fit = dataclasses.replace(usual, fit=False)
    # 4 x 32k + 60 x 500: chunk 640 gives 4 x 52 + 60 = 268 items, four past the 264 slots
    # (a second wave of four). Chunk 640 + 80 = 720 -> 768 tokens: 4 x 43 + 60 = 232.
    mix = [32768] * 4 + [500] * 60
    assert schedule(mix, no_fit).size == 268
    s = schedule(mix, usual)
    assert s.fit == 1 and s.chunk == 768 and s.size == 232 and not s.lone
    _check_invariants(np.array(mix), usual)
    # 64 x 32k: chunk 8064 cuts each sequence in 5 (320 items); 9072 -> 9088 cuts it in 4.
    s = schedule([32768] * 64, usual)
    assert schedule([32768] * 64, no_fit).size == 320
    assert s.fit == 1 and s.size == 256 and set((s.end - s.begin).tolist()) == {8192}
    # The second chunk (1 + 4/8) where the first does not fit.
    lens = np.random.default_rng(1).integers(1, 16385, size=146)
    s = schedule(lens, usual)
    assert s.fit == 2 and s.size <= 264 < schedule(lens, no_fit).size
    assert s.chunk == fit_chunk(schedule(lens, no_fit).chunk, 1, 128)
    _check_invariants(lens, usual)
    # A usual split within the target is left alone: 64 x 8k (256 items), 256 x 1k.
    for lens in ([8192] * 64, [1024] * 256, [32768] * 4):
        assert schedule(lens, usual).fit == 0
        assert schedule(lens, usual).chunk == schedule(lens, no_fit).chunk
    # No chunk fits (every row is an item at least): the usual split.
    s = schedule([1000] * 40, SplitPolicy(target_items=16, min_split_tokens=128, fit=True))
    assert s.fit == 0 and s.size == 40
    # The rows bound: rows + target_items below 2^15 (the device's 16-bit counts). 100
    # sequences of 41740 tokens (one 46740) at chunk 128 overshoot either target.
    lens = np.full(100, 41740)
    lens[0] += 5000
    for target, fit in ((2**15 - 100, 0), (2**15 - 101, 1)):
        p = SplitPolicy(target_items=target, min_split_tokens=128, max_ranges=0, fit=True)
        assert schedule(lens, dataclasses.replace(p, fit=False)).size == 32739 > target
        assert schedule(lens, p).fit == fit
    with pytest.raises(TypeError, match="fit"):
        SplitPolicy(target_items=4, fit=1)


def test_max_ranges_caps_the_slots_of_a_row():
    # 4 x 8k on 132 CUs with a 128-token floor: 64 ranges a sequence, or 16 longer ones.
    policy = SplitPolicy(target_items=264, min_split_tokens=128, max_ranges=0)
    assert np.bincount(schedule([8192] * 4, policy).seq).tolist() == [64] * 4
    capped = dataclasses.replace(policy, max_ranges=16)
    s = schedule([8192] * 4 + [100], capped)
    assert np.bincount(s.seq).tolist() == [16] * 4 + [1]
    assert set((s.end - s.begin)[s.seq < 4].tolist()) == {512}
    # Short sequences keep the finer split: 4 x 1k gets 8 ranges of 128 either way.
    assert np.bincount(schedule([1024] * 4, capped).seq).tolist() == [8] * 4
    # Ranges as long as long_range_tokens (512) anyway are not capped: 4 x 32k + 60 x 500
    # keeps its 640-token chunk, 52 ranges a long sequence (16 would leave SMs idle); the
    # fit then takes 768 (43 ranges: 232 items, not 268 on 264 slots).
    mix = [32768] * 4 + [500] * 60
    assert np.bincount(schedule(mix, capped).seq).tolist() == [52] * 4 + [1] * 60
    assert np.bincount(schedule(mix, dataclasses.replace(capped, fit=True)).seq).tolist() == [43] * 4 + [1] * 60
    assert np.bincount(schedule(mix, dataclasses.replace(capped, long_range_tokens=4096)).seq)[:4].tolist() == [16] * 4


def test_schedule_balances_long_sequences():
    policy = SplitPolicy.for_device(132)
    s = schedule([8192] * 4, policy)
    assert s.chunk == 128 and s.size == 4 * 16  # 264 target items, 128-token floor, 16 ranges a sequence
    s = schedule([100, 20000], policy)
    per_seq = np.bincount(s.seq)
    # the longest sequence gets the splits, 512 tokens each (the cap's long ranges)
    assert per_seq[0] == 1 and per_seq[1] == 40
    per_seq = np.bincount(schedule([100, 20000], dataclasses.replace(policy, max_ranges=0)).seq)
    assert per_seq[1] > 30


def test_fast_tile_cuts_the_partial_last_tile():
    s = schedule([300, 128, 100, 0], SplitPolicy(target_items=1, min_split_tokens=4096, fast_tile=128))
    got = [(int(a), int(b), int(c)) for a, b, c in zip(s.seq, s.begin, s.end)]
    assert got == [(0, 0, 256), (0, 256, 300), (1, 0, 128), (2, 0, 100), (3, 0, 0)]
    assert list(s.slot) == [0, 1, -1, -1, -1]


def test_split_chunk():
    p = SplitPolicy(target_items=10, min_split_tokens=256, align_tokens=128)
    assert split_chunk(0, p) == 256
    assert split_chunk(100_000, p) == 10_112  # ceil(10_000 / 128) * 128
    assert split_chunk(2_000, p) == 256


@pytest.mark.parametrize("kwargs, name", [
    (dict(target_items=0), "target_items"),
    (dict(target_items=4, align_tokens=96), "align_tokens"),
    (dict(target_items=4, fast_tile=256), "fast_tile"),
    (dict(target_items=4, min_split_tokens=2**31), "min_split_tokens"),
    (dict(target_items=True), "target_items"),
    (dict(target_items=4, max_ranges=-1), "max_ranges"),
    (dict(target_items=4, max_ranges=1.5), "max_ranges"),
    (dict(target_items=4, long_range_tokens=0), "long_range_tokens"),
    (dict(target_items=4, lone_items=-1), "lone_items"),
    (dict(target_items=4, lone_below_tokens=0), "lone_below_tokens"),
    (dict(target_items=4, lone_max_ranges=2**31), "lone_max_ranges"),
])
def test_bad_policies_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SplitPolicy(**kwargs)


@pytest.mark.parametrize("lens, err", [
    ([], ValueError), ([[1]], ValueError), ([1.5], TypeError), ([-1], ValueError),
    (np.array([2**32 + 5], dtype=np.uint64), ValueError), ([2**30 + 1], ValueError),
    (np.array([2**30 + 1], dtype=np.uint32), ValueError),
])
def test_bad_lengths(lens, err):
    with pytest.raises(err, match="seq_lens"):
        check_lens(lens)


def test_max_items_bounds_the_grid():
    p = SplitPolicy.for_device(8, fast_tile=128)
    assert p.max_items(10) == 16 + 20
    assert SplitPolicy.for_device(8, items_per_cu=1, lone=True).max_items(3) == 8 + 3
    with pytest.raises(TypeError, match="lone"):
        SplitPolicy.for_device(8, lone=1)
    with pytest.raises(ValueError, match="rows"):
        p.max_items(0)


# --------------------------------------------------------------------- the device code


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    if CLANG is None:
        pytest.skip("clang++-22 not installed (the harness uses clang vector types)")
    d = tmp_path_factory.mktemp("sched")
    src = d / "sched.cpp"
    src.write_text(HOST_PRELUDE + translation_unit("core/schedule.h") + SCHEDULE_DUMP)
    lib = d / "sched.so"
    subprocess.run([CLANG, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)],
                   check=True, capture_output=True, text=True)
    fn = ctypes.CDLL(str(lib)).dump_schedule
    fn.argtypes = [DecodeParams, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return fn


def _device_items(dump, layout: KvLayout, policy: SplitPolicy, qo=None, groups: int = 1,
                  row_tokens: int = 1) -> np.ndarray:
    t_q = layout.batch if qo is None else int(qo[-1])
    grid = policy.max_items(max(t_q * groups, 1))
    out = np.full((grid, SCHEDULE_FIELDS), -7, dtype=np.int32)
    qo32 = None if qo is None else np.ascontiguousarray(qo, dtype=np.int32)
    indptr = np.ascontiguousarray(layout.kv_indptr, dtype=np.int32)
    indices = np.ascontiguousarray(layout.kv_indices, dtype=np.int32) if layout.paged else None
    last = np.ascontiguousarray(layout.kv_last_page_len, dtype=np.int32) if layout.paged else None
    p = DecodeParams(kv_indptr=indptr.ctypes.data,
                     kv_indices=None if indices is None else indices.ctypes.data,
                     kv_last_page_len=None if last is None else last.ctypes.data,
                     qo_indptr=None if qo32 is None else qo32.ctypes.data,
                     batch=layout.batch, page_shift=layout.page_size.bit_length() - 1,
                     head_groups=groups, q_tokens=t_q, row_tokens=row_tokens)
    p.set_split(policy)
    dump(p, grid, 0, out.ctypes.data)
    return out


def _assert_items_are(got: np.ndarray, s) -> None:
    """The device's items (_device_items) are the host model's, block for block."""
    want = np.stack([s.seq, s.begin, s.end, np.arange(s.size), s.first_slot, s.n_items, s.row, s.slot_stride],
                    axis=1)
    np.testing.assert_array_equal(got[: s.size, :8], want)
    np.testing.assert_array_equal(got[: s.size, 9:11], np.stack([s.queries, s.sees], axis=1))


@pytest.mark.parametrize("batch", [1, 2, 7, 8, 9, 33])
def test_device_schedule_on_both_sides_of_the_small_scan(dump, batch):
    # core/schedule.h: up to SMALL_SCAN (8) sequences take the one-barrier scan
    rng = np.random.default_rng(7 + batch)
    lens = rng.integers(0, 3000, size=batch)
    policy = dataclasses.replace(SplitPolicy.for_device(132), min_split_tokens=128)
    got = _device_items(dump, KvLayout.contiguous(lens), policy)
    s = schedule(lens, policy)
    _assert_items_are(got, s)
    assert (got[s.size:, 0] == -1).all()


@pytest.mark.parametrize("seed", range(4))
def test_device_schedule_equals_the_host_model(dump, seed):
    rng = np.random.default_rng(100 + seed)
    # batch > 256 on one seed: a thread then owns several sequences
    lens = random_seq_lens(rng, max_batch=600 if seed == 3 else 80, max_len=5000)
    page_size = [1, 16, 64, 128][seed]
    layout = random_page_table(lens, page_size, rng, spare_pages=5) if seed % 2 else KvLayout.contiguous(lens)
    policy = SplitPolicy.for_device(int(rng.integers(1, 140)), fast_tile=128 if seed >= 2 else 0)
    policy = dataclasses.replace(policy, min_split_tokens=128, max_ranges=[0, 3, 16, 5][seed],
                                 long_range_tokens=[512, 700, 2048, 128][seed])
    got = _device_items(dump, layout, policy)
    s = schedule(lens, policy)
    _assert_items_are(got, s)
    assert (got[s.size:, 0] == -1).all()  # blocks past the batch's items have none


def _queries(rng, lens: np.ndarray, several: bool):
    """(lens, q_lens, qo_indptr, head groups): one query token of 16 heads each, or (several)
    1-3 query tokens a sequence, its kv grown by them, and 1 or 2 head groups."""
    if not several:
        return lens, None, None, 1
    q_lens = rng.integers(1, 4, size=lens.size)
    return lens + q_lens, q_lens, np.concatenate([[0], np.cumsum(q_lens)]), int(rng.choice([1, 2]))


@pytest.mark.parametrize("seed", range(4))
def test_device_lone_split_equals_the_host_model(dump, seed):
    # Batches on both sides of the lone split's two conditions (the usual chunk below
    # lone_below_tokens; at most lone_items lone items), one of them past a thread's
    # one sequence (up to 400), paged on odd seeds, with several query tokens and head groups on
    # seed 2.
    rng = np.random.default_rng(300 + seed)
    took = 0
    for _ in range(6):
        lens = random_seq_lens(rng, max_batch=400 if seed == 3 else int(rng.choice([4, 8, 40])),
                               max_len=2000 if seed == 3 else 9000)
        lens, q_lens, qo, groups = _queries(rng, lens, several=seed == 2)
        layout = random_page_table(lens, 16, rng, spare_pages=3) if seed % 2 else KvLayout.contiguous(lens)
        policy = SplitPolicy.for_device(int(rng.integers(1, 140)), fast_tile=int(rng.choice([0, 128])), lone=True)
        policy = dataclasses.replace(policy, lone_below_tokens=int(rng.choice([512, 1024, 8192])),
                                     lone_max_ranges=int(rng.choice([0, 4, 32])))
        if seed == 3:  # every sequence is an item: a lone split of up to 400 of them
            policy = dataclasses.replace(policy, lone_items=int(rng.integers(260, 600)))
        got = _device_items(dump, layout, policy, qo, groups)
        s = schedule(lens, policy, q_lens=q_lens, head_groups=groups)
        _assert_items_are(got, s)
        assert (got[s.size:, 0] == -1).all()
        rows = lens.size if q_lens is None else int(q_lens.sum())
        took += s.lone
        assert s.size <= policy.max_items(rows * groups)
    assert 0 < took < 6  # both splits ran


@pytest.mark.parametrize("seed", range(4))
def test_device_fit_equals_the_host_model(dump, seed):
    # Ragged batches whose usual split overshoots the target (the fit's candidates), on both
    # sides of the small scan and past a thread's one sequence (seed 3: up to 400), paged on
    # odd seeds, several query tokens and head groups on seed 2, fast tiles on seed 1.
    rng = np.random.default_rng(500 + seed)
    fits = set()
    for _ in range(8):
        batch = int(rng.choice([3, 8, 20, 60])) if seed < 3 else int(rng.integers(200, 400))
        lens = rng.integers(1, 20000, size=batch)
        lens, q_lens, qo, groups = _queries(rng, lens, several=seed == 2)
        layout = random_page_table(lens, 16, rng, spare_pages=3) if seed % 2 else KvLayout.contiguous(lens)
        cus = int(rng.integers(1, 140)) if seed < 3 else int(rng.integers(150, 300))  # target above the rows
        policy = SplitPolicy.for_device(cus, fast_tile=128 if seed == 1 else 0, lone=bool(rng.integers(0, 2)))
        policy = dataclasses.replace(policy, fit=True)
        got = _device_items(dump, layout, policy, qo, groups)
        s = schedule(lens, policy, q_lens=q_lens, head_groups=groups)
        _assert_items_are(got, s)
        assert (got[s.size:, 0] == -1).all()
        fits.add(s.fit)
    assert 0 in fits and len(fits) > 1  # fitted and left alone


def test_device_lone_split_of_more_sequences_than_threads(dump):
    # 300 sequences (threads own two), a lone split of 300 items: each sequence one item.
    lens = np.random.default_rng(5).integers(1, 129, size=300)
    policy = SplitPolicy(target_items=600, min_split_tokens=128, lone_items=320)
    s = schedule(lens, policy)
    assert s.lone and s.size == 300
    _assert_items_are(_device_items(dump, KvLayout.contiguous(lens), policy), s)


@pytest.mark.parametrize("seed", range(3))
def test_device_schedule_of_several_query_tokens_and_heads_equals_the_host_model(dump, seed):
    rng = np.random.default_rng(200 + seed)
    groups = [2, 8, 1][seed]
    q_lens = rng.integers(0, 9, size=40 if seed < 2 else 300)  # 0..8 query tokens, ragged
    lens = q_lens + rng.integers(0, 3000, size=q_lens.size)    # kv >= q: every token sees itself
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    layout = random_page_table(lens, 16, rng, spare_pages=5) if seed == 1 else KvLayout.contiguous(lens)
    policy = SplitPolicy.for_device(int(rng.integers(1, 140)))
    got = _device_items(dump, layout, policy, qo, groups)
    s = schedule(lens, policy, q_lens=q_lens, head_groups=groups)
    _assert_items_are(got, s)
    assert (got[: s.size, 8] == 0).all()
    assert (got[s.size:, 0] == -1).all()
    # Every row of every query token has items; a row's items cover what its token sees.
    assert sorted(set(s.row.tolist())) == list(range(int(qo[-1]) * groups))
    for r in range(0, int(qo[-1]) * groups, 7):
        it = s.items_of_row(r)
        seq = int(s.seq[it[0]])
        j = r // groups - int(qo[seq])
        sees = int(lens[seq]) - int(q_lens[seq]) + j + 1
        assert s.begin[it[0]] == 0 and s.end[it[-1]] == sees
        assert (s.begin[it[1:]] == s.end[it[:-1]]).all()
        assert list(it) == list(s.first_slot[it[0]] + s.slot_stride[it[0]] * np.arange(it.size))


@pytest.mark.parametrize("seed", range(8))
def test_device_schedule_of_several_query_tokens_a_row_equals_the_host_model(dump, seed):
    # Rows of row_tokens query tokens: the 64-row kernel below 64 heads (16 heads x 4, 32
    # heads x 2), the 16-head kernels below 16 heads (2 heads x 8, 1 x 16); ragged query
    # tokens a sequence (0..9, 0..39 from seed 4 on), so rows of fewer tokens too; paged on
    # odd seeds; the lone split and the fit on seeds 3 and 7; seed 6 has as many kv tokens
    # as query tokens everywhere.
    rng = np.random.default_rng(700 + seed)
    rt = [4, 2, 4, 2, 8, 16, 16, 8][seed]
    q_lens = rng.integers(0, 10 if seed < 4 else 40, size=[30, 7, 260, 50, 30, 7, 200, 50][seed])
    lens = q_lens + (0 if seed == 6 else rng.integers(0, 4000, size=q_lens.size))
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    layout = random_page_table(lens, 16, rng, spare_pages=5) if seed % 2 else KvLayout.contiguous(lens)
    policy = SplitPolicy.for_device(int(rng.integers(1, 140)), items_per_cu=1, lone=seed % 4 == 3,
                                    fit=seed % 4 == 3)
    got = _device_items(dump, layout, policy, qo, 1, rt)
    s = schedule(lens, policy, q_lens=q_lens, head_groups=1, row_tokens=rt)
    _assert_items_are(got, s)
    assert (got[s.size:, 0] == -1).all()
    # The rows tile the query tokens in groups of rt from each sequence's first; a row's
    # items cover what its last token sees, the earlier ones seeing one fewer each.
    firsts = [int(qo[b]) + j for b in range(lens.size) for j in range(0, int(q_lens[b]), rt)]
    assert sorted(set(s.row.tolist())) == firsts
    for r in firsts[::5]:
        it = s.items_of_row(r)
        seq = int(s.seq[it[0]])
        j = r - int(qo[seq])
        queries = min(rt, int(q_lens[seq]) - j)
        assert (s.queries[it] == queries).all()
        assert (s.sees[it] == int(lens[seq]) - int(q_lens[seq]) + j + queries).all()
        assert s.begin[it[0]] == 0 and s.end[it[-1]] == s.sees[it[0]]
        assert (s.begin[it[1:]] == s.end[it[:-1]]).all()
    assert s.size <= policy.max_items(int(qo[-1]))


def test_lone_and_fit_bounds_count_query_tokens_not_rows():
    # core/schedule.h tries the fit only while step_rows (core/paged.h: query tokens x head
    # groups, not divided by row_tokens) + the target stays below FIT_MAX_ROWS; the model
    # must decide the same. 4096 sequences x 8 query tokens in rows of 4: 8192 rows, 32768
    # step rows. (Too many blocks for the CPU harness of the device code: the rule alone.)
    from hipmla.schedule import FIT_MAX_ROWS

    policy = SplitPolicy.for_device(9000, items_per_cu=1, fit=True)
    lens, q_lens = np.full(4096, 2000), np.full(4096, 8)
    assert 8192 + policy.target_items < FIT_MAX_ROWS <= 32768 + policy.target_items
    s = schedule(lens, policy, q_lens=q_lens, row_tokens=4)
    assert s.fit == 0
    usual = schedule(lens, dataclasses.replace(policy, fit=False), q_lens=q_lens, row_tokens=4)
    assert s.size == usual.size > policy.target_items  # what the fit would have cut
    # 2000 such sequences: 16000 step rows, within the bound, so the fit is tried and taken.
    fitted = schedule(lens[:2000], policy, q_lens=q_lens[:2000], row_tokens=4)
    assert fitted.fit > 0 and fitted.size <= policy.target_items


def test_schedule_rows_of_several_query_tokens_take_one_head_group():
    with pytest.raises(ValueError, match="row_tokens: several query tokens a row need head_groups 1, got 2"):
        schedule([9], SplitPolicy.for_device(4), q_lens=[2], head_groups=2, row_tokens=2)
    with pytest.raises(ValueError, match=r"row_tokens: expected one of \(1, 2, 4, 8, 16\), got 3"):
        schedule([9], SplitPolicy.for_device(4), row_tokens=3)


def test_device_schedule_flags_short_sequences_and_bad_query_ranges(dump):
    lens = np.array([5, 2, 9])
    policy = SplitPolicy.for_device(4)
    got = _device_items(dump, KvLayout.contiguous(lens), policy, np.array([0, 2, 5, 6]), 1)
    seq, bad = got[:, 0], got[:, 8]
    assert set(bad[seq == 1]) == {32}  # ERR_Q_LEN: 2 kv tokens, 3 query tokens
    assert set(bad[(seq == 0) | (seq == 2)]) == {0}


def _raw_device_items(dump, indptr, policy: SplitPolicy, indices=None, last=None, page_size: int = 1,
                      kv_rows: int = 0, n_indices: int = 0) -> np.ndarray:
    """The device's items for int32 arrays the host never checked (what a runtime passes by
    address), with the cache's / page table's extents (0: a raw address, unbounded). Field 8
    is the item's ERR_* bits (the kernel's report_bad_item puts them in the error word)."""
    indptr = np.ascontiguousarray(indptr, dtype=np.int32)
    ind = None if indices is None else np.ascontiguousarray(indices, dtype=np.int32)
    lst = None if last is None else np.ascontiguousarray(last, dtype=np.int32)
    batch = indptr.shape[0] - 1
    grid = policy.max_items(batch)
    out = np.full((grid, SCHEDULE_FIELDS), -7, dtype=np.int32)
    p = DecodeParams(kv_indptr=indptr.ctypes.data, kv_indices=None if ind is None else ind.ctypes.data,
                     kv_last_page_len=None if lst is None else lst.ctypes.data, batch=batch,
                     page_shift=page_size.bit_length() - 1, q_tokens=batch, kv_rows=kv_rows, n_indices=n_indices)
    p.set_split(policy)
    dump(p, grid, 0, out.ctypes.data)
    return out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_device_schedule_flags_an_indptr_wrapped_past_int32(dump, paged):
    # An int64 offset just past 2^31 cast to int32 by a runtime: kv_indptr[2] = -2^31 + 2.
    # In int32, end - first wrapped back to 2^31 - 3 tokens, which passed every check (a
    # negative end is below any bound) and, paged, read kv_indices ~2^31 entries past its 10.
    indptr = [0, 5, -2**31 + 2]
    kw = dict(indices=np.zeros(10), last=[1, 1], page_size=1, n_indices=10) if paged else {}
    got = _raw_device_items(dump, indptr, SplitPolicy.for_device(4), kv_rows=100, **kw)
    items = got[got[:, 0] >= 0]
    assert set(items[items[:, 0] == 1, 8]) == {1}  # ERR_INDPTR and (items[items[:, 0] == 1, 2] == 0).all()
    assert items[items[:, 0] == 0, 1:3].tolist() == [[0, 5]] and (items[items[:, 0] == 0, 8] == 0).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_device_schedule_flags_a_sequence_past_the_most_tokens(dump, paged):
    # With raw addresses (no extent to check against) a sequence may claim more than
    # MAX_SEQ_TOKENS (2^30) tokens: one item of 2^31 - 1 tokens overflowed every kernel's
    # tile count. It is flagged (ERR_BOUNDS) and reads nothing; 2^30 tokens exactly pass.
    from hipmla.validate import MAX_SEQ_TOKENS

    policy = SplitPolicy.for_device(4)
    if paged:  # 2^23 pages of 128, the last one full: 2^30 tokens; one more page passes it
        n = 1 << 23
        table = np.zeros(n + 2, np.int32)  # the items' page checks read every entry of the ok case
        over = _raw_device_items(dump, [0, 1, n + 2], policy, table, [128, 128], 128)
        ok = _raw_device_items(dump, [0, 1, n + 1], policy, table, [128, 128], 128)
    else:
        over = _raw_device_items(dump, [0, 1, MAX_SEQ_TOKENS + 2], policy)
        ok = _raw_device_items(dump, [0, 1, MAX_SEQ_TOKENS + 1], policy)
    for got, bad in ((over, 2), (ok, 0)):
        items = got[got[:, 0] == 1]
        assert set(items[:, 8]) == {bad}
    assert (over[over[:, 0] == 1, 2] == 0).all()  # an invalid sequence gets no range
    assert ok[ok[:, 0] == 1, 2].max() == MAX_SEQ_TOKENS


def test_device_division_is_exact_on_both_sides_of_32_bits(tmp_path):
    # div_nonneg takes a 32-bit division when both operands fit and a 64-bit one otherwise:
    # the schedule's chunk and ranges must not depend on which.
    if CLANG is None:
        pytest.skip("clang++-22 not installed (the harness uses clang vector types)")
    src = tmp_path / "div.cpp"
    src.write_text(HOST_PRELUDE + translation_unit("core/schedule.h") +
                   'extern "C" long long div_c(long long a, long long b) { return hipmla::div_nonneg(a, b); }\n')
    lib = tmp_path / "div.so"
    subprocess.run([CLANG, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(src), "-o", str(lib)],
                   check=True, capture_output=True, text=True)
    div = ctypes.CDLL(str(lib)).div_c
    div.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
    div.restype = ctypes.c_longlong
    rng = np.random.default_rng(7)
    edges = [0, 1, 2, 63, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 5, 2**62 + 3]
    pairs = [(a, b) for a in edges for b in edges if b >= 1]
    pairs += [(int(a), int(b)) for a, b in zip(rng.integers(0, 2**63 - 1, 200), rng.integers(1, 2**34, 200))]
    pairs += [(int(a), int(b)) for a, b in zip(rng.integers(0, 2**32, 200), rng.integers(1, 2**32, 200))]
    for a, b in pairs:
        assert div(a, b) == a // b, (a, b)
