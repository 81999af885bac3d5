#!/usr/bin/env python3
"""Feasibility probe: the token-split wgmma design for an MXFP4 cache on sm_90a, timed.

Not a library kernel. ``scripts/sm90_wgmma_probe.cu`` is the hot loop of the design the
sm_90 kernel's notes name as the one candidate for 60% of the read bandwidth: Q.K as
S^T = K' Q'^T on wgmma with K' dequantized into registers (each warp its own 16 tokens,
no partial-score exchange), V written once as bf16 to shared memory, P.V as
O^T = V^T P^T on wgmma from shared memory. It leaves out the schedule, paging, the merge
and the epilogue (block b reads rows [b n, (b + 1) n) of a contiguous cache; its two
warpgroups' states are merged here on the host), so its time is a lower bound for a
kernel built on it.

    python3 scripts/sm90_wgmma_probe.py [--blocks 128] [--tokens 16384] [--iters 20] [--only VDESC] [--define NAME=VALUE]

Checks each V^T descriptor variant (PROBE_VDESC) against float64 attention on a small
case and times it on ``blocks x tokens`` tokens (128 x 16384 reads the bytes of the
256 x 8k benchmark shape) beside the read bandwidth of the same run; then times builds
with one part taken out (PROBE_ABLATE: their results are wrong, their time is not).
Needs an sm_90 GPU (NVRTC builds for sm_90a).

Measured on the H200 (2026-12-02, scripts/results/h200-2026-12-02-sm90-wgmma-probe.txt):
473 us at 128 x 16384 (32.8% of the read bandwidth), against 464 us for the decoder's whole
kernel at 256 x 8k (another run): the design, at the 8 warps an SM its registers and shared
memory allow, is latency-bound (0.59 eligible warps a scheduler). With ``--define
PROBE_ROLLED=1`` (less code to fetch) 454.6 us against 472.9 in a later run: its loop alone
about as fast as that whole kernel, before the schedule, merge and epilogue.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import formats, kernels, runtime  # noqa: E402
from hipmla.bench import Timer, read_gbs  # noqa: E402
from hipmla.runtime.launch import Module  # noqa: E402

SYMBOL = "hipmla_probe_wgmma_mxfp4"
SHARED = 232448  # sizeof(probe::Smem): the whole opt-in limit of an sm_90 block (the kernel traps on less)


class ProbeParams(ctypes.Structure):
    _fields_ = [("kv", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("q", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("ml", ctypes.c_void_p), ("tokens", ctypes.c_int),
                ("scale_log2", ctypes.c_float)]


def probe_source() -> str:
    """The probe as one translation unit (its includes inlined from this tree's hip_src)."""
    return kernels.translation_unit("probe/wgmma.hip", Path(__file__).with_suffix(".cu").read_text())


ABLATIONS = {1: "no V stores", 2: "no P.V wgmma", 3: "no Q.K wgmma", 4: "no dequantization"}


def build(vdesc: int, ablate: int = 0, defines: tuple[str, ...] = ()):
    options = [f"-DPROBE_VDESC={vdesc}", f"-DPROBE_ABLATE={ablate}", *(f"-D{d}" for d in defines)]
    code = runtime.compile_source(probe_source(), SYMBOL, "sm_90a", options)
    return Module(code).function(SYMBOL)


def case(blocks: int, tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((blocks * tokens, 576), dtype=np.float32)
    mx = formats.mxfp4_quantize(k)
    q = formats.to_bf16(rng.standard_normal((blocks, 16, 576), dtype=np.float32))
    return mx, q


def run(fn, mx, q, blocks: int, tokens: int, scale_log2: float):
    bufs = {
        "kv": runtime.DeviceArray.from_host(np.ascontiguousarray(mx.data)),
        "scales": runtime.DeviceArray.from_host(np.ascontiguousarray(mx.scales)),
        "q": runtime.DeviceArray.from_host(formats.bf16_bits(q)),
        "out": runtime.DeviceArray((blocks, 2, 16, 512), np.float32),
        "ml": runtime.DeviceArray((blocks, 2, 16, 2), np.float32),
    }
    args = ProbeParams(bufs["kv"].ptr, bufs["scales"].ptr, bufs["q"].ptr, bufs["out"].ptr, bufs["ml"].ptr,
                       tokens, scale_log2)

    def launch():  # l is summed by atomics: zeroed by the caller before a checked launch
        fn.launch((blocks, 1, 1), (256, 1, 1), args, SHARED)

    return launch, bufs


def check(fn, scale_log2: float) -> float:
    blocks, tokens = 3, 512
    mx, q = case(blocks, tokens, 1)
    launch, bufs = run(fn, mx, q, blocks, tokens, scale_log2)
    runtime.memset(bufs["ml"].ptr, 0, bufs["ml"].nbytes)
    launch()
    runtime.synchronize()
    out = bufs["out"].to_host() * np.float32(2.0 ** 64)
    ml = bufs["ml"].to_host()
    kf = mx.dequantize().astype(np.float64)
    worst = 0.0
    for b in range(blocks):
        m, l = ml[b, :, :, 0], ml[b, :, :, 1]
        big = m.max(axis=0)
        wgt = np.exp2(m - big)
        o = (out[b] * wgt[..., None]).sum(axis=0) / (l * wgt).sum(axis=0)[:, None]
        kb = kf[b * tokens:(b + 1) * tokens]
        s = (q[b].astype(np.float64) @ kb.T) * scale_log2
        p = np.exp2(s - s.max(axis=1, keepdims=True))
        ref = (p @ kb[:, :512]) / p.sum(axis=1, keepdims=True)
        worst = max(worst, float(np.abs(o - ref).max() / np.abs(ref).max()))
    return worst


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="another -D for every build (e.g. PROBE_ROLLED=1)")
    ap.add_argument("--only", type=int, default=None, metavar="VDESC",
                    help="one descriptor variant, no ablations (for Nsight Compute: launch 2 is the timed shape)")
    args = ap.parse_args(argv)
    info = runtime.device_info()
    scale_log2 = float(np.float32(576 ** -0.5 * 1.4426950408889634))
    rd = read_gbs()
    print(f"{info.name}: read {rd:.0f} GB/s" if rd else f"{info.name}: no read probe (torch missing)")
    timer = Timer(info.l2_bytes)
    mx, q = case(args.blocks, args.tokens, 2)
    nbytes = mx.data.nbytes + mx.scales.nbytes + q.size * 2
    def timed(fn) -> str:
        launch, _ = run(fn, mx, q, args.blocks, args.tokens, scale_log2)
        t = statistics.median(timer.time(launch, args.iters, True))
        gbs = nbytes / (t * 1e-6) / 1e9
        pct = f", {100 * gbs / rd:.1f}% of read" if rd else ""
        return f"{args.blocks} x {args.tokens} tokens, L2 flushed, median of {args.iters}: {t:.1f} us, {gbs:.0f} GB/s{pct}"

    good = None
    for vdesc in (2, 0, 1) if args.only is None else (args.only,):
        fn = build(vdesc, 0, tuple(args.define))
        err = check(fn, scale_log2)
        ok = err < 2e-2
        good = vdesc if ok and good is None else good
        print(f"PROBE_VDESC={vdesc}: max error / max |ref| {err:.2e} ({'ok' if ok else 'WRONG'}); {timed(fn)}")
    for ablate, what in ABLATIONS.items() if args.only is None else ():
        print(f"PROBE_ABLATE={ablate} ({what}; results wrong): {timed(build(good or 0, ablate, tuple(args.define)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
