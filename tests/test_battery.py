"""A battery of bad inputs across the public API, on the CPU: each must raise the
documented exception before anything is launched, with a message that starts with the
name of the argument at fault (``name: what was expected, what came``) — and never a
numpy warning first. Decoders run on the fake runtime of ``test_decode``."""

from __future__ import annotations

import re
import warnings

import ml_dtypes
import numpy as np
import pytest
from test_decode import ADDR, D_QK, D_V, H, FakeCAI, args, fake_runtime, make, paged

from hipmla import Decoder, decode, formats, schedule
from hipmla.emulate import emulate_decode
from hipmla.formats import KVCache, fp8_quantize, mxfp4_quantize, quantize_kv
from hipmla.paging import KvLayout, random_page_table
from hipmla.reference import mla_decode_reference
from hipmla.schedule import SplitPolicy

RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, D_QK)).astype(np.float32)  # a small float KV cache
Q = RNG.standard_normal((2, H, D_QK)).astype(ml_dtypes.bfloat16)
INDPTR = np.array([0, 3, 8], np.int32)
MX = quantize_kv(X, "mxfp4")
FP8 = quantize_kv(X, "fp8")
BF16 = quantize_kv(X, "bf16")
POLICY = SplitPolicy(target_items=8)
RAW = dict(q=ADDR["q"], kv=ADDR["kv"], kv_indptr=ADDR["kv_indptr"], out=ADDR["out"], batch=2)


class Env:
    """What a case may touch: decoders on the fake runtime, whose launches are checked."""

    def __init__(self, monkeypatch):
        self.mp, self.gpus = monkeypatch, []

    def decoder(self, kv_format="mxfp4", **kw) -> Decoder:
        gpu, dec = make(self.mp, kv_format=kv_format, **kw)
        dec.run(**args(kv_format=kv_format))  # a good step first: a bad one must not reuse it
        gpu.reset()
        self.gpus.append(gpu)
        return dec

    def construct(self, *a, **kw):
        self.gpus.append(fake_runtime(self.mp, "sm_90"))
        return Decoder(*a, **kw)

    def run(self, kv_format="mxfp4", **over):
        return self.decoder(kv_format).run(**args(kv_format=kv_format, **over))

    def run_raw(self, **over):
        return self.decoder().run(**{**RAW, "kv_scale": ADDR["kv_scale"], "kv_scale_stride": 24, **over})


def cai(shape, typestr, key, off=0, **extra):
    obj = FakeCAI(shape, typestr, ADDR[key] + off)
    obj.__cuda_array_interface__.update(extra)
    return obj


def mx_without_scales():
    return KVCache("mxfp4", MX.data, scales=None, dim=D_QK)


NaN_Q = Q.copy()
NaN_Q[1, 3, 7] = np.nan
INF_X = X.copy()
INF_X[2, 5] = np.inf

