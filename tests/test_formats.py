"""hipmla.formats: MXFP4 scale rules and rounding modes on known vectors, bit-for-bit
agreement with ml_dtypes and with oracles written here, packing, round trips, FP8 and
BF16, the KV-cache container, and argument validation."""

from __future__ import annotations

import math
import struct
import warnings

import ml_dtypes
import numpy as np
import pytest

from hipmla import formats as F

# E2M1 magnitudes by code, written out independently of the module's table.
E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ----------------------------------------------------------------------------- oracles


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def oracle_scale(amax: float, rule: str) -> int:
    """Biased E8M0 code of a block, the rules as DESIGN.md states them, in plain Python."""
    a = float(np.float32(amax))
    if rule == "even":
        a = f32_from_bits((f32_bits(a) + 0x200000) & 0xFF800000)
    if a == 0:
        return 0
    e = math.inf if math.isinf(a) else math.floor(math.log2(a))
    return int(min(max(e - 2, -127), 127)) + 127


def oracle_e2m1(y: float, rounding: str) -> int:
    """Code of the nearest E2M1 value; ties to the even code (rne) or away from zero."""
    dist = [abs(abs(y) - v) for v in E2M1_BY_CODE]  # beyond 6 the nearest is 6: saturation
    best = min(dist)
    ties = [c for c, d in enumerate(dist) if d == best]
    if len(ties) == 1:
        code = ties[0]
    elif rounding == "rne":
        code = next(c for c in ties if c % 2 == 0)
    else:
        code = max(ties)
    return code | (8 if math.copysign(1.0, y) < 0 else 0)


def oracle_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 round-to-nearest-even on the integer bits (finite input)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def block(*values: float) -> np.ndarray:
    """One 32-element row whose first elements are ``values``, the rest zero."""
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, : len(values)] = values
    return x


# ----------------------------------------------------------------------------- scale rules


@pytest.mark.parametrize(
    "amax, even, floor",
    [
        (1.0, 125, 125),
        (1.75, 126, 125),  # mantissa .75 rounds up under "even"
        (1.74, 125, 125),
        (6.0, 127, 127),
        (2.9e38, 252, 252),  # largest binade, mantissa < .75: no round-up
        (1e-40, 0, 0),  # f32 subnormal amax clamps to the smallest scale
        (1e-30, 25, 25),  # floor(log2(1e-30)) = -100
    ],
)
def test_scale_rules_known_vectors(amax, even, floor):
    assert oracle_scale(amax, "even") == even and oracle_scale(amax, "floor") == floor
    for rule, want in (("even", even), ("floor", floor)):
        got = F.mxfp4_quantize(block(amax, -amax / 3), rule=rule).scales[0, 0]
        assert got == want, f"rule={rule} amax={amax}: expected biased scale {want}, got {got}"


def test_scale_rules_sweep_against_oracle():
    rng = np.random.default_rng(0)
    amax = np.concatenate([
        np.float32(2.0) ** rng.integers(-140, 127, 400).astype(np.float32) * rng.uniform(1, 2, 400).astype(np.float32),
        np.float32([1.5, 1.7499999, 1.75, 1.8, 0.75, 3.5, 7.0, 1e-45]),
    ]).astype(np.float32)
    for rule in F.SCALE_RULES:
        got = F.mx_scale_exponent(amax, rule, emax=2) + 127
        want = np.array([oracle_scale(float(a), rule) for a in amax])
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"rule={rule}: amax {amax[bad[:5]]} gave {got[bad[:5]]}, expected {want[bad[:5]]}"


def test_1p75_encodes_differently_under_the_two_rules():
    x = block(1.75)
    even = F.mxfp4_quantize(x, rule="even")  # scale 2^-1: 3.5 ties to 4 -> 2.0
    floor = F.mxfp4_quantize(x, rule="floor")  # scale 2^-2: 7 saturates to 6 -> 1.5
    assert even.data[0, 0] & 0xF == 6 and even.dequantize()[0, 0] == 2.0
    assert floor.data[0, 0] & 0xF == 7 and floor.dequantize()[0, 0] == 1.5


