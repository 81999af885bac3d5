// gfx942 (MI300X / MI325X, CDNA3) building blocks of the fast split kernel: wave64 lane
// roles, the bf16 MFMA, fp8 (e4m3fnuz) and E2M1 -> f32 conversions, bf16 packing, the
// asynchronous global -> LDS dword copy and its counted wait. Raw instructions live here
// and nowhere else.
//
// gfx942 has no scaled MFMA and no fp4 converts (both are gfx950 additions), so every KV
// format is turned into bf16 in registers and multiplied on v_mfma_f32_16x16x16_bf16.
//
// Where the layout facts come from (no gfx942 exists on the project's machines):
// - Builtin: clang's BuiltinsAMDGPU (__builtin_amdgcn_mfma_f32_16x16x16bf16_1k: a, b as
//   4 x i16, c as 4 x f32, then cbsz, abid, blgp), emitted as v_mfma_f32_16x16x16_bf16
//   (checked with llvm-objdump-22 on a clang-22 build).
// - Operand layout of the 16x16x16 MFMAs (f16 and bf16 alike): AMD's matrix instruction
//   calculator tables for v_mfma_f32_16x16x16f16 (A[i][k]: lane i + 16 * (k / 4),
//   element k % 4, i.e. row = lane % 16, k = 4 * (lane / 16) + 0..3; B is the transpose),
//   and AMD's "Matrix Core Programming on CDNA3 and CDNA4" (ROCm blog, 2025). The D
//   layout of every 16x16 f32 accumulator is the one arch/gfx950.h uses: column =
//   lane % 16, rows 4 * (lane / 16) + 0..3.
// - v_cvt_pk_f32_fp8 converts two e4m3fnuz bytes (word 0 or word 1 of the source) to two
//   f32 on gfx940+ (CDNA3 ISA guide, "fp8 conversions"); 0x80 gives NaN.
// - global_load_lds_dword (CDNA3 ISA guide, "global load LDS"; LLVM's
//   llvm.amdgcn.global.load.lds, size 4 -- gfx942 has no 12- or 16-byte form, gfx950 added
//   them): lane l's dword at its own global address lands at LDS M0 + offset + 4 l, and
//   counts in vmcnt like any vector load. Vector memory operations of a wave return in
//   issue order on CDNA (vmcnt counts down in order), which is what lets wait_vm<N> name
//   "everything but the N youngest".
// - v_perm_b32 (GCN3+ ISA guides): selector bytes 0..3 pick bytes of the second source,
//   4..7 of the first; that makes it an 8-entry byte table.
#pragma once

#include "arch/cdna.h"
#include "common/platform.h"

#if !defined(__gfx942__)
#error "arch/gfx942.h: gfx942 instructions; build this kernel for --offload-arch=gfx942 only"
#endif

