"""``python -m hipmla bench``: device time per decode call, relative to memory bandwidth.

For each KV format and shape: median and min device time (events) over many calls,
with and without an L2 flush before each call; achieved GB/s from the bytes the call
must move (KV rows, Q, output, LSE, split partials written and read back, work list);
that as a % of the device's datasheet peak and of a device-to-device copy measured in
the same run; and the host time of one ``Decoder.run`` — a whole serving step, since the
split is scheduled inside the decode launch — three ways: the same buffer objects every
step, new views of the same buffers every step (torch tensors where torch is there,
else new interface objects), and raw addresses.
Where torch is importable, a straightforward torch bf16 decode on the same inputs is
timed the same way, for a peer comparison.

Inputs are N(0,1) Q and random codes for the cache (``inputs.random_cache``): the
kernels do the same work on any codes, and generating 2M quantized N(0,1) rows per
format would dominate the run.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from hipmla import runtime
from hipmla.decode import Decoder
from hipmla.formats import KV_FORMATS
from hipmla.inputs import BENCH_SM_SCALE, benchmark_shapes, random_cache
from hipmla.paging import KvLayout, random_page_table, scatter
from hipmla.schedule import schedule

#: Datasheet peak HBM bandwidth, GB/s, by a part of the device's name: one arch spans
#: parts of different memories (sm_90: the H100 SXM's 3.35 TB/s HBM3, the H200's 4.8 TB/s
#: HBM3e; gfx942: MI300X 5.3, MI325X 6.0), so the arch alone does not say it.
PEAK_GBS = (("MI355X", 8000.0), ("MI350X", 8000.0), ("MI325X", 6000.0), ("MI300X", 5300.0),
            ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))
#: ... by arch, for a name that says no part (ROCm may report a marketing name or none).
PEAK_GBS_BY_ARCH = {"gfx950": 8000.0, "gfx942": 5300.0}


def datasheet_peak_gbs(name: str, arch: str, device_gbs: float) -> tuple[float, str]:
    """The peak HBM bandwidth to quote for the device, and where it comes from: the
    datasheet's where PEAK_GBS knows the part (the first key in ``name``) or
    PEAK_GBS_BY_ARCH the arch, else ``device_gbs`` (memory clock x bus width, as the
    driver reports them)."""
    for key, gbs in PEAK_GBS:
        if key in name:
            return gbs, "datasheet"
    if arch in PEAK_GBS_BY_ARCH:
        return PEAK_GBS_BY_ARCH[arch], "datasheet"
    return device_gbs, "memory clock x bus width"


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


def ragged_mixes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(6)
    return {
        "rag64": rng.integers(0, 16385, size=64),
        "rag300": rng.integers(0, 8193, size=300),
        "long+short": np.array([32768] * 4 + [500] * 60),
    }


def bytes_moved(kv_format: str, tokens: int, batch: int, scale_stride: int, n_slots: int,
                heads: int = 16, page_size: int = 0) -> int:
    """What a step must move: KV rows, Q, output + LSE, partials written and read back,
    the lengths (and page table) every block reads."""
    per_token = {"bf16": 1152, "fp8": 576, "mxfp4": 288 + scale_stride}[kv_format]
    q = batch * heads * 576 * 2
    out = batch * heads * (512 * 2 + 4)
    partials = 2 * n_slots * heads * (512 + 2) * 4
    meta = (batch + 1) * 4 + (batch * 4 + -(-tokens // page_size) * 4 if page_size else 0)
    return tokens * per_token + q + out + partials + meta


class Timer:
    """Device time of a callable on the null stream, with an optional L2 flush first."""

    def __init__(self, l2_bytes: int):
        self.flush_buf = runtime.alloc(max(4 * l2_bytes, 256 << 20))
        self.start, self.end = runtime.Event(), runtime.Event()

    def time(self, fn, iters: int, flush: bool) -> list[float]:
        fn()
        runtime.synchronize()
        times = []
        for _ in range(iters):
            if flush:
                runtime.memset(self.flush_buf.ptr, 0, self.flush_buf.nbytes)
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(self.start.elapsed_ms(self.end) * 1e3)
        return times

    def copy_gbs(self) -> float:
        """Device-to-device copy bandwidth (bytes read + written)."""
        n = self.flush_buf.nbytes // 2
        t = self.time(lambda: runtime.copy_dtod(self.flush_buf.ptr + n, self.flush_buf.ptr, n), 20, False)
        return 2 * n / (statistics.median(t) * 1e-6) / 1e9


def read_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float | None:
    """Read bandwidth of the device: ``torch.sum`` over a ``nbytes`` float32 tensor (many
    times the L2), median of ``iters``; a decode step reads, so this, not the copy, is
    its ceiling. None where torch or its GPU is not there."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x.sum()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start.record()
        x.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del x
    torch.cuda.empty_cache()
    return nbytes / (statistics.median(times) * 1e-6) / 1e9


