"""Device buffers as a decode step takes them: raw addresses, ``__cuda_array_interface__``
objects and DLPack producers (kDLCUDA / kDLROCM), checked once (shape, element size,
C-contiguity, alignment, writability) and then recognised step after step by a cheap key
of what they are (address, shape, dtype, strides), whatever the Python objects.

``device_ptr`` is the check; ``dlpack_interface`` reads a producer's capsule without
consuming it; ``buffer_key`` / ``KEYERS`` are the keys ``Decoder.run`` compares to skip the
check on a step whose arguments are the same buffers as the last one's.
"""

from __future__ import annotations

import ctypes
import operator
from typing import Callable

import numpy as np

from hipmla import runtime
from hipmla.validate import format_shape

# ----------------------------------------------------------------------------- pointers


def device_ptr(obj, name: str, *, itemsize: int, shape: tuple | None = None,
               kinds: str = "uiV", align: int = 4, writable: bool = False, float8: tuple[str, ...] = (),
               device: int | None = None) -> tuple[int, tuple | None]:
    """``(address, shape)`` of a device buffer given as an int, a
    ``__cuda_array_interface__`` object or a DLPack producer (shape None for a raw address).

    The address must be ``align``-byte aligned (the kernels load Q and KV rows 16 bytes
    at a time). For an interface object, ``shape`` (``None`` entries match anything),
    the element size and C-contiguity are checked too, and ``writable`` buffers must not
    be read-only. A DLPack buffer that names a float8 encoding must name one of
    ``float8`` (e.g. ``"float8_e4m3fn"``: an e5m2 cache read as e4m3 would decode to other
    values); one that says which device it is on (``__dlpack_device__``) must be on
    ``device`` when that is given. The extent behind a raw address cannot be checked: it
    is the caller's promise.
    """
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        if obj <= 0:
            raise ValueError(f"{name}: expected a non-null device address, got {obj}")
        if obj >= 1 << 64:
            raise ValueError(f"{name}: {obj:#x} is not a 64-bit device address")
        return _aligned(int(obj), name, align), None
    cai = interface_of(obj, name)
    if cai is None:
        if isinstance(obj, np.ndarray):
            raise TypeError(f"{name}: got a host numpy array; run() takes device buffers "
                            f"(use Decoder.decode for numpy inputs)")
        raise TypeError(f"{name}: expected a device address (int), an object with "
                        f"__cuda_array_interface__ or a DLPack producer, got {type(obj).__name__}")
    got_shape = interface_shape(cai, name)
    typestr = cai.get("typestr")
    if not isinstance(typestr, str) or len(typestr) < 3 or not typestr[2:].isdigit():
        raise TypeError(f"{name}: the interface's typestr {typestr!r} is not a numpy type string")
    if typestr[0] == ">" and int(typestr[2:]) > 1:  # the GPUs are little-endian
        raise TypeError(f"{name}: big-endian elements (typestr {typestr!r}); expected little-endian ('<' or '|')")
    if int(typestr[2:]) != itemsize or typestr[1] not in kinds:
        want = {"f": "float32" if itemsize == 4 else "float", "i": "int32" if itemsize == 4 else "integer"} \
            .get(kinds, "raw (bf16/fp8/byte) or integer")
        raise TypeError(f"{name}: expected {itemsize}-byte {want} elements, got typestr {typestr!r}")
    encoding = DLPACK_FLOAT8.get(cai.get("dlpack_dtype"))
    if encoding is not None and encoding not in float8:
        want = " or ".join(float8) if float8 else "no float8 encoding (raw bytes as uint8 are taken as they are)"
        raise TypeError(f"{name}: a DLPack {encoding} buffer; expected {want}")
    if device is not None:
        on = cai.get("dlpack_device") or _dlpack_device(obj)
        if on is not None and int(on[1]) != device:
            raise ValueError(f"{name}: the buffer is on device {int(on[1])}, this decoder runs on device {device}")
    if shape is not None:
        if len(got_shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got_shape)):
            raise ValueError(f"{name}: expected shape {format_shape(shape)}, got {got_shape}")
    strides = cai.get("strides")
    if strides is not None:
        contiguous = tuple(int(np.prod(got_shape[i + 1:], dtype=np.int64)) * itemsize
                           for i in range(len(got_shape)))
        # Only used strides count, as in torch's and numpy's contiguity: extents of 1 may
        # carry any stride (torch gives them one), an empty buffer any strides at all.
        if len(tuple(strides)) != len(got_shape) or 0 not in got_shape and any(
                int(s) != c for s, c, n in zip(strides, contiguous, got_shape) if n != 1):
            raise ValueError(f"{name}: expected a C-contiguous buffer, got strides {tuple(strides)}")
    if cai.get("mask") is not None:
        raise TypeError(f"{name}: masked arrays are not supported (the interface has a mask)")
    stream = cai.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, (int, np.integer))):
        raise TypeError(f"{name}: the interface's stream must be None or an int, got {stream!r}")
    if stream is not None and stream == 0:
        raise ValueError(f"{name}: the interface's stream is 0, which version 3 of the CUDA Array "
                         f"Interface disallows (1: legacy default stream, 2: per-thread default)")
    data = cai.get("data")
    if not isinstance(data, (tuple, list)) or len(data) != 2 or isinstance(data[0], bool) \
            or not isinstance(data[0], (int, np.integer)):
        raise TypeError(f"{name}: the interface's data must be (pointer, read_only), got {data!r}")
    ptr = int(data[0])
    if ptr == 0 and int(np.prod(got_shape, dtype=np.int64)) > 0:
        raise ValueError(f"{name}: null data pointer")
    if not 0 <= ptr < 1 << 64:  # the kernel's pointer field would wrap it to another address
        raise ValueError(f"{name}: the interface's data pointer {ptr:#x} is not a 64-bit device address")
    if writable and data[1]:
        raise ValueError(f"{name}: the buffer is read-only, and the kernels write it")
    return _aligned(ptr, name, align), got_shape


