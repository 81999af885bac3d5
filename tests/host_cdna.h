// The wave64 instructions of the CDNA fast kernels (hip_src/arch/cdna.h, gfx950.h,
// gfx942.h), emulated on the CPU so that tests/test_kernels.py runs those kernels, whole
// and unchanged, on the host harness (one host thread per GPU thread, tests/host_harness.py).
//
// What this proves and what it cannot: everything the kernels do around the instructions
// (schedule, paged rows, copies into LDS, masking, online softmax, the wave and split
// merges, the output) runs as written. The instructions themselves follow the operand
// layouts the arch headers cite (AMD's matrix-core documentation); an emulation written
// from the same reading cannot confirm that reading. In particular the fp8 B-operand
// striping of the gfx950 scaled MFMA (the header's one unconfirmed fact) is assumed here
// exactly as there. Async copies land when issued, or only at the vmcnt wait that covers
// them: a missing or short vmcnt wait shows as stale data in the second mode
// (test_fast_kernels_on_cpu_wait_for_their_copies); a missing lgkmcnt wait before a copy
// overwrites a buffer still being read does not (the harness's reads are synchronous).
//
// Cross-lane instructions (MFMA, ds_bpermute, readfirstlane) are a rendezvous of the 64
// threads of a wave (tests/host_lanes.h).
// MFMA products are exact in double and summed in double, then rounded once to f32: the
// hardware's internal order is not documented, and the kernels' bound against the
// emulator is the test.
#pragma once

#include <cmath>
#include <cstring>

#include "host_lanes.h"

#if !defined(__gfx950__) && !defined(__gfx942__)
#error "tests/host_cdna.h: define __gfx950__ or __gfx942__ (the arch the kernel is built for)"
#endif

namespace hipmla_cdna {

constexpr int WAVE = 64;
using hipmla_lanes::bf16_rne;
using hipmla_lanes::bf16_value;

inline int lane() { return hipmla_lanes::lane<WAVE>(); }

template <class T, class F>
auto exchange(const T& mine, F&& f) {
    return hipmla_lanes::exchange<WAVE>(mine, f);
}

[[noreturn]] inline void unsupported(const char* what) { hipmla_lanes::unsupported("tests/host_cdna.h", what); }

// ---------------------------------------------------------------------------- element values

inline double e2m1_value(unsigned n) {
    static const double mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    return (n & 8u) ? -mag[n & 7u] : mag[n & 7u];
}

// OCP e4m3fn: bias 7, subnormals m * 2^-9, 0x7f / 0xff NaN, no inf.
inline double e4m3fn_value(unsigned b) {
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) return NAN;
    const double v = e ? std::ldexp(1.0 + m / 8.0, int(e) - 7) : std::ldexp(double(m), -9);
    return (b & 0x80u) ? -v : v;
}

// e4m3fnuz (gfx942): bias 8, subnormals m * 2^-10, 0x80 the only NaN, no -0, no inf.
inline double e4m3fnuz_value(unsigned b) {
    if (b == 0x80u) return NAN;
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    const double v = e ? std::ldexp(1.0 + m / 8.0, int(e) - 8) : std::ldexp(double(m), -10);
    return (b & 0x80u) ? -v : v;
}

inline double e8m0_value(unsigned s) { return s == 255u ? NAN : std::ldexp(1.0, int(s) - 127); }


// ---------------------------------------------------------------------------- cross-lane

inline int ds_bpermute(int address, int data) {
    return exchange(data, [address](auto peer) { return peer((address >> 2) & (WAVE - 1)); });
}

inline int readfirstlane(int v) {
    return exchange(v, [](auto peer) { return peer(0); });
}

// ---------------------------------------------------------------------------- MFMA

// D (16 x 16 f32) of this lane: column lane % 16, rows 4 (lane / 16) + 0..3, from
// elem(all, is_a, row_or_col, k), the element of A (row) or B (column) at k, read from
// `all` (every lane's operands).
template <class In, class Elem>
hipmla::f32x4 mfma_16x16(const In& mine, hipmla::f32x4 c, int k_total, Elem elem) {
    return exchange(mine, [&](auto peer) {
        In all[WAVE];
        for (int l = 0; l < WAVE; ++l) all[l] = peer(l);
        const int l = lane(), col = l % 16, row0 = 4 * (l / 16);
        hipmla::f32x4 d;
        for (int r = 0; r < 4; ++r) {
            double sum = 0.0;
            for (int k = 0; k < k_total; ++k) sum += elem(all, true, row0 + r, k) * elem(all, false, col, k);
            d[r] = float(double(c[r]) + sum);
        }
        return d;
    });
}

