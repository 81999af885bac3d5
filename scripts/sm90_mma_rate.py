#!/usr/bin/env python3
"""Issue cycles of the H200 per instruction kind, for the sm_90 kernel's design: how long a
scheduler spends on mma.sync m16n8k16 / m16n8k8 (bf16, f32 accumulators), wgmma m64n16k16
and the ALU, FMA-pipe and shared-memory instructions the kernel's loop is made of, alone
and side by side.

Not a library kernel (``scripts/sm90_mma_rate.cu``): every warp issues ``--iters`` rounds
of CHAINS independent tensor-core instructions, each followed by RATE_ALU instructions of
one kind (and RATE_ALU2 of a second), on arbitrary operands, one or two 8-warp blocks an
SM (64 KiB of dynamic shared memory a block keeps it at two), all SMs. Reported: device
time (CUDA events), dense TFLOP/s, the cycles a round takes a scheduler (each SM's clock64
span, first warp in to last warp out, over the rounds its 4 schedulers issue; a wgmma round
is a warp's quarter of the instruction), and the SM clock (clock64 against %globaltimer).
``scripts/sm90_counts.py --cost`` prices the kernel's tile loop with these figures (its
ISSUE_CYCLES).

    python3 scripts/sm90_mma_rate.py [--iters 4096] [--op 3 ...]

Measured on the H200 (2026-12-03, scripts/results/h200-2026-12-03-sm90-mma-rate.txt), cycles
of a scheduler a warp-instruction with 4 warps a scheduler (clock64 over each SM's span;
the SM clock 1.98 GHz for ALU work, 1.80 with the tensor cores busy): HMMA.16816 6.2-6.7
(615 TFLOP/s), HMMA.1688 4.3, MOVM and SHFL 4.0, LOP3 / SHF / PRMT 2.06, IMAD 2.0, HFMA2
1.17, FFMA / FADD 1.1, MUFU.EX2 8.0, shared-memory accesses 4 a wavefront; an HMMA adds to
the others (with 4 lop3 13.6, alone 6.7 + 8.3); a wgmma m64n16k16 (RS) quarter 13.0 alone,
24.3 beside 8 lop3 (which alone take 16.5): it overlaps them in part.
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
from hipmla.bench import Timer  # noqa: E402
from hipmla.runtime.launch import Module  # noqa: E402

SYMBOL = "hipmla_probe_mma_rate"
OPS = {0: ("mma.sync m16n8k16", 16 * 8 * 16), 1: ("mma.sync m16n8k8", 16 * 8 * 8),
       2: ("wgmma m64n16k16 RS", 64 * 16 * 16), 3: ("wgmma m64n16k16 SS", 64 * 16 * 16), 4: ("none", 0)}
KINDS = ("lop3", "hfma2", "shr", "imad", "movmatrix", "ffma", "prmt", "fadd", "lds.128", "ldsm.x4.t+lop3", "sts.128",
         "ex2", "lds.64", "lds.32", "sts.64", "shfl")


class RateParams(ctypes.Structure):
    _fields_ = [("stamps", ctypes.c_void_p), ("sink", ctypes.c_void_p), ("iters", ctypes.c_int)]


#: Dynamic shared memory a block asks for beside its 32 KiB static: at most two blocks fit
#: an SM (2 x 97 KiB of 228), so "2 blocks an SM" cannot become 3 or 4 on some SMs.
PAD_SHARED = 64 * 1024


def sm_spans(stamps: np.ndarray) -> tuple[float, float, int, int]:
    """(median over SMs of the SM's clock64 span / its warps, SM clock in GHz from clock64
    against %globaltimer, fewest and most warps an SM ran) from [warp][t0, t1, g0, g1, smid]."""
    spans, clocks, counts = [], [], []
    for sm in np.unique(stamps[:, 4]):
        w = stamps[stamps[:, 4] == sm]
        span = float(w[:, 1].max() - w[:, 0].min())
        spans.append(span / len(w))
        clocks.append(span / float(w[:, 3].max() - w[:, 2].min()))
        counts.append(len(w))
    return float(np.median(spans)), float(np.median(clocks)), min(counts), max(counts)


def source() -> str:
    """The probe as one translation unit (its includes inlined from this tree's hip_src)."""
    return kernels.translation_unit("probe/rate.hip", Path(__file__).with_suffix(".cu").read_text())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--op", type=int, action="append", choices=sorted(OPS),
                    help="run only the cases of this tensor instruction (repeatable; default: all)")
    args = ap.parse_args(argv)
    info = runtime.device_info()
    sms = info.num_cus
    print(f"{info.name}: {sms} SMs; {args.iters} rounds a warp, 8-warp blocks; median of 5")
    src = source()
    timer = Timer(0)
    # (op, chains, (count, kind) of the extra instructions a round, (count, kind) of a second group, blocks an SM)
    cases = [(4, 4, (8, kind), (0, 0), 2) for kind in range(len(KINDS))] + [
        (4, 4, (4, 0), (4, 3), 2), (4, 4, (4, 0), (4, 5), 2), (4, 4, (4, 0), (4, 1), 2), (4, 4, (4, 4), (4, 0), 2),
        (4, 4, (4, 0), (4, 8), 2), (4, 4, (4, 3), (4, 5), 2), (4, 4, (4, 5), (4, 1), 2),
        (0, 4, (0, 0), (0, 0), 1), (0, 4, (0, 0), (0, 0), 2), (0, 8, (0, 0), (0, 0), 2),
        (0, 4, (4, 0), (0, 0), 2), (0, 4, (8, 0), (0, 0), 2), (0, 4, (4, 1), (0, 0), 2), (0, 4, (4, 3), (0, 0), 2),
        (0, 4, (4, 4), (0, 0), 2), (0, 4, (4, 5), (0, 0), 2), (0, 4, (1, 4), (0, 0), 2), (0, 4, (4, 8), (0, 0), 2),
        (0, 4, (4, 0), (4, 3), 2), (0, 4, (2, 12), (0, 0), 2),
        (1, 4, (0, 0), (0, 0), 2), (1, 4, (4, 0), (0, 0), 2),
        (2, 4, (0, 0), (0, 0), 2), (2, 8, (0, 0), (0, 0), 2), (2, 4, (4, 0), (0, 0), 2), (2, 4, (8, 0), (0, 0), 2),
        (2, 4, (8, 3), (0, 0), 2), (2, 4, (8, 5), (0, 0), 2), (2, 4, (4, 4), (0, 0), 2), (2, 4, (4, 0), (4, 3), 2),
        (3, 4, (0, 0), (0, 0), 2), (3, 8, (0, 0), (0, 0), 2), (3, 4, (4, 0), (0, 0), 2), (3, 4, (8, 0), (0, 0), 2),
        (3, 4, (8, 5), (0, 0), 2), (3, 4, (8, 1), (0, 0), 2)]
    if args.op:
        cases = [c for c in cases if c[0] in args.op]
    print(f"{'instruction':>20} {'chains':>6} {'extra':>20} {'blocks/SM':>9} {'us':>8} {'TFLOP/s':>8} {'cycles/round/scheduler':>22} {'GHz':>6}")
    for op, chains, (alu, kind), (alu2, kind2), per_sm in cases:
        code = runtime.compile_source(src, SYMBOL, "sm_90a", [f"-DRATE_OP={op}", f"-DRATE_CHAINS={chains}",
                                                             f"-DRATE_ALU={alu}", f"-DRATE_ALU_KIND={kind}",
                                                             f"-DRATE_ALU2={alu2}", f"-DRATE_ALU_KIND2={kind2}"])
        fn = Module(code).function(SYMBOL)
        blocks = sms * per_sm
        cyc = runtime.DeviceArray((blocks * 8, 5), np.int64)
        sink = runtime.DeviceArray((blocks * 256,), np.float32)
        args_t = RateParams(cyc.ptr, sink.ptr, args.iters)
        t = statistics.median(timer.time(lambda: fn.launch((blocks, 1, 1), (256, 1, 1), args_t, PAD_SHARED), 5, False))
        name, flop = OPS[op]
        # A round: one tensor instruction a warp (wgmma: a warpgroup's, each warp issuing it
        # for its quarter of M) and `alu` extra instructions; a scheduler runs 2 warps a block.
        groups = blocks * (2 if op in (2, 3) else 8) * args.iters * chains
        tflops = 2 * flop * groups / (t * 1e-6) / 1e12
        # The SM's span (first warp in .. last warp out, clock64 cycles) over the rounds each
        # scheduler issues: its warps / 4 (the SM's warps share 4 schedulers) x iters x chains.
        span_per_warp, ghz, fewest, most = sm_spans(cyc.to_host())
        per_round = span_per_warp * 4 / (args.iters * chains)
        extra = " + ".join(f"{n} {KINDS[k]}" for n, k in ((alu, kind), (alu2, kind2)) if n) or "-"
        note = "" if fewest == most == 8 * per_sm else f"  (warps an SM {fewest}..{most})"
        print(f"{name:>20} {chains:>6} {extra:>20} {per_sm:>9} {t:8.1f} {tflops:8.1f} {per_round:22.2f} {ghz:6.2f}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
