"""Device memory: buffers hipmla owns, copies and memset, and typed device arrays.

:class:`DeviceBuffer` owns an allocation (freed on ``free()``, on leaving a ``with``
block, or when collected, only in the process that made it); :class:`DeviceArray` is a
typed view of device memory that speaks ``__cuda_array_interface__``. Copies and memset
take device addresses (ints) and an optional stream.
"""

from __future__ import annotations

import os

import numpy as np

from hipmla import runtime  # the process's runtime state: runtime.hip
from hipmla.runtime.library import _Owned, _ensure_runtime, check
from hipmla.runtime.streams import _stream_handle
from hipmla.validate import check_array


class DeviceBuffer(_Owned):
    """Device memory owned by this object; ``ptr`` is its address (0 once freed)."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes
        self._owner_pid = os.getpid()

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            check(runtime.hip.hipFree(ptr))

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
    ptr = check(runtime.hip.hipMalloc(max(int(nbytes), 1)))
    return DeviceBuffer(int(ptr), int(nbytes))


def _check_ptr(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a device address (int), got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: expected a non-null device address, got {value}")
    return int(value)


def _memcpy(dst: int, src: int, nbytes: int, kind: str, stream) -> None:
    """hipMemcpy (synchronous) without a stream, hipMemcpyAsync on one."""
    _ensure_runtime()
    kind = getattr(runtime.hip.hipMemcpyKind, kind)
    if stream is None:
        check(runtime.hip.hipMemcpy(dst, src, nbytes, kind))
    else:
        check(runtime.hip.hipMemcpyAsync(dst, src, nbytes, kind, _stream_handle(stream)))


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
    check(runtime.hip.hipMemsetAsync(dst, int(value), int(nbytes), _stream_handle(stream)))


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
            check(runtime.hip.hipStreamSynchronize(_stream_handle(stream)))
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