struct ScaledIn {
    unsigned a[8], b[8];
    unsigned scale_a, scale_b;
};

// v_mfma_scale_f32_16x16x128_f8f6f4 (gfx950), formats e4m3 (0) and e2m1 (4):
// row / column = lane % 16; e2m1: 32 consecutive k at 32 (lane / 16) in dwords 0-3;
// e4m3: k = 16 (lane / 16) + 0..15 in dwords 0-3 and 64 + 16 (lane / 16) + 0..15 in
// dwords 4-7; E8M0 of (row, k-block of 32) in the byte `opsel` of lane row + 16 block.
template <class V8>
hipmla::f32x4 mfma_scale_16x16x128(V8 a, V8 b, hipmla::f32x4 c, int a_fmt, int b_fmt, int opsel_a, int scale_a,
                                   int opsel_b, int scale_b) {
    for (int f : {a_fmt, b_fmt})
        if (f != 0 && f != 4) unsupported("an MFMA format other than e4m3 (0) and e2m1 (4)");
    ScaledIn in;
    static_assert(sizeof(V8) == sizeof(in.a), "8 dwords per operand");
    std::memcpy(in.a, &a, sizeof(in.a));
    std::memcpy(in.b, &b, sizeof(in.b));
    in.scale_a = (unsigned(scale_a) >> (8 * opsel_a)) & 0xffu;
    in.scale_b = (unsigned(scale_b) >> (8 * opsel_b)) & 0xffu;
    auto elem = [a_fmt, b_fmt](const ScaledIn* all, bool is_a, int rc, int k) {
        const int fmt = is_a ? a_fmt : b_fmt;
        const int holder = fmt == 4 ? rc + 16 * (k / 32) : rc + 16 * ((k % 64) / 16);
        const ScaledIn& op = all[holder];
        const unsigned* words = is_a ? op.a : op.b;
        const unsigned char* bytes = reinterpret_cast<const unsigned char*>(words);
        double v;
        if (fmt == 4) {
            const int j = k % 32;
            v = e2m1_value((bytes[j / 2] >> (4 * (j % 2))) & 15u);
        } else {
            v = e4m3fn_value(bytes[16 * (k / 64) + k % 16]);
        }
        const ScaledIn& sc = all[rc + 16 * (k / 32)];
        return v * e8m0_value(is_a ? sc.scale_a : sc.scale_b);
    };
    return mfma_16x16(in, c, 128, elem);
}

// The bf16 MFMAs: 16x16xK, row / column = lane % 16, K / 4 consecutive k per lane at
// (K / 4) (lane / 16), as bf16 pairs (low half = lower k).
template <int K>
struct Bf16In {
    unsigned a[K / 8], b[K / 8];
};

template <int K, class V>
hipmla::f32x4 mfma_bf16_16x16(V a, V b, hipmla::f32x4 c, int cbsz, int abid, int blgp) {
    if (cbsz != 0 || abid != 0 || blgp != 0) unsupported("an MFMA broadcast (cbsz / abid / blgp != 0)");
    Bf16In<K> in;
    static_assert(sizeof(V) == sizeof(in.a), "K / 4 bf16 per lane");
    std::memcpy(in.a, &a, sizeof(in.a));
    std::memcpy(in.b, &b, sizeof(in.b));
    auto elem = [](const Bf16In<K>* all, bool is_a, int rc, int k) {
        const Bf16In<K>& op = all[rc + 16 * (k / (K / 4))];
        const int e = k % (K / 4);
        const unsigned w = (is_a ? op.a : op.b)[e / 2];
        return bf16_value(w >> (16 * (e % 2)));
    };
    return mfma_16x16(in, c, K, elem);
}

// ---------------------------------------------------------------------------- lane-local

