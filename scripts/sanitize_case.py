"""A small ragged decode in every KV format, contiguous and paged, for compute-sanitizer
(memcheck, racecheck).

Covers the irregular paths: an empty sequence, a 1-token sequence, tails that are not
multiples of the 64-token tile, a sequence long enough to be split (so the last block
of it merges the partials in the kernel), and page tables of page size 1 and 16 with
pages in random order. Exits non-zero if any output is non-finite or far from the
emulator.
"""

import sys

import numpy as np

from hipmla.decode import Decoder
from hipmla.emulate import emulate_decode
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
                emu, _ = emulate_decode(inputs.q, kv, layout, 1 / 24, dec.policy)
                o = out.astype(np.float32)
                if not np.isfinite(o).all():
                    print(f"{fmt} {name}: non-finite output")
                    return 1
                err = float(np.abs(o - emu.astype(np.float32)).max())
                worst = max(worst, err)
                print(f"{fmt} {name}: max |device - emulator| = {err:.3e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
