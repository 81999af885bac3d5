"""Benchmark bookkeeping (CPU) and a short benchmark run (GPU)."""

import json
import re

import pytest

from hipmla import bench, runtime


def test_bytes_moved_counts_cache_rows_and_partials():
    # 4 sequences x 1024 tokens, mxfp4 with the padded 24-byte scale rows, no splits
    base = bench.bytes_moved("mxfp4", 4096, 4, 24, n_slots=0)
    assert base == 4096 * (288 + 24) + 4 * 16 * 576 * 2 + 4 * 16 * (1024 + 4) + 5 * 4
    # every split slot is written once and read once by the merging block
    split = bench.bytes_moved("mxfp4", 4096, 4, 24, n_slots=8)
    assert split - base == 2 * 8 * 16 * 514 * 4
    assert bench.bytes_moved("bf16", 10, 1, 0, 0) - bench.bytes_moved("fp8", 10, 1, 0, 0) == 10 * 576
    # a page table: one int per page and the last-page lengths
    paged = bench.bytes_moved("mxfp4", 4096, 4, 24, n_slots=0, page_size=16)
    assert paged - base == 4096 // 16 * 4 + 4 * 4


@pytest.mark.parametrize("name, arch, device, want", [
    ("NVIDIA H100 80GB HBM3", "sm_90", 3352.3, (3350.0, "datasheet")),
    ("NVIDIA H200", "sm_90", 4800.0, (4800.0, "datasheet")),
    ("NVIDIA H100 NVL", "sm_90", 3938.0, (3900.0, "datasheet")),
    ("AMD Instinct MI325X", "gfx942", 6000.0, (6000.0, "datasheet")),
    ("", "gfx950", 0.0, (8000.0, "datasheet")),
    ("NVIDIA GeForce RTX 4090", "sm_89", 1008.1, (1008.1, "memory clock x bus width")),
    ("NVIDIA GH200 480GB", "sm_90", 4022.8, (4022.8, "memory clock x bus width")),
])
def test_the_quoted_peak_is_the_parts_own(name, arch, device, want):
    """sm_90 is both the H100 (3.35 TB/s) and the H200 (4.8): the %peak column must not
    quote the H200's figure for an H100, as it did until 2026-12-05."""
    assert bench.datasheet_peak_gbs(name, arch, device) == want


def test_ragged_mixes_are_ragged():
    mixes = bench.ragged_mixes()
    for name, lens in mixes.items():
        assert lens.ndim == 1 and lens.min() >= 0
        assert len(set(lens.tolist())) > 1, name


def test_unknown_shape_is_an_argument_error(capsys, monkeypatch):
    monkeypatch.setattr(runtime, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "5x5k"])
    assert "--shapes" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--device", "-1"], "--device"),
    (["--out", "A_FILE"], "--out: .* is a file"),  # said before the run, not when it writes
])
def test_bench_arguments_are_checked_before_any_device_work(capsys, monkeypatch, tmp_path, argv, words):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setattr(runtime, "device_count", lambda: pytest.fail("the device was looked for"))
    with pytest.raises(SystemExit):
        bench.main([str(a_file) if a == "A_FILE" else a for a in argv])
    assert re.search(words, capsys.readouterr().err)


def test_a_trailing_comma_in_shapes_is_no_shape(capsys, monkeypatch):
    """As check reads --shapes: '4x1k,' is 4x1k (the run stops at the device, none here)."""
    def no_hip():
        raise RuntimeError("hip-python is not installed\nmore")

    monkeypatch.setattr(runtime, "device_count", no_hip)
    assert bench.main(["--shapes", "4x1k,", "--format", "bf16"]) == 2
    # and why, as check and selftest say it
    assert "no GPU reachable through hip-python (hip-python is not installed)" in capsys.readouterr().err


@pytest.mark.gpu
def test_short_benchmark_writes_table_and_files(tmp_path, capsys):
    rows = bench.run_bench(("mxfp4",), iters=3, device=0, with_torch=False, out_dir=tmp_path,
                           only={"4x1k", "rag64"})
    assert [r.shape for r in rows] == ["4x1k", "rag64"]
    for r in rows:
        assert r.flushed_median_us > 0 and r.gbs > 0
        assert r.host_us > 0 and r.host_views_us > 0 and r.host_raw_us > 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == 2 and data["meta"]["copy_gbs"] > 0
    assert (tmp_path / "bench.csv").read_text().count("\n") == 3
    assert "GB/s" in capsys.readouterr().out


@pytest.mark.gpu
def test_paged_benchmark_runs(tmp_path):
    rows = bench.run_bench(("fp8",), iters=3, device=0, with_torch=False, out_dir=None,
                           only={"4x1k"}, page_size=16)
    assert rows[0].page_size == 16 and rows[0].gbs > 0


