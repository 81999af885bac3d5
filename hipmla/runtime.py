"""The one module that talks to the HIP runtime and hiprtc (through hip-python).

Everything else in hipmla calls this module; every HIP call here goes through
:func:`check`, which turns a failed status into :class:`HipError` with the error's
name and description.

hip-python is imported lazily and resolves ``libamdhip64.so`` / ``libhiprtc.so`` once
per process, at the first call. Before that call this module picks the platform
(``HIPMLA_PLATFORM`` = ``auto`` | ``amd`` | ``nvidia``): ROCm on AMD, or on an NVIDIA
GPU hipmla's HIP-on-CUDA library (:mod:`hipmla.nvidia`), which it exposes to
hip-python by pointing ``ROCM_PATH`` at it. Nothing touches a GPU at import time.

Lifetimes: :class:`DeviceBuffer`, :class:`Stream`, :class:`Event` and :class:`Module`
own their handles and release them on ``close()``/``free()``, on leaving a ``with``
block, or when collected (only in the process that created them: a forked child
must not free its parent's handles).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import json
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hipmla.validate import check_array

#: Bump when the bytes stored in the compile cache change meaning, so old entries
#: are never loaded.
CACHE_FORMAT_VERSION = 1
PLATFORMS = ("amd", "nvidia")
MAX_BLOCK_THREADS = 1024

# ``extra`` tags of hipModuleLaunchKernel (hip_runtime_api.h: HIP_LAUNCH_PARAM_*);
# hip-python builds the same five-entry array from a tuple.
_LAUNCH_PARAM_BUFFER_POINTER = 0x01
_LAUNCH_PARAM_BUFFER_SIZE = 0x02
_LAUNCH_PARAM_END = 0x03
_HIP_ERROR_NO_DEVICE = 100

_HOW_TO_GET_ONE = (
    "Install ROCm (https://rocm.docs.amd.com) and make libamdhip64.so findable "
    "(ROCM_PATH, /opt/rocm or LD_LIBRARY_PATH); on an NVIDIA GPU hipmla uses its own "
    "HIP-on-CUDA library: set HIPMLA_PLATFORM=nvidia (HIPMLA_PLATFORM=auto, the "
    "default, picks it when an NVIDIA GPU is present)."
)

# The hip-python modules, bound by _ensure_runtime(); every call is written
# ``hip.<function>(...)`` / ``hiprtc.<function>(...)`` so the API subset hipmla uses
# can be read off this file.
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


class HipError(RuntimeError):
    """A HIP or hiprtc call returned an error status."""

    def __init__(self, code: int, name: str, description: str):
        super().__init__(f"{name} ({code}): {description}")
        self.code = code
        self.name = name


class RuntimeUnavailable(RuntimeError):
    """No usable HIP runtime in this process."""


class CompileError(RuntimeError):
    """hiprtc rejected a kernel; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str):
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log


def check(result: tuple) -> Any:
    """Raise :class:`HipError` unless ``result[0]`` (a hip-python status) is success.

    Returns what the call produced besides the status: None, the one value, or a
    tuple of values.
    """
    status = result[0]
    if status:
        raise _error_for(status)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _error_for(status) -> HipError:
    # Both enums are IntEnums; only their class tells hiprtc results from hip errors.
    if type(status).__name__ == "hiprtcResult":
        description = hiprtc.hiprtcGetErrorString(status)[1]
        name = status.name
    else:
        name = hip.hipGetErrorName(status)[1]
        description = hip.hipGetErrorString(status)[1]
    code = int(status)
    name = str(name) if name is not None else getattr(status, "name", f"error {code}")
    return HipError(code, name, str(description) if description is not None else "")


# --- platform selection and initialisation -----------------------------------------


def _rocm_library_found() -> bool:
    roots = [os.environ.get("ROCM_PATH"), "/opt/rocm"]
    if any(r and (Path(r) / "lib" / "libamdhip64.so").is_file() for r in roots):
        return True
    try:
        ctypes.CDLL("libamdhip64.so")
    except OSError:
        return False
    return True


