"""The decoder: one decode step is one launch of device arrays, with no host work.

    dec = Decoder("mxfp4", sm_scale=1 / 24, max_batch=256)   # device 0, null stream
    dec.run(q, kv, kv_indptr, out, kv_scale=scales, lse=lse,             # contiguous rows
            kv_indices=pages, kv_last_page_len=last, page_size=16)       # or a page table

Buffers (:mod:`hipmla.buffers`) are device addresses (int), objects exposing
``__cuda_array_interface__`` or DLPack producers (``__dlpack__``, kDLCUDA or kDLROCM
memory); with the latter two every shape, dtype and stride is checked before anything is
launched. The kernels run on the
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
one stream at a time: two steps in flight at once on two streams would share them (and
the placement words on NVIDIA, which a launch resets only when all its blocks have
claimed: two launches overlapping there could leave them wrong for every later step).
:meth:`Decoder.decode` is the convenience path for numpy arrays (copy in, run, copy out).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable
import numpy as np

from hipmla import kernels, runtime
from hipmla.buffers import (DLPACK_DEVICES, KEYERS, buffer_key, device_ptr, dlpack_interface, interface_of,
                            interface_shape)
from hipmla import selftest as _selftest  # Decoder(selftest=...) is a keyword
from hipmla.emulate import FAST_SCHEDULES, LOG2E, emulate_decode
from hipmla.formats import KV_FORMATS, KVCache
from hipmla.paging import PAGE_SIZES, KvLayout, as_layout, check_page_size
from hipmla.queries import MAX_Q_LEN, check_causal, check_heads, check_qo_indptr, head_groups, heads_in_row, q_lens
from hipmla.reference import check_q
from hipmla.schedule import INT32_MAX, LONE_BELOW_TOKENS, SplitPolicy
from hipmla.validate import check_choice, check_positive_finite

#: Batch the decoder reserves for when the caller does not say.
DEFAULT_MAX_BATCH = 256
#: Largest max_batch / max_q_tokens reserve() takes: the kernels' int32 row arithmetic.
MAX_RESERVE = INT32_MAX // 4 // kernels.HEADS
#: Most partial slots of a scratch: the kernels' int offset (slot * 16 + head) * 2 of part_ml.
MAX_SLOTS = (INT32_MAX // 2 - kernels.HEADS) // kernels.HEADS

#: Bits of the device's error word (hip_src/core/paged.h, ERR_*): device-side input the
#: host never reads, found invalid by the kernels. The sequence concerned gets NaN.
DEVICE_ERRORS = {
    1: "kv_indptr decreases (or is negative) at a sequence",
    2: "kv_indptr points past the cache rows (contiguous) or past kv_indices (paged), or gives a "
       "sequence more than 2^30 tokens (MAX_SEQ_TOKENS)",
    4: "a page id in kv_indices is negative or its rows pass the end of the cache",
    8: "kv_last_page_len is outside 1 .. page_size",
    16: "qo_indptr is no offsets array from 0 to the query tokens of q (the whole step computed nothing: "
        "out and lse were not written)",
    32: "a sequence has fewer kv tokens than query tokens (qo_indptr)",
}


@dataclass(frozen=True)
class ScratchLayout:
    """The persistent scratch of a decoder (Decoder.scratch_layout): f32 partials
    (``acc_bytes``, then ``ml_bytes`` of (m, l) pairs), then ``words`` int32 words: two merge
    counters a 16-head row, the error word, padding and, from ``placement_at``, the
    placement words."""

    slots: int  # partial slots of 16 heads
    rows: int  # 16-head rows (merge counters)
    acc_bytes: int
    ml_bytes: int
    words: int
    sms: int  # SMs the placement words serve (0: none)
    placement_at: int
    placement_words: int

    @property
    def total_bytes(self) -> int:
        return self.acc_bytes + self.ml_bytes + self.words * 4


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
    choice (tests, trials). ``kernel_symbol`` names the kernel the decoder runs.
    ``placement``: on NVIDIA, the first block to reach each SM takes the first work
    items (``hip_src/core/placement.h``); False gives item i to block i, as on AMD.
    ``fit``: a step whose usual split gives more items than slots takes a longer chunk
    (``hipmla.schedule.FIT_EIGHTHS``); NVIDIA kernels only (None: on there, off on AMD).
    ``q_len``: query tokens a sequence has in the steps this decoder serves (1, or 1 +
    draft tokens with MTP / speculative decoding); it only picks the kernel -- on sm_90
    with an MXFP4 or fp8 cache and bf16 Q, ``heads x q_len >= 64`` (16+ heads) takes the 64-row kernel
    (:data:`hipmla.kernels.ROWS64_MIN_ROWS`) -- and every step runs with any query tokens
    a sequence on either kernel."""

    def __init__(self, kv_format: str, sm_scale: float, *, q_precision: str = "auto",
                 heads: int = kernels.HEADS, device: int = 0, stream=None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_q_tokens: int | None = None,
                 selftest: bool | None = None, kernel: kernels.KernelSpec | None = None,
                 placement: bool = True, fit: bool | None = None, q_len: int = 1):
        check_choice(kv_format, "kv_format", KV_FORMATS)
        if isinstance(q_len, bool) or not isinstance(q_len, (int, np.integer)) or not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"q_len: expected an integer in [1, {MAX_Q_LEN}] (query tokens a sequence), "
                             f"got {q_len!r}")
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise TypeError(f"device: expected a device index (int), got {type(device).__name__} {device!r}")
        if device < 0:
            raise ValueError(f"device: expected a device index >= 0, got {device}")
        sm_scale = check_positive_finite(sm_scale, "sm_scale")
        with np.errstate(over="ignore", under="ignore"):  # _f32 rejects what does not fit
            _f32(float(np.float32(sm_scale) * LOG2E), "sm_scale", f"{sm_scale!r} times log2(e)")
        DecoderConfig(kv_format, sm_scale, heads=heads)  # the arguments, before any device call
        check_stream(stream)
        if not isinstance(placement, bool):
            raise TypeError(f"placement: expected a bool, got {type(placement).__name__} {placement!r}")
        if fit is not None and not isinstance(fit, bool):
            raise TypeError(f"fit: expected a bool, got {type(fit).__name__} {fit!r}")
        self.device = runtime.device_info(device)
        if fit is None:
            fit = self.device.platform == "nvidia"
        elif fit and self.device.platform != "nvidia":
            raise ValueError(f"fit: only the NVIDIA kernels build the fit (core/schedule.h), "
                             f"this device is {self.device.platform} {self.device.arch}")
        self._placement = placement and self.device.platform == "nvidia"
        arch = self.device.arch
        q_precision = resolve_q_precision(q_precision, arch, kv_format)
        self.config = DecoderConfig(kv_format, check_positive_finite(sm_scale, "sm_scale"), q_precision, heads)
        self.stream = stream
        self.fp8_variant = fp8_variant_for(arch)
        # One kernel takes every item of a step (any length; partial tiles masked inside):
        # the arch's fast kernel for this cache format and Q where it has one (gfx950,
        # gfx942), else the sm_90 tensor-core kernel (any Q), else the portable kernel
        # (or ``kernel``, for tests and trials). One that is not the portable kernel serves
        # only once it passed its known-answer check on this arch (hipmla.selftest; the
        # verdict is kept per code object), else the portable kernel does.
        chosen = kernels.decoder_kernel(arch, kv_format, q_precision, heads, int(q_len)) if kernel is None \
            else kernels.check_serves(kernel, arch, kv_format, q_precision, heads)
        self._split = _selftest.trusted_kernel(chosen, self.device, requested=selftest)
        self._fast = self._split if self._split.tile_tokens else None
        self.kernel_symbol = self._split.symbol
        # The lone split only where the placement gives each of its items an SM; the fit
        # where the kernels build it (NVIDIA), measured in hipmla/schedule.py, FIT_EIGHTHS.
        self.policy = replace(SplitPolicy.for_device(self.device.num_cus, items_per_cu=self._split.items_per_cu,
                                                     lone=self._placement, fit=fit),
                              lone_below_tokens=LONE_BELOW_TOKENS[self.config.kv_format])
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
        # A schedule row is the kernel's row_heads query rows (16 heads of one query token,
        # or below 16 heads several tokens; the 64-row sm_90a kernel 64 heads of one, or 64 /
        # heads query tokens of fewer: hipmla.schedule.row_shape).
        self._params.head_groups, self._params.row_tokens = self._split.schedule_rows(self.config.heads)
        self._params.heads_in_row = heads_in_row(self.config.heads)  # below 16 heads: several tokens a row
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
            kw.update(tile_tokens=self._split.softmax_tile, products=self._split.products,
                      row_heads=self._split.row_heads)
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
        limit = MAX_RESERVE
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
        lay = self.scratch_layout(max_batch, max_q_tokens)
        if lay.total_bytes > self.device.total_mem:
            raise ValueError(f"max_batch/max_q_tokens: steps of {max_batch} sequences and {max_q_tokens} query "
                             f"tokens need {lay.total_bytes / 2**30:.1f} GiB of split scratch; the device has "
                             f"{self.device.total_mem / 2**30:.1f} GiB")
        # The kernels index part_ml as int ((slot * 16 + h) * 2): at most MAX_SLOTS slots,
        # whatever the device's memory (2^26 slots would be 2 TiB of scratch).
        if lay.slots > MAX_SLOTS:
            raise ValueError(f"max_batch/max_q_tokens: steps of {max_batch} sequences and {max_q_tokens} query "
                             f"tokens need {lay.slots} partial slots; the kernels index at most {MAX_SLOTS}")
        runtime.use_device(self.device.index)
        grown = runtime.alloc(lay.total_bytes)
        try:
            # A row's last block resets its merge counters, a launch's last claim the
            # placement words; they start at zero once, and so does the error word
            # (check_errors clears it).
            runtime.memset(grown.ptr + lay.acc_bytes + lay.ml_bytes, 0, lay.words * 4)
            runtime.synchronize()  # the memset is done, and runs enqueued on the old buffers too
        except BaseException:
            grown.free()
            raise
        if self._scratch is not None:
            self._scratch.free()
        self._scratch, self._max_batch, self._max_q_tokens, self._slots = grown, max_batch, max_q_tokens, lay.slots
        p = self._params
        p.part_acc = grown.ptr
        p.part_ml = grown.ptr + lay.acc_bytes
        p.counters = grown.ptr + lay.acc_bytes + lay.ml_bytes
        p.errors = p.counters + 2 * lay.rows * 4
        p.placement = p.counters + lay.placement_at * 4 if lay.placement_words else None
        p.placement_sms = lay.sms
        self._last_key = None

    def scratch_layout(self, max_batch: int, max_q_tokens: int) -> ScratchLayout:
        """Where the partials, the merge counters, the error word and the placement words of
        a scratch for steps of up to ``max_batch`` sequences and ``max_q_tokens`` query tokens
        go (nothing is allocated)."""
        tokens = max(max_q_tokens, max_batch)
        rows = tokens * head_groups(self.config.heads)  # rows of 16 heads: the merge counters
        # An item of the 64-head kernel writes a slot of 16 heads for each of its 4 rows.
        slots = self.policy.max_items(tokens * self._params.head_groups) * (self._split.row_heads // kernels.HEADS)
        words = 2 * rows + 2  # the merge counters (two per row, core/merge.h), the error word, padding
        # Which block runs which item (core/placement.h): on NVIDIA, where a block knows
        # its SM (%smid); an AMD block does not, and runs item i of block i.
        sms = self.device.num_cus if self._placement else 0
        placement_at = (words + 3) // 4 * 4  # 16-byte aligned: the kernel clears it in 16-byte stores
        placement_words = kernels.placement_words(sms) if sms else 0
        if placement_words:
            words = placement_at + placement_words
        return ScratchLayout(slots=slots, rows=rows, acc_bytes=slots * kernels.HEADS * kernels.D_V * 4,
                             ml_bytes=slots * kernels.HEADS * 2 * 4, words=words, sms=sms,
                             placement_at=placement_at, placement_words=placement_words)

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
        keyers = KEYERS
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
                   type(q_tokens), q_tokens, s, type(s) is runtime.Stream and s.closed)
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
        dev = self.device.index
        if qo_indptr is None:
            if q_tokens is not None:
                raise ValueError(f"q_tokens: {q_tokens!r} given without qo_indptr (one query token per sequence)")
            b = t_q = _batch(q, batch)
            p.qo_indptr = 0
        else:
            t_q = _batch(q, q_tokens, "q_tokens")
            p.qo_indptr, qo_shape = device_ptr(qo_indptr, "qo_indptr", itemsize=4, shape=(None,), kinds="i", device=dev)
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
        p.q = device_ptr(q, "q", itemsize=2, shape=(t_q, h, kernels.D_QK), align=16, device=dev)[0]
        kv_cols = kernels.D_QK // 2 if fmt == "mxfp4" else kernels.D_QK
        p.kv, kv_shape = device_ptr(kv, "kv", itemsize=2 if fmt == "bf16" else 1, shape=(None, kv_cols), align=16,
                                    float8=(f"float8_{self.fp8_variant}",) if fmt == "fp8" else (), device=dev)
        p.kv_indptr = device_ptr(kv_indptr, "kv_indptr", itemsize=4, shape=(b + 1,), kinds="i", device=dev)[0]
        # The kernels store up to 16 bytes of output at a time.
        p.out = device_ptr(out, "out", itemsize=2, shape=(t_q, h, kernels.D_V), align=16, writable=True,
                           device=dev)[0]
        p.lse = 0 if lse is None else device_ptr(lse, "lse", itemsize=4, shape=(t_q, h), kinds="f",
                                                 writable=True, device=dev)[0]
        # The kernels read no row past the cache's and no page-table entry past its end
        # (0: a raw address, whose extent is the caller's promise; an empty buffer is a
        # bound of no rows, so only a step of empty sequences reads it, and reads nothing).
        p.kv_rows = _extent(kv_shape)
        p.n_indices = 0
        if kv_indices is None and kv_last_page_len is None:
            if isinstance(page_size, (bool, np.bool_)) or not isinstance(page_size, (int, np.integer)):
                raise TypeError(f"page_size: expected an int, got {type(page_size).__name__} {page_size!r}")
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
            p.kv_indices, idx_shape = device_ptr(kv_indices, "kv_indices", itemsize=4, shape=(None,), kinds="i",
                                                 device=dev)
            p.n_indices = _extent(idx_shape)
            if p.n_indices == EXTENT_EMPTY:
                # A null table would switch the kernels to a contiguous cache: they get another
                # address of ints in its place, of which they read none (every entry is past
                # the bound).
                p.kv_indices = p.kv_indptr
            p.kv_last_page_len = device_ptr(kv_last_page_len, "kv_last_page_len", itemsize=4,
                                            shape=(b,), kinds="i", device=dev)[0]
        if fmt == "mxfp4":
            stride = _scale_stride(kv_scale, kv_scale_stride)
            p.kv_scale, scale_shape = device_ptr(kv_scale, "kv_scale", itemsize=1, shape=(None, stride), align=1,
                                                 float8=("float8_e8m0fnu",), device=dev)
            if kv_shape is not None and scale_shape is not None and scale_shape[0] < kv_shape[0]:
                raise ValueError(f"kv_scale: expected a scale row for each of the {kv_shape[0]} cache rows, "
                                 f"got {scale_shape[0]}")
            if kv_shape is None and scale_shape is not None:
                p.kv_rows = _extent(scale_shape)
            p.stride_kv_scale = stride
            if fp8_scale is not None:
                raise ValueError("fp8_scale: only the fp8 format has a per-tensor scale, this decoder reads mxfp4")
            p.kv_fp8_scale = 1.0
        else:
            if kv_scale is not None:
                raise ValueError(f"kv_scale: only the mxfp4 format has block scales, this decoder reads {fmt}")
            if kv_scale_stride is not None:
                raise ValueError(f"kv_scale_stride: only the mxfp4 format has block scales, this decoder reads {fmt}")
            p.kv_scale = 0
            p.stride_kv_scale = 0
            if fmt == "fp8":
                if fp8_scale is None:
                    raise ValueError("fp8_scale: the fp8 format needs its per-tensor scale")
                p.kv_fp8_scale = _f32(check_positive_finite(fp8_scale, "fp8_scale"), "fp8_scale")
                # The kernels scale the scores by this product, in f32.
                with np.errstate(over="ignore", under="ignore"):
                    product = np.float32(p.sm_scale_log2) * np.float32(p.kv_fp8_scale)
                _f32(float(product),
                     f"fp8_scale: {fp8_scale!r} times the decoder's sm_scale * log2(e) ({p.sm_scale_log2!r})")
            else:
                if fp8_scale is not None:
                    raise ValueError(f"fp8_scale: only the fp8 format has a per-tensor scale, "
                                     f"this decoder reads {fmt}")
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
        if isinstance(layout, KvLayout):
            layout.check()  # again: the caller's arrays may have changed since it was made
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
        layout.check_cache(kv.rows)
        import ml_dtypes

        if q.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"q: the device path takes bfloat16 Q, got {q.dtype}")
        b, t_q = layout.batch, q.shape[0]
        if t_q == 0:  # sequences with no query tokens this step: nothing to compute or launch
            return (np.zeros((0, self.config.heads, kernels.D_V), ml_dtypes.bfloat16),
                    np.zeros((0, self.config.heads), np.float32))
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
            result = out.to_host().view(ml_dtypes.bfloat16), lse.to_host()
            self.check_errors()  # what the device found wrong, this step (or an unchecked earlier one)
            return result
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


