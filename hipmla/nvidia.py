"""hipmla's HIP-on-CUDA library: what lets the hip-python code path run on NVIDIA GPUs.

``hip_src/nvidia/hip_on_cuda.c`` implements the HIP runtime and hiprtc functions hipmla
calls on top of the CUDA driver API and NVRTC (both opened with dlopen, so building needs
only a C compiler). :func:`build_shim` compiles it into ``<root>/lib/libamdhip64.so`` with
``libhiprtc.so`` beside it; hip-python then finds both through ``ROCM_PATH=<root>``.
Choosing when to do that is :mod:`hipmla.runtime`'s job; it calls :func:`shim_root`.

Environment:
    HIPMLA_NVIDIA_DIR  where to build (default ``~/.cache/hipmla/nvidia/<hash of sources>``)
    HIPMLA_NVRTC       NVRTC library the shim loads first; set here when the ``nvidia``
                       Python package (pip ``nvidia-cuda-nvrtc``) ships one
    HIPMLA_LIBCUDA     CUDA driver library (default ``libcuda.so.1``)
    CC                 C compiler (default the first of cc, gcc, clang)
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from hipmla.validate import folder_arg

LIBRARY = "libamdhip64.so"
#: hip-python opens the hiprtc half under this name; it is a link to LIBRARY.
HIPRTC_LIBRARY = "libhiprtc.so"
SOURCE = "hip_on_cuda.c"
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-fvisibility=hidden")
LIBS = ("-ldl", "-lpthread")
DEFAULT_COMPILERS = ("cc", "gcc", "clang")
#: NVRTC versions the shim can drive, newest first (directory in the ``nvidia`` package).
NVRTC_PACKAGE_DIRS = ("cu13/lib", "cu12/lib", "cuda_nvrtc/lib")


def shim_source_dir() -> Path:
    """``hip_src/nvidia``: the C sources of the library."""
    try:
        from hipmla.kernels import hip_src_dir
    except ImportError:
        return Path(__file__).resolve().parent.parent / "hip_src" / "nvidia"
    return Path(hip_src_dir()) / "nvidia"


def _main_source(source_dir: Path) -> Path:
    path = source_dir / SOURCE
    if not path.is_file():
        raise FileNotFoundError(f"shim sources: expected {path}, it does not exist")
    return path


def _sources(source_dir: Path) -> list[Path]:
    _main_source(source_dir)
    return sorted(p for p in source_dir.iterdir() if p.suffix in (".c", ".h"))


def source_hash() -> str:
    """Short hash of the library's sources and build flags: names its cache directory."""
    digest = hashlib.sha256()
    digest.update(" ".join(CFLAGS + LIBS).encode())
    for path in _sources(shim_source_dir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def default_out_dir() -> Path:
    override = os.environ.get("HIPMLA_NVIDIA_DIR")
    if override:
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hipmla" / "nvidia" / source_hash()


def find_compiler(cc: str | None = None) -> str:
    """The C compiler to use: ``cc``, else $CC, else the first of cc, gcc, clang on PATH."""
    wanted = cc or os.environ.get("CC")
    if wanted:
        found = shutil.which(wanted)
        if found is None:
            source = "--cc" if cc else "$CC"
            raise FileNotFoundError(f"{source}: expected a C compiler on PATH, got {wanted!r}")
        return found
    for name in DEFAULT_COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        f"no C compiler found (tried {', '.join(DEFAULT_COMPILERS)}); install one or set CC"
    )


def _is_built(root: Path) -> bool:
    lib = root / "lib"
    return (lib / LIBRARY).is_file() and (lib / HIPRTC_LIBRARY).exists()


def build_shim(out_dir: Path | None = None, cc: str | None = None) -> Path:
    """Compile the library into ``out_dir/lib`` and return ``out_dir`` (for ROCM_PATH).

    Files are written under temporary names and renamed into place, so processes that
    build concurrently, or one that loads the library meanwhile, never see half a file.
    """
    root = Path(out_dir).expanduser() if out_dir is not None else default_out_dir()
    compiler = find_compiler(cc)
    source_dir = shim_source_dir()
    source = _main_source(source_dir)
    lib = root / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LIBRARY}.", dir=lib)
    os.close(fd)
    tmp = Path(tmp_name)
    command = [compiler, *CFLAGS, "-I", str(source_dir), str(source), "-o", str(tmp), *LIBS]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"building {LIBRARY} failed ({' '.join(command)}):\n{done.stderr.strip()}"
            )
        tmp.chmod(0o755)  # mkstemp made it 0600; other users may share the cache
        os.replace(tmp, lib / LIBRARY)
    finally:
        tmp.unlink(missing_ok=True)
    link_tmp = lib / f".{HIPRTC_LIBRARY}.{os.getpid()}"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(LIBRARY)
    os.replace(link_tmp, lib / HIPRTC_LIBRARY)
    return root


