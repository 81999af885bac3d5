"""``python -m hipmla``: check, selftest, build, model, bench, profile and the NVIDIA runtime helper."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

import numpy as np

from hipmla import __version__
from hipmla.formats import KV_FORMATS
from hipmla.inputs import benchmark_shapes, make_sampled_inputs
from hipmla.queries import HEAD_COUNTS, MAX_Q_LEN
from hipmla.reference import mla_decode_reference

#: Loose tolerance against exact attention, per Q precision: |out - ref| <= tol * (1 + mag),
#: mag = sum p |v| / l (mla_decode_reference(magnitude=True)), the scale of P's rounding.
#: bf16 Q: P in bf16 and the bf16 output dominate (~0.1% of scale); fp8 and mxfp4 Q add
#: their own quantization error (see README, "Numerics").
REFERENCE_TOL = {"bf16": 2e-2, "fp8": 8e-2, "mxfp4": 0.4}
#: Bound on |lse - ref_lse| (natural log, absolute), per Q precision; a row whose LSE
#: error exceeds it fails. bf16 Q: Q reaches the kernel exactly and scores are f32, so
#: the LSE moves only by the bf16 rounding of P, at most 2^-9 relative in every term of
#: the sum: |d lse| <= ln(1 + 2^-9) ~ 1.95e-3 even if every rounding went one way, plus
#: the f32 rounding of the scores (~1e-6 each), so 2e-3. That is tight
#: enough to catch one 64-token tile lost from an 8k sequence (ln(1 - 1/128) ~ -8e-3).
#: fp8 and mxfp4 Q: the quantization error ds of each score enters the LSE as the
#: softmax-weighted mean of ds plus half its weighted variance, a bias of one sign that
#: no tighter analytic bound captures, so the bound is ~2.5x the largest error seen.
#: Seen on the host emulator, 8 shapes x 3 KV formats x seeds 0-3, 8 sequences each:
#: bf16 Q <= 2.8e-4; fp8 Q median 9.0e-3, max 1.3e-2; mxfp4 Q median 3.8e-2, max 5.4e-2.
LSE_TOL = {"bf16": 2e-3, "fp8": 3e-2, "mxfp4": 0.15}
HOST_NUM_CUS = 256  # the host emulator plans for an MI355X (256 CUs)
#: Commands with their own argument parsers, in the modules that implement them.
DELEGATED = {
    "build": ("hipmla.aot", "ahead-of-time build of every kernel with clang, plus a resource report"),
    "model": ("hipmla.perfmodel", "the performance model: H200 predicted vs measured, PREDICTED MI355X/MI300X times"),
    "bench": ("hipmla.bench", "device time per decode call against the memory roofline (GPU)"),
    "profile": ("hipmla.profile", "one shape under rocprofv3 with a per-kernel summary (ROCm)"),
    "nvidia-runtime": ("hipmla.nvidia", "build the HIP-on-CUDA library that runs hipmla on NVIDIA GPUs"),
}
Q_CHOICES = ("auto", "bf16", "fp8", "mxfp4")

#: What is not a command's output (progress, notes) goes through this logger, to stderr.
log = logging.getLogger("hipmla")


# ----------------------------------------------------------------------------- progress


class StderrHandler(logging.Handler):
    """The CLI's handler of the ``hipmla`` logger: ``hipmla: message`` lines on stderr.

    Records logged with ``extra={"progress": True}`` are status updates: on a terminal
    they overwrite one another on a single line (``\\r``), elsewhere (a log file, a pipe)
    each is a line of its own. Call :meth:`end_status` before writing to stdout.
    """

    def __init__(self, level=logging.NOTSET):
        super().__init__(level)
        self.setFormatter(logging.Formatter("hipmla: %(message)s"))
        self._status = False  # a status line is on the terminal, unterminated

    @staticmethod
    def _tty() -> bool:
        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):
            return False

    def end_status(self) -> None:
        if self._status:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self._status = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            if getattr(record, "progress", False) and self._tty():
                sys.stderr.write("\r\x1b[K" + msg)
                self._status = True
            else:
                self.end_status()
                sys.stderr.write(msg + "\n")
            sys.stderr.flush()
        except Exception:  # logging must never take the command down
            self.handleError(record)


def configure_logging(verbosity: int = 0) -> StderrHandler:
    """Route the ``hipmla`` logger to stderr for a CLI run (once per process; later calls
    only set the level): INFO by default, WARNING with ``-q``, DEBUG with ``-v``."""
    handler = next((h for h in log.handlers if isinstance(h, StderrHandler)), None)
    if handler is None:
        handler = StderrHandler()
        log.addHandler(handler)
    log.setLevel(logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO)
    return handler


def progress(message: str) -> None:
    """One step of a long command: a status line on a terminal, a log line elsewhere."""
    log.info(message, extra={"progress": True})


def end_status() -> None:
    """Clear a pending status line before writing the command's own output."""
    for h in log.handlers:
        if isinstance(h, StderrHandler):
            h.end_status()


