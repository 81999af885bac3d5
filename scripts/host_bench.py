#!/usr/bin/env python3
"""Host cost of one ``Decoder.run`` on the CPU alone: the bench's host figures
(``hipmla.bench.host_figures``: the same objects, new views, raw addresses) with the
runtime under the decoder stubbed, so no GPU is needed.

Everything of a step but the HIP call itself is the real code: ``runtime.use_device``
on its hot path, the argument key, ``BoundLaunch.prepare``'s prebuilt ctypes launch.
The launch calls C ``labs`` with the kernel handle 0 as its first argument (returns 0,
ignores the rest), so the ctypes argument passing and the GIL release of the real call
are measured too. The views are new tensor objects over the same memory each step, as
a torch caller hands over: real torch CUDA tensors where torch has a GPU, else
torch-style stand-ins (``data_ptr()``, ``shape``, ``dtype``, ``is_contiguous()``, an
interface dict built on each read).

    python scripts/host_bench.py [--format mxfp4] [--calls 5000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import kernels, runtime  # noqa: E402
from hipmla.bench import host_figures  # noqa: E402
from hipmla.decode import Decoder  # noqa: E402
from hipmla.formats import KV_FORMATS  # noqa: E402

#: The H200 the figures are compared with: sm_90, 132 SMs.
ARCH, NUM_CUS = "sm_90", 132
PAGE_SIZE = 16
ROWS = 1 << 16  # rows of the cache: its shape is keyed, its contents never read


class Size(tuple):
    """torch.Size: a tuple subclass."""


class TorchLike:
    """What the decoder sees of a torch CUDA tensor."""

    def __init__(self, ptr: int, shape: tuple, dtype: np.dtype):
        self._ptr, self.shape, self.dtype = ptr, Size(shape), dtype

    def data_ptr(self) -> int:
        return self._ptr

    def is_contiguous(self) -> bool:
        return True

    @property
    def __cuda_array_interface__(self) -> dict:  # torch builds it on every read
        return {"shape": tuple(self.shape), "typestr": self.dtype.str, "data": (self._ptr, False),
                "strides": None, "version": 3}


@contextlib.contextmanager
def stubbed_runtime() -> Iterator[None]:
    """The runtime calls under a Decoder, without a GPU; undone on leaving."""
    info = runtime.DeviceInfo(index=0, name="stub", arch=ARCH, arch_full=ARCH, platform="nvidia",
                              num_cus=NUM_CUS, warp_size=32, max_shared_per_block=48 << 10,
                              shared_optin=227 << 10, total_mem=141 << 30, l2_bytes=60 << 20,
                              mem_clock_khz=0, mem_bus_bits=0, pci_bus_id=0, peak_bandwidth_gbs=0.0)

    class Buffer:
        def __init__(self, nbytes: int):
            self.ptr, self.nbytes = 1 << 40, nbytes

        def free(self) -> None:
            self.ptr = 0

    launch = ctypes.CDLL(None).labs  # bound as runtime.launch._c_launcher binds the HIP call
    launch.restype = ctypes.c_int
    stubs = {"device_info": lambda index=0: info, "alloc": Buffer, "memset": lambda *a, **k: None,
             "synchronize": lambda: None, "_c_launch": launch,
             "load_kernel": lambda spec, arch: runtime.Function(0, None, spec.symbol)}
    saved = {name: getattr(runtime, name) for name in stubs}
    device = runtime._thread.device
    for name, stub in stubs.items():
        setattr(runtime, name, stub)
    runtime._thread.device = 0  # use_device's hot path: this thread already has device 0
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(runtime, name, real)
        runtime._thread.device = device


def buffer_specs(kv_format: str, batch: int, paged: bool) -> dict:
    """``(shape, dtype)`` of each buffer of a step, by ``run`` keyword (None: not given)."""
    cols = {"mxfp4": kernels.D_QK // 2, "fp8": kernels.D_QK, "bf16": kernels.D_QK}[kv_format]
    h = kernels.HEADS
    return {"q": ((batch, h, kernels.D_QK), np.int16),
            "kv": ((ROWS, cols), np.int16 if kv_format == "bf16" else np.uint8),
            "kv_indptr": ((batch + 1,), np.int32),
            "out": ((batch, h, kernels.D_V), np.int16), "lse": ((batch, h), np.float32),
            "kv_scale": ((ROWS, 24), np.uint8) if kv_format == "mxfp4" else None,
            "kv_indices": ((ROWS // PAGE_SIZE,), np.int32) if paged else None,
            "kv_last_page_len": ((batch,), np.int32) if paged else None}


def tensors(specs: dict) -> dict:
    """A tensor for each buffer: torch CUDA tensors where torch has a GPU (their accessors
    are what a torch caller's step costs), else :class:`TorchLike` s over made-up,
    16-byte aligned addresses. The decoder never reads their memory."""
    try:
        import torch

        if torch.cuda.is_available():
            return {k: None if v is None else torch.empty(v[0], dtype=getattr(torch, np.dtype(v[1]).name),
                                                          device="cuda") for k, v in specs.items()}
    except ImportError:
        pass
    return {k: None if v is None else TorchLike((i + 1) << 32, v[0], np.dtype(v[1]))
            for i, (k, v) in enumerate(specs.items())}


def views(made: dict, calls: int) -> list[dict]:
    """``calls`` sets of new tensor objects over the same memory, one set a step."""
    def view(t):
        return TorchLike(t.data_ptr(), t.shape, t.dtype) if isinstance(t, TorchLike) else t.view(t.shape)

    return [{k: None if t is None else view(t) for k, t in made.items()} for _ in range(calls)]


def host_table(kv_format: str, calls: int, rounds: int) -> list[str]:
    """The table: a line per layout and batch, each figure the least median of ``rounds``
    (inside :func:`stubbed_runtime`)."""
    cases = []
    for paged in (False, True):
        for batch in (4, 256):
            specs = buffer_specs(kv_format, batch, paged)
            made = tensors(specs)
            bufs = {k: None if v is None else runtime.DeviceArray(v[0], v[1], ptr=made[k].data_ptr())
                    for k, v in specs.items()}
            extra = dict(page_size=PAGE_SIZE if paged else 1, fp8_scale=0.5 if kv_format == "fp8" else None)
            dec = Decoder(kv_format, 1 / 24, max_batch=batch, selftest=False)  # no kernel runs under the stub
            cases.append(("paged" if paged else "contiguous", batch, dec, bufs, extra, views(made, calls)))
    # rounds interleaved over the cases: a slow spell of a shared machine hits them all alike
    figures = [[host_figures(*case[2:], calls, rounds=1) for case in cases] for _ in range(rounds)]
    lines = [f"host us per Decoder.run, {kv_format}, launch stubbed (least median of {rounds} x {calls})",
             f"{'layout':>10} {'batch':>5} {'same':>6} {'views':>6} {'raw':>6}"]
    for i, (layout, batch, *_) in enumerate(cases):
        same, view, raw = (min(r[i][j] for r in figures) for j in range(3))
        lines.append(f"{layout:>10} {batch:>5} {same:6.2f} {view:6.2f} {raw:6.2f}")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="mxfp4", choices=KV_FORMATS)
    p.add_argument("--calls", type=int, default=5000, help="steps timed per figure (median)")
    p.add_argument("--rounds", type=int, default=9, help="the least median of this many rounds is shown")
    a = p.parse_args(argv)
    with stubbed_runtime():
        print("\n".join(host_table(a.format, a.calls, a.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
