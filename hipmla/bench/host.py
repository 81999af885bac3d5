"""Host time of one serving step (``Decoder.run``): the CPU's part of a step, timed apart
from the device's, three ways (the same buffer objects, new views, raw addresses), beside
a ctypes call of a C no-op that shows the CPU's state."""

from __future__ import annotations

import ctypes
import statistics
import time

from hipmla import runtime
from hipmla.decode import Decoder

#: Rounds of host timing: the figure is the least of their medians.
HOST_ROUNDS = 5


def host_overhead_us(fn, calls: int = 300, args=None, rounds: int = HOST_ROUNDS) -> float:
    """CPU time of one call of ``fn`` (launches only; the queue drains every 50): the
    least of ``rounds`` medians of ``calls`` calls. A round that another process or a
    clock change disturbed has a higher median; the least is what the code costs (the
    H200 machine's single-round medians of one bench run spread from 6 to 15 us).
    With ``args``, call ``i`` of a round is ``fn(args[i])`` (argument objects made before
    timing, ``calls`` of them)."""
    medians = []
    for _ in range(rounds):
        samples = []
        for i in range(calls):
            a = None if args is None else args[i]
            t0 = time.perf_counter_ns()
            fn() if args is None else fn(a)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if i % 50 == 49:
                runtime.synchronize()
        runtime.synchronize()
        medians.append(statistics.median(samples))
    return min(medians)


def c_noop_launch():
    """A ctypes call of a C function that does nothing, with a launch's 11 ready-made
    arguments: the floor of any launch from Python, for comparison with the real one."""
    noop = ctypes.CDLL(None).labs  # C labs: reads its first argument, ignores the rest
    noop.restype = ctypes.c_long
    u = ctypes.c_uint
    args = (ctypes.c_void_p(0), u(1), u(1), u(1), u(256), u(1), u(1), u(0), ctypes.c_void_p(0), None,
            ctypes.c_void_p(0))
    return lambda: noop(*args)


def host_reference_us(calls: int = 300, rounds: int = HOST_ROUNDS) -> float:
    """:func:`host_overhead_us` of :func:`c_noop_launch`. The H200 machine's CPU runs it
    in 1.0 us at times and 2.2 us at others, and every host figure moves with it; the
    bench prints it beside them."""
    return host_overhead_us(c_noop_launch(), calls, rounds=rounds)


def host_figures(dec: Decoder, bufs: dict, extra: dict, views: list[dict], calls: int = 300,
                 rounds: int = HOST_ROUNDS) -> tuple[float, float, float]:
    """Host time (us, :func:`host_overhead_us`) of one ``dec.run`` three ways: the same
    ``bufs`` objects every step, ``views[i]`` (new objects over the same buffers) at step
    ``i``, and raw addresses (with the ``batch`` and ``kv_scale_stride`` a raw q and scale need). ``bufs`` are
    :class:`runtime.DeviceArray` s by ``run`` keyword; ``extra`` the other keywords."""
    scale = bufs.get("kv_scale")
    raw = {k: (v.ptr if v is not None else None) for k, v in bufs.items()}
    raw.update(batch=bufs["q"].shape[0], kv_scale_stride=None if scale is None else scale.shape[1])

    def call(args=bufs):
        dec.run(**args, **extra)

    def call_raw():
        dec.run(**raw, **extra)

    return (host_overhead_us(call, calls, rounds=rounds),
            host_overhead_us(call, calls, args=views, rounds=rounds),
            host_overhead_us(call_raw, calls, rounds=rounds))


class _View:
    """A new interface object over the same memory, as a caller without torch makes."""

    def __init__(self, arr):
        self.__cuda_array_interface__ = dict(arr.__cuda_array_interface__)


def fresh_views(bufs: dict, calls: int) -> list[dict]:
    """``calls`` sets of new views of the same device buffers: torch tensors over them
    where torch is importable (what a torch-based caller passes each step), else new
    interface objects."""
    try:
        import torch

        made = {k: torch.as_tensor(v, device="cuda") for k, v in bufs.items() if v is not None}
        return [{k: (made[k].view(made[k].shape) if k in made else None) for k in bufs}
                for _ in range(calls)]
    except (ImportError, RuntimeError, TypeError):
        return [{k: (_View(v) if v is not None else None) for k, v in bufs.items()} for _ in range(calls)]
