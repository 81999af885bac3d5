#!/usr/bin/env python3
"""Where the host time of one ``Decoder.run`` goes, on the real device: the whole call
(same objects), the prepared launch alone (``Decoder._launch``: one ctypes call into the
HIP library and the driver), and a ctypes call of a C no-op with as many arguments, each
with the GPU kept busy (launches queue behind running kernels, as in serving) and idle
(a sync after each). Median of ``--calls``.

    python scripts/launch_cost.py [--formats bf16,fp8,mxfp4] [--shape 32x8k] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import runtime  # noqa: E402
from hipmla.bench import c_noop_launch  # noqa: E402
from hipmla.decode import Decoder  # noqa: E402
from hipmla.inputs import random_cache  # noqa: E402
from hipmla.paging import KvLayout  # noqa: E402


def median_us(fn, calls: int, sync_each: bool) -> float:
    samples = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        if sync_each or i % 50 == 49:
            runtime.synchronize()
    runtime.synchronize()
    return statistics.median(samples)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bf16,fp8,mxfp4")
    p.add_argument("--shape", default="32x8k")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--after-torch", action="store_true",
                   help="time run() again right after a few torch ops, and a second later")
    a = p.parse_args(argv)
    b, n = a.shape.split("x")
    b, n = int(b), int(n.replace("k", "")) * (1024 if n.endswith("k") else 1)
    lens = np.full(b, n)
    rng = np.random.default_rng(0)
    c_noop = c_noop_launch()
    print(f"host us per call, {a.shape}, median of {a.calls}: busy GPU (sync every 50) / idle GPU (sync each)")
    print(f"{'format':>6} {'run':>12} {'launch':>12} {'C no-op':>12}")
    for fmt in a.formats.split(","):
        dec = Decoder(fmt, 1 / 24, max_batch=b)
        kv = random_cache(int(lens.sum()), fmt, rng, fp8_variant=dec.fp8_variant)
        layout = KvLayout.contiguous(lens)
        q = rng.standard_normal((b, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        host = {"q": q.view(np.uint16), "kv": kv.data, "kv_indptr": layout.kv_indptr, "kv_scale": kv.scales}
        bufs = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) if v is not None else None
                for k, v in host.items()}
        bufs["out"] = runtime.DeviceArray((b, 16, 512), np.uint16)
        bufs["lse"] = runtime.DeviceArray((b, 16), np.float32)
        extra = dict(fp8_scale=kv.fp8_scale if fmt == "fp8" else None)

        def run():
            dec.run(**bufs, **extra)

        run()
        runtime.synchronize()
        launch = dec._launch
        figures = [(median_us(f, a.calls, False), median_us(f, a.calls, True)) for f in (run, launch, c_noop)]
        print(f"{fmt:>6} " + " ".join(f"{busy:5.1f} /{idle:5.1f}" for busy, idle in figures), flush=True)
        if a.after_torch:
            import torch

            x = torch.randn(b, 16, 576, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, 2048, 576, device="cuda", dtype=torch.bfloat16)
            torch.softmax(torch.bmm(x, k.transpose(1, 2)).float(), dim=-1)
            torch.cuda.synchronize()
            for label, pause in (("right after torch ops", 0.0), ("1 s later", 1.0)):
                time.sleep(pause)
                print(f"{fmt:>6} run, busy GPU, {label}: {median_us(run, a.calls, False):5.1f}", flush=True)
        dec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
