// NVIDIA Hopper (sm_90) instructions of the tensor-core split kernel, as small named
// helpers around inline PTX. Each cites the section of the PTX ISA (version 8.x / 9.0,
// "Parallel Thread Execution ISA") whose operand layout it follows; the kernel
// (decode/split_sm90.hip) relies on exactly these layouts. NVRTC only: every helper is
// compiled for __CUDACC__ and nothing here is used on AMD.
//
// Fragment vocabulary (PTX ISA 9.7.14.5.8, "Matrix Fragments for mma.m16n8k16 with
// floating point type", and 9.7.14.5.7 for m16n8k8): in a warp, lane = 4 g + t with
// g = groupID = lane >> 2 and t = threadID_in_group = lane & 3.
//   A (16 x 16, row-major, bf16): 4 registers of 2 elements, low half first:
//       reg 0: (row g,     cols 2t, 2t+1)    reg 1: (row g + 8, cols 2t, 2t+1)
//       reg 2: (row g,     cols 2t+8, 2t+9)  reg 3: (row g + 8, cols 2t+8, 2t+9)
//   B (16 x 8, "col", bf16): reg 0: (rows 2t, 2t+1, col g)  reg 1: (rows 2t+8, 2t+9, col g)
//   C/D (16 x 8, f32): c0, c1: (row g, cols 2t, 2t+1)  c2, c3: (row g + 8, cols 2t, 2t+1)
//   m16n8k8 (bf16): A = regs 0, 1 above (cols 2t, 2t+1 only), B = reg 0 above.
// An 8 x 8 b16 matrix "in fragment layout" (movmatrix, ldmatrix): lane (g, t) holds row g,
// cols 2t (low half) and 2t + 1 (high half) in one register.
#pragma once

#include "common/platform.h"

#if !defined(__CUDACC__) && !defined(HIPMLA_HOST_PLATFORM)
#error "arch/sm90.h is for NVRTC / nvcc builds for sm_90 only"
#endif

namespace hipmla {
namespace sm90 {

// The CPU harness (tests/host_sm90.h) defines WARP and every instruction helper below
// that is inline PTX or a warp intrinsic; what is built from them is shared.
#if !defined(HIPMLA_HOST_PLATFORM)
constexpr int WARP = 32;

// ------------------------------------------------------------------------------ tensor cores

// D = A B + C, m16n8k16, bf16 inputs (F16: f16), f32 accumulators (PTX ISA 9.7.14.5.14
// "mma", shape .m16n8k16, .row.col, .f32.bf16.bf16.f32 / .f32.f16.f16.f32; fragments as in
// the header). f16 is the fp8 cache's path: the hardware converts its e4m3 codes to f16 in
// one instruction (e4m3x2_to_f16x2 below), to bf16 in none.
template <bool F16>
HIPMLA_DEVICE void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#define HIPMLA_SM90_MMA_16816(T)                                                      \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 "            \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (F16) HIPMLA_SM90_MMA_16816("f16");
    else HIPMLA_SM90_MMA_16816("bf16");
#undef HIPMLA_SM90_MMA_16816
}

// D = A B + C, m16n8k8 (PTX ISA 9.7.14.5.14, shape .m16n8k8; A is regs 0 and 1 of the k16
// layout, B one register), inputs as mma_16816's.
template <bool F16>
HIPMLA_DEVICE void mma_1688(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
#define HIPMLA_SM90_MMA_1688(T)                                                       \
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32." T "." T ".f32 "             \
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"               \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                      \
                 : "r"(a0), "r"(a1), "r"(b0))
    if constexpr (F16) HIPMLA_SM90_MMA_1688("f16");
    else HIPMLA_SM90_MMA_1688("bf16");
#undef HIPMLA_SM90_MMA_1688
}

// The transpose of an 8 x 8 b16 matrix held in fragment layout, returned in fragment
// layout (PTX ISA 9.7.14.5.16 "movmatrix", .m8n8.trans.b16): lane (g, t) receives
// elements (2t, g) and (2t + 1, g) of the source.
HIPMLA_DEVICE unsigned movmatrix_trans(unsigned a) {
    unsigned d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
    return d;
}

// ------------------------------------------------------------------------------ bf16x2 arithmetic

// a * b + c on two bf16 lanes, rounded to nearest even (PTX ISA 9.7.4.4 "fma" for half
// precision, .rn.bf16x2). bf16 has no .ftz form: subnormal inputs and results are kept,
// which the exact dequantization below depends on (E2M1 0.5 enters as 2^-127).
HIPMLA_DEVICE unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#endif  // !HIPMLA_HOST_PLATFORM

