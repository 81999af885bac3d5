"""A small ragged decode in every KV format, contiguous and paged, for compute-sanitizer
(memcheck, racecheck).

Covers the irregular paths: an empty sequence, a 1-token sequence, tails that are not
multiples of the 64-token tile, a sequence long enough to be split (so its items merge
the partials in the kernel, core/merge.h), page tables of page size 1 and 16 with
pages in random order, several query tokens at 8 and 32 heads, a ragged step whose usual
split has more items than slots, so the fit's longer chunk runs (NVIDIA; on by default
there), fp8 / mxfp4 Q (quantized in the block), and 64 / 128 heads (on sm_90 an mxfp4
or fp8 cache then runs the 64-head kernel). Exits non-zero if any output is non-finite or far from the emulator.
"""

import sys

import ml_dtypes
import numpy as np

from hipmla.decode import Decoder
from hipmla.inputs import make_inputs
from hipmla.paging import random_page_table, scatter

LENS = np.array([0, 1, 65, 300, 129, 9000])


def main() -> int:
    worst = 0.0
    rng = np.random.default_rng(0)
    for fmt in ("bf16", "fp8", "mxfp4"):
        with Decoder(fmt, 1 / 24) as dec:
            inputs = make_inputs(LENS, fmt, seed=1, fp8_variant=dec.fp8_variant)
            cases = [("contiguous", inputs.kv, inputs.layout)]
            for page_size in (1, 16):
                layout = random_page_table(LENS, page_size, rng, spare_pages=3)
                cases.append((f"page {page_size}", scatter(inputs.kv, layout), layout))
            for name, kv, layout in cases:
                out, lse = dec.decode(inputs.q, kv, layout)
                emu, _ = dec.emulate(inputs.q, kv, layout)
                o = out.astype(np.float32)
                if not np.isfinite(o).all():
                    print(f"{fmt} {name}: non-finite output")
                    return 1
                err = float(np.abs(o - emu.astype(np.float32)).max())
                worst = max(worst, err)
                print(f"{fmt} {name}: max |device - emulator| = {err:.3e}")
            if not corrupted_steps(dec, inputs):
                return 1
        worst = max(worst, several_query_tokens(fmt, rng))
        worst = max(worst, fit_step(fmt, rng))
        worst = max(worst, quantized_q(fmt, rng))
        worst = max(worst, many_heads(fmt, rng))
        worst = max(worst, query_rows(fmt, rng))
    return 0 if worst < 1e-2 else 1