def test_read_probe_is_none_without_a_torch_gpu(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch":
            raise ImportError("no torch here")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert bench.read_gbs() is None


def test_the_torch_probes_share_one_timing_loop():
    """probes.torch_median_us (read probe, matmul rate, torch peer): one warm-up call,
    ``before`` outside each timed span, the median of the event times."""
    from types import SimpleNamespace

    from hipmla.bench.probes import torch_median_us

    log, spans = [], iter([3.0, 1.0, 2.0])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            log.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return next(spans)  # ms

    fake_torch = SimpleNamespace(cuda=SimpleNamespace(Event=Event, synchronize=lambda: log.append("sync")))
    us = torch_median_us(fake_torch, lambda: log.append("fn"), 3, before=lambda: log.append("flush"))
    assert us == 2000.0
    assert log == ["fn", "sync"] + ["flush", "record", "fn", "record"] * 3


def test_table_prints_rows_with_and_without_the_read_probe(capsys):
    common = dict(kernel="k", kv_format="mxfp4", shape="4x1k", batch=4, tokens=4096, n_work=16, n_slots=0,
                  bytes_moved=1000, median_us=2.0, min_us=1.0, flushed_median_us=2.0, flushed_min_us=1.0,
                  gbs=0.5, pct_peak=1.0, pct_copy=2.0, host_us=5.0, host_views_us=6.0, host_raw_us=4.0)
    bench.print_table([bench.BenchRow(**common, pct_read=3.5), bench.BenchRow(**common, pct_read=None)], {})
    out = capsys.readouterr().out.splitlines()
    assert "%read" in out[0] and "3.5" in out[1] and " - " in out[2]


def test_the_files_say_what_the_peak_is(tmp_path):
    """bench.json records the peak and where it came from (a datasheet or the driver's
    clock x bus width), so a saved %peak can be read against the right figure."""
    from types import SimpleNamespace

    row = bench.BenchRow(kernel="k", kv_format="fp8", shape="4x1k", batch=4, tokens=4096, n_work=16, n_slots=0,
                         bytes_moved=1000, median_us=2.0, min_us=1.0, flushed_median_us=2.0, flushed_min_us=1.0,
                         gbs=0.5, pct_peak=1.0, pct_copy=2.0, pct_read=None, host_us=5.0, host_views_us=6.0,
                         host_raw_us=4.0)
    info = SimpleNamespace(name="NVIDIA GH200 480GB", arch="sm_90")
    bench.write_files([row], {}, tmp_path, info, 3000.0, 4022.8, None, "memory clock x bus width", "mxfp4")
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert (meta["peak_gbs"], meta["peak_from"], meta["device"]) == (4022.8, "memory clock x bus width", info.name)
    assert meta["q_precision"] == "mxfp4"  # the Q the rows ran with
    assert (tmp_path / "bench.csv").read_text().splitlines()[1].startswith("k,fp8,4x1k,")


def test_cpu_host_bench_times_every_path_and_undoes_its_stub():
    """scripts/host_bench.py: the host figures with the runtime stubbed (no GPU). Only
    that it runs every path and leaves the runtime as it was; its times are not judged."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "host_bench.py"
    spec = importlib.util.spec_from_file_location("host_bench", path)
    host_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_bench)
    before = {name: getattr(runtime, name) for name in ("device_info", "load_kernel", "_c_launch")}
    with host_bench.stubbed_runtime():
        lines = host_bench.host_table("mxfp4", calls=3, rounds=1)
    assert {name: getattr(runtime, name) for name in before} == before
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("contiguous", "4"), ("contiguous", "256"), ("paged", "4"),
                                            ("paged", "256")]
    assert all(float(x) > 0 for r in rows for x in r[2:])


def test_mtp_flops_counts_both_products_of_every_score():
    from hipmla.bench import MTP_CASES, mtp_flops

    assert mtp_flops(16, 10) == 2 * 16 * 10 * (576 + 512)
    assert (128, 1) in MTP_CASES and (16, 4) in MTP_CASES and (8, 1) in MTP_CASES


def test_the_commit_measured(monkeypatch):
    """$HIPMLA_COMMIT wins (a copy without git metadata); else git's short hash, marked
    -dirty where the tracked files differ from it."""
    import re

    from hipmla.bench.probes import git_commit

    monkeypatch.setenv("HIPMLA_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("HIPMLA_COMMIT")
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?|unknown", git_commit())


def test_mtp_peers_leave_the_64_row_kernel_out_below_16_heads():
    """bench --mtp times the 64-row kernel beside the 16-row one only where it serves the heads
    (8 heads: Decoder(kernel=...) would refuse it)."""
    from types import SimpleNamespace

    from hipmla import kernels
    from hipmla.bench.mtp import _peers

    def fake(heads, symbol):
        return SimpleNamespace(config=SimpleNamespace(kv_format="mxfp4", q_precision="bf16", heads=heads),
                               device=SimpleNamespace(arch="sm_90"), kernel_symbol=symbol)

    sixteen, rows64 = kernels.sm90_split_kernel("mxfp4", "bf16"), kernels.sm90_rows64_kernel("mxfp4")
    assert _peers(fake(8, sixteen.symbol)) == [None]
    assert _peers(fake(16, sixteen.symbol)) == [None, rows64]
    assert _peers(fake(64, rows64.symbol)) == [None, sixteen]
