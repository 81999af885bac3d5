"""Where a short decode step's time goes, block by block: the sm_90 kernel with time stamps.

A copy of hip_src is edited (text insertions into decode/split_sm90.hip, each of which must
apply exactly once, so a changed kernel makes this script fail, not lie) so that thread 0
of every block reads %globaltimer (ns, one clock for the whole GPU) at the phase
boundaries below and, at its end, writes them into partial slot grid + its block index of
the decoder's scratch (reserved twice as large; the items' own slots are the claimed
items', hip_src/core/placement.h), which the script reads back after the last timed call.
The build's OUTPUTS ARE WRONG; its stamps and its time are what it is for.

    python3 scripts/sm90_timeline.py [--formats mxfp4] [--shapes 4x1k,4x8k,32x1k] [--iters 20] [--page-size 16]

Stamps: start, schedule (the device schedule's item), prologue (Q in registers, the first
tiles issued), tiles (the tile loop), stored (the item's partial or output written),
arrived (the merge counter), end (merge done, for the last block of a split row).
Printed relative to the earliest block start of the launch, medians over the blocks that
got an item, beside the launch's CUDA-event time (L2 flushed).
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import kernels, runtime  # noqa: E402
from hipmla.bench import Timer, lens_step  # noqa: E402
from hipmla.decode import Decoder  # noqa: E402
from hipmla.inputs import BENCH_SM_SCALE, random_cache  # noqa: E402
from hipmla.schedule import SplitPolicy  # noqa: E402

KERNEL = "decode/split_sm90.hip"
PHASES = ("start", "schedule", "prologue", "tiles", "stored", "arrived", "end")
# Inside the schedule (core/schedule.h), as thread 0 passes them: after the first scan (the
# lengths read), its chunk and item counts done ("counts"), after the second scan (whose
# barrier waits for the placement claim), its item found ("found"), after the barrier that
# publishes the item ("search"), and at its return (the page check).
SCHEDULE = ("scan 1", "counts", "scan 2", "found", "search", "pages")
SCHED = 12  # the record's first SCHEDULE word
WORDS = SCHED + len(SCHEDULE)  # u64 per block record: PHASES, seq, tokens, n_items, last, smid, then SCHEDULE
SLOT_WORDS = 16 * 512 // 2  # u64 per partial slot: block b records into slot grid + b

STAMP = "HIPMLA_STAMP"
HELPERS = f"""
namespace hipmla {{ namespace sm90k {{
HIPMLA_DEVICE unsigned timeline_smid() {{
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}}
}} }}
constexpr long long SLOT_WORDS = {SLOT_WORDS};
#define {STAMP}(k) do {{ if (thread_index() == 0) hipmla_stamp[k] = timer_ns(); }} while (0)
"""
RECORD = """
    if (thread_index() == 0) {
        unsigned long long* rec = reinterpret_cast<unsigned long long*>(p.part_acc) +
            (long long)(block_count() + block_index()) * SLOT_WORDS;
        for (int k = 0; k < 7; ++k) rec[k] = hipmla_stamp[k];
        rec[7] = (unsigned long long)(long long)%(seq)s;
        rec[8] = (unsigned long long)(long long)%(tokens)s;
        rec[9] = (unsigned long long)(long long)%(items)s;
        rec[10] = %(last)s;
        rec[11] = timeline_smid();
        for (int k = 0; k < %(stamps)s; ++k) rec[%(sched)s + k] = hipmla_sched_stamp[k];
    }
