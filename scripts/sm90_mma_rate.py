#!/usr/bin/env python3
"""Issue cycles of the H200 per instruction kind, for the sm_90 kernel's design: how long a
scheduler spends on mma.sync m16n8k16 / m16n8k8 (bf16, f32 accumulators), wgmma m64n16k16
and the ALU, FMA-pipe and shared-memory instructions the kernel's loop is made of, alone
and side by side.

Not a library kernel (``scripts/sm90_mma_rate.cu``): every warp issues ``--iters`` rounds
of CHAINS independent tensor-core instructions, each followed by RATE_ALU instructions of
one kind (and RATE_ALU2 of a second), on arbitrary operands, one or two 8-warp blocks an
SM, all SMs. Reported: device time (CUDA events), dense TFLOP/s, and from clock64 the
cycles a round takes per scheduler (a scheduler runs 2 warps of each block; a wgmma round
is a warp's quarter of the instruction). ``scripts/sm90_counts.py --cost`` prices the
kernel's tile loop with these figures (its ISSUE_CYCLES).

    python3 scripts/sm90_mma_rate.py [--iters 4096]

Measured on the H200 (2026-12-03, scripts/results/h200-2026-12-03-sm90-mma-rate.txt), cycles
a warp-instruction with 4 warps a scheduler: HMMA.16816 4.6-4.9 (615 TFLOP/s), HMMA.1688
3.5, MOVM 3.2, LOP3 / SHF / PRMT 1.6, IMAD 1.5, HFMA2 1.1, FFMA / FADD 0.9, MUFU.EX2 5.9,
SHFL 3.2, shared-memory accesses of 4 wavefronts 12; an HMMA adds to the others (with 4
lop3 11.8, alone 4.9 + 6.3); a wgmma m64n16k16 (RS) quarter 13.0 alone, 18.4 beside 8 lop3
(which alone take 12.7): it overlaps them.
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
    _fields_ = [("cycles", ctypes.c_void_p), ("sink", ctypes.c_void_p), ("iters", ctypes.c_int)]


def source() -> str:
    """The probe as one translation unit (its includes inlined from this tree's hip_src)."""
    return kernels.translation_unit("probe/rate.hip", Path(__file__).with_suffix(".cu").read_text())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4096)
    args = ap.parse_args(argv)
    info = runtime.device_info()
    sms = info.num_cus
    print(f"{info.name}: {sms} SMs; {args.iters} rounds a warp, 8-warp blocks; median of 5")
    src = source()
    timer = Timer(0)
    # (op, chains, (count, kind) of the extra instructions a round, (count, kind) of a second group, blocks an SM)
    cases = [(4, 4, (8, kind), (0, 0), 2) for kind in range(16)] + [
        (4, 4, (4, 0), (4, 3), 2), (4, 4, (4, 0), (4, 5), 2), (4, 4, (4, 0), (4, 1), 2), (4, 4, (4, 4), (4, 0), 2),
        (4, 4, (4, 0), (4, 8), 2), (4, 4, (4, 3), (4, 5), 2), (4, 4, (4, 5), (4, 1), 2),
        (0, 4, (0, 0), (0, 0), 1), (0, 4, (0, 0), (0, 0), 2), (0, 8, (0, 0), (0, 0), 2),
        (0, 4, (4, 0), (0, 0), 2), (0, 4, (8, 0), (0, 0), 2), (0, 4, (4, 1), (0, 0), 2), (0, 4, (4, 3), (0, 0), 2),
        (0, 4, (4, 4), (0, 0), 2), (0, 4, (4, 5), (0, 0), 2), (0, 4, (1, 4), (0, 0), 2), (0, 4, (4, 8), (0, 0), 2),
        (0, 4, (4, 0), (4, 3), 2), (0, 4, (2, 12), (0, 0), 2),
        (1, 4, (0, 0), (0, 0), 2), (1, 4, (4, 0), (0, 0), 2),
        (2, 4, (0, 0), (0, 0), 2), (2, 8, (0, 0), (0, 0), 2), (2, 4, (4, 0), (0, 0), 2), (2, 4, (8, 0), (0, 0), 2),
        (2, 4, (8, 3), (0, 0), 2), (2, 4, (8, 5), (0, 0), 2), (2, 4, (4, 4), (0, 0), 2), (2, 4, (4, 0), (4, 3), 2),
        (3, 4, (0, 0), (0, 0), 2)]
    print(f"{'instruction':>20} {'chains':>6} {'extra':>20} {'blocks/SM':>9} {'us':>8} {'TFLOP/s':>8} {'cycles/round/scheduler':>22}")
    for op, chains, (alu, kind), (alu2, kind2), per_sm in cases:
        code = runtime.compile_source(src, SYMBOL, "sm_90a", [f"-DRATE_OP={op}", f"-DRATE_CHAINS={chains}",
                                                             f"-DRATE_ALU={alu}", f"-DRATE_ALU_KIND={kind}",
                                                             f"-DRATE_ALU2={alu2}", f"-DRATE_ALU_KIND2={kind2}"])
        fn = Module(code).function(SYMBOL)
        blocks = sms * per_sm
        cyc = runtime.DeviceArray((blocks * 8,), np.int64)
        sink = runtime.DeviceArray((blocks * 256,), np.float32)
        args_t = RateParams(cyc.ptr, sink.ptr, args.iters)
        t = statistics.median(timer.time(lambda: fn.launch((blocks, 1, 1), (256, 1, 1), args_t, 0), 5, False))
        name, flop = OPS[op]
        # A round: one tensor instruction a warp (wgmma: a warpgroup's, each warp issuing it
        # for its quarter of M) and `alu` extra instructions; a scheduler runs 2 warps a block.
        groups = blocks * (2 if op in (2, 3) else 8) * args.iters * chains
        tflops = 2 * flop * groups / (t * 1e-6) / 1e12
        rounds = per_sm * 2 * args.iters * chains
        c = float(np.median(cyc.to_host()))
        extra = " + ".join(f"{n} {KINDS[k]}" for n, k in ((alu, kind), (alu2, kind2)) if n) or "-"
        print(f"{name:>20} {chains:>6} {extra:>20} {per_sm:>9} {t:8.1f} {tflops:8.1f} {c / rounds:22.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
