"""The decoder: plan on the host, launch the split and combine kernels on a stream.

    dec = Decoder("mxfp4", sm_scale=1 / 24)          # device 0, null stream
    plan = dec.plan(seq_lens)                        # host lengths -> device work list
    dec.run(plan, q, kv, kv_indptr, out, kv_scale=scales, lse=lse)

Buffers are device addresses (int) or objects exposing ``__cuda_array_interface__``;
with the latter every shape, dtype and stride is checked against the plan before
anything is launched. ``run`` never reads device memory and never synchronizes, so it
can be captured into a graph. :meth:`Decoder.decode` is the convenience path for numpy
arrays (copy in, run, copy out).

The decoder owns a split-partials scratch buffer, allocated by the first plan that needs
one and grown only when a later plan needs more; one decoder serves one stream at a time.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from hipmla import kernels, runtime
from hipmla.formats import KV_FORMATS, KVCache
from hipmla.plan import DecodePlan, lengths_from_indptr, make_plan
from hipmla.reference import check_kv, check_q
from hipmla.emulate import LOG2E
from hipmla.validate import check_choice, check_positive_finite, format_shape


def fp8_variant_for(arch: str) -> str:
    """MI300-class targets (gfx940-942) read e4m3fnuz, every other target OCP e4m3fn."""
    return "e4m3fnuz" if arch.split(":")[0] in kernels.FNUZ_ARCHS else "e4m3fn"


# ----------------------------------------------------------------------------- pointers


def device_ptr(obj, name: str, *, itemsize: int, shape: tuple | None = None,
               kinds: str = "uiV", align: int = 4) -> int:
    """Address of a device buffer given as an int or a ``__cuda_array_interface__``.

    The address must be ``align``-byte aligned (the kernels load Q and KV rows 16 bytes
    at a time). For an interface object, ``shape`` (``None`` entries match anything),
    the element size and C-contiguity are checked too. The extent behind a raw address
    cannot be checked: it is the caller's promise.
    """
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        if obj <= 0:
            raise ValueError(f"{name}: expected a non-null device address, got {obj}")
        return _aligned(int(obj), name, align)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        if isinstance(obj, np.ndarray):
            raise TypeError(f"{name}: got a host numpy array; run() takes device buffers "
                            f"(use Decoder.decode for numpy inputs)")
        raise TypeError(f"{name}: expected a device address (int) or an object with "
                        f"__cuda_array_interface__, got {type(obj).__name__}")
    got_shape = tuple(int(s) for s in cai["shape"])
    typestr = cai["typestr"]
    if int(typestr[2:]) != itemsize or typestr[1] not in kinds:
        want = "float" if kinds == "f" else "raw (bf16/fp8/byte) or integer"
        raise TypeError(f"{name}: expected {itemsize}-byte {want} elements, got typestr {typestr!r}")
    if shape is not None:
        if len(got_shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got_shape)):
            raise ValueError(f"{name}: expected shape {format_shape(shape)}, got {got_shape}")
    strides = cai.get("strides")
    if strides is not None:
        contiguous = tuple(int(np.prod(got_shape[i + 1:], dtype=np.int64)) * itemsize
                           for i in range(len(got_shape)))
        if tuple(strides) != contiguous:
            raise ValueError(f"{name}: expected a C-contiguous buffer, got strides {tuple(strides)}")
    ptr = int(cai["data"][0])
    if ptr == 0 and int(np.prod(got_shape, dtype=np.int64)) > 0:
        raise ValueError(f"{name}: null data pointer")
    return _aligned(ptr, name, align)


def _aligned(ptr: int, name: str, align: int) -> int:
    if ptr % align:
        raise ValueError(f"{name}: device address {ptr:#x} is not {align}-byte aligned")
    return ptr


# ----------------------------------------------------------------------------- plans


class DevicePlan:
    """A :class:`DecodePlan` with its work list uploaded; owned by the decoder that made it."""

    def __init__(self, plan: DecodePlan):
        self.plan = plan
        self.work = runtime.DeviceArray.from_host(plan.work)
        self.seq_slots = runtime.DeviceArray.from_host(plan.seq_slots)

    @property
    def batch(self) -> int:
        return self.plan.batch

    def close(self) -> None:
        self.work.free()
        self.seq_slots.free()


def resolve_q_precision(q_precision: str, arch: str, kv_format: str) -> str:
    """``"auto"``: the most accurate Q that keeps decode at the memory limit — the fast
    kernel's default Q where ``arch`` has a fast kernel for ``kv_format``, else bf16."""
    check_choice(q_precision, "q_precision", ("auto",) + kernels.Q_PRECISIONS)
    if q_precision != "auto":
        return q_precision
    fast = kernels.fast_split_kernel(arch, kv_format, kernels.DEFAULT_FAST_Q_PRECISION)
    return kernels.DEFAULT_FAST_Q_PRECISION if fast is not None else "bf16"


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
        if self.heads != kernels.HEADS:
            raise ValueError(f"heads: the kernels are built for {kernels.HEADS} heads, got {self.heads}")


