"""The HIP library this process uses: which one, loaded once through hip-python, its
calls checked.

hip-python is imported lazily and resolves ``libamdhip64.so`` / ``libhiprtc.so`` once
per process, at the first call. Before that call this module picks the platform
(``HIPMLA_PLATFORM`` = ``auto`` | ``amd`` | ``nvidia``): ROCm on AMD, or on an NVIDIA
GPU hipmla's HIP-on-CUDA library (:mod:`hipmla.nvidia`), which it exposes to
hip-python by pointing ``ROCM_PATH`` at it. Nothing touches a GPU at import time.

What it binds (``runtime.hip``, ``runtime.hiprtc``, the selected platform) is the
package's state (:mod:`hipmla.runtime`). Every HIP call of the runtime goes through
:func:`check`, which turns a failed status into :class:`HipError` with the error's name
and description; :class:`_Owned` is the base of the objects that own HIP handles.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

from hipmla import runtime  # the process's runtime state, which this module binds

PLATFORMS = ("amd", "nvidia")

_HOW_TO_GET_ONE = (
    "Install ROCm (https://rocm.docs.amd.com) and make libamdhip64.so findable "
    "(ROCM_PATH, /opt/rocm or LD_LIBRARY_PATH); on an NVIDIA GPU hipmla uses its own "
    "HIP-on-CUDA library: set HIPMLA_PLATFORM=nvidia (HIPMLA_PLATFORM=auto, the "
    "default, picks it when an NVIDIA GPU is present)."
)


class HipError(RuntimeError):
    """A HIP or hiprtc call returned an error status."""

    def __init__(self, code: int, name: str, description: str):
        super().__init__(f"{name} ({code}): {description}")
        self.code = code
        self.name = name


class RuntimeUnavailable(RuntimeError):
    """No usable HIP runtime in this process."""


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
        description = runtime.hiprtc.hiprtcGetErrorString(status)[1]
        name = status.name
    else:
        name = runtime.hip.hipGetErrorName(status)[1]
        description = runtime.hip.hipGetErrorString(status)[1]
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
    if runtime._platform is None:
        with runtime._lock:
            if runtime._platform is None:
                runtime._platform = _select_platform()
    return runtime._platform


def _ensure_runtime() -> None:
    """Bind hip-python and call hipInit once; a failure is remembered and re-raised."""
    if runtime.hip is not None:
        return
    if runtime._init_error is not None:
        raise runtime._init_error
    selected = platform()
    with runtime._lock:
        if runtime.hip is not None:
            return
        try:
            hip_module, hiprtc_module = _load_hip_python(selected)
        except RuntimeUnavailable as e:
            runtime._init_error = e
            raise
        runtime.hip, runtime.hiprtc = hip_module, hiprtc_module


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


# --- owned handles -----------------------------------------------------------------


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
        # At interpreter exit the module globals may already be gone (``runtime`` None).
        if getattr(runtime, "hip", None) is not None and self._owner_pid == os.getpid() and self._live():
            try:
                self.close()
            except Exception:
                pass
