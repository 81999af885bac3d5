#!/usr/bin/env python3
"""Feasibility probe: a split row's hand-off through a thread-block cluster on sm_90, timed.

Not a library kernel. At short shapes the sm_90 kernel's items spend ~4.4 us after their
last tile (MXFP4 4 x 1k, scripts/results/h200-2026-12-04-sm90-timeline-placement.txt:
stored +1.25, arrived +1.39, merge +1.79 us): the partial goes to global memory, a release
fence and an atomic counter hand it over, and the row's items read it back from L2.
``scripts/sm90_cluster_probe.cu`` times that hand-off alone against one through
distributed shared memory, the row's items being one cluster: the same merge sums, read
from the siblings' shared memory after a cluster barrier. Grid = rows x items blocks,
each block holding a fixed partial; modes (PROBE_MODE): 0 no hand-off (each block writes
an output: launch, block start, one store), 1 the library's (core/merge.h, the code the
decoder runs), 2 the cluster's, 3 the library's in blocks launched as clusters (what a
kernel launched so pays for rows that do not fit a cluster). Modes 1, 2 and 3 must write
the same bytes (checked).

    python3 scripts/sm90_cluster_probe.py [--shapes 4x8,4x16,16x8,32x4,32x8,64x4] [--iters 50] [--shared 67840]

``--shared``: dynamic shared memory a block (default: the MXFP4 kernel's, two blocks an
SM). Prints, per shape and mode, the median event time (L2 flushed before each call, as
the benchmark does) and how the blocks sat on the SMs (%smid). A cluster of 16 is not
portable: the script allows it for the function (cuFuncSetAttribute through the CUDA
driver) and reports a refusal rather than failing.
Needs an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import kernels, runtime  # noqa: E402
from hipmla.reference import D_V, HEADS  # noqa: E402
from hipmla.bench import Timer  # noqa: E402
from hipmla.runtime.launch import Module  # noqa: E402

SYMBOL = "hipmla_probe_cluster"
MODES = {0: "none", 1: "global", 2: "cluster", 3: "global in clusters"}


class _Args(ctypes.Structure):
    _fields_ = [("p", kernels.DecodeParams), ("smids", ctypes.c_void_p)]


def probe_source() -> str:
    """The probe as one translation unit (its includes inlined from this tree's hip_src)."""
    return kernels.translation_unit("probe/cluster.hip", Path(__file__).with_suffix(".cu").read_text())


def build_options(mode: int, items: int) -> list[str]:
    return [f"-DPROBE_MODE={mode}", f"-DPROBE_ITEMS={items}"]


def build(mode: int, items: int):
    code = runtime.compile_source(probe_source(), f"{SYMBOL}_{mode}_{items}", "sm_90", build_options(mode, items))
    return Module(code).function(SYMBOL)


def allow_non_portable(fn) -> str | None:
    """Lets ``fn`` launch clusters above 8 blocks (CUDA driver, attribute 14); None or why not."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no libcuda: {e}"
    rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(fn.address), 14, 1)
    return None if rc == 0 else f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) = {rc}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x8,4x16,16x8,32x4,32x8,64x4", help="rows x items, comma-separated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shared", type=int, default=kernels.sm90_shared_bytes("mxfp4"))
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for rows, items in shapes:
        if rows < 1 or not 2 <= items <= 16:
            ap.error(f"--shapes: {rows}x{items}: expected rows >= 1 and 2 .. 16 items a row "
                     "(a row of one item hands nothing off)")
    info = runtime.device_info()
    print(f"{info.name}: {info.num_cus} SMs; dynamic shared memory {args.shared} B a block; "
          f"L2 flushed, median of {args.iters}")
    timer = Timer(info.l2_bytes)
    for rows, items in shapes:
        blocks = rows * items
        slots = runtime.DeviceArray((blocks, HEADS, D_V), np.float32)
        ml = runtime.DeviceArray((blocks, HEADS, 2), np.float32)
        counters = runtime.DeviceArray((rows, 2), np.int32)
        runtime.memset(counters.ptr, 0, counters.nbytes)
        smids = runtime.DeviceArray((blocks,), np.int32)
        outs, line = {}, [f"{rows:3d} rows x {items:2d} items ({blocks:4d} blocks):"]
        for mode in MODES:
            out = runtime.DeviceArray((rows, HEADS, D_V), np.uint16)
            p = kernels.DecodeParams()
            p.counters, p.part_acc, p.part_ml, p.out = counters.ptr, slots.ptr, ml.ptr, out.ptr
            p.q_tokens, p.batch, p.head_groups = rows, rows, 1
            launch_args = _Args(p, smids.ptr)
            try:
                fn = build(mode, items)
                if mode >= 2 and items > 8:
                    why = allow_non_portable(fn)
                    if why:
                        line.append(f"{MODES[mode]} refused ({why})")
                        continue

                def launch(fn=fn, launch_args=launch_args):
                    fn.launch((blocks, 1, 1), (256, 1, 1), launch_args, args.shared)

                t = statistics.median(timer.time(launch, args.iters, True))
            except Exception as e:  # a refused cluster launch is a finding, not a crash
                line.append(f"{MODES[mode]} failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                continue
            runtime.synchronize()
            outs[mode] = out.to_host()
            sm = smids.to_host()
            per_sm = np.bincount(sm[sm >= 0])
            line.append(f"{MODES[mode]} {t:6.2f} us (SMs {np.count_nonzero(per_sm)}, at most {per_sm.max()} an SM)")
        for mode in (2, 3):
            if 1 in outs and mode in outs:
                diff = int((outs[1] != outs[mode]).sum())
                line.append(f"{MODES[mode]}: same bytes as global" if diff == 0 else
                            f"{MODES[mode]}: {diff} of {outs[1].size} differ from global")
        print("  " + "; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
