"""A small ragged decode in every KV format, for compute-sanitizer (memcheck, racecheck).

Covers the irregular paths: an empty sequence, a 1-token sequence, tails that are not
multiples of the 64-token tile, and a sequence long enough to be split and combined.
Exits non-zero if any output is non-finite or far from the emulator.
"""

import sys

import numpy as np

from hipmla.decode import Decoder
from hipmla.emulate import emulate_decode
from hipmla.inputs import make_inputs
from hipmla.plan import make_plan

LENS = np.array([0, 1, 65, 300, 129, 9000])


def main() -> int:
    worst = 0.0
    for fmt in ("bf16", "fp8", "mxfp4"):
        with Decoder(fmt, 1 / 24) as dec:
            inputs = make_inputs(LENS, fmt, seed=1, fp8_variant=dec.fp8_variant)
            out, lse = dec.decode(inputs.q, inputs.kv, inputs.kv_indptr)
            emu, _ = emulate_decode(inputs.q, inputs.kv, make_plan(LENS, dec.device.num_cus), 1 / 24)
            o = out.astype(np.float32)
            if not np.isfinite(o).all():
                print(f"{fmt}: non-finite output")
                return 1
            err = float(np.abs(o - emu.astype(np.float32)).max())
            worst = max(worst, err)
            print(f"{fmt}: max |device - emulator| = {err:.3e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
