"""Ahead-of-time builds of the hipmla kernels with clang, and their resource report.

``python -m hipmla build --arch gfx950,gfx942`` compiles every kernel of
``hipmla.kernels.kernels_for_arch(arch)`` (the portable kernels, plus the arch's fast
ones) into a code object per architecture, reads the
register, LDS and scratch use the compiler recorded in each object's AMDGPU metadata
note, prints one line per kernel and architecture and fails when a kernel breaks the
project's budget (no scratch, no spills, LDS within one CU). This is the compile
evidence for AMD targets on machines that have no AMD GPU.

With ``--report`` it also counts the tile loops of the fast kernels (llvm-objdump) and
hands the counts to the performance model (:mod:`hipmla.perfmodel`), which prints the
H200 calibration and the PREDICTED MI355X / MI300X times.

The same objects serve the runtime: before it compiles a kernel with hiprtc it calls
:func:`find_prebuilt`, which returns an object only when it was built from exactly the
translation unit and options the runtime is about to compile.

Object names are ``<symbol>-<arch>-<key>-<compiler>.co``: ``key`` hashes the
translation unit, the options, the architecture and the fixed compiler flags;
``compiler`` hashes the ``clang --version`` text. A changed source therefore never
matches, and a rebuild with another compiler writes a new object instead of reusing
one made by the old compiler. The runtime looks up by ``key`` alone, because it has no
clang to ask for a version: any compiler's build of the same source and options is a
valid build of that kernel.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hipmla import perfmodel
from hipmla.kernels import FORMAT_CODES, KernelSpec, fast_kernels, kernels_for_arch, translation_unit
from hipmla.perfmodel import MFMA_CYCLES, SIMDS_PER_CU

#: Where ``build`` writes by default and the runtime looks after ``$HIPMLA_AOT_DIR``:
#: None means :func:`default_aot_dir` at the time of the call (a Path set here wins).
DEFAULT_AOT_DIR: Path | None = None
#: Objects shipped inside the installed package (a wheel built with prebuilt kernels);
#: searched last, never written.
PACKAGE_AOT_DIR = Path(__file__).resolve().parent / "_aot"


def default_aot_dir() -> Path:
    """The user cache: ``$XDG_CACHE_HOME/hipmla/aot``, by default ``~/.cache/hipmla/aot``
    (never site-packages, so nothing is left behind by an uninstall)."""
    if DEFAULT_AOT_DIR is not None:
        return Path(DEFAULT_AOT_DIR)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hipmla" / "aot"
#: Part of every object key: bump it when the naming or build recipe changes meaning.
FORMAT_VERSION = 1
#: Flags of every build besides the arch and the kernel's own options. They are part of
#: the object key, so changing them here orphans every old object.
BUILD_FLAGS = (
    "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc",
    "--no-gpu-bundle-output", "-O3", "-std=c++17",
)
#: The arch a clang must accept to be used at all: the newest target of the project.
PROBE_ARCH = "gfx950"
COMPILE_TIMEOUT_S = 600


# Occupancy model (waves resident per SIMD) of the gfx90a-family CUs, gfx942 and gfx950:
# - Register file: 512 VGPRs per lane per SIMD, shared by arch VGPRs and AGPRs (the
#   "unified" file), handed out in granules of 8; at most 8 waves per SIMD. Sources:
#   the AMD Instinct MI200 (CDNA2) ISA guide, section 3.6.4, cited by LLVM commit
#   b7611370 (512 in total, at most 256 each of VGPR and AGPR; CDNA3/4 keep the design);
#   LLVM AMDGPUBaseInfo getTotalNumVGPRs / getVGPRAllocGranule / getMaxWavesPerEU
#   (gfx90a-family: 512, 8, 8); ROCm "GPU hardware specifications" table (a 512 KiB
#   VGPR file per CU for MI300X and MI355X = 4 SIMDs x 512 x 64 lanes x 4 B).
#   The metadata's .vgpr_count is already that unified total (arch VGPRs rounded up to
#   4, plus AGPRs; LLVM getTotalNumVGPRs): a kernel with 4 arch VGPRs and 3 AGPRs
#   reports .vgpr_count 7 and .agpr_count 3. Adding .agpr_count again would double-count.
#   waves_vgpr = min(8, 512 // roundup(vgpr, 8)).
# - SGPRs: 800 per SIMD on GFX9-generation chips; LLVM getOccupancyWithNumSGPRs gives
#   at most 8 waves up to 100 SGPRs and 7 above, so only > 100 can bind at the cap of 8.
# - LDS per CU: gfx950 160 KiB, gfx942 64 KiB (ROCm "GPU hardware specifications";
#   LLVM's local memory size for these targets); 4 SIMDs per CU, wave64.
#   blocks_per_cu = min(lds_per_cu // block_lds, (4 * min(waves_vgpr, waves_sgpr)) //
#   waves_per_block); waves_per_simd = ceil(blocks_per_cu * waves_per_block / 4): the
#   waves of the resident blocks spread as evenly as possible over the 4 SIMDs, the
#   same rounding LLVM's getOccupancyWithWorkGroupSizes uses. The 16 barrier slots per
#   CU never bind here: 8 waves x 4 SIMDs of blocks of >= 2 waves is <= 16 blocks.
#   0 means one block does not fit on a CU at all (LLVM would say 1; we want it seen).
# Checked against the "; Occupancy:" comment clang-22 writes for test kernels.
VGPRS_PER_SIMD_LANE = 512
VGPR_GRANULE = 8
MAX_WAVES_PER_SIMD = 8
SGPRS_FOR_FULL_OCCUPANCY = 100
WAVE_SIZE = 64  # SIMDS_PER_CU (4) comes from hipmla.perfmodel, which issues on the same SIMDs


@dataclass(frozen=True)
class ArchLimits:
    lds_per_cu: int  # bytes of LDS one CU shares among its resident blocks


ARCH_LIMITS: dict[str, ArchLimits] = {
    "gfx950": ArchLimits(lds_per_cu=160 * 1024),
    "gfx942": ArchLimits(lds_per_cu=64 * 1024),
}


class ToolchainNotFound(RuntimeError):
    """No usable clang or llvm-readelf; the message lists what was tried."""


class CompileError(RuntimeError):
    """A build failed; ``stderr`` holds the compiler's own diagnostics."""

    def __init__(self, message: str, command: Sequence[str], stderr: str):
        super().__init__(f"{message}\n{stderr.rstrip()}")
        self.command = list(command)
        self.stderr = stderr


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


