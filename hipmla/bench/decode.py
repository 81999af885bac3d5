"""The decode bench: device time of ``Decoder.run`` per format and shape, hot and with the
L2 flushed, as GB/s and as a % of the ceilings measured in the same run, the host time of
the step, and the torch peer; the table and the JSON / CSV files."""

from __future__ import annotations

import csv
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hipmla import runtime
from hipmla.bench.host import fresh_views, host_figures, host_reference_us
from hipmla.bench.peer import torch_peer
from hipmla.bench.probes import Timer, datasheet_peak_gbs, git_commit, read_gbs
from hipmla.bench.steps import bytes_moved, lens_step, ragged_mixes
from hipmla.decode import Decoder, resolve_q_precision
from hipmla.inputs import BENCH_SM_SCALE, benchmark_shapes, random_cache
from hipmla.schedule import schedule


@dataclass
class BenchRow:
    kernel: str
    kv_format: str
    shape: str
    batch: int
    tokens: int
    n_work: int
    n_slots: int
    bytes_moved: int
    median_us: float
    min_us: float
    flushed_median_us: float
    flushed_min_us: float
    gbs: float  # from the flushed median
    pct_peak: float
    pct_copy: float
    pct_read: float | None  # of a read-only stream (torch.sum) measured in the same run; None without torch
    host_us: float  # one run() with the same buffer objects
    host_views_us: float  # one run() with new views of the same buffers
    host_raw_us: float  # one run() with raw addresses
    page_size: int = 0  # 0: contiguous rows
    host_ref_us: float | None = None  # a ctypes call of a C no-op, timed the same way: the CPU's state


def run_bench(formats, iters: int, device: int, with_torch: bool, out_dir: Path | None,
              only: set[str] | None = None, page_size: int = 0, q_precision: str = "auto") -> list[BenchRow]:
    info = runtime.device_info(device)
    timer = Timer(info.l2_bytes)
    copy_gbs = timer.copy_gbs()
    read = read_gbs()
    peak, peak_from = datasheet_peak_gbs(info.name, info.arch, info.peak_bandwidth_gbs)
    q_precision = resolve_q_precision(q_precision, info.arch, "mxfp4")  # auto: bf16 for every format
    layout_name = f"paged, {page_size} rows a page, pages in random order" if page_size else "contiguous rows"
    print(f"hipmla bench: {info.name} ({info.arch}, {info.num_cus} CUs), peak {peak:.0f} GB/s "
          f"({peak_from}), measured device copy {copy_gbs:.0f} GB/s, read "
          f"{'-' if read is None else f'{read:.0f}'} GB/s, cache {layout_name}, Q {q_precision}, "
          f"commit {git_commit()}", flush=True)
    shapes = [(s.name, s.seq_lens) for s in benchmark_shapes()] + list(ragged_mixes().items())
    if only:
        shapes = [(n, l) for n, l in shapes if n in only]
    max_rows = max(int(l.sum()) for _, l in shapes)
    rng = np.random.default_rng(0)
    rows: list[BenchRow] = []
    peer: dict[str, float] = {}
    for fmt in formats:
        print(f"  generating a {max_rows}-row {fmt} cache...", file=sys.stderr, flush=True)
        dec = Decoder(fmt, BENCH_SM_SCALE, device=device, max_batch=max(l.shape[0] for _, l in shapes),
                      q_precision=q_precision)
        kv = random_cache(max_rows, fmt, rng, fp8_variant=dec.fp8_variant)
        stride = kv.scales.shape[1] if fmt == "mxfp4" else 0
        for name, lens in shapes:
            b = lens.shape[0]
            q, bufs, extra = lens_step(kv, lens, page_size, rng)

            def call():
                dec.run(**bufs, **extra)

            hot = timer.time(call, iters, flush=False)
            cold = timer.time(call, iters, flush=True)
            views = fresh_views(bufs, 300)
            host_same, host_views, host_raw = host_figures(dec, bufs, extra, views)
            host_ref = host_reference_us()
            items = schedule(lens, dec.policy)
            n_slots = int((items.n_items > 1).sum())
            moved = bytes_moved(fmt, int(lens.sum()), b, stride, n_slots, page_size=page_size)
            med = statistics.median(cold)
            gbs = moved / (med * 1e-6) / 1e9
            row = BenchRow(dec._split.symbol, fmt, name, b, int(lens.sum()), items.size, n_slots, moved,
                           statistics.median(hot), min(hot), med, min(cold), gbs, 100 * gbs / peak,
                           100 * gbs / copy_gbs, None if read is None else 100 * gbs / read,
                           host_same, host_views, host_raw, page_size, host_ref)
            rows.append(row)
            print(f"  {fmt:>5} {name:>10}: {med:9.1f} us flushed, {gbs:7.0f} GB/s "
                  f"({row.pct_peak:.1f}% of peak), host {host_same:.1f} / {host_views:.1f} / {host_raw:.1f} us "
                  f"(same / views / raw)", file=sys.stderr, flush=True)
            if with_torch and fmt == "bf16" and name not in peer:
                t = torch_peer(q, kv.data, lens, timer, max(iters // 2, 5))
                if t is not None:
                    peer[name] = t
            del views
            for a in bufs.values():
                if a is not None:
                    a.free()
        dec.close()
    print_table(rows, peer)
    if out_dir is not None:
        write_files(rows, peer, out_dir, info, copy_gbs, peak, read, peak_from, q_precision)
    return rows


def print_table(rows: list[BenchRow], peer: dict[str, float]) -> None:
    head = (f"{'kv':>5} {'shape':>10} {'tokens':>8} {'items':>5} {'MB':>8} {'med_us':>9} {'min_us':>9} "
            f"{'L2cold_us':>9} {'GB/s':>6} {'%peak':>6} {'%copy':>6} {'%read':>6} {'host_same':>9} {'host_views':>10} "
            f"{'host_raw':>8} {'host_ref':>8} {'torch_bf16_us':>13} {'speedup':>7}")
    print(head)
    for r in rows:
        t = peer.get(r.shape)
        extra = f"{t:13.1f} {t / r.flushed_median_us:7.2f}" if t is not None else f"{'-':>13} {'-':>7}"
        print(f"{r.kv_format:>5} {r.shape:>10} {r.tokens:>8} {r.n_work:>5} {r.bytes_moved / 1e6:8.1f} "
              f"{r.median_us:9.1f} {r.min_us:9.1f} {r.flushed_median_us:9.1f} {r.gbs:6.0f} "
              f"{r.pct_peak:6.1f} {r.pct_copy:6.1f} {'-' if r.pct_read is None else f'{r.pct_read:.1f}':>6} "
              f"{r.host_us:9.1f} {r.host_views_us:10.1f} "
              f"{r.host_raw_us:8.1f} {'-' if r.host_ref_us is None else f'{r.host_ref_us:.1f}':>8} {extra}")


def write_files(rows, peer, out_dir: Path, info, copy_gbs: float, peak: float, read: float | None = None,
                peak_from: str = "datasheet", q_precision: str = "bf16") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": info.name, "arch": info.arch,
            "commit": git_commit(), "peak_gbs": peak, "peak_from": peak_from, "copy_gbs": copy_gbs, "read_gbs": read,
            "q_precision": q_precision, "torch_bf16_us": peer}
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with open(out_dir / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
