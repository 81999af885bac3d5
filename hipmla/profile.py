"""``python -m hipmla profile``: one benchmark shape under rocprofv3, per-kernel summary.

rocprofv3 ships with ROCm; without it the command says so (``--dry-run`` prints the
command line it would run, which is also what the tests check).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from hipmla.validate import folder_arg

log = logging.getLogger("hipmla")


def rocprof_command(shape: str, kv_format: str, out_dir: Path, iters: int = 20,
                    rocprof: str = "rocprofv3") -> list[str]:
    """Kernel trace + stats of ``iters`` decode calls of one shape, written under ``out_dir``."""
    return [
        rocprof, "--kernel-trace", "--stats", "--output-format", "csv",
        "-d", str(out_dir), "-o", f"hipmla_{kv_format}_{shape}",
        "--",
        sys.executable, "-m", "hipmla", "bench", "--format", kv_format, "--shapes", shape,
        "--iters", str(iters), "--no-torch",
    ]


def summarize(stats_csv: Path) -> str:
    """The per-kernel lines of rocprofv3's kernel_stats.csv, hipmla kernels first."""
    import csv

    with open(stats_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    rows.sort(key=lambda r: (not r.get("Name", "").startswith("hipmla_"), r.get("Name", "")))
    lines = [f"{'kernel':<40} {'calls':>6} {'total_us':>10} {'avg_us':>9}"]
    for r in rows:
        lines.append(f"{r.get('Name', '?')[:40]:<40} {r.get('Calls', '?'):>6} "
                     f"{float(r.get('TotalDurationNs', 0)) / 1e3:10.1f} {float(r.get('AverageNs', 0)) / 1e3:9.1f}")
    return "\n".join(lines)


def _shape(text: str) -> str:
    """argparse type of ``--shape``: one benchmark shape name."""
    from hipmla.inputs import benchmark_shapes

    known = [s.name for s in benchmark_shapes()]
    if text.strip() not in known:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(known)}, got {text!r}")
    return text.strip()


def main(argv: list[str]) -> int:
    from hipmla.cli import positive_int
    from hipmla.formats import KV_FORMATS

    p = argparse.ArgumentParser(prog="python -m hipmla profile", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="64x8k", type=_shape, help="a benchmark shape (default: 64x8k)")
    p.add_argument("--format", default="mxfp4", choices=KV_FORMATS)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--out", type=folder_arg, default=Path("rocprof_out"))
    p.add_argument("--dry-run", action="store_true", help="print the command line only")
    a = p.parse_args(argv)
    cmd = rocprof_command(a.shape, a.format, a.out, a.iters)
    if a.dry_run:
        print(" ".join(cmd))
        return 0
    if shutil.which(cmd[0]) is None:
        print("hipmla profile: rocprofv3 not found (it ships with ROCm); --dry-run shows the command",
              file=sys.stderr)
        return 2
    log.info("profiling %s %s: %s", a.shape, a.format, " ".join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        return rc
    stats = sorted(a.out.rglob("*kernel_stats.csv"))
    if not stats:
        print(f"hipmla profile: no kernel_stats.csv under {a.out}", file=sys.stderr)
        return 1
    print(summarize(stats[-1]))
    return 0
