"""scripts/soak.py: what needs no GPU runs here, through tests/test_decode.py's faked
runtime — a failed ``Decoder.reserve`` changes nothing and a later one works, the script's
allocation-failure checks, and the growing page tables of its soak — and a short run of
the whole script on a GPU (``gpu``-marked)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hipmla import runtime
from hipmla.paging import KvLayout
from test_decode import args, count_prepares, make

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import soak  # noqa: E402

#: DecodeParams fields that hold scratch addresses: the only ones a grown scratch changes.
SCRATCH_FIELDS = ("part_acc", "part_ml", "counters", "errors")


# ----------------------------------------------------------------------------- allocation failure


def test_failed_reserve_leaves_the_decoder_as_it_was_and_a_later_one_works(monkeypatch):
    gpu, dec = make(monkeypatch, max_batch=4)
    dec.run(**args(4))
    (scratch,), (before,) = gpu.buffers, gpu.launches
    gpu.reset()
    with soak.failing_alloc() as shots, pytest.raises(runtime.HipError, match="hipErrorOutOfMemory") as e:
        dec.reserve(64)
    assert e.value.code == soak.HIP_ERROR_OUT_OF_MEMORY and shots.left == 0
    assert gpu.host_calls() == {}  # nothing allocated, zeroed, waited for or freed
    assert dec.max_batch == 4 and dec._scratch is scratch and scratch.ptr

    prepares = count_prepares(monkeypatch, dec)
    dec.run(**args(4))
    assert prepares == [], "the step cached before the failure must go straight to its launch"
    assert gpu.launches == [before]  # the same kernel, shape, stream and every argument
    with pytest.raises(ValueError, match="^batch: 5 .*reserve"):
        dec.run(**args(5))

    gpu.reset()
    dec.reserve(64)  # the allocator works again
    assert gpu.calls["alloc"] == 1 and gpu.calls["free"] == 1 and scratch.ptr == 0
    grown = gpu.buffers[-1]
    assert dec.max_batch == 64 and dec._scratch is grown and grown.ptr
    dec.run(**args(4))
    (after,) = gpu.launches
    assert after.part_acc == grown.ptr
    assert {k: v for k, v in after.params.items() if k not in SCRATCH_FIELDS} == \
        {k: v for k, v in before.params.items() if k not in SCRATCH_FIELDS}
    assert (after.symbol, after.grid, after.block, after.shared, after.stream) == \
        (before.symbol, before.grid, before.block, before.shared, before.stream)


def test_failing_alloc_fails_as_often_as_asked_then_restores_the_allocator(monkeypatch):
    gpu, _ = make(monkeypatch)
    fake = runtime.alloc
    with soak.failing_alloc(2) as shots:
        for _ in range(2):
            with pytest.raises(runtime.HipError):
                runtime.alloc(64)
        assert shots.left == 0 and runtime.alloc(64).nbytes == 64
    assert runtime.alloc is fake


def bounded_device(monkeypatch):
    """The faked runtime with an allocator that refuses more than the device's memory not
    yet in use, as hipMalloc does; ``(gpu, decoder, step, used)`` for ``alloc_failure_checks``."""
    gpu, dec = make(monkeypatch, max_batch=8)
    fake = runtime.alloc

    def alloc(nbytes: int):
        if nbytes > dec.device.total_mem - used():
            raise runtime.HipError(soak.HIP_ERROR_OUT_OF_MEMORY, "hipErrorOutOfMemory", "out of memory")
        return fake(nbytes)

    monkeypatch.setattr(runtime, "alloc", alloc)

    def step() -> tuple:
        # what the kernel would compute from: every argument but where the scratch lives
        dec.run(**args(8))
        launch = gpu.launches[-1]
        return launch.grid, {k: v for k, v in launch.params.items() if k not in SCRATCH_FIELDS}

    def used() -> int:
        return sum(buf.nbytes for buf in gpu.buffers if buf.ptr)

    return gpu, dec, step, used


def test_alloc_failure_checks_pass_a_decoder_that_recovers(monkeypatch):
    gpu, dec, step, used = bounded_device(monkeypatch)
    failures, info = soak.alloc_failure_checks(dec, step, used, device_tolerance=0)
    assert failures == []
    assert dec.max_batch == info["grow_to"] == 32 and info["grown_scratch_bytes"] > info["scratch_bytes"]
    # the largest scratch reserve() does not refuse itself: the device's memory, not what is free
    too_big = info["too_big"]
    assert dec.scratch_layout(too_big, too_big).total_bytes <= dec.device.total_mem \
        < dec.scratch_layout(too_big + 1, too_big + 1).total_bytes
    assert "hipErrorOutOfMemory" in info["simulated_error"] and "hipErrorOutOfMemory" in info["real_error"]
    assert info["simulated_used_delta"] == info["real_used_delta"] == 0
    assert [buf for buf in gpu.buffers if buf.ptr] == [dec._scratch]


def test_alloc_failure_checks_report_what_changed(monkeypatch):
    gpu, dec, step, used = bounded_device(monkeypatch)
    counter = itertools.count()
    failures, _ = soak.alloc_failure_checks(dec, lambda: next(counter), used, device_tolerance=0)
    assert any(f.startswith("simulated: the next step's result differs") for f in failures)
    assert any(f.startswith("real: the next step's result differs") for f in failures)
    assert any(f.startswith("the step after the successful reserve differs") for f in failures)

    gpu, dec, step, used = bounded_device(monkeypatch)
    leaked = []

    def leaky_used() -> int:  # a failure that kept memory would show as growth
        leaked.append(1)
        return used() + (len(leaked) > 1) * 4096

    failures, _ = soak.alloc_failure_checks(dec, step, leaky_used, device_tolerance=0)
    assert any("device memory in use moved by 4096 bytes" in f for f in failures)


# ----------------------------------------------------------------------------- page tables


def test_growing_batch_tables_are_valid_and_rows_never_move():
    lens = np.array([0, 1, 15, 16, 17, 40])
    steps, page = 100, 16
    pool = soak.GrowingBatch.pages_for(lens, steps, page) + 3
    batch = soak.GrowingBatch(lens, page, pool, np.random.default_rng(1))
    rows: list[np.ndarray] = []
    for k in range(steps + 1):
        layout = batch.layout()  # KvLayout checks offsets, page ids and last-page lengths
        assert isinstance(layout, KvLayout) and layout.paged
        assert np.array_equal(layout.seq_lens(), lens + k)
        assert np.array_equal(np.diff(layout.kv_indptr), -(-(lens + k) // page))  # no page more than needed
        layout.check_cache(pool * page)
        used = layout.kv_indices[: layout.kv_indptr[-1]]
        assert np.unique(used).size == used.size, "a page handed to two sequences"
        now = [layout.rows(s) for s in range(layout.batch)]
        for s, earlier in enumerate(rows):
            assert np.array_equal(now[s][:-1], earlier), f"step {k}: sequence {s}'s earlier tokens moved"
        flat = np.concatenate(now)
        assert np.unique(flat).size == flat.size, "two tokens on one cache row"
        rows = now
        if k < steps:
            starts_page = bool(((lens + k) % page == 0).any())
            assert batch.grow() == starts_page
    with pytest.raises(RuntimeError, match="pages are all taken"):
        for _ in range(4 * page):
            batch.grow()


def test_growing_batch_plan_is_the_tables_step_by_step():
    lens = [3, 0, 31, 32, 200]
    steps, page = 40, 16
    pool = soak.GrowingBatch.pages_for(lens, steps, page) + 2
    stepped = soak.GrowingBatch(lens, page, pool, np.random.default_rng(9))
    indptr, indices, last = soak.GrowingBatch(lens, page, pool, np.random.default_rng(9)).plan(steps)
    assert indptr.shape == (steps, 6) and indices.shape == (steps, pool) and last.shape == (steps, 5)
    assert {a.dtype for a in (indptr, indices, last)} == {np.dtype(np.int32)}
    for k in range(steps):
        if k:
            stepped.grow()
        want = stepped.layout()
        got = KvLayout(indptr[k], indices[k], last[k], page)  # the padded row is a valid table too
        assert np.array_equal(got.seq_lens(), np.array(lens) + k)
        for s in range(got.batch):
            assert np.array_equal(got.rows(s), want.rows(s))


def test_measurement_points_include_the_baseline():
    points, baseline = soak.measure_points(10000, 1000)
    assert points == [100, *range(1000, 10001, 1000)] and baseline == 1000
    assert soak.measure_points(200, 1000) == ([100, 200], 100)
    assert soak.measure_points(1500, 400) == ([100, 400, 750, 800, 1200, 1500], 750)
    assert soak.measure_points(1, 1000) == ([1], 1)


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_a_short_soak_passes_on_the_gpu(tmp_path):
    """The whole script, briefly: every phase runs and passes. Memory limits are off here
    (other test workers share the device and the process); the full run in
    scripts/h200_run.sh's ``soak`` step holds them."""
    pytest.importorskip("torch")
    rc = soak.main(["--steps", "200", "--concurrent-steps", "50", "--host-growth-mib", "1e6",
                    "--device-growth-mib", "1e9", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "soak.json").read_text())
    failures = {name: results[name]["failures"] for name in ("soak", "concurrency", "alloc-failure")}
    assert rc == 0, failures
    assert [s["step"] for s in results["soak"]["samples"]] == [100, 200]
    assert "PASS" in (tmp_path / "soak.log").read_text().splitlines()[-1]
