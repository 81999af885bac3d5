"""``bench --mtp``: several heads or query tokens a sequence (128 heads x 1 token, 16 heads
x 4 tokens, 8 heads x 2 tokens, ...), as TFLOP/s against a bf16 matmul and GB/s against the
read stream, both measured in the same run."""

from __future__ import annotations

import statistics

import ml_dtypes
import numpy as np

from hipmla import kernels, runtime
from hipmla.bench.probes import Timer, git_commit, matmul_tflops, read_gbs
from hipmla.bench.steps import bytes_moved
from hipmla.decode import Decoder
from hipmla.inputs import BENCH_SM_SCALE, random_cache
from hipmla.paging import KvLayout

#: Several heads / query tokens a sequence: (heads, query tokens per sequence); 8 heads x 1
#: fill half of each 16-head row, 8 x 2 and 4 x 4 a whole row (two and four tokens a row).
MTP_CASES = ((128, 1), (64, 1), (32, 2), (16, 2), (16, 4), (8, 1), (8, 2), (4, 4))
MTP_BATCHES = (32, 128)
MTP_KV_LEN = 8192


def mtp_flops(heads: int, seen_tokens: int) -> int:
    """FLOP of a step: a multiply-add per Q.K column (576) and P.V column (512) of every
    score; ``seen_tokens`` sums the kv tokens each query token sees."""
    return 2 * heads * seen_tokens * (576 + 512)


def _peers(dec: Decoder) -> list[kernels.KernelSpec | None]:
    """The decoder's own kernel (None), then, where the 64-row sm_90a kernel serves its cache
    and Q, the other of that kernel and the 16-row sm_90 kernel, timed in the same run for
    the comparison (what kernels.ROWS64_MIN_ROWS rests on)."""
    fmt, qp = dec.config.kv_format, dec.config.q_precision
    if dec.device.arch.split(":", 1)[0] != "sm_90" or fmt not in kernels.ROWS64_FORMATS or qp != "bf16":
        return [None]
    rows64 = kernels.sm90_rows64_kernel(fmt)
    if not rows64.serves_heads(dec.config.heads):  # below 16 heads: the 16-row kernel alone
        return [None]
    return [None, kernels.sm90_split_kernel(fmt, qp) if dec.kernel_symbol == rows64.symbol else rows64]


def run_mtp_bench(formats, iters: int, device: int) -> list[dict]:
    """µs (L2 flushed), TFLOP/s with % of the measured bf16 matmul rate, and GB/s of the
    unique bytes with % of the measured read bandwidth, for MTP_CASES x MTP_BATCHES (and the
    16-head sm_90 kernel beside the 64-head one where the decoder picks that)."""
    info = runtime.device_info(device)
    timer = Timer(info.l2_bytes)
    read, mma = read_gbs(), matmul_tflops()
    print(f"hipmla bench --mtp: {info.name} ({info.arch}), read {'-' if read is None else f'{read:.0f}'} GB/s, "
          f"bf16 matmul {'-' if mma is None else f'{mma:.0f}'} TFLOP/s (both measured now), commit {git_commit()}",
          flush=True)
    rng = np.random.default_rng(0)
    out_rows = []
    print(f"{'kv':>5} {'heads':>5} {'q/seq':>5} {'bs':>4} {'med_us':>9} {'TFLOP/s':>8} {'%mma':>6} "
          f"{'GB/s':>7} {'%read':>6}  kernel")
    for fmt in formats:
        kv = random_cache(max(MTP_BATCHES) * MTP_KV_LEN, fmt, rng)
        stride = kv.scales.shape[1] if fmt == "mxfp4" else 0
        for heads, n in MTP_CASES:
            for b in MTP_BATCHES:
                lens = np.full(b, MTP_KV_LEN)
                t_q = b * n
                layout = KvLayout.contiguous(lens)
                qo = np.arange(0, t_q + 1, n, dtype=np.int32)
                first = Decoder(fmt, BENCH_SM_SCALE, heads=heads, device=device, max_batch=b, max_q_tokens=t_q,
                                q_len=n)
                q = rng.standard_normal((t_q, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
                host = {"q": q.view(np.uint16), "kv": kv.data, "kv_indptr": layout.kv_indptr.astype(np.int32),
                        "qo_indptr": qo, "kv_scale": kv.scales}
                bufs = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) if v is not None else None
                        for k, v in host.items()}
                bufs["out"] = runtime.DeviceArray((t_q, heads, 512), np.uint16)
                extra = dict(fp8_scale=kv.fp8_scale if fmt == "fp8" else None)
                for peer in _peers(first):
                    dec = first if peer is None else Decoder(fmt, BENCH_SM_SCALE, heads=heads, device=device,
                                                             max_batch=b, max_q_tokens=t_q, kernel=peer)
                    med = statistics.median(timer.time(lambda: dec.run(**bufs, **extra), iters, flush=True))
                    seen = int(sum(MTP_KV_LEN - n + j + 1 for j in range(n))) * b
                    tflops = mtp_flops(heads, seen) / (med * 1e-6) / 1e12
                    moved = bytes_moved(fmt, int(lens.sum()), t_q, stride, 0, heads=heads)
                    gbs = moved / (med * 1e-6) / 1e9
                    row = dict(kv=fmt, heads=heads, q_per_seq=n, batch=b, kv_len=MTP_KV_LEN, med_us=med,
                               tflops=tflops, pct_mma=None if mma is None else 100 * tflops / mma, gbs=gbs,
                               pct_read=None if read is None else 100 * gbs / read, kernel=dec.kernel_symbol)
                    out_rows.append(row)
                    pct_mma = "-" if mma is None else f"{row['pct_mma']:.1f}"
                    pct_read = "-" if read is None else f"{row['pct_read']:.1f}"
                    print(f"{fmt:>5} {heads:>5} {n:>5} {b:>4} {med:9.1f} {tflops:8.1f} {pct_mma:>6} {gbs:7.0f} "
                          f"{pct_read:>6}  {dec.kernel_symbol}", flush=True)
                    if dec is not first:
                        dec.close()
                for a in bufs.values():
                    if a is not None:
                        a.free()
                first.close()
    return out_rows