def _nvidia_gpu_present() -> bool:
    from hipmla.nvidia import nvidia_gpu_present

    return nvidia_gpu_present()


def _shim_root(build: bool) -> Path:
    from hipmla.nvidia import shim_root

    return shim_root(build=build)


def _rocm_path_is_shim() -> bool:
    """ROCM_PATH already names our HIP-on-CUDA library.

    A child process inherits the ROCM_PATH its parent set for the shim; without this
    check it would take the shim for ROCm and report the wrong platform.
    """
    rocm_path = os.environ.get("ROCM_PATH")
    if not rocm_path:
        return False
    return Path(rocm_path).resolve() == _shim_root(build=False).resolve()


def _use_shim() -> None:
    try:
        root = _shim_root(build=True)
    except Exception as e:
        raise RuntimeUnavailable(f"could not build hipmla's HIP-on-CUDA library: {e}") from e
    os.environ["ROCM_PATH"] = str(root)


def platform_choice() -> str:
    """``$HIPMLA_PLATFORM`` checked: ``"auto"`` (unset or empty), ``"amd"`` or ``"nvidia"``.

    Any other value raises ValueError naming the variable; :func:`available` would
    swallow it (it never raises), so callers that fall back to the host when no GPU is
    found call this first."""
    raw = os.environ.get("HIPMLA_PLATFORM", "")
    choice = raw.strip().lower() or "auto"
    if choice not in ("auto", *PLATFORMS):
        raise ValueError(
            f"HIPMLA_PLATFORM: expected one of 'auto', {', '.join(map(repr, PLATFORMS))} "
            f"(or unset), got {raw!r}"
        )
    return choice


def _select_platform() -> str:
    """Decide between ROCm and the HIP-on-CUDA library; must run before hip-python
    loads its libraries, since it looks them up once per process."""
    choice = platform_choice()
    if choice == "amd":
        return "amd"
    if choice == "nvidia":
        if not _rocm_path_is_shim():
            _use_shim()
        return "nvidia"
    if _rocm_path_is_shim():
        return "nvidia"
    if _rocm_library_found():
        return "amd"
    if _nvidia_gpu_present():
        _use_shim()
        return "nvidia"
    raise RuntimeUnavailable(
        "no HIP runtime found: libamdhip64.so is not installed and no NVIDIA GPU is "
        f"present. {_HOW_TO_GET_ONE}"
    )


def platform() -> str:
    """``"amd"`` or ``"nvidia"``: which HIP runtime this process uses (selected once)."""
    global _platform
    if _platform is None:
        with _lock:
            if _platform is None:
                _platform = _select_platform()
    return _platform


def _ensure_runtime() -> None:
    """Bind hip-python and call hipInit once; a failure is remembered and re-raised."""
    global hip, hiprtc, _init_error
    if hip is not None:
        return
    if _init_error is not None:
        raise _init_error
    selected = platform()
    with _lock:
        if hip is not None:
            return
        try:
            hip_module, hiprtc_module = _load_hip_python(selected)
        except RuntimeUnavailable as e:
            _init_error = e
            raise
        hip, hiprtc = hip_module, hiprtc_module


def _load_hip_python(selected: str) -> tuple[Any, Any]:
    """Import hip-python and initialise HIP: the call that loads the libraries."""
    try:
        from hip import hip, hiprtc
    except ImportError as e:
        raise RuntimeUnavailable(
            f"hip-python is not installed ({e}); install it with `pip install hip-python`"
        ) from e
    point_hip_python_at_rocm_path()
    where = f"ROCM_PATH={os.environ.get('ROCM_PATH', '<unset>')}"
    try:
        (status,) = hip.hipInit(0)
    except RuntimeError as e:  # hip-python raises RuntimeError when dlopen fails
        raise RuntimeUnavailable(
            f"no HIP runtime found (platform {selected!r}, {where}): {e}. {_HOW_TO_GET_ONE}"
        ) from e
    if status:
        raise RuntimeUnavailable(
            f"hipInit failed on platform {selected!r} ({where}): "
            f"{getattr(status, 'name', status)} ({int(status)}). {_HOW_TO_GET_ONE}"
        )
    return hip, hiprtc