"""
SCHEDULE_FILE = "core/schedule.h"
SCHEDULE_HELPERS = """
__shared__ unsigned long long hipmla_sched_stamp[6];
#define HIPMLA_SCHED_STAMP(k) do { if (thread_index() == 0) hipmla_sched_stamp[k] = timer_ns(); } while (0)
"""
SCHEDULE_EDITS = [
    ("namespace hipmla {\n\nstruct WorkItem {", "namespace hipmla {\n" + SCHEDULE_HELPERS + "\nstruct WorkItem {"),
    ("    block_exclusive_scan<THREADS>(mine, sm, 0, p.batch, total, active);\n",
     "    block_exclusive_scan<THREADS>(mine, sm, 0, p.batch, total, active);\n    HIPMLA_SCHED_STAMP(0);\n"),
    ("    long long n_all = 0;\n", "    HIPMLA_SCHED_STAMP(1);\n    long long n_all = 0;\n"),
    ("    if (qo_bad) atomic_or_block(&sm.qo_bad, 1);", "    HIPMLA_SCHED_STAMP(2);\n    if (qo_bad) atomic_or_block(&sm.qo_bad, 1);"),
    ("    block_sync();\n    WorkItem it = sm.item;",
     "    HIPMLA_SCHED_STAMP(3);\n    block_sync();\n    HIPMLA_SCHED_STAMP(4);\n    WorkItem it = sm.item;"),
    ("    block_sync();  // sm is free for the kernel's own use after this\n",
     "    block_sync();  // sm is free for the kernel's own use after this\n    HIPMLA_SCHED_STAMP(5);\n"),
]
# (old, new) on the kernel's source; each old must occur exactly once.
EDITS = [
    ('#include "arch/sm90.h"\n', '#include "arch/sm90.h"\n' + HELPERS),
    ("    if (dynamic_smem_size() < sizeof(Smem)) __trap();\n",
     "    if (dynamic_smem_size() < sizeof(Smem)) __trap();\n"
     "    unsigned long long hipmla_stamp[7] = {0, 0, 0, 0, 0, 0, 0};\n    HIPMLA_STAMP(0);\n"),
    ("    if (it.seq < 0) return;\n",
     "    HIPMLA_STAMP(1);\n    if (it.seq < 0) {" + RECORD % dict(seq="-1", tokens="0", items="0", last="0", stamps=len(SCHEDULE), sched=SCHED) + "return; }\n"),
    ("    // x is the partial-score exchange from here on",
     "    HIPMLA_STAMP(2);\n    // x is the partial-score exchange from here on"),
    ("    // ---- the item's state: m, l of head sh; O of heads g, g + 8\n",
     "    HIPMLA_STAMP(3);\n    // ---- the item's state: m, l of head sh; O of heads g, g + 8\n"),
    ("    if (slot >= 0) merge_split_row<THREADS>(p, done, &sm.last);\n",
     "    HIPMLA_STAMP(4);\n    unsigned long long hipmla_last = 0;\n"
     "    if (slot >= 0) merge_split_row<THREADS>(p, done, &sm.last, hipmla_stamp, hipmla_last);\n"
     "    else { HIPMLA_STAMP(5); HIPMLA_STAMP(6); }\n    block_sync();\n"
     + RECORD % dict(seq="done.seq", tokens="done.end - done.begin", items="done.n_items", last="hipmla_last",
                    stamps=len(SCHEDULE), sched=SCHED)),
]
# The merge's own stamps (core/merge.h is parsed before the kernel's helpers exist): the
# block's share known ("arrived"), its merge done ("end"); the record's "merged" word: 0 none,
# 1 a share of the row's columns, 2 the whole row.
MERGE_FILE = "core/merge.h"
MERGE_EDITS = [
    ("constexpr int MERGE_GROUPS = D_V / 4;",
     "#define HIPMLA_MERGE_STAMP(k) do { if (thread_index() == 0) hipmla_stamp[k] = timer_ns(); } while (0)\n"
     "constexpr int MERGE_GROUPS = D_V / 4;"),
    ("HIPMLA_DEVICE void merge_split_row(const MlaDecodeParams& p, const WorkItem& it, int* flag) {",
     "HIPMLA_DEVICE void merge_split_row(const MlaDecodeParams& p, const WorkItem& it, int* flag,\n"
     "                                   unsigned long long* hipmla_stamp, unsigned long long& hipmla_merged) {"),
    ("    const int share = *flag;\n",
     "    const int share = *flag;\n    HIPMLA_MERGE_STAMP(5);\n"
     "    hipmla_merged = share == MERGE_NONE ? 0ull : share == MERGE_ALL ? 2ull : 1ull;\n"),
    ("    if (t0) reset_counters(p, it, done);\n}",
     "    HIPMLA_MERGE_STAMP(6);\n    if (t0) reset_counters(p, it, done);\n}"),
]
SHAPES = {"4x1k": (4, 1024), "4x8k": (4, 8192), "8x8k": (8, 8192), "32x1k": (32, 1024), "64x1k": (64, 1024),
          "64x8k": (64, 8192)}


def edited_tree(original: Path, root: Path) -> None:
    shutil.copytree(original, root)
    for file, edits in ((KERNEL, EDITS), (SCHEDULE_FILE, SCHEDULE_EDITS), (MERGE_FILE, MERGE_EDITS)):
        path = root / file
        text = path.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"the edit {old.strip()[:60]!r} no longer matches {file} exactly once; update the edits")
            text = text.replace(old, new)
        path.write_text(text)


def summarize(rec: np.ndarray, event_us: float) -> str:
    """rec: (blocks, WORDS) u64 of the grid's blocks (row = block index; rows of blocks that
    wrote no record are zero)."""
    seq = rec[:, 7].astype(np.int64)
    wrote = rec[:, 0] > 0
    first = [int(x) for x in rec[:8, 11]] if wrote[:8].all() else []
    rec, seq = rec[wrote], seq[wrote]
    t0 = rec[:, 0].min()
    rel = (rec[:, :7].astype(np.int64) - np.int64(t0)) / 1e3  # us since the first block started
    work = seq >= 0
    last = work & (rec[:, 10] >= 1)
    split = work & (rec[:, 9] > 1)
    lines = [f"  event {event_us:.1f} us; blocks {len(rec)} ({work.sum()} with an item, {last.sum()} merged); "
             f"span first start .. last end {rel[:, 6][work].max() if work.any() else 0:.1f} us; "
             f"block starts {rel[:, 0].min():.1f} .. {rel[:, 0].max():.1f} us (median {np.median(rel[:, 0]):.1f})"]
    if work.any():
        # Which SMs the blocks with an item ran on (%smid): the hardware places a launch's
        # blocks, and two of an SM's block slots may fill before another SM gets one.
        per_sm = np.bincount(rec[work, 11].astype(np.int64))
        lines.append(f"  placement: {int(work.sum())} blocks with an item on {int(np.count_nonzero(per_sm))} SMs "
                     f"(at most {int(per_sm.max())} an SM); blocks 0..7 on SMs {first}")
    if (~work).any():
        e = rel[~work]
        lines.append(f"  empty blocks: schedule done at median {np.median(e[:, 1]):.1f} us (max {e[:, 1].max():.1f})")
        # The latest of them, stamp by stamp (us since the launch's first start): where a
        # block without an item spends its time (the placement's wait, a late start).
        inner = (rec[~work, SCHED:WORDS].astype(np.int64) - np.int64(t0)) / 1e3
        for k in np.argsort(e[:, 1])[-4:]:
            lines.append(f"    block {int(np.flatnonzero(~work)[k])} on SM {int(rec[~work][k, 11])}: start {e[k, 0]:.1f}, "
                         + ", ".join(f"{SCHEDULE[j]} {inner[k, j]:.1f}" for j in range(len(SCHEDULE))) + f", done {e[k, 1]:.1f}")
    if work.any():
        w = rel[work]
        steps = np.diff(w[:, :7], axis=1)
        desc = ", ".join(f"{PHASES[k + 1]} +{np.median(steps[:, k]):.2f}" for k in range(6))
        lines.append(f"  blocks with an item, medians (us): start {np.median(w[:, 0]):.1f}; {desc}")
        inner = (rec[work, SCHED:WORDS].astype(np.int64) - rec[work, :1].astype(np.int64)) / 1e3
        marks = ", ".join(f"{SCHEDULE[k]} {np.median(inner[:, k]):.2f}" for k in range(len(SCHEDULE)))
        lines.append(f"  inside the schedule, us after the block's start (medians): {marks}")
        lines.append(f"  tokens per item: median {int(np.median(rec[work, 8]))}, items per row {int(np.median(rec[work, 9]))}; "
                     f"latest 'stored' {w[:, 4].max():.1f} us, latest 'arrived' {w[:, 5].max():.1f} us")
    if split.any():
        # Per sequence (its items share a kv range order): how far apart its items finished.
        done = {}
        for sq, t in zip(seq[split], rel[split, 4]):
            done.setdefault(int(sq), []).append(t)
        spread = [max(v) - min(v) for v in done.values()]
        lines.append(f"  split rows: {int((rec[split, 10] == 1).sum())} blocks merged a share, "
                     f"{int((rec[split, 10] == 2).sum())} a whole row, {int((rec[split, 10] == 0).sum())} none; "
                     f"'stored' spread within a sequence: median {np.median(spread):.2f} us, max {max(spread):.2f}")
    if last.any():
        m = rel[last]
        lines.append(f"  merging blocks: arrived at {np.median(m[:, 5]):.1f} us, merge +{np.median(m[:, 6] - m[:, 5]):.2f} us "
                     f"(max {(m[:, 6] - m[:, 5]).max():.2f}), end {m[:, 6].max():.1f} us")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp4")
    ap.add_argument("--shapes", default="4x1k,4x8k,32x1k")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=0, help="a paged cache, pages in random order (0: contiguous)")
    ap.add_argument("--warm-l2", action="store_true",
                    help="no L2 flush between launches: the lengths, Q, KV and the kernel's code stay in L2")
    ap.add_argument("--policy", default="", help="items_per_cu:min_split_tokens:max_ranges (default: the decoder's)")
    args = ap.parse_args(argv)
    info = runtime.device_info(0)
    timer = Timer(info.l2_bytes)
    layout_name = f"paged, {args.page_size} rows a page" if args.page_size else "contiguous"
    flushed = "L2 kept warm" if args.warm_l2 else "L2 flushed"
    print(f"{info.name}: sm_90 kernel with time stamps (%globaltimer), {layout_name}, {flushed}; "
          "the outputs of this build are wrong")
    original = kernels.hip_src_dir()
    rng = np.random.default_rng(0)
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "timeline"
        edited_tree(original, root)
        for fmt in args.formats.split(","):
            max_b = max(b for b, _ in shapes.values())
            kv = random_cache(max(b * n for b, n in shapes.values()), fmt, rng)
            kernels.hip_src_dir = lambda: root
            spec = kernels.sm90_split_kernel(fmt)
            spec = dataclasses.replace(spec, defines=spec.defines + (("HIPMLA_TIMELINE", "1"),))
            dec = Decoder(fmt, BENCH_SM_SCALE, selftest=False, max_batch=1, kernel=spec)
            if args.policy:
                per_cu, min_tokens, max_ranges = (int(x) for x in args.policy.split(":"))
                dec.policy = dataclasses.replace(SplitPolicy.for_device(info.num_cus, items_per_cu=per_cu),
                                                 min_split_tokens=min_tokens, max_ranges=max_ranges)
                dec._params.set_split(dec.policy)
            # The scratch follows dec.policy; slots [grid, 2 grid) hold the records.
            dec.reserve(2 * max_b + dec.policy.target_items)
            kernels.hip_src_dir = lambda: original
            for name, (b, n) in shapes.items():
                _, bufs, extra = lens_step(kv, np.full(b, n), args.page_size, rng)
                times = timer.time(lambda: dec.run(**bufs, **extra), args.iters, flush=not args.warm_l2)
                grid = kernels.grid_decode(dec.policy.max_items(b))[0]
                slots = runtime.DeviceArray((grid, SLOT_WORDS), np.uint64,
                                            ptr=dec._scratch.ptr + grid * SLOT_WORDS * 8)
                raw = slots.to_host()[:, :WORDS]
                print(f"{fmt} {name}:")
                print(summarize(raw, statistics.median(times)))
                for a in bufs.values():
                    if a is not None:
                        a.free()
            dec.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
