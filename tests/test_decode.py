"""The decoder API on the CPU: argument checks, launch shapes and the no-host-work
contract of a step, through a faked runtime that records every launch and counts every
allocation, memset, copy, synchronization and free. Decoding on a GPU against the
emulator and the exact reference is ``tests/test_decode_gpu.py``."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
import types
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from hipmla import buffers, decode, kernels, runtime
from hipmla.emulate import LOG2E
from hipmla.paging import PAGE_SIZES, random_page_table

H, D_QK, D_V = kernels.HEADS, kernels.D_QK, kernels.D_V
#: Compute units of the faked device. Odd on purpose: a split target of 38 can only
#: come from 19 CUs x 2 items, not from some other constant that happens to match.
NUM_CUS = 19
#: Argument addresses of the standard buffers, 16-byte aligned and far from the fake
#: allocator's (which starts at 1 << 32), so a test can tell them apart.
ADDR = dict(q=0x100000, kv=0x200000, kv_indptr=0x300000, out=0x400000, kv_scale=0x500000,
            lse=0x600000, kv_indices=0x700000, kv_last_page_len=0x800000)


class FakeCAI:
    def __init__(self, shape, typestr, ptr=0x1000, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3}


# ----------------------------------------------------------------------------- configuration
# (device_ptr and buffer_key themselves: tests/test_buffers.py)


def test_decoder_config_validates():
    with pytest.raises(ValueError, match="kv_format"):
        decode.DecoderConfig("int4", 0.1)
    with pytest.raises(ValueError, match="q_precision"):
        decode.DecoderConfig("mxfp4", 0.1, q_precision="fp16")
    with pytest.raises(ValueError, match="q_precision"):
        decode.DecoderConfig("mxfp4", 0.1, q_precision="auto")  # the config holds a resolved one
    with pytest.raises(ValueError, match="sm_scale"):
        decode.DecoderConfig("mxfp4", -1.0)
    with pytest.raises(ValueError, match="heads"):
        decode.DecoderConfig("mxfp4", 0.1, heads=48)
    assert [decode.DecoderConfig("mxfp4", 0.1, heads=h).heads for h in (8, 16, 32, 64, 128)] == [8, 16, 32, 64, 128]


def test_fp8_variant_follows_arch():
    assert decode.fp8_variant_for("gfx942") == "e4m3fnuz"
    assert decode.fp8_variant_for("gfx942:sramecc+:xnack-") == "e4m3fnuz"
    assert decode.fp8_variant_for("gfx950") == "e4m3fn"
    assert decode.fp8_variant_for("sm_90") == "e4m3fn"


def test_auto_q_precision_is_the_fast_kernels_where_there_is_one():
    assert decode.resolve_q_precision("auto", "gfx950", "mxfp4") == "bf16"  # proven instructions
    assert decode.resolve_q_precision("fp8", "gfx950", "mxfp4") == "fp8"  # opt-in
    assert decode.resolve_q_precision("auto", "gfx950", "bf16") == "bf16"
    assert decode.resolve_q_precision("auto", "gfx942", "mxfp4") == "bf16"  # its fast kernel takes bf16 Q
    assert decode.resolve_q_precision("auto", "sm_90", "mxfp4") == "bf16"
    assert decode.resolve_q_precision("mxfp4", "sm_90", "mxfp4") == "mxfp4"
    with pytest.raises(ValueError, match="q_precision"):
        decode.resolve_q_precision("fp16", "gfx950", "mxfp4")


# ----------------------------------------------------------------------------- buffer keys in a step


def test_a_strided_tensor_over_memory_that_passed_is_checked_again(monkeypatch):
    class Tensor(FakeCAI):
        """torch's way: the interface has strides only when the tensor is not contiguous."""

        def __init__(self, shape, ptr, strides=None):
            super().__init__(shape, "<u2", ptr, strides)
            self.shape, self.dtype = shape, "uint16"

        def data_ptr(self):
            return self.__cuda_array_interface__["data"][0]

        def is_contiguous(self):
            return self.__cuda_array_interface__["strides"] is None

    gpu, dec = make(monkeypatch)
    prepares = count_prepares(monkeypatch, dec)
    dec.run(**args(q=Tensor((2, H, D_QK), ADDR["q"])))
    with pytest.raises(ValueError, match="^q: expected a C-contiguous buffer"):
        dec.run(**args(q=Tensor((2, H, D_QK), ADDR["q"], strides=(H * D_QK * 2, 2, H * 2))))
    dec.run(**args(q=Tensor((2, H, D_QK), ADDR["q"])))
    assert len(gpu.launches) == 2 and len(prepares) == 3


# ----------------------------------------------------------------------------- the faked runtime


@dataclass(frozen=True)
class Launch:
    """One enqueued kernel: its launch shape and every DecodeParams field as it was bound."""

    symbol: str
    grid: tuple
    block: tuple
    shared: int
    stream: object
    params: dict

    def __getattr__(self, name):  # launch.batch, launch.q, launch.part_acc, ...
        try:
            return self.__dict__["params"][name]
        except KeyError:
            raise AttributeError(name) from None


def _fields(args: ctypes.Structure) -> dict:
    # A null c_void_p reads back as None; the kernel sees 0.
    return {name: (0 if (v := getattr(args, name)) is None else v) for name, _ in args._fields_}


class FakeFunction:
    def __init__(self, gpu: FakeGPU, symbol: str):
        self.gpu, self.symbol = gpu, symbol

    def bind(self, args):
        assert isinstance(args, kernels.DecodeParams), type(args)
        return FakeBound(self, args)


class FakeBound:
    """runtime.BoundLaunch: ``prepare`` resolves the launch, calling the result enqueues it."""

    def __init__(self, function: FakeFunction, args: kernels.DecodeParams):
        self.function, self.args = function, args
        self.fields = _fields(args)  # copied now

    def prepare(self, grid, block, shared=0, stream=None):
        assert len(grid) == 3 and min(grid) >= 1, grid
        assert len(block) == 3 and min(block) >= 1 and math.prod(block) <= 1024, block
        gpu = self.function.gpu

        def launch() -> None:
            # The real runtime reads the struct when the launch is enqueued: a bound
            # struct that changed since it was bound would launch other arguments.
            assert _fields(self.args) == self.fields, "a bound parameter struct was edited"
            gpu.launches.append(Launch(self.function.symbol, tuple(grid), tuple(block), shared,
                                       stream, dict(self.fields)))

        return launch


class FakeGPU:
    """What the decoder did to the device: launches in order, and a count of every
    host-side runtime call that a decode step must not make."""

    HOST_CALLS = ("alloc", "memset", "synchronize", "copy_htod", "copy_dtoh", "copy_dtod", "free")

    def __init__(self):
        self.launches: list[Launch] = []
        self.calls: Counter = Counter()
        self.memsets: list[tuple[int, int, int]] = []
        self.buffers: list = []  # every allocation, in order
        self.functions: dict[str, FakeFunction] = {}
        self._next = 1 << 32

    def host_calls(self) -> dict:
        return {name: self.calls[name] for name in self.HOST_CALLS if self.calls[name]}

    def reset(self) -> None:
        self.launches.clear()
        self.calls.clear()
        self.memsets.clear()

    def address(self, nbytes: int) -> int:
        ptr, self._next = self._next, self._next + max(nbytes, 1) + 0x10000 & ~0xFFFF
        return ptr


def fake_runtime(monkeypatch, arch: str, num_cus: int = NUM_CUS, platform: str = "amd") -> FakeGPU:
    """Fake the runtime under a Decoder: launches are recorded, nothing touches a GPU."""

    gpu = FakeGPU()
    info = runtime.DeviceInfo(index=0, name="fake", arch=arch, arch_full=arch, platform=platform,
                              num_cus=num_cus, warp_size=64, max_shared_per_block=65536,
                              shared_optin=65536, total_mem=1 << 34, l2_bytes=1 << 22, mem_clock_khz=0,
                              mem_bus_bits=0, pci_bus_id=0, peak_bandwidth_gbs=0.0)

    class FakeBuffer:
        def __init__(self, nbytes: int):
            gpu.calls["alloc"] += 1
            self.ptr, self.nbytes = gpu.address(nbytes), nbytes
            gpu.buffers.append(self)

        def free(self) -> None:
            gpu.calls["free"] += 1
            assert self.ptr, "double free"
            self.ptr = 0

    class FakeArray(runtime.DeviceArray):  # the real interface and free(), over fake memory
        def __init__(self, shape, dtype, buffer=None, ptr=None):
            self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
            self.nbytes = math.prod(self.shape) * self.dtype.itemsize
            self.buffer = FakeBuffer(self.nbytes) if buffer is None and ptr is None else buffer
            self.ptr = self.buffer.ptr if self.buffer is not None else ptr

        @classmethod
        def from_host(cls, arr, stream=None):
            out = cls(arr.shape, arr.dtype)
            runtime.copy_htod(out.ptr, arr, stream)
            return out

        def to_host(self, stream=None):
            host = np.zeros(self.shape, self.dtype)
            runtime.copy_dtoh(host, self.ptr, stream)
            return host

    def counted(name: str):
        def call(*args, **kwargs) -> None:
            gpu.calls[name] += 1

        return call

    def memset(ptr: int, value: int, nbytes: int, stream=None) -> None:
        gpu.calls["memset"] += 1
        gpu.memsets.append((ptr, value, nbytes))

    def load_kernel(spec: kernels.KernelSpec, arch_: str) -> FakeFunction:
        assert spec.builds_for(arch_), f"{spec.symbol} does not build for {arch_}"
        return gpu.functions.setdefault(spec.symbol, FakeFunction(gpu, spec.symbol))

    monkeypatch.setattr(runtime, "device_info", lambda index=0: info)
    monkeypatch.setattr(runtime, "use_device", lambda index: None)
    monkeypatch.setattr(runtime, "synchronize", counted("synchronize"))
    for copy in ("copy_htod", "copy_dtoh", "copy_dtod"):
        monkeypatch.setattr(runtime, copy, counted(copy))
    monkeypatch.setattr(runtime, "memset", memset)
    monkeypatch.setattr(runtime, "alloc", FakeBuffer)
    monkeypatch.setattr(runtime, "DeviceArray", FakeArray)
    monkeypatch.setattr(runtime, "load_kernel", load_kernel)
    return gpu