# kv_rows / n_indices of an empty buffer (params.h): a bound of nothing, where 0 is no bound.
EXTENT_EMPTY = -1


def _extent(shape: tuple | None) -> int:
    """The kernels' bound of a buffer's first dimension: 0 for a raw address (the caller's
    promise), EXTENT_EMPTY for an empty buffer, whose address may be null."""
    if shape is None:
        return 0
    return min(shape[0], INT32_MAX) if shape[0] > 0 else EXTENT_EMPTY


def _f32(value: float, name: str, came: str | None = None) -> float:
    """``value`` as the kernel's f32 receives it: finite and not flushed to zero. ``came``:
    what the caller passed, where ``value`` is derived from it."""
    with np.errstate(over="ignore", under="ignore"):  # the range check below says it
        v = np.float32(value)
    if not np.isfinite(v) or v == 0 or abs(v) < np.finfo(np.float32).tiny:
        shown = repr(value) if came is None else f"{came} ({value!r} as the kernel takes it)"
        raise ValueError(f"{name}: {shown} is outside the range of the kernel's float32 "
                         f"(normal magnitudes {np.finfo(np.float32).tiny:.3g} .. {np.finfo(np.float32).max:.3g})")
    return float(v)


def check_stream(stream, name: str = "stream"):
    """What the launch takes for ``stream``: None (the null stream), a :class:`runtime.Stream`,
    a raw handle (int >= 0 or a hip-python stream), or a torch/CuPy-style stream object
    (its ``cuda_stream`` / ``ptr`` handle, or ``__cuda_stream__()``)."""
    if stream is None:
        return stream
    if isinstance(stream, runtime.Stream):
        if stream.closed:
            raise ValueError(f"{name}: this hipmla.runtime.Stream was closed (its handle is destroyed)")
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
    cai = interface_of(q, "q")
    if cai is None:
        device_ptr(q, "q", itemsize=2)  # raises: says what q is instead
        raise TypeError(f"q: expected a device address (int) or a device buffer, got {type(q).__name__}")
    shape = interface_shape(cai, "q")
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
    cai = None if raw else interface_of(kv_scale, "kv_scale")
    if not raw and cai is None:
        device_ptr(kv_scale, "kv_scale", itemsize=1, align=1)  # raises: says what kv_scale is
    shape = None if cai is None else interface_shape(cai, "kv_scale")
    if shape is not None and len(shape) != 2:
        raise ValueError(f"kv_scale: expected shape (rows, stride), got {shape}")
    stride = int(shape[1]) if shape is not None else kv_scale_stride
    if stride is None:
        raise ValueError("kv_scale_stride: needed when kv_scale is a raw address")
    if kv_scale_stride is not None and stride != kv_scale_stride:
        raise ValueError(f"kv_scale_stride: {kv_scale_stride} disagrees with kv_scale's shape ({stride})")
    if not kernels.D_QK // 32 <= stride <= INT32_MAX:
        if shape is not None:  # the stride is the buffer's own: its shape is what is wrong
            raise ValueError(f"kv_scale: expected rows of {kernels.D_QK // 32} .. {INT32_MAX} E8M0 bytes "
                             f"(a scale a 32-value block), got shape {shape}")
        raise ValueError(f"kv_scale_stride: expected {kernels.D_QK // 32} .. {INT32_MAX}, got {stride}")
    return int(stride)