# --- toolchain -------------------------------------------------------------------


def find_clang() -> str:
    """Path of a clang that builds gfx950 HIP device code.

    ``$HIPMLA_CLANG`` wins and must work when set (a broken explicit choice is an
    error, not something to route around); otherwise the first usable of
    ``amdclang++`` (on PATH or in ``$ROCM_PATH/llvm/bin``), ``clang++-22``, ``clang++``.
    A candidate is usable when it accepts ``--offload-arch=gfx950``; asking it beats
    guessing from version numbers (LLVM 19 says 19 and knows no gfx950).
    """
    explicit = os.environ.get("HIPMLA_CLANG")
    if explicit:
        path = shutil.which(explicit)
        if path is None:
            raise ToolchainNotFound(f"HIPMLA_CLANG={explicit!r}: not an executable")
        why = _probe_clang(path)
        if why:
            raise ToolchainNotFound(f"HIPMLA_CLANG={explicit!r}: {why}")
        return path

    rocm = os.environ.get("ROCM_PATH") or os.environ.get("ROCM_HOME") or "/opt/rocm"
    candidates = [
        ("amdclang++", shutil.which("amdclang++") or _executable(Path(rocm, "llvm", "bin", "amdclang++"))),
        ("clang++-22", shutil.which("clang++-22")),
        ("clang++", shutil.which("clang++")),
    ]
    tried = []
    for name, path in candidates:
        if path is None:
            tried.append(f"{name}: not found")
            continue
        why = _probe_clang(path)
        if not why:
            return path
        tried.append(f"{path}: {why}")
    raise ToolchainNotFound(
        f"no clang that builds HIP device code for {PROBE_ARCH}; tried "
        + "; ".join(tried)
        + ". Install clang-22 (apt-get install clang-22 lld-22) or ROCm, or set HIPMLA_CLANG."
    )