def make(monkeypatch, arch: str = "sm_90", kv_format: str = "mxfp4", **kwargs) -> tuple[FakeGPU, decode.Decoder]:
    gpu = fake_runtime(monkeypatch, arch)
    return gpu, decode.Decoder(kv_format, 1 / 24, **kwargs)


def count_prepares(monkeypatch, dec: decode.Decoder) -> list:
    """Every call of the argument check + launch build; run() on a known key skips it."""
    calls = []
    real = dec._prepare
    monkeypatch.setattr(dec, "_prepare", lambda *a: (calls.append(a), real(*a))[1])
    return calls


def args(b: int = 2, rows: int = 400, kv_format: str = "mxfp4", **over) -> dict:
    """run() keywords for a valid step over the standard addresses: fresh objects each
    call, like the new tensor views a serving loop hands over every step."""
    cols, typestr = {"mxfp4": (D_QK // 2, "|u1"), "fp8": (D_QK, "|u1"), "bf16": (D_QK, "<u2")}[kv_format]
    a = dict(q=FakeCAI((b, H, D_QK), "<u2", ADDR["q"]), kv=FakeCAI((rows, cols), typestr, ADDR["kv"]),
             kv_indptr=FakeCAI((b + 1,), "<i4", ADDR["kv_indptr"]),
             out=FakeCAI((b, H, D_V), "<u2", ADDR["out"]))
    if kv_format == "mxfp4":
        a["kv_scale"] = FakeCAI((rows, 24), "|u1", ADDR["kv_scale"])
    if kv_format == "fp8":
        a["fp8_scale"] = 0.5
    a.update(over)
    return a


def paged(b: int = 2, pages: int = 64, **over) -> dict:
    """A page table over the standard addresses (contents are the device's business)."""
    return {"kv_indices": FakeCAI((pages,), "<i4", ADDR["kv_indices"]),
            "kv_last_page_len": FakeCAI((b,), "<i4", ADDR["kv_last_page_len"]), **over}


# ----------------------------------------------------------------------------- launches


@pytest.mark.parametrize("b", [1, 3, 64])
def test_one_launch_per_run_over_the_whole_schedule_without_a_fast_kernel(monkeypatch, b):
    gpu, dec = make(monkeypatch, "sm_90", max_batch=64)
    assert dec._fast is None
    dec.run(**args(b, lse=FakeCAI((b, H), "<f4", ADDR["lse"])))
    dec.run(**args(b, lse=FakeCAI((b, H), "<f4", ADDR["lse"])))
    assert len(gpu.launches) == 2  # one per run, nothing else (no combine kernel any more)
    for launch in gpu.launches:
        assert launch.symbol == dec._split.symbol
        # The grid is the most items any batch of b gets, so it depends on b alone and
        # a graph of one step replays for every later step of that batch size.
        assert launch.grid == (dec.policy.max_items(b), 1, 1) == (2 * NUM_CUS + b, 1, 1)
        assert launch.block == (kernels.BLOCK_THREADS, 1, 1) == (256, 1, 1)
        assert launch.split_target == NUM_CUS * 2 and launch.fast_tile == 0
        assert launch.split_min_tokens == 128 and launch.split_align == 128
        assert launch.split_max_ranges == 16 and launch.split_long_range == 512
        assert launch.batch == b and launch.stream is None
        assert (launch.q, launch.kv, launch.kv_indptr, launch.out, launch.kv_scale, launch.lse) == \
            (ADDR["q"], ADDR["kv"], ADDR["kv_indptr"], ADDR["out"], ADDR["kv_scale"], ADDR["lse"])
        assert launch.stride_kv_scale == 24 and launch.kv_fp8_scale == 1.0
        assert (launch.kv_indices, launch.kv_last_page_len, launch.page_shift) == (0, 0, 0)
        assert launch.sm_scale_log2 == pytest.approx(float(np.float32(1 / 24)) * LOG2E, rel=1e-7)
        assert launch.part_acc == dec._scratch.ptr and launch.counters > launch.part_ml > launch.part_acc


def test_grid_follows_the_batch(monkeypatch):
    gpu, dec = make(monkeypatch, "sm_90", max_batch=16)
    for b in (16, 1, 7):
        dec.run(**args(b))
    assert [(l.grid[0], l.batch) for l in gpu.launches] == [(2 * NUM_CUS + b, b) for b in (16, 1, 7)]


@pytest.mark.parametrize("arch, kv_format, q_precision", [
    ("gfx950", "mxfp4", "bf16"),  # auto Q: bf16, on the instructions the seed ran
    ("gfx942", "mxfp4", "bf16"),  # the bf16 MFMA takes every cache, bf16 Q only
    ("gfx942", "fp8", "bf16"),
])
def test_fast_arch_launches_only_its_fast_kernel(monkeypatch, arch, kv_format, q_precision):
    """The AMD fast kernels mask partial tiles themselves: one launch takes every item,
    and the portable kernel is not even loaded for the variant."""
    gpu, dec = make(monkeypatch, arch, kv_format)  # q_precision "auto"
    assert dec.config.q_precision == q_precision and dec._fast is not None
    assert dec._split is dec._fast and list(gpu.functions) == [dec._fast.symbol]
    for _ in range(2):
        dec.run(**args(4, kv_format=kv_format))
    assert [l.symbol for l in gpu.launches] == [dec._fast.symbol] * 2
    fast = gpu.launches[0]
    assert fast.grid == (dec.policy.max_items(4), 1, 1) == (2 * NUM_CUS + 4, 1, 1)
    assert fast.fast_tile == 0 and fast.split_target == NUM_CUS * 2 and fast.batch == 4
    assert fast.block == (256, 1, 1)
    # gfx950: a wave's quarter of the 128-token tile; gfx942: the block's 16-token tile
    assert dec.tile_tokens == {"gfx950": 32, "gfx942": 16}[arch]


def test_a_bf16_cache_on_gfx950_has_no_fast_kernel(monkeypatch):
    gpu, dec = make(monkeypatch, "gfx950", "bf16")  # the gfx950 fast kernel reads MXFP4 only
    assert dec._fast is None
    dec.run(**args(4, kv_format="bf16"))
    assert [(l.symbol, l.grid, l.fast_tile) for l in gpu.launches] == \
        [(dec._split.symbol, (2 * NUM_CUS + 4, 1, 1), 0)]


def test_raw_addresses_launch_like_interfaces(monkeypatch):
    gpu, dec = make(monkeypatch)
    dec.run(ADDR["q"], ADDR["kv"], ADDR["kv_indptr"], ADDR["out"], batch=4, kv_scale=ADDR["kv_scale"],
            kv_scale_stride=24)
    (launch,) = gpu.launches
    assert launch.batch == 4 and launch.grid == (dec.policy.max_items(4), 1, 1)
    assert (launch.q, launch.kv, launch.kv_indptr, launch.out, launch.kv_scale, launch.stride_kv_scale) == \
        (ADDR["q"], ADDR["kv"], ADDR["kv_indptr"], ADDR["out"], ADDR["kv_scale"], 24)
    with pytest.raises(ValueError, match="^batch:"):  # a raw q says nothing about the batch
        dec.run(ADDR["q"], ADDR["kv"], ADDR["kv_indptr"], ADDR["out"], kv_scale=ADDR["kv_scale"],
                kv_scale_stride=24)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="^batch:"):
            dec.run(ADDR["q"], ADDR["kv"], ADDR["kv_indptr"], ADDR["out"], batch=bad,
                    kv_scale=ADDR["kv_scale"], kv_scale_stride=24)
    assert len(gpu.launches) == 1


def test_changing_the_decoders_stream_takes_effect(monkeypatch):
    gpu, dec = make(monkeypatch)
    dec.stream = 111
    dec.run(**args())
    dec.stream = 222
    dec.run(**args())
    dec.run(**args(), stream=333)
    dec.run(**args())
    assert [l.stream for l in gpu.launches] == [111, 222, 333, 222]


def test_a_closed_stream_is_refused_also_after_a_step_ran_on_it(monkeypatch):
    """A step enqueued on a destroyed handle is lost work (or another stream's, once the
    handle is reused): refused before the launch, also when the same arguments skipped
    the checks the step before."""
    gpu, dec = make(monkeypatch)
    monkeypatch.setattr(runtime, "hip", types.SimpleNamespace(hipStreamCreate=lambda: (0, 0xBEEF),
                                                              hipStreamDestroy=lambda h: (0,)))
    stream = runtime.Stream()
    dec.run(**args(), stream=stream)
    stream.close()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^stream: this hipmla.runtime.Stream was closed"):
            dec.run(**args(), stream=stream)
    dec.stream = stream  # as the decoder's own stream too
    with pytest.raises(ValueError, match=r"^stream: .*closed"):
        dec.run(**args())
    with pytest.raises(ValueError, match=r"^stream: .*closed"):
        runtime.streams._stream_handle(stream)
    assert len(gpu.launches) == 1 and runtime.Stream.null().closed is False


def test_launches_get_their_own_copy_of_the_parameters(monkeypatch):
    gpu, dec = make(monkeypatch)
    dec.run(**args())
    # Editing the decoder's own struct (as reserve() and the next prepare do) must not
    # reach a launch that was already built: FakeBound asserts its struct is unchanged.
    dec._params.q = 0xDEAD0
    dec._params.batch = 99
    dec.run(**args())
    assert [l.q for l in gpu.launches] == [ADDR["q"]] * 2 and gpu.launches[1].batch == 2


# ----------------------------------------------------------------------------- no host work


def test_steps_do_no_host_work_and_check_arguments_once(monkeypatch):
    gpu, dec = make(monkeypatch, max_batch=8)
    prepares = count_prepares(monkeypatch, dec)
    gpu.reset()  # construction allocated the scratch and zeroed the counters
    for _ in range(200):
        dec.run(**args(8, lse=FakeCAI((8, H), "<f4", ADDR["lse"])))  # new objects, same buffers
    assert gpu.host_calls() == {}, "a step must not allocate, memset, copy, synchronize or free"
    assert len(prepares) == 1
    assert len(gpu.launches) == 200 and len({tuple(sorted(l.params.items())) for l in gpu.launches}) == 1
    # Another output buffer is another argument set: checked and built again, once.
    for _ in range(3):
        dec.run(**args(8, out=FakeCAI((8, H, D_V), "<u2", 0x900000)))
    assert len(prepares) == 2 and gpu.launches[-1].out == 0x900000 and gpu.launches[-1].lse == 0
    dec.run(**args(8))  # and back: the decoder keeps the last set only
    assert len(prepares) == 3 and gpu.launches[-1].out == ADDR["out"]
    assert gpu.host_calls() == {}


def test_paged_steps_with_new_page_table_contents_never_check_again(monkeypatch):
    gpu, dec = make(monkeypatch, max_batch=4)
    prepares = count_prepares(monkeypatch, dec)
    gpu.reset()
    b, page, pool = 4, 16, 64
    # Host arrays posing as device memory: the page table changes in place every step,
    # as a serving loop's does. The decoder may not read it (on a GPU that would be a
    # copy and a sync) and must not key on it: the kernels read it on the device.
    indptr, indices, last = np.zeros(b + 1, np.int32), np.zeros(pool, np.int32), np.ones(b, np.int32)
    view = lambda a: FakeCAI(a.shape, a.dtype.str, a.ctypes.data)  # noqa: E731
    rng = np.random.default_rng(5)
    for _ in range(50):
        layout = random_page_table(rng.integers(0, 200, b), page, rng)
        indptr[:] = layout.kv_indptr
        indices[: layout.kv_indices.size] = layout.kv_indices
        last[:] = layout.kv_last_page_len
        dec.run(**args(b, rows=pool * page, kv_indptr=view(indptr)), kv_indices=view(indices),
                kv_last_page_len=view(last), page_size=page)
    assert len(prepares) == 1 and gpu.host_calls() == {}
    assert len(gpu.launches) == 50
    assert {(l.kv_indptr, l.kv_indices, l.kv_last_page_len, l.page_shift) for l in gpu.launches} == \
        {(indptr.ctypes.data, indices.ctypes.data, last.ctypes.data, 4)}


# ----------------------------------------------------------------------------- page tables


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_size_becomes_a_shift(monkeypatch, page_size):
    gpu, dec = make(monkeypatch)
    dec.run(**args(), **paged(), page_size=page_size)
    (launch,) = gpu.launches
    assert 1 << launch.page_shift == page_size
    assert (launch.kv_indices, launch.kv_last_page_len) == (ADDR["kv_indices"], ADDR["kv_last_page_len"])


@pytest.mark.parametrize("call, exc, words", [
    (lambda: dict(**paged(), page_size=3), ValueError, "^page_size:"),
    (lambda: dict(**paged(), page_size=256), ValueError, "^page_size:"),
    (lambda: dict(**paged(), page_size=0), ValueError, "^page_size:"),
    (lambda: dict(**paged(), page_size=-16), ValueError, "^page_size:"),
    (lambda: dict(**paged(), page_size=True), ValueError, "^page_size:"),
    (lambda: dict(**paged(), page_size=16.0), ValueError, "^page_size:"),
    (lambda: dict(page_size=16), ValueError, "^page_size:"),  # no page table to page
    (lambda: dict(kv_indices=paged()["kv_indices"]), ValueError, "^kv_indices/kv_last_page_len:"),
    (lambda: dict(kv_last_page_len=paged()["kv_last_page_len"], page_size=16), ValueError,
     "^kv_indices/kv_last_page_len:"),
    (lambda: paged(kv_indices=FakeCAI((64,), "<i8", ADDR["kv_indices"])), TypeError, "^kv_indices:"),
    (lambda: paged(kv_indices=FakeCAI((64,), "<u4", ADDR["kv_indices"])), TypeError, "^kv_indices:"),
    (lambda: paged(kv_indices=FakeCAI((8, 8), "<i4", ADDR["kv_indices"])), ValueError, "^kv_indices:"),
    (lambda: paged(kv_indices=np.zeros(64, np.int32)), TypeError, "^kv_indices:"),
    (lambda: paged(kv_last_page_len=FakeCAI((3,), "<i4", ADDR["kv_last_page_len"])), ValueError,
     "^kv_last_page_len:"),
    (lambda: paged(kv_last_page_len=FakeCAI((2, 1), "<i4", ADDR["kv_last_page_len"])), ValueError,
     "^kv_last_page_len:"),
    (lambda: paged(kv_last_page_len=FakeCAI((2,), "<f4", ADDR["kv_last_page_len"])), TypeError,
     "^kv_last_page_len:"),
], ids=["3", "256", "0", "-16", "True", "16.0", "no-table", "no-last", "no-indices", "indices-i8",
        "indices-u4", "indices-2d", "indices-host", "last-shape", "last-2d", "last-f4"])
def test_bad_page_tables_raise_before_any_launch(monkeypatch, call, exc, words):
    gpu, dec = make(monkeypatch)
    with pytest.raises(exc, match=words):
        dec.run(**args(), **call())
    assert gpu.launches == []


# ----------------------------------------------------------------------------- capacity


def scratch_layout(dec: decode.Decoder, max_batch: int) -> tuple[int, int, int]:
    """(part_ml - part_acc, counters - part_acc, bytes) the kernels' params.h layout
    needs: an f32 accumulator and (m, l) pair per head per slot, two int32 merge counters
    per sequence (core/merge.h), the error word (and a word of padding)."""
    slots = dec.policy.max_items(max_batch)
    acc, ml = slots * H * D_V * 4, slots * H * 2 * 4
    return acc, acc + ml, acc + ml + (2 * max_batch + 2) * 4


@pytest.mark.parametrize("platform, placement", [("nvidia", True), ("nvidia", False), ("amd", True)])
def test_placement_words_follow_the_counters_on_nvidia(monkeypatch, platform, placement):
    # core/placement.h: a block knows its SM on NVIDIA only; the words start at zero once
    gpu = fake_runtime(monkeypatch, "sm_90", platform=platform)
    dec = decode.Decoder("mxfp4", 1 / 24, max_batch=4, placement=placement)
    (scratch,) = gpu.buffers
    _, counters_off, nbytes = scratch_layout(dec, 4)
    on = platform == "nvidia" and placement
    # 10 words of counters and error word, padded to 12: the placement words are 16-byte aligned
    words = 12 + kernels.placement_words(NUM_CUS) if on else 2 * 4 + 2
    assert kernels.placement_words(NUM_CUS) == 4 + 20  # 19 SM words padded to 20
    assert scratch.nbytes >= counters_off + 4 * words
    assert gpu.memsets == [(scratch.ptr + counters_off, 0, words * 4)]
    dec.run(**args(4))
    launch = gpu.launches[-1]
    if on:
        assert launch.placement == scratch.ptr + counters_off + 12 * 4 and launch.placement % 16 == 0
        assert launch.placement_sms == NUM_CUS
    else:
        assert not launch.placement and launch.placement_sms == 0


@pytest.mark.parametrize("platform, placement", [("nvidia", True), ("nvidia", False), ("amd", True)])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "mxfp4"])
def test_lone_split_runs_where_the_placement_does(monkeypatch, platform, placement, kv_format):
    # hipmla.schedule's lone split (one item an SM for short items) is measured with the
    # placement only; its threshold is the format's, and the launch carries it.
    gpu = fake_runtime(monkeypatch, "sm_90", platform=platform)
    dec = decode.Decoder(kv_format, 1 / 24, max_batch=4, placement=placement)
    on = platform == "nvidia" and placement
    assert dec.policy.lone_items == (NUM_CUS if on else 0)
    assert dec.policy.lone_below_tokens == {"mxfp4": 256}.get(kv_format, 1024)
    want = (dec.policy.lone_items, dec.policy.lone_below_tokens, 32)
    p = dec._params
    assert (p.split_lone_items, p.split_lone_below, p.split_lone_max_ranges) == want
    if kv_format == "mxfp4":  # (args() makes an MXFP4 step)
        dec.run(**args(4))
        launch = gpu.launches[-1]
        assert (launch.split_lone_items, launch.split_lone_below, launch.split_lone_max_ranges) == want


