"""Where the sm_90 kernel's time goes: builds with one part taken out, timed side by side.

Each variant edits a copy of hip_src (text replacements on decode/split_sm90.hip, each of
which must apply exactly once, so a changed kernel makes this script fail, not lie), and
the decoder runs it with its self-test off. The outputs of those builds are WRONG: only
their device time means something. Times are CUDA events, L2 flushed, median of --iters.

    python3 scripts/sm90_ablation.py [--formats mxfp4,fp8] [--shapes 64x8k,256x8k,4x1k,rag64] [--variants full,-merge]

With --tree NAME=DIR (repeatable) it also times the kernel of another hip_src tree (a
worktree of an earlier commit, a trial change) beside the variants: an A/B of two designs
on the same inputs, in one process. --check runs each build's known-answer self-test
first (for trees, whose outputs should be right); --page-size times a paged cache.
--one-block-per-sm also times every build launched with enough dynamic shared memory that
only one block fits an SM (rows "NAME 1/SM"): the same kernel, where the hardware cannot put
two of the step's items on one SM while another SM idles. --no-placement also times every
build with the decoder's placement off (rows "NAME item=block": block i runs item i, as
before hip_src/core/placement.h). --heads 64 or 128 times the kernel the decoder takes for
that many heads (with an fp8 or MXFP4 cache the 64-row kernel, decode/split_sm90_rows64.hip,
which the variants do not edit: trees only, --variants ''), and --same checks that every
build wrote the same output bytes as the first (for trees meant to change no numerics).
--shared-bytes N launches every build with at least N bytes of dynamic shared memory (for a
tree whose kernel needs more than the current one's: its own would trap).

hip_src/KERNELS.md ("sm_90: what was measured, tried and dropped") quotes runs of it.
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
from hipmla.bench import Timer, lens_step, ragged_mixes, read_gbs  # noqa: E402
from hipmla.decode import Decoder  # noqa: E402
from hipmla.inputs import BENCH_SM_SCALE, random_cache  # noqa: E402

KERNEL = "decode/split_sm90.hip"

# name -> [(old, new)] on the kernel's source, or [(file under hip_src, old, new)]. "copies" keeps the commits, so the ring's
# waits still count groups; the other loop edits keep every load whose result they use.
PARTS: dict[str, list[tuple[str, str]]] = {
    "copies": [("""        if (MXFP4) store_scales(tile + STAGES - 1, prev_stage);
        {
            const long long r = tile_row(tile + STAGES);
            if (MXFP4) load_scales(tile + STAGES, r);
            issue_tile(tile + STAGES, stage, r);
        }""", "        cp_async_commit();")],
    "convert": [("kf[j][kk][0] = e4m3x2_to_f16x2<0>(wv[kk]);\n                    kf[j][kk][1] = e4m3x2_to_f16x2<1>(wv[kk]);",
                 "kf[j][kk][0] = wv[kk];\n                    kf[j][kk][1] = wv[kk] >> 3;"),
                ("e2m1x8_to_bf16x2_scaled_down(wv[k], w4);",
                 "w4[0] = wv[k]; w4[1] = wv[k] ^ mv; w4[2] = wv[k] + mv; w4[3] = wv[k] - mv;")],
    "movmatrix": [("vt[step][kk][r][0] = movmatrix_trans(kf[2 * step][kk][r]);", "vt[step][kk][r][0] = kf[2 * step][kk][r];"),
                  ("vt[step][kk][r][1] = movmatrix_trans(kf[2 * step + 1][kk][r]);",
                   "vt[step][kk][r][1] = kf[2 * step + 1][kk][r];")],
    "partials": [("for (int w = 1; w < WARPS; ++w) {", "for (int w = 1; w < 1; ++w) {")],
    "pv": [("        for (int step = 0; step < PV_STEPS; ++step) {\n            const u32x4 pa",
            "        for (int step = 0; step < 0; ++step) {\n            const u32x4 pa")],
    "qk_mma": [("for (int j = 0; j < NTILES; ++j) mma_16816<F16>(s[j], qa[kk], kf[j][kk][0], kf[j][kk][1]);",
                "for (int j = 0; j < NTILES; ++j) { s[j][0] += f32_from_bits(kf[j][kk][0]); "
                "s[j][1] += f32_from_bits(kf[j][kk][1]); }")],
    "barriers": [("""            *reinterpret_cast<f32x2*>(&sm.x.red[warp][g + 8][8 * j + 2 * t]) = f32x2{s[j][2], s[j][3]};
        }
        block_sync();""", """            *reinterpret_cast<f32x2*>(&sm.x.red[warp][g + 8][8 * j + 2 * t]) = f32x2{s[j][2], s[j][3]};
        }"""), ("""        if (EARLY_WAIT) cp_async_wait<STAGES - 2>();
        block_sync();""", "        if (EARLY_WAIT) cp_async_wait<STAGES - 2>();")],
    "tiles": [("const int n_tiles = (n + TILE - 1) / TILE;", "const int n_tiles = 0;")],
    "merge": [("if (slot >= 0) merge_split_row<THREADS>", "if (false && slot >= 0) merge_split_row<THREADS>")],
    # What a launch costs before any work: the kernel returns at once, or after its schedule,
    "empty": [("    const WorkItem it = schedule_item<THREADS, HEADS>(",
               "    if (p.batch >= 0) return;\n    const WorkItem it = schedule_item<THREADS, HEADS>(")],
    "schedule": [("    if (it.seq < 0) return;", "    if (it.seq < 0 || p.batch >= 0) return;")],
    # Not removals: the copies as before they were rotated onto whole shared-memory lines,
    "unrotated": [("constexpr bool ROTATE = !MXFP4;", "constexpr bool ROTATE = false;")],
    # the schedule's scan adding its group's values in a loop to tid (a chain of loads),
    "scan_chain": [("core/schedule.h", """#pragma unroll
        for (int i = 0; i < SCAN_GROUP; ++i) {
            const int j = SCAN_GROUP * group + i;
            before += j < tid ? sm.scan[j] : 0;
        }""", """        for (int i = SCAN_GROUP * group; i < tid; ++i) before += sm.scan[i];""")],
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "full": (),
    **{f"-{name}": (name,) for name in PARTS},
    "-loop work": ("copies", "convert", "movmatrix", "partials", "pv", "qk_mma"),
    "-tiles -merge": ("tiles", "merge"),
    "unrotated": ("unrotated",),
    "empty": ("empty",),
    "schedule only": ("schedule",),
    "scan_chain": ("scan_chain",),
}
#: Dynamic shared memory that leaves room for one block an SM (the H200 has 228 KiB an SM
#: and reserves 1 KiB a block; a block may have 227 KiB).
ONE_BLOCK_SHARED = 120 * 1024
SHAPES = {"4x1k": (4, 1024), "4x8k": (4, 8192), "8x2k": (8, 2048), "6x4k": (6, 4096), "8x8k": (8, 8192),
          "2x32k": (2, 32768), "16x8k": (16, 8192), "32x1k": (32, 1024),
          "32x8k": (32, 8192), "64x8k": (64, 8192), "256x1k": (256, 1024), "256x8k": (256, 8192)}


def edited_source(root: Path, parts: tuple[str, ...]) -> None:
    for part in parts:
        for edit in PARTS[part]:
            file, old, new = edit if len(edit) == 3 else (KERNEL, *edit)
            path = root / file
            text = path.read_text()
            if text.count(old) != 1:
                raise SystemExit(f"{part}: the edit no longer matches {file} exactly once; update PARTS")
            path.write_text(text.replace(old, new))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp4,fp8")
    ap.add_argument("--shapes", default="64x8k,256x8k,4x1k")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS ('' for none)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="also time the kernel of another hip_src tree, unedited")
    ap.add_argument("--check", action="store_true", help="run each build's known-answer self-test first")
    ap.add_argument("--page-size", type=int, default=0, help="0: contiguous rows; else pages in random order")
    ap.add_argument("--one-block-per-sm", action="store_true",
                    help=f"also time each build with {ONE_BLOCK_SHARED} B of dynamic shared memory a block")
    ap.add_argument("--no-placement", action="store_true",
                    help="also time each build with Decoder(placement=False): item i on block i")
    ap.add_argument("--heads", type=int, default=16, choices=(16, 32, 64, 128),
                    help="query heads (default 16); the decoder's kernel for them is timed")
    ap.add_argument("--same", action="store_true", help="check every build's output bytes against the first's")
    ap.add_argument("--shared-bytes", type=int, default=0,
                    help="launch every build with at least this much dynamic shared memory (a tree whose kernel "
                         "needs more than the current one's)")
    args = ap.parse_args(argv)
    variants = {name: VARIANTS[name] for name in filter(None, args.variants.split(","))}
    rows64 = args.heads >= kernels.ROWS64_MIN_ROWS and any(f in kernels.ROWS64_FORMATS for f in args.formats.split(","))
    if variants and rows64:
        raise SystemExit(f"--heads {args.heads}: the 64-row kernel has no variants (they edit {KERNEL}); "
                         "pass --variants '' and --tree NAME=DIR")
    trees_in = {}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not (Path(path) / KERNEL).is_file():
            raise SystemExit(f"--tree: expected NAME=DIR with DIR/{KERNEL}, got {item!r}")
        trees_in[name] = Path(path).resolve()
    formats = args.formats.split(",")
    known = {name: np.full(b, n) for name, (b, n) in SHAPES.items()} | ragged_mixes()
    unknown = [name for name in args.shapes.split(",") if name not in known]
    if unknown:
        raise SystemExit(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    shapes = {name: known[name] for name in args.shapes.split(",")}
    info = runtime.device_info(0)
    timer = Timer(info.l2_bytes)
    layout_name = f"paged, {args.page_size} rows a page" if args.page_size else "contiguous rows"
    print(f"{info.name}: read {read_gbs() or float('nan'):.0f} GB/s; us, L2 flushed, median of {args.iters}, "
          f"{layout_name}")
    original = kernels.hip_src_dir()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for name, parts in variants.items():
            root = Path(tmp) / f"v{len(trees)}"
            shutil.copytree(original, root)
            edited_source(root, parts)
            trees[name] = root
        trees.update(trees_in)
        tree_index = {root: i for i, root in enumerate(trees.values())}
        runs = [(name, root, args.shared_bytes, True) for name, root in trees.items()]
        if args.one_block_per_sm:
            runs += [(f"{name} 1/SM", root, ONE_BLOCK_SHARED, True) for name, root in trees.items()]
        if args.no_placement:
            runs += [(f"{name} item=block", root, 0, False) for name, root in trees.items()]
        print(f"{'variant':>16} " + " ".join(f"{f + ' ' + s:>14}" for f in formats for s in shapes), flush=True)
        results = {name: [] for name, _, _, _ in runs}
        for fmt in formats:
            max_b = max(lens.size for lens in shapes.values())
            kv = random_cache(max(int(lens.sum()) for lens in shapes.values()), fmt, rng)
            for shape, lens in shapes.items():
                _, bufs, extra = lens_step(kv, lens, args.page_size, rng, args.heads)
                first_out = None
                for name, root, shared, placement in runs:
                    kernels.hip_src_dir = lambda root=root: root  # this process compiles from the edited copy
                    # A define of its own per tree: the runtime keeps one loaded kernel per spec
                    # (the placement on and off run one build).
                    spec = kernels.main_split_kernel(info.arch, fmt, "bf16", heads=args.heads)
                    spec = dataclasses.replace(spec, defines=spec.defines + (("HIPMLA_ABLATION_VARIANT",
                                                                              str(tree_index[root])),),
                                               dynamic_shared_bytes=max(shared, spec.dynamic_shared_bytes))
                    dec = Decoder(fmt, BENCH_SM_SCALE, heads=args.heads, selftest=args.check, max_batch=max_b,
                                  kernel=spec, placement=placement)
                    results[name].append(statistics.median(timer.time(lambda: dec.run(**bufs, **extra),
                                                                      args.iters, flush=True)))
                    # As it comes (stderr), so a run cut short still leaves its figures.
                    print(f"  {name} {fmt} {shape}: {results[name][-1]:.1f} us",
                          file=sys.stderr, flush=True)
                    dec.close()
                    if args.same:
                        out = bufs["out"].to_host()
                        if first_out is None:
                            first_out = out
                        elif not np.array_equal(out, first_out):
                            print(f"{name}: {fmt} output differs from {runs[0][0]}'s", flush=True)
                kernels.hip_src_dir = lambda: original
                for a in bufs.values():
                    if a is not None:
                        a.free()
        for name, times in results.items():
            print(f"{name:>16} " + " ".join(f"{t:14.1f}" for t in times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
