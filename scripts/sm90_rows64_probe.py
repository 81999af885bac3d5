#!/usr/bin/env python3
"""Feasibility probe: 64 rows a block on wgmma (sm_90a) for an MXFP4 cache, timed beside the decoder.

Not a library kernel. ``scripts/sm90_rows64_probe.cu`` holds the hot loop of the design for
64+ rows of one sequence (64 or 128 heads of a query token, or 16 heads x 4 MTP tokens):
the rows are the M = 64 of wgmma, K is dequantized once a tile into bf16 in shared memory
for all 64 rows, and Q.K and P.V both read it from there (P.V as MN-major B, so no
transpose). The decoder's sm_90 kernel serves 16 rows at a time and dequantizes and
transposes K once per 16 (``bench --mtp``: 128 heads ran at ~20% of the bf16 matmul).
Two designs: 1, all 8 warps through each phase of a 64-token tile (dequantize, Q.K,
softmax, P.V); 2, a producer warpgroup dequantizing 32-token tiles into a double buffer
beside two consumer warpgroups' tensor work. Both leave out the schedule, paging,
masking, the merge and the epilogue (block x reads rows [x n, (x + 1) n) of a contiguous
cache for the 64 rows of blockIdx.y; the two warpgroups' sums are added here), so their
times are lower bounds for a kernel built on them.

    python3 scripts/sm90_rows64_probe.py [--design 1|2] [--blocks 128] [--tokens 2048] [--iters 20] [--no-decoder]

Checks each build against float64 attention (3 blocks x 512 tokens x 128 rows), times
``blocks x tokens`` tokens (128 x 2048 = the tokens of bs 32 x 8k) at 64 and 128 heads
beside the decoder at bs 32 x 8k with the same heads, the read bandwidth and a bf16
matmul of the same run, then builds with one part taken out (PROBE_ABLATE: their results
are wrong, their time is not). Needs an sm_90 GPU (NVRTC builds for sm_90a).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import formats, kernels, runtime  # noqa: E402
from hipmla.bench import Timer, matmul_tflops, read_gbs  # noqa: E402
from hipmla.runtime.launch import Module  # noqa: E402

ROWS = 64


def _kib_round(n: int) -> int:
    return (n + 1023) // 1024 * 1024


#: design: (symbol, threads, sizeof its Smem: Q' 72 KiB, K' (one 64-token buffer or three of
#: 32 tokens), P 8 KiB, the raw ring, the exchanges; rounded to its 1 KiB alignment; the
#: kernel traps on less)
DESIGNS = {
    1: ("hipmla_probe_rows64_mxfp4", 256,
        _kib_round(2 * 9 * 8192 + 8192 + 2 * 64 * (288 + 18) + 2 * 4 * 128 * 16 + 2 * 64 * 4)),
    2: ("hipmla_probe_rows64_ws_mxfp4", 384,
        _kib_round(9 * 8192 + 3 * 9 * 4096 + 8192 + 3 * 32 * (288 + 18) + 2 * 2 * 128 * 16 + 2 * 64 * 4)),
}


class ProbeParams(ctypes.Structure):
    _fields_ = [("kv", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("q", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("ml", ctypes.c_void_p), ("tokens", ctypes.c_int),
                ("scale_log2", ctypes.c_float)]


def probe_source() -> str:
    """The probe as one translation unit (its includes inlined from this tree's hip_src)."""
    return kernels.translation_unit("probe/rows64.hip", Path(__file__).with_suffix(".cu").read_text())


ABLATIONS = {1: "no K' stores", 2: "no Q.K wgmma", 3: "no P.V wgmma", 4: "no dequantization arithmetic"}


def build(design: int, ablate: int = 0):
    symbol, threads, shared = DESIGNS[design]
    code = runtime.compile_source(probe_source(), symbol, "sm_90a", [f"-DPROBE_ABLATE={ablate}"])
    return Module(code).function(symbol), threads, shared


def case(blocks: int, tokens: int, heads: int, seed: int):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((blocks * tokens, 576), dtype=np.float32)
    mx = formats.mxfp4_quantize(k)
    q = formats.to_bf16(rng.standard_normal((blocks, heads, 576), dtype=np.float32))
    return mx, q


def run(kernel, mx, q, blocks: int, tokens: int, scale_log2: float):
    fn, threads, shared = kernel
    heads = q.shape[1]
    bufs = {
        "kv": runtime.DeviceArray.from_host(np.ascontiguousarray(mx.data)),
        "scales": runtime.DeviceArray.from_host(np.ascontiguousarray(mx.scales)),
        "q": runtime.DeviceArray.from_host(formats.bf16_bits(q)),
        "out": runtime.DeviceArray((blocks, heads, 512), np.float32),
        "ml": runtime.DeviceArray((blocks, 2, heads, 2), np.float32),
    }
    args = ProbeParams(bufs["kv"].ptr, bufs["scales"].ptr, bufs["q"].ptr, bufs["out"].ptr, bufs["ml"].ptr,
                       tokens, scale_log2)

    def launch():
        fn.launch((blocks, heads // ROWS, 1), (threads, 1, 1), args, shared)

    return launch, bufs


def check(kernel, scale_log2: float) -> float:
    """Max error of the merged output over max |reference|, float64 attention over each
    block's tokens (128 rows: both row groups)."""
    blocks, tokens = 3, 512
    mx, q = case(blocks, tokens, 2 * ROWS, 1)
    launch, bufs = run(kernel, mx, q, blocks, tokens, scale_log2)
    launch()
    runtime.synchronize()
    out = bufs["out"].to_host().astype(np.float64) * 2.0 ** 64
    ml = bufs["ml"].to_host().astype(np.float64)
    kf = mx.dequantize().astype(np.float64)
    worst = 0.0
    for b in range(blocks):
        m, lsum = ml[b, 0, :, 0], ml[b, 0, :, 1] + ml[b, 1, :, 1]  # both warpgroups hold the same m
        if not np.array_equal(ml[b, 0, :, 0], ml[b, 1, :, 0]):
            return float("inf")
        o = out[b] / lsum[:, None]
        kb = kf[b * tokens:(b + 1) * tokens]
        s = (q[b].astype(np.float64) @ kb.T) * scale_log2
        if np.abs(s.max(axis=1) - m).max() > 1e-3 * (1 + np.abs(m).max()):
            return float("inf")
        pr = np.exp2(s - s.max(axis=1, keepdims=True))
        ref = (pr @ kb[:, :512]) / pr.sum(axis=1, keepdims=True)
        worst = max(worst, float(np.abs(o - ref).max() / np.abs(ref).max()))
    return worst


def decoder_us(heads: int, batch: int, kv_len: int, iters: int, timer: Timer) -> tuple[float, str]:
    """The decoder's L2-flushed median for one query token of ``heads`` heads a sequence."""
    from hipmla.decode import Decoder
    from hipmla.inputs import BENCH_SM_SCALE, random_cache
    from hipmla.paging import KvLayout
    rng = np.random.default_rng(3)
    kv = random_cache(batch * kv_len, "mxfp4", rng)
    layout = KvLayout.contiguous(np.full(batch, kv_len))
    dec = Decoder("mxfp4", BENCH_SM_SCALE, heads=heads, max_batch=batch)
    q = rng.standard_normal((batch, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    bufs = {"q": runtime.DeviceArray.from_host(q.view(np.uint16)),
            "kv": runtime.DeviceArray.from_host(kv.data),
            "kv_indptr": runtime.DeviceArray.from_host(layout.kv_indptr.astype(np.int32)),
            "kv_scale": runtime.DeviceArray.from_host(np.ascontiguousarray(kv.scales)),
            "out": runtime.DeviceArray((batch, heads, 512), np.uint16)}
    try:
        return statistics.median(timer.time(lambda: dec.run(**bufs), iters, flush=True)), dec.kernel_symbol
    finally:
        for a in bufs.values():
            a.free()
        dec.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-decoder", action="store_true", help="leave the decoder's times out")
    ap.add_argument("--design", type=int, choices=sorted(DESIGNS), action="append",
                    help="1: all warps through each phase, 64-token tiles; 2: a producer warpgroup, 32-token tiles "
                         "(default: both)")
    ap.add_argument("--only", action="store_true", help="the full builds only, no ablations (for Nsight Compute)")
    args = ap.parse_args(argv)
    if args.tokens % 64:
        ap.error("--tokens: a multiple of 64")
    designs = args.design or sorted(DESIGNS)
    info = runtime.device_info()
    scale_log2 = float(np.float32(576 ** -0.5 * 1.4426950408889634))
    rd, mma = read_gbs(), matmul_tflops()
    print(f"{info.name}: read {rd or 0:.0f} GB/s, bf16 matmul {mma or 0:.0f} TFLOP/s (measured now); "
          f"probe shared memory {', '.join(f'{DESIGNS[d][2]} B' for d in designs)}", flush=True)
    timer = Timer(info.l2_bytes)
    total = args.blocks * args.tokens

    def timed(kernel, heads: int) -> str:
        mx, q = case(args.blocks, args.tokens, heads, 2)
        launch, bufs = run(kernel, mx, q, args.blocks, args.tokens, scale_log2)
        t = statistics.median(timer.time(launch, args.iters, True))
        for a in bufs.values():
            a.free()
        tflops = 2 * heads * total * (576 + 512) / (t * 1e-6) / 1e12
        nbytes = total * (288 + 18)
        gbs = nbytes / (t * 1e-6) / 1e9
        return (f"{heads:3d} heads, {args.blocks} x {args.tokens} tokens: {t:7.1f} us, {tflops:5.0f} TFLOP/s"
                f" ({100 * tflops / mma:.0f}% of the matmul), KV {gbs:.0f} GB/s ({100 * gbs / rd:.0f}% of read)"
                if mma and rd else f"{heads} heads: {t:.1f} us, {tflops:.0f} TFLOP/s")

    kernels_ = {d: build(d) for d in designs}
    for d, kernel in kernels_.items():
        err = check(kernel, scale_log2)
        print(f"design {d} vs float64 (3 x 512 tokens, 128 rows): max error / max |ref| {err:.2e} "
              f"({'ok' if err < 2e-2 else 'WRONG'})", flush=True)
    for heads in (64, 128):
        for d, kernel in kernels_.items():
            print(f"design {d}  {timed(kernel, heads)}", flush=True)
        if not args.no_decoder:
            batch = 32
            kv_len = total // batch
            us, symbol = decoder_us(heads, batch, kv_len, args.iters, timer)
            tflops = 2 * heads * total * (576 + 512) / (us * 1e-6) / 1e12
            print(f"decoder   {heads:3d} heads, bs {batch} x {kv_len}: {us:7.1f} us, {tflops:5.0f} TFLOP/s ({symbol})",
                  flush=True)
    if not args.only:
        for d in designs:
            for ablate, what in ABLATIONS.items():
                print(f"design {d} PROBE_ABLATE={ablate} ({what}; results wrong): {timed(build(d, ablate), 128)}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