def point_hip_python_at_rocm_path() -> None:
    """hip-python before 10.0 (the releases of ROCm 6.4 .. 7.x) dlopens the bare names
    ``libamdhip64.so`` / ``libhiprtc.so`` held in ``hip.chip.DLL`` / ``hip.chiprtc.DLL``,
    read at its first call; 10.x looks ``$ROCM_PATH/lib`` up itself. So with an older
    release, point those names at ``$ROCM_PATH/lib`` when the libraries are there (a ROCm
    install outside the loader path, or hipmla's HIP-on-CUDA library). Call it before
    hip-python's first call."""
    root = os.environ.get("ROCM_PATH")
    if not root:
        return
    try:  # only the releases before 10.0 have these modules
        import hip.chip
        import hip.chiprtc
    except ImportError:
        return
    for module, name in ((hip.chip, "libamdhip64.so"), (hip.chiprtc, "libhiprtc.so")):
        path = Path(root) / "lib" / name
        if path.is_file():
            module.DLL = str(path).encode()


def available() -> bool:
    """True if a HIP device can be used. Never raises."""
    try:
        return device_count() > 0
    except Exception:
        return False


def device_count() -> int:
    _ensure_runtime()
    status, count = hip.hipGetDeviceCount()
    if int(status) == _HIP_ERROR_NO_DEVICE:
        return 0
    check((status,))
    return int(count)


def _check_device_index(index, name: str = "index") -> int:
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"{name}: expected a device index (int), got {type(index).__name__}")
    count = device_count()
    if not 0 <= index < count:
        raise ValueError(f"{name}: expected a device index in [0, {count}), got {index}")
    return int(index)


def set_device(index: int) -> None:
    """Make device ``index`` current for this host thread."""
    index = _check_device_index(index)  # initialises the runtime: binds ``hip``
    check(hip.hipSetDevice(index))
    _thread.device = index


def use_device(index: int) -> None:
    """Make ``index`` current for this thread unless hipmla already did: one attribute
    read on the hot path instead of a HIP call."""
    if _thread.device != index:
        set_device(index)


def synchronize() -> None:
    """Wait for all work on the current device."""
    _ensure_runtime()
    check(hip.hipDeviceSynchronize())


# --- device properties -------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    arch: str  # "gfx950", "gfx942", "sm_90": what --offload-arch takes
    arch_full: str  # with target features, e.g. "gfx950:sramecc+:xnack-"
    platform: str  # "amd" | "nvidia"
    num_cus: int  # compute units (AMD) / streaming multiprocessors (NVIDIA)
    warp_size: int
    max_shared_per_block: int  # bytes a block gets without opting in
    shared_optin: int  # bytes a block can get at most
    total_mem: int
    l2_bytes: int
    mem_clock_khz: int
    mem_bus_bits: int
    pci_bus_id: int
    #: Theoretical DDR peak 2 * clock * bus / 8 from the reported attributes, in GB/s.
    #: Vendors report memory clocks differently (HBM3 often as half the data rate),
    #: so rooflines should prefer a measured or datasheet number.
    peak_bandwidth_gbs: float


def split_arch(arch_full: str) -> str:
    """Offload arch without target features: ``"gfx950:sramecc+:xnack-"`` -> ``"gfx950"``."""
    return arch_full.split(":", 1)[0].strip()


def peak_bandwidth_gbs(mem_clock_khz: int, mem_bus_bits: int) -> float:
    return 2.0 * mem_clock_khz * 1e3 * mem_bus_bits / 8 / 1e9


