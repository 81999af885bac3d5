"""The decoder: one decode step is one launch of device arrays, with no host work.

    dec = Decoder("mxfp4", sm_scale=1 / 24, max_batch=256)   # device 0, null stream
    dec.run(q, kv, kv_indptr, out, kv_scale=scales, lse=lse,             # contiguous rows
            kv_indices=pages, kv_last_page_len=last, page_size=16)       # or a page table

Buffers are device addresses (int), objects exposing ``__cuda_array_interface__`` or
DLPack producers (``__dlpack__``, kDLCUDA or kDLROCM memory); with the latter two every
shape, dtype and stride is checked before anything is launched. The kernels run on the
stream passed to ``run`` (or the decoder's): the caller orders the producers' work before
it (an interface's ``stream`` key is checked, not waited on; DLPack capsules are asked
for no synchronization, ``stream=-1``).
The split of the batch over the GPU is derived on the device from ``kv_indptr`` (and
``kv_last_page_len``) by every block of the decode grid (``hip_src/core/schedule.h``),
and the last block of a split sequence merges its partials, so a step never reads
device memory, never allocates, copies or synchronizes: capture one step into a graph
and replay it for every later step of the same batch size.

The decoder owns the split-partials scratch and the per-sequence counters, sized once
for ``max_batch`` sequences (``reserve`` grows them, outside a step). One decoder serves
one stream at a time: two steps in flight at once on two streams would share them.
:meth:`Decoder.decode` is the convenience path for numpy arrays (copy in, run, copy out).
"""

from __future__ import annotations

import ctypes
import operator
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hipmla import kernels, runtime
from hipmla import selftest as _selftest  # Decoder(selftest=...) is a keyword
from hipmla.emulate import FAST_SCHEDULES, LOG2E, emulate_decode
from hipmla.formats import KV_FORMATS, KVCache
from hipmla.paging import PAGE_SIZES, KvLayout, as_layout, check_page_size
from hipmla.queries import check_causal, check_heads, check_qo_indptr, q_lens
from hipmla.reference import check_q
from hipmla.schedule import INT32_MAX, SplitPolicy
from hipmla.validate import check_choice, check_positive_finite, format_shape

#: Batch the decoder reserves for when the caller does not say.
DEFAULT_MAX_BATCH = 256

#: Bits of the device's error word (hip_src/core/paged.h, ERR_*): device-side input the
#: host never reads, found invalid by the kernels. The sequence concerned gets NaN.
DEVICE_ERRORS = {
    1: "kv_indptr decreases (or is negative) at a sequence",
    2: "kv_indptr points past the cache rows (contiguous) or past kv_indices (paged), or gives a "
       "sequence more pages than 2^31 - 1 tokens",
    4: "a page id in kv_indices is negative or its rows pass the end of the cache",
    8: "kv_last_page_len is outside 1 .. page_size",
    16: "qo_indptr is no offsets array from 0 to the query tokens of q (the whole step computed nothing: "
        "out and lse were not written)",
    32: "a sequence has fewer kv tokens than query tokens (qo_indptr)",
}


class DeviceInputError(ValueError):
    """Invalid device-side input found by the kernels (see :data:`DEVICE_ERRORS`)."""

    def __init__(self, bits: int):
        self.bits = int(bits)
        kinds = [text for bit, text in DEVICE_ERRORS.items() if bits & bit]
        nan = " (those sequences got NaN output and LSE)" if self.bits & ~16 else ""
        super().__init__("device-side input: " + "; ".join(kinds) + nan)


def fp8_variant_for(arch: str) -> str:
    """MI300-class targets (gfx940-942) read e4m3fnuz, every other target OCP e4m3fn."""
    return "e4m3fnuz" if arch.split(":")[0] in kernels.FNUZ_ARCHS else "e4m3fn"


# ----------------------------------------------------------------------------- pointers


