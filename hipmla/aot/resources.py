"""What each built kernel uses (registers, LDS, scratch, occupancy), for every kernel
and arch at once, and the project's budget for it.

:func:`read_resources` reads the AMDGPU metadata note of a code object (llvm-readelf);
:func:`build_all` builds every kernel of every arch and reads each one;
:func:`format_report` prints the table ``python -m hipmla build`` shows, and
:func:`check_budget` names what breaks the budget (no scratch, no spills, LDS within
one CU).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hipmla.aot.occupancy import ARCH_LIMITS, _check_arch, waves_per_simd
from hipmla.aot.prebuilt import default_aot_dir
from hipmla.aot.toolchain import CompileError, compile_offline, find_clang, find_readelf
from hipmla.kernels import KernelSpec, fast_kernels, kernels_for_arch


@dataclass(frozen=True)
class KernelResources:
    symbol: str
    arch: str
    vgpr: int  # unified VGPR file use: arch VGPRs (rounded up to 4) + AGPRs
    sgpr: int  # including VCC / FLAT_SCRATCH / XNACK_MASK the compiler reserves
    agpr: int  # the AGPR part of ``vgpr``
    lds_bytes: int  # static LDS + the dynamic LDS the launch asks for
    scratch_bytes: int  # private segment per lane; anything > 0 is a slow stack
    vgpr_spills: int
    sgpr_spills: int
    waves_per_simd: int  # occupancy at the launch's block size; 0 = does not fit
    dynamic_stack: bool  # scratch of unknown size (recursion, alloca, indirect calls)


# --- one code object ---------------------------------------------------------------------

_REQUIRED_KEYS = (
    ".name", ".vgpr_count", ".sgpr_count", ".group_segment_fixed_size",
    ".private_segment_fixed_size", ".vgpr_spill_count", ".sgpr_spill_count",
    ".max_flat_workgroup_size",
)


def parse_notes(
    notes: str, *, symbol: str | None = None, block_threads: int | None = None,
    dynamic_lds_bytes: int = 0,
) -> KernelResources:
    """Resources of one kernel from ``llvm-readelf --notes`` text.

    ``symbol`` picks the kernel when the object holds several. ``block_threads`` is the
    launch's block size; without it the occupancy assumes the largest block the
    compiler allowed for (``.max_flat_workgroup_size``). ``dynamic_lds_bytes`` is the
    LDS the launch adds to the static ``.group_segment_fixed_size``.
    """
    target = re.search(r"^amdhsa\.target:\s*'?amdgcn-amd-amdhsa--([^\s:']+)", notes, re.M)
    if target is None:
        raise ValueError("notes: no 'amdhsa.target' line: not the notes of an AMDGPU code object")
    arch = target.group(1)
    kernels = _kernel_records(notes)
    if symbol is None:
        if len(kernels) != 1:
            raise ValueError(f"symbol: the object holds kernels {[k.get('.name') for k in kernels]}; name one")
        record = kernels[0]
    else:
        matching = [k for k in kernels if k.get(".name") == symbol]
        if not matching:
            raise ValueError(f"symbol: expected one of {[k.get('.name') for k in kernels]}, got {symbol!r}")
        record = matching[0]
    missing = [key for key in _REQUIRED_KEYS if key not in record]
    if missing:
        raise ValueError(f"notes: kernel {record.get('.name')!r} lacks metadata keys {missing}")

    def num(key: str, default: int | None = None) -> int:
        if key not in record and default is not None:
            return default
        try:
            return int(record[key])
        except ValueError:
            raise ValueError(f"notes: {key} of {record['.name']!r}: expected an integer, got {record[key]!r}") from None

    vgpr, sgpr = num(".vgpr_count"), num(".sgpr_count")
    lds = num(".group_segment_fixed_size") + int(dynamic_lds_bytes)
    threads = num(".max_flat_workgroup_size") if block_threads is None else int(block_threads)
    return KernelResources(
        symbol=record[".name"],
        arch=arch,
        vgpr=vgpr,
        sgpr=sgpr,
        agpr=num(".agpr_count", 0),  # absent on targets without MFMA
        lds_bytes=lds,
        scratch_bytes=num(".private_segment_fixed_size"),
        vgpr_spills=num(".vgpr_spill_count"),
        sgpr_spills=num(".sgpr_spill_count"),
        waves_per_simd=waves_per_simd(arch, vgpr=vgpr, sgpr=sgpr, lds_bytes=lds, block_threads=threads),
        dynamic_stack=record.get(".uses_dynamic_stack", "false") == "true",
    )


def _kernel_records(notes: str) -> list[dict[str, str]]:
    """The scalar keys of each ``amdhsa.kernels`` entry of the YAML that readelf prints.

    Entries start with ``  - .key: value`` at column 2; their own scalar keys sit at
    column 4; nested lists (``.args``) sit deeper and are skipped. A full YAML parser
    would be a dependency for the dozen flat keys we read.
    """
    records: list[dict[str, str]] = []
    in_kernels = False
    for line in notes.splitlines():
        if re.match(r"^\S", line):
            in_kernels = line.startswith("amdhsa.kernels:")
            continue
        if not in_kernels:
            continue
        m = re.match(r"^(  - |    )(\.[\w.]+):\s*(.*?)\s*$", line)
        if m is None:
            continue
        if m.group(1) == "  - ":
            records.append({})
        if records:
            records[-1][m.group(2)] = m.group(3).strip("'\"")
    if not records:
        raise ValueError("notes: no kernels under 'amdhsa.kernels'")
    return records


def read_resources(
    co_path: Path, *, symbol: str | None = None, block_threads: int | None = None,
    dynamic_lds_bytes: int = 0,
) -> KernelResources:
    """Resources of a kernel in a code object, read with the clang's own llvm-readelf."""
    co_path = Path(co_path)
    if not co_path.is_file():
        raise FileNotFoundError(f"co_path: no code object at {co_path}")
    readelf = find_readelf(find_clang())
    proc = subprocess.run([readelf, "--notes", str(co_path)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{readelf} --notes {co_path} exited {proc.returncode}: {proc.stderr.strip()}")
    return parse_notes(proc.stdout, symbol=symbol, block_threads=block_threads,
                       dynamic_lds_bytes=dynamic_lds_bytes)


# --- all kernels, report, budget -----------------------------------------------------------


def build_all(archs: Sequence[str], out_dir: Path | None = None, jobs: int = 2, *,
              fast_only: bool = False) -> list[KernelResources]:
    """Build every kernel for every arch (``jobs`` compilers at once); rows in arch, kernel order.
    ``fast_only``: the archs' fast kernels alone (what the performance model counts).

    ``out_dir`` defaults to :func:`default_aot_dir` (the user cache), where the runtime looks.
    Every failure is collected before raising, so one run shows all broken kernels.
    """
    if isinstance(archs, str) or not archs:
        raise ValueError(f"archs: expected a non-empty list of arch names, got {archs!r}")
    for arch in archs:
        _check_arch(arch)
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected an integer >= 1, got {jobs!r}")
    out = default_aot_dir() if out_dir is None else Path(out_dir)
    find_clang()  # one clear toolchain error up front instead of one per job

    def build(spec: KernelSpec, arch: str) -> KernelResources:
        co = compile_offline(spec, arch, out)
        return read_resources(co, symbol=spec.symbol, block_threads=spec.block_threads,
                              dynamic_lds_bytes=spec.dynamic_shared_bytes)

    specs = fast_kernels if fast_only else kernels_for_arch
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(build, spec, arch) for arch in archs for spec in specs(arch)]
        for future in futures:  # wait here, where Ctrl-C lands
            future.exception()
    except BaseException:  # Ctrl-C: the queued builds do not start (the running ones end with their clang)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    rows, errors = [], []
    for future in futures:
        try:
            rows.append(future.result())
        except CompileError as e:
            errors.append(e)
    if errors:
        raise CompileError(
            f"{len(errors)} of {len(futures)} builds failed",
            [],
            "\n\n".join(str(e) for e in errors),
        )
    return rows


_COLUMNS = ("symbol", "arch", "VGPR(+AGPR)", "AGPR", "SGPR", "LDS bytes", "scratch", "spills v/s", "waves/SIMD")


def format_report(rows: Sequence[KernelResources]) -> str:
    """One aligned line per kernel and arch, under a header."""
    table = [_COLUMNS] + [
        (r.symbol, r.arch, str(r.vgpr), str(r.agpr), str(r.sgpr), str(r.lds_bytes),
         str(r.scratch_bytes) + ("+dyn" if r.dynamic_stack else ""),
         f"{r.vgpr_spills}/{r.sgpr_spills}", str(r.waves_per_simd))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in table
    )


def check_budget(rows: Sequence[KernelResources]) -> list[str]:
    """Budget violations, one sentence each; empty when every kernel is within budget."""
    problems = []
    for r in rows:
        where = f"{r.symbol} on {r.arch}"
        if r.scratch_bytes > 0:
            problems.append(f"{where}: {r.scratch_bytes} bytes of scratch per lane (budget 0)")
        if r.dynamic_stack:
            problems.append(f"{where}: dynamic stack of unknown size (recursion, alloca or indirect call)")
        if r.vgpr_spills or r.sgpr_spills:
            problems.append(f"{where}: spills {r.vgpr_spills} VGPRs and {r.sgpr_spills} SGPRs (budget 0)")
        limit = ARCH_LIMITS[r.arch].lds_per_cu
        if r.lds_bytes > limit:
            problems.append(f"{where}: {r.lds_bytes} bytes of LDS (budget {limit} = one CU)")
        elif r.waves_per_simd == 0:
            problems.append(f"{where}: one block does not fit on a CU with these registers")
    return problems