# ----------------------------------------------------------------------------- CLI backend


def gpu_check_backend(index: int = 0):
    """``(label, run)`` for ``python -m hipmla check`` on a GPU."""
    info = runtime.device_info(index)
    decoders: dict[tuple[str, str, int, int], Decoder] = {}

    def run(inputs, seqs, q_precision):
        heads = inputs.q.shape[1]
        # The kernel a server of these steps would run (the 64-row kernel with MTP on sm_90).
        q_len = 1 if inputs.qo_indptr is None else int(np.clip(np.diff(inputs.qo_indptr).max(), 1, MAX_Q_LEN))
        key = (inputs.kv.format, q_precision, heads, q_len)
        if key not in decoders:
            decoders[key] = Decoder(inputs.kv.format, inputs.sm_scale, q_precision=q_precision, device=index,
                                    heads=heads, q_len=q_len)
        t0 = time.perf_counter()  # wall time of the numpy path: copies in and out included
        out, lse = decoders[key].decode(inputs.q, inputs.kv, inputs.layout, inputs.qo_indptr)
        if inputs.qo_indptr is not None:  # rows are query tokens: those of the sequences asked for
            qo = inputs.qo_indptr
            rows = np.concatenate([np.arange(qo[s], qo[s + 1]) for s in seqs])
            return out[rows], lse[rows], time.perf_counter() - t0
        return out[seqs], lse[seqs], time.perf_counter() - t0

    return f"{info.arch}:{index}", run


__all__ = ["DEVICE_ERRORS", "DLPACK_DEVICES", "Decoder", "DecoderConfig", "DeviceInputError", "PAGE_SIZES", "KvLayout",
           "ScratchLayout",
           "buffer_key", "check_stream", "device_ptr", "dlpack_interface",
           "fp8_variant_for", "resolve_q_precision"]