def query_rows(fmt: str, rng) -> float:
    """16 heads x q_len 0..6 ragged and 32 heads x 0..3, page table of 16, the decoder given
    q_len 4 / 2 (on sm_90 an mxfp4 or fp8 cache runs the 64-row kernel with rows of 4 / 2 query
    tokens, some of fewer), and 8 heads x 0..5 (two query tokens a 16-head row, some of one:
    nothing may be read or written past the row's query heads): the worst |device - emulator|."""
    worst = 0.0
    for heads, q_lens in ((16, np.array([4, 0, 1, 6, 3, 4])), (32, np.array([2, 1, 0, 3, 2, 2])),
                          (8, np.array([3, 1, 0, 2, 5, 1]))):
        lens = LENS + q_lens
        qo = np.concatenate([[0], np.cumsum(q_lens)])
        layout = random_page_table(lens, 16, rng, spare_pages=3)
        kv = scatter(make_inputs(lens, fmt, seed=6).kv, layout)
        q = rng.standard_normal((int(qo[-1]), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        with Decoder(fmt, 1 / 24, heads=heads, max_batch=lens.size, max_q_tokens=int(qo[-1]),
                     q_len=64 // heads) as dec:
            out, _ = dec.decode(q, kv, layout, qo_indptr=qo)
            emu, _ = dec.emulate(q, kv, layout, qo_indptr=qo)
            symbol = dec.kernel_symbol
        err = float(np.abs(out.astype(np.float32) - emu.astype(np.float32)).max())
        print(f"{fmt} {heads} heads ({symbol}), q_len {q_lens.tolist()}: max |device - emulator| = {err:.3e}")
        worst = max(worst, err if np.isfinite(out.astype(np.float32)).all() else np.inf)
    return worst


def many_heads(fmt: str, rng) -> float:
    """64 and 128 heads through page tables of 1 and 16 (on sm_90 an mxfp4 cache runs the
    64-head kernel: 4 slots and 4 row merges an item; fp8 too): the worst |device - emulator|."""
    worst = 0.0
    for heads in (64, 128):
        with Decoder(fmt, 1 / 24, heads=heads) as dec:
            inputs = make_inputs(LENS, fmt, seed=5, heads=heads, fp8_variant=dec.fp8_variant)
            for page_size in (1, 16):
                layout = random_page_table(LENS, page_size, rng, spare_pages=3)
                kv = scatter(inputs.kv, layout)
                out, _ = dec.decode(inputs.q, kv, layout)
                emu, _ = dec.emulate(inputs.q, kv, layout)
                err = float(np.abs(out.astype(np.float32) - emu.astype(np.float32)).max())
                print(f"{fmt} {heads} heads ({dec.kernel_symbol}), page {page_size}: "
                      f"max |device - emulator| = {err:.3e}")
                worst = max(worst, err if np.isfinite(out.astype(np.float32)).all() else np.inf)
    return worst


def quantized_q(fmt: str, rng) -> float:
    """fp8 and mxfp4 Q through a page table of 16 (the block quantizes Q in shared memory
    first): the worst |device - emulator|."""
    layout = random_page_table(LENS, 16, rng, spare_pages=3)
    worst = 0.0
    for q_precision in ("fp8", "mxfp4"):
        with Decoder(fmt, 1 / 24, q_precision=q_precision) as dec:
            inputs = make_inputs(LENS, fmt, seed=4, fp8_variant=dec.fp8_variant)
            kv = scatter(inputs.kv, layout)
            out, _ = dec.decode(inputs.q, kv, layout)
            emu, _ = dec.emulate(inputs.q, kv, layout)
        err = float(np.abs(out.astype(np.float32) - emu.astype(np.float32)).max())
        print(f"{fmt} q {q_precision}, page 16: max |device - emulator| = {err:.3e}")
        worst = max(worst, err if np.isfinite(out.astype(np.float32)).all() else np.inf)
    return worst


#: 36 sequences of 900 tokens and 4 short ones: on 132 SMs the usual split gives one item
#: a row more than its 264 slots, so the fit runs.
FIT_LENS = np.array([900] * 36 + [0, 1, 65, 129])


def fit_step(fmt: str, rng) -> float:
    """The fit's schedule (hipmla.schedule, FIT_EIGHTHS) through a page table of 16: the
    worst |device - emulator|, inf where the output is not finite; the step is skipped
    (0) where the decoder does not run the fit (AMD) or the device's CU count does not
    reach it with FIT_LENS."""
    from hipmla.schedule import schedule

    with Decoder(fmt, 1 / 24, max_batch=FIT_LENS.size) as dec:
        fit = schedule(FIT_LENS, dec.policy).fit if dec.policy.fit else 0
        if not fit:
            print(f"{fmt} fit: not run (fit {dec.policy.fit}, {dec.device.num_cus} CUs)")
            return 0.0
        layout = random_page_table(FIT_LENS, 16, rng, spare_pages=3)
        kv = scatter(make_inputs(FIT_LENS, fmt, seed=3, fp8_variant=dec.fp8_variant).kv, layout)
        q = rng.standard_normal((FIT_LENS.size, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        out, _ = dec.decode(q, kv, layout)
        emu, _ = dec.emulate(q, kv, layout)
    err = float(np.abs(out.astype(np.float32) - emu.astype(np.float32)).max())
    print(f"{fmt} fit (chunk {fit}): max |device - emulator| = {err:.3e}")
    return err if np.isfinite(out.astype(np.float32)).all() else np.inf


def several_query_tokens(fmt: str, rng) -> float:
    """32 heads, q_len 0..5 ragged through a page table of 16 (a row per head group and
    query token; causal clamps at split boundaries): the worst |device - emulator|."""
    q_lens = np.array([2, 0, 1, 5, 3, 4])
    lens = LENS + q_lens
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    layout = random_page_table(lens, 16, rng, spare_pages=3)
    kv = scatter(make_inputs(lens, fmt, seed=2).kv, layout)
    q = rng.standard_normal((int(qo[-1]), 32, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    with Decoder(fmt, 1 / 24, heads=32, max_batch=lens.size, max_q_tokens=int(qo[-1])) as dec:
        out, _ = dec.decode(q, kv, layout, qo_indptr=qo)
        emu, _ = dec.emulate(q, kv, layout, qo_indptr=qo)
    err = float(np.abs(out.astype(np.float32) - emu.astype(np.float32)).max())
    print(f"{fmt} 32 heads, q_len {q_lens.tolist()}: max |device - emulator| = {err:.3e}")
    return err if np.isfinite(out.astype(np.float32)).all() else np.inf


def corrupted_steps(dec: Decoder, inputs) -> bool:
    """Device-side page tables that point outside the pool or decrease: the kernels must
    read nothing outside the arrays (memcheck), write NaN for that sequence and flag it."""
    from hipmla import runtime
    from hipmla.decode import DeviceInputError

    rng = np.random.default_rng(1)
    good = random_page_table(LENS, 16, rng)
    pool = scatter(inputs.kv, good)
    for name, seq, change in (("page past the pool", 5, lambda ip, ix, la: ix.__setitem__(ip[5] + 3, 10**6)),
                              ("negative page", 3, lambda ip, ix, la: ix.__setitem__(ip[3], -5)),
                              ("decreasing indptr", 3, lambda ip, ix, la: ip.__setitem__(4, ip[3] - 2)),
                              # an int64 offset past 2^31 cast to int32 (int32 end - first wrapped)
                              ("wrapped indptr", 3, lambda ip, ix, la: ip.__setitem__(4, -2**31 + 2))):
        ip, ix, la = good.kv_indptr.copy(), good.kv_indices.copy(), good.kv_last_page_len.copy()
        change(ip, ix, la)
        host = {"q": inputs.q.view(np.uint16), "kv": pool.data, "kv_indptr": ip, "kv_indices": ix,
                "kv_last_page_len": la}
        if pool.scales is not None:
            host["kv_scale"] = pool.scales
        dev = {k: runtime.DeviceArray.from_host(np.ascontiguousarray(v)) for k, v in host.items()}
        out = runtime.DeviceArray((len(LENS), 16, 512), np.uint16)
        dec.run(out=out, page_size=16, fp8_scale=pool.fp8_scale if pool.format == "fp8" else None, **dev)
        got = out.to_host().view(np.uint16)
        for a in list(dev.values()) + [out]:
            a.free()
        nan = bool((((got[seq] & 0x7F80) == 0x7F80) & ((got[seq] & 0x7F) != 0)).all())
        try:
            dec.check_errors()
            flagged = 0
        except DeviceInputError as e:
            flagged = e.bits
        print(f"{dec.config.kv_format} {name}: error bits {flagged}, sequence {seq} NaN: {nan}")
        if not flagged or not nan:
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