# (id, call(env), exception, the argument the message starts with)
CASES = [
    # --- Decoder(...) construction
    ("ctor-sm_scale-1e39", lambda e: e.construct("mxfp4", 1e39), ValueError, "sm_scale"),
    ("ctor-sm_scale-1e-50", lambda e: e.construct("mxfp4", 1e-50), ValueError, "sm_scale"),
    ("ctor-sm_scale-None", lambda e: e.construct("mxfp4", None), TypeError, "sm_scale"),
    ("ctor-sm_scale-str", lambda e: e.construct("mxfp4", "x"), TypeError, "sm_scale"),
    ("ctor-sm_scale-nan", lambda e: e.construct("mxfp4", float("nan")), ValueError, "sm_scale"),
    ("ctor-sm_scale-neg", lambda e: e.construct("mxfp4", -0.1), ValueError, "sm_scale"),
    ("ctor-sm_scale-bool", lambda e: e.construct("mxfp4", True), TypeError, "sm_scale"),
    ("ctor-sm_scale-array", lambda e: e.construct("mxfp4", np.ones(2)), TypeError, "sm_scale"),
    ("ctor-kv_format", lambda e: e.construct("int4", 0.1), ValueError, "kv_format"),
    ("ctor-kv_format-None", lambda e: e.construct(None, 0.1), ValueError, "kv_format"),
    ("ctor-q_precision", lambda e: e.construct("mxfp4", 0.1, q_precision="fp16"), ValueError, "q_precision"),
    ("ctor-heads-str", lambda e: e.construct("mxfp4", 0.1, heads="16"), TypeError, "heads"),
    ("ctor-heads-float", lambda e: e.construct("mxfp4", 0.1, heads=16.0), TypeError, "heads"),
    ("ctor-heads-48", lambda e: e.construct("mxfp4", 0.1, heads=48), ValueError, "heads"),
    ("ctor-heads-256", lambda e: e.construct("mxfp4", 0.1, heads=256), ValueError, "heads"),
    ("ctor-device-str", lambda e: e.construct("mxfp4", 0.1, device="0"), TypeError, "device"),
    ("ctor-device-neg", lambda e: e.construct("mxfp4", 0.1, device=-1), ValueError, "device"),
    ("ctor-device-bool", lambda e: e.construct("mxfp4", 0.1, device=True), TypeError, "device"),
    ("ctor-stream-str", lambda e: e.construct("mxfp4", 0.1, stream="abc"), TypeError, "stream"),
    ("ctor-stream-float", lambda e: e.construct("mxfp4", 0.1, stream=1.5), TypeError, "stream"),
    ("ctor-stream-object", lambda e: e.construct("mxfp4", 0.1, stream=object()), TypeError, "stream"),
    ("ctor-stream-neg", lambda e: e.construct("mxfp4", 0.1, stream=-1), ValueError, "stream"),
    ("ctor-max_batch-0", lambda e: e.construct("mxfp4", 0.1, max_batch=0), ValueError, "max_batch"),
    ("ctor-max_batch-huge", lambda e: e.construct("mxfp4", 0.1, max_batch=2**31), ValueError, "max_batch"),
    # --- Decoder.reserve
    ("reserve-neg", lambda e: e.decoder().reserve(-3), ValueError, "max_batch"),
    ("reserve-float", lambda e: e.decoder().reserve(2.5), ValueError, "max_batch"),
    ("reserve-np-float", lambda e: e.decoder().reserve(np.float64(4)), ValueError, "max_batch"),
    ("reserve-bool", lambda e: e.decoder().reserve(True), ValueError, "max_batch"),
    # --- Decoder.run: streams, checked before any launch
    ("run-stream-str", lambda e: e.run(stream="abc"), TypeError, "stream"),
    ("run-stream-bytes", lambda e: e.run(stream=b"\x00"), TypeError, "stream"),
    ("run-stream-list", lambda e: e.run(stream=[0]), TypeError, "stream"),
    ("run-stream-huge", lambda e: e.run(stream=2**64), ValueError, "stream"),
    ("run-decoder-stream-str", lambda e: (setattr(d := e.decoder(), "stream", "abc"), d.run(**args())),
     TypeError, "stream"),
    # --- run: q
    ("run-q-None", lambda e: e.run(q=None), TypeError, "q"),
    ("run-q-bool", lambda e: e.run(q=True, batch=2), TypeError, "q"),
    ("run-q-str", lambda e: e.run(q="0x100000", batch=2), TypeError, "q"),
    ("run-q-2d", lambda e: e.run(q=cai((2, D_QK), "<u2", "q")), ValueError, "q"),
    ("run-q-batch0", lambda e: e.run(q=cai((0, H, D_QK), "<u2", "q")), ValueError, "q"),
    ("run-q-f4", lambda e: e.run(q=cai((2, H, D_QK), "<f4", "q")), TypeError, "q"),
    ("run-q-i1", lambda e: e.run(q=cai((2, H, D_QK), "|i1", "q")), TypeError, "q"),
    ("run-q-bool-dtype", lambda e: e.run(q=cai((2, H, D_QK), "|b1", "q")), TypeError, "q"),
    ("run-q-strided", lambda e: e.run(q=cai((2, H, D_QK), "<u2", "q", strides=(2 * H * D_QK * 2, 4 * D_QK, 2))),
     ValueError, "q"),
    ("run-q-misaligned", lambda e: e.run(q=cai((2, H, D_QK), "<u2", "q", off=8)), ValueError, "q"),
    ("run-q-masked", lambda e: e.run(q=cai((2, H, D_QK), "<u2", "q", mask=object())), TypeError, "q"),
    ("run-q-bad-typestr", lambda e: e.run(q=cai((2, H, D_QK), "bf16", "q")), TypeError, "q"),
    ("run-q-bad-shape-entry", lambda e: e.run(q=cai((2, H, -576), "<u2", "q")), TypeError, "q"),
    ("run-q-interface-stream-0", lambda e: e.run(q=cai((2, H, D_QK), "<u2", "q", stream=0)), ValueError, "q"),
    ("run-q-host", lambda e: e.run(q=np.zeros((2, H, D_QK), np.uint16)), TypeError, "q"),
    ("run-q-raw-no-batch", lambda e: e.run(q=ADDR["q"]), ValueError, "batch"),
    # --- run: kv, kv_indptr, out, lse
    ("run-kv-None", lambda e: e.run(kv=None), TypeError, "kv"),
    ("run-kv-1d", lambda e: e.run(kv=cai((400 * 288,), "|u1", "kv")), ValueError, "kv"),
    ("run-kv-cols", lambda e: e.run(kv=cai((400, 576), "|u1", "kv")), ValueError, "kv"),
    ("run-kv-itemsize", lambda e: e.run(kv=cai((400, 288), "<u2", "kv")), TypeError, "kv"),
    ("run-kv-null", lambda e: e.run(kv=0), ValueError, "kv"),
    ("run-kv-host", lambda e: e.run(kv=MX.data), TypeError, "kv"),
    ("run-indptr-i8", lambda e: e.run(kv_indptr=cai((3,), "<i8", "kv_indptr")), TypeError, "kv_indptr"),
    ("run-indptr-u4", lambda e: e.run(kv_indptr=cai((3,), "<u4", "kv_indptr")), TypeError, "kv_indptr"),
    ("run-indptr-f4", lambda e: e.run(kv_indptr=cai((3,), "<f4", "kv_indptr")), TypeError, "kv_indptr"),
    ("run-indptr-len", lambda e: e.run(kv_indptr=cai((4,), "<i4", "kv_indptr")), ValueError, "kv_indptr"),
    ("run-indptr-2d", lambda e: e.run(kv_indptr=cai((3, 1), "<i4", "kv_indptr")), ValueError, "kv_indptr"),
    ("run-indptr-host", lambda e: e.run(kv_indptr=INDPTR), TypeError, "kv_indptr"),
    ("run-out-f4", lambda e: e.run(out=cai((2, H, D_V), "<f4", "out")), TypeError, "out"),
    ("run-out-shape", lambda e: e.run(out=cai((2, H, D_QK), "<u2", "out")), ValueError, "out"),
    ("run-out-misaligned", lambda e: e.run(out=cai((2, H, D_V), "<u2", "out", off=4)), ValueError, "out"),
    ("run-out-readonly", lambda e: e.run(out=cai((2, H, D_V), "<u2", "out", data=(ADDR["out"], True))),
     ValueError, "out"),
    ("run-lse-f8", lambda e: e.run(lse=cai((2, H), "<f8", "lse")), TypeError, "lse"),
    ("run-lse-shape", lambda e: e.run(lse=cai((2, H, 1), "<f4", "lse")), ValueError, "lse"),
    ("run-lse-readonly", lambda e: e.run(lse=cai((2, H), "<f4", "lse", data=(ADDR["lse"], True))),
     ValueError, "lse"),
    # --- run: scales and their strides
    ("run-kv_scale-None", lambda e: e.run(kv_scale=None), ValueError, "kv_scale"),
    ("run-kv_scale-1d", lambda e: e.run(kv_scale=cai((400 * 24,), "|u1", "kv_scale")), ValueError, "kv_scale"),
    ("run-kv_scale-host", lambda e: e.run(kv_scale=MX.scales), TypeError, "kv_scale"),
    ("run-kv_scale-rows", lambda e: e.run(kv_scale=cai((399, 24), "|u1", "kv_scale")), ValueError, "kv_scale"),
    ("run-kv_scale-itemsize", lambda e: e.run(kv_scale=cai((400, 24), "<u2", "kv_scale")), TypeError, "kv_scale"),
    ("run-stride-2**32+24", lambda e: e.run_raw(kv_scale_stride=2**32 + 24), ValueError, "kv_scale_stride"),
    ("run-stride-float", lambda e: e.run_raw(kv_scale_stride=24.0), TypeError, "kv_scale_stride"),
    ("run-stride-str", lambda e: e.run_raw(kv_scale_stride="24"), TypeError, "kv_scale_stride"),
    ("run-stride-bool", lambda e: e.run_raw(kv_scale_stride=True), TypeError, "kv_scale_stride"),
    ("run-stride-np-float", lambda e: e.run_raw(kv_scale_stride=np.float64(24)), TypeError, "kv_scale_stride"),
    ("run-stride-17", lambda e: e.run_raw(kv_scale_stride=17), ValueError, "kv_scale_stride"),
    ("run-stride-neg", lambda e: e.run_raw(kv_scale_stride=-24), ValueError, "kv_scale_stride"),
    ("run-stride-missing", lambda e: e.run_raw(kv_scale_stride=None), ValueError, "kv_scale_stride"),
    ("run-stride-disagrees", lambda e: e.run(kv_scale_stride=16), ValueError, "kv_scale_stride"),
    ("run-kv_scale-on-bf16", lambda e: e.run("bf16", kv_scale=cai((400, 24), "|u1", "kv_scale")),
     ValueError, "kv_scale"),
    ("run-fp8_scale-1e39", lambda e: e.run("fp8", fp8_scale=1e39), ValueError, "fp8_scale"),
    ("run-fp8_scale-1e-50", lambda e: e.run("fp8", fp8_scale=1e-50), ValueError, "fp8_scale"),
    ("run-fp8_scale-None", lambda e: e.run("fp8", fp8_scale=None), ValueError, "fp8_scale"),
    ("run-fp8_scale-str", lambda e: e.run("fp8", fp8_scale="x"), TypeError, "fp8_scale"),
    ("run-fp8_scale-inf", lambda e: e.run("fp8", fp8_scale=float("inf")), ValueError, "fp8_scale"),
    ("run-fp8_scale-0", lambda e: e.run("fp8", fp8_scale=0.0), ValueError, "fp8_scale"),
    ("run-fp8_scale-bool", lambda e: e.run("fp8", fp8_scale=True), TypeError, "fp8_scale"),
    # --- run: batch, page tables
    ("run-batch-0", lambda e: e.run_raw(batch=0), ValueError, "batch"),
    ("run-batch-neg", lambda e: e.run_raw(batch=-2), ValueError, "batch"),
    ("run-batch-bool", lambda e: e.run_raw(batch=True), ValueError, "batch"),
    ("run-batch-str", lambda e: e.run_raw(batch="2"), ValueError, "batch"),
    ("run-batch-over-reserve", lambda e: e.run_raw(batch=2**31), ValueError, "batch"),
    ("run-batch-vs-q", lambda e: e.run(batch=3), ValueError, "q"),
    ("run-page_size-3", lambda e: e.run(**paged(), page_size=3), ValueError, "page_size"),
    ("run-page_size-256", lambda e: e.run(**paged(), page_size=256), ValueError, "page_size"),
    ("run-page_size-float", lambda e: e.run(**paged(), page_size=16.0), ValueError, "page_size"),
    ("run-page_size-no-table", lambda e: e.run(page_size=16), ValueError, "page_size"),
    ("run-indices-alone", lambda e: e.run(kv_indices=cai((64,), "<i4", "kv_indices")), ValueError,
     "kv_indices/kv_last_page_len"),
    ("run-indices-i8", lambda e: e.run(**paged(kv_indices=cai((64,), "<i8", "kv_indices")), page_size=16),
     TypeError, "kv_indices"),
    ("run-indices-2d", lambda e: e.run(**paged(kv_indices=cai((8, 8), "<i4", "kv_indices")), page_size=16),
     ValueError, "kv_indices"),
    ("run-last-shape", lambda e: e.run(**paged(kv_last_page_len=cai((3,), "<i4", "kv_last_page_len")),
                                       page_size=16), ValueError, "kv_last_page_len"),
    ("run-last-u4", lambda e: e.run(**paged(kv_last_page_len=cai((2,), "<u4", "kv_last_page_len")),
                                    page_size=16), TypeError, "kv_last_page_len"),
    # --- Decoder.decode (numpy)
    ("decode-layout-None", lambda e: e.decoder().decode(Q, MX, None), TypeError, "layout"),
    ("decode-layout-list", lambda e: e.decoder().decode(Q, MX, [0, 3, 8]), TypeError, "layout"),
    ("decode-q-f32", lambda e: e.decoder().decode(Q.astype(np.float32), MX, INDPTR), TypeError, "q"),
    ("decode-q-f16", lambda e: e.decoder().decode(Q.astype(np.float16), MX, INDPTR), TypeError, "q"),
    ("decode-q-batch", lambda e: e.decoder().decode(Q[:1], MX, INDPTR), ValueError, "q"),
    ("decode-q-nan", lambda e: e.decoder().decode(NaN_Q, MX, INDPTR), ValueError, "q"),
    ("decode-kv-type", lambda e: e.decoder().decode(Q, MX.data, INDPTR), TypeError, "kv"),
    ("decode-kv-format", lambda e: e.decoder().decode(Q, BF16, INDPTR), ValueError, "kv"),
    ("decode-indptr-past-cache", lambda e: e.decoder().decode(Q, MX, np.array([0, 3, 9], np.int32)),
     ValueError, "kv_indptr"),
    ("decode-indptr-u4", lambda e: e.decoder().decode(Q, MX, INDPTR.astype(np.uint32)), TypeError, "kv_indptr"),
    ("decode-indptr-f8", lambda e: e.decoder().decode(Q, MX, INDPTR.astype(np.float64)), TypeError, "kv_indptr"),
    # --- reference
    # --- KVCache: an mxfp4 cache without its scales, a bf16 one of values, not bits, is refused when made
    ("kvcache-mxfp4-no-scales", lambda e: mx_without_scales(), ValueError, "scales"),
    ("kvcache-format", lambda e: KVCache("fp4", MX.data, scales=MX.scales), ValueError, "format"),
    ("kvcache-bf16-f32", lambda e: KVCache("bf16", BF16.dequantize()), TypeError, "data"),
    ("kvcache-fp8-scale-0", lambda e: KVCache("fp8", np.zeros((3, D_QK), np.uint8), fp8_scale=0.0), ValueError,
     "fp8_scale"),
    ("kvcache-fp8-e5m2", lambda e: KVCache("fp8", np.zeros((3, D_QK), ml_dtypes.float8_e5m2)), TypeError, "data"),
    ("kvcache-mxfp4-width", lambda e: KVCache("mxfp4", MX.data[:, :100], scales=MX.scales), ValueError, "data"),
    ("kvcache-mxfp4-scale-rows", lambda e: KVCache("mxfp4", MX.data, scales=MX.scales[:1]), ValueError, "scales"),
    ("ref-sm_scale-None", lambda e: mla_decode_reference(Q, MX, INDPTR, None), TypeError, "sm_scale"),
    ("ref-sm_scale-str", lambda e: mla_decode_reference(Q, MX, INDPTR, "x"), TypeError, "sm_scale"),
    ("ref-sm_scale-nan", lambda e: mla_decode_reference(Q, MX, INDPTR, float("nan")), ValueError, "sm_scale"),
    ("ref-q-list", lambda e: mla_decode_reference(Q.tolist(), MX, INDPTR, 0.1), TypeError, "q"),
    ("ref-q-2d", lambda e: mla_decode_reference(Q[0], MX, INDPTR, 0.1), ValueError, "q"),
    ("ref-q-nan", lambda e: mla_decode_reference(NaN_Q, MX, INDPTR, 0.1), ValueError, "q"),
    ("ref-q-width", lambda e: mla_decode_reference(Q[..., :512], MX, INDPTR, 0.1), ValueError, "q"),
    ("ref-kv-type", lambda e: mla_decode_reference(Q, X, INDPTR, 0.1), TypeError, "kv"),
    ("ref-layout-None", lambda e: mla_decode_reference(Q, MX, None, 0.1), TypeError, "layout"),
    ("ref-indptr-decreasing", lambda e: mla_decode_reference(Q, MX, np.array([0, 5, 3], np.int32), 0.1),
     ValueError, "kv_indptr"),
    ("ref-indptr-start", lambda e: mla_decode_reference(Q, MX, np.array([1, 3, 8], np.int32), 0.1),
     ValueError, "kv_indptr"),
    ("ref-seqs-range", lambda e: mla_decode_reference(Q, MX, INDPTR, 0.1, seqs=[2]), ValueError, "seqs"),
    ("ref-seqs-float", lambda e: mla_decode_reference(Q, MX, INDPTR, 0.1, seqs=[0.5]), TypeError, "seqs"),
    ("ref-d_v-too-wide", lambda e: mla_decode_reference(Q, MX, INDPTR, 0.1, d_v=600), ValueError, "d_v"),
    ("ref-d_v-float", lambda e: mla_decode_reference(Q, MX, INDPTR, 0.1, d_v=512.0), TypeError, "d_v"),
    # --- formats
    ("quantize_kv-format", lambda e: quantize_kv(X, "int4"), ValueError, "format"),
    ("quantize_kv-1d", lambda e: quantize_kv(X[0], "bf16"), ValueError, "x"),
    ("quantize_kv-int", lambda e: quantize_kv(X.astype(np.int32), "bf16"), TypeError, "x"),
    ("quantize_kv-inf", lambda e: quantize_kv(INF_X, "mxfp4"), ValueError, "x"),
    ("quantize_kv-list", lambda e: quantize_kv(X.tolist(), "fp8"), TypeError, "x"),
    ("quantize_kv-fp8_scale-1e39", lambda e: quantize_kv(X, "fp8", fp8_scale=1e39), ValueError, "fp8_scale"),
    ("quantize_kv-fp8_scale-1e-50", lambda e: quantize_kv(X, "fp8", fp8_scale=1e-50), ValueError, "fp8_scale"),
    ("quantize_kv-fp8_scale-None-ok-str", lambda e: quantize_kv(X, "fp8", fp8_scale="x"), TypeError, "fp8_scale"),
    ("quantize_kv-fp8_variant", lambda e: quantize_kv(X, "fp8", fp8_variant="e5m2"), ValueError, "fp8_variant"),
    ("quantize_kv-rule", lambda e: quantize_kv(X, "mxfp4", rule="nearest"), ValueError, "rule"),
    ("mxfp4-width", lambda e: mxfp4_quantize(X[:, :100]), ValueError, "x"),
    ("mxfp4-stride-small", lambda e: mxfp4_quantize(X, scale_stride=8), ValueError, "scale_stride"),
    ("mxfp4-stride-str", lambda e: mxfp4_quantize(X, scale_stride="24"), TypeError, "scale_stride"),
    ("mxfp4-stride-float", lambda e: mxfp4_quantize(X, scale_stride=24.0), TypeError, "scale_stride"),
    ("mxfp4-rounding", lambda e: mxfp4_quantize(X, rounding="up"), ValueError, "rounding"),
    ("fp8-tiny-amax", lambda e: fp8_quantize(np.full((2, 32), 1e-44, np.float32)), ValueError, "x"),
    ("fp8-scale-1e39", lambda e: fp8_quantize(X, scale=1e39), ValueError, "scale"),
    ("fp8-scale-1e-50", lambda e: fp8_quantize(X, scale=1e-50), ValueError, "scale"),
    ("fp8-scale-None-str", lambda e: fp8_quantize(X, scale="x"), TypeError, "scale"),
    ("fp8-variant", lambda e: fp8_quantize(X, "e5m2"), ValueError, "variant"),
    ("fp8-nan", lambda e: fp8_quantize(np.full((2, 32), np.nan, np.float32)), ValueError, "x"),
    ("mxfp4_dequantize-scales", lambda e: formats.mxfp4_dequantize(MX.data, MX.scales[:4]), ValueError, "scales"),
    # --- paging
    ("layout-indptr-list", lambda e: KvLayout([0, 3]), TypeError, "kv_indptr"),
    ("layout-indptr-u4", lambda e: KvLayout(INDPTR.astype(np.uint32)), TypeError, "kv_indptr"),
    ("layout-indptr-short", lambda e: KvLayout(np.array([0], np.int32)), ValueError, "kv_indptr"),
    ("layout-indptr-int64-past-int32", lambda e: KvLayout(np.array([0, 2**31], np.int64)), ValueError, "kv_indptr"),
    ("layout-page_size", lambda e: KvLayout(INDPTR, page_size=12), ValueError, "page_size"),
    ("layout-page_size-bool", lambda e: KvLayout(INDPTR, page_size=True), ValueError, "page_size"),
    ("layout-indices-alone", lambda e: KvLayout(INDPTR, np.arange(8, dtype=np.int32)), ValueError,
     "kv_last_page_len"),
    ("layout-indices-neg", lambda e: KvLayout(np.array([0, 1, 2], np.int32), np.array([0, -1], np.int32),
                                              np.array([1, 1], np.int32), 1), ValueError, "kv_indices"),
    ("layout-indices-f4", lambda e: KvLayout(np.array([0, 1, 2], np.int32), np.zeros(2, np.float32),
                                             np.array([1, 1], np.int32), 1), TypeError, "kv_indices"),
    ("layout-indices-past-int32", lambda e: KvLayout(np.array([0, 1], np.int32), np.array([2**31], np.int64),
                                                     np.array([1], np.int32), 1), ValueError, "kv_indices"),
    ("layout-indptr-past-indices", lambda e: KvLayout(np.array([0, 3], np.int32), np.zeros(2, np.int32),
                                                      np.array([1], np.int32), 16), ValueError, "kv_indptr"),
    ("layout-last-range", lambda e: KvLayout(np.array([0, 1], np.int32), np.zeros(1, np.int32),
                                             np.array([17], np.int32), 16), ValueError, "kv_last_page_len"),
    ("layout-last-shape", lambda e: KvLayout(np.array([0, 1], np.int32), np.zeros(1, np.int32),
                                             np.array([1, 1], np.int32), 16), ValueError, "kv_last_page_len"),
    ("contiguous-neg", lambda e: KvLayout.contiguous([3, -1]), ValueError, "seq_lens"),
    ("contiguous-float", lambda e: KvLayout.contiguous([3.0, 1.5]), TypeError, "seq_lens"),
    ("contiguous-empty", lambda e: KvLayout.contiguous([]), ValueError, "seq_lens"),
    ("contiguous-total", lambda e: KvLayout.contiguous([2**30, 2**30]), ValueError, "seq_lens"),
    ("page-table-page_size", lambda e: random_page_table([5, 9], 10, RNG), ValueError, "page_size"),
    ("page-table-rng", lambda e: random_page_table([5, 9], 16, 0), TypeError, "rng"),
    ("page-table-spare", lambda e: random_page_table([5, 9], 16, RNG, spare_pages=-1), ValueError, "spare_pages"),
    ("page-table-shared", lambda e: random_page_table([5, 9], 16, RNG, shared=1.5), TypeError, "shared"),
    ("page-table-lens-None", lambda e: random_page_table(None, 16, RNG), TypeError, "seq_lens"),
    ("page-table-lens-str", lambda e: random_page_table("12", 16, RNG), TypeError, "seq_lens"),
    # --- schedule
    ("policy-target-0", lambda e: SplitPolicy(0), ValueError, "target_items"),
    ("policy-target-str", lambda e: SplitPolicy("8"), ValueError, "target_items"),
    ("policy-target-bool", lambda e: SplitPolicy(True), ValueError, "target_items"),
    ("policy-align", lambda e: SplitPolicy(8, align_tokens=100), ValueError, "align_tokens"),
    ("policy-min-huge", lambda e: SplitPolicy(8, min_split_tokens=2**31), ValueError, "min_split_tokens"),
    ("policy-fast-neg", lambda e: SplitPolicy(8, fast_tile=-1), ValueError, "fast_tile"),
    ("policy-fast-divide", lambda e: SplitPolicy(8, fast_tile=48), ValueError, "fast_tile"),
    ("for_device-cus", lambda e: SplitPolicy.for_device(0), ValueError, "num_cus"),
    ("for_device-items-str", lambda e: SplitPolicy.for_device(8, items_per_cu="2"), ValueError, "items_per_cu"),
    ("for_device-fast-str", lambda e: SplitPolicy.for_device(8, fast_tile="128"), ValueError, "fast_tile"),
    ("max_items-0", lambda e: POLICY.max_items(0), ValueError, "rows"),
    ("schedule-policy", lambda e: schedule.schedule([5, 9], "policy"), TypeError, "policy"),
    ("schedule-lens-float", lambda e: schedule.schedule([5.0], POLICY), TypeError, "seq_lens"),
    ("schedule-lens-2d", lambda e: schedule.schedule([[5, 9]], POLICY), ValueError, "seq_lens"),
    ("schedule-lens-neg", lambda e: schedule.schedule([5, -9], POLICY), ValueError, "seq_lens"),
    ("schedule-lens-uint64", lambda e: schedule.schedule(np.array([5, 2**64 - 1], np.uint64), POLICY),
     ValueError, "seq_lens"),
    ("schedule-lens-bool", lambda e: schedule.schedule([True, False], POLICY), TypeError, "seq_lens"),
    # --- emulator
    ("emulate-layout-None", lambda e: emulate_decode(Q, MX, None, 0.1, POLICY), TypeError, "layout"),
    ("emulate-q-nan", lambda e: emulate_decode(NaN_Q, MX, INDPTR, 0.1, POLICY), ValueError, "q"),
    ("emulate-q-int", lambda e: emulate_decode(Q.view(np.int16), MX, INDPTR, 0.1, POLICY), TypeError, "q"),
    ("emulate-kv", lambda e: emulate_decode(Q, X, INDPTR, 0.1, POLICY), TypeError, "kv"),
    ("emulate-sm_scale", lambda e: emulate_decode(Q, MX, INDPTR, None, POLICY), TypeError, "sm_scale"),
    ("emulate-q_precision", lambda e: emulate_decode(Q, MX, INDPTR, 0.1, POLICY, q_precision="int8"),
     ValueError, "q_precision"),
    ("emulate-indptr-past-cache", lambda e: emulate_decode(Q, MX, np.array([0, 3, 20], np.int32), 0.1, POLICY),
     ValueError, "kv_indptr"),
]

