"""Seeded decode inputs: the 8 benchmark shapes and ragged serving-like batches."""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from hipmla.formats import KV_FORMATS, KVCache, default_scale_stride, quantize_kv
from hipmla.paging import KvLayout
from hipmla.queries import MAX_Q_LEN
from hipmla.reference import D_QK, HEADS, select_seqs
from hipmla.validate import check_choice

BENCH_BATCH_SIZES = (4, 32, 64, 256)
BENCH_KV_LENS = (1024, 8192)
#: The benchmark's softmax scale. Models use their own (DeepSeek: 1/sqrt(192) * yarn).
BENCH_SM_SCALE = 1.0 / math.sqrt(D_QK)
_GEN_ROWS = 1 << 13  # rows generated and quantized at a time


@dataclass(frozen=True)
class Shape:
    batch: int
    kv_len: int

    @property
    def name(self) -> str:
        k = f"{self.kv_len // 1024}k" if self.kv_len % 1024 == 0 else str(self.kv_len)
        return f"{self.batch}x{k}"

    @property
    def seq_lens(self) -> np.ndarray:
        return np.full(self.batch, self.kv_len, dtype=np.int64)


def benchmark_shapes() -> list[Shape]:
    return [Shape(b, n) for b in BENCH_BATCH_SIZES for n in BENCH_KV_LENS]


@dataclass(frozen=True)
class DecodeInputs:
    q: np.ndarray  # (t_q, h, 576) bfloat16: t_q = b with one query token per sequence
    kv: KVCache
    layout: KvLayout  # where each sequence's rows are (contiguous, or a page table)
    sm_scale: float
    qo_indptr: np.ndarray | None = None  # (b + 1,) query tokens per sequence; None: one each

    @property
    def batch(self) -> int:
        return self.layout.batch

    @property
    def kv_indptr(self) -> np.ndarray:
        return self.layout.kv_indptr

    @property
    def seq_lens(self) -> np.ndarray:
        return self.layout.seq_lens()


def make_inputs(
    seq_lens,
    kv_format: str,
    *,
    seed: int = 0,
    heads: int = HEADS,
    sm_scale: float = BENCH_SM_SCALE,
    fp8_variant: str = "e4m3fn",
    scale_stride: int | None = None,
    rule: str = "even",
) -> DecodeInputs:
    """N(0,1) Q (bf16) and KV (quantized to ``kv_format``), reproducible from ``seed``.

    The cache is generated and quantized in blocks of rows, so the f32 original of a
    2M-row cache never exists in memory at once. The fp8 per-tensor scale is fixed at
    8 / fp8_max, enough for N(0,1) data (amax about 6.2 over 1e9 samples) rather than
    measured, for the same reason.
    """
    check_choice(kv_format, "kv_format", KV_FORMATS)
    seed = _check_seed(seed)
    _check_heads(heads)
    layout = KvLayout.contiguous(seq_lens)
    indptr = layout.kv_indptr
    rows = int(indptr[-1])
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((indptr.shape[0] - 1, heads, D_QK), dtype=np.float32).astype(ml_dtypes.bfloat16)
    # Each block has its own generator, so blocks can run on threads and the cache is
    # still a pure function of the seed.
    tasks = [(r0, min(_GEN_ROWS, rows - r0)) for r0 in range(0, rows, _GEN_ROWS)] or [(0, 0)]
    kv = _quantized_cache(
        kv_format, tasks,
        lambda t: np.random.default_rng([seed, t[0]]).standard_normal((t[1], D_QK), dtype=np.float32),
        rule=rule, scale_stride=scale_stride, fp8_variant=fp8_variant)
    return DecodeInputs(q=q, kv=kv, layout=layout, sm_scale=float(sm_scale))


