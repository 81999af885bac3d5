"""``python -m hipmla bench``: device time per decode call, relative to memory bandwidth.

For each KV format and shape: median and min device time (events) over many calls,
with and without an L2 flush before each call; achieved GB/s from the bytes the call
must move (KV rows, Q, output, LSE, split partials written and read back, work list);
that as a % of the device's datasheet peak and of a device-to-device copy measured in
the same run; and the host time of one ``Decoder.run`` (the Python launch path).
Where torch is importable, a straightforward torch bf16 decode on the same inputs is
timed the same way, for a peer comparison.

Inputs are N(0,1) Q and random codes for the cache (``inputs.random_cache``): the
kernels do the same work on any codes, and generating 2M quantized N(0,1) rows per
format would dominate the run.
"""

from __future__ import annotations

import argparse
import csv
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
from hipmla.plan import indptr_from_lengths

#: Datasheet peak HBM bandwidth, GB/s (MI355X, MI300X, H200 SXM).
PEAK_GBS = {"gfx950": 8000.0, "gfx942": 5300.0, "sm_90": 4800.0}


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
    host_us: float


def ragged_mixes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(6)
    return {
        "rag64": rng.integers(0, 16385, size=64),
        "rag300": rng.integers(0, 8193, size=300),
        "long+short": np.array([32768] * 4 + [500] * 60),
    }


def bytes_moved(kv_format: str, tokens: int, batch: int, scale_stride: int, n_work: int,
                n_slots: int, heads: int = 16) -> int:
    per_token = {"bf16": 1152, "fp8": 576, "mxfp4": 288 + scale_stride}[kv_format]
    q = batch * heads * 576 * 2
    out = batch * heads * (512 * 2 + 4)
    partials = 2 * n_slots * heads * (512 + 2) * 4
    meta = n_work * 16 + (batch + 1) * 8
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


def host_overhead_us(fn, calls: int = 300) -> float:
    """Median CPU time of one call of ``fn`` (launches only; the queue drains every 50)."""
    samples = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        if i % 50 == 49:
            runtime.synchronize()
    runtime.synchronize()
    return statistics.median(samples)


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


