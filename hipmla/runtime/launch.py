"""Code objects on the device and kernel launches.

A :class:`Module` is a loaded code object, a :class:`Function` one kernel of it, and a
:class:`BoundLaunch` that kernel with one argument struct, launched with one C call
(:func:`_c_launcher`). :func:`load_kernel` is what the decoder calls: the kernel of a
:class:`hipmla.kernels.KernelSpec`, prebuilt (:mod:`hipmla.aot`) or compiled
(:mod:`hipmla.runtime.compiler`), loaded once per device.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
from typing import Callable

from hipmla import runtime  # the process's runtime state: runtime.hip, the loaded kernels
from hipmla.runtime.compiler import compile_source
from hipmla.runtime.library import _Owned, _ensure_runtime, _error_for, check
from hipmla.runtime.streams import _stream_handle

MAX_BLOCK_THREADS = 1024

# ``extra`` tags of hipModuleLaunchKernel (hip_runtime_api.h: HIP_LAUNCH_PARAM_*);
# hip-python builds the same five-entry array from a tuple.
_LAUNCH_PARAM_BUFFER_POINTER = 0x01
_LAUNCH_PARAM_BUFFER_SIZE = 0x02
_LAUNCH_PARAM_END = 0x03


class Module(_Owned):
    """A loaded code object. Its functions stay valid until ``close()``."""

    def __init__(self, code: bytes):
        if not isinstance(code, (bytes, bytearray)) or not code:
            raise TypeError(f"code: expected non-empty bytes (a code object), got {type(code).__name__}")
        _ensure_runtime()
        self.handle = check(runtime.hip.hipModuleLoadData(bytes(code)))
        self._functions: dict[str, Function] = {}
        self._owner_pid = os.getpid()

    def function(self, symbol: str) -> Function:
        fn = self._functions.get(symbol)
        if fn is None:
            if self.handle is None:
                raise RuntimeError("Module.function: the module is closed")
            fn = Function(check(runtime.hip.hipModuleGetFunction(self.handle, symbol.encode())), self, symbol)
            self._functions[symbol] = fn
        return fn

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._functions.clear()
            check(runtime.hip.hipModuleUnload(handle))

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
    if runtime._c_launch is None:
        path = _hip_library_path()
        try:
            lib = ctypes.CDLL(path) if path else None
        except OSError:
            lib = None
        if lib is None or not hasattr(lib, "hipModuleLaunchKernel"):
            runtime._c_launch = False
        else:
            fn = lib.hipModuleLaunchKernel  # no argtypes: see BoundLaunch.prepare
            fn.restype = ctypes.c_int
            runtime._c_launch = fn
    return runtime._c_launch or None


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
                check(runtime.hip.hipModuleLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared_bytes,
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
                raise _error_for(runtime.hip.hipError_t(status))

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
    device = int(check(runtime.hip.hipGetDevice()))
    key = (spec, arch, device)
    fn = runtime._kernels.get(key)
    if fn is None:
        from hipmla.kernels import translation_unit

        source = translation_unit(spec.source)
        options = list(spec.options(arch))
        code = _find_prebuilt(spec, arch, source, options)
        if code is None:
            code = compile_source(source, spec.symbol, spec.compile_arch(arch), options)
        fn = Module(code).function(spec.symbol)
        runtime._kernels[key] = fn
    return fn
