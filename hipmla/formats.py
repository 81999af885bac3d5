"""KV-cache formats: MXFP4 (OCP MX), FP8 per tensor, BF16 — host-side encode and decode.

Byte layouts (what the device kernels read):

* ``bf16``:  ``data (rows, n)`` uint16, the bf16 bit patterns.
* ``fp8``:   ``data (rows, n)`` uint8 e4m3 bit patterns plus one f32 ``scale``;
  value = fp8 * scale. Variant ``e4m3fn`` (OCP; gfx950, NVIDIA; max 448) or
  ``e4m3fnuz`` (gfx942; max 240, no negative zero, 0x80 is NaN).
* ``mxfp4``: ``data (rows, n/2)`` uint8 — byte j holds element 2j in the low nibble and
  element 2j+1 in the high nibble, each E2M1 (sign, 2 exponent bits, 1 mantissa bit);
  ``scales (rows, stride)`` uint8 E8M0, scale c covers elements 32c .. 32c+31;
  value = e2m1 * 2^(scale - 127). E8M0 255 is NaN, 0 decodes to 2^-127. Bytes of a
  scale row past n/32 are padding (written 0, never read).

Every function here is vectorised over rows and processes large caches in bounded
chunks, so a 2M-row cache quantizes in seconds without a copy of it in f64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import ml_dtypes
import numpy as np

from hipmla.validate import check_array, check_choice, check_finite, check_int, check_positive_finite

MX_BLOCK = 32
#: E2M1 magnitudes by code (bits 0-2); bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_MAX = 6.0
_E2M1_CODE_OF_TWICE = np.zeros(13, dtype=np.uint8)  # code of a magnitude, indexed by 2 * value
_E2M1_CODE_OF_TWICE[(E2M1_VALUES * 2).astype(np.int64)] = np.arange(8, dtype=np.uint8)
#: All 16 codes decoded (signed), for table lookups.
E2M1_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)

#: Scale rules for an MX block (unbiased exponent before clamping):
#: ``"even"`` — the widely used producer rule: add 0x200000 to amax's f32 bits, keep
#: sign and exponent (mask 0xFF800000), then floor(log2(.)) - 2. It rounds amax up
#: when its mantissa is >= 0.75, so fewer elements saturate at 6.
#: ``"floor"`` — the plain OCP MX rule floor(log2(amax)) - 2.
SCALE_RULES = ("even", "floor")
#: Element rounding: ``"rne"`` round-to-nearest-even with saturation at +-6 (what the
#: gfx950 converts and ml_dtypes' float4_e2m1fn do); ``"legacy_ties_away"`` rounds ties
#: away from zero (older caches were written that way).
ROUNDINGS = ("rne", "legacy_ties_away")

FP8_VARIANTS = ("e4m3fn", "e4m3fnuz")
_FP8_DTYPE = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}
FP8_MAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}
#: Largest unbiased exponent of an fp8 element: the MX scale rule subtracts it.
FP8_EMAX = {"e4m3fn": 8, "e4m3fnuz": 7}

KV_FORMATS = ("bf16", "fp8", "mxfp4")
_CHUNK_ELEMS = 1 << 23  # elements per processing chunk: bounds temporaries to ~100 MB


def _row_chunks(rows: int, n: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMS // max(n, 1))
    for r0 in range(0, rows, step):
        yield slice(r0, min(rows, r0 + step))


def _chunk(x: np.ndarray, sl: slice) -> np.ndarray:
    """Rows ``sl`` of float input in the width it is rounded from: float64 as it is (rounded
    to the format once), narrower floats as float32 (exact)."""
    return x[sl] if x.dtype == np.float64 else x[sl].astype(np.float32)


def _as_float_rows(x, name: str) -> np.ndarray:
    """Accept f16/bf16/f32/f64 2-D input; returns the array unchanged."""
    check_array(x, name, ndim=2, contiguous=False)
    if x.dtype not in (np.float16, np.float32, np.float64) and x.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"{name}: expected a float16/bfloat16/float32/float64 array, got {x.dtype}")
    return x


# ----------------------------------------------------------------------------- bf16


def to_bf16(x) -> np.ndarray:
    """Round to bf16 (nearest-even, once: float64 is not rounded to float32 on the way);
    returns an ml_dtypes.bfloat16 array."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        return x.astype(ml_dtypes.bfloat16)
    return x.astype(np.float32).astype(ml_dtypes.bfloat16)