def test_placement_must_be_a_bool(monkeypatch):
    gpu = fake_runtime(monkeypatch, "sm_90", platform="nvidia")
    with pytest.raises(TypeError, match="^placement: expected a bool, got int 1"):
        decode.Decoder("mxfp4", 1 / 24, placement=1)
    assert gpu.calls["alloc"] == 0


@pytest.mark.parametrize("platform", ["nvidia", "amd"])
def test_the_fit_is_asked_for_and_nvidia_only(monkeypatch, platform):
    # On by default on NVIDIA, off on AMD, whose kernels do not build it: asking there is an
    # error, not a host model the device disagrees with. The launch carries it.
    gpu = fake_runtime(monkeypatch, "sm_90", platform=platform)
    assert decode.Decoder("mxfp4", 1 / 24, max_batch=4).policy.fit is (platform == "nvidia")
    assert decode.Decoder("mxfp4", 1 / 24, max_batch=4, fit=False).policy.fit is False
    with pytest.raises(TypeError, match="^fit: expected a bool, got int 1"):
        decode.Decoder("mxfp4", 1 / 24, fit=1)
    if platform == "amd":
        with pytest.raises(ValueError, match="^fit: only the NVIDIA kernels"):
            decode.Decoder("mxfp4", 1 / 24, fit=True)
        return
    dec = decode.Decoder("mxfp4", 1 / 24, max_batch=4, fit=True)
    assert dec.policy.fit is True and dec._params.split_fit == 1
    dec.run(**args(4))
    assert gpu.launches[-1].split_fit == 1