def device_ptr(obj, name: str, *, itemsize: int, shape: tuple | None = None,
               kinds: str = "uiV", align: int = 4, writable: bool = False) -> tuple[int, tuple | None]:
    """``(address, shape)`` of a device buffer given as an int, a
    ``__cuda_array_interface__`` object or a DLPack producer (shape None for a raw address).

    The address must be ``align``-byte aligned (the kernels load Q and KV rows 16 bytes
    at a time). For an interface object, ``shape`` (``None`` entries match anything),
    the element size and C-contiguity are checked too, and ``writable`` buffers must not
    be read-only. The extent behind a raw address cannot be checked: it is the caller's
    promise.
    """
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        if obj <= 0:
            raise ValueError(f"{name}: expected a non-null device address, got {obj}")
        if obj >= 1 << 64:
            raise ValueError(f"{name}: {obj:#x} is not a 64-bit device address")
        return _aligned(int(obj), name, align), None
    cai = _interface(obj, name)
    if cai is None:
        if isinstance(obj, np.ndarray):
            raise TypeError(f"{name}: got a host numpy array; run() takes device buffers "
                            f"(use Decoder.decode for numpy inputs)")
        raise TypeError(f"{name}: expected a device address (int), an object with "
                        f"__cuda_array_interface__ or a DLPack producer, got {type(obj).__name__}")
    got_shape = _shape(cai, name)
    typestr = cai.get("typestr")
    if not isinstance(typestr, str) or len(typestr) < 3 or not typestr[2:].isdigit():
        raise TypeError(f"{name}: the interface's typestr {typestr!r} is not a numpy type string")
    if int(typestr[2:]) != itemsize or typestr[1] not in kinds:
        want = {"f": "float32" if itemsize == 4 else "float", "i": "int32" if itemsize == 4 else "integer"} \
            .get(kinds, "raw (bf16/fp8/byte) or integer")
        raise TypeError(f"{name}: expected {itemsize}-byte {want} elements, got typestr {typestr!r}")
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
    if writable and data[1]:
        raise ValueError(f"{name}: the buffer is read-only, and the kernels write it")
    return _aligned(ptr, name, align), got_shape


def _aligned(ptr: int, name: str, align: int) -> int:
    if ptr % align:
        raise ValueError(f"{name}: device address {ptr:#x} is not {align}-byte aligned")
    return ptr


def _shape(cai: dict, name: str) -> tuple:
    shape = cai.get("shape")
    if not isinstance(shape, (tuple, list)) or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise TypeError(f"{name}: the interface's shape must be a tuple of extents >= 0, got {shape!r}")
    return tuple(int(s) for s in shape)


def _interface(obj, name: str) -> dict | None:
    """``__cuda_array_interface__`` of ``obj``, or the same fields read from its DLPack
    capsule, or None when it speaks neither."""
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
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
            "version": 3, "dlpack_device": (int(t.device.device_type), int(t.device.device_id))}


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
    return (type(obj), d["data"], d["shape"], d["typestr"], d["strides"], d["dlpack_device"])


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
    keyer = _KEYERS[type(obj)] = _choose_keyer(obj)
    return keyer(obj)


class _Keyers(dict):
    """Keyer by type; a type not seen yet gets :func:`_first_key`."""

    def __missing__(self, cls: type) -> Callable:
        return _first_key


_KEYERS: dict[type, Callable] = _Keyers()


def buffer_key(obj):
    """What a buffer argument is — address, shape, dtype, strides — as a value that
    compares equal for any two views of the same memory, whatever the objects. A raw
    address and None are their own key. ``Decoder.run`` computes the same keys inline."""
    if obj is None or type(obj) is int:
        return obj
    try:
        return _KEYERS[type(obj)](obj)
    except Exception:  # noqa: BLE001 - not a buffer: the full check will say what it is
        return (object(),)


# ----------------------------------------------------------------------------- the decoder


def resolve_q_precision(q_precision: str, arch: str, kv_format: str) -> str:
    """``"auto"``: :data:`hipmla.kernels.AUTO_Q_PRECISION` (bf16: the most accurate Q, on
    instructions proven on hardware) on every ``arch`` and ``kv_format``; any other choice
    as it is."""
    check_choice(q_precision, "q_precision", ("auto",) + kernels.Q_PRECISIONS)
    check_choice(kv_format, "kv_format", KV_FORMATS)
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"arch: expected an offload arch such as 'gfx950' or 'sm_90', got {arch!r}")
    return kernels.AUTO_Q_PRECISION if q_precision == "auto" else q_precision


@dataclass(frozen=True)
class DecoderConfig:
    kv_format: str
    sm_scale: float
    q_precision: str = "bf16"  # resolved: never "auto"
    heads: int = kernels.HEADS

    def __post_init__(self):
        check_choice(self.kv_format, "kv_format", KV_FORMATS)
        check_choice(self.q_precision, "q_precision", kernels.Q_PRECISIONS)
        check_positive_finite(self.sm_scale, "sm_scale")
        if isinstance(self.heads, bool) or not isinstance(self.heads, (int, np.integer)):
            raise TypeError(f"heads: expected an int, got {type(self.heads).__name__} {self.heads!r}")
        check_heads(self.heads)  # every kernel runs 16 of them per work item
        object.__setattr__(self, "heads", int(self.heads))  # a numpy integer would reach ctypes fields