def test_huge_block_saturates_under_floor_rule():
    t = F.mxfp4_quantize(block(3e38, -3e38, 1e38), rule="floor")
    assert t.scales[0, 0] == 252
    assert list(t.data[0, :2]) == [0x7 | (0xF << 4), 0x4]  # +-6 saturated; 1e38/2^125 = 2.35 -> 2
    assert t.dequantize()[0, 0] == np.float32(6 * 2.0**125)


def test_huge_block_keeps_its_magnitude_under_even_rule():
    # "even" rounds amax 3e38 up to 2^128 (inf); the rule read literally then clamps
    # log2(inf) to the largest scale (254). 252 (no overflow on decode) or 253 are
    # defensible too; a scale that shrinks the block to O(1) values is not.
    with np.errstate(over="ignore"):
        t = F.mxfp4_quantize(block(3e38, -3e38), rule="even")
        got = t.dequantize()[0, 0]
    assert oracle_scale(3e38, "even") == 254
    assert t.scales[0, 0] >= 252 and got >= 2.5e38, (
        f"amax 3e38, rule even: expected scale >= 252 and a value >= 2.5e38, "
        f"got scale {t.scales[0, 0]} and value {got}"
    )


def test_all_zero_block_and_tiny_block():
    z = F.mxfp4_quantize(np.zeros((2, 64), np.float32))
    assert (z.scales == 0).all() and (z.data == 0).all() and (z.dequantize() == 0).all()
    tiny = F.mxfp4_quantize(block(1e-40, 3e-41))
    assert tiny.scales[0, 0] == 0
    # 1e-40 / 2^-127 = 0.017: far below 0.25, so it encodes as zero
    assert tiny.data[0, 0] == 0


# ----------------------------------------------------------------------------- E2M1


TIES_RNE = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
TIES_AWAY = {0.25: 0.5, 0.75: 1.0, 1.25: 1.5, 1.75: 2.0, 2.5: 3.0, 3.5: 4.0, 5.0: 6.0}


@pytest.mark.parametrize("rounding, table", [("rne", TIES_RNE), ("legacy_ties_away", TIES_AWAY)])
def test_e2m1_ties(rounding, table):
    y = np.array(list(table), dtype=np.float32)
    want = np.array(list(table.values()), dtype=np.float32)
    for sign in (1, -1):
        got = F.e2m1_decode(F.e2m1_encode(sign * y, rounding))
        np.testing.assert_array_equal(got, sign * want, err_msg=f"rounding={rounding} sign={sign}")


@pytest.mark.parametrize("rounding", F.ROUNDINGS)
def test_e2m1_saturation_negative_zero_subnormal(rounding):
    y = np.float32([6.0, 7.0, 100.0, 1e30, -6.5, -1e30, -0.1, -0.0, 0.5, -0.5, 0.3])
    codes = F.e2m1_encode(y, rounding)
    assert list(codes) == [0x7, 0x7, 0x7, 0x7, 0xF, 0xF, 0x8, 0x8, 0x1, 0x9, 0x1]
    assert F.e2m1_decode(np.uint8(0x1)) == 0.5


@pytest.mark.parametrize("rounding", F.ROUNDINGS)
def test_e2m1_dense_sweep_against_oracle(rounding):
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = np.concatenate([np.linspace(-8, 8, 4001, dtype=np.float32), ties])
    y = np.concatenate([y, -y])
    got = F.e2m1_encode(y, rounding)
    want = np.array([oracle_e2m1(float(v), rounding) for v in y], dtype=np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{rounding}: y={y[bad[:5]]} gave {got[bad[:5]]}, expected {want[bad[:5]]}"


def test_e2m1_rne_matches_ml_dtypes():
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0])
    y = np.concatenate([np.linspace(-10, 10, 20001, dtype=np.float32), ties, -ties, np.float32([1e30, -1e30])])
    np.testing.assert_array_equal(F.e2m1_encode(y, "rne"), y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(F.e2m1_decode(codes), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_packing_low_nibble_first():
    # amax 6: floor(log2 6) - 2 = 0, so elements are unscaled; codes 2, 4, 9, 7
    t = F.mxfp4_quantize(block(1.0, 2.0, -0.5, 6.0), rule="floor")
    assert t.scales[0, 0] == 127
    assert t.data[0, 0] == 0x42 and t.data[0, 1] == 0x79


# ----------------------------------------------------------------------------- E8M0, FP8, BF16


def test_e8m0_matches_ml_dtypes_for_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = F.e8m0_to_f32(codes)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[255]) and not np.isnan(got[:255]).any()
    assert got[0] == np.float32(2.0**-127) and got[127] == 1.0 and got[254] == np.float32(2.0**127)


@pytest.mark.parametrize("variant", F.FP8_VARIANTS)
def test_fp8_round_matches_ml_dtypes_in_range(variant):
    m = F.FP8_MAX[variant]
    dt = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}[variant]
    y = np.concatenate([np.linspace(-m, m, 30001, dtype=np.float32), np.float32([2.0**-9, 2.0**-10, 1e-6, 0.0])])
    np.testing.assert_array_equal(F.fp8_round(y, variant), y.astype(dt).view(np.uint8))
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(F.fp8_to_f32(codes, variant), codes.view(dt).astype(np.float32))