// Exact products by a power of two: a * b + (-0), so the sign of a zero survives.
HIPMLA_DEVICE unsigned mul_bf16x2(unsigned a, unsigned b) { return fma_bf16x2(a, b, 0x80008000u); }

#if !defined(HIPMLA_HOST_PLATFORM)
// (a & m) | (b & ~m) in one instruction (PTX ISA 9.7.8.6 "lop3", LUT 0xE4 for operands
// a, b, m). Inline PTX keeps the compiler from re-associating it with the shifts that
// feed it (it would mask b separately, one more instruction per word).
HIPMLA_DEVICE unsigned select_bits(unsigned m, unsigned a, unsigned b) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(m));
    return d;
}

// a & m as one opaque lop3 (LUT 0xC0): a sign word masked once and then shifted for
// several words, which the compiler would otherwise re-mask after every shift.
template <unsigned M>
HIPMLA_DEVICE unsigned and_bits(unsigned a) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, 0, 0xC0;\n" : "=r"(d) : "r"(a), "n"(M));
    return d;
}

// v through a mov the compiler cannot look into: a per-thread constant formed once before
// a loop stays in a register (without it, the optimizer rebuilt the value from the thread
// index inside the loop, several instructions every iteration).
HIPMLA_DEVICE unsigned loop_invariant(unsigned v) {
    unsigned d;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(d) : "r"(v));
    return d;
}

// Two f32 to bf16x2, round to nearest even, `lo` in the low half (PTX ISA 9.7.9.21 "cvt",
// .rn.bf16x2.f32: the first source goes to the upper half).
HIPMLA_DEVICE unsigned pack_bf16x2_rn(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Two f32 to f16x2, round to nearest even with f16 subnormals (PTX ISA 9.7.9.21 "cvt",
// .rn.f16x2.f32: the first source goes to the upper half), `lo` in the low half.
HIPMLA_DEVICE unsigned pack_f16x2_rn(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// The two e4m3fn codes in bits 0-15 (HALF 0) or 16-31 (HALF 1) of q to f16x2, the lower
// byte in the low half (PTX ISA 9.7.9.21 "cvt", .rn.f16x2.e4m3x2, sm_89+): exact, every
// e4m3 value (subnormals included) being an f16 value; the NaN codes 0x7f / 0xff give
// NaN. One F2FP.F16.E4M3.UNPACK_B each (its .H1 operand form reads the upper half), where
// placing the bits by hand into bf16 took 3.5 instructions a word.
template <int HALF>
HIPMLA_DEVICE unsigned e4m3x2_to_f16x2(unsigned q) {
    static_assert(HALF == 0 || HALF == 1, "a half of the word");
    unsigned d;
    if constexpr (HALF == 0)
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(d) : "r"(q));
    else
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(d) : "r"(q));
    return d;
}

// An f16x2 word to bf16x2 (low half to low half) through f32 (PTX ISA 9.7.9.21 "cvt",
// .f32.f16 then .rn.bf16x2.f32): exact for every f16 value a bf16 holds (e4m3's do), NaN
// stays NaN.
HIPMLA_DEVICE unsigned f16x2_to_bf16x2(unsigned h) {
    float lo, hi;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi) : "r"(h));
    return pack_bf16x2_rn(lo, hi);
}

// 2^x, the MUFU approximation (PTX ISA 9.7.4.x "ex2", .approx.ftz.f32: ~2 ulp, results
// below 2^-126 flushed to zero; ex2(-inf) = +0).
HIPMLA_DEVICE float exp2_approx(float x) {
    float d;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(d) : "f"(x));
    return d;
}

#endif  // !HIPMLA_HOST_PLATFORM

// ------------------------------------------------------------------------------ dequantization

// Eight E2M1 codes (nibbles n0..n7 of q, n_i at bits 4i) to four bf16x2 words holding
// value * 2^-126 exactly: word i = (n_i low, n_{i+4} high). The 3 magnitude bits go to
// bf16 bits 6-8 (exponent LSBs + the top mantissa bit), so the exponent field is the
// E2M1 exponent e and the subnormal code (e = 0, 0.5) becomes the bf16 subnormal 2^-127:
// one mapping for every code, no special case. Signs go to bits 15 / 31. Each word is one
// lop3 of a shifted copy of q (magnitudes) and a shifted copy of its sign bits, chosen so
// that the only stray sign bits land on magnitude positions, which the lop3 overwrites.
HIPMLA_DEVICE void e2m1x8_to_bf16x2_scaled_down(unsigned q, unsigned (&w)[4]) {
    constexpr unsigned MAG = 0x01C001C0u;
    const unsigned se = and_bits<0x08080808u>(q);  // signs of n0, n2, n4, n6
    const unsigned so = and_bits<0x80808080u>(q);  // signs of n1, n3, n5, n7
    w[0] = select_bits(MAG, q << 6, se << 12);
    w[1] = select_bits(MAG, q << 2, so << 8);
    w[2] = select_bits(MAG, q >> 2, se << 4);
    w[3] = select_bits(MAG, q >> 6, so);
}