class Decoder:
    """MLA decode for one KV format and Q precision on one device and stream.

    ``selftest``: whether a kernel other than the portable one must first pass its
    known-answer check (:mod:`hipmla.selftest`; None: unless ``HIPMLA_SELFTEST=0``).
    ``kernel``: a :class:`hipmla.kernels.KernelSpec` to run instead of the device's
    choice (tests, trials). ``kernel_symbol`` names the kernel the decoder runs."""

    def __init__(self, kv_format: str, sm_scale: float, *, q_precision: str = "auto",
                 heads: int = kernels.HEADS, device: int = 0, stream=None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_q_tokens: int | None = None,
                 selftest: bool | None = None, kernel: kernels.KernelSpec | None = None):
        check_choice(kv_format, "kv_format", KV_FORMATS)
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise TypeError(f"device: expected a device index (int), got {type(device).__name__} {device!r}")
        if device < 0:
            raise ValueError(f"device: expected a device index >= 0, got {device}")
        sm_scale = check_positive_finite(sm_scale, "sm_scale")
        with np.errstate(over="ignore", under="ignore"):  # _f32 rejects what does not fit
            _f32(float(np.float32(sm_scale) * LOG2E), "sm_scale")
        DecoderConfig(kv_format, sm_scale, heads=heads)  # the arguments, before any device call
        check_stream(stream)
        self.device = runtime.device_info(device)
        arch = self.device.arch
        q_precision = resolve_q_precision(q_precision, arch, kv_format)
        self.config = DecoderConfig(kv_format, check_positive_finite(sm_scale, "sm_scale"), q_precision, heads)
        self.stream = stream
        self.fp8_variant = fp8_variant_for(arch)
        # One kernel takes every item of a step (any length; partial tiles masked inside):
        # the arch's fast kernel for this cache format and Q where it has one (gfx950,
        # gfx942), else the sm_90 tensor-core kernel for bf16 Q, else the portable kernel
        # (or ``kernel``, for tests and trials). One that is not the portable kernel serves
        # only once it passed its known-answer check on this arch (hipmla.selftest; the
        # verdict is kept per code object), else the portable kernel does.
        chosen = kernels.decoder_kernel(arch, kv_format, q_precision) if kernel is None \
            else kernels.check_serves(kernel, arch, kv_format, q_precision)
        self._split = _selftest.trusted_kernel(chosen, self.device, requested=selftest)
        self._fast = self._split if self._split.tile_tokens else None
        self.kernel_symbol = self._split.symbol
        self.policy = SplitPolicy.for_device(self.device.num_cus)
        self._split_fn = runtime.load_kernel(self._split, arch)
        self._scratch: runtime.DeviceBuffer | None = None
        self._max_batch = 0
        self._max_q_tokens = 0
        self._slots = 0
        self._params = kernels.DecodeParams()
        # f32 exactly as the emulator forms it: the scale rounded to f32, times log2(e).
        with np.errstate(over="ignore", under="ignore"):  # _f32 rejects what does not fit
            scale_log2 = float(np.float32(self.config.sm_scale) * LOG2E)
        self._params.sm_scale_log2 = _f32(scale_log2, "sm_scale")
        self._params.set_split(self.policy)
        self._params.head_groups = self.config.heads // kernels.HEADS
        self._last_key: tuple | None = None  # arguments of the last run, already resolved
        self._launch: Callable[[], None] | None = None  # the launch _last_key was built for
        self.reserve(max_batch, max_q_tokens)

    # -- capacity -------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def max_q_tokens(self) -> int:
        """Query tokens a step may have (``max_batch`` with one per sequence)."""
        return self._max_q_tokens

    @property
    def tile_tokens(self) -> int:
        """Tokens per online-softmax step of the kernel (the emulator's ``tile_tokens``;
        the AMD fast kernels step per wave quarter of their 128-token tiles)."""
        if self._fast is not None:
            return FAST_SCHEDULES[self.device.arch.split(":", 1)[0]].quarter
        return self._split.softmax_tile

    def emulate(self, q, kv: KVCache, layout, *, seqs=None, qo_indptr=None) -> tuple[np.ndarray, np.ndarray]:
        """What this decoder's kernel computes, by the numpy emulator: the same schedule,
        tiles and Q quantization (``hipmla.emulate.emulate_decode``)."""
        kw: dict = dict(q_precision=self.config.q_precision, q_fp8_variant=self.fp8_variant, seqs=seqs,
                        qo_indptr=qo_indptr)
        if self._fast is not None:
            kw.update(fast_schedule=FAST_SCHEDULES[self.device.arch.split(":", 1)[0]], fast_any_length=True)
        else:
            kw.update(tile_tokens=self._split.softmax_tile)
        return emulate_decode(q, kv, layout, self.config.sm_scale, self.policy, **kw)

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.nbytes

    def reserve(self, max_batch: int, max_q_tokens: int | None = None) -> None:
        """Size the partials scratch and the counters for steps of up to ``max_batch``
        sequences and ``max_q_tokens`` query tokens (default ``max_batch``: one each), any
        lengths. Grows only; not for inside a step: it allocates, and it waits for enqueued
        work before it frees the old buffers — so reserve before capturing a graph, which
        then keeps using these buffers."""
        limit = INT32_MAX // 4 // kernels.HEADS
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) \
                or not 1 <= max_batch <= limit:
            raise ValueError(f"max_batch: expected an integer in [1, {limit}], got {max_batch!r}")
        if max_q_tokens is None:
            max_q_tokens = max_batch
        if isinstance(max_q_tokens, bool) or not isinstance(max_q_tokens, (int, np.integer)) \
                or not 1 <= max_q_tokens <= limit:
            raise ValueError(f"max_q_tokens: expected an integer in [1, {limit}], got {max_q_tokens!r}")
        max_batch, max_q_tokens = max(int(max_batch), self._max_batch), max(int(max_q_tokens), self._max_q_tokens)
        if max_batch == self._max_batch and max_q_tokens == self._max_q_tokens:
            return
        runtime.use_device(self.device.index)
        rows = max(max_q_tokens, max_batch) * self._params.head_groups  # rows: 16 heads of a query token
        slots = self.policy.max_items(rows)
        acc_bytes = slots * kernels.HEADS * kernels.D_V * 4
        ml_bytes = slots * kernels.HEADS * 2 * 4
        words = 2 * rows + 2  # the merge counters (two per row, core/merge.h), the error word, padding
        grown = runtime.alloc(acc_bytes + ml_bytes + words * 4)
        try:
            # A row's last block resets its merge counters; they start at zero once, and so
            # does the error word (check_errors clears it).
            runtime.memset(grown.ptr + acc_bytes + ml_bytes, 0, words * 4)
            runtime.synchronize()  # the memset is done, and runs enqueued on the old buffers too
        except BaseException:
            grown.free()
            raise
        if self._scratch is not None:
            self._scratch.free()
        self._scratch, self._max_batch, self._max_q_tokens, self._slots = grown, max_batch, max_q_tokens, slots
        p = self._params
        p.part_acc = grown.ptr
        p.part_ml = grown.ptr + acc_bytes
        p.counters = grown.ptr + acc_bytes + ml_bytes
        p.errors = p.counters + 2 * rows * 4
        self._last_key = None

    # -- launching ----------------------------------------------------------------

    def run(self, q, kv, kv_indptr, out, *, kv_indices=None, kv_last_page_len=None, page_size: int = 1,
            kv_scale=None, lse=None, fp8_scale: float | None = None, kv_scale_stride: int | None = None,
            batch: int | None = None, qo_indptr=None, q_tokens: int | None = None, stream=None) -> None:
        """Enqueue one decode step on ``stream`` (default: the decoder's). No host sync,
        no allocation, no copy: what changes between steps (lengths, page tables) is read
        by the kernels from ``kv_indptr``, ``kv_indices`` and ``kv_last_page_len``.

        Arguments are checked once per distinct set of buffers — their addresses, shapes,
        dtypes and strides, not the objects — so new views of the same memory each step
        go straight to the launch. ``batch`` is needed when ``q`` is a raw address.

        Several query tokens per sequence (MTP, speculative decoding): ``qo_indptr``
        ``(b + 1,)`` int32 on the device gives sequence s the q rows ``qo_indptr[s] ..
        qo_indptr[s+1] - 1``; ``q`` is then ``(t_q, heads, 576)``, ``out`` ``(t_q, heads,
        512)``, ``lse`` ``(t_q, heads)``, causal within the step (query token j of n sees
        the first ``len - n + j + 1`` kv tokens; ``len >= n`` is the caller's promise, checked
        on the device: ERR_Q_LEN). ``batch`` is needed when ``qo_indptr`` is a raw address,
        ``q_tokens`` (t_q) when ``q`` is.
        """
        runtime.use_device(self.device.index)
        s = self.stream if stream is None else stream
        # The hot path: one key of what the arguments are, compared with the last one:
        # buffer_key written out per argument (a call each costs more than most keys).
        # Scalars by type and value: 24.0 or True must not pass because 24 or 1 passed before.
        keyers = _KEYERS
        try:
            key = (q if q is None or type(q) is int else keyers[type(q)](q),
                   kv if kv is None or type(kv) is int else keyers[type(kv)](kv),
                   kv_indptr if kv_indptr is None or type(kv_indptr) is int else keyers[type(kv_indptr)](kv_indptr),
                   out if out is None or type(out) is int else keyers[type(out)](out),
                   kv_indices if kv_indices is None or type(kv_indices) is int
                   else keyers[type(kv_indices)](kv_indices),
                   kv_last_page_len if kv_last_page_len is None or type(kv_last_page_len) is int
                   else keyers[type(kv_last_page_len)](kv_last_page_len),
                   kv_scale if kv_scale is None or type(kv_scale) is int else keyers[type(kv_scale)](kv_scale),
                   lse if lse is None or type(lse) is int else keyers[type(lse)](lse),
                   type(page_size), page_size, type(fp8_scale), fp8_scale, type(kv_scale_stride), kv_scale_stride,
                   type(batch), batch,
                   qo_indptr if qo_indptr is None or type(qo_indptr) is int else keyers[type(qo_indptr)](qo_indptr),
                   type(q_tokens), q_tokens, s)
        except Exception:  # noqa: BLE001 - an argument that is no buffer: the full check refuses it
            key = None
        if key is None or key != self._last_key:
            self._last_key = None
            self._prepare(q, kv, kv_indptr, out, kv_indices, kv_last_page_len, page_size, kv_scale, lse,
                          fp8_scale, kv_scale_stride, batch, check_stream(s), qo_indptr, q_tokens)
            self._last_key = key
        self._launch()

    def _prepare(self, q, kv, kv_indptr, out, kv_indices, kv_last_page_len, page_size, kv_scale, lse,
                 fp8_scale, kv_scale_stride, batch, stream, qo_indptr=None, q_tokens=None) -> None:
        """Validate every argument and build the launch."""
        cfg = self.config
        h, fmt = cfg.heads, cfg.kv_format
        p = self._params
        if qo_indptr is None:
            if q_tokens is not None:
                raise ValueError(f"q_tokens: {q_tokens!r} given without qo_indptr (one query token per sequence)")
            b = t_q = _batch(q, batch)
            p.qo_indptr = 0
        else:
            t_q = _batch(q, q_tokens, "q_tokens")
            p.qo_indptr, qo_shape = device_ptr(qo_indptr, "qo_indptr", itemsize=4, shape=(None,), kinds="i")
            if batch is not None:
                b = _batch(q, batch)
                if qo_shape is not None and qo_shape[0] != b + 1:
                    raise ValueError(f"qo_indptr: expected {b + 1} entries (batch + 1), got {qo_shape[0]}")
            elif qo_shape is None:
                raise ValueError("batch: needed when qo_indptr is a raw address (the sequences of the step)")
            elif qo_shape[0] < 2:
                raise ValueError(f"qo_indptr: expected batch + 1 >= 2 entries, got {qo_shape[0]}")
            else:
                b = qo_shape[0] - 1
        if b > self._max_batch:
            raise ValueError(f"batch: {b} sequences exceed the {self._max_batch} this decoder reserved "
                             f"for; call reserve({b}) before the step")
        if t_q > self._max_q_tokens:
            raise ValueError(f"q: {t_q} query tokens exceed the {self._max_q_tokens} this decoder reserved "
                             f"for; call reserve({self._max_batch}, {t_q}) before the step")
        p.q = device_ptr(q, "q", itemsize=2, shape=(t_q, h, kernels.D_QK), align=16)[0]
        kv_cols = kernels.D_QK // 2 if fmt == "mxfp4" else kernels.D_QK
        p.kv, kv_shape = device_ptr(kv, "kv", itemsize=2 if fmt == "bf16" else 1, shape=(None, kv_cols), align=16)
        p.kv_indptr = device_ptr(kv_indptr, "kv_indptr", itemsize=4, shape=(b + 1,), kinds="i")[0]
        # The kernels store up to 16 bytes of output at a time.
        p.out = device_ptr(out, "out", itemsize=2, shape=(t_q, h, kernels.D_V), align=16, writable=True)[0]
        p.lse = 0 if lse is None else device_ptr(lse, "lse", itemsize=4, shape=(t_q, h), kinds="f",
                                                 writable=True)[0]
        # The kernels read no row past the cache's and no page-table entry past its end
        # (0: a raw address, whose extent is the caller's promise).
        p.kv_rows = min(kv_shape[0], INT32_MAX) if kv_shape is not None else 0
        p.n_indices = 0
        if kv_indices is None and kv_last_page_len is None:
            if page_size != 1:
                raise ValueError(f"page_size: {page_size!r} given without a page table "
                                 f"(kv_indices, kv_last_page_len)")
            p.kv_indices = p.kv_last_page_len = 0
            p.page_shift = 0
        elif kv_indices is None or kv_last_page_len is None:
            missing = "kv_indices" if kv_indices is None else "kv_last_page_len"
            raise ValueError(f"kv_indices/kv_last_page_len: a page table needs both, {missing} is missing")
        else:
            p.page_shift = check_page_size(page_size).bit_length() - 1
            p.kv_indices, idx_shape = device_ptr(kv_indices, "kv_indices", itemsize=4, shape=(None,), kinds="i")
            p.n_indices = min(idx_shape[0], INT32_MAX) if idx_shape is not None else 0
            p.kv_last_page_len = device_ptr(kv_last_page_len, "kv_last_page_len", itemsize=4,
                                            shape=(b,), kinds="i")[0]
        if fmt == "mxfp4":
            stride = _scale_stride(kv_scale, kv_scale_stride)
            p.kv_scale, scale_shape = device_ptr(kv_scale, "kv_scale", itemsize=1, shape=(None, stride), align=1)
            if kv_shape is not None and scale_shape is not None and scale_shape[0] < kv_shape[0]:
                raise ValueError(f"kv_scale: expected a scale row for each of the {kv_shape[0]} cache rows, "
                                 f"got {scale_shape[0]}")
            if kv_shape is None and scale_shape is not None:
                p.kv_rows = min(scale_shape[0], INT32_MAX)
            p.stride_kv_scale = stride
            p.kv_fp8_scale = 1.0
        else:
            if kv_scale is not None:
                raise ValueError(f"kv_scale: only the mxfp4 format has block scales, this decoder reads {fmt}")
            p.kv_scale = 0
            p.stride_kv_scale = 0
            if fmt == "fp8":
                if fp8_scale is None:
                    raise ValueError("fp8_scale: the fp8 format needs its per-tensor scale")
                p.kv_fp8_scale = _f32(check_positive_finite(fp8_scale, "fp8_scale"), "fp8_scale")
            else:
                p.kv_fp8_scale = 1.0
        p.batch = b
        p.q_tokens = t_q
        grid = kernels.grid_decode(self.policy.max_items(t_q * p.head_groups))
        # The launch gets its own copy of the parameters (the struct is read when a
        # launch is enqueued; a copy per launch keeps later edits of self._params out).
        self._launch = self._split_fn.bind(type(p).from_buffer_copy(p)).prepare(
            grid, (self._split.block_threads, 1, 1), self._split.dynamic_shared_bytes, stream)

    def check_errors(self) -> None:
        """Raise :class:`DeviceInputError` if a step since the last check found invalid
        device-side input (decreasing ``kv_indptr``, entries past the cache or the page
        table, bad page ids or last-page lengths), then clear the record. It waits for
        the device: call it between steps (or after a replayed graph), not inside one."""
        if self._scratch is None:
            return
        runtime.use_device(self.device.index)
        runtime.synchronize()
        word = np.zeros(1, dtype=np.int32)
        runtime.copy_dtoh(word, self._params.errors)
        if word[0]:
            runtime.memset(self._params.errors, 0, 4)
            runtime.synchronize()
            raise DeviceInputError(int(word[0]))

    # -- numpy convenience ----------------------------------------------------------

    def decode(self, q: np.ndarray, kv: KVCache, layout, qo_indptr=None) -> tuple[np.ndarray, np.ndarray]:
        """Copy numpy inputs in, decode, copy out: ``(out bf16 (t_q,h,512), lse f32 (t_q,h))``.
        ``layout`` is a :class:`hipmla.paging.KvLayout` or a host ``kv_indptr``; ``qo_indptr``
        a host array as :meth:`run` takes it on the device (checked here, causal rule too)."""
        layout = as_layout(layout)
        if qo_indptr is None:
            check_q(q, batch=layout.batch)
        else:
            check_q(q)
            qo_indptr = check_qo_indptr(qo_indptr, layout.batch, q_tokens=q.shape[0])
            check_causal(layout.seq_lens(), q_lens(qo_indptr, layout.batch))
        if q.shape[1] != self.config.heads:
            raise ValueError(f"q: this decoder serves {self.config.heads} heads, got shape {q.shape}")
        self._check_cache(kv)
        if kv.format == "mxfp4" and not isinstance(kv.scales, np.ndarray):
            raise ValueError(f"kv: an mxfp4 cache needs its E8M0 scales, got scales={kv.scales!r}")
        layout.check_cache(kv.rows)
        import ml_dtypes

        if q.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"q: the device path takes bfloat16 Q, got {q.dtype}")
        b, t_q = layout.batch, q.shape[0]
        self.reserve(b, t_q)
        host = [q.view(np.uint16), kv.data, np.ascontiguousarray(layout.kv_indptr, dtype=np.int32)]
        if layout.paged:
            host += [np.ascontiguousarray(layout.kv_indices, dtype=np.int32),
                     np.ascontiguousarray(layout.kv_last_page_len, dtype=np.int32)]
        bufs = [runtime.DeviceArray.from_host(a) for a in host]
        qo = None if qo_indptr is None else runtime.DeviceArray.from_host(np.ascontiguousarray(qo_indptr, np.int32))
        scale = runtime.DeviceArray.from_host(kv.scales) if kv.format == "mxfp4" else None
        out = runtime.DeviceArray((t_q, self.config.heads, kernels.D_V), np.uint16)
        lse = runtime.DeviceArray((t_q, self.config.heads), np.float32)
        paged = dict(kv_indices=bufs[3], kv_last_page_len=bufs[4], page_size=layout.page_size) \
            if layout.paged else {}
        if qo is not None:
            paged["qo_indptr"] = qo
        try:
            self.run(*bufs[:3], out, kv_scale=scale, lse=lse,
                     fp8_scale=kv.fp8_scale if kv.format == "fp8" else None, **paged)
            runtime.synchronize()
            return out.to_host().view(ml_dtypes.bfloat16), lse.to_host()
        finally:
            self._last_key = None
            self._launch = None
            for a in bufs + [out, lse] + [x for x in (scale, qo) if x is not None]:
                a.free()

    def _check_cache(self, kv: KVCache) -> None:
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv: expected a hipmla.formats.KVCache, got {type(kv).__name__}")
        if kv.format != self.config.kv_format:
            raise ValueError(f"kv: this decoder reads {self.config.kv_format}, got a {kv.format} cache")
        if kv.format == "fp8" and kv.fp8_variant != self.fp8_variant:
            raise ValueError(f"kv: {self.device.arch} reads fp8 as {self.fp8_variant}, "
                             f"got a {kv.fp8_variant} cache")

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        self._last_key = None
        self._launch = None
        if self._scratch is not None:
            runtime.use_device(self.device.index)
            self._scratch.free()
            self._scratch = None
            self._max_batch = self._max_q_tokens = self._slots = 0

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _f32(value: float, name: str) -> float:
    """``value`` as the kernel's f32 receives it: finite and not flushed to zero."""
    with np.errstate(over="ignore", under="ignore"):  # the range check below says it
        v = np.float32(value)
    if not np.isfinite(v) or v == 0 or abs(v) < np.finfo(np.float32).tiny:
        raise ValueError(f"{name}: {value!r} is outside the range of the kernel's float32 "
                         f"(normal magnitudes {np.finfo(np.float32).tiny:.3g} .. {np.finfo(np.float32).max:.3g})")
    return float(v)


