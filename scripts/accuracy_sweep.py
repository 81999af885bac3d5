#!/usr/bin/env python3
"""The emulator's error against exact attention over 200 ragged serving-like batches.

README's accuracy figures and the bounds of tests/test_emulate.py come from this sweep:
for each batch (``inputs.random_seq_lens``: sizes 1-300, lengths 0-20000, empty and short
sequences), a few sampled sequences are built at their full length
(``inputs.make_sampled_inputs``), decoded by the emulator with each Q precision over an
MXFP4 cache (portable schedule, the device's split for 132 compute units), and compared
with exact f64 attention over the same dequantized cache: relative L2 error of the
output over the batch's live sequences, and the largest |LSE error|.

    python scripts/accuracy_sweep.py [--configs 200] [--sample 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla.emulate import Q_PRECISIONS, emulate_decode  # noqa: E402
from hipmla.inputs import make_sampled_inputs, random_seq_lens  # noqa: E402
from hipmla.reference import mla_decode_reference  # noqa: E402
from hipmla.schedule import SplitPolicy  # noqa: E402


def sweep(configs: int, sample: int, kv_format: str = "mxfp4", seed: int = 2026) -> dict[str, list[tuple]]:
    rng = np.random.default_rng(seed)
    policy = SplitPolicy.for_device(132)
    errors: dict[str, list[tuple]] = {qp: [] for qp in Q_PRECISIONS}
    for i in range(configs):
        lens = random_seq_lens(rng, max_batch=300, max_len=20000)
        live = np.flatnonzero(lens > 0)
        if live.size == 0:
            continue
        seqs = np.sort(rng.choice(live, size=min(sample, live.size), replace=False))
        inp = make_sampled_inputs(lens, seqs, kv_format, seed=i)
        ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv, inp.layout, inp.sm_scale)
        for qp in Q_PRECISIONS:
            out, lse = emulate_decode(inp.q, inp.kv, inp.layout, inp.sm_scale, policy, q_precision=qp)
            o = out.astype(np.float64)
            rel = float(np.linalg.norm(o - ref_out) / np.linalg.norm(ref_out))
            errors[qp].append((rel, float(np.abs(lse - ref_lse).max())))
    return errors


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scripts/accuracy_sweep.py")
    p.add_argument("--configs", type=int, default=200)
    p.add_argument("--sample", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    errors = sweep(a.configs, a.sample)
    print(f"{'Q':>6} {'configs':>7} {'rel L2 median':>14} {'rel L2 max':>11} {'LSE err median':>15} {'LSE err max':>12}")
    summary = {}
    for qp, rows in errors.items():
        rel = np.array([r[0] for r in rows])
        lse = np.array([r[1] for r in rows])
        summary[qp] = dict(configs=len(rows), rel_median=float(np.median(rel)), rel_max=float(rel.max()),
                           lse_median=float(np.median(lse)), lse_max=float(lse.max()))
        s = summary[qp]
        print(f"{qp:>6} {s['configs']:>7} {s['rel_median']:14.3e} {s['rel_max']:11.3e} "
              f"{s['lse_median']:15.3e} {s['lse_max']:12.3e}")
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "errors": errors}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