class Decoder:
    """MLA decode for one KV format and Q precision on one device and stream."""

    def __init__(self, kv_format: str, sm_scale: float, *, q_precision: str = "auto",
                 heads: int = kernels.HEADS, device: int = 0, stream=None):
        check_choice(kv_format, "kv_format", KV_FORMATS)
        self.device = runtime.device_info(device)
        arch = self.device.arch
        q_precision = resolve_q_precision(q_precision, arch, kv_format)
        self.config = DecoderConfig(kv_format, float(sm_scale), q_precision, heads)
        self.stream = stream
        self.fp8_variant = fp8_variant_for(arch)
        self._split = kernels.split_kernel(kv_format, q_precision)
        self._combine = kernels.combine_kernel()
        # Whole tiles of every sequence go to the arch's fast kernel where it has one.
        self._fast = kernels.fast_split_kernel(arch, kv_format, q_precision)
        self._split_fn = runtime.load_kernel(self._split, arch)
        self._combine_fn = runtime.load_kernel(self._combine, arch)
        self._fast_fn = runtime.load_kernel(self._fast, arch) if self._fast is not None else None
        self._scratch: runtime.DeviceBuffer | None = None
        self._scratch_slots = 0
        self._plans: list[DevicePlan] = []
        self._params = kernels.DecodeParams()
        self._last_key: tuple | None = None  # arguments of the last run, already resolved
        self._launches: list[tuple] = []
        # f32 exactly as the emulator forms it: the scale rounded to f32, times log2(e).
        self._params.sm_scale_log2 = float(np.float32(self.config.sm_scale) * LOG2E)

    # -- planning ---------------------------------------------------------------

    def plan(self, seq_lens=None, *, kv_indptr=None) -> DevicePlan:
        """Plan from host-side lengths (or a host ``kv_indptr``) and upload the work list."""
        if (seq_lens is None) == (kv_indptr is None):
            raise ValueError("plan: pass exactly one of seq_lens and kv_indptr (host arrays)")
        runtime.use_device(self.device.index)
        lens = lengths_from_indptr(kv_indptr) if kv_indptr is not None else seq_lens
        fast_tile = self._fast.tile_tokens if self._fast is not None else 0
        host = make_plan(lens, self.device.num_cus, fast_tile_tokens=fast_tile)
        self._last_key = None  # the scratch may move
        self._ensure_scratch(host.n_slots)
        dp = DevicePlan(host)
        self._plans.append(dp)
        return dp

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.nbytes

    def _ensure_scratch(self, n_slots: int) -> None:
        """Grow the scratch to ``n_slots``. The new buffer is allocated before the old
        one is freed, so a failed allocation leaves the decoder as it was. Growing
        frees memory that an already captured graph may still use: capture after the
        largest plan."""
        if n_slots <= self._scratch_slots:
            return
        per_slot = self.config.heads * (kernels.D_V + 2) * 4
        grown = runtime.alloc(n_slots * per_slot)
        if self._scratch is not None:
            runtime.synchronize()  # runs already enqueued may still write the old one
            self._scratch.free()
        self._scratch, self._scratch_slots = grown, n_slots

    # -- launching ----------------------------------------------------------------

    def run(self, plan: DevicePlan, q, kv, kv_indptr, out, *, kv_scale=None, lse=None,
            fp8_scale: float | None = None, kv_scale_stride: int | None = None, stream=None) -> None:
        """Enqueue one decode on ``stream`` (default: the decoder's). No host sync.

        Arguments are checked and resolved once per distinct set of argument objects: a
        decode loop that passes the same objects again (raw addresses compare by value)
        goes straight to the launches. So an interface object must keep its address
        (and stay allocated) while it is being passed here, as device arrays do.
        The decoder keeps the last arguments referenced until the next ``run`` with
        others, ``release`` or ``close``.
        """
        runtime.use_device(self.device.index)
        key = (plan, q, kv, kv_indptr, out, kv_scale, lse, fp8_scale, kv_scale_stride,
               self.stream if stream is None else stream)
        if not _same_arguments(key, self._last_key):
            self._last_key = None
            self._prepare(*key)
            self._last_key = key
        for launch, grid, block, shared, s in self._launches:
            launch(grid, block, shared, s)

    def _prepare(self, plan, q, kv, kv_indptr, out, kv_scale, lse, fp8_scale, kv_scale_stride,
                 stream) -> None:
        """Validate every argument and fill the parameter struct and the launch list."""
        if not isinstance(plan, DevicePlan) or plan not in self._plans:
            raise ValueError("plan: expected a DevicePlan made by this decoder's plan()")
        cfg = self.config
        b, h = plan.batch, cfg.heads
        fmt = cfg.kv_format
        p = self._params
        p.q = device_ptr(q, "q", itemsize=2, shape=(b, h, kernels.D_QK), align=16)
        kv_cols = kernels.D_QK // 2 if fmt == "mxfp4" else kernels.D_QK
        p.kv = device_ptr(kv, "kv", itemsize=2 if fmt == "bf16" else 1, shape=(None, kv_cols), align=16)
        _check_rows(kv, "kv", plan.plan.total_tokens)
        p.kv_indptr = device_ptr(kv_indptr, "kv_indptr", itemsize=4, shape=(b + 1,), kinds="i")
        # The kernels store up to 16 bytes of output at a time.
        p.out = device_ptr(out, "out", itemsize=2, shape=(b, h, kernels.D_V), align=16)
        p.lse = 0 if lse is None else device_ptr(lse, "lse", itemsize=4, shape=(b, h), kinds="f")
        if fmt == "mxfp4":
            stride = _scale_stride(kv_scale, kv_scale_stride)
            p.kv_scale = device_ptr(kv_scale, "kv_scale", itemsize=1, shape=(None, stride), align=1)
            _check_rows(kv_scale, "kv_scale", plan.plan.total_tokens)
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
                p.kv_fp8_scale = check_positive_finite(fp8_scale, "fp8_scale")
            else:
                p.kv_fp8_scale = 1.0
        p.work = plan.work.ptr
        p.seq_slots = plan.seq_slots.ptr
        scratch = self._scratch.ptr if self._scratch is not None else 0
        p.part_acc = scratch
        p.part_ml = scratch + self._scratch_slots * h * kernels.D_V * 4 if scratch else 0
        p.batch = b
        p.n_work = plan.plan.n_work
        s = stream
        if plan.plan.n_slots > self._scratch_slots or (plan.plan.n_slots and self._scratch is None):
            raise ValueError("plan: its split partials do not fit this decoder's scratch "
                             "(a plan() that grew it failed?); plan again")
        # Fast items (whole tiles) first, then the portable ones, then the combine; each
        # split launch reads its own slice of the work list, so each gets its own copy
        # of the parameters (launches copy them when they are enqueued).
        n_fast = plan.plan.n_fast
        launches = []
        if n_fast:
            pf = type(p).from_buffer_copy(p)
            pf.n_work = n_fast
            launches.append((self._fast_fn, self._fast, kernels.grid_split(n_fast), pf))
        if plan.plan.n_portable:
            pp = type(p).from_buffer_copy(p)
            pp.work = plan.work.ptr + 16 * n_fast
            pp.n_work = plan.plan.n_portable
            launches.append((self._split_fn, self._split, kernels.grid_split(pp.n_work), pp))
        if plan.plan.needs_combine:
            pc = type(p).from_buffer_copy(p)
            launches.append((self._combine_fn, self._combine, kernels.grid_combine(b), pc))
        self._launches = [(fn.bind(params), grid, (spec.block_threads, 1, 1), spec.dynamic_shared_bytes, s)
                          for fn, spec, grid, params in launches]

    # -- numpy convenience ----------------------------------------------------------

    def decode(self, q: np.ndarray, kv: KVCache, kv_indptr: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """Copy numpy inputs in, decode, copy out: ``(out bf16 (b,h,512), lse f32 (b,h))``."""
        check_q(q, batch=int(np.asarray(kv_indptr).shape[0]) - 1)
        check_kv(kv, kv_indptr)
        self._check_cache(kv)
        import ml_dtypes

        if q.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"q: the device path takes bfloat16 Q, got {q.dtype}")
        plan = self.plan(kv_indptr=kv_indptr)
        b = plan.batch
        bufs = [runtime.DeviceArray.from_host(a) for a in
                (q.view(np.uint16), kv.data, np.ascontiguousarray(kv_indptr, dtype=np.int32))]
        scale = runtime.DeviceArray.from_host(kv.scales) if kv.format == "mxfp4" else None
        out = runtime.DeviceArray((b, self.config.heads, kernels.D_V), np.uint16)
        lse = runtime.DeviceArray((b, self.config.heads), np.float32)
        try:
            self.run(plan, *bufs, out, kv_scale=scale, lse=lse,
                     fp8_scale=kv.fp8_scale if kv.format == "fp8" else None)
            runtime.synchronize()
            return out.to_host().view(ml_dtypes.bfloat16), lse.to_host()
        finally:
            for a in bufs + [out, lse] + ([scale] if scale is not None else []):
                a.free()
            self.release(plan)

    def _check_cache(self, kv: KVCache) -> None:
        if kv.format != self.config.kv_format:
            raise ValueError(f"kv: this decoder reads {self.config.kv_format}, got a {kv.format} cache")
        if kv.format == "fp8" and kv.fp8_variant != self.fp8_variant:
            raise ValueError(f"kv: {self.device.arch} reads fp8 as {self.fp8_variant}, "
                             f"got a {kv.fp8_variant} cache")

    # -- lifetime -------------------------------------------------------------------

    def release(self, plan: DevicePlan) -> None:
        """Free a plan's device work list (after the runs that use it have finished)."""
        if plan in self._plans:
            runtime.use_device(self.device.index)
            self._plans.remove(plan)
            plan.close()
            self._last_key = None

    def close(self) -> None:
        self._last_key = None
        self._launches = []
        if self._plans or self._scratch is not None:
            runtime.use_device(self.device.index)
        for plan in self._plans:
            plan.close()
        self._plans.clear()
        if self._scratch is not None:
            self._scratch.free()
            self._scratch = None
            self._scratch_slots = 0

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _same_arguments(a: tuple, b: tuple | None) -> bool:
    """The same argument objects as last time: identity, except numbers by value. Never
    ``==`` on buffers: a tensor's ``==`` may raise or even launch device work."""
    if b is None:
        return False
    for x, y in zip(a, b):
        if x is not y and not (type(x) in (int, float) and type(x) is type(y) and x == y):
            return False
    return True


