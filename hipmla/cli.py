"""``python -m hipmla``: check, build, bench and the NVIDIA runtime helper."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from hipmla.formats import KV_FORMATS
from hipmla.inputs import benchmark_shapes, make_inputs
from hipmla.reference import mla_decode_reference

#: Loose tolerance against exact attention, per Q precision: |out - ref| <= tol * (1 + |ref|).
#: bf16 Q: P in bf16 and the bf16 output dominate (~0.1% of scale); fp8 and mxfp4 Q add
#: their own quantization error (see README, "Numerics").
REFERENCE_TOL = {"bf16": 2e-2, "fp8": 8e-2, "mxfp4": 0.4}
HOST_NUM_CUS = 256  # the host emulator plans for an MI355X (256 CUs)
#: Commands with their own argument parsers, in the modules that implement them.
DELEGATED = {
    "build": ("hipmla.aot", "ahead-of-time build of every kernel with clang, plus a resource report"),
    "bench": ("hipmla.bench", "device time per decode call against the memory roofline (GPU)"),
    "profile": ("hipmla.profile", "one shape under rocprofv3 with a per-kernel summary (ROCm)"),
    "nvidia-runtime": ("hipmla.nvidia", "build the HIP-on-CUDA library that runs hipmla on NVIDIA GPUs"),
}


@dataclass(frozen=True)
class CheckRow:
    shape: str
    kv_format: str
    device: str
    q_precision: str
    sampled: int
    max_abs: float
    max_rel: float
    frac_bad: float
    lse_max_abs: float
    seconds: float

    def line(self) -> str:
        return (f"{self.shape:>8} {self.kv_format:>6} {self.q_precision:>5} {self.device:>14} "
                f"{self.sampled:>5} {self.max_abs:>9.2e} {self.max_rel:>9.2e} {self.frac_bad:>9.2e} "
                f"{self.lse_max_abs:>9.2e} {self.seconds:>8.3f}")


HEADER = (f"{'shape':>8} {'kv':>6} {'q':>5} {'device':>14} {'seqs':>5} {'max_abs':>9} "
          f"{'max_rel':>9} {'frac_bad':>9} {'lse_err':>9} {'time_s':>8}")


def sample_seqs(batch: int, sample: int | None) -> np.ndarray:
    """Evenly spread sequence indices (all when ``sample`` is None or >= batch)."""
    if sample is None or sample >= batch:
        return np.arange(batch)
    return np.unique(np.linspace(0, batch - 1, sample).round().astype(np.int64))


def compare(out, lse, ref_out, ref_lse, tol: float) -> tuple[float, float, float, float]:
    o = np.asarray(out, dtype=np.float32)
    err = np.abs(o - ref_out)
    scale = float(np.abs(ref_out).max()) or 1.0
    bad = err > tol * (1 + np.abs(ref_out))
    both_inf = np.isneginf(lse) & np.isneginf(ref_lse)
    lse_err = np.where(both_inf, 0.0, np.abs(lse.astype(np.float64) - ref_lse))
    return (float(err.max(initial=0)), float(err.max(initial=0)) / scale,
            float(bad.mean()) if bad.size else 0.0, float(lse_err.max(initial=0)))


def _backend(device: str):
    """``(label, run)`` where run(inputs, seqs, q_precision) -> (out, lse, seconds)."""
    if device in ("auto", "gpu") or device.startswith("gpu:"):
        from hipmla import runtime

        if runtime.available():
            from hipmla.decode import gpu_check_backend

            index = int(device.split(":")[1]) if ":" in device else 0
            return gpu_check_backend(index)
        if device != "auto":
            raise SystemExit(f"--device {device}: no GPU available through hip-python")
    from hipmla.emulate import emulate_decode
    from hipmla.schedule import SplitPolicy

    def run(inputs, seqs, q_precision):
        t0 = time.perf_counter()
        out, lse = emulate_decode(inputs.q, inputs.kv, inputs.layout, inputs.sm_scale,
                                  SplitPolicy.for_device(HOST_NUM_CUS), q_precision=q_precision, seqs=seqs)
        return out, lse, time.perf_counter() - t0

    return "host-emulator", run


def cmd_check(args) -> int:
    formats = KV_FORMATS if args.format == "all" else (args.format,)
    shapes = benchmark_shapes()
    if args.shapes:
        wanted = set(args.shapes.split(","))
        shapes = [s for s in shapes if s.name in wanted]
        if not shapes:
            raise SystemExit(f"--shapes: none of {sorted(wanted)} is a benchmark shape "
                             f"({', '.join(s.name for s in benchmark_shapes())})")
    label, run = _backend(args.device)
    tol = REFERENCE_TOL[args.q_precision]
    print(f"hipmla check: device {label}, q precision {args.q_precision}, "
          f"tolerance |out-ref| <= {tol} * (1 + |ref|), reference = exact f64 attention "
          f"over the dequantized cache", flush=True)
    print(HEADER, flush=True)
    failures = 0
    total = len(formats) * len(shapes)
    for i, (fmt, shape) in enumerate((f, s) for f in formats for s in shapes):
        print(f"  [{i + 1}/{total}] {shape.name} {fmt}: generating inputs...", end="\r",
              file=sys.stderr, flush=True)
        inputs = make_inputs(shape.seq_lens, fmt, seed=args.seed)
        seqs = sample_seqs(shape.batch, args.sample)
        print(f"  [{i + 1}/{total}] {shape.name} {fmt}: running {len(seqs)} sequences...  ",
              end="\r", file=sys.stderr, flush=True)
        out, lse, seconds = run(inputs, seqs, args.q_precision)
        ref_out, ref_lse = mla_decode_reference(inputs.q, inputs.kv, inputs.layout,
                                                inputs.sm_scale, seqs=seqs)
        row = CheckRow(shape.name, fmt, label, args.q_precision, len(seqs),
                       *compare(out, lse, ref_out, ref_lse, tol), seconds)
        failures += row.frac_bad > 0
        print(" " * 70, end="\r", file=sys.stderr)
        print(row.line(), flush=True)
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hipmla", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="run the 8 benchmark shapes and compare with the exact reference")
    c.add_argument("--format", default="mxfp4", choices=KV_FORMATS + ("all",))
    c.add_argument("--q-precision", default="bf16", choices=("bf16", "fp8", "mxfp4"))
    c.add_argument("--device", default="auto",
                   help="auto (GPU if hip-python finds one, else host emulator), host, gpu, gpu:N")
    c.add_argument("--sample", type=int, default=None,
                   help="check only this many sequences of each batch (spread evenly)")
    c.add_argument("--shapes", default=None, help="comma-separated subset, e.g. 4x1k,256x8k")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_check)

    for name, (_module, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        import importlib

        return int(importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
