"""What a benchmark run measures beside the decoder: the device's ceilings (its datasheet
peak, a device-to-device copy, a read-only stream, a bf16 matmul) and the commit measured.

Each run measures its own ceilings, so a % in its table is against the machine as it ran:
machines of one kind differ by several percent from day to day.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path

from hipmla import runtime

#: Datasheet peak HBM bandwidth, GB/s, by a part of the device's name, the first match in
#: this order: one arch spans parts of different memories (sm_90: the H100 SXM's 3.35 TB/s
#: HBM3, the H200's 4.8 TB/s HBM3e; gfx942: MI300X 5.3, MI325X 6.0), so the arch alone
#: does not say it. None: a name with memories of several sizes (the GH200 comes with
#: HBM3 or HBM3e), whose driver figure is quoted instead.
PEAK_GBS_BY_NAME: tuple[tuple[str, float | None], ...] = (
    ("MI355X", 8000.0), ("MI350X", 8000.0), ("MI325X", 6000.0), ("MI300X", 5300.0),
    ("GH200", None), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))
#: ... by arch, for a name that says no part (ROCm may report a marketing name or none).
PEAK_GBS_BY_ARCH = {"gfx950": 8000.0, "gfx942": 5300.0}


def datasheet_peak_gbs(name: str, arch: str, device_gbs: float) -> tuple[float, str]:
    """The peak HBM bandwidth to quote for the device, and where it comes from: the
    datasheet's where PEAK_GBS_BY_NAME knows the part or PEAK_GBS_BY_ARCH the arch, else
    ``device_gbs`` (memory clock x bus width, as the driver reports them)."""
    driver = device_gbs, "memory clock x bus width"
    for key, gbs in PEAK_GBS_BY_NAME:
        if key in name:
            return driver if gbs is None else (gbs, "datasheet")
    if arch in PEAK_GBS_BY_ARCH:
        return PEAK_GBS_BY_ARCH[arch], "datasheet"
    return driver


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


def torch_gpu():
    """torch, where it is importable and sees a GPU, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_median_us(torch, fn, iters: int, before=None) -> float:
    """Median device time (us, CUDA events) of ``fn`` over ``iters`` calls after one
    warm-up call; ``before`` (an L2 flush, say) runs ahead of each call, outside the
    timed span."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def read_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float | None:
    """Read bandwidth of the device: ``torch.sum`` over a ``nbytes`` float32 tensor (many
    times the L2), median of ``iters``; a decode step reads, so this, not the copy, is
    its ceiling. None where torch or its GPU is not there."""
    torch = torch_gpu()
    if torch is None:
        return None
    x = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    us = torch_median_us(torch, x.sum, iters)
    del x
    torch.cuda.empty_cache()
    return nbytes / (us * 1e-6) / 1e9


def _matmul_us(torch, n: int, iters: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return torch_median_us(torch, lambda: a @ b, iters)


def matmul_tflops(n: int = 8192, iters: int = 10) -> float | None:
    """Dense bf16 tensor-core rate of the device, measured: ``torch.matmul`` of two
    ``n x n`` bf16 matrices, median of ``iters``. None without torch or its GPU."""
    torch = torch_gpu()
    if torch is None:
        return None
    us = _matmul_us(torch, n, iters)  # its matrices are gone when it returns
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def git_commit() -> str:
    """The commit being measured: $HIPMLA_COMMIT (for copies without .git), else git's,
    with "-dirty" where tracked files differ from it (a copy whose git metadata lags its
    files says so instead of naming a commit it does not hold)."""
    if os.environ.get("HIPMLA_COMMIT"):
        return os.environ["HIPMLA_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
