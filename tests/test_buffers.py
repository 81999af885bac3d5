"""hipmla.buffers on the CPU: the checks of a buffer argument (raw address, CUDA Array
Interface, DLPack fields) and the keys that let a step skip them. DLPack capsules
themselves are ``tests/test_interop.py``."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from test_decode import FakeCAI

from hipmla import buffers, runtime


def test_device_ptr_accepts_raw_addresses_and_interfaces():
    # (address, shape): the shape is None for a raw address, whose extent is unknowable.
    assert buffers.device_ptr(0x1234, "q", itemsize=2) == (0x1234, None)
    assert buffers.device_ptr(np.int64(0x1234), "q", itemsize=2) == (0x1234, None)
    assert buffers.device_ptr(FakeCAI((4, 16, 576), "<u2", 0x2000), "q", itemsize=2,
                             shape=(4, 16, 576)) == (0x2000, (4, 16, 576))
    # explicit C-contiguous strides are fine too, and None extents match anything
    assert buffers.device_ptr(FakeCAI((3, 4), "<f4", 0x10, strides=(16, 4)), "lse", itemsize=4,
                             shape=(None, 4), kinds="f") == (0x10, (3, 4))


@pytest.mark.parametrize(
    "obj, kwargs, exc, words",
    [
        (0, {}, ValueError, "q: expected a non-null"),
        (-5, {}, ValueError, "non-null"),
        (True, {}, TypeError, "device address"),  # a bool is not an address
        (np.zeros((4, 16, 576), np.uint16), {}, TypeError, "host numpy array"),
        ("0x10", {}, TypeError, "device address"),
        (FakeCAI((4, 16, 576), "<f4"), {}, TypeError, "2-byte"),
        (FakeCAI((4, 16, 576), "<f2"), {}, TypeError, "2-byte raw"),  # IEEE half is not bf16
        (FakeCAI((4, 16, 512), "<u2"), {"shape": (4, 16, 576)}, ValueError, "expected shape"),
        (FakeCAI((16, 576), "<u2"), {"shape": (4, 16, 576)}, ValueError, "expected shape"),
        (FakeCAI((4, 16, 576), "<u2", strides=(2, 8, 128)), {"shape": (4, 16, 576)}, ValueError,
         "C-contiguous"),
        (FakeCAI((4, 16, 576), "<u2", ptr=0), {}, ValueError, "null data"),
        # the kernel's 64-bit pointer field would wrap these to other addresses
        (FakeCAI((4, 16, 576), "<u2", ptr=2**64 + 16), {}, ValueError, "pointer 0x10000000000000010 is not"),
        (FakeCAI((4, 16, 576), "<u2", ptr=-16), {}, ValueError, "data pointer -0x10 is not a 64-bit"),
        (FakeCAI((4, 16, 576), ">u2"), {}, TypeError, "big-endian"),
    ],
)
def test_device_ptr_rejects_bad_buffers(obj, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        buffers.device_ptr(obj, "q", itemsize=2, **kwargs)


def test_device_ptr_checks_alignment():
    with pytest.raises(ValueError, match="kv: device address 0x1008 is not 16-byte aligned"):
        buffers.device_ptr(0x1008, "kv", itemsize=1, align=16)
    with pytest.raises(ValueError, match="q: device address"):
        buffers.device_ptr(FakeCAI((1, 16, 576), "<u2", 0x1002), "q", itemsize=2, align=16)
    assert buffers.device_ptr(0x1001, "kv_scale", itemsize=1, align=1) == (0x1001, None)
    # an empty buffer may have a null pointer and any strides (nothing is ever read through
    # it): contiguous, as torch and numpy call it
    assert buffers.device_ptr(FakeCAI((0,), "<i4", 0), "kv_indices", itemsize=4, kinds="i") == (0, (0,))
    assert buffers.device_ptr(FakeCAI((0, 24), "|u1", 0x10, strides=(1, 7)), "kv_scale", itemsize=1,
                             align=1) == (0x10, (0, 24))


def test_buffer_key_is_what_the_buffer_is_not_which_object():
    key = buffers.buffer_key
    a = FakeCAI((2, 16, 576), "<u2", 0x1000)
    assert key(a) == key(FakeCAI((2, 16, 576), "<u2", 0x1000))  # another view, same memory
    assert key(a) == key(FakeCAI([2, 16, 576], "<u2", 0x1000))  # a list shape is the same shape
    for other in (FakeCAI((2, 16, 576), "<u2", 0x2000),  # address
                  FakeCAI((2, 16, 576), "<i2", 0x1000),  # typestr
                  FakeCAI((2, 16, 576), "<u2", 0x1000, strides=(18432, 1152, 2)),  # strides
                  FakeCAI((1, 32, 576), "<u2", 0x1000)):  # shape
        assert key(a) != key(other)
    assert key(None) is None and key(0x1000) == 0x1000
    # Not a buffer: a fresh key every time, so the full check always runs (and says what it is).
    assert key("x") != key("x")
    assert key(np.zeros(4)) != key(np.zeros(4))


def test_buffer_key_of_device_arrays_uses_their_fields():
    # Over someone else's address: nothing is allocated, so no GPU is needed.
    a = runtime.DeviceArray((2, 16, 576), np.uint16, ptr=0x1000)
    assert buffers.buffer_key(a) == buffers.buffer_key(runtime.DeviceArray((2, 16, 576), np.uint16, ptr=0x1000))
    assert buffers.buffer_key(a) != buffers.buffer_key(runtime.DeviceArray((2, 16, 576), np.int16, ptr=0x1000))
    assert buffers.buffer_key(a) != buffers.buffer_key(runtime.DeviceArray((2, 16, 576), np.uint16, ptr=0x2000))


def test_buffer_key_of_a_tensor_skips_its_interface():
    reads = Counter()

    class Tensor:
        """torch.Tensor's shape: cheap accessors, and an interface dict built on each read."""

        def __init__(self, ptr: int, shape: tuple, stride: tuple):
            self._ptr, self.shape, self._stride, self.dtype = ptr, shape, stride, "bfloat16"

        def data_ptr(self) -> int:
            return self._ptr

        def is_contiguous(self) -> bool:
            return self._stride == tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

        @property
        def __cuda_array_interface__(self) -> dict:
            reads["cai"] += 1
            return {"shape": self.shape, "typestr": "<u2", "data": (self._ptr, False),
                    "strides": None, "version": 3}

        def __eq__(self, other):  # elementwise, like a tensor's
            raise RuntimeError("elementwise == called")

        __hash__ = object.__hash__

    t = Tensor(0x1000, (2, 16, 576), (9216, 576, 1))
    first = buffers.buffer_key(t)
    seen = reads["cai"]  # choosing the keyer for a new type may look at the interface once
    second = buffers.buffer_key(Tensor(0x1000, (2, 16, 576), (9216, 576, 1)))
    assert reads["cai"] == seen, "the per-step key of a tensor must not build its interface dict"
    assert first == second
    assert buffers.buffer_key(Tensor(0x1000, (2, 16, 576), (576, 9216, 1))) != first
    assert buffers.buffer_key(Tensor(0x1010, (2, 16, 576), (9216, 576, 1))) != first