def test_fp8_known_bits():
    y = np.float32([1.0, -1.0, 448.0, 2.0**-9, 1000.0, -1000.0])
    assert list(F.fp8_round(y, "e4m3fn")) == [0x38, 0xB8, 0x7E, 0x01, 0x7E, 0xFE]
    y = np.float32([1.0, -1.0, 240.0, 2.0**-10, 1000.0, -1000.0, -1e-9])
    assert list(F.fp8_round(y, "e4m3fnuz")) == [0x40, 0xC0, 0x7F, 0x01, 0x7F, 0xFF, 0x00]
    assert np.isnan(F.fp8_to_f32(np.uint8(0x80), "e4m3fnuz"))


def test_bf16_bits_ties_and_ml_dtypes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(5000).astype(np.float32) * np.float32(1e3)
    # exact ties: low 16 bits 0x8000, with even and odd kept mantissas
    tie_bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F80_7FFF, 0x3F80_8001], np.uint32)
    x = np.concatenate([x, tie_bits.view(np.float32), np.float32([0.0, -0.0, 3e38])])
    got = F.bf16_bits(x)
    np.testing.assert_array_equal(got, oracle_bf16_bits(x))
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert list(got[5000:5006]) == [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x3F80, 0x3F81]
    np.testing.assert_array_equal(F.bf16_from_bits(got), x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("variant", F.FP8_VARIANTS)
def test_fp8_quantize_saturation_and_auto_scale(variant):
    m = F.FP8_MAX[variant]
    x = np.float32([[1000.0, -1000.0, 1.0, 0.0]])
    t = F.fp8_quantize(x, variant, scale=1.0)
    np.testing.assert_array_equal(t.dequantize(), np.float32([[m, -m, 1.0, 0.0]]))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64)).astype(np.float32) * 3
    t = F.fp8_quantize(x, variant)
    amax = float(np.abs(x).max())
    assert t.scale == np.float32(amax / m)
    deq = t.dequantize()
    assert abs(float(np.abs(deq).max()) - amax) <= amax * 2**-4  # the max element maps to ~fp8 max
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus a subnormal floor
    assert (np.abs(deq - x) <= np.abs(x) * 2**-4 + t.scale * 2.0**-9).all()


# ----------------------------------------------------------------------------- round trips, layout