#: Rounds of host timing: the figure is the least of their medians.
HOST_ROUNDS = 5


def host_overhead_us(fn, calls: int = 300, args=None, rounds: int = HOST_ROUNDS) -> float:
    """CPU time of one call of ``fn`` (launches only; the queue drains every 50): the
    least of ``rounds`` medians of ``calls`` calls. A round that another process or a
    clock change disturbed has a higher median; the least is what the code costs (the
    H200 machine's single-round medians of one bench run spread from 6 to 15 us).
    With ``args``, call ``i`` of a round is ``fn(args[i])`` (argument objects made before
    timing, ``calls`` of them)."""
    medians = []
    for _ in range(rounds):
        samples = []
        for i in range(calls):
            a = None if args is None else args[i]
            t0 = time.perf_counter_ns()
            fn() if args is None else fn(a)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if i % 50 == 49:
                runtime.synchronize()
        runtime.synchronize()
        medians.append(statistics.median(samples))
    return min(medians)


def c_noop_launch():
    """A ctypes call of a C function that does nothing, with a launch's 11 ready-made
    arguments: the floor of any launch from Python, for comparison with the real one."""
    noop = ctypes.CDLL(None).labs  # C labs: reads its first argument, ignores the rest
    noop.restype = ctypes.c_long
    u = ctypes.c_uint
    args = (ctypes.c_void_p(0), u(1), u(1), u(1), u(256), u(1), u(1), u(0), ctypes.c_void_p(0), None,
            ctypes.c_void_p(0))
    return lambda: noop(*args)


def host_reference_us(calls: int = 300, rounds: int = HOST_ROUNDS) -> float:
    """:func:`host_overhead_us` of :func:`c_noop_launch`. The H200 machine's CPU runs it
    in 1.0 us at times and 2.2 us at others, and every host figure moves with it; the
    bench prints it beside them."""
    return host_overhead_us(c_noop_launch(), calls, rounds=rounds)


def host_figures(dec: Decoder, bufs: dict, extra: dict, views: list[dict], calls: int = 300,
                 rounds: int = HOST_ROUNDS) -> tuple[float, float, float]:
    """Host time (us, :func:`host_overhead_us`) of one ``dec.run`` three ways: the same
    ``bufs`` objects every step, ``views[i]`` (new objects over the same buffers) at step
    ``i``, and raw addresses (with the ``batch`` and ``kv_scale_stride`` a raw q and scale need). ``bufs`` are
    :class:`runtime.DeviceArray` s by ``run`` keyword; ``extra`` the other keywords."""
    scale = bufs.get("kv_scale")
    raw = {k: (v.ptr if v is not None else None) for k, v in bufs.items()}
    raw.update(batch=bufs["q"].shape[0], kv_scale_stride=None if scale is None else scale.shape[1])

    def call(args=bufs):
        dec.run(**args, **extra)

    def call_raw():
        dec.run(**raw, **extra)

    return (host_overhead_us(call, calls, rounds=rounds),
            host_overhead_us(call, calls, args=views, rounds=rounds),
            host_overhead_us(call_raw, calls, rounds=rounds))


class _View:
    """A new interface object over the same memory, as a caller without torch makes."""

    def __init__(self, arr):
        self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__)


def fresh_views(bufs: dict, calls: int) -> list[dict]:
    """``calls`` sets of new views of the same device buffers: torch tensors over them
    where torch is importable (what a torch-based caller passes each step), else new
    interface objects."""
    try:
        import torch

        made = {k: torch.as_tensor(v, device="cuda") for k, v in bufs.items() if v is not None}
        return [{k: (made[k].view(made[k].shape) if k in made else None) for k in bufs}
                for _ in range(calls)]
    except (ImportError, RuntimeError, TypeError):
        return [{k: (_View(v) if v is not None else None) for k, v in bufs.items()} for _ in range(calls)]