def check_stream(stream, name: str = "stream"):
    """What the launch takes for ``stream``: None (the null stream), a :class:`runtime.Stream`,
    a raw handle (int >= 0 or a hip-python stream), or a torch/CuPy-style stream object
    (its ``cuda_stream`` / ``ptr`` handle, or ``__cuda_stream__()``)."""
    if stream is None or isinstance(stream, runtime.Stream):
        return stream
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
        if not 0 <= stream < 1 << 64:
            raise ValueError(f"{name}: a raw stream handle must lie in [0, 2**64), got {stream}")
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if callable(proto):
        got = proto()
        if isinstance(got, tuple) and len(got) == 2:
            return check_stream(got[1], name)
        raise TypeError(f"{name}: __cuda_stream__() must return (version, handle), got {got!r}")
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attr, None)
        if isinstance(handle, (int, np.integer)) and not isinstance(handle, bool):
            return check_stream(handle, name)
    if type(stream).__module__.split(".")[0] in ("hip", "rocm", "cuda") and hasattr(stream, "__int__"):
        return stream  # hip-python's own handle (ihipStream_t)
    raise TypeError(f"{name}: expected None, a hipmla.runtime.Stream, a raw handle (int) or a "
                    f"stream object (hip-python, torch, CuPy), got {type(stream).__name__} {stream!r}")