def test_reserve_sizes_the_scratch_once_and_grows_only(monkeypatch):
    gpu, dec = make(monkeypatch, max_batch=4)
    assert dec.max_batch == 4 and gpu.calls["alloc"] == 1
    (scratch,) = gpu.buffers
    ml_off, counters_off, nbytes = scratch_layout(dec, 4)
    assert scratch.nbytes == dec.scratch_bytes >= nbytes
    assert gpu.memsets == [(scratch.ptr + counters_off, 0, (2 * 4 + 2) * 4)]  # counters and error word start at 0
    dec.run(**args(4))
    launch = gpu.launches[-1]
    assert (launch.part_acc, launch.part_ml, launch.counters) == \
        (scratch.ptr, scratch.ptr + ml_off, scratch.ptr + counters_off)

    gpu.reset()
    with pytest.raises(ValueError, match=r"^batch: 5 .*reserve\(5\)"):
        dec.run(**args(5))
    assert gpu.launches == [] and gpu.host_calls() == {}  # no growing behind the caller's back

    dec.run(**args(4))  # cached again, with the scratch reserve() is about to free
    gpu.reset()
    dec.reserve(16)
    assert gpu.calls["alloc"] == 1 and gpu.calls["free"] == 1 and scratch.ptr == 0  # old one freed
    grown = gpu.buffers[-1]
    ml_off, counters_off, nbytes = scratch_layout(dec, 16)
    assert dec.max_batch == 16 and grown.nbytes == dec.scratch_bytes >= nbytes
    assert gpu.memsets == [(grown.ptr + counters_off, 0, (2 * 16 + 2) * 4)]
    # the very step that was cached before must now use the new scratch
    dec.run(**args(4))
    dec.run(**args(5))
    for launch in gpu.launches:
        assert (launch.part_acc, launch.part_ml, launch.counters) == \
            (grown.ptr, grown.ptr + ml_off, grown.ptr + counters_off)

    gpu.reset()
    for smaller in (16, 8, 1, np.int64(3)):
        dec.reserve(smaller)
    assert gpu.host_calls() == {} and dec.max_batch == 16 and dec.scratch_bytes == grown.nbytes


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8", None, 2**31])
def test_max_batch_must_be_a_positive_integer(monkeypatch, bad):
    gpu = fake_runtime(monkeypatch, "sm_90")
    with pytest.raises(ValueError, match="^max_batch:"):
        decode.Decoder("mxfp4", 1 / 24, max_batch=bad)
    dec = decode.Decoder("mxfp4", 1 / 24, max_batch=2)
    gpu.reset()
    with pytest.raises(ValueError, match="^max_batch:"):
        dec.reserve(bad)
    assert gpu.host_calls() == {} and dec.max_batch == 2


def test_a_scratch_larger_than_the_device_is_refused_before_allocating(monkeypatch):
    gpu = fake_runtime(monkeypatch, "sm_90")  # 16 GiB
    dec = decode.Decoder("mxfp4", 1 / 24, heads=128, max_batch=2)
    gpu.reset()
    with pytest.raises(ValueError, match=r"^max_batch/max_q_tokens: .* GiB of split scratch; the device has 16\.0 GiB"):
        dec.reserve(2**24)
    assert gpu.host_calls() == {} and dec.max_batch == 2
    dec.reserve(4096, 4 * 4096)  # a large serving step still fits
    assert dec.max_batch == 4096


def test_more_slots_than_the_kernels_index_are_refused_on_any_device(monkeypatch):
    # (slot * 16 + head) * 2 is an int in the kernels: a device with memory enough for the
    # scratch must not lift that bound.
    gpu = fake_runtime(monkeypatch, "sm_90")
    dec = decode.Decoder("mxfp4", 1 / 24, heads=128, max_batch=2)
    dec.device = dataclasses.replace(dec.device, total_mem=1 << 50)  # 1 PiB
    assert dec.scratch_layout(2**23, 2**23).slots > decode.MAX_SLOTS >= dec.scratch_layout(2**20, 2**20).slots
    gpu.reset()
    with pytest.raises(ValueError, match=r"^max_batch/max_q_tokens: .* partial slots; the kernels index at most"):
        dec.reserve(2**23)
    assert gpu.host_calls() == {} and dec.max_batch == 2
    assert (decode.MAX_SLOTS * kernels.HEADS + kernels.HEADS - 1) * 2 + 1 <= 2**31 - 1


def test_failed_scratch_growth_keeps_the_old_scratch(monkeypatch):

    gpu, dec = make(monkeypatch, max_batch=4)
    (before,) = gpu.buffers
    dec.run(**args(4))

    def out_of_memory(nbytes):
        raise MemoryError(f"out of memory ({nbytes} bytes)")

    monkeypatch.setattr(runtime, "alloc", out_of_memory)
    gpu.reset()
    with pytest.raises(MemoryError):
        dec.reserve(1 << 12)
    assert gpu.host_calls() == {}  # nothing freed, nothing zeroed
    assert dec._scratch is before and before.ptr and dec.max_batch == 4
    dec.run(**args(4))  # the cached step
    dec.run(**args(3, out=FakeCAI((3, H, D_V), "<u2", 0x900000)))  # and a new one
    assert [l.part_acc for l in gpu.launches] == [before.ptr] * 2
    with pytest.raises(ValueError, match="^batch:"):
        dec.run(**args(5))


