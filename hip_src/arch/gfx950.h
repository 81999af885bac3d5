// gfx950 (MI355X, CDNA4) building blocks of the fast split kernel: wave64 lane roles,
// the scaled and bf16 MFMAs, the scaled fp4 -> bf16 convert, cross-lane reductions and
// the asynchronous global -> LDS copy. Raw instructions live here and nowhere else.
//
// Where the layout facts come from (no gfx950 exists on the project's machines):
// - Builtin signatures and argument order: clang's BuiltinsAMDGPU.td / AMDGPUBuiltins.rst
//   and LLVM's IntrinsicsAMDGPU.td (llvm.amdgcn.mfma.scale.f32.16x16x128.f8f6f4:
//   a, b, c, cbsz = A format, blgp = B format, opsel_a, scale_a, opsel_b, scale_b; format
//   codes 0 e4m3, 1 e5m2, 2 e2m3, 3 e3m2, 4 e2m1).
// - MFMA operand layouts: AMD's "Matrix Core Programming on CDNA3 and CDNA4" (ROCm blog,
//   2025), sections 5.2-5.5, and the CDNA4 ISA guide it cites. For 16x16xK:
//   A row = lane % 16, B column = lane % 16, D column = lane % 16 and D rows
//   4 * (lane / 16) + 0..3. K per lane: bf16 16x16x32: 8 consecutive k at 8 * (lane / 16).
//   Scaled 16x16x128 with an fp4 operand: 32 consecutive k at 32 * (lane / 16) (16 bytes,
//   the upper 4 dwords unused); with an fp8 operand two stripes of 16: k = 16 * (lane / 16)
//   + 0..15 in dwords 0-3 and 64 + 16 * (lane / 16) + 0..15 in dwords 4-7 (the blog's
//   32x32x64 fp8 figure, scaled to four lane groups). Block scales are a matrix of their
//   own: lane l holds the E8M0 of row (or column) l % 16, k-block l / 16, whatever the
//   element layout. The seed kernel relied on the fp4 x fp4 case on MI355X; the fp8
//   operand layout is the one fact here that no hardware run has confirmed yet.
#pragma once

#include "arch/cdna.h"
#include "common/platform.h"

#if !defined(__gfx950__)
#error "arch/gfx950.h: gfx950 instructions; build this kernel for --offload-arch=gfx950 only"
#endif

namespace hipmla {
namespace gfx950 {

using namespace cdna;  // lane roles and reductions common to CDNA (arch/cdna.h)
constexpr int SCALED_K = 128;              // k of one scaled MFMA
constexpr int BF16_K = 32;                 // k of one bf16 MFMA

// Format codes of the scaled MFMA's cbsz / blgp operands.
constexpr int MFMA_FMT_E4M3 = 0;
constexpr int MFMA_FMT_E2M1 = 4;

typedef int i32x8 __attribute__((ext_vector_type(8)));
typedef __bf16 bf16x8 __attribute__((ext_vector_type(8)));


// D += A * B over k = 128 with E8M0 block scales (opsel 0: the scale's low byte).
template <int A_FMT, int B_FMT>
HIPMLA_DEVICE f32x4 mfma_scaled_16x16x128(i32x8 a, unsigned scale_a, i32x8 b, unsigned scale_b, f32x4 d) {
    static_assert(A_FMT == MFMA_FMT_E2M1 || A_FMT == MFMA_FMT_E4M3, "A: e2m1 or e4m3");
    static_assert(B_FMT == MFMA_FMT_E2M1 || B_FMT == MFMA_FMT_E4M3, "B: e2m1 or e4m3");
    return __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(a, b, d, A_FMT, B_FMT, 0, int(scale_a), 0, int(scale_b));
}

// D += A * B over k = 32, bf16 operands as 4 dwords of bf16 pairs (low half = lower k).
HIPMLA_DEVICE f32x4 mfma_bf16_16x16x32(u32x4 a, u32x4 b, f32x4 d) {
    return __builtin_amdgcn_mfma_f32_16x16x32_bf16(__builtin_bit_cast(bf16x8, a), __builtin_bit_cast(bf16x8, b), d, 0, 0, 0);
}

// The two E2M1 nibbles of byte BYTE of `packed`, times `scale`, as a bf16 pair
// (low half = low nibble). Exact for every scale MXFP4 data can carry.
template <int BYTE>
HIPMLA_DEVICE unsigned cvt_fp4x2_bf16x2(unsigned packed, float scale) {
    static_assert(BYTE >= 0 && BYTE < 4, "byte select is 0..3");
    return __builtin_bit_cast(unsigned, __builtin_amdgcn_cvt_scalef32_pk_bf16_fp4(packed, scale, BYTE));
}

// Low (LOW = true) or high bf16 halves of two words, `first` in the low result half.
template <bool LOW>
HIPMLA_DEVICE unsigned pick_halves(unsigned first, unsigned second) {
    return __builtin_amdgcn_perm(second, first, LOW ? 0x05040100u : 0x07060302u);
}


// Asynchronous gather of 64 x 16 global bytes into 1024 contiguous LDS bytes: lane l
// moves the 16 bytes at its own `src` (any 16-byte aligned address) to LDS bytes
// 16l..16l+15 after `lds_base` (global_load_lds_dwordx4: the global address is per lane,
// the LDS base wave-uniform, the compiler puts it in M0). Wait with wait_global_loads()
// before reading the copy.
HIPMLA_DEVICE void gather_1k_to_lds(const unsigned char* src, void* lds_base) {
    typedef __attribute__((address_space(1))) void global_void;
    typedef __attribute__((address_space(3))) void lds_void;
    __builtin_amdgcn_global_load_lds((global_void*)src, (lds_void*)lds_base, 16, 0, 0);
}

// s_waitcnt vmcnt(0): every global load of this wave, including LDS copies, has landed.
// (The CPU harness, tests/host_cdna.h, lands a copy when it is issued or, with late copies,
// here; its lanes meet here.)
HIPMLA_DEVICE void wait_global_loads() {
#if defined(HIPMLA_HOST_PLATFORM)
    host_wait_vm(0);
    wave_sync();
#else
    asm volatile("s_waitcnt vmcnt(0)" ::: "memory");
#endif
}

// s_waitcnt lgkmcnt(0): every LDS read of this wave has returned, so an LDS copy issued
// next cannot overwrite what a read still has to deliver (the hardware orders neither).
// (The CPU harness lands a copy when it is issued: its lanes meet here first.)
HIPMLA_DEVICE void wait_lds_reads() {
#if defined(HIPMLA_HOST_PLATFORM)
    wave_sync();
#else
    asm volatile("s_waitcnt lgkmcnt(0)" ::: "memory");
#endif
}

// An E8M0 code as the f32 scale the converts take: 2^(code - 127) by ldexp, two VALU
// instead of four for the explicit cases; code 0 gives 2^-127 exactly, 255 (NaN in E8M0)
// gives +inf here, so a NaN-scaled block reads as inf / NaN rather than NaN throughout.
HIPMLA_DEVICE float e8m0_to_f32(unsigned code) { return __builtin_ldexpf(1.0f, int(code) - 127); }

}  // namespace gfx950
}  // namespace hipmla