def _batch(q, batch, name: str = "batch") -> int:
    """``batch`` (or ``q_tokens``) as given, else the rows of ``q``."""
    if batch is not None:
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not 1 <= batch <= INT32_MAX:
            raise ValueError(f"{name}: expected an integer in [1, {INT32_MAX}], got {batch!r}")
        return int(batch)
    if isinstance(q, (int, np.integer)) and not isinstance(q, bool):
        what = "the sequences" if name == "batch" else "the query tokens"
        raise ValueError(f"{name}: needed when q is a raw address ({what} of the step)")
    cai = _interface(q, "q")
    if cai is None:
        device_ptr(q, "q", itemsize=2)  # raises: says what q is instead
        raise TypeError(f"q: expected a device address (int) or a device buffer, got {type(q).__name__}")
    shape = _shape(cai, "q")
    if len(shape) != 3 or shape[0] < 1:
        raise ValueError(f"q: expected shape (query tokens >= 1, heads, {kernels.D_QK}), got {shape}")
    return int(shape[0])


def _scale_stride(kv_scale, kv_scale_stride: int | None) -> int:
    if kv_scale is None:
        raise ValueError("kv_scale: the mxfp4 format needs its E8M0 block scales")
    if kv_scale_stride is not None and (isinstance(kv_scale_stride, bool)
                                        or not isinstance(kv_scale_stride, (int, np.integer))):
        raise TypeError(f"kv_scale_stride: expected an int, got {type(kv_scale_stride).__name__}")
    raw = isinstance(kv_scale, (int, np.integer)) and not isinstance(kv_scale, bool)
    cai = None if raw else _interface(kv_scale, "kv_scale")
    if not raw and cai is None:
        device_ptr(kv_scale, "kv_scale", itemsize=1, align=1)  # raises: says what kv_scale is
    shape = None if cai is None else _shape(cai, "kv_scale")
    if shape is not None and len(shape) != 2:
        raise ValueError(f"kv_scale: expected shape (rows, stride), got {shape}")
    stride = int(shape[1]) if shape is not None else kv_scale_stride
    if stride is None:
        raise ValueError("kv_scale_stride: needed when kv_scale is a raw address")
    if kv_scale_stride is not None and stride != kv_scale_stride:
        raise ValueError(f"kv_scale_stride: {kv_scale_stride} disagrees with kv_scale's shape ({stride})")
    if not kernels.D_QK // 32 <= stride <= INT32_MAX:
        raise ValueError(f"kv_scale_stride: expected {kernels.D_QK // 32} .. {INT32_MAX}, got {stride}")
    return int(stride)


