"""The one package that talks to the HIP runtime and hiprtc (through hip-python).

Everything else in hipmla calls this package, through the names it exports here
(``runtime.alloc``, ``runtime.load_kernel``, ...); every HIP call goes through
:func:`check`, which turns a failed status into :class:`HipError` with the error's
name and description. Its modules, bottom up:

- :mod:`~hipmla.runtime.library`: which HIP runtime (``HIPMLA_PLATFORM``: ROCm, or on an
  NVIDIA GPU hipmla's HIP-on-CUDA library), hip-python loaded once per process at the
  first call, :func:`check` and the errors. Nothing touches a GPU at import time.
- :mod:`~hipmla.runtime.device`: device count, the current device, :class:`DeviceInfo`.
- :mod:`~hipmla.runtime.streams`: :class:`Stream` and :class:`Event`.
- :mod:`~hipmla.runtime.memory`: :class:`DeviceBuffer`, copies, memset, :class:`DeviceArray`.
- :mod:`~hipmla.runtime.compiler`: hiprtc and the on-disk compile cache.
- :mod:`~hipmla.runtime.launch`: loaded code objects, kernel launches, :func:`load_kernel`.

Lifetimes: :class:`DeviceBuffer`, :class:`Stream`, :class:`Event` and :class:`Module`
own their handles and release them on ``close()``/``free()``, on leaving a ``with``
block, or when collected (only in the process that created them: a forked child
must not free its parent's handles).
"""

from __future__ import annotations

import threading
from typing import Any

# --- the process's runtime state -----------------------------------------------------
#
# Here and nowhere else: the modules below read and set it as ``runtime.<name>`` when
# called, so what a test or script puts here (a fake ``runtime.hip``, a stubbed
# ``runtime._c_launch``) is what all of them use. Defined before they are imported.

# The hip-python modules, bound by library._ensure_runtime(); every call is written
# ``runtime.hip.<function>(...)`` / ``runtime.hiprtc.<function>(...)`` so the API subset
# hipmla uses can be read off this package.
hip: Any = None
hiprtc: Any = None

_lock = threading.Lock()


class _ThreadState(threading.local):
    device: int | None = None  # the device hipmla last made current on this thread


_thread = _ThreadState()
_platform: str | None = None
_init_error: RuntimeUnavailable | None = None
_compiler_version: str | None = None
_device_infos: dict[int, DeviceInfo] = {}
_kernels: dict[tuple, Function] = {}
_c_launch = None  # ctypes hipModuleLaunchKernel once bound, False where unavailable

# --- what the runtime exports ----------------------------------------------------------

from hipmla.runtime.library import (  # noqa: E402
    PLATFORMS,
    HipError,
    RuntimeUnavailable,
    check,
    platform,
    platform_choice,
    point_hip_python_at_rocm_path,
)
from hipmla.runtime.device import (  # noqa: E402
    DeviceInfo,
    available,
    device_count,
    device_info,
    memory_info,
    peak_bandwidth_gbs,
    set_device,
    split_arch,
    synchronize,
    use_device,
    versions,
)
from hipmla.runtime.streams import Event, Stream  # noqa: E402
from hipmla.runtime.memory import (  # noqa: E402
    DeviceArray,
    DeviceBuffer,
    alloc,
    copy_dtod,
    copy_dtoh,
    copy_htod,
    memset,
)
from hipmla.runtime.compiler import (  # noqa: E402
    CACHE_FORMAT_VERSION,
    CompileError,
    cache_dir,
    cache_key,
    compile_source,
    compiler_version,
)
from hipmla.runtime.launch import (  # noqa: E402
    MAX_BLOCK_THREADS,
    BoundLaunch,
    Function,
    Module,
    load_kernel,
)

__all__ = [
    "BoundLaunch",
    "CACHE_FORMAT_VERSION",
    "CompileError",
    "DeviceArray",
    "DeviceBuffer",
    "DeviceInfo",
    "Event",
    "Function",
    "HipError",
    "MAX_BLOCK_THREADS",
    "Module",
    "PLATFORMS",
    "RuntimeUnavailable",
    "Stream",
    "alloc",
    "available",
    "cache_dir",
    "cache_key",
    "check",
    "compile_source",
    "compiler_version",
    "copy_dtod",
    "copy_dtoh",
    "copy_htod",
    "device_count",
    "device_info",
    "load_kernel",
    "memory_info",
    "memset",
    "peak_bandwidth_gbs",
    "platform",
    "platform_choice",
    "point_hip_python_at_rocm_path",
    "set_device",
    "split_arch",
    "synchronize",
    "use_device",
    "versions",
]