def torch_peer(q_np: np.ndarray, kv_bits: np.ndarray, lens: np.ndarray, timer: Timer, iters: int):
    """Median flushed time (us) of a plain torch bf16 decode, or None without torch/uniform lengths."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or len(set(lens.tolist())) != 1:
        return None
    b, L = lens.shape[0], int(lens[0])
    dev = torch.device("cuda")
    q = torch.from_numpy(q_np.view(np.int16)).to(dev).view(torch.bfloat16)
    kv = torch.from_numpy(kv_bits[: b * L].view(np.int16)).to(dev).view(torch.bfloat16).view(b, L, 576)
    v = kv[..., :512]

    def run():
        s = torch.bmm(q, kv.transpose(1, 2)).float() * BENCH_SM_SCALE
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        return torch.bmm(p, v)

    flush = torch.empty(timer.flush_buf.nbytes, dtype=torch.uint8, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.zero_()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def git_commit() -> str:
    """The commit being measured: $HIPMLA_COMMIT (for copies without .git), else git's."""
    if os.environ.get("HIPMLA_COMMIT"):
        return os.environ["HIPMLA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def device_step(cache, layout: KvLayout, rng: np.random.Generator):
    """One decode step's device buffers for ``cache`` read through ``layout``: random bf16 Q
    (N(0, 1)), the cache and its layout uploaded, output and LSE allocated. Returns the
    host Q, the buffers (``Decoder.run``'s keyword arguments) and the other arguments."""
    b = layout.batch
    q = rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    host = {"q": q.view(np.uint16), "kv": cache.data, "kv_indptr": layout.kv_indptr,
            "kv_indices": layout.kv_indices, "kv_last_page_len": layout.kv_last_page_len,
            "kv_scale": cache.scales}
    bufs = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) if v is not None else None
            for k, v in host.items()}
    bufs["out"] = runtime.DeviceArray((b, 16, 512), np.uint16)
    bufs["lse"] = runtime.DeviceArray((b, 16), np.float32)
    extra = dict(page_size=layout.page_size, fp8_scale=cache.fp8_scale if cache.format == "fp8" else None)
    return q, bufs, extra


def lens_step(kv, lens, page_size: int, rng: np.random.Generator):
    """:func:`device_step` for sequences of ``lens`` tokens read from the front of ``kv``:
    contiguous rows (``page_size`` 0), or ``kv`` scattered into pages of ``page_size`` rows
    in random order. Returns what :func:`device_step` returns."""
    layout = random_page_table(lens, page_size, rng) if page_size else KvLayout.contiguous(lens)
    return device_step(scatter(kv, layout) if page_size else kv, layout, rng)