def device_info(index: int = 0) -> DeviceInfo:
    """Properties of device ``index`` (cached); also makes it the current device."""
    set_device(index)
    index = int(index)
    info = _device_infos.get(index)
    if info is not None:
        return info
    props = check(hip.hipGetDeviceProperties(index))
    names = hip.hipDeviceAttribute_t

    def attr(attribute) -> int:
        return int(check(hip.hipDeviceGetAttribute(attribute, index)))

    selected = platform()
    arch_full = str(props.gcnArchName).strip()
    if not arch_full and selected == "nvidia":
        major = attr(names.hipDeviceAttributeComputeCapabilityMajor)
        minor = attr(names.hipDeviceAttributeComputeCapabilityMinor)
        arch_full = f"sm_{major}{minor}"
    if not arch_full:
        raise RuntimeUnavailable(f"device {index} reports no architecture name (gcnArchName)")
    max_shared = attr(names.hipDeviceAttributeMaxSharedMemoryPerBlock)
    clock_khz = attr(names.hipDeviceAttributeMemoryClockRate)
    bus_bits = attr(names.hipDeviceAttributeMemoryBusWidth)
    info = DeviceInfo(
        index=index,
        name=str(props.name).strip(),
        arch=split_arch(arch_full),
        arch_full=arch_full,
        platform=selected,
        num_cus=attr(names.hipDeviceAttributeMultiprocessorCount),
        warp_size=attr(names.hipDeviceAttributeWarpSize),
        max_shared_per_block=max_shared,
        # Some runtimes report 0 when there is nothing to opt into.
        shared_optin=max(attr(names.hipDeviceAttributeSharedMemPerBlockOptin), max_shared),
        total_mem=int(props.totalGlobalMem),
        l2_bytes=attr(names.hipDeviceAttributeL2CacheSize),
        mem_clock_khz=clock_khz,
        mem_bus_bits=bus_bits,
        pci_bus_id=int(props.pciBusID),
        peak_bandwidth_gbs=peak_bandwidth_gbs(clock_khz, bus_bits),
    )
    _device_infos[index] = info
    return info


def memory_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    _ensure_runtime()
    free, total = check(hip.hipMemGetInfo())
    return int(free), int(total)


def versions() -> dict[str, int]:
    """HIP driver and runtime version numbers, for reports."""
    _ensure_runtime()
    return {
        "driver": int(check(hip.hipDriverGetVersion())),
        "runtime": int(check(hip.hipRuntimeGetVersion())),
    }


# --- memory ------------------------------------------------------------------------