def run_bench(formats, iters: int, device: int, with_torch: bool, out_dir: Path | None,
              only: set[str] | None = None) -> list[BenchRow]:
    info = runtime.device_info(device)
    timer = Timer(info.l2_bytes)
    copy_gbs = timer.copy_gbs()
    peak = PEAK_GBS.get(info.arch, info.peak_bandwidth_gbs)
    print(f"hipmla bench: {info.name} ({info.arch}, {info.num_cus} CUs), peak {peak:.0f} GB/s "
          f"(datasheet), measured device copy {copy_gbs:.0f} GB/s, commit {git_commit()}", flush=True)
    shapes = [(s.name, s.seq_lens) for s in benchmark_shapes()] + list(ragged_mixes().items())
    if only:
        shapes = [(n, l) for n, l in shapes if n in only]
    max_rows = max(int(l.sum()) for _, l in shapes)
    rng = np.random.default_rng(0)
    rows: list[BenchRow] = []
    peer: dict[str, float] = {}
    for fmt in formats:
        print(f"  generating a {max_rows}-row {fmt} cache...", file=sys.stderr, flush=True)
        dec = Decoder(fmt, BENCH_SM_SCALE, device=device)
        kv = random_cache(max_rows, fmt, rng, fp8_variant=dec.fp8_variant)
        d_kv = runtime.DeviceArray.from_host(kv.data)
        d_sc = runtime.DeviceArray.from_host(kv.scales) if fmt == "mxfp4" else None
        stride = kv.scales.shape[1] if fmt == "mxfp4" else 0
        for name, lens in shapes:
            b = lens.shape[0]
            q = rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
            d_q = runtime.DeviceArray.from_host(q.view(np.uint16))
            d_ind = runtime.DeviceArray.from_host(indptr_from_lengths(lens))
            d_out = runtime.DeviceArray((b, 16, 512), np.uint16)
            d_lse = runtime.DeviceArray((b, 16), np.float32)
            plan = dec.plan(lens)

            def call():
                dec.run(plan, d_q, d_kv, d_ind, d_out, kv_scale=d_sc, lse=d_lse,
                        fp8_scale=kv.fp8_scale if fmt == "fp8" else None)

            hot = timer.time(call, iters, flush=False)
            cold = timer.time(call, iters, flush=True)
            host = host_overhead_us(call)
            moved = bytes_moved(fmt, int(lens.sum()), b, stride, plan.plan.n_work, plan.plan.n_slots)
            med = statistics.median(cold)
            gbs = moved / (med * 1e-6) / 1e9
            row = BenchRow(dec._split.symbol, fmt, name, b, int(lens.sum()), plan.plan.n_work,
                           plan.plan.n_slots, moved, statistics.median(hot), min(hot), med, min(cold),
                           gbs, 100 * gbs / peak, 100 * gbs / copy_gbs, host)
            rows.append(row)
            print(f"  {fmt:>5} {name:>10}: {med:9.1f} us flushed, {gbs:7.0f} GB/s "
                  f"({row.pct_peak:.1f}% of peak), host {host:.1f} us", file=sys.stderr, flush=True)
            if with_torch and fmt == "bf16" and name not in peer:
                t = torch_peer(q, kv.data, lens, timer, max(iters // 2, 5))
                if t is not None:
                    peer[name] = t
            dec.release(plan)
            for a in (d_q, d_ind, d_out, d_lse):
                a.free()
        d_kv.free()
        if d_sc is not None:
            d_sc.free()
        dec.close()
    print_table(rows, peer)
    if out_dir is not None:
        write_files(rows, peer, out_dir, info, copy_gbs, peak)
    return rows


def print_table(rows: list[BenchRow], peer: dict[str, float]) -> None:
    head = (f"{'kv':>5} {'shape':>10} {'tokens':>8} {'items':>5} {'MB':>8} {'med_us':>9} {'min_us':>9} "
            f"{'L2cold_us':>9} {'GB/s':>6} {'%peak':>6} {'%copy':>6} {'host_us':>7} {'torch_bf16_us':>13} {'speedup':>7}")
    print(head)
    for r in rows:
        t = peer.get(r.shape)
        extra = f"{t:13.1f} {t / r.flushed_median_us:7.2f}" if t is not None else f"{'-':>13} {'-':>7}"
        print(f"{r.kv_format:>5} {r.shape:>10} {r.tokens:>8} {r.n_work:>5} {r.bytes_moved / 1e6:8.1f} "
              f"{r.median_us:9.1f} {r.min_us:9.1f} {r.flushed_median_us:9.1f} {r.gbs:6.0f} "
              f"{r.pct_peak:6.1f} {r.pct_copy:6.1f} {r.host_us:7.1f} {extra}")


def write_files(rows, peer, out_dir: Path, info, copy_gbs: float, peak: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": info.name, "arch": info.arch,
            "commit": git_commit(), "peak_gbs": peak, "copy_gbs": copy_gbs, "torch_bf16_us": peer}
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with open(out_dir / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hipmla bench")
    p.add_argument("--format", default="all", choices=KV_FORMATS + ("all",))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--no-torch", action="store_true", help="skip the torch bf16 peer comparison")
    p.add_argument("--shapes", default=None,
                   help="comma-separated subset, e.g. 4x1k,256x8k,rag64 (default: all)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench.json and bench.csv")
    a = p.parse_args(argv)
    if not runtime.available():
        print("hipmla bench: no GPU reachable through hip-python", file=sys.stderr)
        return 2
    formats = KV_FORMATS if a.format == "all" else (a.format,)
    known = [s.name for s in benchmark_shapes()] + list(ragged_mixes())
    only = set(a.shapes.split(",")) if a.shapes else None
    if only and not only <= set(known):
        p.error(f"--shapes: unknown {sorted(only - set(known))}; known: {', '.join(known)}")
    run_bench(formats, a.iters, a.device, not a.no_torch, a.out, only)
    return 0
