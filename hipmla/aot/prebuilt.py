"""Where the runtime finds code objects built ahead of time, and takes one.

Before the runtime compiles a kernel with hiprtc it calls :func:`find_prebuilt`, which
returns an object only when it was built from exactly the translation unit and options
the runtime is about to compile. It looks up by the object key alone (:func:`object_key`),
because it has no clang to ask for a version: any compiler's build of the same source
and options is a valid build of that kernel.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from hipmla import aot
from hipmla.aot.occupancy import ARCH_LIMITS
from hipmla.aot.toolchain import ELF_MAGIC, object_key
from hipmla.kernels import KernelSpec

#: Objects shipped inside the installed package (a wheel built with prebuilt kernels);
#: searched last, never written.
PACKAGE_AOT_DIR = Path(__file__).resolve().parent.parent / "_aot"


def default_aot_dir() -> Path:
    """The user cache: ``$XDG_CACHE_HOME/hipmla/aot``, by default ``~/.cache/hipmla/aot``
    (never site-packages, so nothing is left behind by an uninstall)."""
    if aot.DEFAULT_AOT_DIR is not None:
        return Path(aot.DEFAULT_AOT_DIR)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hipmla" / "aot"


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
        for path in found:
            code = path.read_bytes()
            if code.startswith(ELF_MAGIC):  # an empty or overwritten file is no build: hiprtc builds instead
                return code
    return None