class _Owned:
    """Releases its handle on ``close()``, on leaving a ``with`` block, or when collected
    — only in the process that created it (a forked child must not free its parent's)."""

    _owner_pid = -1

    def _live(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter exit the module globals may already be gone.
        if hip is not None and self._owner_pid == os.getpid() and self._live():
            try:
                self.close()
            except Exception:
                pass


class DeviceBuffer(_Owned):
    """Device memory owned by this object; ``ptr`` is its address (0 once freed)."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes
        self._owner_pid = os.getpid()

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            check(hip.hipFree(ptr))

    close = free

    def _live(self) -> bool:
        return bool(self.ptr)

    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


def alloc(nbytes: int) -> DeviceBuffer:
    """Allocate ``nbytes`` of device memory on the current device.

    ``alloc(0)`` is allowed: it returns a buffer with ``nbytes == 0`` backed by a
    1-byte allocation, so an empty tensor (a plan without split slots) still has a
    valid, unique address and callers need no special case.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes: expected an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    _ensure_runtime()
    ptr = check(hip.hipMalloc(max(int(nbytes), 1)))
    return DeviceBuffer(int(ptr), int(nbytes))


def _check_ptr(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a device address (int), got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: expected a non-null device address, got {value}")
    return int(value)


def _stream_handle(stream):
    """None, a :class:`Stream` or a raw handle (int or hip-python object) -> raw."""
    return stream.handle if isinstance(stream, Stream) else stream


def _memcpy(dst: int, src: int, nbytes: int, kind: str, stream) -> None:
    """hipMemcpy (synchronous) without a stream, hipMemcpyAsync on one."""
    _ensure_runtime()
    kind = getattr(hip.hipMemcpyKind, kind)
    if stream is None:
        check(hip.hipMemcpy(dst, src, nbytes, kind))
    else:
        check(hip.hipMemcpyAsync(dst, src, nbytes, kind, _stream_handle(stream)))


def copy_htod(dst_ptr: int, src: np.ndarray, stream=None) -> None:
    """Copy ``src`` to device address ``dst_ptr``.

    Without a stream the copy has finished when this returns. On a stream it is
    asynchronous: keep ``src`` alive and unchanged until the stream is synchronised.
    """
    check_array(src, "src")
    dst = _check_ptr(dst_ptr, "dst_ptr")
    if src.nbytes == 0:
        return
    _memcpy(dst, src.ctypes.data, src.nbytes, "hipMemcpyHostToDevice", stream)


def copy_dtoh(dst: np.ndarray, src_ptr: int, stream=None) -> None:
    """Copy ``dst.nbytes`` bytes from device address ``src_ptr`` into ``dst``.

    On a stream the copy is asynchronous: read ``dst`` only after synchronising.
    """
    check_array(dst, "dst")
    if not dst.flags.writeable:
        raise ValueError("dst: expected a writeable array, got a read-only one")
    src = _check_ptr(src_ptr, "src_ptr")
    if dst.nbytes == 0:
        return
    _memcpy(dst.ctypes.data, src, dst.nbytes, "hipMemcpyDeviceToHost", stream)


def copy_dtod(dst_ptr: int, src_ptr: int, nbytes: int, stream=None) -> None:
    """Device-to-device copy, ordered on ``stream`` (default: the null stream); does not wait."""
    dst = _check_ptr(dst_ptr, "dst_ptr")
    src = _check_ptr(src_ptr, "src_ptr")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"nbytes: expected an int >= 0, got {nbytes!r}")
    if nbytes == 0:
        return
    _memcpy(dst, src, int(nbytes), "hipMemcpyDeviceToDevice", 0 if stream is None else stream)


def memset(dst_ptr: int, value: int, nbytes: int, stream=None) -> None:
    """Set ``nbytes`` bytes at ``dst_ptr`` to ``value``, ordered on ``stream`` (default:
    the null stream). Like hipMemset it does not wait for completion."""
    dst = _check_ptr(dst_ptr, "dst_ptr")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= 255:
        raise ValueError(f"value: expected a byte value in [0, 255], got {value!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"nbytes: expected an int >= 0, got {nbytes!r}")
    if nbytes == 0:
        return
    _ensure_runtime()
    check(hip.hipMemsetAsync(dst, int(value), int(nbytes), _stream_handle(stream)))


# --- streams and events ------------------------------------------------------------


class Stream(_Owned):
    """A HIP stream. ``Stream()`` creates one; ``Stream.null()`` is the null stream.

    ``handle`` is what hip-python takes: a hip-python stream object, or 0 for the null
    stream. Functions that take a stream also accept such a raw handle directly, so an
    embedding runtime can pass its own stream without wrapping it.
    """

    def __init__(self):
        _ensure_runtime()
        self.handle = check(hip.hipStreamCreate())
        self._owned = True
        self._owner_pid = os.getpid()

    @classmethod
    def null(cls) -> Stream:
        stream = cls.__new__(cls)
        stream.handle = 0
        stream._owned = False
        stream._owner_pid = os.getpid()
        return stream

    def synchronize(self) -> None:
        _ensure_runtime()
        check(hip.hipStreamSynchronize(self.handle))

    def close(self) -> None:
        if self._owned:
            self._owned = False
            check(hip.hipStreamDestroy(self.handle))

    def _live(self) -> bool:
        return getattr(self, "_owned", False)


class Event(_Owned):
    """A HIP event for timing work on a stream."""

    def __init__(self):
        _ensure_runtime()
        self.handle = check(hip.hipEventCreate())
        self._owner_pid = os.getpid()

    def record(self, stream=None) -> None:
        check(hip.hipEventRecord(self.handle, _stream_handle(stream)))

    def synchronize(self) -> None:
        check(hip.hipEventSynchronize(self.handle))

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; both must have completed."""
        if not isinstance(end, Event):
            raise TypeError(f"end: expected an Event, got {type(end).__name__}")
        return float(check(hip.hipEventElapsedTime(self.handle, end.handle)))

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            check(hip.hipEventDestroy(handle))

    def _live(self) -> bool:
        return getattr(self, "handle", None) is not None


# --- compilation -------------------------------------------------------------------


def compiler_version() -> str:
    """hiprtc and HIP runtime versions: part of the compile cache key, since a new
    compiler may emit different code for the same source."""
    global _compiler_version
    if _compiler_version is None:
        _ensure_runtime()
        major, minor = check(hiprtc.hiprtcVersion())
        runtime = check(hip.hipRuntimeGetVersion())
        _compiler_version = f"hiprtc {major}.{minor}, HIP runtime {runtime}"
        if platform() == "nvidia":
            # Our HIP-on-CUDA library translates hiprtc options: a change there can
            # change the code for the same source and options.
            from hipmla import nvidia

            _compiler_version += f", hip-on-cuda {nvidia.source_hash()}"
    return _compiler_version


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
    prog = check(hiprtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        (status,) = hiprtc.hiprtcCompileProgram(prog, len(flags), [f.encode() for f in flags])
        if status:
            raise CompileError(
                f"hiprtc could not compile {name!r} for {arch} "
                f"({getattr(status, 'name', status)}; flags {' '.join(flags)})",
                _program_log(prog),
            )
        size = check(hiprtc.hiprtcGetCodeSize(prog))
        code = bytearray(size)
        check(hiprtc.hiprtcGetCode(prog, code))
    finally:
        check(hiprtc.hiprtcDestroyProgram(prog.createRef()))
    return bytes(code)


def _program_log(prog) -> str:
    size = check(hiprtc.hiprtcGetProgramLogSize(prog))
    if size <= 1:
        return ""
    log = bytearray(size)
    check(hiprtc.hiprtcGetProgramLog(prog, log))
    return log.split(b"\0", 1)[0].decode(errors="replace")


# --- modules and launches ----------------------------------------------------------


class Module(_Owned):
    """A loaded code object. Its functions stay valid until ``close()``."""

    def __init__(self, code: bytes):
        if not isinstance(code, (bytes, bytearray)) or not code:
            raise TypeError(f"code: expected non-empty bytes (a code object), got {type(code).__name__}")
        _ensure_runtime()
        self.handle = check(hip.hipModuleLoadData(bytes(code)))
        self._functions: dict[str, Function] = {}
        self._owner_pid = os.getpid()

    def function(self, symbol: str) -> Function:
        fn = self._functions.get(symbol)
        if fn is None:
            if self.handle is None:
                raise RuntimeError("Module.function: the module is closed")
            fn = Function(check(hip.hipModuleGetFunction(self.handle, symbol.encode())), self, symbol)
            self._functions[symbol] = fn
        return fn

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._functions.clear()
            check(hip.hipModuleUnload(handle))

    def _live(self) -> bool:
        return getattr(self, "handle", None) is not None


def _hip_library_path() -> str | None:
    """The HIP runtime library exactly as hip-python resolves it (its own lookup)."""
    try:  # hip-python < 10: the name it dlopens (point_hip_python_at_rocm_path)
        import hip.chip

        name = getattr(hip.chip, "DLL", None)
        return name.decode() if isinstance(name, bytes) else name
    except ImportError:
        pass
    try:
        from rocm.bindings.util.paths import get_library_path
    except ImportError:
        return None
    path = get_library_path("amdhip64")
    return path.decode() if isinstance(path, bytes) else path


def _c_launcher():
    """``hipModuleLaunchKernel`` of the library hip-python loaded, called through ctypes.

    The decode hot path makes one HIP call per kernel; through ctypes with prebuilt
    arguments it costs about half of hip-python's call (DESIGN.md measured 4.8 vs
    9 us). hip-python has loaded the library by the time a Function exists, so this
    binds the very same code; where it cannot be found, launches go through hip-python.
    """
    global _c_launch
    if _c_launch is None:
        path = _hip_library_path()
        try:
            lib = ctypes.CDLL(path) if path else None
        except OSError:
            lib = None
        if lib is None or not hasattr(lib, "hipModuleLaunchKernel"):
            _c_launch = False
        else:
            fn = lib.hipModuleLaunchKernel  # no argtypes: see BoundLaunch.prepare
            fn.restype = ctypes.c_int
            _c_launch = fn
    return _c_launch or None


def _stream_address(stream) -> int:
    handle = _stream_handle(stream)
    return 0 if handle is None or handle == 0 else int(handle)


class BoundLaunch:
    """One kernel with one argument struct: the ``extra`` array is built once here, so a
    launch is a single HIP call. Each caller owns its bindings, so two threads launching
    the same kernel with different arguments never share an ``extra`` array."""

    def __init__(self, function: "Function", args: ctypes.Structure):
        if not isinstance(args, ctypes.Structure):
            raise TypeError(f"args: expected a ctypes.Structure, got {type(args).__name__}")
        self.function = function
        self.args = args  # kept alive: the extra array points into it
        self._size = ctypes.c_size_t(ctypes.sizeof(args))
        self._extra = (ctypes.c_void_p * 5)(
            _LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(args),
            _LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self._size), _LAUNCH_PARAM_END)
        self.extra_address = ctypes.addressof(self._extra)

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                 shared_bytes: int = 0, stream=None) -> None:
        """Launch. The runtime copies the argument bytes when the launch is enqueued, so
        the struct's fields may change as soon as this returns."""
        self.prepare(grid, block, shared_bytes, stream)()

    def prepare(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                shared_bytes: int = 0, stream=None) -> Callable[[], None]:
        """This launch with its shape and stream resolved now: calling the result is one
        C call (the decode hot path builds it once per argument set)."""
        gx, gy, gz = grid
        bx, by, bz = block
        if gx < 1 or gy < 1 or gz < 1:
            raise ValueError(f"grid: expected every dimension >= 1, got {tuple(grid)}")
        if bx < 1 or by < 1 or bz < 1 or bx * by * bz > MAX_BLOCK_THREADS:
            raise ValueError(
                f"block: expected dimensions >= 1 and at most {MAX_BLOCK_THREADS} threads, "
                f"got {tuple(block)}"
            )
        if shared_bytes < 0:
            raise ValueError(f"shared_bytes: expected >= 0, got {shared_bytes}")
        fn = self.function
        launch = _c_launcher()
        if launch is None:
            handle, extra = fn.handle, self.extra_address

            def run_hip_python() -> None:
                check(hip.hipModuleLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared_bytes,
                                                _stream_handle(stream), None, extra))

            run_hip_python.binding = self
            return run_hip_python
        # Arguments as ready-made ctypes values: no per-call conversion (about 0.7 us of
        # the call's 1.4 us, measured with a no-op C function on the 2-core CI machine).
        # The function has no argtypes, so ctypes passes these as they are (c_void_p,
        # c_uint; None is NULL) instead of calling a from_param for each (about 0.1 us).
        u = ctypes.c_uint
        call = functools.partial(launch, ctypes.c_void_p(fn.address), u(gx), u(gy), u(gz), u(bx), u(by),
                                 u(bz), u(shared_bytes), ctypes.c_void_p(_stream_address(stream)), None,
                                 ctypes.c_void_p(self.extra_address))

        def run() -> None:
            status = call()
            if status:
                raise _error_for(hip.hipError_t(status))

        run.binding = self  # the extra array and the argument struct live as long as the launch
        return run