def _dlpack_device(obj) -> tuple | None:
    """``(device type, device id)`` of an interface object that also speaks DLPack (torch,
    CuPy), or None: the CUDA Array Interface itself does not say which device."""
    try:
        dev = obj.__dlpack_device__()
        return (int(dev[0]), int(dev[1]))
    except Exception:  # noqa: BLE001 - no such method, or not one that answers: nothing to compare
        return None


def _aligned(ptr: int, name: str, align: int) -> int:
    if ptr % align:
        raise ValueError(f"{name}: device address {ptr:#x} is not {align}-byte aligned")
    return ptr


def interface_shape(cai: dict, name: str) -> tuple:
    shape = cai.get("shape")
    if not isinstance(shape, (tuple, list)) or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise TypeError(f"{name}: the interface's shape must be a tuple of extents >= 0, got {shape!r}")
    return tuple(int(s) for s in shape)


def interface_of(obj, name: str) -> dict | None:
    """``__cuda_array_interface__`` of ``obj``, or the same fields read from its DLPack
    capsule, or None when it speaks neither."""
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    except ValueError as e:  # a buffer that cannot describe itself (a freed DeviceArray): say which argument
        raise ValueError(f"{name}: {e}") from None
    except TypeError:  # torch: bf16 and fp8 tensors have no typestr; their DLPack names them
        if not callable(getattr(obj, "__dlpack__", None)):
            raise
        cai = None
    if cai is None and isinstance(obj, np.ndarray):
        return None  # host memory (numpy speaks DLPack too): device_ptr says what to do instead
    if cai is not None:
        if not isinstance(cai, dict):
            raise TypeError(f"{name}: __cuda_array_interface__ must be a dict, got {type(cai).__name__}")
        return cai
    if callable(getattr(obj, "__dlpack__", None)):
        return dlpack_interface(obj, name)
    return None


# ----------------------------------------------------------------------------- DLPack
# The C structs of dlpack.h (v0.8 legacy capsule "dltensor" and v1.x "dltensor_versioned").


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


#: DLPack device types of memory the kernels can read.
DLPACK_DEVICES = {2: "kDLCUDA", 10: "kDLROCM"}
_DLPACK_HOST = {1: "kDLCPU", 3: "kDLCUDAHost", 11: "kDLROCMHost"}
#: DLPack dtype codes as numpy kinds: int, uint, float, bfloat and the float8 codes
#: (bit patterns, like a uint8 or uint16 view).
_DLPACK_KINDS = {0: "i", 1: "u", 2: "f", 4: "V", 6: "b", 5: "c"}
#: DLPack's float8 dtype codes (dlpack.h, DLDataTypeCode) by the encoding's name.
DLPACK_FLOAT8 = {7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
                 11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu"}
_DLPACK_READ_ONLY = 1
# private function objects (indexing makes new ones): argtypes set on the shared
# ctypes.pythonapi attributes would change them for every other user in the process
_capsule_name = ctypes.pythonapi["PyCapsule_GetName"]
_capsule_name.argtypes, _capsule_name.restype = [ctypes.py_object], ctypes.c_char_p
_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_pointer.argtypes, _capsule_pointer.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p


def dlpack_interface(obj, name: str) -> dict:
    """The ``__cuda_array_interface__`` fields of a DLPack producer, read from its capsule.

    The capsule is only looked at, never consumed: its name stays ``"dltensor"``, so the
    producer's own capsule destructor releases it (the deleter runs once, not here). The
    memory stays the producer's, alive as long as ``obj`` is."""
    device = getattr(obj, "__dlpack_device__", None)
    if callable(device):
        dev_type = int(device()[0])
        _check_dlpack_device(dev_type, name)
    try:
        capsule = obj.__dlpack__(stream=-1)  # -1: the producer must not synchronize
    except TypeError:
        capsule = obj.__dlpack__()  # producers older than the stream keyword
    cname = _capsule_name(capsule)
    if cname == b"dltensor":
        managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, cname))
        t, read_only = managed.dl_tensor, False
    elif cname == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, cname))
        t, read_only = managed.dl_tensor, bool(managed.flags & _DLPACK_READ_ONLY)
    else:
        raise TypeError(f"{name}: __dlpack__ returned a capsule named {cname!r}, not an unused DLPack tensor")
    _check_dlpack_device(int(t.device.device_type), name)
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    code, bits, lanes = int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes)
    if lanes != 1 or bits % 8 or bits == 0:
        raise TypeError(f"{name}: DLPack dtype code {code}, {bits} bits x {lanes} lanes is not a "
                        f"whole-byte scalar type")
    kind = _DLPACK_KINDS.get(code, "V" if code >= 7 else "?")  # 7+: float8/float4/... bit patterns
    item = bits // 8
    strides = None if not t.strides else tuple(int(t.strides[i]) * item for i in range(ndim))
    data = (t.data or 0) + int(t.byte_offset)
    del capsule  # the producer's destructor runs the deleter, once
    return {"shape": shape, "typestr": f"<{kind}{item}", "data": (data, read_only), "strides": strides,
            "version": 3, "dlpack_device": (int(t.device.device_type), int(t.device.device_id)),
            "dlpack_dtype": code}