def test_close_frees_the_scratch_and_later_runs_refuse(monkeypatch):
    gpu, dec = make(monkeypatch, max_batch=4)
    dec.run(**args(2))
    with dec:
        pass  # leaving the block closes
    assert gpu.calls["free"] == 1 and dec.scratch_bytes == 0 and dec.max_batch == 0
    with pytest.raises(ValueError, match="^batch:.*reserve"):
        dec.run(**args(2))  # the cached launches pointed at the freed scratch
    assert len(gpu.launches) == 1
    dec.close()  # twice is fine
    assert gpu.calls["free"] == 1


# ----------------------------------------------------------------------------- bad arguments


def _sm_scale_cases():
    return [(1e39, ValueError), (1e-50, ValueError), (-1.0, ValueError), (0.0, ValueError),
            (float("nan"), ValueError), (float("inf"), ValueError), (None, TypeError), ("x", TypeError),
            ("0.5", TypeError), (b"0.5", TypeError), (10**400, ValueError)]


def test_an_sm_scale_outside_f32_is_named_with_the_value_that_came(monkeypatch):
    """Not the derived sm_scale * log2(e) alone: the caller passed 3e38 (or 1e-40)."""
    fake_runtime(monkeypatch, "sm_90")
    with pytest.raises(ValueError, match=r"^sm_scale: 3e\+38 times log2\(e\) \(inf as the kernel takes it\) is"):
        decode.Decoder("mxfp4", 3e38)
    with pytest.raises(ValueError, match=r"^sm_scale: 1e-40 times log2\(e\) \("):
        decode.Decoder("mxfp4", 1e-40)


@pytest.mark.parametrize("sm_scale, exc", _sm_scale_cases(), ids=lambda v: repr(v))
def test_bad_sm_scale_raises_at_construction(monkeypatch, sm_scale, exc):
    gpu = fake_runtime(monkeypatch, "sm_90")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the argument's own message, never a numpy warning first
        with pytest.raises(exc, match="^sm_scale:"):
            decode.Decoder("mxfp4", sm_scale)
    assert gpu.calls["alloc"] == 0  # rejected before any scratch is reserved


# (decoder format, run() keywords, exception, argument the message names)
BAD_RUNS = [
    ("mxfp4", lambda: args(q=FakeCAI((2, 8, D_QK), "<u2", ADDR["q"])), ValueError, "q"),
    ("mxfp4", lambda: args(q=FakeCAI((2, H, D_V), "<u2", ADDR["q"])), ValueError, "q"),
    ("mxfp4", lambda: args(q=FakeCAI((2, D_QK), "<u2", ADDR["q"])), ValueError, "q"),
    ("mxfp4", lambda: args(q=FakeCAI((2, H, D_QK), "<u2", ADDR["q"] + 8)), ValueError, "q"),
    ("mxfp4", lambda: args(q=np.zeros((2, H, D_QK), np.uint16), batch=2), TypeError, "q"),
    ("mxfp4", lambda: args(kv=np.zeros((400, 288), np.uint8)), TypeError, "kv"),
    ("mxfp4", lambda: args(kv=FakeCAI((400, 288), "|u1", ADDR["kv"] + 8)), ValueError, "kv"),
    ("mxfp4", lambda: args(kv=FakeCAI((400, 576), "|u1", ADDR["kv"])), ValueError, "kv"),
    ("mxfp4", lambda: args(kv=FakeCAI((400, 288), "<u2", ADDR["kv"])), TypeError, "kv"),
    ("mxfp4", lambda: args(kv_indptr=FakeCAI((3,), "<i8", ADDR["kv_indptr"])), TypeError, "kv_indptr"),
    ("mxfp4", lambda: args(kv_indptr=FakeCAI((3,), "<u4", ADDR["kv_indptr"])), TypeError, "kv_indptr"),
    ("mxfp4", lambda: args(kv_indptr=FakeCAI((2,), "<i4", ADDR["kv_indptr"])), ValueError, "kv_indptr"),
    ("mxfp4", lambda: args(out=FakeCAI((2, H, D_V), "<f4", ADDR["out"])), TypeError, "out"),
    ("mxfp4", lambda: args(out=FakeCAI((2, H, D_QK), "<u2", ADDR["out"])), ValueError, "out"),
    ("mxfp4", lambda: args(lse=FakeCAI((2, H), "<u2", ADDR["lse"])), TypeError, "lse"),
    ("mxfp4", lambda: args(lse=FakeCAI((2, H), "<i4", ADDR["lse"])), TypeError, "lse"),
    ("mxfp4", lambda: args(lse=FakeCAI((3, H), "<f4", ADDR["lse"])), ValueError, "lse"),
    ("mxfp4", lambda: args(kv_scale=None), ValueError, "kv_scale"),
    ("mxfp4", lambda: args(kv_scale=ADDR["kv_scale"]), ValueError, "kv_scale_stride"),
    ("mxfp4", lambda: args(kv_scale=ADDR["kv_scale"], kv_scale_stride=2**32 + 24), ValueError, "kv_scale_stride"),
    ("mxfp4", lambda: args(kv_scale=ADDR["kv_scale"], kv_scale_stride=17), ValueError, "kv_scale_stride"),
    ("mxfp4", lambda: args(kv_scale=ADDR["kv_scale"], kv_scale_stride=24.0), TypeError, "kv_scale_stride"),
    ("mxfp4", lambda: args(kv_scale_stride=16), ValueError, "kv_scale_stride"),  # disagrees with (400, 24)
    ("mxfp4", lambda: args(kv_scale=FakeCAI((400 * 24,), "|u1", ADDR["kv_scale"])), ValueError, "kv_scale"),
    ("mxfp4", lambda: args(kv_scale=FakeCAI((399, 24), "|u1", ADDR["kv_scale"])), ValueError, "kv_scale"),
    ("mxfp4", lambda: args(kv_scale=FakeCAI((400, 24), "<u2", ADDR["kv_scale"])), TypeError, "kv_scale"),
    ("mxfp4", lambda: args(kv=FakeCAI((1, 288), "|u1", ADDR["kv"]), kv_scale=FakeCAI((0, 24), "|u1", 0)),
     ValueError, "kv_scale"),  # a row without its scale row
    ("fp8", lambda: args(kv_format="fp8", fp8_scale=None), ValueError, "fp8_scale"),
    # fine alone, but the scores' f32 factor sm_scale * log2(e) * fp8_scale flushes to zero
    ("fp8", lambda: args(kv_format="fp8", fp8_scale=1e-37), ValueError, "fp8_scale"),
    ("fp8", lambda: args(kv_format="fp8", fp8_scale=1e39), ValueError, "fp8_scale"),
    ("fp8", lambda: args(kv_format="fp8", fp8_scale=1e-50), ValueError, "fp8_scale"),
    ("fp8", lambda: args(kv_format="fp8", fp8_scale=-0.5), ValueError, "fp8_scale"),
    ("fp8", lambda: args(kv_format="fp8", fp8_scale=float("nan")), ValueError, "fp8_scale"),
    ("fp8", lambda: args(kv_format="fp8", fp8_scale="x"), TypeError, "fp8_scale"),
    ("fp8", lambda: args(kv_format="fp8", kv=FakeCAI((400, 288), "|u1", ADDR["kv"])), ValueError, "kv"),
    ("fp8", lambda: args(kv_format="fp8", kv_scale=FakeCAI((400, 24), "|u1", ADDR["kv_scale"])),
     ValueError, "kv_scale"),
    ("bf16", lambda: args(kv_format="bf16", kv_scale=FakeCAI((400, 24), "|u1", ADDR["kv_scale"])),
     ValueError, "kv_scale"),
    ("bf16", lambda: args(kv_format="bf16", kv=FakeCAI((400, D_QK), "|u1", ADDR["kv"])), TypeError, "kv"),
    # a scalar of another format is a mix-up, not a no-op
    ("bf16", lambda: args(kv_format="bf16", fp8_scale=0.5), ValueError, "fp8_scale"),
    ("mxfp4", lambda: args(fp8_scale=0.5), ValueError, "fp8_scale"),
    ("bf16", lambda: args(kv_format="bf16", kv_scale_stride=24), ValueError, "kv_scale_stride"),
    ("fp8", lambda: args(kv_format="fp8", kv_scale_stride=-7), ValueError, "kv_scale_stride"),
    # without a page table the page size is 1, an int
    ("bf16", lambda: args(kv_format="bf16", page_size=1.0), TypeError, "page_size"),
    ("bf16", lambda: args(kv_format="bf16", page_size=True), TypeError, "page_size"),
    ("bf16", lambda: args(kv_format="bf16", page_size=None), TypeError, "page_size"),
    ("bf16", lambda: args(kv_format="bf16", page_size=16), ValueError, "page_size"),
    ("bf16", lambda: args(kv_format="bf16", kv=FakeCAI((400, D_QK), "<f2", ADDR["kv"])), TypeError, "kv"),
]