def _quantized_cache(kv_format: str, tasks: list, rows_of, *, rule: str, scale_stride: int | None,
                     fp8_variant: str) -> KVCache:
    """The blocks ``rows_of(task)`` (f32 ``(n, 576)``) quantized on threads (numpy releases
    the GIL) and stacked in task order. The fp8 per-tensor scale is fixed at 8 / fp8_max,
    enough for N(0,1) data, so no pass over the whole cache is needed to measure it."""
    if kv_format == "mxfp4" and scale_stride is None:
        scale_stride = default_scale_stride(D_QK)
    fp8_scale = 8.0 / (448.0 if fp8_variant == "e4m3fn" else 240.0)

    def block(task) -> KVCache:
        return quantize_kv(rows_of(task), kv_format, rule=rule, scale_stride=scale_stride,
                           fp8_variant=fp8_variant, fp8_scale=fp8_scale)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        parts = list(pool.map(block, tasks))
    data = np.concatenate([p.data for p in parts])
    scales = np.concatenate([p.scales for p in parts]) if kv_format == "mxfp4" else None
    return KVCache(kv_format, data, scales=scales, fp8_scale=parts[0].fp8_scale,
                   fp8_variant=fp8_variant, dim=D_QK)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
    return int(seed)


def _check_heads(heads) -> int:
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or not 1 <= heads <= 1024:
        raise ValueError(f"heads: expected an integer in [1, 1024] (a decoder serves 1 to 16, 32, 64 or 128), "
                         f"got {heads!r}")
    return int(heads)


def make_sampled_inputs(
    seq_lens,
    seqs,
    kv_format: str,
    *,
    seed: int = 0,
    heads: int = HEADS,
    sm_scale: float = BENCH_SM_SCALE,
    fp8_variant: str = "e4m3fn",
    scale_stride: int | None = None,
    rule: str = "even",
    q_len: int = 1,
) -> DecodeInputs:
    """The sub-batch of sequences ``seqs`` of a batch with lengths ``seq_lens``, built
    without the rest of the batch: sequence ``seqs[i]`` becomes sequence ``i`` of the
    result, with its full length, its rows laid out contiguously from row 0.

    Each sequence's Q row and KV rows come from generators keyed by ``(seed, sequence)``
    alone, so a sequence's data is the same whichever other sequences are sampled with
    it (and whatever the batch's other lengths are). It is *not* the data
    :func:`make_inputs` gives that sequence: that one keys its generators by cache row.
    Q is N(0,1) in bf16, KV N(0,1) quantized as :func:`make_inputs` does it (fixed fp8
    per-tensor scale; mxfp4 scales per 32-value block of a row, so per row). ``q_len`` > 1:
    that many query tokens per sequence (MTP; ``qo_indptr`` set, the causal rule of
    :mod:`hipmla.queries`: every length must be >= q_len).
    """
    from hipmla.queries import check_causal
    from hipmla.schedule import check_lens

    _check_heads(heads)
    if isinstance(q_len, bool) or not isinstance(q_len, (int, np.integer)) or not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len: expected an integer in [1, {MAX_Q_LEN}], got {q_len!r}")

    check_choice(kv_format, "kv_format", KV_FORMATS)
    seed = _check_seed(seed)
    lens = check_lens(seq_lens)
    sel = select_seqs(seqs, lens.shape[0], allow_empty=False)
    sub_lens = lens[sel]
    layout = KvLayout.contiguous(sub_lens)
    if q_len > 1:
        check_causal(sub_lens, np.full(sub_lens.shape, q_len), "seq_lens")
    q = np.concatenate([np.random.default_rng([seed, int(b), 0]).standard_normal((q_len, heads, D_QK),
                                                                                 dtype=np.float32)
                        for b in sel]).astype(ml_dtypes.bfloat16)
    qo = np.arange(0, q_len * sel.size + 1, q_len, dtype=np.int64) if q_len > 1 else None
    tasks = [(int(b), t0, min(_GEN_ROWS, int(n) - t0)) for b, n in zip(sel, sub_lens)
             for t0 in range(0, int(n), _GEN_ROWS)] or [(0, 0, 0)]
    kv = _quantized_cache(
        kv_format, tasks,
        lambda t: np.random.default_rng([seed, t[0], 1, t[1]]).standard_normal((t[2], D_QK), dtype=np.float32),
        rule=rule, scale_stride=scale_stride, fp8_variant=fp8_variant)
    return DecodeInputs(q=q, kv=kv, layout=layout, sm_scale=float(sm_scale), qo_indptr=qo)