def run_bench(formats, iters: int, device: int, with_torch: bool, out_dir: Path | None,
              only: set[str] | None = None, page_size: int = 0) -> list[BenchRow]:
    info = runtime.device_info(device)
    timer = Timer(info.l2_bytes)
    copy_gbs = timer.copy_gbs()
    read = read_gbs()
    peak, peak_from = datasheet_peak_gbs(info.name, info.arch, info.peak_bandwidth_gbs)
    layout_name = f"paged, {page_size} rows a page, pages in random order" if page_size else "contiguous rows"
    print(f"hipmla bench: {info.name} ({info.arch}, {info.num_cus} CUs), peak {peak:.0f} GB/s "
          f"({peak_from}), measured device copy {copy_gbs:.0f} GB/s, read "
          f"{'-' if read is None else f'{read:.0f}'} GB/s, cache {layout_name}, "
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
        dec = Decoder(fmt, BENCH_SM_SCALE, device=device, max_batch=max(l.shape[0] for _, l in shapes))
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
        write_files(rows, peer, out_dir, info, copy_gbs, peak, read)
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


def write_files(rows, peer, out_dir: Path, info, copy_gbs: float, peak: float, read: float | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": info.name, "arch": info.arch,
            "commit": git_commit(), "peak_gbs": peak, "copy_gbs": copy_gbs, "read_gbs": read,
            "torch_bf16_us": peer}
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with open(out_dir / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


#: The issue's rows for several heads / query tokens: (heads, query tokens per sequence).
MTP_CASES = ((128, 1), (16, 4))
MTP_BATCHES = (32, 128)
MTP_KV_LEN = 8192


def matmul_tflops(n: int = 8192, iters: int = 10) -> float | None:
    """Dense bf16 tensor-core rate of the device, measured: ``torch.matmul`` of two
    ``n x n`` bf16 matrices, median of ``iters``. None without torch or its GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / statistics.median(times) / 1e12


def mtp_flops(heads: int, seen_tokens: int) -> int:
    """FLOP of a step: a multiply-add per Q.K column (576) and P.V column (512) of every
    score; ``seen_tokens`` sums the kv tokens each query token sees."""
    return 2 * heads * seen_tokens * (576 + 512)


def run_mtp_bench(formats, iters: int, device: int) -> list[dict]:
    """µs (L2 flushed), TFLOP/s with % of the measured bf16 matmul rate, and GB/s of the
    unique bytes with % of the measured read bandwidth, for MTP_CASES x MTP_BATCHES."""
    info = runtime.device_info(device)
    timer = Timer(info.l2_bytes)
    read, mma = read_gbs(), matmul_tflops()
    print(f"hipmla bench --mtp: {info.name} ({info.arch}), read {'-' if read is None else f'{read:.0f}'} GB/s, "
          f"bf16 matmul {'-' if mma is None else f'{mma:.0f}'} TFLOP/s (both measured now), commit {git_commit()}",
          flush=True)
    rng = np.random.default_rng(0)
    out_rows = []
    print(f"{'kv':>5} {'heads':>5} {'q/seq':>5} {'bs':>4} {'med_us':>9} {'TFLOP/s':>8} {'%mma':>6} "
          f"{'GB/s':>7} {'%read':>6}  kernel")
    for fmt in formats:
        kv = random_cache(max(MTP_BATCHES) * MTP_KV_LEN, fmt, rng)
        stride = kv.scales.shape[1] if fmt == "mxfp4" else 0
        for heads, n in MTP_CASES:
            for b in MTP_BATCHES:
                lens = np.full(b, MTP_KV_LEN)
                t_q = b * n
                layout = KvLayout.contiguous(lens)
                qo = np.arange(0, t_q + 1, n, dtype=np.int32)
                dec = Decoder(fmt, BENCH_SM_SCALE, heads=heads, device=device, max_batch=b, max_q_tokens=t_q)
                q = rng.standard_normal((t_q, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
                host = {"q": q.view(np.uint16), "kv": kv.data, "kv_indptr": layout.kv_indptr.astype(np.int32),
                        "qo_indptr": qo, "kv_scale": kv.scales}
                bufs = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) if v is not None else None
                        for k, v in host.items()}
                bufs["out"] = runtime.DeviceArray((t_q, heads, 512), np.uint16)
                extra = dict(fp8_scale=kv.fp8_scale if fmt == "fp8" else None)
                med = statistics.median(timer.time(lambda: dec.run(**bufs, **extra), iters, flush=True))
                seen = int(sum(MTP_KV_LEN - n + j + 1 for j in range(n))) * b
                tflops = mtp_flops(heads, seen) / (med * 1e-6) / 1e12
                moved = bytes_moved(fmt, int(lens.sum()), t_q, stride, 0, heads=heads)
                gbs = moved / (med * 1e-6) / 1e9
                row = dict(kv=fmt, heads=heads, q_per_seq=n, batch=b, kv_len=MTP_KV_LEN, med_us=med,
                           tflops=tflops, pct_mma=None if mma is None else 100 * tflops / mma,
                           gbs=gbs, pct_read=None if read is None else 100 * gbs / read, kernel=dec.kernel_symbol)
                out_rows.append(row)
                pct_mma = "-" if mma is None else f"{row['pct_mma']:.1f}"
                pct_read = "-" if read is None else f"{row['pct_read']:.1f}"
                print(f"{fmt:>5} {heads:>5} {n:>5} {b:>4} {med:9.1f} {tflops:8.1f} {pct_mma:>6} {gbs:7.0f} "
                      f"{pct_read:>6}  {dec.kernel_symbol}", flush=True)
                for a in bufs.values():
                    if a is not None:
                        a.free()
                dec.close()
    return out_rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hipmla bench")
    p.add_argument("--format", default="all", choices=KV_FORMATS + ("all",))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--no-torch", action="store_true", help="skip the torch bf16 peer comparison")
    p.add_argument("--shapes", default=None,
                   help="comma-separated subset, e.g. 4x1k,256x8k,rag64 (default: all)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench.json and bench.csv")
    p.add_argument("--page-size", type=int, default=0,
                   help="0: contiguous cache (default); 1..128 (a power of two): a paged cache, pages in random order")
    p.add_argument("--mtp", action="store_true",
                   help="instead: 128 heads x 1 query token and 16 heads x 4 tokens at bs 32/128 x 8k "
                        "(TFLOP/s against a bf16 matmul measured in the same run)")
    a = p.parse_args(argv)
    if not runtime.available():
        print("hipmla bench: no GPU reachable through hip-python", file=sys.stderr)
        return 2
    formats = KV_FORMATS if a.format == "all" else (a.format,)
    known = [s.name for s in benchmark_shapes()] + list(ragged_mixes())
    only = set(a.shapes.split(",")) if a.shapes else None
    if only and not only <= set(known):
        p.error(f"--shapes: unknown {sorted(only - set(known))}; known: {', '.join(known)}")
    if a.page_size and a.page_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        p.error(f"--page-size: expected 0 or a power of two in 1..128, got {a.page_size}")
    if a.mtp:
        rows = run_mtp_bench(formats, a.iters, a.device)
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "bench_mtp.json").write_text(json.dumps(rows, indent=1))
        return 0
    run_bench(formats, a.iters, a.device, not a.no_torch, a.out, only, a.page_size)
    return 0