@pytest.mark.parametrize("kv_format, call, exc, name", BAD_RUNS,
                         ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD_RUNS)])
def test_bad_arguments_raise_before_any_launch(monkeypatch, kv_format, call, exc, name):
    gpu, dec = make(monkeypatch, kv_format=kv_format)
    dec.run(**args(kv_format=kv_format))  # a good step first: a bad one must not reuse it
    gpu.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the argument's own message, never a numpy warning first
        with pytest.raises(exc, match=f"^{re.escape(name)}:"):
            dec.run(**call())
    assert gpu.launches == [] and gpu.host_calls() == {}
    dec.run(**args(kv_format=kv_format))  # and the decoder still works
    assert len(gpu.launches) == 1


def test_fp8_scale_times_a_large_sm_scale_must_stay_finite(monkeypatch):
    fake_runtime(monkeypatch, "sm_90")
    dec = decode.Decoder("fp8", 1e20)
    dec.run(**args(kv_format="fp8", fp8_scale=1e15))
    with pytest.raises(ValueError, match=r"^fp8_scale: 1e\+20 times the decoder's sm_scale \* log2\(e\).*: inf is"):
        dec.run(**args(kv_format="fp8", fp8_scale=1e20))


def test_out_must_be_16_byte_aligned(monkeypatch):
    # The kernels store up to 16 bytes of output at a time.
    gpu, dec = make(monkeypatch)
    with pytest.raises(ValueError, match="^out: device address .* 16-byte"):
        dec.run(**args(out=FakeCAI((2, H, D_V), "<u2", ADDR["out"] + 8)))
    with pytest.raises(ValueError, match="^out: device address .* 16-byte"):
        dec.run(ADDR["q"], ADDR["kv"], ADDR["kv_indptr"], ADDR["out"] + 4, batch=2,
                kv_scale=ADDR["kv_scale"], kv_scale_stride=24)
    assert gpu.launches == []


def test_argument_cache_never_compares_buffers_with_eq(monkeypatch):
    class Tensor(FakeCAI):
        def __eq__(self, other):  # like a tensor: elementwise, may raise or launch work
            raise RuntimeError("elementwise == called")

        __ne__ = __eq__
        __hash__ = object.__hash__

    gpu, dec = make(monkeypatch)
    prepares = count_prepares(monkeypatch, dec)
    for _ in range(3):
        dec.run(**args(q=Tensor((2, H, D_QK), "<u2", ADDR["q"]),
                       out=Tensor((2, H, D_V), "<u2", ADDR["out"])))  # new objects each step
    assert len(gpu.launches) == 3 and len(prepares) == 1


def test_a_type_seen_first_in_a_step_is_keyed_from_that_step_on(monkeypatch):
    buffers.KEYERS.clear()  # every argument type is new: its keyer is chosen inside run()
    gpu, dec = make(monkeypatch)
    prepares = count_prepares(monkeypatch, dec)
    for _ in range(3):
        dec.run(**args(), lse=FakeCAI((2, H), "<f4", ADDR["lse"]))
    assert len(prepares) == 1 and len(gpu.launches) == 3
    assert buffers.KEYERS[FakeCAI] is buffers._interface_key


def test_an_argument_that_cannot_be_keyed_is_checked_every_step(monkeypatch):
    class Tensor(FakeCAI):
        """torch-style accessors that fail (a tensor without storage), a good interface."""

        def data_ptr(self):
            raise RuntimeError("no storage")

        def is_contiguous(self):
            return True

    gpu, dec = make(monkeypatch)
    prepares = count_prepares(monkeypatch, dec)
    dec.run(**args())
    for b in (2, 2, 3):  # never a cache hit, so the launch follows each step's q
        dec.run(**args(b, q=Tensor((b, H, D_QK), "<u2", ADDR["q"])))
    assert len(prepares) == 4 and [l.batch for l in gpu.launches] == [2, 2, 2, 3]
    with pytest.raises(ValueError, match="^q: expected shape"):
        dec.run(**args(2, q=Tensor((2, 8, D_QK), "<u2", ADDR["q"])))
    assert len(gpu.launches) == 4


def test_decode_copies_in_runs_once_and_frees_everything(monkeypatch):
    from hipmla.inputs import make_inputs

    gpu, dec = make(monkeypatch, max_batch=2)
    inputs = make_inputs(np.array([100, 0, 37]), "mxfp4", seed=1)
    gpu.reset()
    out, lse = dec.decode(inputs.q, inputs.kv, inputs.layout)
    assert out.shape == (3, H, D_V) and lse.shape == (3, H)
    assert len(gpu.launches) == 1 and gpu.launches[0].batch == 3
    assert dec.max_batch == 3  # the numpy path reserves for its batch
    # q, kv, kv_indptr and the scales in; out, lse and the error word back; one wait between
    assert gpu.calls["copy_htod"] == 4 and gpu.calls["copy_dtoh"] == 3 and gpu.calls["synchronize"] >= 1
    live = [buf for buf in gpu.buffers if buf.ptr]
    assert live == [dec._scratch], "decode() must free every array it allocated"
    assert dec._launch is None  # nothing cached that points at the freed arrays


# ----------------------------------------------------------------------------- known bugs


def test_numpy_integer_addresses_are_checked_once(monkeypatch):
    gpu, dec = make(monkeypatch)
    prepares = count_prepares(monkeypatch, dec)
    for _ in range(3):
        dec.run(*(np.int64(ADDR[k]) for k in ("q", "kv", "kv_indptr", "out")), batch=2,
                kv_scale=np.int64(ADDR["kv_scale"]), kv_scale_stride=24)
    assert len(gpu.launches) == 3
    assert len(prepares) == 1


@pytest.mark.parametrize("good, bad, exc", [
    (dict(kv_scale_stride=24), dict(kv_scale_stride=24.0), TypeError),
    (dict(**paged(), page_size=1), dict(**paged(), page_size=True), ValueError),
    (dict(batch=2), dict(batch=2.0), ValueError),
], ids=["kv_scale_stride", "page_size", "batch"])
def test_validation_does_not_depend_on_the_previous_step(monkeypatch, good, bad, exc):
    gpu, dec = make(monkeypatch)
    raw = dict(q=ADDR["q"], kv=ADDR["kv"], kv_indptr=ADDR["kv_indptr"], out=ADDR["out"],
               kv_scale=ADDR["kv_scale"])
    base = dict(raw, batch=2, kv_scale_stride=24)
    dec.run(**dict(base, **good))
    with pytest.raises(exc):
        dec.run(**dict(base, **bad))  # raises on a fresh decoder


def test_host_q_without_batch_is_reported_as_a_bad_q(monkeypatch):
    gpu, dec = make(monkeypatch)
    with pytest.raises(TypeError, match="^q: got a host numpy array"):
        dec.run(**args(q=np.zeros((2, H, D_QK), np.uint16)))


def test_failed_counter_reset_frees_the_new_scratch(monkeypatch):

    gpu, dec = make(monkeypatch, max_batch=4)

    def broken(*a, **k):
        raise RuntimeError("hipErrorIllegalAddress")

    monkeypatch.setattr(runtime, "memset", broken)
    with pytest.raises(RuntimeError):
        dec.reserve(64)
    assert dec.max_batch == 4 and dec._scratch.ptr
    assert [buf for buf in gpu.buffers if buf.ptr] == [dec._scratch]


@pytest.mark.parametrize("what", ["sm_scale", "fp8_scale"])
def test_out_of_range_scales_raise_without_a_numpy_warning(monkeypatch, what):
    gpu = fake_runtime(monkeypatch, "sm_90")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=f"^{what}:"):
            if what == "sm_scale":
                decode.Decoder("mxfp4", 1e39)
            else:
                decode.Decoder("fp8", 1 / 24).run(**args(kv_format="fp8", fp8_scale=1e39))
    assert gpu.launches == []


# ----------------------------------------------------------------------------- device guard