def _check_rows(buf, name: str, needed: int) -> None:
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None and int(cai["shape"][0]) < needed:
        raise ValueError(f"{name}: the plan's sequences need {needed} rows, got {cai['shape'][0]}")


def _scale_stride(kv_scale, kv_scale_stride: int | None) -> int:
    if kv_scale is None:
        raise ValueError("kv_scale: the mxfp4 format needs its E8M0 block scales")
    cai = getattr(kv_scale, "__cuda_array_interface__", None)
    stride = int(cai["shape"][1]) if cai is not None and len(cai["shape"]) == 2 else kv_scale_stride
    if stride is None:
        raise ValueError("kv_scale_stride: needed when kv_scale is a raw address")
    if kv_scale_stride is not None and stride != kv_scale_stride:
        raise ValueError(f"kv_scale_stride: {kv_scale_stride} disagrees with kv_scale's shape ({stride})")
    if stride < kernels.D_QK // 32:
        raise ValueError(f"kv_scale_stride: expected >= {kernels.D_QK // 32}, got {stride}")
    return stride


# ----------------------------------------------------------------------------- CLI backend


def gpu_check_backend(index: int = 0):
    """``(label, run)`` for ``python -m hipmla check`` on a GPU."""
    info = runtime.device_info(index)
    decoders: dict[tuple[str, str], Decoder] = {}

    def run(inputs, seqs, q_precision):
        key = (inputs.kv.format, q_precision)
        if key not in decoders:
            decoders[key] = Decoder(inputs.kv.format, inputs.sm_scale, q_precision=q_precision, device=index)
        t0 = time.perf_counter()  # wall time of the numpy path: copies in and out included
        out, lse = decoders[key].decode(inputs.q, inputs.kv, inputs.kv_indptr)
        return out[seqs], lse[seqs], time.perf_counter() - t0

    return f"{info.arch}:{index}", run