def spread_sample(lens: np.ndarray, k: int = 6) -> np.ndarray:
    """A few sequences of a batch to check on the host: ``k`` spread evenly, the longest,
    and the first empty one (sorted indices)."""
    lens = np.asarray(lens)
    batch = lens.shape[0]
    picks = set(np.linspace(0, batch - 1, min(k, batch)).round().astype(int).tolist())
    picks.add(int(np.argmax(lens)))
    empty = np.flatnonzero(lens == 0)
    if empty.size:
        picks.add(int(empty[0]))
    return np.array(sorted(picks))


def random_seq_lens(rng: np.random.Generator, max_batch: int = 300, max_len: int = 20000) -> np.ndarray:
    """A serving-like ragged batch: any size, lengths off every tile multiple, some
    empty sequences, a few long ones."""
    batch = int(rng.integers(1, max_batch + 1))
    kind = rng.random(batch)
    lens = rng.integers(0, max_len + 1, size=batch)
    lens = np.where(kind < 0.1, 0, lens)  # empty
    short = rng.integers(1, max(min(200, max_len + 1), 2), size=batch)
    lens = np.where((kind >= 0.1) & (kind < 0.3), np.minimum(short, max_len), lens)  # short
    return lens.astype(np.int64)


def _mapped(raw: np.ndarray, table: np.ndarray) -> np.ndarray:
    """table[raw] for a cache of random codes, in one pass of row chunks (the element-wise
    forms made several passes and cache-sized temporaries: 2.3M rows of bf16 took 28 s on a
    2-core host, this 15 s; fp8 3.6x faster)."""
    out = np.empty(raw.shape, table.dtype)
    step = 1024
    for start in range(0, raw.shape[0], step):
        np.take(table, raw[start:start + step], out=out[start:start + step])
    return out


@functools.cache
def _bf16_code_map() -> np.ndarray:
    """random_cache's bf16 values from 16 random bits: sign and mantissa kept, the exponent
    set to -4 .. 2 from bits 7-14 (mod 7)."""
    x = np.arange(1 << 16, dtype=np.uint32)
    return ((x & 0x807F) | ((127 - 4 + ((x >> 7) & 0xFF) % 7) << 7)).astype(np.uint16)


@functools.cache
def _fp8_code_map(variant: str) -> np.ndarray:
    """Every e4m3 byte as itself but the variant's NaN codes, which become 0."""
    table = np.arange(256, dtype=np.uint8)
    table[[0x80] if variant == "e4m3fnuz" else [0x7F, 0xFF]] = 0
    return table


def random_cache(rows: int, kv_format: str, rng: np.random.Generator, *,
                 fp8_variant: str = "e4m3fn", scale_stride: int | None = None) -> KVCache:
    """A cache of random *codes* rather than quantized N(0,1) data: every E2M1/e4m3 code
    a producer can write (NaN excepted), block scales spread over 2^-8 .. 2^2, bf16
    values of magnitude 2^-4 .. 2^3 with random mantissas. Much
    faster than :func:`make_inputs` for large ragged tests, and it exercises codes
    that N(0,1) data rarely hits."""
    check_choice(kv_format, "kv_format", KV_FORMATS)
    if kv_format == "bf16":
        raw = np.frombuffer(rng.bytes(rows * D_QK * 2), dtype=np.uint16).reshape(rows, D_QK)
        return KVCache("bf16", _mapped(raw, _bf16_code_map()))
    if kv_format == "fp8":
        raw = np.frombuffer(rng.bytes(rows * D_QK), dtype=np.uint8).reshape(rows, D_QK)
        return KVCache("fp8", _mapped(raw, _fp8_code_map(fp8_variant)), fp8_scale=1.0 / 64, fp8_variant=fp8_variant)
    stride = default_scale_stride(D_QK) if scale_stride is None else scale_stride
    data = np.frombuffer(rng.bytes(rows * D_QK // 2), dtype=np.uint8).reshape(rows, D_QK // 2)
    scales = np.zeros((rows, stride), dtype=np.uint8)
    scales[:, : D_QK // 32] = rng.integers(127 - 8, 127 + 3, size=(rows, D_QK // 32), dtype=np.uint8)
    return KVCache("mxfp4", data, scales=scales)