def _executable(path: Path) -> str | None:
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


@lru_cache(maxsize=None)
def _probe_clang(path: str) -> str:
    """Why ``path`` cannot build gfx950 device code, or '' when it can."""
    cmd = [path, "-x", "hip", f"--offload-arch={PROBE_ARCH}", "--cuda-device-only",
           "-nogpulib", "-nogpuinc", "-fsyntax-only", "-"]
    try:
        proc = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=60)
    except OSError as e:
        return f"cannot run ({e})"
    except subprocess.TimeoutExpired:
        return "timed out on an empty translation unit"
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"rejects --offload-arch={PROBE_ARCH} ({lines[0] if lines else f'exit {proc.returncode}'})"
    return ""


@lru_cache(maxsize=None)
def compiler_version(clang: str) -> str:
    """First line of ``clang --version``: names the compiler build in object names."""
    proc = subprocess.run([clang, "--version"], capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ToolchainNotFound(f"{clang} --version failed: {proc.stderr.strip()}")
    return lines[0]


def find_readelf(clang: str) -> str:
    """The llvm-readelf of the same LLVM as ``clang``: older ones mis-decode new notes.

    Looks beside the resolved compiler first (/usr/lib/llvm-22/bin, ROCm's llvm/bin),
    then beside the name that was called (/usr/bin), then ``llvm-readelf-<major>`` on PATH.
    """
    match = re.search(r"version (\d+)\.", compiler_version(clang))
    versioned = f"llvm-readelf-{match.group(1)}" if match else None
    names = [n for n in (versioned, "llvm-readelf") if n]
    dirs = [Path(os.path.realpath(clang)).parent, Path(clang).parent]
    tried = []
    for d in dirs:
        for name in names:
            found = _executable(d / name)
            if found:
                return found
            tried.append(str(d / name))
    if versioned:
        found = shutil.which(versioned)
        if found:
            return found
        tried.append(f"{versioned} on PATH")
    raise ToolchainNotFound(f"no llvm-readelf matching {clang}; tried " + ", ".join(tried))


def find_objdump(clang: str) -> str:
    """The llvm-objdump of the same LLVM as ``clang`` (beside its llvm-readelf)."""
    readelf = Path(find_readelf(clang))
    name = readelf.name.replace("readelf", "objdump")
    for candidate in (readelf.parent / name, readelf.parent / "llvm-objdump"):
        found = _executable(candidate)
        if found:
            return found
    found = shutil.which(name)
    if found:
        return found
    raise ToolchainNotFound(f"no llvm-objdump beside {readelf} and no {name} on PATH")


# --- building ----------------------------------------------------------------------


def _check_arch(arch: str) -> str:
    if arch not in ARCH_LIMITS:
        raise ValueError(f"arch: expected one of {sorted(ARCH_LIMITS)}, got {arch!r}")
    return arch


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def object_key(source_text: str, options: Sequence[str], arch: str) -> str:
    """Hash of everything that decides what a build contains, except the compiler."""
    return _digest(json.dumps([FORMAT_VERSION, arch, list(BUILD_FLAGS), list(options), source_text]))


def compile_source(
    source_text: str, symbol: str, arch: str, options: Sequence[str], out_dir: Path
) -> Path:
    """Build ``source_text`` (one self-contained translation unit) into a code object.

    Returns the existing object when this exact build was made before: the name covers
    source, options, arch, flags and compiler. The object appears atomically, so a
    reader never sees a half-written file and parallel builds do not collide.
    """
    _check_arch(arch)
    options = [str(o) for o in options]
    clang = find_clang()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{symbol}-{arch}-{object_key(source_text, options, arch)}-{_digest(compiler_version(clang))}"
    target = out_dir / f"{stem}.co"
    if target.is_file():
        return target

    with tempfile.TemporaryDirectory(prefix="hipmla-aot-") as tmp:
        tu = Path(tmp, f"{symbol}.hip")
        tu.write_text(source_text)
        fd, partial_name = tempfile.mkstemp(dir=out_dir, prefix=f".{stem}.", suffix=".tmp")
        os.close(fd)
        partial = Path(partial_name)
        cmd = [clang, *BUILD_FLAGS, f"--offload-arch={arch}", *options, str(tu), "-o", str(partial)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            partial.unlink(missing_ok=True)
            raise CompileError(f"{symbol} for {arch}: clang ran over {COMPILE_TIMEOUT_S} s", cmd, "") from None
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise CompileError(f"{symbol} for {arch}: clang exited {proc.returncode}", cmd, proc.stderr)
        os.replace(partial, target)
    return target


def compile_offline(spec: KernelSpec, arch: str, out_dir: Path) -> Path:
    """Build one kernel of ``hipmla.kernels`` for ``arch`` into ``out_dir``."""
    return compile_source(translation_unit(spec.source), spec.symbol, arch, spec.options(arch), out_dir)


# --- resources -----------------------------------------------------------------------

_REQUIRED_KEYS = (
    ".name", ".vgpr_count", ".sgpr_count", ".group_segment_fixed_size",
    ".private_segment_fixed_size", ".vgpr_spill_count", ".sgpr_spill_count",
    ".max_flat_workgroup_size",
)


def waves_per_simd(arch: str, *, vgpr: int, sgpr: int, lds_bytes: int, block_threads: int) -> int:
    """Waves of one kernel resident per SIMD (model and sources in the comment above)."""
    limits = ARCH_LIMITS[_check_arch(arch)]
    if block_threads < 1:
        raise ValueError(f"block_threads: expected >= 1, got {block_threads}")
    by_vgpr = min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD_LANE // (-(-max(vgpr, 1) // VGPR_GRANULE) * VGPR_GRANULE))
    by_sgpr = MAX_WAVES_PER_SIMD if sgpr <= SGPRS_FOR_FULL_OCCUPANCY else MAX_WAVES_PER_SIMD - 1
    waves_per_block = -(-block_threads // WAVE_SIZE)
    blocks_by_regs = SIMDS_PER_CU * min(by_vgpr, by_sgpr) // waves_per_block
    blocks_by_lds = limits.lds_per_cu // lds_bytes if lds_bytes else blocks_by_regs
    blocks = min(blocks_by_regs, blocks_by_lds)
    return math.ceil(blocks * waves_per_block / SIMDS_PER_CU)


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

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        specs = fast_kernels if fast_only else kernels_for_arch
        futures = [pool.submit(build, spec, arch) for arch in archs for spec in specs(arch)]
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


# --- instruction counts of the fast kernels (the performance model's input) ---------------
#
# Static counts of a kernel's tile loop (the backward branch whose body holds the most
# MFMAs), read from ``llvm-objdump -d``. For the fast kernels one trip of that loop is one
# 128-token tile for each of the block's waves, so the counts are per wave and tile. The
# cycles an MFMA issues for are the model's (hipmla.perfmodel.MFMA_CYCLES).

_INSTRUCTION = re.compile(r"^\s+([a-z][a-z0-9_]*)\b(.*?//\s*([0-9A-Fa-f]+):.*)$")
_BRANCH_TARGET = re.compile(r"<[^>+]+\+0x([0-9a-fA-F]+)>")


@dataclass(frozen=True)
class Instruction:
    address: int
    mnemonic: str
    operands: str  # the rest of objdump's line: operands, encoding, branch target


@dataclass(frozen=True)
class LoopCounts:
    """Instructions of one trip of a kernel's main loop, by kind."""

    symbol: str
    mfma: int  # v_mfma* (scaled and plain)
    mfma_cycles: int  # their issue cycles on the kernel's target (MFMA_CYCLES)
    valu: int  # other v_* (including the converts)
    transcendental: int  # the quarter-rate part of ``valu`` (exp, log, rcp, sqrt)
    lds: int  # ds_* (reads, writes, bpermute)
    lds_bytes: int  # bytes those move per wave
    global_loads: int  # global_load* / buffer_load* (LDS copies included)
    salu: int  # s_* (waits and branches included)
    total: int
    # s_waitcnt on vmcnt between the loop's first and last MFMA: a wait for memory inside
    # the tile's math (the next tile's copies must not be waited for there)
    vm_waits_in_math: int = 0


def parse_disassembly(text: str, symbol: str) -> list[Instruction]:
    """The instructions of ``symbol`` in ``llvm-objdump -d`` output, with addresses."""
    start = re.search(rf"^[0-9a-fA-F]+ <{re.escape(symbol)}>:\s*$", text, re.M)
    if start is None:
        raise ValueError(f"symbol: no function {symbol!r} in the disassembly")
    out = []
    for line in text[start.end():].splitlines():
        if re.match(r"^[0-9a-fA-F]+ <", line):
            break
        m = _INSTRUCTION.match(line)
        if m:
            out.append(Instruction(int(m.group(3), 16), m.group(1), m.group(2).strip()))
    if not out:
        raise ValueError(f"symbol: {symbol!r} has no instructions in the disassembly")
    return out


def main_loop(instructions: Sequence[Instruction], symbol: str, base: int) -> list[Instruction]:
    """Body of the backward branch whose range holds the most MFMAs (ties: the shortest).
    ``base`` is the function's address, to which objdump's ``<sym+0x..>`` targets are
    relative."""
    best: list[Instruction] = []
    best_key = (-1, 0)
    for i, ins in enumerate(instructions):
        if not ins.mnemonic.startswith(("s_branch", "s_cbranch")):
            continue
        m = _BRANCH_TARGET.search(ins.operands)
        if m is None:
            continue
        target = base + int(m.group(1), 16)
        if target > ins.address:
            continue
        body = [x for x in instructions[: i + 1] if x.address >= target]
        key = (sum(x.mnemonic.startswith("v_mfma") for x in body), -len(body))
        if key > best_key:
            best, best_key = body, key
    if not best:
        raise ValueError(f"symbol: {symbol!r} has no loop")
    return best


_TRANSCENDENTAL = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")
_LDS_WIDTH = {"b128": 16, "b96": 12, "b64": 8, "2addr_b64": 16}


def _mfma_cycles(ins: Instruction) -> int:
    if ins.mnemonic.startswith("v_mfma_scale_f32_16x16x128_f8f6f4"):
        # cbsz / blgp name the A / B formats; objdump omits them when 0 (e4m3).
        cbsz = re.search(r"cbsz:(\d)", ins.operands)
        blgp = re.search(r"blgp:(\d)", ins.operands)
        fp4 = all(m is not None and int(m.group(1)) == 4 for m in (cbsz, blgp))
        return MFMA_CYCLES["v_mfma_scale_f32_16x16x128_f8f6f4/" + ("fp4" if fp4 else "fp8")]
    if ins.mnemonic not in MFMA_CYCLES:
        raise ValueError(f"no cycle count for {ins.mnemonic}; add it to MFMA_CYCLES")
    return MFMA_CYCLES[ins.mnemonic]


def count_loop(instructions: Sequence[Instruction], symbol: str) -> LoopCounts:
    """Counts of a loop body (see :class:`LoopCounts`)."""
    mfma = [x for x in instructions if x.mnemonic.startswith("v_mfma")]
    valu = [x for x in instructions if x.mnemonic.startswith("v_") and not x.mnemonic.startswith("v_mfma")]
    lds = [x for x in instructions if x.mnemonic.startswith("ds_")]
    lds_bytes = 0
    for x in lds:
        suffix = x.mnemonic.split("_", 2)[-1]
        lds_bytes += 64 * _LDS_WIDTH.get(suffix, 4)
    glds = [x for x in instructions if x.mnemonic.startswith(("global_load", "buffer_load"))]
    lds_bytes += sum(64 * 16 for x in glds if x.mnemonic == "global_load_lds_dwordx4")
    at = [i for i, x in enumerate(instructions) if x.mnemonic.startswith("v_mfma")]
    math = instructions[at[0]:at[-1] + 1] if at else []
    return LoopCounts(
        symbol=symbol,
        mfma=len(mfma),
        mfma_cycles=sum(_mfma_cycles(x) for x in mfma),
        valu=len(valu),
        transcendental=sum(x.mnemonic.startswith(_TRANSCENDENTAL) for x in valu),
        lds=len(lds),
        lds_bytes=lds_bytes,
        global_loads=len(glds),
        salu=sum(x.mnemonic.startswith("s_") for x in instructions),
        total=len(instructions),
        vm_waits_in_math=sum(x.mnemonic == "s_waitcnt" and "vmcnt" in x.operands for x in math),
    )


def loop_counts(co_path: Path, symbol: str) -> LoopCounts:
    """Disassembles a code object with the clang's own llvm-objdump and counts ``symbol``'s
    main loop."""
    objdump = find_objdump(find_clang())
    proc = subprocess.run([objdump, "-d", str(co_path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{objdump} -d {co_path} exited {proc.returncode}: {proc.stderr.strip()}")
    instructions = parse_disassembly(proc.stdout, symbol)
    base = int(re.search(rf"^([0-9a-fA-F]+) <{re.escape(symbol)}>:", proc.stdout, re.M).group(1), 16)
    return count_loop(main_loop(instructions, symbol, base), symbol)


def format_counts(rows: Sequence[tuple[KernelResources, LoopCounts]]) -> str:
    lines = ["per wave and 128-token tile (main loop, static): "
             "symbol  MFMA (cycles)  VALU (transc.)  LDS (bytes)  global loads  SALU  total  "
             "memory waits inside the math"]
    for r, c in rows:
        lines.append(f"{c.symbol} {r.arch}: MFMA {c.mfma} ({c.mfma_cycles} cyc)  VALU {c.valu} ({c.transcendental})  "
                     f"LDS {c.lds} ({c.lds_bytes} B)  global loads {c.global_loads}  SALU {c.salu}  total {c.total}  "
                     f"vm waits in math {c.vm_waits_in_math}")
    return "\n".join(lines)


def count_fast(rows: Sequence[KernelResources], out_dir: Path) -> list[tuple[KernelResources, KernelSpec, LoopCounts]]:
    """The fast kernels among ``rows`` (built into ``out_dir`` by :func:`build_all`), each
    with its tile loop counted."""
    counted = []
    for r in rows:
        spec = next((s for s in kernels_for_arch(r.arch) if s.symbol == r.symbol), None)
        if spec is None or not spec.tile_tokens:
            continue
        co = compile_offline(spec, r.arch, out_dir)  # already built: returns the object
        counted.append((r, spec, loop_counts(co, r.symbol)))
    return counted


def kernel_model(r: KernelResources, spec: KernelSpec, counts: LoopCounts) -> perfmodel.KernelModel:
    """What the performance model needs of a counted fast kernel on its arch's device."""
    kv = next(k for k, code in FORMAT_CODES.items() if ("HIPMLA_KV_FORMAT", str(code)) in spec.defines)
    return perfmodel.amd_kernel(counts, r.waves_per_simd, r.arch, kv, tile_tokens=spec.tile_tokens,
                                waves_per_block=-(-spec.block_threads // WAVE_SIZE))


def fast_report(rows: Sequence[KernelResources], out_dir: Path) -> str:
    """Instruction counts of the fast kernels among ``rows``, then the performance model's
    report: the H200 calibration and their PREDICTED times (MI355X for gfx950, MI300X for
    gfx942)."""
    counted = count_fast(rows, out_dir)
    if not counted:
        return "no fast kernels among the built archs"
    models = [kernel_model(*c) for c in counted]
    return format_counts([(r, c) for r, _, c in counted]) + "\n\n" + perfmodel.calibration_report(models)


def fast_kernel_models(archs: Sequence[str], out_dir: Path | None = None, jobs: int = 2) -> list[perfmodel.KernelModel]:
    """Build (or find built) the fast kernels of ``archs`` and model each from its counts."""
    out = default_aot_dir() if out_dir is None else Path(out_dir)
    rows = build_all(archs, out, jobs, fast_only=True)
    return [kernel_model(*c) for c in count_fast(rows, out)]


# --- runtime lookup ----------------------------------------------------------------------


def search_dirs() -> list[Path]:
    """``$HIPMLA_AOT_DIR`` (os.pathsep-separated) first, then :func:`default_aot_dir`
    (where ``build`` writes by default), then the package's own ``_aot``."""
    env = os.environ.get("HIPMLA_AOT_DIR", "")
    dirs = [Path(p).expanduser() for p in env.split(os.pathsep) if p] + [default_aot_dir(), PACKAGE_AOT_DIR]
    return list(dict.fromkeys(dirs))


def find_prebuilt(spec: KernelSpec, arch: str, source_text: str, options: Sequence[str]) -> bytes | None:
    """A code object built by :func:`compile_offline` for exactly this kernel, or None.

    ``source_text`` is the translation unit the runtime would hand hiprtc
    (``translation_unit(spec.source)``) and ``options`` the kernel's
    ``spec.options(arch)``, as the build hashed them. ``arch`` may carry target
    features (``gfx942:sramecc+:xnack-``): objects are built for the bare processor,
    whose "any" feature setting loads on either. Of several compilers' builds of the
    same key, the newest file wins.
    """
    processor = arch.split(":", 1)[0]
    if processor not in ARCH_LIMITS:
        return None
    key = object_key(source_text, [str(o) for o in options], processor)
    pattern = f"{glob.escape(spec.symbol)}-{processor}-{key}-*.co"
    for d in search_dirs():
        found = sorted(d.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            return found[0].read_bytes()
    return None


# --- CLI -----------------------------------------------------------------------------


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
    parser.add_argument("--arch", default="gfx950,gfx942",
                        help="comma-separated targets (default: gfx950,gfx942)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the code objects (default: $XDG_CACHE_HOME/hipmla/aot, "
                             "~/.cache/hipmla/aot; the runtime looks there and in $HIPMLA_AOT_DIR)")
    parser.add_argument("--jobs", type=_positive_int, default=2, help="compilers run at once (default: 2)")
    parser.add_argument("--report", action="store_true",
                        help="also count the fast kernels' instructions per 128-token tile and print the "
                             "performance model: its H200 calibration (predicted vs measured) and a "
                             "PREDICTED time range per benchmark shape (MI355X for gfx950, MI300X for gfx942); "
                             "'python -m hipmla model' prints the same without the resource table")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs:
        parser.error(f"argument --arch: expected comma-separated targets such as gfx950,gfx942, got {args.arch!r}")
    out_dir = default_aot_dir() if args.out is None else args.out
    try:
        rows = build_all(archs, out_dir, args.jobs)
    except (ToolchainNotFound, CompileError, ValueError) as e:
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
