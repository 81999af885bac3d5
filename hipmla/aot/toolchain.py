"""The clang toolchain, and builds of one kernel into a code object with it.

:func:`find_clang` picks a clang that builds gfx950 HIP device code (``$HIPMLA_CLANG``,
``amdclang++``, ``clang++-22``, ``clang++``); :func:`find_readelf` and
:func:`find_objdump` the LLVM tools of the same build. :func:`compile_source` writes
``<symbol>-<arch>-<key>-<compiler>.co``: ``key`` (:func:`object_key`) hashes the
translation unit, the options, the arch and the fixed compiler flags; ``compiler``
hashes the ``clang --version`` text.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from hipmla.aot.occupancy import _check_arch
from hipmla.kernels import KernelSpec, translation_unit

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


class ToolchainNotFound(RuntimeError):
    """No usable clang or llvm-readelf; the message lists what was tried."""


class CompileError(RuntimeError):
    """A build failed; ``stderr`` holds the compiler's own diagnostics."""

    def __init__(self, message: str, command: Sequence[str], stderr: str):
        super().__init__(f"{message}\n{stderr.rstrip()}")
        self.command = list(command)
        self.stderr = stderr


# --- the tools -------------------------------------------------------------------


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
        if is_code_object(target):
            return target
        target.unlink()  # truncated or overwritten since it was built: build it again

    with tempfile.TemporaryDirectory(prefix="hipmla-aot-") as tmp:
        tu = Path(tmp, f"{symbol}.hip")
        tu.write_text(source_text)
        fd, partial_name = tempfile.mkstemp(dir=out_dir, prefix=f".{stem}.", suffix=".tmp")
        os.close(fd)
        partial = Path(partial_name)
        cmd = [clang, *BUILD_FLAGS, f"--offload-arch={arch}", *options, str(tu), "-o", str(partial)]
        try:
            # clang's own temporaries (and its crash reproducers) go where this build's do
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                                  env={**os.environ, "TMPDIR": tmp})
        except subprocess.TimeoutExpired:
            partial.unlink(missing_ok=True)
            raise CompileError(f"{symbol} for {arch}: clang ran over {COMPILE_TIMEOUT_S} s", cmd, "") from None
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise CompileError(f"{symbol} for {arch}: clang exited {proc.returncode}", cmd, proc.stderr)
        if not is_code_object(partial):
            partial.unlink(missing_ok=True)
            raise CompileError(f"{symbol} for {arch}: clang exited 0 but wrote no code object (an ELF file)",
                               cmd, proc.stderr)
        os.replace(partial, target)
    return target


#: The first bytes of every code object (an ELF file).
ELF_MAGIC = b"\x7fELF"


def is_code_object(path: Path) -> bool:
    """Whether ``path`` starts as a code object does (an ELF header): an empty or
    overwritten file must be neither reused nor loaded."""
    try:
        with open(path, "rb") as f:
            return f.read(len(ELF_MAGIC)) == ELF_MAGIC
    except OSError:
        return False


def compile_offline(spec: KernelSpec, arch: str, out_dir: Path) -> Path:
    """Build one kernel of ``hipmla.kernels`` for ``arch`` into ``out_dir``."""
    return compile_source(translation_unit(spec.source), spec.symbol, arch, spec.options(arch), out_dir)