def test_the_kernels_get_the_extent_of_every_array_they_index(monkeypatch):
    """Rows of the cache and entries of the page table go into the parameters, so the
    kernels check the device-side indices against them; a raw address leaves them 0."""
    gpu, dec = make(monkeypatch)
    dec.run(**args(2, rows=400))
    assert (dec._params.kv_rows, dec._params.n_indices) == (400, 0)
    dec.run(**args(2, rows=400), **paged(2, pages=64), page_size=16)
    assert (dec._params.kv_rows, dec._params.n_indices) == (400, 64)
    raw = {k: v.__cuda_array_interface__["data"][0] if hasattr(v, "__cuda_array_interface__") else v
           for k, v in args(2, rows=400).items()}
    dec.run(**raw, batch=2, kv_scale_stride=24)
    assert (dec._params.kv_rows, dec._params.n_indices) == (0, 0)
    # An empty buffer (whose address may be null) is a bound of nothing (-1; 0 is none), so
    # a step of empty sequences runs and any other sequence is flagged on the device.
    empty = {"kv": FakeCAI((0, 288), "|u1", 0), "kv_scale": FakeCAI((0, 24), "|u1", 0)}
    dec.run(**(args(2) | empty))
    assert (dec._params.kv_rows, dec._params.n_indices) == (decode.EXTENT_EMPTY, 0) == (-1, 0)
    dec.run(**(args(2) | {"kv": ADDR["kv"], "kv_scale": empty["kv_scale"]}))  # the scales bound a raw cache
    assert dec._params.kv_rows == -1
    # An empty page table: a null kv_indices would mean a contiguous cache, so the kernels
    # get kv_indptr's address in its place, with no entry to read.
    dec.run(**args(2, rows=400), **paged(2, kv_indices=FakeCAI((0,), "<i4", 0)), page_size=16)
    assert (dec._params.kv_rows, dec._params.n_indices) == (400, -1)
    assert dec._params.kv_indices == dec._params.kv_indptr == ADDR["kv_indptr"] != 0
    launch = gpu.launches[-1]
    assert (launch.n_indices, launch.kv_indices) == (-1, ADDR["kv_indptr"])
    fp8 = make(monkeypatch, kv_format="fp8")[1]
    fp8.run(**args(2, kv_format="fp8", kv=FakeCAI((0, D_QK), "|u1", 0)))
    assert fp8._params.kv_rows == -1
    # the error word sits after the counters, inside the scratch
    assert dec._params.errors == dec._params.counters + 2 * dec.max_batch * 4
    assert dec._params.errors + 4 <= gpu.buffers[0].ptr + gpu.buffers[0].nbytes


def test_check_errors_names_each_kind_and_clears(monkeypatch):

    gpu, dec = make(monkeypatch)
    word = {"bits": 0}

    def read(host, ptr, stream=None):
        assert ptr == dec._params.errors
        host[0] = word["bits"]

    monkeypatch.setattr(runtime, "copy_dtoh", read)
    dec.check_errors()  # nothing recorded: no exception
    word["bits"] = 1 | 4
    gpu.reset()
    with pytest.raises(decode.DeviceInputError, match="kv_indptr decreases.*page id") as e:
        dec.check_errors()
    assert e.value.bits == 5 and isinstance(e.value, ValueError)
    assert gpu.memsets == [(dec._params.errors, 0, 4)]  # cleared for the next steps
    assert set(decode.DEVICE_ERRORS) == {1, 2, 4, 8, 16, 32}


def test_decode_raises_what_the_device_found(monkeypatch):
    """The numpy path waits for its step anyway: an error the device recorded raises there,
    not as NaN output and a word a later check_errors() would blame on a later step."""
    from hipmla.inputs import make_inputs

    gpu, dec = make(monkeypatch, max_batch=2)
    inputs = make_inputs(np.array([100, 0, 37]), "mxfp4", seed=1)
    real_read = runtime.copy_dtoh

    def read(host, ptr, stream=None):
        if ptr == dec._params.errors:
            host[0] = 8
        else:
            real_read(host, ptr, stream)

    monkeypatch.setattr(runtime, "copy_dtoh", read)
    with pytest.raises(decode.DeviceInputError, match="kv_last_page_len") as e:
        dec.decode(inputs.q, inputs.kv, inputs.layout)
    assert e.value.bits == 8
    assert [buf for buf in gpu.buffers if buf.ptr] == [dec._scratch]  # freed all the same


def test_decode_checks_a_layout_edited_after_it_was_made(monkeypatch):
    """KvLayout's arrays are the caller's: edited in place between steps, decode() checks
    them again before anything is copied or launched."""
    from hipmla.inputs import make_inputs, random_cache

    gpu, dec = make(monkeypatch, max_batch=3)
    rng = np.random.default_rng(0)
    lens = np.array([40, 3, 17])
    layout = random_page_table(lens, 16, rng, spare_pages=2)
    kv = random_cache((int(layout.kv_indices.max()) + 1) * 16, "mxfp4", rng)
    q = make_inputs(lens, "mxfp4", seed=1).q
    dec.decode(q, kv, layout)
    for field, i, value, words in (("kv_last_page_len", 0, 17, "kv_last_page_len"),
                                   ("kv_last_page_len", 1, 0, "kv_last_page_len"),
                                   ("kv_indices", 0, -3, "kv_indices: page ids must be >= 0"),
                                   ("kv_indptr", 1, 99, "kv_indptr")):
        arr = getattr(layout, field)
        saved = int(arr[i])
        arr[i] = value
        gpu.reset()
        with pytest.raises(ValueError, match=f"^{words}"):
            dec.decode(q, kv, layout)
        assert not gpu.launches and not gpu.calls["copy_htod"], field
        arr[i] = saved


def test_sm90_takes_every_item_with_any_q(monkeypatch):
    """On sm_90 the tensor-core kernel (any item length, 32-token softmax steps, dynamic
    shared memory) is the one launch for every Q precision (quantized Q: in the block)."""
    gpu, dec = make(monkeypatch, arch="sm_90", q_precision="bf16")
    assert dec._split.symbol == "hipmla_decode_split_sm90_mxfp4_qbf16" and dec._fast is None
    assert dec.tile_tokens == 32 and dec._split.dynamic_shared_bytes > 48 * 1024
    dec.run(**args(3))
    (launch,) = gpu.launches
    assert launch.symbol == dec._split.symbol and launch.fast_tile == 0
    _, fp8_q = make(monkeypatch, arch="sm_90", q_precision="fp8")
    assert fp8_q._split.symbol == "hipmla_decode_split_sm90_mxfp4_qfp8" and fp8_q.tile_tokens == 32
    _, amd = make(monkeypatch, arch="gfx942", q_precision="bf16")
    assert amd._split.symbol == "hipmla_decode_split_gfx942_mxfp4_qbf16"  # its own fast kernel


@pytest.mark.parametrize("arch, q_precision", [("gfx950", "fp8"), ("sm_90", "bf16"), ("sm_90", "mxfp4"),
                                               ("gfx942", "fp8")])
def test_emulate_models_the_decoders_own_kernel(monkeypatch, arch, q_precision):
    """Decoder.emulate is emulate_decode with this decoder's schedule, tiles and Q: the
    fast kernels' four-wave quarters (partial tiles masked), the sm_90 kernel's 32-token
    steps, the portable kernel's 64."""
    from hipmla.emulate import FAST_SCHEDULES, emulate_decode
    from hipmla.inputs import make_inputs

    _, dec = make(monkeypatch, arch=arch, q_precision=q_precision)
    inp = make_inputs([300, 0, 129], "mxfp4", seed=4)
    got = dec.emulate(inp.q, inp.kv, inp.layout)
    kw = dict(q_precision=q_precision, q_fp8_variant=dec.fp8_variant)
    if arch == "gfx950":
        kw |= dict(fast_schedule=FAST_SCHEDULES["gfx950"], fast_any_length=True)
    else:
        kw |= dict(tile_tokens=32 if arch == "sm_90" else 64)
    want = emulate_decode(inp.q, inp.kv, inp.layout, dec.config.sm_scale, dec.policy, **kw)
    assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
    other = emulate_decode(inp.q, inp.kv, inp.layout, dec.config.sm_scale, dec.policy, q_precision=q_precision,
                           tile_tokens=16)
    assert not np.array_equal(got[0].view(np.uint16), other[0].view(np.uint16))  # the schedule matters


# ----------------------------------------------------------------------------- several query tokens, heads


