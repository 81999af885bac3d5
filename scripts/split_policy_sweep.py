"""Device time of the decoder's kernel under other split policies, side by side.

The split (hipmla.schedule.SplitPolicy: items per CU, shortest split) decides how many
items, hence how many partial slots per row, a step gets: more items fill the GPU and
shorten each item's chain of tiles; more slots per row lengthen the merge. This times
the decoder's own kernel with each policy on the same buffers (CUDA events, L2 flushed,
median of --iters) so the trade-off is measured, not guessed.

    python3 scripts/split_policy_sweep.py [--formats mxfp4,fp8] [--shapes 4x1k,4x8k,rag64,...]
        [--policies 2:256,2:128:16,4:128,2:128:16+lone]
        (items_per_cu:min_split_tokens[:max_ranges[:align]], "+lone": the lone split may run,
        as the decoder's default policy on NVIDIA; "default": the decoder's own policy; a
        trailing "+fit1" / "+fit0": the fit on / off, hipmla.schedule.FIT_EIGHTHS)
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import runtime  # noqa: E402
from hipmla.bench import Timer, device_step, ragged_mixes, read_gbs  # noqa: E402
from hipmla.decode import Decoder  # noqa: E402
from hipmla.inputs import BENCH_SM_SCALE, random_cache  # noqa: E402
from hipmla.paging import KvLayout  # noqa: E402
from hipmla.schedule import SplitPolicy, schedule  # noqa: E402


def parse_shape(text: str) -> np.ndarray:
    """Sequence lengths of a shape: "BxN" (B sequences of N tokens, N may end in k) or one
    of the bench's ragged mixes (rag64, rag300, long+short)."""
    mixes = ragged_mixes()
    if text in mixes:
        return mixes[text]
    b, n = text.lower().split("x")
    return np.full(int(b), int(n[:-1]) * 1024 if n.endswith("k") else int(n))


def parse_policy(text: str, num_cus: int, default: SplitPolicy) -> SplitPolicy:
    """items_per_cu:min_split_tokens[:max_ranges[:align]][+lone] (max_ranges 0 when left out)."""
    spec, lone = (text[:-5], True) if text.endswith("+lone") else (text, False)
    items_per_cu, min_tokens, *rest = (int(x) for x in spec.split(":"))
    return dataclasses.replace(SplitPolicy.for_device(num_cus, default.fast_tile, items_per_cu, lone=lone),
                               min_split_tokens=min_tokens, max_ranges=rest[0] if rest else 0,
                               align_tokens=rest[1] if len(rest) > 1 else default.align_tokens)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="mxfp4,fp8")
    ap.add_argument("--shapes", default="4x1k,4x8k,32x1k,64x1k,32x8k,256x1k")
    ap.add_argument("--policies", default="2:256,2:128,3:128,4:128,4:256")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    shapes = {s: parse_shape(s) for s in args.shapes.split(",")}
    policies = args.policies.split(",")
    info = runtime.device_info(0)
    timer = Timer(info.l2_bytes)
    print(f"{info.name}: read {read_gbs() or float('nan'):.0f} GB/s; us, L2 flushed, median of {args.iters}; "
          f"policy = items_per_cu:min_split_tokens[:max_ranges[:align]][+lone][+fit0|1] "
          "(items, slots per row; L: lone split, F: fitted)")
    print(f"{'kv':>6} {'shape':>7} " + " ".join(f"{pol:>22}" for pol in policies))
    rng = np.random.default_rng(0)
    for fmt in args.formats.split(","):
        kv = random_cache(max(int(lens.sum()) for lens in shapes.values()), fmt, rng)
        for name, lens in shapes.items():
            layout = KvLayout.contiguous(lens)
            _, bufs, extra = device_step(kv, layout, rng)
            cells = []
            for text in policies:
                spec, marked, fit = text.partition("+fit")
                dec = Decoder(fmt, BENCH_SM_SCALE, max_batch=1)
                policy = dec.policy if spec == "default" else parse_policy(spec, info.num_cus, dec.policy)
                if marked:
                    policy = dataclasses.replace(policy, fit=fit == "1")
                # The scratch (reserve) and the launch are sized from dec.policy: set it
                # first, then grow from one row to b, so the slots follow this policy.
                dec.policy = policy
                dec._params.set_split(policy)
                dec.reserve(len(lens))
                sched = schedule(lens, policy)
                t = statistics.median(timer.time(lambda: dec.run(**bufs, **extra), args.iters, flush=True))
                mark = "L" if sched.lone else "F" if sched.fit else " "
                cells.append(f"{t:8.1f} ({sched.size:4d}, {int(sched.n_items.max()):3d}){mark}")
                dec.close()
            print(f"{fmt:>6} {name:>7} " + " ".join(f"{c:>22}" for c in cells), flush=True)
            for a in bufs.values():
                if a is not None:
                    a.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
