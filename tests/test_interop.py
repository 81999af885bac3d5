"""Interop on the CPU: DLPack producers (a real PyCapsule holding a DLManagedTensor
built with ctypes, as torch, CuPy and JAX hand them out) next to
``__cuda_array_interface__`` v3 (its ``stream`` key, its ``mask``)."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
from test_decode import ADDR, D_QK, D_V, H, FakeCAI, args, fake_runtime, make

from hipmla import buffers, decode

_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_new = ctypes.pythonapi["PyCapsule_New"]
_new.argtypes, _new.restype = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p], ctypes.py_object
_name_of = ctypes.pythonapi["PyCapsule_GetName"]  # on the raw PyObject* a destructor gets
_name_of.argtypes, _name_of.restype = [ctypes.c_void_p], ctypes.c_char_p

TYPES = {"<u2": (1, 16), "<i2": (0, 16), "bf16": (4, 16), "|u1": (1, 8), "e4m3": (10, 8), "e4m3fnuz": (11, 8),
         "e5m2": (12, 8), "e8m0": (14, 8), "<i4": (0, 32),
         "<u4": (1, 32), "<i8": (0, 64), "<f4": (2, 32), "<f2": (2, 16), "|b1": (6, 8)}


class Producer:
    """A DLPack producer over a fake device address. Every capsule it hands out holds its
    own DLManagedTensor; the capsule's destructor calls the deleter if the capsule was
    never consumed (renamed "used_dltensor"), as the DLPack spec asks of producers."""

    deleted: list  # manager_ctx of every DLManagedTensor whose deleter ran

    def __init__(self, shape, dtype="<u2", ptr=0x100000, *, device=(2, 0), strides=None, byte_offset=0,
                 lanes=1, versioned=False, read_only=False, dlpack_device=True):
        self.shape, self.dtype, self.ptr, self.device = tuple(shape), dtype, ptr, device
        self.strides, self.byte_offset, self.lanes, self.versioned = strides, byte_offset, lanes, versioned
        self.read_only = read_only
        self.calls, self.streams, self.deleted, self._keep = 0, [], [], []
        if not dlpack_device:
            self.__dlpack_device__ = None

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.calls += 1
        self.streams.append(stream)
        n = len(self.shape)
        shape = (ctypes.c_int64 * max(n, 1))(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * max(n, 1))(*self.strides)
        code, bits = TYPES[self.dtype]
        t = buffers._DLTensor(self.ptr, buffers._DLDevice(*self.device), n,
                             buffers._DLDataType(code, bits, self.lanes),
                             ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                             None if strides is None else ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)),
                             self.byte_offset)
        ctx = len(self._keep) + 1

        @_Deleter
        def deleter(address):
            self.deleted.append(ctx)

        if self.versioned:
            m = buffers._DLManagedTensorVersioned(buffers._DLPackVersion(1, 0), ctx,
                                                 ctypes.cast(deleter, ctypes.c_void_p), int(self.read_only), t)
            name = b"dltensor_versioned"
        else:
            m = buffers._DLManagedTensor(t, ctx, ctypes.cast(deleter, ctypes.c_void_p))
            name = b"dltensor"

        @_Destructor
        def destructor(capsule):
            # an unconsumed capsule: the producer releases the tensor (the spec's rule)
            if _name_of(capsule) == name:
                _Deleter(m.deleter)(ctypes.addressof(m))

        self._keep.append((shape, strides, m, deleter, destructor))
        return _new(ctypes.addressof(m), name, ctypes.cast(destructor, ctypes.c_void_p))


# ----------------------------------------------------------------------------- DLPack in device_ptr


def test_dlpack_cuda_and_rocm_producers_give_address_and_shape():
    for device in ((2, 0), (10, 1)):  # kDLCUDA, kDLROCM
        p = Producer((4, H, D_QK), device=device)
        assert decode.device_ptr(p, "q", itemsize=2, shape=(4, H, D_QK), align=16) == (0x100000, (4, H, D_QK))
    # bf16 (code 4) and fp8 (float8 codes) are raw 2- and 1-byte elements, like int16/uint8 views;
    # a float8 code must be one the buffer may hold
    assert decode.device_ptr(Producer((2, H, D_QK), "bf16"), "q", itemsize=2)[1] == (2, H, D_QK)
    assert decode.device_ptr(Producer((8, D_QK), "e4m3"), "kv", itemsize=1, float8=("float8_e4m3fn",))[1] \
        == (8, D_QK)
    assert decode.device_ptr(Producer((3,), "<i4"), "kv_indptr", itemsize=4, kinds="i")[1] == (3,)


@pytest.mark.parametrize("dtype, allowed", [("e4m3", ()), ("e5m2", ("float8_e4m3fn",)),
                                            ("e4m3fnuz", ("float8_e4m3fn",)), ("e4m3", ("float8_e4m3fnuz",))])
def test_dlpack_float8_encodings_must_be_the_expected_one(dtype, allowed):
    # an e5m2 cache read as e4m3 decodes to other values, silently: the code in the capsule says which
    with pytest.raises(TypeError, match=r"^kv: a DLPack float8_e\w+ buffer; expected "):
        decode.device_ptr(Producer((8, D_QK), dtype), "kv", itemsize=1, float8=allowed)


def test_run_refuses_another_float8_cache_and_accepts_its_own(monkeypatch):
    fake_runtime(monkeypatch, "sm_90")
    dec = decode.Decoder("fp8", 1 / 24)  # NVIDIA: e4m3fn
    dec.run(**args(kv_format="fp8", kv=Producer((400, D_QK), "e4m3", ADDR["kv"])))
    for dtype in ("e5m2", "e4m3fnuz"):
        with pytest.raises(TypeError, match=f"^kv: a DLPack float8_{dtype} buffer; expected float8_e4m3fn"):
            dec.run(**args(kv_format="fp8", kv=Producer((400, D_QK), dtype, ADDR["kv"])))
    mx = decode.Decoder("mxfp4", 1 / 24)  # E8M0 scales may come as float8_e8m0fnu, codes as bytes only
    mx.run(**args(kv_scale=Producer((400, 24), "e8m0", ADDR["kv_scale"])))
    with pytest.raises(TypeError, match="^kv: a DLPack float8_e4m3fn buffer; expected no float8"):
        mx.run(**args(kv=Producer((400, D_QK // 2), "e4m3", ADDR["kv"])))


def test_buffers_on_another_device_are_refused(monkeypatch):
    fake_runtime(monkeypatch, "sm_90")
    dec = decode.Decoder("mxfp4", 1 / 24)  # device 0
    with pytest.raises(ValueError, match="^q: the buffer is on device 1, this decoder runs on device 0"):
        dec.run(**args(q=Producer((2, H, D_QK), device=(2, 1), ptr=ADDR["q"])))

    class Tensor(FakeCAI):  # torch and CuPy: the interface has no device, __dlpack_device__ says it
        def __init__(self, *a, device=0):
            super().__init__(*a)
            self.device = device

        def __dlpack_device__(self):
            return (2, self.device)

    with pytest.raises(ValueError, match="^out: the buffer is on device 3"):
        dec.run(**args(out=Tensor((2, H, D_V), "<u2", ADDR["out"], device=3)))
    dec.run(**args(out=Tensor((2, H, D_V), "<u2", ADDR["out"]), q=Producer((2, H, D_QK), ptr=ADDR["q"])))


def test_dlpack_byte_offset_and_explicit_contiguous_strides():
    p = Producer((4, 576), "|u1", ptr=0x200000, byte_offset=576 * 2, strides=(576, 1))
    assert decode.device_ptr(p, "kv", itemsize=1, align=16) == (0x200000 + 1152, (4, 576))
    # strides are in elements in DLPack: (288, 1) of 2-byte elements are bytes (576, 2)
    assert decode.device_ptr(Producer((4, 288), "<u2", strides=(288, 1)), "kv", itemsize=2)[1] == (4, 288)


@pytest.mark.parametrize("producer, exc, words", [
    (Producer((4, H, D_QK), device=(1, 0)), TypeError, "host .*kDLCPU"),
    (Producer((4, H, D_QK), device=(3, 0)), TypeError, "host .*kDLCUDAHost"),
    (Producer((4, H, D_QK), device=(4, 0)), TypeError, "device type 4"),
    (Producer((4, H, D_QK), device=(1, 0), dlpack_device=False), TypeError, "kDLCPU"),  # seen in the capsule
    (Producer((4, H, D_QK), "<f2"), TypeError, "2-byte raw"),
    (Producer((4, H, D_QK), "<f4"), TypeError, "2-byte"),
    (Producer((4, H, D_QK), "|b1"), TypeError, "2-byte"),
    (Producer((4, H, D_QK), lanes=2), TypeError, "lanes"),
    (Producer((4, H, D_QK), strides=(1, 4, 64)), ValueError, "C-contiguous"),
    (Producer((4, H, 512)), ValueError, "expected shape"),
    (Producer((4, H, D_QK), byte_offset=8), ValueError, "16-byte aligned"),
    (Producer((4, H, D_QK), ptr=0), ValueError, "null data"),
])
def test_dlpack_bad_producers(producer, exc, words):
    with pytest.raises(exc, match="^q: .*" + words):
        decode.device_ptr(producer, "q", itemsize=2, shape=(4, H, D_QK), align=16)


def test_dlpack_capsule_is_peeked_not_consumed_and_deleted_once():
    p = Producer((2, H, D_QK))
    for _ in range(3):
        decode.device_ptr(p, "q", itemsize=2)
    gc.collect()
    # each capsule was released by its own destructor, once: hipmla never calls a deleter
    assert p.calls == 3 and sorted(p.deleted) == [1, 2, 3]
    assert p.streams == [-1] * 3  # -1: no synchronization asked of the producer


def test_dlpack_versioned_capsules_and_their_read_only_flag():
    p = Producer((2, H, D_V), versioned=True)
    assert decode.device_ptr(p, "out", itemsize=2, writable=True)[1] == (2, H, D_V)
    ro = Producer((2, H, D_V), versioned=True, read_only=True)
    assert decode.device_ptr(ro, "q", itemsize=2)[1] == (2, H, D_V)  # reading is fine
    with pytest.raises(ValueError, match="^out: .*read-only"):
        decode.device_ptr(ro, "out", itemsize=2, writable=True)


def test_producer_without_the_stream_keyword():
    class Old(Producer):
        def __dlpack__(self):  # DLPack before the array API's stream keyword
            return super().__dlpack__()

    assert decode.device_ptr(Old((3,), "<i4"), "kv_indptr", itemsize=4, kinds="i")[1] == (3,)


# ----------------------------------------------------------------------------- DLPack in the decoder


def producers(b=2, rows=400):
    return dict(q=Producer((b, H, D_QK), ptr=ADDR["q"]), kv=Producer((rows, D_QK // 2), "|u1", ADDR["kv"]),
                kv_indptr=Producer((b + 1,), "<i4", ADDR["kv_indptr"]),
                out=Producer((b, H, D_V), "bf16", ADDR["out"]),
                kv_scale=Producer((rows, 24), "|u1", ADDR["kv_scale"]), lse=Producer((b, H), "<f4", ADDR["lse"]))


def test_decoder_runs_dlpack_producers_like_interfaces(monkeypatch):
    gpu, dec = make(monkeypatch)
    dec.run(**producers(3))
    dec.run(**args(3, lse=FakeCAI((3, H), "<f4", ADDR["lse"])))
    a, b = gpu.launches
    assert a.params == b.params and a.batch == 3 and a.kv_rows == 400


def test_pure_dlpack_producers_are_keyed_by_their_capsule(monkeypatch):
    gpu, dec = make(monkeypatch)
    calls = []
    real = dec._prepare
    monkeypatch.setattr(dec, "_prepare", lambda *a: (calls.append(1), real(*a))[1])
    for _ in range(5):
        dec.run(**producers(2))  # new producer objects over the same memory each step
    assert len(calls) == 1 and len(gpu.launches) == 5
    dec.run(**dict(producers(2), out=Producer((2, H, D_V), ptr=0x900000)))
    assert len(calls) == 2 and gpu.launches[-1].out == 0x900000
    with pytest.raises(TypeError, match="^q: .*kDLCPU"):
        dec.run(**dict(producers(2), q=Producer((2, H, D_QK), ptr=ADDR["q"], device=(1, 0))))
    assert len(gpu.launches) == 6


def test_torch_style_tensors_never_build_a_capsule_on_the_hot_path():
    class Tensor(Producer):
        """torch on ROCm: data_ptr()/stride() and DLPack, no usable interface dict."""

        def data_ptr(self):
            return self.ptr

        def is_contiguous(self):
            return self.strides is None

    t = Tensor((2, H, D_QK))
    key = decode.buffer_key(t)
    assert t.calls == 0 and key == decode.buffer_key(Tensor((2, H, D_QK)))
    assert decode.device_ptr(t, "q", itemsize=2)[1] == (2, H, D_QK)  # the full check reads the capsule


def test_numpy_arrays_are_host_memory_not_dlpack_producers():
    with pytest.raises(TypeError, match="^q: got a host numpy array"):
        decode.device_ptr(np.zeros((2, H, D_QK), np.uint16), "q", itemsize=2)


# ----------------------------------------------------------------------------- the interface's stream and mask


def test_interface_stream_key_is_accepted_and_checked():
    for stream in (None, 1, 2, 0x7F00DEAD):
        a = FakeCAI((3,), "<i4")
        a.__cuda_array_interface__["stream"] = stream
        assert decode.device_ptr(a, "kv_indptr", itemsize=4, kinds="i")[1] == (3,)
    for stream, exc in ((0, ValueError), ("1", TypeError), (True, TypeError)):
        a = FakeCAI((3,), "<i4")
        a.__cuda_array_interface__["stream"] = stream
        with pytest.raises(exc, match="^kv_indptr: .*stream"):
            decode.device_ptr(a, "kv_indptr", itemsize=4, kinds="i")


def test_interface_mask_is_refused():
    a = FakeCAI((3,), "<i4")
    a.__cuda_array_interface__["mask"] = FakeCAI((3,), "|b1")
    with pytest.raises(TypeError, match="^kv_indptr: masked"):
        decode.device_ptr(a, "kv_indptr", itemsize=4, kinds="i")
    a.__cuda_array_interface__["mask"] = None  # v3: None is no mask
    assert decode.device_ptr(a, "kv_indptr", itemsize=4, kinds="i")[1] == (3,)


def test_a_new_mask_or_read_only_flag_on_the_same_memory_is_checked_again(monkeypatch):
    gpu, dec = make(monkeypatch)
    dec.run(**args())
    masked = FakeCAI((2, H, D_V), "<u2", ADDR["out"])
    masked.__cuda_array_interface__["mask"] = object()
    with pytest.raises(TypeError, match="^out: masked"):
        dec.run(**args(out=masked))
    ro = FakeCAI((2, H, D_V), "<u2", ADDR["out"])
    ro.__cuda_array_interface__["data"] = (ADDR["out"], True)
    with pytest.raises(ValueError, match="^out: .*read-only"):
        dec.run(**args(out=ro))
    assert len(gpu.launches) == 1


def test_stream_objects_of_other_libraries(monkeypatch):
    class TorchStream:
        cuda_stream = 0x1234

    class CupyStream:
        ptr = 0x5678

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x9ABC)

    gpu, dec = make(monkeypatch)
    for s in (TorchStream(), CupyStream(), Protocol()):
        dec.run(**args(), stream=s)
    assert [l.stream for l in gpu.launches] == [0x1234, 0x5678, 0x9ABC]


def test_a_tensor_without_a_typestr_falls_back_to_its_dlpack():
    """torch raises TypeError from __cuda_array_interface__ for bf16 and fp8 tensors; the
    same tensor's DLPack capsule names the dtype, so it is taken as it is."""

    class Bf16Tensor(Producer):
        @property
        def __cuda_array_interface__(self):
            raise TypeError("dtype torch.bfloat16 is not supported by the interface")

    t = Bf16Tensor((2, H, D_QK), "bf16")
    assert decode.device_ptr(t, "q", itemsize=2, shape=(2, H, D_QK), align=16) == (0x100000, (2, H, D_QK))


def test_the_key_of_a_tensor_whose_interface_raises(monkeypatch):
    """A torch-style bf16 tensor: its interface property raises, its key must not."""
    buffers.KEYERS.clear()

    class Bf16Torch(Producer):
        @property
        def __cuda_array_interface__(self):
            raise TypeError("dtype torch.bfloat16 is not supported")

        def data_ptr(self):
            return self.ptr

        def is_contiguous(self):
            return self.strides is None

    key = decode.buffer_key(Bf16Torch((2, H, D_QK), "bf16"))
    assert key[0] == 0x100000 and key == decode.buffer_key(Bf16Torch((2, H, D_QK), "bf16"))