def random_blocks(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """N(0,1) rows with a different magnitude per 32-block, so scales vary."""
    mag = np.float32(2.0) ** rng.integers(-20, 20, (rows, n // 32, 1)).astype(np.float32)
    return (rng.standard_normal((rows, n // 32, 32)).astype(np.float32) * mag).reshape(rows, n)


@pytest.mark.parametrize("rule", F.SCALE_RULES)
@pytest.mark.parametrize("rounding", F.ROUNDINGS)
def test_mxfp4_quantize_matches_oracle(rule, rounding):
    rng = np.random.default_rng(3)
    x = random_blocks(rng, 3, 64)
    # a block of exact tie points (scale 2^-3 under both rules), so the rounding mode shows
    ties = np.float32([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.25, -2.5, -5.0])
    x[1, :32] = 0
    x[1, : ties.size] = ties / 8
    t = F.mxfp4_quantize(x, rule=rule, rounding=rounding)
    for r in range(3):
        for b in range(2):
            blk = x[r, 32 * b: 32 * b + 32]
            s = oracle_scale(float(np.abs(blk).max()), rule)
            assert t.scales[r, b] == s
            codes = [oracle_e2m1(float(v) * 2.0 ** (127 - s), rounding) for v in blk]
            packed = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
            assert list(t.data[r, 16 * b: 16 * b + 16]) == packed, f"row {r} block {b}"


@pytest.mark.parametrize("rule", F.SCALE_RULES)
@pytest.mark.parametrize("rounding", F.ROUNDINGS)
def test_mxfp4_round_trip_is_idempotent(rule, rounding):
    rng = np.random.default_rng(4)
    d1 = F.mxfp4_quantize(random_blocks(rng, 16, 576), rule=rule, rounding=rounding).dequantize()
    d2 = F.mxfp4_quantize(d1, rule=rule, rounding=rounding).dequantize()
    np.testing.assert_array_equal(d2, d1)


def test_mxfp4_error_is_bounded():
    rng = np.random.default_rng(5)
    x = random_blocks(rng, 8, 576)
    d = F.mxfp4_quantize(x, rule="floor").dequantize()
    amax = np.abs(x.reshape(8, 18, 32)).max(axis=2, keepdims=True)
    err = np.abs(d - x).reshape(8, 18, 32)
    # floor rule: scale = 2^(floor(log2 amax) - 2), step <= 2 * scale in [4, 6], saturation <= amax/4
    assert (err <= amax / 4 + 1e-30).all()


def test_padded_scale_stride():
    rng = np.random.default_rng(6)
    x = random_blocks(rng, 5, 576)
    t18 = F.mxfp4_quantize(x)
    t24 = F.mxfp4_quantize(x, scale_stride=F.default_scale_stride(576))
    assert F.default_scale_stride(576) == 24 and t18.scale_stride == 18 and t24.scale_stride == 24
    assert (t24.scales[:, 18:] == 0).all()
    np.testing.assert_array_equal(t24.scales[:, :18], t18.scales)
    poisoned = t24.scales.copy()
    poisoned[:, 18:] = 255
    np.testing.assert_array_equal(F.mxfp4_dequantize(t24.data, poisoned, 576), t18.dequantize())


def test_mxfp4_accepts_bf16_and_f64_input():
    rng = np.random.default_rng(7)
    x = random_blocks(rng, 2, 64)
    want = F.mxfp4_quantize(x.astype(ml_dtypes.bfloat16).astype(np.float32)).dequantize()
    np.testing.assert_array_equal(F.mxfp4_quantize(x.astype(ml_dtypes.bfloat16)).dequantize(), want)
    np.testing.assert_array_equal(F.mxfp4_quantize(x.astype(np.float64)).dequantize(), F.mxfp4_quantize(x).dequantize())


@pytest.mark.parametrize("element", ["e2m1", "e4m3fn", "e4m3fnuz"])
def test_mx_fake_quantize_outputs_are_representable(element):
    rng = np.random.default_rng(8)
    x = random_blocks(rng, 4, 64).reshape(2, 2, 64)
    out = F.mx_fake_quantize(x, element)
    assert out.shape == x.shape and out.dtype == np.float32
    blocks_x = x.reshape(-1, 32)
    blocks_o = out.reshape(-1, 32)
    emax = {"e2m1": 2, "e4m3fn": 8, "e4m3fnuz": 7}[element]
    for bx, bo in zip(blocks_x, blocks_o):
        e = math.floor(math.log2(float(np.abs(bx).max()))) - emax
        y = bo.astype(np.float64) * 2.0 ** -e
        if element == "e2m1":
            assert set(np.abs(y)) <= set(E2M1_BY_CODE)
        else:
            dt = ml_dtypes.float8_e4m3fn if element == "e4m3fn" else ml_dtypes.float8_e4m3fnuz
            np.testing.assert_array_equal(y.astype(np.float32).astype(dt).astype(np.float64), y)
            m = F.FP8_MAX[element]
            nearest = np.clip(bx.astype(np.float64) * 2.0**-e, -m, m).astype(np.float32).astype(dt)
            np.testing.assert_array_equal(y, nearest.astype(np.float64))
    if element == "e2m1":
        np.testing.assert_array_equal(out.reshape(4, 64), F.mxfp4_quantize(x.reshape(4, 64), rule="floor").dequantize())


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize(
    "fmt, kwargs, bpt",
    [
        ("bf16", {}, 1152),
        ("fp8", {}, 576),
        ("fp8", {"fp8_variant": "e4m3fnuz"}, 576),
        ("mxfp4", {}, 306),
        ("mxfp4", {"scale_stride": 24}, 312),
    ],
)
def test_quantize_kv_formats(fmt, kwargs, bpt):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((7, 576)).astype(np.float32)
    kv = F.quantize_kv(x, fmt, **kwargs)
    assert kv.format == fmt and kv.rows == 7 and kv.dim == 576 and kv.bytes_per_token == bpt
    deq = kv.dequantize()
    assert deq.shape == (7, 576) and deq.dtype == np.float32
    if fmt == "bf16":
        assert kv.data.dtype == np.uint16
        np.testing.assert_array_equal(deq, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    elif fmt == "fp8":
        variant = kwargs.get("fp8_variant", "e4m3fn")
        assert kv.data.dtype == np.uint8 and kv.fp8_variant == variant
        assert kv.fp8_scale == pytest.approx(float(np.abs(x).max()) / F.FP8_MAX[variant], rel=1e-6)
        np.testing.assert_array_equal(deq, F.fp8_quantize(x, variant).dequantize())
    else:
        assert kv.data.shape == (7, 288) and kv.scales.shape == (7, kwargs.get("scale_stride", 18))
        np.testing.assert_array_equal(deq, F.mxfp4_quantize(x).dequantize())
    np.testing.assert_array_equal(kv.dequantize(slice(2, 5)), deq[2:5])
    np.testing.assert_array_equal(kv.dequantize(np.array([6, 0])), deq[[6, 0]])
    assert np.abs(deq - x).max() <= np.abs(x).max() * 0.25  # coarse sanity for every format


# ----------------------------------------------------------------------------- validation


def test_nan_and_inf_rejected_naming_x():
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros((2, 64), np.float32)
        x[1, 40] = bad
        for fn in (lambda: F.mxfp4_quantize(x), lambda: F.fp8_quantize(x), lambda: F.quantize_kv(x, "bf16"),
                   lambda: F.mx_fake_quantize(x, "e2m1"), lambda: F.fp8_quantize(x, scale=2.0)):
            with pytest.raises(ValueError, match=r"^x: "):
                fn()


def test_shape_and_value_errors():
    with pytest.raises(ValueError, match=r"x: .*multiple of 32.*48"):
        F.mxfp4_quantize(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match=r"x: .*multiple of 32"):
        F.mx_fake_quantize(np.zeros((2, 40), np.float32), "e2m1")
    with pytest.raises(ValueError, match=r"scale_stride: .*18.*17"):
        F.mxfp4_quantize(np.zeros((2, 576), np.float32), scale_stride=17)
    with pytest.raises(ValueError, match=r"x: expected 2 dimensions"):
        F.mxfp4_quantize(np.zeros(64, np.float32))
    with pytest.raises(ValueError, match=r"scales: "):
        F.mxfp4_dequantize(np.zeros((2, 288), np.uint8), np.zeros((2, 17), np.uint8))
    with pytest.raises(ValueError, match=r"scales: "):
        F.mxfp4_dequantize(np.zeros((2, 288), np.uint8), np.zeros((3, 18), np.uint8))
    with pytest.raises(ValueError, match=r"data: "):
        F.mxfp4_dequantize(np.zeros((2, 288), np.uint8), np.zeros((2, 18), np.uint8), n=512)
    for scale in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match=r"scale: "):
            F.fp8_quantize(np.ones((1, 4), np.float32), scale=scale)


def test_unknown_names():
    x = np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError, match=r"rule: .*'even'.*'nope'"):
        F.mxfp4_quantize(x, rule="nope")
    with pytest.raises(ValueError, match=r"rounding: .*'rne'.*'ties_away'"):
        F.mxfp4_quantize(x, rounding="ties_away")
    with pytest.raises(ValueError, match=r"rounding: "):
        F.e2m1_encode(x, "up")
    with pytest.raises(ValueError, match=r"variant: .*'e4m3fn'.*'e5m2'"):
        F.fp8_quantize(x, "e5m2")
    with pytest.raises(ValueError, match=r"variant: "):
        F.fp8_to_f32(np.zeros(2, np.uint8), "e5m2")
    with pytest.raises(ValueError, match=r"format: .*'mxfp4'.*'int4'"):
        F.quantize_kv(x, "int4")
    with pytest.raises(ValueError, match=r"element: "):
        F.mx_fake_quantize(x, "e5m2")
    with pytest.raises(ValueError, match=r"rule: "):
        F.mx_scale_exponent(np.float32([1.0]), "ceil", emax=2)


def test_wrong_dtypes():
    with pytest.raises(TypeError, match=r"x: .*int32"):
        F.mxfp4_quantize(np.zeros((1, 32), np.int32))
    with pytest.raises(TypeError, match=r"x: .*numpy.ndarray.*list"):
        F.quantize_kv([[0.0] * 32], "bf16")
    with pytest.raises(TypeError, match=r"data: .*uint8.*float32"):
        F.mxfp4_dequantize(np.zeros((1, 16), np.float32), np.zeros((1, 1), np.uint8))
    with pytest.raises(TypeError, match=r"scales: .*uint8.*int64"):
        F.mxfp4_dequantize(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.int64))
    with pytest.raises(TypeError, match=r"data: .*uint8"):
        F.fp8_dequantize(np.zeros(4, np.int8), 1.0)


def test_legacy_rounding_just_below_a_tie_rounds_down():
    # steps + 0.5 rounds up in f32 for steps = 0.5 - 2^-25; the encoder must not.
    below = np.nextafter(np.float32([0.25, 1.25, 2.5, 5.0]), np.float32(0))
    got = F.e2m1_decode(F.e2m1_encode(below, "legacy_ties_away"))
    assert got.tolist() == [0.0, 1.0, 2.0, 4.0]


# ----------------------------------------------------------------------------- float64 input, range, KVCache


def test_float64_input_is_rounded_once_as_ml_dtypes_does():
    # f64 -> f32 -> format would round twice: each value sits just past a tie of the format
    # and exactly on it once rounded to f32.
    eps = 2.0 ** -30
    bf = F.quantize_kv(np.full((1, 32), 1 + 2 ** -8 + eps), "bf16")
    assert F.bf16_from_bits(bf.data)[0, 0] == np.float64(1 + 2 ** -8 + eps).astype(ml_dtypes.bfloat16) == 1.0078125
    f8 = F.quantize_kv(np.full((1, 32), 1 + 2 ** -4 + eps), "fp8", fp8_scale=1.0)
    assert f8.dequantize()[0, 0] == np.float64(1 + 2 ** -4 + eps).astype(ml_dtypes.float8_e4m3fn) == 1.125
    x = np.zeros((1, 32))
    x[0, :2] = [4.0, 0.25 * (1 + eps)]  # scale 2^0: 0.25 + a hair is nearer 0.5 than 0
    assert F.mxfp4_quantize(x).dequantize()[0, :2].tolist() == [4.0, 0.5]
    assert F.e2m1_decode(F.e2m1_encode(np.array([0.25 * (1 + eps), 0.25]))).tolist() == [0.5, 0.0]


def test_float64_block_amax_enters_the_scale_rule_truncated():
    # 8 - a hair is in the binade [4, 8): the floor rule's scale is 2^0 (it saturates to 6),
    # not the 2^1 that rounding the amax to f32 (8.0) would give.
    x = np.zeros((1, 32))
    x[0, 0] = 8 * (1 - 2.0 ** -40)
    assert F.mxfp4_quantize(x, rule="floor").scales[0, 0] == 127
    # The even rule rounds an amax of 1.75 up to the next binade (scale 2^-1), one a hair
    # below it not (2^-2), as in f32 input just below 1.75.
    x[0, 0] = 1.75
    assert F.mxfp4_quantize(x, rule="even").scales[0, 0] == 126
    x[0, 0] = 1.75 * (1 - 2.0 ** -40)
    assert F.mxfp4_quantize(x, rule="even").scales[0, 0] == 125
    assert F.mxfp4_quantize(np.nextafter(np.float32(x), 0), rule="even").scales[0, 0] == 125


def test_finite_float64_beyond_float32_gets_its_own_message():
    x = np.zeros((2, 32))
    x[1, 3] = 1e39
    for fn in (lambda: F.quantize_kv(x, "bf16"), lambda: F.quantize_kv(x, "fp8", fp8_scale=1e36),
               lambda: F.mxfp4_quantize(x)):
        with pytest.raises(ValueError, match=r"^x: 1e\+39 at index \(1, 3\) is beyond float32's range"):
            fn()


def test_bf16_quantizer_refuses_a_value_that_rounds_to_inf():
    x = np.zeros((3, 32), np.float32)
    x[2, 7] = 3.4e38  # finite in f32, past bf16's largest finite + half an ulp
    with pytest.raises(ValueError, match=r"^x: 3\.4e\+38 at index \(2, 7\) rounds to inf in bf16"):
        F.quantize_kv(x, "bf16")
    x[2, 7] = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert np.isfinite(F.quantize_kv(x, "bf16").dequantize()).all()


def test_e2m1_encode_refuses_nan_and_saturates_inf():
    with pytest.raises(ValueError, match=r"^y: NaN at index \(1,\)"):
        F.e2m1_encode(np.float32([1.0, np.nan]))
    assert F.e2m1_decode(F.e2m1_encode(np.float32([np.inf, -np.inf]))).tolist() == [6.0, -6.0]


def test_scales_253_and_254_decode_past_float32_to_inf_without_warnings():
    data = np.full((1, 16), 0x77, np.uint8)  # code 7 (6.0) in both nibbles
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = F.mxfp4_dequantize(data, np.full((1, 1), 254, np.uint8))
        assert np.isinf(out).all()
        assert (F.mxfp4_dequantize(data & 0x11, np.full((1, 1), 254, np.uint8)) == 2.0 ** 126).all()


def test_kvcache_takes_typed_arrays_as_their_bits_and_refuses_the_rest():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    bf = F.quantize_kv(x, "bf16")
    typed = F.KVCache("bf16", bf.data.view(ml_dtypes.bfloat16))
    assert typed.data.dtype == np.uint16 and np.array_equal(typed.dequantize(), bf.dequantize())
    f8 = F.quantize_kv(x, "fp8")
    typed = F.KVCache("fp8", f8.data.view(ml_dtypes.float8_e4m3fn), fp8_scale=f8.fp8_scale)
    assert np.array_equal(typed.dequantize(), f8.dequantize())
    with pytest.raises(TypeError, match=r"^data: expected dtype uint8, got float8_e4m3fnuz"):
        F.KVCache("fp8", f8.data.view(ml_dtypes.float8_e4m3fnuz), fp8_scale=f8.fp8_scale)
    mx = F.quantize_kv(x, "mxfp4")
    typed = F.KVCache("mxfp4", mx.data, scales=mx.scales.view(ml_dtypes.float8_e8m0fnu))
    assert typed.scales.dtype == np.uint8 and np.array_equal(typed.dequantize(), mx.dequantize())
    for bad in (0.0, -1.0, np.nan, np.inf, 1e-45):
        with pytest.raises(ValueError, match="^fp8_scale: "):
            F.KVCache("fp8", f8.data, fp8_scale=bad)
    with pytest.raises(ValueError, match="^scales: only an mxfp4 cache"):
        F.KVCache("bf16", bf.data, scales=mx.scales)
    with pytest.raises(ValueError, match=r"^format: "):
        F.KVCache("FP8", f8.data)
    with pytest.raises(ValueError, match=r"^scale: "):
        F.fp8_dequantize(f8.data, -1.0)


def test_quantize_kv_checks_every_option_given():
    x = np.zeros((1, 576), np.float32)
    for kw, name in ((dict(rule="bogus"), "rule"), (dict(rounding="x"), "rounding"),
                     (dict(scale_stride=-5), "scale_stride"), (dict(fp8_scale=0.0), "fp8_scale")):
        for fmt in F.KV_FORMATS:
            with pytest.raises(ValueError, match=f"^{name}: "):
                F.quantize_kv(x, fmt, **kw)