// v_perm_b32: result byte i = byte sel_i of {s0 (bytes 4-7), s1 (bytes 0-3)}; 8..11 the
// sign of a 16-bit half, 12 zero, 13+ 0xff.
inline unsigned perm(unsigned s0, unsigned s1, unsigned sel) {
    const unsigned long long both = (static_cast<unsigned long long>(s0) << 32) | s1;
    unsigned d = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned s = (sel >> (8 * i)) & 0xffu;
        unsigned byte;
        if (s < 8) byte = unsigned(both >> (8 * s)) & 0xffu;
        else if (s < 12) byte = ((both >> (16 * (s - 8) + 15)) & 1u) ? 0xffu : 0u;
        else byte = s == 12 ? 0u : 0xffu;
        d |= byte << (8 * i);
    }
    return d;
}

// v_cvt_scalef32_pk_bf16_fp4: the two E2M1 nibbles of byte `byte` times `scale`, bf16 RNE.
inline unsigned cvt_scalef32_pk_bf16_fp4(unsigned src, float scale, int byte) {
    const unsigned b = (src >> (8 * byte)) & 0xffu;
    const float lo = float(e2m1_value(b & 15u) * double(scale));
    const float hi = float(e2m1_value(b >> 4) * double(scale));
    return bf16_rne(lo) | (bf16_rne(hi) << 16);
}

// v_cvt_pk_f32_fp8: two fp8 bytes (0, 1, or 2, 3 with high) as f32; the arch's fp8.
inline hipmla::f32x2 cvt_pk_f32_fp8(int word, bool high) {
    const unsigned w = unsigned(word) >> (high ? 16 : 0);
#if defined(__gfx942__)
    return hipmla::f32x2{float(e4m3fnuz_value(w & 0xffu)), float(e4m3fnuz_value((w >> 8) & 0xffu))};
#else
    return hipmla::f32x2{float(e4m3fn_value(w & 0xffu)), float(e4m3fn_value((w >> 8) & 0xffu))};
#endif
}

// global_load_lds (dwordx4 on gfx950, dword on gfx942): lane l's `size` bytes to LDS base +
// offset + size l, asynchronously (hipmla::host_copy: at once, or at the wait that covers it).
inline void global_load_lds(const void* src, void* lds_base, int size, int offset, int aux) {
    if (aux != 0) unsupported("a global_load_lds cache policy (aux != 0)");
    hipmla::host_copy(static_cast<unsigned char*>(lds_base) + offset + size * lane(), src, size_t(size));
}

}  // namespace hipmla_cdna

namespace hipmla {
// platform.h's wave_sync: the 64 threads of the wave meet (hardware lanes are in lockstep).
inline void wave_sync() { hipmla_lanes::meet<hipmla_cdna::WAVE>(); }
}  // namespace hipmla

#define __builtin_amdgcn_ds_bpermute(address, data) ::hipmla_cdna::ds_bpermute(address, data)
#define __builtin_amdgcn_readfirstlane(v) ::hipmla_cdna::readfirstlane(v)
#define __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(a, b, c, fa, fb, oa, sa, ob, sb) \
    ::hipmla_cdna::mfma_scale_16x16x128(a, b, c, fa, fb, oa, sa, ob, sb)
#define __builtin_amdgcn_mfma_f32_16x16x32_bf16(a, b, c, cbsz, abid, blgp) \
    ::hipmla_cdna::mfma_bf16_16x16<32>(a, b, c, cbsz, abid, blgp)
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, cbsz, abid, blgp) \
    ::hipmla_cdna::mfma_bf16_16x16<16>(a, b, c, cbsz, abid, blgp)
#define __builtin_amdgcn_perm(s0, s1, sel) ::hipmla_cdna::perm(s0, s1, sel)
#define __builtin_amdgcn_cvt_scalef32_pk_bf16_fp4(src, scale, byte) \
    ::hipmla_cdna::cvt_scalef32_pk_bf16_fp4(src, scale, byte)
#define __builtin_amdgcn_cvt_pk_f32_fp8(word, high) ::hipmla_cdna::cvt_pk_f32_fp8(word, high)
#define __builtin_amdgcn_global_load_lds(src, lds, size, offset, aux) \
    ::hipmla_cdna::global_load_lds((const void*)(src), (void*)(lds), size, offset, aux)
#define __builtin_amdgcn_sched_barrier(mask) ((void)0)
