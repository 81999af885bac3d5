"""Kernel compilation with hiprtc, and the on-disk cache of what it compiled.

:func:`compile_source` turns one HIP C++ translation unit into a code object for one
architecture. Results are kept under :func:`cache_dir`, named by a hash
(:func:`cache_key`) of everything that decides the code: the source, the options, the
arch, the compiler version and the platform. Entries are written whole or not at all
(:func:`_store`), so processes can share the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

from hipmla import runtime  # the process's runtime state: runtime.hiprtc, the compiler version
from hipmla.runtime.library import _ensure_runtime, check, platform

#: Bump when the bytes stored in the compile cache change meaning, so old entries
#: are never loaded.
CACHE_FORMAT_VERSION = 1


class CompileError(RuntimeError):
    """hiprtc rejected a kernel; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str):
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log


def compiler_version() -> str:
    """hiprtc and HIP runtime versions: part of the compile cache key, since a new
    compiler may emit different code for the same source."""
    if runtime._compiler_version is None:
        _ensure_runtime()
        major, minor = check(runtime.hiprtc.hiprtcVersion())
        version = check(runtime.hip.hipRuntimeGetVersion())
        runtime._compiler_version = f"hiprtc {major}.{minor}, HIP runtime {version}"
        if platform() == "nvidia":
            # Our HIP-on-CUDA library translates hiprtc options: a change there can
            # change the code for the same source and options.
            from hipmla import nvidia

            runtime._compiler_version += f", hip-on-cuda {nvidia.source_hash()}"
    return runtime._compiler_version


def cache_dir() -> Path | None:
    """Where compiled code objects are kept, or None when ``HIPMLA_CACHE=0``:
    ``$HIPMLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/hipmla/kernels`` (``~/.cache/hipmla/kernels``)."""
    if os.environ.get("HIPMLA_CACHE", "1").strip() == "0":
        return None
    configured = os.environ.get("HIPMLA_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hipmla" / "kernels"


def cache_key(source: str, options: list[str], arch: str) -> str:
    material = json.dumps(
        [CACHE_FORMAT_VERSION, source, list(options), arch, compiler_version(), platform()]
    )
    return hashlib.sha256(material.encode()).hexdigest()


def _cache_path(directory: Path, name: str, arch: str, key: str) -> Path:
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{arch}")[:80]
    return directory / f"{readable}-{key[:40]}.co"


def _store(path: Path, code: bytes) -> None:
    """Write via a temporary file and rename, so a concurrent reader sees the whole
    file or none of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(code)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(f"hipmla: could not write the kernel cache entry {path}: {e}", stacklevel=3)


def _check_compile_args(source, name, arch, options) -> list[str]:
    for arg, value in (("source", source), ("name", name), ("arch", arch)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{arg}: expected a non-empty str, got {value!r:.60}")
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise TypeError(f"options: expected a list of str, got {options!r:.120}")
    return list(options)


def compile_source(source: str, name: str, arch: str, options: list[str]) -> bytes:
    """Compile HIP C++ ``source`` for ``arch`` with hiprtc; returns the code object.

    Flags are ``--offload-arch=<arch> -O3 *options``. Results are cached on disk (see
    :func:`cache_dir`) under a hash of the source, options, arch, compiler version and
    platform. ``name`` names the program in diagnostics and the cache file.
    """
    options = _check_compile_args(source, name, arch, options)
    directory = cache_dir()
    path = None
    if directory is not None:
        path = _cache_path(directory, name, arch, cache_key(source, options, arch))
        try:
            code = path.read_bytes()
        except OSError:
            code = b""
        if code:
            return code
    code = _compile(source, name, arch, options)
    if path is not None:
        _store(path, code)
    return code


def _compile(source: str, name: str, arch: str, options: list[str]) -> bytes:
    _ensure_runtime()
    flags = [f"--offload-arch={arch}", "-O3", *options]
    prog = check(runtime.hiprtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        (status,) = runtime.hiprtc.hiprtcCompileProgram(prog, len(flags), [f.encode() for f in flags])
        if status:
            raise CompileError(
                f"hiprtc could not compile {name!r} for {arch} "
                f"({getattr(status, 'name', status)}; flags {' '.join(flags)})",
                _program_log(prog),
            )
        size = check(runtime.hiprtc.hiprtcGetCodeSize(prog))
        code = bytearray(size)
        check(runtime.hiprtc.hiprtcGetCode(prog, code))
    finally:
        check(runtime.hiprtc.hiprtcDestroyProgram(prog.createRef()))
    return bytes(code)


def _program_log(prog) -> str:
    size = check(runtime.hiprtc.hiprtcGetProgramLogSize(prog))
    if size <= 1:
        return ""
    log = bytearray(size)
    check(runtime.hiprtc.hiprtcGetProgramLog(prog, log))
    return log.split(b"\0", 1)[0].decode(errors="replace")
