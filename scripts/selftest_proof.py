#!/usr/bin/env python3
"""The proof, on an sm_90 GPU (the H200), that kernels check themselves (hipmla.selftest):

1. the sm_90 tensor-core kernel passes its known-answer check in every cache format;
2. its deliberately broken build (``selftest.broken``: ``-DHIPMLA_SELFTEST_BREAK``, the
   output scaled by 1.5) fails it in every format, on its numbers (not a build error);
3. a decoder built on the broken build, with no verdict stored, runs the check, falls back
   to the portable kernel with one warning naming the kernel and the error, and decodes a
   ragged paged batch right (against the portable kernel's emulator and exact attention);
4. the next one (a fresh process's view: verdicts forgotten) reads the stored failure and
   falls back without running the case again;
5. a decoder left to itself serves the sm_90 kernel.

    python scripts/selftest_proof.py [--out DIR]     # exit 0 when every expectation holds

Verdicts go where decoders keep them (``<kernel cache>/selftest``); the checks of 1 and 2
run afresh (``use_cache=False``) and replace what was stored.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import kernels, runtime, selftest  # noqa: E402
from hipmla.cli import LSE_TOL, REFERENCE_TOL, compare  # noqa: E402
from hipmla.decode import Decoder  # noqa: E402
from hipmla.formats import KV_FORMATS  # noqa: E402
from hipmla.inputs import random_cache  # noqa: E402
from hipmla.paging import random_page_table  # noqa: E402
from hipmla.reference import mla_decode_reference  # noqa: E402

SM_SCALE = 1 / 24
#: The batch the fallen-back decoder serves: not the known case.
LENS = np.array([0, 5, 64, 129, 1000, 2500, 31])


def built(make) -> tuple[Decoder, list[warnings.WarningMessage], float]:
    """A decoder from ``make()``, the self-test warnings it gave and the seconds it took."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dec = make()
    return dec, [w for w in caught if issubclass(w.category, selftest.KernelSelfTestWarning)], \
        time.perf_counter() - t0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for selftest_proof.json")
    a = p.parse_args(argv)
    info = runtime.device_info(0)
    if info.arch != "sm_90":
        print(f"selftest_proof: needs an sm_90 GPU (the broken build is of the sm_90 kernel), got "
              f"{info.name} ({info.arch})", file=sys.stderr)
        return 2
    report: dict = {"device": info.name, "arch": info.arch, "steps": []}

    def step(what: str, ok: bool, **facts) -> None:
        report["steps"].append({"step": what, "ok": bool(ok), **facts})
        detail = "; ".join(f"{k} {v}" for k, v in facts.items())
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}", flush=True)

    print(f"selftest proof on {info.name} ({info.arch}); verdicts in {selftest.verdict_dir()}", flush=True)
    for fmt in KV_FORMATS:
        v = selftest.check_kernel(kernels.sm90_split_kernel(fmt), use_cache=False)
        step(f"1 {v.symbol} passes", v.passed, worst=f"{v.worst_error:.2e}", lse=f"{v.lse_error:.2e}",
             hash=v.code_hash[:16], message=v.message)
    for fmt in KV_FORMATS:
        v = selftest.check_kernel(selftest.broken(kernels.sm90_split_kernel(fmt)), use_cache=False)
        step(f"2 broken {v.symbol} fails", not v.passed and "outputs off the emulator" in v.message,
             worst=f"{v.worst_error:.2e}", lse=f"{v.lse_error:.2e}", hash=v.code_hash[:16], message=v.message)

    spec = kernels.sm90_split_kernel("mxfp4")
    bad = selftest.broken(spec)
    portable = kernels.split_kernel("mxfp4", "bf16")
    path = selftest.verdict_path(bad, info.arch, selftest.code_hash(bad, info.arch))
    if path is not None:
        path.unlink(missing_ok=True)  # step 3 runs the check itself
    selftest.forget()
    dec, caught, seconds = built(lambda: Decoder("mxfp4", SM_SCALE, kernel=bad, selftest=True))
    verdict = selftest.verdict_of(bad, info.arch)
    step("3 a decoder on the broken build checks it and falls back",
         dec.kernel_symbol == portable.symbol and len(caught) == 1 and spec.symbol in str(caught[0].message)
         and not verdict.cached, kernel=dec.kernel_symbol, warnings=len(caught), seconds=f"{seconds:.2f}",
         warning=str(caught[0].message) if caught else None)
    rng = np.random.default_rng(2027)
    layout = random_page_table(LENS, 16, rng, spare_pages=9, shared=2)
    kv = random_cache((int(layout.kv_indices.max()) + 1) * 16, "mxfp4", rng, scale_stride=24)
    q = rng.standard_normal((LENS.size, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    out, lse = dec.decode(q, kv, layout)
    emu = selftest.compare(out, lse, *dec.emulate(q, kv, layout))
    max_abs, _, frac_bad, lse_err = compare(out, lse, *mla_decode_reference(q, kv, layout, SM_SCALE, magnitude=True),
                                            REFERENCE_TOL["bf16"])
    dec.close()
    step("3 ... and decodes a ragged paged batch right", emu.passed and frac_bad == 0 and lse_err <= LSE_TOL["bf16"],
         lens="/".join(map(str, LENS)), vs_emulator=f"{emu.worst_error:.2e} of scale, LSE {emu.lse_error:.2e}",
         vs_reference=f"max abs {max_abs:.2e}, LSE {lse_err:.2e}", failure=emu.failure or None)

    runs: list = []
    real_run = selftest.run_case
    selftest.run_case = lambda *args: (runs.append(args), real_run(*args))[1]
    try:
        selftest.forget()
        dec, caught, seconds = built(lambda: Decoder("mxfp4", SM_SCALE, kernel=bad, selftest=True))
    finally:
        selftest.run_case = real_run
    step("4 the next decoder reads the stored failure and falls back without running the case",
         dec.kernel_symbol == portable.symbol and runs == [] and selftest.verdict_of(bad, info.arch).cached
         and len(caught) == 1 and "(stored verdict)" in str(caught[0].message),
         kernel=dec.kernel_symbol, runs=len(runs), warnings=len(caught), seconds=f"{seconds:.2f}")
    dec.close()

    selftest.forget()
    dec, caught, _ = built(lambda: Decoder("mxfp4", SM_SCALE, selftest=True))
    step("5 a decoder left to itself serves the sm_90 kernel", dec.kernel_symbol == spec.symbol and not caught,
         kernel=dec.kernel_symbol, verdict=selftest.verdict_of(spec, info.arch).message)
    dec.close()

    failed = [s["step"] for s in report["steps"] if not s["ok"]]
    print(f"{len(report['steps']) - len(failed)} of {len(report['steps'])} expectations hold", flush=True)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "selftest_proof.json").write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