# ----------------------------------------------------------------------------- argument types


def int_at_least(low: int, high: int | None = None):
    """argparse type: an integer >= ``low`` (and <= ``high``; argparse names the option in
    its error)."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = want.removeprefix("an ")
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def device_arg(text: str) -> str:
    """argparse type of ``--device``: ``auto``, ``host``, ``gpu`` or ``gpu:N``."""
    value = text.strip().lower()
    if value in ("auto", "host", "gpu"):
        return value
    if value.startswith("gpu:") and value[4:].isdigit():
        return f"gpu:{int(value[4:])}"
    hint = " (the numpy emulator of the kernels is --device host)" if value in ("cpu", "emulator") else ""
    raise argparse.ArgumentTypeError(f"expected auto, host, gpu or gpu:N (N >= 0), got {text!r}{hint}")


def shape_names(text: str) -> list[str]:
    """argparse type of ``--shapes``: comma-separated benchmark shape names, all known."""
    known = [s.name for s in benchmark_shapes()]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(known)}, got {text!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown))} "
            f"{'is not a benchmark shape' if len(unknown) == 1 else 'are not benchmark shapes'} "
            f"(expected a comma-separated list of {', '.join(known)})")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- check


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
    lse_tol: float = float("inf")

    @property
    def lse_ok(self) -> bool:
        return bool(self.lse_max_abs <= self.lse_tol)  # NaN fails

    @property
    def ok(self) -> bool:
        return bool(self.frac_bad == 0) and self.lse_ok

    def line(self) -> str:
        why = [] if self.ok else (["out"] if self.frac_bad != 0 else []) + ([] if self.lse_ok else ["lse"])
        verdict = "ok" if self.ok else "FAIL(" + ",".join(why) + ")"
        return (f"{self.shape:>8} {self.kv_format:>6} {self.q_precision:>5} {self.device:>14} "
                f"{self.sampled:>5} {self.max_abs:>9.2e} {self.max_rel:>9.2e} {self.frac_bad:>9.2e} "
                f"{self.lse_max_abs:>9.2e} {self.seconds:>8.3f}  {verdict}")


HEADER = (f"{'shape':>8} {'kv':>6} {'q':>5} {'device':>14} {'seqs':>5} {'max_abs':>9} "
          f"{'max_rel':>9} {'frac_bad':>9} {'lse_err':>9} {'time_s':>8}  result")


def sample_seqs(batch: int, sample: int | None) -> np.ndarray:
    """Evenly spread sequence indices (all when ``sample`` is None or >= batch)."""
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, (int, np.integer))
                               or sample < 1):
        raise ValueError(f"sample: expected an integer >= 1 or None (all sequences), got {sample!r}")
    if sample is None or sample >= batch:
        return np.arange(batch)
    return np.unique(np.linspace(0, batch - 1, sample).round().astype(np.int64))


def compare(out, lse, ref_out, ref_lse, ref_mag, tol: float) -> tuple[float, float, float, float]:
    """``(max_abs, max_rel, frac_bad, lse_max_abs)`` against ``mla_decode_reference(...,
    magnitude=True)``'s three arrays; an output is bad past ``tol * (1 + ref_mag)`` (sum p
    |v| / l: |ref| is too tight a scale for the rounding of P where the terms cancel); NaN
    or Inf in ``out`` counts as bad, and an LSE that is -inf on one side only is an
    infinite error."""
    o = np.asarray(out, dtype=np.float32)
    err = np.abs(o - ref_out)
    scale = float(np.abs(ref_out).max(initial=0)) or 1.0
    bad = ~(err <= tol * (1 + ref_mag))
    both_inf = np.isneginf(lse) & np.isneginf(ref_lse)
    with np.errstate(invalid="ignore"):
        lse_err = np.where(both_inf, 0.0, np.abs(np.asarray(lse, np.float64) - ref_lse))
    max_abs = float(np.max(err)) if err.size else 0.0
    lse_max = float(np.max(lse_err)) if lse_err.size else 0.0
    return max_abs, max_abs / scale, float(bad.mean()) if bad.size else 0.0, lse_max


@dataclass(frozen=True)
class Backend:
    """Where ``check`` runs: ``run(inputs, seqs, q_precision) -> (out, lse, seconds)``."""

    label: str
    run: object
    arch: str | None = None  # None: the host emulator

    def q_precision(self, requested: str, kv_format: str) -> str:
        """What ``Decoder(q_precision=requested)`` uses here; on the host, auto is bf16."""
        if requested != "auto":
            return requested
        if self.arch is None:
            return "bf16"
        from hipmla.decode import resolve_q_precision

        return resolve_q_precision("auto", self.arch, kv_format)

    def fp8_variant(self) -> str:
        if self.arch is None:
            return "e4m3fn"
        from hipmla.decode import fp8_variant_for

        return fp8_variant_for(self.arch)


def _host_backend() -> Backend:
    from hipmla.emulate import emulate_decode
    from hipmla.schedule import SplitPolicy

    def run(inputs, seqs, q_precision):
        t0 = time.perf_counter()
        out, lse = emulate_decode(inputs.q, inputs.kv, inputs.layout, inputs.sm_scale,
                                  SplitPolicy.for_device(HOST_NUM_CUS), q_precision=q_precision, seqs=seqs,
                                  qo_indptr=inputs.qo_indptr)
        return out, lse, time.perf_counter() - t0

    return Backend("host-emulator", run)


def _fail(message: str, command: str = "check") -> SystemExit:
    """A usage or set-up error of a command: the message on stderr, exit status 2."""
    end_status()
    print(f"hipmla {command}: {message}", file=sys.stderr)
    return SystemExit(2)


def gpu_count(command: str) -> tuple[int, str]:
    """``(devices, why none)`` hip-python reaches; exits naming ``HIPMLA_PLATFORM`` when
    its value is bad."""
    from hipmla import runtime

    try:
        runtime.platform_choice()  # HIPMLA_PLATFORM: a bad value is an error, not "no GPU"
    except ValueError as e:
        raise _fail(str(e), command) from None
    try:
        return runtime.device_count(), "hip-python reports no device"
    except Exception as e:  # any failure to load or start HIP means "no GPU here"
        return 0, str(e).splitlines()[0] if str(e) else type(e).__name__


def _backend(device: str) -> Backend:
    """The backend ``--device`` names; exits with a message naming ``--device`` (or the
    environment variable) when it cannot be had."""
    if device == "host":
        return _host_backend()
    from hipmla import runtime

    count, reason = gpu_count("check")
    if count == 0:
        if device == "auto":
            log.info("no GPU reachable through hip-python (%s); checking on the host emulator",
                     reason.split(". ")[0].rstrip("."))
            return _host_backend()
        raise _fail(f"--device {device}: no GPU reachable through hip-python ({reason})")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise _fail(f"--device {device}: expected a device index in [0, {count}), got {index}")
    from hipmla.decode import gpu_check_backend

    label, run = gpu_check_backend(index)
    return Backend(label, run, arch=runtime.device_info(index).arch)


def cmd_check(args) -> int:
    formats = KV_FORMATS if args.format == "all" else (args.format,)
    shapes = benchmark_shapes()
    if args.shapes:
        shapes = [s for s in shapes if s.name in set(args.shapes)]
    backend = _backend(args.device)
    q_of = {fmt: backend.q_precision(args.q_precision, fmt) for fmt in formats}
    picks = ", ".join(f"{fmt} cache: {q} Q" for fmt, q in q_of.items())
    if args.q_precision != "auto":
        why = "as asked"
    elif backend.arch is None:
        why = "auto means bf16 on the host emulator"
    else:
        why = f"what Decoder(q_precision='auto') picks on {backend.arch}"
    print(f"hipmla check {__version__}: device {backend.label}; q precision {args.q_precision} -> "
          f"{picks} ({why})")
    tols = "; ".join(f"{q} Q: |out-ref| <= {REFERENCE_TOL[q]} * (1 + sum p|v| / l), |lse-ref| <= {LSE_TOL[q]}"
                     for q in dict.fromkeys(q_of.values()))
    print(f"tolerance {tols}; reference = exact f64 attention over the dequantized cache; "
          f"{'all' if args.sample is None else f'up to {args.sample}'} sequences of each shape, "
          f"at the shape's length, seed {args.seed}", flush=True)
    shape_tag = "" if (args.heads, args.q_len) == (16, 1) else f" h{args.heads}q{args.q_len}"
    if shape_tag:
        print(f"{args.heads} heads, {args.q_len} query tokens per sequence (causal within the step)", flush=True)
    print(HEADER, flush=True)
    failures = 0
    total = len(formats) * len(shapes)
    for i, (fmt, shape) in enumerate((f, s) for f in formats for s in shapes):
        step = f"[{i + 1}/{total}] {shape.name} {fmt}"
        seqs = sample_seqs(shape.batch, args.sample)
        n = f"{len(seqs)} sequence{'' if len(seqs) == 1 else 's'}"
        progress(f"{step}: generating {n} of {shape.kv_len} tokens")
        inputs = make_sampled_inputs(shape.seq_lens, seqs, fmt, seed=args.seed,
                                     fp8_variant=backend.fp8_variant(), heads=args.heads, q_len=args.q_len)
        q = q_of[fmt]
        progress(f"{step}: running {n}, {q} Q")
        out, lse, seconds = backend.run(inputs, np.arange(len(seqs)), q)
        progress(f"{step}: exact reference")
        ref_out, ref_lse, ref_mag = mla_decode_reference(inputs.q, inputs.kv, inputs.layout, inputs.sm_scale,
                                                         qo_indptr=inputs.qo_indptr, magnitude=True)
        row = CheckRow(shape.name + shape_tag, fmt, backend.label, q, len(seqs),
                       *compare(out, lse, ref_out, ref_lse, ref_mag, REFERENCE_TOL[q]), seconds, LSE_TOL[q])
        failures += not row.ok
        end_status()
        print(row.line(), flush=True)
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


# ----------------------------------------------------------------------------- selftest


def writable_file(text: str) -> str:
    """argparse type of an output file: its folder exists and it can be written, checked
    before a command's work rather than after it."""
    import os
    from pathlib import Path

    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK) \
            or path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (a file in an existing, writable folder)")
    return text