# ----------------------------------------------------------------------------- CLI backend


def gpu_check_backend(index: int = 0):
    """``(label, run)`` for ``python -m hipmla check`` on a GPU."""
    info = runtime.device_info(index)
    decoders: dict[tuple[str, str], Decoder] = {}

    def run(inputs, seqs, q_precision):
        heads = inputs.q.shape[1]
        key = (inputs.kv.format, q_precision, heads)
        if key not in decoders:
            decoders[key] = Decoder(inputs.kv.format, inputs.sm_scale, q_precision=q_precision, device=index,
                                    heads=heads)
        t0 = time.perf_counter()  # wall time of the numpy path: copies in and out included
        out, lse = decoders[key].decode(inputs.q, inputs.kv, inputs.layout, inputs.qo_indptr)
        if inputs.qo_indptr is not None:  # rows are query tokens: those of the sequences asked for
            qo = inputs.qo_indptr
            rows = np.concatenate([np.arange(qo[s], qo[s + 1]) for s in seqs])
            return out[rows], lse[rows], time.perf_counter() - t0
        return out[seqs], lse[seqs], time.perf_counter() - t0

    return f"{info.arch}:{index}", run


__all__ = ["DEVICE_ERRORS", "DLPACK_DEVICES", "Decoder", "DecoderConfig", "DeviceInputError", "PAGE_SIZES", "KvLayout",
           "buffer_key", "check_stream", "device_ptr", "dlpack_interface",
           "fp8_variant_for", "resolve_q_precision"]