@pytest.mark.parametrize("heads,q_len,row_tokens", [(16, 4, 4), (32, 2, 2), (16, 8, 4), (64, 2, 1)])
def test_q_len_takes_the_64_row_kernel_with_rows_of_query_tokens(monkeypatch, heads, q_len, row_tokens):
    """heads x q_len >= 64 on sm_90 (mxfp4 or fp8, bf16 Q): the 64-row kernel, launched with
    rows of 64 / heads query tokens below 64 heads; the grid and the slots cover any step."""
    for kv_format in kernels.ROWS64_FORMATS:
        gpu, dec = make(monkeypatch, kv_format=kv_format, heads=heads, max_batch=4, max_q_tokens=16, q_len=q_len)
        assert dec.kernel_symbol == kernels.sm90_rows64_kernel(kv_format).symbol
        dec.run(**mtp_args(3, 11, heads, kv_format=kv_format))
        (launch,) = gpu.launches
        groups = max(heads // 64, 1)
        assert (launch.head_groups, launch.row_tokens) == (groups, row_tokens)
        assert launch.grid[0] == dec.policy.max_items(11 * groups)
        assert launch.shared == kernels.sm90_rows64_shared_bytes(kv_format)
        slots = dec.policy.max_items(16 * groups) * 4
        assert launch.part_ml - launch.part_acc == slots * 16 * 512 * 4
    # Below 64 rows, and off sm_90 or for other caches, q_len changes nothing.
    assert make(monkeypatch, heads=16, q_len=3)[1].kernel_symbol == kernels.sm90_split_kernel("mxfp4").symbol
    assert make(monkeypatch, kv_format="bf16", heads=heads, q_len=q_len)[1].kernel_symbol == \
        kernels.sm90_split_kernel("bf16").symbol


@pytest.mark.parametrize("q_len", [0, -1, 65, 2.0, True, "4"])
def test_q_len_is_checked(monkeypatch, q_len):
    fake_runtime(monkeypatch, "sm_90")
    with pytest.raises(ValueError, match=r"q_len: expected an integer in \[1, 64\]"):
        decode.Decoder("mxfp4", 1 / 24, q_len=q_len)


def mtp_args(b: int, t_q: int, heads: int, **over) -> dict:
    """run() keywords of a step with ``t_q`` query tokens over ``b`` sequences."""
    return args(b, q=FakeCAI((t_q, heads, D_QK), "<u2", ADDR["q"]), out=FakeCAI((t_q, heads, D_V), "<u2", ADDR["out"]),
                qo_indptr=FakeCAI((b + 1,), "<i4", 0x900000), **over)


@pytest.mark.parametrize("heads", [16, 32, 128])
def test_several_query_tokens_and_heads_reach_the_kernel(monkeypatch, heads):
    """A step of 3 sequences with 7 query tokens: the grid covers every row (16 heads of
    a query token), two merge counters per row, the struct carries qo_indptr and the rows."""
    gpu, dec = make(monkeypatch, heads=heads, max_batch=4, max_q_tokens=8)
    groups = heads // 16
    # On sm_90 an mxfp4 cache with 64+ heads runs the 64-head kernel: a schedule row is 64 heads.
    row_heads = 64 if heads % 64 == 0 else 16
    assert dec.kernel_symbol == kernels.decoder_kernel("sm_90", "mxfp4", "bf16", heads).symbol
    dec.run(**mtp_args(3, 7, heads), lse=FakeCAI((7, heads), "<f4", ADDR["lse"]))
    (launch,) = gpu.launches
    assert launch.qo_indptr == 0x900000 and launch.q_tokens == 7 and launch.head_groups == heads // row_heads
    assert launch.batch == 3
    assert launch.grid[0] == dec.policy.max_items(7 * heads // row_heads)
    scratch = gpu.buffers[-1]
    assert launch.errors - launch.counters == 2 * 4 * 8 * groups  # two counters per reserved 16-head row
    # The scratch: 16-head partial slots, row_heads / 16 for each item of the grid.
    slots = dec.policy.max_items(8 * heads // row_heads) * (row_heads // 16)
    assert launch.part_ml - launch.part_acc == slots * 16 * 512 * 4
    assert launch.errors + 8 <= scratch.ptr + scratch.nbytes
    assert launch.row_tokens == 1
    # One query token per sequence and 16 heads: exactly today's step.
    gpu2, dec2 = make(monkeypatch, max_batch=4)
    dec2.run(**args(3))
    (plain,) = gpu2.launches
    assert plain.qo_indptr == 0 and plain.q_tokens == 3 and plain.head_groups == 1
    assert plain.grid[0] == dec2.policy.max_items(3)


@pytest.mark.parametrize("kv_format", ["mxfp4", "fp8", "bf16"])
def test_eight_heads_share_each_row_between_two_query_tokens(monkeypatch, kv_format):
    """8 heads: a row of 16 holds two query tokens of a sequence (row_tokens 2) with
    heads_in_row 8 (the kernels read q and write out / lse at 8 heads a token), two merge
    counters a reserved query token, the 16-row kernel even where heads x q_len reaches 64
    (the 64-row kernel serves 16+ heads); 16 heads set 16 and one token a row."""
    gpu, dec = make(monkeypatch, kv_format=kv_format, heads=8, max_batch=4, max_q_tokens=8, q_len=8)
    assert dec.kernel_symbol == kernels.sm90_split_kernel(kv_format).symbol
    dec.run(**mtp_args(3, 7, 8, kv_format=kv_format), lse=FakeCAI((7, 8), "<f4", ADDR["lse"]))
    (launch,) = gpu.launches
    assert (launch.heads_in_row, launch.head_groups, launch.row_tokens) == (8, 1, 2)
    assert launch.grid[0] == dec.policy.max_items(7)
    assert launch.errors - launch.counters == 2 * 4 * 8  # two counters a reserved query token
    with pytest.raises(ValueError, match="^q: "):  # 16 heads of q for a decoder of 8
        dec.run(**mtp_args(3, 7, 16, kv_format=kv_format))
    gpu2, dec2 = make(monkeypatch, kv_format=kv_format, max_batch=4)
    dec2.run(**args(3, kv_format=kv_format))
    assert (gpu2.launches[0].heads_in_row, gpu2.launches[0].row_tokens) == (16, 1)


@pytest.mark.parametrize("over, name", [
    (dict(q_tokens=5), "q_tokens"),                                                # without qo_indptr
    (dict(qo_indptr=FakeCAI((5,), "<i4", 0x900000)), "indptr"),                   # 4 sequences, kv_indptr has 3
    (dict(qo_indptr=FakeCAI((4,), "<f4", 0x900000)), "qo_indptr"),                # not int32
    (dict(qo_indptr=0x900000), "batch"),                                           # raw: batch needed
    (dict(q=0x100000, qo_indptr=FakeCAI((4,), "<i4", 0x900000)), "q_tokens"),     # raw q: q_tokens needed
    (dict(q=FakeCAI((9, 32, D_QK), "<u2", ADDR["q"])), "query tokens"),          # more than reserved
    (dict(q=FakeCAI((7, 16, D_QK), "<u2", ADDR["q"])), "q"),                     # not the decoder's heads
    (dict(out=FakeCAI((3, 32, D_V), "<u2", ADDR["out"])), "out"),               # one row per query token
])
def test_bad_query_layouts_are_refused_before_launch(monkeypatch, over, name):
    gpu, dec = make(monkeypatch, heads=32, max_batch=4, max_q_tokens=8)
    a = mtp_args(3, 7, 32)
    a.update(over)
    if "q_tokens" in over and "qo_indptr" not in over:
        del a["qo_indptr"]
    with pytest.raises((ValueError, TypeError), match=name):
        dec.run(**a)
    assert not gpu.launches


def test_decode_refuses_a_sequence_shorter_than_its_query_tokens(monkeypatch):
    import ml_dtypes

    from hipmla.formats import quantize_kv

    gpu, dec = make(monkeypatch, kv_format="bf16")
    kv = quantize_kv(np.zeros((5, D_QK), np.float32), "bf16")
    q = np.zeros((4, 16, D_QK), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="sequence 1 has 2 kv tokens but 3 query tokens"):
        dec.decode(q, kv, np.array([0, 3, 5]), qo_indptr=np.array([0, 1, 4]))
    assert not gpu.launches


def test_decode_of_a_step_without_query_tokens_is_empty_and_launches_nothing(monkeypatch):
    """As the reference and the emulator answer it, not a complaint about max_q_tokens."""
    import ml_dtypes

    from hipmla.formats import quantize_kv

    gpu, dec = make(monkeypatch, kv_format="bf16")
    kv = quantize_kv(np.ones((16, D_QK), np.float32), "bf16")
    out, lse = dec.decode(np.zeros((0, 16, D_QK), ml_dtypes.bfloat16), kv, np.array([0, 5, 9]),
                          qo_indptr=np.array([0, 0, 0]))
    assert out.shape == (0, 16, D_V) and out.dtype == ml_dtypes.bfloat16 and lse.shape == (0, 16)
    assert not gpu.launches


def test_messages_name_the_argument_at_fault(monkeypatch):
    gpu, dec = make(monkeypatch)
    # a stride taken from the buffer's shape: the shape is what is wrong
    with pytest.raises(ValueError, match=r"^kv_scale: expected rows of 18 .. \d+ E8M0 bytes.*\(400, 17\)"):
        dec.run(**args(kv_scale=FakeCAI((400, 17), "|u1", ADDR["kv_scale"])))
    lse = runtime.DeviceArray((2, H), np.float32, ptr=ADDR["lse"])
    lse.free()
    with pytest.raises(ValueError, match=r"^lse: DeviceArray: the memory was freed"):
        dec.run(**args(lse=lse))
    assert not gpu.launches


def test_reserve_grows_for_query_tokens(monkeypatch):
    gpu, dec = make(monkeypatch, max_batch=4)
    assert dec.max_q_tokens == 4
    before = dec.scratch_bytes
    dec.reserve(4, 32)
    assert dec.max_q_tokens == 32 and dec.max_batch == 4 and dec.scratch_bytes > before
    dec.reserve(2, 8)  # grows only
    assert dec.max_q_tokens == 32 and dec.max_batch == 4
    with pytest.raises(ValueError, match="max_q_tokens"):
        dec.reserve(4, 0)