namespace hipmla {
namespace gfx942 {

using namespace cdna;  // lane roles and reductions common to CDNA (arch/cdna.h)
constexpr int BF16_K = 16;                 // k of one bf16 MFMA
constexpr int K_PER_LANE = BF16_K / LANE_GROUPS;  // 4 consecutive k per lane and MFMA

typedef short i16x4 __attribute__((ext_vector_type(4)));


// D += A * B over k = 16; each operand is this lane's 4 bf16 as 2 dwords (low half =
// lower k).
HIPMLA_DEVICE f32x4 mfma_bf16_16x16x16(u32x2 a, u32x2 b, f32x4 d) {
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(i16x4, a), __builtin_bit_cast(i16x4, b), d,
                                                     0, 0, 0);
}

// Two e4m3fnuz bytes of `word` (bytes 0, 1, or 2, 3 with HIGH) as f32, lower byte first.
template <bool HIGH>
HIPMLA_DEVICE f32x2 fp8x2_to_f32(unsigned word) {
    return __builtin_amdgcn_cvt_pk_f32_fp8(int(word), HIGH);
}

// bf16 pair of two f32 that are already bf16 values (`lo` in the low half): their high
// halves, one v_perm, no rounding needed.
HIPMLA_DEVICE unsigned bf16_pair_exact(float lo, float hi) {
    return __builtin_amdgcn_perm(bits_from_f32(hi), bits_from_f32(lo), 0x07060302u);
}

// Low (LOW = true) or high bf16 halves of two words, `first` in the low result half.
template <bool LOW>
HIPMLA_DEVICE unsigned pick_halves(unsigned first, unsigned second) {
    return __builtin_amdgcn_perm(second, first, LOW ? 0x05040100u : 0x07060302u);
}

// The eight E2M1 nibbles of `x` (element 2j in the low nibble of byte j) times `scale`
// as f32, element order. E2M1 values are exact in e4m3fnuz, so a v_perm table maps
// magnitudes to fp8 codes four at a time and v_cvt_pk_f32_fp8 does the rest. -0 must
// become code 0x00, not 0x80 (NaN in fnuz): a nibble keeps its sign only when its
// magnitude is nonzero ((m + 7) has bit 3 set exactly then; no carry leaves a nibble).
// The scale multiplies the converts' pairs as they come (v_pk_mul_f32, two products an
// instruction; in element order the pairs straddle two converts and took one each).
HIPMLA_DEVICE void e2m1x8_to_f32_scaled(unsigned x, float scale, float* out) {
    constexpr unsigned TABLE_LO = 0x44403800u;  // 0, 0.5, 1, 1.5 as e4m3fnuz (bias 8)
    constexpr unsigned TABLE_HI = 0x54504c48u;  // 2, 3, 4, 6
    const unsigned mag = x & 0x77777777u;
    const unsigned sign = x & (mag + 0x77777777u) & 0x88888888u;
    const unsigned even = __builtin_amdgcn_perm(TABLE_HI, TABLE_LO, mag & 0x07070707u) | ((sign << 4) & 0x80808080u);
    const unsigned odd = __builtin_amdgcn_perm(TABLE_HI, TABLE_LO, (mag >> 4) & 0x07070707u) | (sign & 0x80808080u);
    const f32x2 s2 = {scale, scale};
    const f32x2 e02 = fp8x2_to_f32<false>(even) * s2, e46 = fp8x2_to_f32<true>(even) * s2;
    const f32x2 e13 = fp8x2_to_f32<false>(odd) * s2, e57 = fp8x2_to_f32<true>(odd) * s2;
    out[0] = e02.x; out[1] = e13.x; out[2] = e02.y; out[3] = e13.y;
    out[4] = e46.x; out[5] = e57.x; out[6] = e46.y; out[7] = e57.y;
}

// An E8M0 code as its f32 scale 2^(code - 127): code 0 gives 2^-127 exactly (ldexp
// makes the subnormal), 255 gives NaN as hip_src/KERNELS.md says: ldexp overflows to
// +inf there, and x * 0 + x is x for every finite x and NaN for an infinite one (one FMA,
// where a compare and a select took two; gfx950's kernel lets 255 become +inf).
HIPMLA_DEVICE float e8m0_to_f32(unsigned code) {
    const float x = __builtin_ldexpf(1.0f, int(code) - 127);
    return __builtin_fmaf(x, 0.0f, x);
}


// Asynchronous gather of 64 x 4 global bytes into 256 contiguous LDS bytes: lane l moves
// the dword at its own `src` (4-byte aligned) to LDS bytes 4l..4l+3 after `lds_base`
// (wave-uniform; the compiler puts it in M0). Wait with wait_vm before reading the copy.
HIPMLA_DEVICE void gather_256_to_lds(const unsigned char* src, void* lds_base) {
    typedef __attribute__((address_space(1))) void global_void;
    typedef __attribute__((address_space(3))) void lds_void;
    __builtin_amdgcn_global_load_lds((global_void*)src, (lds_void*)lds_base, 4, 0, 0);
}

// s_waitcnt vmcnt(N): every vector memory operation of this wave but the N issued last has
// completed (in-order completion), LDS copies included. (The CPU harness, tests/host_cdna.h,
// lands a copy when it is issued or, with late copies, here: all but the lane's N newest.
// Its lanes meet here.)
template <int N>
HIPMLA_DEVICE void wait_vm() {
    static_assert(N >= 0 && N < 64, "vmcnt is a 6-bit count on gfx9");
#if defined(HIPMLA_HOST_PLATFORM)
    host_wait_vm(N);
    wave_sync();
#else
    asm volatile("s_waitcnt vmcnt(%0)" ::"n"(N) : "memory");
#endif
}

// The block's waves meet, with this wave's LDS reads and writes done before (s_waitcnt
// lgkmcnt(0); s_barrier) -- block_sync without its fences: a workgroup release fence
// also waits for every LDS copy in flight (vmcnt(0), clang-22), which would drain the
// copy ring at every barrier. Only for barriers that publish LDS: the copies a wave
// needs it waits for itself (wait_vm), and nothing here orders global memory.
HIPMLA_DEVICE void lds_barrier() {
#if defined(HIPMLA_HOST_PLATFORM)
    block_sync();
#else
    asm volatile("s_waitcnt lgkmcnt(0)\n\ts_barrier" ::: "memory");
#endif
}

}  // namespace gfx942
}  // namespace hipmla