def cmd_selftest(args) -> int:
    from hipmla import runtime, selftest

    count, reason = gpu_count("selftest")
    if count == 0:
        raise _fail(f"no GPU reachable through hip-python ({reason.split('. ')[0].rstrip('.')}); "
                    f"the self-test checks the kernels "
                    f"on a device, so there is nothing to run here", "selftest")
    if args.device >= count:
        raise _fail(f"--device: expected a device index in [0, {count}), got {args.device}", "selftest")
    info = runtime.device_info(args.device)
    formats = KV_FORMATS if args.format == "all" else (args.format,)
    plan = selftest.device_plan(info.arch, formats)
    print(f"hipmla selftest {__version__}: {info.name} ({info.arch}:{args.device}); known case "
          f"{'/'.join(map(str, selftest.CASE_LENS))} tokens, pages of {selftest.CASE_PAGE_SIZE}; bounds "
          f"|out-emu| <= 2^-7 |emu| + {selftest.EMU_ATOL:g} x scale, |lse-emu| <= {selftest.EMU_LSE_ATOL:g}; "
          f"verdicts in {selftest.verdict_dir() or '(none kept: HIPMLA_CACHE=0)'}", flush=True)
    print(f"{'role':<8} {'kernel':<40} {'arch':<8} {'kv/q':<11} {'result':<6} {'worst':>9} {'lse':>9}  cached",
          flush=True)
    rows = []
    for i, (spec, role) in enumerate(plan):
        progress(f"[{i + 1}/{len(plan)}] {spec.symbol}")
        verdict = selftest.check_kernel(spec, args.device, use_cache=not args.no_cache)
        rows.append({"role": role, **verdict.to_json()})
        end_status()
        print(f"{role:<8} {verdict.symbol:<40} {verdict.arch:<8} {verdict.kv_format + '/' + verdict.q_precision:<11} "
              f"{'pass' if verdict.passed else 'FAIL':<6} {verdict.worst_error:>9.2e} {verdict.lse_error:>9.2e}  "
              f"{'yes' if verdict.cached else 'no'}", flush=True)
        if not verdict.passed:
            print(f"         {verdict.message}", flush=True)
    failed = sum(not r["passed"] for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    if args.json:
        import json

        report = {"device": info.name, "arch": info.arch, "index": args.device, "version": selftest.VERSION,
                  "verdicts": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- parser and main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hipmla",
                                description="MLA decode attention for AMD Instinct GPUs: check, selftest, build, "
                                            "model, bench, profile, and the NVIDIA runtime helper.",
                                epilog="Results go to stdout, progress and notes to stderr (the 'hipmla' "
                                       "logger). Environment variables: docs/ENVIRONMENT.md.")
    p.add_argument("--version", action="version", version=f"hipmla {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser(
        "check", help="check sampled sequences of the 8 benchmark shapes against the exact reference",
        description="Decode sampled sequences of each benchmark shape (each at the shape's length; only "
                    "their rows are built) on the GPU or the host emulator and compare output and LSE "
                    "with exact f64 attention. Exit status 1 when a row fails (output or LSE beyond "
                    "its bound), 2 on bad arguments.")
    c.add_argument("--format", default="mxfp4", choices=KV_FORMATS + ("all",))
    c.add_argument("--q-precision", default="auto", choices=Q_CHOICES,
                   help="Q precision to check; auto (default): what Decoder picks on the device "
                        "(bf16 on the host emulator)")
    c.add_argument("--device", default="auto", type=device_arg,
                   help="auto (GPU if hip-python finds one, else the host emulator), host "
                        "(the numpy emulator of the kernels), gpu, gpu:N")
    c.add_argument("--sample", type=positive_int, default=None,
                   help="check only this many sequences of each batch (spread evenly; default all)")
    c.add_argument("--shapes", type=shape_names, default=None,
                   help="comma-separated subset, e.g. 4x1k,256x8k")
    c.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the inputs (each sequence's data depends on the seed and its index only)")
    c.add_argument("--heads", type=int, default=16, choices=HEAD_COUNTS, metavar="H",
                   help="query heads: 1 to 16, 32, 64 or 128 (default 16)")
    c.add_argument("--q-len", type=int_at_least(1, MAX_Q_LEN), default=1,
                   help="query tokens per sequence (MTP; default 1)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    c.set_defaults(func=cmd_check)

    t = sub.add_parser(
        "selftest", help="run each kernel of this GPU on a known case against the emulator",
        description="Run a small known case (ragged, paged, with partial tiles) through every kernel a "
                    "decoder picks on this GPU and, as the reference, the portable kernel, and compare "
                    "each with the emulator's model of that kernel. Prints a table; exit status 1 when "
                    "a kernel fails (its decoders fall back to the portable kernel), 2 without a GPU.")
    t.add_argument("--format", default="all", choices=KV_FORMATS + ("all",))
    t.add_argument("--device", type=non_negative_int, default=0, metavar="N", help="device index (default 0)")
    t.add_argument("--json", metavar="PATH", type=writable_file, default=None,
                   help="also write the verdicts as JSON to PATH")
    t.add_argument("--no-cache", action="store_true",
                   help="run every check even where a verdict is stored (the new one replaces it)")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    t.set_defaults(func=cmd_selftest)

    for name, (_module, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    configure_logging()
    try:
        if argv and argv[0] in DELEGATED:
            import importlib

            return int(importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        if getattr(args, "quiet", False):
            configure_logging(-1)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        end_status()
        print("hipmla: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (| head): stop quietly, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    finally:
        end_status()