def find_nvrtc() -> Path | None:
    """An NVRTC shipped by the ``nvidia`` Python package (pip nvidia-cuda-nvrtc), if any.

    The loader cache is the shim's own fallback; this covers the pip-only installs that
    the loader cannot see.
    """
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for package_dir in spec.submodule_search_locations:
        for sub in NVRTC_PACKAGE_DIRS:
            candidates = sorted(Path(package_dir, sub).glob("libnvrtc.so*"), reverse=True)
            if candidates:
                return candidates[0]
    return None


def find_cuda_tool(name: str) -> str | None:
    """A CUDA command-line tool (``cuobjdump``, ``nvdisasm``, ``nvcc``): on PATH, or shipped
    by a pip ``nvidia-cuda-*`` wheel (which puts it under ``nvidia/<package>/bin``)."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for package_dir in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(package_dir).glob(f"*/bin/{name}")):
            return str(candidate)
    return None


def shim_env(root: Path) -> dict[str, str]:
    """Environment entries that make hip-python in a child process use the shim at ``root``."""
    env = {"ROCM_PATH": str(root)}
    nvrtc = os.environ.get("HIPMLA_NVRTC") or find_nvrtc()
    if nvrtc:
        env["HIPMLA_NVRTC"] = str(nvrtc)
    return env


def shim_root(build: bool = True) -> Path:
    """The directory to use as ROCM_PATH for the shim.

    With ``build`` the library is compiled there first if it is not yet; without, the
    path is returned either way (callers compare it with ROCM_PATH). Also points
    HIPMLA_NVRTC at a pip-installed NVRTC when the user has not chosen one, because the
    shim reads it when hiprtc is first used in this process.
    """
    root = default_out_dir()
    if build and not _is_built(root):
        build_shim(root)
    nvrtc = shim_env(root).get("HIPMLA_NVRTC")
    if nvrtc:
        os.environ.setdefault("HIPMLA_NVRTC", nvrtc)
    return root


def nvidia_gpu_present() -> bool:
    """libcuda.so.1 loads, initializes and reports at least one device. Never raises."""
    try:
        cuda = ctypes.CDLL(os.environ.get("HIPMLA_LIBCUDA") or "libcuda.so.1")
        count = ctypes.c_int(0)
        return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except (OSError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hipmla nvidia-runtime [--out DIR] [--cc CC]``: build and say how to use it."""
    parser = argparse.ArgumentParser(
        prog="python -m hipmla nvidia-runtime",
        description="Build hipmla's HIP-on-CUDA library (libamdhip64.so + libhiprtc.so) "
                    "so that hip-python runs on NVIDIA GPUs.",
    )
    parser.add_argument("--out", type=folder_arg, default=None,
                        help="directory to build into (default: $HIPMLA_NVIDIA_DIR or the cache)")
    parser.add_argument("--cc", default=None, help="C compiler (default: $CC, cc, gcc or clang)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # what an argparse REMAINDER in front of us passes on
        argv = argv[1:]
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out = args.out.resolve()  # the exports below work from any folder
    try:
        root = build_shim(args.out, args.cc)
    except FileNotFoundError as e:  # no such compiler: what was asked for is wrong
        print(f"hipmla nvidia-runtime: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:
        print(f"hipmla nvidia-runtime: {e}", file=sys.stderr)
        return 1
    print(root)
    print(f"\nBuilt {root / 'lib' / LIBRARY} (+ {HIPRTC_LIBRARY}). Use it with either of:", file=sys.stderr)
    platform = "HIPMLA_PLATFORM=nvidia"
    if args.out is not None and root.resolve() != default_out_dir().resolve():
        platform = f"HIPMLA_NVIDIA_DIR={root} {platform}"
    print(f"  {platform}   (hipmla selects it by itself)", file=sys.stderr)
    exports = " ".join(f"{k}={v}" for k, v in shim_env(root).items())
    print(f"  export {exports}   (any hip-python program)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