assert len({c[0] for c in CASES}) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("call, exc, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_its_name(monkeypatch, call, exc, name):
    env = Env(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the argument's own message, never a numpy warning first
        with pytest.raises(exc, match=f"^{re.escape(name)}:") as info:
            call(env)
    assert info.type is exc  # not a subclass standing in for another kind of error
    for gpu in env.gpus:
        assert gpu.launches == [], "nothing may be launched for a bad argument"
        assert {k for k in gpu.host_calls() if k != "copy_htod" and k != "alloc"} <= {"free"}


def test_the_battery_is_big_enough():
    assert len(CASES) >= 60


def test_messages_say_what_came(monkeypatch):
    """The details the issue found unclear: the real value, the real type."""
    from hipmla.schedule import check_lens

    with pytest.raises(ValueError, match="18446744073709551615"):  # not its wrapped -1
        check_lens(np.array([2**64 - 1], np.uint64))
    gpu = fake_runtime(monkeypatch, "sm_90")  # undone after the test
    with pytest.raises(TypeError) as info:
        Decoder("mxfp4", 0.1, heads="16")
    assert "'16'" in str(info.value) and "got 16 " not in str(info.value) + " "
    with pytest.raises(TypeError, match="int32") as info:
        decode.device_ptr(FakeCAI((3,), "<i8"), "kv_indptr", itemsize=4, kinds="i")
    with pytest.raises(ValueError) as info:
        fp8_quantize(np.full((2, 32), 1e-44, np.float32))
    assert "scale" not in str(info.value).split(":")[0]
    with pytest.raises(TypeError, match="^kv_scale: got a host numpy array"):
        decode._scale_stride(np.zeros(24 * 4, np.uint8), 24)
    assert gpu.launches == []


def test_good_inputs_next_to_the_bad_ones_still_pass(monkeypatch):
    """The battery's neighbours in value are accepted: its checks are not too eager."""
    gpu, dec = make(monkeypatch)
    dec.run(**args(), stream=7)
    dec.run(**args(), stream=np.uint64(7))
    dec.run(**args(q=cai((2, H, D_QK), "<u2", "q", stream=1)))  # v3: 1 is the legacy default stream
    dec.run(**args(out=cai((2, H, D_V), "<u2", "out", data=(ADDR["out"], False))))
    dec.run(**args(kv_scale=ADDR["kv_scale"], kv_scale_stride=np.int64(24)))
    assert len(gpu.launches) == 5
    Decoder("fp8", np.float32(0.1), heads=np.int64(16), device=np.int32(0))
    quantize_kv(X, "fp8", fp8_scale=np.float32(0.01))
    mxfp4_quantize(X, scale_stride=np.int64(24))
    mla_decode_reference(Q, MX, INDPTR, 0.1, seqs=np.array([1], np.int32))
    KvLayout(np.array([0, 2**30, 2**31 - 1], np.int64))