class Function:
    """A kernel symbol of a :class:`Module` (which it keeps alive)."""

    def __init__(self, handle, module: Module, symbol: str):
        self.handle = handle
        self.module = module
        self.symbol = symbol
        self._address: int | None = None
        self._last: BoundLaunch | None = None

    @property
    def address(self) -> int:
        """The handle as an integer, for the ctypes launch."""
        if self._address is None:
            self._address = int(self.handle)
        return self._address

    def bind(self, args: ctypes.Structure) -> BoundLaunch:
        """A reusable launch of this kernel with ``args`` as its one by-value parameter."""
        return BoundLaunch(self, args)

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: ctypes.Structure,
        shared_bytes: int = 0,
        stream=None,
    ) -> None:
        """Launch with ``args`` as the kernel's one by-value parameter (a convenience
        over :meth:`bind` that rebinds when ``args`` is another struct; not for
        concurrent use from several threads — bind per thread instead)."""
        bound = self._last
        if bound is None or bound.args is not args:
            bound = self._last = BoundLaunch(self, args)
        bound(grid, block, shared_bytes, stream)


def _find_prebuilt(spec, arch: str, source: str, options: list[str]) -> bytes | None:
    try:
        aot = importlib.import_module("hipmla.aot")
    except ModuleNotFoundError as e:
        if e.name != "hipmla.aot":
            raise
        return None
    return aot.find_prebuilt(spec, arch, source, options)


