#!/usr/bin/env python3
"""First GPU trial of the sm_90 tensor-core split kernel (hip_src/decode/split_sm90.hip).

On an H200 (through hipmla's HIP-on-CUDA library, like every hipmla GPU run):

1. correctness: the kernel alone (p.fast_tile = 0, it takes every item) against the
   emulator with its 32-token tile (``emulate_decode(..., tile_tokens=SM90_TILE_TOKENS)``)
   and loosely against exact attention, for the 8 benchmark shapes and ragged paged mixes
   (page sizes 1/16/64, empty sequences, random page order), all three cache formats;
2. speed: µs per launch with HIP events (warm-up, then the median of --iters), next to the
   portable split kernel on the same inputs, and GB/s = (tokens x bytes per token + Q + out)
   / time.

    python scripts/sm90_trial.py                  # everything
    python scripts/sm90_trial.py --formats mxfp4 --no-ragged --iters 50

It launches the kernel directly, not through the decoder (which runs it on sm_90 for every Q precision),
so the two kernels can be set side by side. ``Sm90Kernel`` is also what
tests/test_sm90.py's GPU test launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import kernels, runtime  # noqa: E402
from hipmla.emulate import LOG2E, SM90_TILE_TOKENS, emulate_decode  # noqa: E402
from hipmla.formats import KV_FORMATS  # noqa: E402
from hipmla.schedule import SplitPolicy  # noqa: E402
from hipmla.selftest import EMU_ATOL, EMU_LSE_ATOL, EMU_RTOL  # noqa: E402  (the GPU tests' bounds)


class Sm90Kernel:
    """One kernel (sm_90 tensor-core, or for comparison the portable split kernel) with its
    own partial scratch and counters, launched with a DecodeParams filled the way
    hipmla.decode.Decoder._prepare fills it (fast_tile = 0)."""

    def __init__(self, kv_format: str, sm_scale: float, max_batch: int, portable: bool = False,
                 policy: SplitPolicy | None = None, q_precision: str = "bf16"):
        info = runtime.device_info(0)
        self.spec = (kernels.split_kernel(kv_format, q_precision) if portable
                     else kernels.sm90_split_kernel(kv_format, q_precision))
        self.q_precision = q_precision
        if not portable and not self.spec.builds_for(info.arch):
            raise RuntimeError(f"the sm_90 kernel needs an sm_90 device, this one is {info.arch}")
        self.fn = runtime.load_kernel(self.spec, info.arch)
        self.policy = policy or SplitPolicy.for_device(info.num_cus)
        self.kv_format = kv_format
        slots = self.policy.max_items(max_batch)
        acc = slots * kernels.HEADS * kernels.D_V * 4
        ml = slots * kernels.HEADS * 2 * 4
        self.scratch = runtime.alloc(acc + ml + 2 * max_batch * 4)  # two merge counters a row
        runtime.memset(self.scratch.ptr + acc + ml, 0, 2 * max_batch * 4)
        runtime.synchronize()
        p = self.params = kernels.DecodeParams()
        p.part_acc, p.part_ml, p.counters = self.scratch.ptr, self.scratch.ptr + acc, self.scratch.ptr + acc + ml
        p.sm_scale_log2 = float(np.float32(np.float32(sm_scale) * LOG2E))
        p.set_split(dataclasses.replace(self.policy, fast_tile=0))
        self.max_batch = max_batch

    def bind(self, dev: dict, batch: int, page_size: int, fp8_scale: float | None, lse_ptr: int, out_ptr: int):
        """A prepared launch (one C call) for these device arrays."""
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} > max_batch {self.max_batch}")
        p = kernels.DecodeParams.from_buffer_copy(self.params)
        p.q, p.kv, p.kv_indptr = dev["q"].ptr, dev["kv"].ptr, dev["kv_indptr"].ptr
        p.out, p.lse = out_ptr, lse_ptr
        p.kv_indices = dev["kv_indices"].ptr if "kv_indices" in dev else 0
        p.kv_last_page_len = dev["kv_last_page_len"].ptr if "kv_last_page_len" in dev else 0
        p.page_shift = int(page_size).bit_length() - 1 if "kv_indices" in dev else 0
        if "kv_scale" in dev:
            p.kv_scale, p.stride_kv_scale = dev["kv_scale"].ptr, int(dev["kv_scale"].shape[1])
        p.kv_fp8_scale = float(fp8_scale) if self.kv_format == "fp8" else 1.0
        p.batch = batch
        grid = kernels.grid_decode(self.policy.max_items(batch))
        return self.fn.bind(p).prepare(grid, (self.spec.block_threads, 1, 1), self.spec.dynamic_shared_bytes)

    def close(self) -> None:
        self.scratch.free()


def upload(q, kv, layout) -> dict:
    i32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731  (the kernel reads int32)
    host = {"q": q.view(np.uint16), "kv": kv.data, "kv_indptr": i32(layout.kv_indptr)}
    if layout.paged:
        host |= {"kv_indices": i32(layout.kv_indices), "kv_last_page_len": i32(layout.kv_last_page_len)}
    if kv.scales is not None:
        host["kv_scale"] = kv.scales
    return {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) for k, v in host.items()}


def run_once(kernel: Sm90Kernel, q, kv, layout):
    """(out bf16 (b,16,512), lse (b,16)) of one launch; outputs poisoned with NaN first."""
    b = layout.batch
    dev = upload(q, kv, layout)
    d_out = runtime.DeviceArray((b, 16, 512), np.uint16)
    d_lse = runtime.DeviceArray((b, 16), np.float32)
    try:
        runtime.memset(d_out.ptr, 0xFF, d_out.nbytes)
        runtime.memset(d_lse.ptr, 0xFF, d_lse.nbytes)
        kernel.bind(dev, b, layout.page_size, kv.fp8_scale, d_lse.ptr, d_out.ptr)()
        runtime.synchronize()
        return d_out.to_host().view(ml_dtypes.bfloat16), d_lse.to_host()
    finally:
        for a in list(dev.values()) + [d_out, d_lse]:
            a.free()


def compare(out, lse, q, kv, layout, sm_scale, policy, seqs, q_precision: str = "bf16") -> dict:
    """Worst device-vs-emulator errors on the sequences ``seqs`` (emulator: 32-token tiles,
    Q quantized as ``q_precision`` says)."""
    emu_out, emu_lse = emulate_decode(q, kv, layout, sm_scale, policy, q_precision=q_precision,
                                      q_fp8_variant="e4m3fn", seqs=seqs, tile_tokens=SM90_TILE_TOKENS,
                                      products=kernels.sm90_split_kernel(kv.format, q_precision).products)
    o = np.asarray(out[seqs], np.float32)
    e = np.asarray(emu_out, np.float32)
    scale = float(np.abs(e).max(initial=0)) or 1.0
    err = np.abs(o - e)
    bad = int((~(err <= EMU_RTOL * np.abs(e) + EMU_ATOL * scale)).sum())  # NaN counts as bad
    l_dev, l_emu = lse[seqs], emu_lse
    pattern = bool((np.isneginf(l_dev) == np.isneginf(l_emu)).all())
    with np.errstate(invalid="ignore"):
        lerr = np.where(np.isneginf(l_dev) & np.isneginf(l_emu), 0, np.abs(l_dev - l_emu))
    lerr_max = float(np.nan_to_num(lerr, nan=np.inf).max(initial=0))
    return {"bad": bad, "max_abs": float(np.nan_to_num(err, nan=np.inf).max(initial=0)),
            "bitexact": float((o == e).mean()) if o.size else 1.0, "lse": lerr_max,
            "ok": bad == 0 and pattern and lerr_max <= EMU_LSE_ATOL}




def time_launch(launch, iters: int) -> float:
    """Median µs of one launch over ``iters`` event-timed launches (after 3 warm-ups)."""
    for _ in range(3):
        launch()
    start, stop = runtime.Event(), runtime.Event()
    times = []
    for _ in range(iters):
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_ms(stop) * 1e3)
    start.close()
    stop.close()
    return float(np.median(times))


def main() -> int:
    from hipmla.inputs import benchmark_shapes, make_inputs, random_cache, random_seq_lens, spread_sample
    from hipmla.paging import random_page_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=list(KV_FORMATS), choices=KV_FORMATS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-ragged", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-portable", action="store_true", help="time the sm_90 kernel only")
    ap.add_argument("--shapes", default=None, help="comma-separated benchmark shapes (default: all)")
    ap.add_argument("--min-split", default=None,
                    help="comma-separated split_min_tokens to time side by side (align = min(128, value))")
    args = ap.parse_args()
    num_cus = runtime.device_info(0).num_cus
    policies = [SplitPolicy.for_device(num_cus)]
    if args.min_split:
        policies = [SplitPolicy(target_items=2 * num_cus, min_split_tokens=int(v), align_tokens=min(128, int(v)))
                    for v in args.min_split.split(",")]
    sm_scale = 1 / 576 ** 0.5
    failures = 0
    print(f"device: {runtime.device_info(0).name} ({runtime.device_info(0).arch}, "
          f"{runtime.device_info(0).num_cus} SMs)")
    for fmt in args.formats:
        for shape in benchmark_shapes():
            if args.shapes and shape.name not in args.shapes.split(","):
                continue
            inputs = make_inputs(shape.seq_lens, fmt, seed=shape.batch + shape.kv_len, sm_scale=sm_scale)
            b = inputs.batch
            fast = Sm90Kernel(fmt, sm_scale, b, policy=policies[0])
            out, lse = run_once(fast, inputs.q, inputs.kv, inputs.layout)
            r = compare(out, lse, inputs.q, inputs.kv, inputs.layout, sm_scale, fast.policy,
                        spread_sample(inputs.seq_lens, 4))
            failures += not r["ok"]
            line = (f"{fmt:5s} {shape.name:8s} emu {'ok ' if r['ok'] else 'BAD'} bad {r['bad']} "
                    f"max_abs {r['max_abs']:.2e} bitexact {r['bitexact']:.4f} lse {r['lse']:.1e}")
            if not args.no_timing:
                dev = upload(inputs.q, inputs.kv, inputs.layout)
                d_out = runtime.DeviceArray((b, 16, 512), np.uint16)
                d_lse = runtime.DeviceArray((b, 16), np.float32)
                tokens = int(inputs.seq_lens.sum())
                nbytes = tokens * inputs.kv.bytes_per_token + b * 16 * 576 * 2 + b * 16 * 512 * 2
                for pol in policies:
                    k = fast if pol is policies[0] else Sm90Kernel(fmt, sm_scale, b, policy=pol)
                    t = time_launch(k.bind(dev, b, 1, inputs.kv.fp8_scale, d_lse.ptr, d_out.ptr), args.iters)
                    line += f" | sm90 min{pol.min_split_tokens} {t:7.1f} us {nbytes / t / 1e3:5.0f} GB/s"
                    if k is not fast:
                        k.close()
                if not args.no_portable:
                    portable = Sm90Kernel(fmt, sm_scale, b, portable=True)
                    t_port = time_launch(portable.bind(dev, b, 1, inputs.kv.fp8_scale, d_lse.ptr, d_out.ptr),
                                         max(3, args.iters // 4))
                    line += f" | portable {t_port:8.1f} us {nbytes / t_port / 1e3:7.0f} GB/s"
                    portable.close()
                for a in list(dev.values()) + [d_out, d_lse]:
                    a.free()
            print(line, flush=True)
            fast.close()
        if args.no_ragged:
            continue
        rng = np.random.default_rng(2026)
        mixes = [np.array([1, 0, 31, 32, 33, 127, 128, 129, 16383, 64, 65]), np.zeros(3, np.int64)]
        mixes += [random_seq_lens(rng, max_batch=200, max_len=12000) for _ in range(6)]
        for i, lens in enumerate(mixes):
            page_size = (1, 16, 64)[i % 3]
            layout = random_page_table(lens, page_size, rng, spare_pages=17, shared=3)
            pool_rows = (int(layout.kv_indices.max(initial=0)) + 1) * page_size
            pool = random_cache(pool_rows, fmt, rng, scale_stride=24)
            q = rng.standard_normal((lens.shape[0], 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
            fast = Sm90Kernel(fmt, sm_scale, lens.shape[0])
            out, lse = run_once(fast, q, pool, layout)
            r = compare(out, lse, q, pool, layout, sm_scale, fast.policy, spread_sample(lens))
            finite = bool(np.isfinite(out.astype(np.float32)).all())
            ok = r["ok"] and finite
            failures += not ok
            print(f"{fmt:5s} ragged {i} (bs {lens.shape[0]}, {int(lens.sum())} tokens, page {page_size}) "
                  f"emu {'ok ' if ok else 'BAD'} bad {r['bad']} max_abs {r['max_abs']:.2e} "
                  f"bitexact {r['bitexact']:.4f} lse {r['lse']:.1e} finite {finite}", flush=True)
            fast.close()
    print("ALL OK" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
