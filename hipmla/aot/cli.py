"""``python -m hipmla build``: build every kernel, print the resource report, fail on the budget."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hipmla.aot.counts import fast_report
from hipmla.aot.occupancy import ARCH_LIMITS
from hipmla.aot.prebuilt import default_aot_dir
from hipmla.aot.resources import build_all, check_budget, format_report
from hipmla.aot.toolchain import CompileError, ToolchainNotFound
from hipmla.validate import arch_list_arg, folder_arg


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hipmla build``: build all kernels, print the report, 1 on budget violations."""
    parser = argparse.ArgumentParser(
        prog="python -m hipmla build",
        description="Compile every hipmla kernel with clang and report registers, LDS, scratch and occupancy.",
    )
    parser.add_argument("--arch", default="gfx950,gfx942", type=arch_list_arg(tuple(ARCH_LIMITS)),
                        help="comma-separated targets (default: gfx950,gfx942)")
    parser.add_argument("--out", type=folder_arg, default=None,
                        help="folder for the code objects (default: $XDG_CACHE_HOME/hipmla/aot, "
                             "~/.cache/hipmla/aot; the runtime looks there and in $HIPMLA_AOT_DIR)")
    parser.add_argument("--jobs", type=_positive_int, default=2, help="compilers run at once (default: 2)")
    parser.add_argument("--report", action="store_true",
                        help="also count the fast kernels' instructions per tile (gfx950: 128 tokens, "
                             "gfx942: 16) and print the performance model: its H200 calibration (predicted vs "
                             "measured) and a PREDICTED time range per benchmark shape (MI355X for gfx950, "
                             "MI300X for gfx942); 'python -m hipmla model' prints the same without the resource table")
    args = parser.parse_args(argv)
    archs = args.arch
    out_dir = default_aot_dir() if args.out is None else args.out
    try:
        rows = build_all(archs, out_dir, args.jobs)
    except OSError as e:  # an --out it cannot write
        print(f"hipmla build: --out {out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (ToolchainNotFound, CompileError, ValueError, RuntimeError) as e:  # RuntimeError: a tool that failed
        print(f"hipmla build: {e}", file=sys.stderr)
        return 2
    print(format_report(rows))
    print(f"code objects in {out_dir}")
    if args.report:
        try:
            print()
            print(fast_report(rows, out_dir))
        except (ToolchainNotFound, ValueError, RuntimeError) as e:
            print(f"hipmla build --report: {e}", file=sys.stderr)
            return 2
    violations = check_budget(rows)
    for v in violations:
        print(f"over budget: {v}", file=sys.stderr)
    return 1 if violations else 0