def load_kernel(spec, arch: str) -> Function:
    """The loaded kernel for a :class:`hipmla.kernels.KernelSpec` on ``arch``.

    Takes an ahead-of-time code object when :mod:`hipmla.aot` has one, else compiles
    with :func:`compile_source`. Loaded once per (spec, arch, current device) per
    process; modules are per device, so each device gets its own.
    """
    _ensure_runtime()
    device = int(check(hip.hipGetDevice()))
    key = (spec, arch, device)
    fn = _kernels.get(key)
    if fn is None:
        from hipmla.kernels import translation_unit

        source = translation_unit(spec.source)
        options = list(spec.options(arch))
        code = _find_prebuilt(spec, arch, source, options)
        if code is None:
            code = compile_source(source, spec.symbol, arch, options)
        fn = Module(code).function(spec.symbol)
        _kernels[key] = fn
    return fn


# --- typed device arrays -------------------------------------------------------------


class DeviceArray:
    """A typed view of device memory that speaks ``__cuda_array_interface__`` (v3).

    What embedding runtimes hand hipmla is usually such an object or a raw address;
    this class is hipmla's own, for tests, the CLI and users without one. It owns its
    :class:`DeviceBuffer` unless built over someone else's address with ``owner=None``.
    """

    def __init__(self, shape, dtype, buffer: DeviceBuffer | None = None, ptr: int | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if buffer is None and ptr is None:
            buffer = alloc(nbytes)
        self.buffer = buffer
        self.ptr = buffer.ptr if buffer is not None else _check_ptr(ptr, "ptr")
        self.nbytes = nbytes

    @classmethod
    def from_host(cls, arr: np.ndarray, stream=None) -> "DeviceArray":
        arr = np.ascontiguousarray(arr)
        out = cls(arr.shape, arr.dtype)
        copy_htod(out.ptr, arr, stream)
        return out

    def to_host(self, stream=None) -> np.ndarray:
        host = np.empty(self.shape, dtype=self.dtype)
        copy_dtoh(host, self.ptr, stream)
        if stream is not None:
            _ensure_runtime()
            check(hip.hipStreamSynchronize(_stream_handle(stream)))
        return host

    @property
    def __cuda_array_interface__(self) -> dict:
        if not self.ptr:
            raise ValueError("DeviceArray: the memory was freed")
        # ml_dtypes types report a void typestr ("|V2"); name bf16 as the 2-byte
        # unsigned pattern it is stored as, which is what other libraries exchange.
        typestr = self.dtype.str if self.dtype.kind != "V" else f"<u{self.dtype.itemsize}"
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False),
                "strides": None, "version": 3}

    def free(self) -> None:
        if self.buffer is not None:
            self.buffer.free()
        self.ptr = 0

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"
