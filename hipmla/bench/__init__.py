"""``python -m hipmla bench``: device time per decode call, relative to memory bandwidth.

The package: ``probes`` (the device's ceilings, measured in the run), ``steps`` (the steps
timed and the bytes they move), ``host`` (a step's host time), ``peer`` (the torch bf16
decode), ``decode`` (the bench and its table), ``mtp`` (several heads / query tokens).

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
import json
import sys

from hipmla.bench.decode import BenchRow, print_table, run_bench, write_files
from hipmla.bench.host import c_noop_launch, fresh_views, host_figures, host_overhead_us, host_reference_us
from hipmla.bench.mtp import MTP_BATCHES, MTP_CASES, MTP_KV_LEN, mtp_flops, run_mtp_bench
from hipmla.bench.peer import torch_peer
from hipmla.bench.probes import (PEAK_GBS_BY_ARCH, PEAK_GBS_BY_NAME, Timer, datasheet_peak_gbs, git_commit,
                                 matmul_tflops, read_gbs)
from hipmla.bench.steps import bytes_moved, device_step, lens_step, ragged_mixes
from hipmla.cli import gpu_count, int_at_least
from hipmla.emulate import Q_PRECISIONS
from hipmla.formats import KV_FORMATS
from hipmla.inputs import benchmark_shapes
from hipmla.validate import folder_arg

__all__ = ["BenchRow", "MTP_BATCHES", "MTP_CASES", "MTP_KV_LEN", "PEAK_GBS_BY_ARCH", "PEAK_GBS_BY_NAME", "Timer",
           "bytes_moved", "c_noop_launch", "datasheet_peak_gbs", "device_step", "fresh_views", "git_commit",
           "host_figures", "host_overhead_us", "host_reference_us", "lens_step", "main", "matmul_tflops",
           "mtp_flops", "print_table", "ragged_mixes", "read_gbs", "run_bench", "run_mtp_bench", "torch_peer",
           "write_files"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hipmla bench")
    p.add_argument("--format", default="all", choices=KV_FORMATS + ("all",))
    p.add_argument("--iters", type=int_at_least(1), default=100)
    p.add_argument("--device", type=int_at_least(0), default=0, metavar="N", help="device index (default 0)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch bf16 peer comparison")
    p.add_argument("--shapes", default=None,
                   help="comma-separated subset, e.g. 4x1k,256x8k,rag64 (default: all)")
    p.add_argument("--out", type=folder_arg, default=None, help="folder for bench.json and bench.csv")
    p.add_argument("--page-size", type=int, default=0,
                   help="0: contiguous cache (default); 1..128 (a power of two): a paged cache, pages in random order")
    p.add_argument("--q-precision", default="auto", choices=("auto",) + Q_PRECISIONS,
                   help="Q as the decoder takes it (auto: its default, bf16)")
    p.add_argument("--mtp", action="store_true",
                   help="instead: 128 heads x 1 query token, 16 heads x 4 tokens, 8 heads x 1 and 2, 4 x 4, ... "
                        "at bs 32/128 x 8k "
                        "(TFLOP/s against a bf16 matmul measured in the same run)")
    a = p.parse_args(argv)
    if a.mtp:  # its own cases (MTP_CASES): the options of the shape bench would be ignored
        given = [flag for flag, on in (("--shapes", a.shapes), ("--page-size", a.page_size),
                                       ("--q-precision", a.q_precision != "auto"), ("--no-torch", a.no_torch)) if on]
        if given:
            p.error(f"--mtp times its own cases (bf16 Q, contiguous cache, a bf16 matmul as the peer); "
                    f"{', '.join(given)} would be ignored")
    # The arguments first, then the platform and the device: a typo is named on any machine.
    known = [s.name for s in benchmark_shapes()] + list(ragged_mixes())
    only = {s.strip() for s in a.shapes.split(",") if s.strip()} if a.shapes else None  # as check reads it
    if only and not only <= set(known):
        p.error(f"--shapes: unknown {sorted(only - set(known))}; known: {', '.join(known)}")
    if a.page_size and a.page_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        p.error(f"--page-size: expected 0 or a power of two in 1..128, got {a.page_size}")
    if a.out is not None and a.out.exists() and not a.out.is_dir():  # before the run, not after it
        p.error(f"--out: {str(a.out)!r} is a file; expected a folder (made if missing)")
    count, reason = gpu_count("bench")  # exits on a bad HIPMLA_PLATFORM: an error, not "no GPU"
    if count == 0:
        print(f"hipmla bench: no GPU reachable through hip-python ({reason})", file=sys.stderr)
        return 2
    formats = KV_FORMATS if a.format == "all" else (a.format,)
    if a.mtp:
        rows = run_mtp_bench(formats, a.iters, a.device)
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "bench_mtp.json").write_text(json.dumps(rows, indent=1))
        return 0
    run_bench(formats, a.iters, a.device, not a.no_torch, a.out, only, a.page_size, a.q_precision)
    return 0