def bf16_bits(x) -> np.ndarray:
    """bf16 bit patterns (uint16) of ``x`` rounded nearest-even."""
    return to_bf16(x).view(np.uint16)


def bf16_from_bits(bits: np.ndarray) -> np.ndarray:
    """f32 values of bf16 bit patterns (exact)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- E8M0


def e8m0_to_f32(scales: np.ndarray) -> np.ndarray:
    """2^(s - 127) for E8M0 codes; 255 is NaN. Exact in f32 (0 gives the subnormal 2^-127)."""
    s = np.asarray(scales, dtype=np.uint8)
    with np.errstate(over="ignore"):  # 255 overflows here and becomes NaN below
        out = np.ldexp(np.float32(1.0), s.astype(np.int32) - 127).astype(np.float32)
    out[s == 255] = np.nan
    return out


def mx_scale_exponent(amax: np.ndarray, rule: str, emax: int) -> np.ndarray:
    """Unbiased block exponent in [-127, 127] from block amax (f32) for an element format
    whose largest exponent is ``emax`` (2 for E2M1, 8 for e4m3fn)."""
    check_choice(rule, "rule", SCALE_RULES)
    a = np.asarray(amax, dtype=np.float32)
    if rule == "even":
        bits = (a.view(np.uint32) + np.uint32(0x200000)) & np.uint32(0xFF800000)
        rounded = bits.view(np.float32)
        # Rounding amax >= 1.75 * 2^127 up would overflow to inf; such a block keeps its
        # own binade (scale 2^125), the largest that still decodes to finite values.
        a = np.where(np.isinf(rounded), a, rounded)
    # frexp is exact for subnormals too: a = m * 2^e with m in [0.5, 1).
    _, e = np.frexp(a)
    e = np.where(a > 0, e.astype(np.int32) - 1, -127)
    return np.clip(e - emax, -127, 127).astype(np.int32)


# ----------------------------------------------------------------------------- E2M1


def e2m1_encode(y: np.ndarray, rounding: str = "rne") -> np.ndarray:
    """Codes (uint8, 0..15) of already-scaled values ``y``; saturates at +-6.

    E2M1 has one mantissa bit, so rounding is to a multiple of the quantum of the
    binade: 0.5 below 2, 1 in [2, 4), 2 from 4 up. ``np.rint`` rounds halves to even,
    which is the even *code* too (the code's low bit is the mantissa bit). The sign bit
    follows the sign of ``y`` (-0.1 becomes negative zero, 0x8), as the hardware
    converts and ml_dtypes do.
    """
    check_choice(rounding, "rounding", ROUNDINGS)
    y = np.asarray(y)
    # float64 stays float64 (rounded once); the quantum steps are exact in either width.
    dt = np.float64 if y.dtype == np.float64 else np.float32
    a = np.abs(y.astype(dt, copy=False))
    if np.isnan(a).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(a))[0])
        raise ValueError(f"y: NaN at index {idx}; E2M1 has no NaN code")
    quantum = np.where(a < 2, dt(0.5), np.where(a < 4, dt(1), dt(2)))
    with np.errstate(invalid="ignore"):  # inf: inf - inf below; it saturates to 6 all the same
        steps = a / quantum
        if rounding == "rne":
            steps = np.rint(steps)
        else:  # ties away; compare the fraction, since steps + 0.5 can round up in f32
            whole = np.floor(steps)
            steps = whole + (steps - whole >= dt(0.5))
    twice = np.minimum(steps * quantum, dt(E2M1_MAX)) * 2  # in {0,1,2,3,4,6,8,12}
    code = _E2M1_CODE_OF_TWICE[twice.astype(np.uint8)]
    return code | (np.signbit(y).astype(np.uint8) << 3)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    return E2M1_TABLE[np.asarray(codes, dtype=np.uint8) & 0xF]


# ----------------------------------------------------------------------------- MXFP4


@dataclass(frozen=True)
class MXFP4Tensor:
    """Packed MXFP4 rows: ``data (rows, n/2)`` uint8, ``scales (rows, stride)`` uint8."""

    data: np.ndarray
    scales: np.ndarray
    n: int

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def scale_stride(self) -> int:
        return int(self.scales.shape[1])

    def dequantize(self) -> np.ndarray:
        return mxfp4_dequantize(self.data, self.scales, self.n)


def default_scale_stride(n: int) -> int:
    """Scale row stride real producers use: n/32 padded to a multiple of 8 (576 -> 24)."""
    return -(-(n // MX_BLOCK) // 8) * 8


def mxfp4_quantize(
    x,
    *,
    rule: str = "even",
    rounding: str = "rne",
    scale_stride: int | None = None,
) -> MXFP4Tensor:
    """Quantize rows of ``x`` (rows, n), n a multiple of 32, to MXFP4.

    ``scale_stride`` defaults to n/32 (18 for 576); pass ``default_scale_stride(n)`` (24)
    for the padded layout. NaN/Inf input raises ValueError. float64 input is rounded to
    E2M1 once; its block amax enters the scale rule (defined on float32 bits) truncated
    to float32, so the rule sees the binade and threshold of the true value.
    """
    x = _as_float_rows(x, "x")
    check_choice(rule, "rule", SCALE_RULES)
    check_choice(rounding, "rounding", ROUNDINGS)
    rows, n = x.shape
    if n % MX_BLOCK or n == 0:
        raise ValueError(f"x: row length must be a positive multiple of {MX_BLOCK}, got {n}")
    nb = n // MX_BLOCK
    stride = nb if scale_stride is None else check_int(scale_stride, "scale_stride", 1, (1 << 31) - 1)
    if stride < nb:
        raise ValueError(f"scale_stride: must be >= n/32 = {nb}, got {scale_stride}")
    data = np.empty((rows, n // 2), dtype=np.uint8)
    scales = np.zeros((rows, stride), dtype=np.uint8)
    for sl in _row_chunks(rows, n):
        xc = _chunk(x, sl)
        check_finite(xc, "x")
        blocks = xc.reshape(-1, nb, MX_BLOCK)
        amax = np.abs(blocks).max(axis=2)
        if xc.dtype == np.float64:
            a32 = amax.astype(np.float32)
            amax = np.where(a32.astype(np.float64) > amax, np.nextafter(a32, np.float32(0)), a32)
        e = mx_scale_exponent(amax, rule, emax=2)
        # Scaling by 2^-e is exact in f32: e <= 126 for finite input, so 2^-e is normal.
        y = blocks * np.ldexp(blocks.dtype.type(1), -e)[..., None]
        codes = e2m1_encode(y, rounding).reshape(-1, n)
        data[sl] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[sl, :nb] = (e + 127).astype(np.uint8)
    return MXFP4Tensor(data=data, scales=scales, n=n)


def mxfp4_dequantize(data: np.ndarray, scales: np.ndarray, n: int | None = None) -> np.ndarray:
    """Exact f32 values (rows, n) of packed MXFP4 rows. E8M0 255 gives NaN; the scales no
    quantizer here writes, 253 and 254, give inf for codes whose value passes float32's
    largest (6 x 2^127 does), as the kernels' float32 arithmetic would."""
    check_array(data, "data", dtype=np.uint8, ndim=2, contiguous=False)
    rows = data.shape[0]
    n = data.shape[1] * 2 if n is None else int(n)
    if n != data.shape[1] * 2 or n % MX_BLOCK:
        raise ValueError(f"data: expected (rows, n/2) with n a multiple of 32, got {data.shape} for n={n}")
    nb = n // MX_BLOCK
    check_array(scales, "scales", dtype=np.uint8, ndim=2, contiguous=False)
    if scales.shape[0] != rows or scales.shape[1] < nb:
        raise ValueError(f"scales: expected shape ({rows}, >= {nb}), got {scales.shape}")
    out = np.empty((rows, n), dtype=np.float32)
    for sl in _row_chunks(rows, n):
        d = data[sl]
        vals = np.empty((d.shape[0], n), dtype=np.float32)
        vals[:, 0::2] = E2M1_TABLE[d & 0xF]
        vals[:, 1::2] = E2M1_TABLE[d >> 4]
        s = e8m0_to_f32(scales[sl, :nb])
        with np.errstate(over="ignore"):  # past float32: inf, as documented
            out[sl] = (vals.reshape(-1, nb, MX_BLOCK) * s[..., None]).reshape(-1, n)
    return out


def mx_fake_quantize(x, element: str, rule: str = "floor") -> np.ndarray:
    """Quantize-dequantize rows (..., n) to an MX format: E8M0 per 32 elements and
    ``element`` in ``"e2m1"``, ``"e4m3fn"``, ``"e4m3fnuz"`` (nearest-even, saturating).

    This is how the kernels quantize Q on the device when Q precision is fp8 or mxfp4;
    the result is exact in f32.
    """
    check_choice(element, "element", ("e2m1",) + FP8_VARIANTS)
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {MX_BLOCK}, got {x.shape[-1]}")
    check_finite(x, "x")
    blocks = x.reshape(-1, x.shape[-1] // MX_BLOCK, MX_BLOCK)
    emax = 2 if element == "e2m1" else FP8_EMAX[element]
    e = mx_scale_exponent(np.abs(blocks).max(axis=2), rule, emax=emax)
    y = blocks.astype(np.float64) * np.ldexp(1.0, -e)[..., None]
    if element == "e2m1":
        vals = e2m1_decode(e2m1_encode(y))
    else:
        vals = fp8_to_f32(fp8_round(y, element), element)
    return (vals.astype(np.float64) * np.ldexp(1.0, e)[..., None]).astype(np.float32).reshape(x.shape)


# ----------------------------------------------------------------------------- FP8


@dataclass(frozen=True)
class FP8Tensor:
    """e4m3 bit patterns ``data`` (uint8) with one f32 per-tensor ``scale``."""

    data: np.ndarray
    scale: np.float32
    variant: str

    def dequantize(self) -> np.ndarray:
        return fp8_dequantize(self.data, self.scale, self.variant)


def fp8_round(y, variant: str = "e4m3fn") -> np.ndarray:
    """Round already-scaled values to e4m3 (nearest-even, saturating, once: float64 is not
    rounded to float32 on the way); returns bit patterns."""
    check_choice(variant, "variant", FP8_VARIANTS)
    m = FP8_MAX[variant]
    y = np.asarray(y)
    y = y if y.dtype == np.float64 else y.astype(np.float32)
    return np.clip(y, -m, m).astype(_FP8_DTYPE[variant]).view(np.uint8)


def fp8_to_f32(bits: np.ndarray, variant: str = "e4m3fn") -> np.ndarray:
    check_choice(variant, "variant", FP8_VARIANTS)
    return np.asarray(bits, dtype=np.uint8).view(_FP8_DTYPE[variant]).astype(np.float32)


def fp8_quantize(x, variant: str = "e4m3fn", scale: float | None = None) -> FP8Tensor:
    """Per-tensor FP8: ``scale = amax / fp8_max`` unless given; data = e4m3(x / scale)."""
    check_choice(variant, "variant", FP8_VARIANTS)
    x = _as_float_rows(x, "x")
    if scale is not None:
        scale = _f32_scale(scale, "scale")
    else:
        amax = 0.0
        for sl in _row_chunks(*x.shape):
            xc = _chunk(x, sl)
            check_finite(xc, "x")
            amax = max(amax, float(np.abs(xc).max(initial=0.0)))
        scale = amax / FP8_MAX[variant] if amax > 0 else 1.0
        if scale < np.finfo(np.float32).tiny:  # amax itself is the problem: no scale was given
            raise ValueError(f"x: its largest magnitude {amax:.3g} is too small for a per-tensor fp8 "
                             f"scale (amax / {FP8_MAX[variant]:g} = {scale:.3g} is below float32's "
                             f"smallest normal {np.finfo(np.float32).tiny:.3g}); pass scale= or rescale x")
    scale = np.float32(scale)
    data = np.empty(x.shape, dtype=np.uint8)
    for sl in _row_chunks(*x.shape):
        xc = _chunk(x, sl)
        check_finite(xc, "x")
        with np.errstate(over="ignore"):  # a quotient past the format saturates (fp8_round)
            data[sl] = fp8_round(xc / scale, variant)  # in xc's width: the f32 scale widens exactly
    return FP8Tensor(data=data, scale=scale, variant=variant)


def fp8_dequantize(data: np.ndarray, scale, variant: str = "e4m3fn") -> np.ndarray:
    check_array(data, "data", dtype=np.uint8, contiguous=False)
    return fp8_to_f32(data, variant) * _f32_scale(scale, "scale")


def _f32_scale(value, name: str) -> np.float32:
    """A scale given by the caller, as the f32 it becomes: finite, > 0 and normal."""
    v = check_positive_finite(value, name)
    f = np.float32(v) if v <= float(np.finfo(np.float32).max) else np.float32(np.inf)
    if not np.isfinite(f) or f < np.finfo(np.float32).tiny:
        raise ValueError(f"{name}: {value!r} is outside float32's normal range "
                         f"({np.finfo(np.float32).tiny:.3g} .. {np.finfo(np.float32).max:.3g})")
    return f


# ----------------------------------------------------------------------------- KV cache


@dataclass(frozen=True)
class KVCache:
    """A KV cache in one of the three formats, as the device reads it.

    ``data``: bf16 -> (rows, 576) uint16; fp8 -> (rows, 576) uint8; mxfp4 -> (rows, 288)
    uint8. ``scales``: mxfp4 E8M0 rows (rows, stride). ``fp8_scale``: f32 per tensor.
    """

    format: str
    data: np.ndarray
    scales: np.ndarray | None = None
    fp8_scale: float = 1.0
    fp8_variant: str = "e4m3fn"
    dim: int = 576

    def __post_init__(self):
        # Typed arrays of the format's own encoding are taken as their bit patterns (a
        # value cast would turn a bf16 0.35 into the code 0).
        check_choice(self.format, "format", KV_FORMATS)
        check_choice(self.fp8_variant, "fp8_variant", FP8_VARIANTS)
        dim = check_int(self.dim, "dim", 1)
        own = {"bf16": (np.uint16, ml_dtypes.bfloat16), "fp8": (np.uint8, _FP8_DTYPE[self.fp8_variant]),
               "mxfp4": (np.uint8,)}[self.format]
        data = self.data
        if isinstance(data, np.ndarray) and data.dtype in own[1:]:
            data = data.view(own[0])
            object.__setattr__(self, "data", data)
        check_array(data, "data", dtype=own[0], ndim=2, contiguous=False)
        cols = dim // 2 if self.format == "mxfp4" else dim
        if data.shape[1] != cols or self.format == "mxfp4" and dim % MX_BLOCK:
            raise ValueError(f"data: a {self.format} cache of {dim}-value rows is (rows, {cols}), got {data.shape}"
                             + (f" (dim must be a multiple of {MX_BLOCK})" if self.format == "mxfp4" else ""))
        if self.format == "fp8":
            _f32_scale(self.fp8_scale, "fp8_scale")
        if self.format != "mxfp4":
            if self.scales is not None:
                raise ValueError(f"scales: only an mxfp4 cache has block scales, this one is {self.format}")
            return
        scales = self.scales
        if scales is None:
            raise ValueError(f"scales: an mxfp4 cache needs its E8M0 scales, uint8 (rows, >= {dim // MX_BLOCK})")
        if isinstance(scales, np.ndarray) and scales.dtype == ml_dtypes.float8_e8m0fnu:
            scales = scales.view(np.uint8)
            object.__setattr__(self, "scales", scales)
        check_array(scales, "scales", dtype=np.uint8, ndim=2, contiguous=False)
        if scales.shape[0] != data.shape[0] or scales.shape[1] < dim // MX_BLOCK:
            raise ValueError(f"scales: expected shape ({data.shape[0]}, >= {dim // MX_BLOCK}), got {scales.shape}")

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def bytes_per_token(self) -> int:
        per = self.data.shape[1] * self.data.dtype.itemsize
        return int(per + (self.scales.shape[1] if self.scales is not None else 0))

    def dequantize(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Exact f32 values (rows, dim) of the selected rows (all by default)."""
        sel = slice(None) if rows is None else rows
        if self.format == "bf16":
            return bf16_from_bits(self.data[sel])
        if self.format == "fp8":
            return fp8_dequantize(self.data[sel], self.fp8_scale, self.fp8_variant)
        return mxfp4_dequantize(self.data[sel], self.scales[sel], self.dim)


def quantize_kv(
    x,
    format: str,
    *,
    rule: str = "even",
    rounding: str = "rne",
    scale_stride: int | None = None,
    fp8_variant: str = "e4m3fn",
    fp8_scale: float | None = None,
) -> KVCache:
    """Encode a float KV cache (rows, dim) into ``format``. ``rule``, ``rounding`` and
    ``scale_stride`` are mxfp4's, ``fp8_variant`` and ``fp8_scale`` fp8's; every one given
    is checked, the other formats ignore them."""
    check_choice(format, "format", KV_FORMATS)
    check_choice(fp8_variant, "fp8_variant", FP8_VARIANTS)
    check_choice(rule, "rule", SCALE_RULES)
    check_choice(rounding, "rounding", ROUNDINGS)
    # Checked whatever the format (callers pass one set of options for all three; each
    # format reads its own), so a bad value fails here, not when the format changes.
    if fp8_scale is not None:
        _f32_scale(fp8_scale, "fp8_scale")
    if scale_stride is not None:
        check_int(scale_stride, "scale_stride", 1, (1 << 31) - 1)
    x = _as_float_rows(x, "x")
    if format == "bf16":
        data = np.empty(x.shape, dtype=np.uint16)
        for sl in _row_chunks(*x.shape):
            xc = x[sl]
            check_finite(xc, "x")
            data[sl] = bits = bf16_bits(xc)
            past = (bits & 0x7FFF) == 0x7F80
            if past.any():
                idx = tuple(int(i) for i in np.argwhere(past)[0])
                raise ValueError(f"x: {float(xc[idx]):.6g} at index ({idx[0] + sl.start}, {idx[1]}) rounds to "
                                 f"inf in bf16 (largest finite {float(ml_dtypes.finfo(ml_dtypes.bfloat16).max):.6g})")
        return KVCache("bf16", data, dim=x.shape[1])
    if format == "fp8":
        t = fp8_quantize(x, fp8_variant, fp8_scale)
        return KVCache("fp8", t.data, fp8_scale=float(t.scale), fp8_variant=fp8_variant, dim=x.shape[1])
    t = mxfp4_quantize(x, rule=rule, rounding=rounding, scale_stride=scale_stride)
    return KVCache("mxfp4", t.data, scales=t.scales, dim=x.shape[1])