// Two E2M1 codes (low nibble x, high nibble y of `byte`, bits 8+ zero) to one bf16x2
// word (x low, y high), value * 2^-126 as above. One multiply places both codes' copies
// that carry the magnitudes (byte << 6 and byte << 18 do not overlap), another both
// copies that carry the signs (<< 12, << 24): 4 instructions, where spreading the
// nibbles apart first took 8.
HIPMLA_DEVICE unsigned e2m1x2_to_bf16x2_scaled_down(unsigned byte) {
    const unsigned mags = byte * 0x00040040u;                  // x: bits 6-8, y: bits 22-24
    const unsigned signs = and_bits<0x80008000u>(byte * 0x01001000u);  // x: bit 15, y: bit 31
    return select_bits(0x01C001C0u, mags, signs);
}

// Four e4m3fn codes (the bytes of q) to two bf16x2 words, bytes 0, 1 -> lo and 2, 3 -> hi,
// the lower byte in the low half: exact (every e4m3 value is a bf16 value), the NaN codes
// 0x7f / 0xff NaN, as the hardware's e4m3 -> f16 convert gives them. 4 instructions a word,
// as many as placing the bits by hand and scaling, which would turn the NaN codes into
// 480 (bf16 has no code that is NaN in e4m3fn's place).
HIPMLA_DEVICE void e4m3x4_to_bf16x2(unsigned q, unsigned& lo, unsigned& hi) {
    lo = f16x2_to_bf16x2(e4m3x2_to_f16x2<0>(q));
    hi = f16x2_to_bf16x2(e4m3x2_to_f16x2<1>(q));
}

// E8M0 byte s -> bf16x2 (2^(s-65), 2^(s-65)), the multiplier that takes a block's
// value * 2^-126 codes above to value * 2^(s-127) * 2^-64 (so Q' = Q * 2^64 gives exact
// scores), saturating at +inf (s >= 193): a min and one multiply-add (the clamp before
// the add, which the multiply-add then absorbs).
HIPMLA_DEVICE unsigned e8m0_multiplier(unsigned s) {
    const unsigned e = (s < 193u ? s : 193u) + 62u;
    return e * 0x00800080u;
}

// ------------------------------------------------------------------------------ async copies
#if !defined(HIPMLA_HOST_PLATFORM)

// 32-bit shared-state-space address of a generic pointer into shared memory.
HIPMLA_DEVICE unsigned smem_address(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, bypassing L1 (PTX ISA 9.7.9.25.3.1 "cp.async", .cg, cp-size 16).
// src_bytes = 0 reads nothing and fills the 16 bytes with zeros (the ignore-src form).
HIPMLA_DEVICE void cp_async_16(unsigned dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Closes the current group of cp.async operations (PTX ISA 9.7.9.25.3.2 "cp.async.commit_group").
HIPMLA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's groups are pending (PTX ISA 9.7.9.25.3.3
// "cp.async.wait_group"); a block barrier after it makes every thread's copies visible.
template <int N>
HIPMLA_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Bytes of dynamic shared memory this launch has (PTX ISA 10.31 "%dynamic_smem_size").
HIPMLA_DEVICE unsigned dynamic_smem_size() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
    return r;
}

// ------------------------------------------------------------------------------ warp exchange

template <class T>  // float (the softmax's max) or unsigned (f16 products' exponent)
HIPMLA_DEVICE T warp_xor_max(T v, int lane_mask) {
    const T o = __shfl_xor_sync(0xffffffffu, v, lane_mask);
    return o > v ? o : v;
}
HIPMLA_DEVICE float warp_xor_sum(float v, int lane_mask) { return v + __shfl_xor_sync(0xffffffffu, v, lane_mask); }
HIPMLA_DEVICE bool warp_all(bool v) { return __all_sync(0xffffffffu, v) != 0; }
HIPMLA_DEVICE bool warp_any(bool v) { return __any_sync(0xffffffffu, v) != 0; }
#endif  // !HIPMLA_HOST_PLATFORM

}  // namespace sm90
}  // namespace hipmla