def _check_dlpack_device(dev_type: int, name: str) -> None:
    if dev_type in DLPACK_DEVICES:
        return
    if dev_type in _DLPACK_HOST:
        raise TypeError(f"{name}: a host ({_DLPACK_HOST[dev_type]}) DLPack tensor; run() takes GPU "
                        f"memory (kDLCUDA or kDLROCM); use Decoder.decode for host arrays")
    raise TypeError(f"{name}: DLPack device type {dev_type} is not GPU memory the kernels can read "
                    f"(kDLCUDA = 2, kDLROCM = 10)")


# ----------------------------------------------------------------------------- argument keys
# A key is what a buffer argument is (address, shape, dtype, strides), computed each step
# by a keyer chosen once per type. Keys of different keyers never compare equal: raw
# addresses (ints and numpy integers alike) are ints, None is None, the tuples differ in
# length or in what they start with (an int for tensors, a type otherwise).


def _tensor_key(obj) -> tuple:
    # torch-style tensors: four accessors instead of building the interface dict (which
    # costs several microseconds a tensor); the keyer is chosen per type, so the type
    # itself need not be in the key. Of the strides only contiguity counts: the check
    # refuses every other layout and the kernels get no strides. is_contiguous() is the
    # same test as device_ptr's (torch's interface omits its strides exactly then), and
    # cheaper than stride(): no tuple to build and compare (79 vs 137 ns on the H200).
    return (obj.data_ptr(), obj.shape, obj.dtype, obj.is_contiguous())


#: hipmla's own arrays: their fields, read in one C call (the class first: a subclass
#: may describe its memory otherwise).
_array_key = operator.attrgetter("__class__", "ptr", "shape", "dtype")


def _interface_key(obj) -> tuple:
    cai = obj.__cuda_array_interface__
    # data is (pointer, read-only); mask and stream are checked too, so they are part of it
    return (type(obj), cai["data"], tuple(cai["shape"]), cai["typestr"], cai.get("strides"),
            cai.get("mask") is None, cai.get("stream"))


def _dlpack_key(obj) -> tuple:
    # a pure DLPack producer: its capsule is the only place its fields are
    d = dlpack_interface(obj, "")
    return (type(obj), d["data"], d["shape"], d["typestr"], d["strides"], d["dlpack_device"], d["dlpack_dtype"])


def _has_interface(obj) -> bool:
    # hasattr evaluates the property: torch raises TypeError there for bf16 and fp8 tensors
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - it has one, it just cannot describe this dtype
        return True


def _choose_keyer(obj) -> Callable:
    if isinstance(obj, np.integer):
        return int  # a raw address as numpy hands it out
    if isinstance(obj, runtime.DeviceArray):
        return _array_key
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "is_contiguous", None)) \
            and (hasattr(obj, "__dlpack__") or _has_interface(obj)):
        return _tensor_key  # torch (CUDA or ROCm): never the capsule on the hot path
    if _has_interface(obj) or not hasattr(obj, "__dlpack__"):
        return _interface_key  # (raises for what is no buffer at all)
    return _dlpack_key


def _first_key(obj):
    """The key of the first object of its type, whose keyer is chosen from it and kept."""
    keyer = KEYERS[type(obj)] = _choose_keyer(obj)
    return keyer(obj)


class _Keyers(dict):
    """Keyer by type; a type not seen yet gets :func:`_first_key`."""

    def __missing__(self, cls: type) -> Callable:
        return _first_key


#: Keyer by argument type, chosen from the first object of the type (Decoder.run's hot path).
KEYERS: dict[type, Callable] = _Keyers()


def buffer_key(obj):
    """What a buffer argument is — address, shape, dtype, strides — as a value that
    compares equal for any two views of the same memory, whatever the objects. A raw
    address and None are their own key. ``Decoder.run`` computes the same keys inline."""
    if obj is None or type(obj) is int:
        return obj
    try:
        return KEYERS[type(obj)](obj)
    except Exception:  # noqa: BLE001 - not a buffer: the full check will say what it is
        return (object(),)


__all__ = ["DLPACK_DEVICES", "KEYERS", "buffer_key", "device_ptr", "dlpack_interface", "interface_of",
           "interface_shape"]
