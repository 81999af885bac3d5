// Bit-exact number formats: bf16, e4m3 (fn and fnuz), E2M1, E8M0, and the MX
// quantization of Q. These are the rounding rules of hip_src/KERNELS.md; the numpy side
// (hipmla/formats.py) implements the same ones, so both must change together.
#pragma once

#include "common/config.h"
#include "common/platform.h"

namespace hipmla {

// ------------------------------------------------------------------------------ bf16

HIPMLA_DEVICE float bf16_to_f32(unsigned bits16) { return f32_from_bits(bits16 << 16); }

// Round to nearest, ties to even; NaN stays NaN (made quiet) with its sign.
HIPMLA_DEVICE unsigned f32_to_bf16_bits(float x) {
    const unsigned u = bits_from_f32(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

HIPMLA_DEVICE float round_bf16(float x) { return bf16_to_f32(f32_to_bf16_bits(x)); }

// Two values into one word, the first in the low half (memory order).
HIPMLA_DEVICE unsigned pack_bf16x2(float lo, float hi) {
    return f32_to_bf16_bits(lo) | (f32_to_bf16_bits(hi) << 16);
}

// ------------------------------------------------------------------------------ e4m3

// e4m3fn (OCP; bias 7, 0x7f/0xff are NaN, max 448) or e4m3fnuz (gfx942; bias 8, only
// 0x80 is NaN, max 240). Subnormals are m * 2^(1 - bias - 3).
template <bool FNUZ>
HIPMLA_DEVICE float fp8_to_f32(unsigned byte) {
    constexpr unsigned bias = FNUZ ? 8u : 7u;
    constexpr float subnormal_unit = FNUZ ? 0.0009765625f : 0.001953125f;  // 2^-10, 2^-9
    const unsigned mag = byte & 0x7fu;
    const float normal = f32_from_bits((mag << 20) + ((127u - bias) << 23));
    const float magnitude = (mag >> 3) != 0 ? normal : float(mag) * subnormal_unit;
    const bool nan = FNUZ ? byte == 0x80u : mag == 0x7fu;
    return nan ? f32_from_bits(0x7fc00000u) : f32_from_bits(bits_from_f32(magnitude) | ((byte & 0x80u) << 24));
}

// ------------------------------------------------------------------------------ E2M1, E8M0

// Twice the E2M1 value of a nibble (an integer in -12..12): the magnitudes
// {0, .5, 1, 1.5, 2, 3, 4, 6} doubled fit one nibble each of 0xC8643210.
HIPMLA_DEVICE float e2m1_twice(unsigned nibble) {
    const float twice = float((0xC8643210u >> ((nibble & 7u) * 4u)) & 0xfu);
    return f32_from_bits(bits_from_f32(twice) | ((nibble & 8u) << 28));
}

// Half of an E8M0 scale, 2^(s - 128), so that e2m1_twice(n) * e8m0_half(s) is the MX
// value. Code 0 (2^-128) and 1 (2^-127) are f32 subnormals; 255 is NaN.
HIPMLA_DEVICE float e8m0_half(unsigned s) {
    if (s == 255u) return f32_from_bits(0x7fc00000u);
    return f32_from_bits(s <= 1u ? 0x00200000u << s : (s - 1u) << 23);
}

// ------------------------------------------------------------------------------ MX quantization

// MX element formats: `mant` mantissa bits, smallest normal exponent `emin`, largest
// finite value `max_value` and its exponent `emax` (which sets the block scale).
// Static scalar members rather than constexpr objects: NVRTC lets device code read
// those without flags.
struct E2M1 {
    static constexpr int mant = 1, emin = 0, emax = 2;
    static constexpr float max_value = 6.0f;
};
struct E4M3FN {
    static constexpr int mant = 3, emin = -6, emax = 8;
    static constexpr float max_value = 448.0f;
};
struct E4M3FNUZ {
    static constexpr int mant = 3, emin = -7, emax = 7;
    static constexpr float max_value = 240.0f;
};

// 2^e for e in [-127, 127], exactly (2^-127 is an f32 subnormal).
HIPMLA_DEVICE float exp2_int(int e) {
    return f32_from_bits(e > -127 ? unsigned(e + 127) << 23 : 0x00400000u);
}

// Block exponent: clamp(floor(log2(amax)) - emax, -127, 127), and -127 for amax 0.
// A zero or subnormal amax has floor(log2) <= -127, which the clamp takes care of.
HIPMLA_DEVICE int mx_block_exponent(float amax, int emax) {
    const int biased = int((bits_from_f32(amax) >> 23) & 0xffu);
    const int e = biased - 127 - emax;
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// y rounded to the element grid, nearest-even, saturating at +-max_value. Adding 2^k
// rounds to a multiple of 2^(k-23) in f32 itself; k is chosen so that multiple is the
// element's quantum in the binade of |y| (or the subnormal quantum below emin).
template <class F>
HIPMLA_DEVICE float mx_round_element(float y) {
    const unsigned sign = bits_from_f32(y) & 0x80000000u;
    const float a = f32_from_bits(bits_from_f32(y) & 0x7fffffffu);
    float r = F::max_value;
    if (a < F::max_value) {
        int e = int(bits_from_f32(a) >> 23) - 127;
        e = e < F::emin ? F::emin : e;
        const float magic = f32_from_bits(unsigned(e - F::mant + 23 + 127) << 23);
        r = (a + magic) - magic;
    }
    return f32_from_bits(bits_from_f32(r) | sign);
}

// Magnitude bits of the larger non-NaN bf16 half of `w` against `m` (NaN halves count
// as 0, as a float compare would skip them; +-inf counts).
HIPMLA_DEVICE unsigned max_bf16_magnitude(unsigned m, unsigned w) {
    unsigned lo = w & 0x7fffu, hi = (w >> 16) & 0x7fffu;
    lo = lo > 0x7f80u ? 0u : lo;
    hi = hi > 0x7f80u ? 0u : hi;
    m = lo > m ? lo : m;
    return hi > m ? hi : m;
}

// One row of Q (HEADS x D_QK bf16 in shared memory, head-major) quantized in place as the Q
// precision QP asks (config.h codes): FORMAT_FP8 MXFP8 (e4m3fnuz with FNUZ, else e4m3fn),
// FORMAT_MXFP4 MXFP4, FORMAT_BF16 nothing. Each MX_BLOCK values get an E8M0 scale (OCP
// floor rule: mx_block_exponent of the block's largest magnitude), each value is rounded
// to the element grid (mx_round_element) and stored back as bf16 -- exact, unless
// |value| < 2^-126 (only when amax < 2^-117). The emulator's quantize_q.
// Two passes, both spread over all threads: a block's exponent per thread into `exps`
// (shared memory the caller lends, Q_BLOCKS bytes), then, after a barrier, 4 values a task,
// 9 tasks every thread at 256 threads. (Rounding a whole block a thread left a second
// round of 32 values to 32 of 256 threads: on the H100 the sm_90 kernel's items took
// 6-15 us longer with quantized Q than with bf16 Q.) The caller syncs before (Q landed)
// and after (Q read).
constexpr int Q_BLOCKS = HEADS * D_QK / MX_BLOCK;  // MX blocks of a row of Q

template <class F, int THREADS>
HIPMLA_DEVICE void mx_quantize_q_row_as(unsigned short* q, signed char* exps, int tid) {
    constexpr int PER = 4;                              // values a task
    constexpr int TASKS = HEADS * D_QK / PER;
    constexpr int ROUNDS = (TASKS + THREADS - 1) / THREADS;
    static_assert(MX_BLOCK % PER == 0 && (HEADS * D_QK) % MX_BLOCK == 0, "whole tasks, whole blocks");
    for (int b = tid; b < Q_BLOCKS; b += THREADS) {
        const u32x4* blk = reinterpret_cast<const u32x4*>(q + b * MX_BLOCK);
        unsigned m = 0;
#pragma unroll
        for (int k = 0; k < MX_BLOCK / 8; ++k) {
            const u32x4 v = blk[k];
            m = max_bf16_magnitude(max_bf16_magnitude(m, v.x), v.y);
            m = max_bf16_magnitude(max_bf16_magnitude(m, v.z), v.w);
        }
        exps[b] = (signed char)mx_block_exponent(bf16_to_f32(m), F::emax);  // in [-127, 127]
    }
    block_sync();
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int i = tid + r * THREADS;
        if (i < TASKS) {
            const int e = exps[i / (MX_BLOCK / PER)];
            u32x2* x = reinterpret_cast<u32x2*>(q + PER * i);
            const u32x2 v = *x;
            const float down = exp2_int(-e), up = exp2_int(e);
            const unsigned w[2] = {v.x, v.y};
            unsigned o[2];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const unsigned a = f32_to_bf16_bits(mx_round_element<F>(bf16_to_f32(w[k] & 0xffffu) * down) * up);
                const unsigned b = f32_to_bf16_bits(mx_round_element<F>(bf16_to_f32(w[k] >> 16) * down) * up);
                o[k] = a | (b << 16);
            }
            *x = u32x2{o[0], o[1]};
        }
    }
}
template <int QP, bool FNUZ, int THREADS>
HIPMLA_DEVICE void mx_quantize_q_row_bf16(unsigned short* q, signed char* exps, int tid) {
    if constexpr (QP == FORMAT_MXFP4) {
        mx_quantize_q_row_as<E2M1, THREADS>(q, exps, tid);
    } else if constexpr (QP == FORMAT_FP8) {
        if constexpr (FNUZ) mx_quantize_q_row_as<E4M3FNUZ, THREADS>(q, exps, tid);
        else mx_quantize_q_row_as<E4M3FN, THREADS>(q, exps, tid);
    }
}

// Where an online softmax's running max starts, not at -inf: the lowest finite f32. With
// masked scores -inf, a state that has seen no valid token yet (a wave whose quarters a
// partial last tile leaves empty; a head of an earlier query token of a row of several,
// past its causal bound) would otherwise compute exp2(-inf - -inf) = NaN for alpha and P;
// from -FLT_MAX, exp2(-inf - m) = 0 for every masked token and exp2(-FLT_MAX - m) = 0 for
// alpha on the first real tile (m - -FLT_MAX is 0 or >= 2^104: exp2 gives 1 or 0), so the
// numbers are those of a max starting at -inf. A state that saw nothing ends with
// m = -FLT_MAX, l = 0 and acc = 0, which a merge weights by exp2(-FLT_MAX - M) = 0 (or 1
// when every state is empty: l = 0, acc = 0 still, and the kernel writes the empty 0 / -inf).
HIPMLA_DEVICE float running_max_start() { return f32_from_bits(0xff7fffffu); }

}  // namespace hipmla
