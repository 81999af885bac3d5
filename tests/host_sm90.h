// The warp instructions of the sm_90 tensor-core kernel (hip_src/arch/sm90.h), emulated
// on the CPU so that tests/test_kernels.py runs hip_src/decode/split_sm90.hip, whole and
// unchanged, on the host harness (one host thread per GPU thread, 32-lane warps).
//
// What this proves and what it cannot: everything around the instructions (schedule,
// paged rows, the copy ring, the dequantization by bit placement, the cross-warp score
// exchange, online softmax, P.V through movmatrix, the merge, the output) runs as written,
// with the fragment layouts of the PTX ISA that sm90.h cites. The kernel runs on the H200
// too (tests/test_sm90.py), which checks those layouts for real; this runs on every CI
// machine. cp.async lands when issued, or (hipmla::host_late_copies) only at the
// cp.async.wait_group that covers its group, so a missing or short wait shows as stale
// data; ex2.approx is exact exp2 here (the device's is within 2 ulp), flushed below 2^-126
// as .ftz does.
#pragma once

#include <cmath>
#include <cstring>
#include <deque>

#include "host_lanes.h"

namespace hipmla {
namespace sm90 {

constexpr int WARP = 32;
constexpr int HOST_SMEM_BYTES = 224 * 1024;  // what an sm_90 block may opt in to

}  // namespace sm90
}  // namespace hipmla

// The kernel's `extern __shared__` array (C linkage: it is declared inside an extern "C"
// function), on 1024 bytes as the 64-row kernel's swizzled operands need.
extern "C" {
alignas(1024) unsigned char hipmla_sm90_smem[hipmla::sm90::HOST_SMEM_BYTES];
}

#define __global__
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

inline void __trap() { hipmla_lanes::unsupported("tests/host_sm90.h", "a trap (the kernel asked to stop)"); }

namespace hipmla {
namespace sm90 {

inline int lane() { return hipmla_lanes::lane<WARP>(); }

template <class T, class F>
auto exchange(const T& mine, F&& f) {
    return hipmla_lanes::exchange<WARP>(mine, f);
}

// f16 bits (the low 16 of h) as a value, exactly.
inline double f16_value(unsigned h) {
    const unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const double sign = (h & 0x8000u) ? -1.0 : 1.0;
    if (e == 31u) return m ? std::nan("") : sign * HUGE_VAL;
    return sign * (e ? std::ldexp(double(1024u + m), int(e) - 25) : std::ldexp(double(m), -24));
}

// f32 to f16 bits, round to nearest even, subnormals kept, overflow to inf (cvt.rn.f16.f32).
inline unsigned f16_rne(float x) {
    const unsigned b = __builtin_bit_cast(unsigned, x);
    const unsigned sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;          // NaN: the canonical one the H200 gives
    if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to inf
    if (a >= 0x38800000u) {                       // an f16 normal: 23 mantissa bits to 10
        const unsigned m = a - 0x38000000u;
        const unsigned round = (m >> 12) & 1u, sticky = (m & 0xfffu) != 0u, odd = (m >> 13) & 1u;
        return sign | ((m >> 13) + (round & (sticky | odd)));
    }
    // Subnormal: a multiple of 2^-24, rounded as an integer (x * 2^24 is exact).
    return sign | unsigned(std::nearbyint(double(__builtin_bit_cast(float, a)) * 0x1p24));
}

// An e4m3fn code as a value (0x7f / 0xff: NaN; no infinities).
inline double e4m3_value(unsigned byte) {
    const unsigned e = (byte >> 3) & 0xfu, m = byte & 7u;
    const double sign = (byte & 0x80u) ? -1.0 : 1.0;
    if (e == 15u && m == 7u) return std::nan("");
    return sign * (e ? std::ldexp(double(8u + m), int(e) - 10) : std::ldexp(double(m), -9));
}

// mma.sync m16n8kK (K = 16 or 8), row.col, bf16 (or, F16, f16) in, f32 accumulate (PTX ISA 9.7.14.5.8):
// lane 4 g + t; A regs (row g | g + 8, cols 2t.. | 2t + 8..), B regs (rows 2t.. | 2t + 8..,
// col g), D (row g | g + 8, cols 2t, 2t + 1). Exact products summed in double, rounded once.
struct MmaIn {
    unsigned a[4], b[2];
};

template <int K, bool F16 = false>
inline void mma(float (&d)[4], const MmaIn& mine) {
    auto value = [](unsigned h) { return F16 ? f16_value(h & 0xffffu) : hipmla_lanes::bf16_value(h); };
    auto r = exchange(mine, [&](auto peer) {
        MmaIn all[WARP];
        for (int l = 0; l < WARP; ++l) all[l] = peer(l);
        // A(row, k): lane 4 (row % 8) + (k % 8) / 2, reg (row / 8) + 2 (k / 8), half k % 2.
        auto a = [&](int row, int k) {
            const unsigned w = all[4 * (row % 8) + (k % 8) / 2].a[(row / 8) + 2 * (k / 8)];
            return value(w >> (16 * (k % 2)));
        };
        // B(k, col): lane 4 col + (k % 8) / 2, reg k / 8, half k % 2.
        auto b = [&](int k, int col) {
            const unsigned w = all[4 * col + (k % 8) / 2].b[k / 8];
            return value(w >> (16 * (k % 2)));
        };
        const int l = lane(), g = l / 4, t = l % 4;
        struct Out { float v[4]; } out;
        for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
            double sum = 0.0;
            for (int k = 0; k < K; ++k) sum += a(row, k) * b(k, col);
            out.v[e] = float(double(d[e]) + sum);
        }
        return out;
    });
    for (int e = 0; e < 4; ++e) d[e] = r.v[e];
}

template <bool F16>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma<16, F16>(d, MmaIn{{a[0], a[1], a[2], a[3]}, {b0, b1}});
}

template <bool F16>
inline void mma_1688(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    mma<8, F16>(d, MmaIn{{a0, a1, 0u, 0u}, {b0, 0u}});
}

// cvt.rn.f16x2.e4m3x2 of bits 16 HALF .. 16 HALF + 15 (every e4m3 value is an f16 value).
template <int HALF>
inline unsigned e4m3x2_to_f16x2(unsigned q) {
    const unsigned two = q >> (16 * HALF);
    return f16_rne(float(e4m3_value(two & 0xffu))) | (f16_rne(float(e4m3_value((two >> 8) & 0xffu))) << 16);
}

// f16x2 -> f32 -> bf16x2 (every f16 value this meets, e4m3's, is a bf16 value; NaN stays NaN).
inline unsigned f16x2_to_bf16x2(unsigned h) {
    return hipmla_lanes::bf16_rne(float(f16_value(h & 0xffffu))) |
           (hipmla_lanes::bf16_rne(float(f16_value(h >> 16))) << 16);
}

// movmatrix.sync.m8n8.trans.b16: lane (g, t) receives elements (2t, g) and (2t + 1, g).
inline unsigned movmatrix_trans(unsigned x) {
    return exchange(x, [](auto peer) {
        const int l = lane(), g = l / 4, t = l % 4;
        auto elem = [&](int row, int col) { return (peer(4 * row + col / 2) >> (16 * (col % 2))) & 0xffffu; };
        return elem(2 * t, g) | (elem(2 * t + 1, g) << 16);
    });
}

// fma.rn.bf16x2 as the kernel uses it (products by powers of two, exact): fmaf, then RNE.
inline unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d = 0;
    for (int h = 0; h < 2; ++h) {
        const float r = std::fmaf(float(hipmla_lanes::bf16_value(a >> (16 * h))),
                                  float(hipmla_lanes::bf16_value(b >> (16 * h))),
                                  float(hipmla_lanes::bf16_value(c >> (16 * h))));
        d |= hipmla_lanes::bf16_rne(r) << (16 * h);
    }
    return d;
}

inline unsigned select_bits(unsigned m, unsigned a, unsigned b) { return (a & m) | (b & ~m); }
template <unsigned M>
inline unsigned and_bits(unsigned a) { return a & M; }
inline unsigned loop_invariant(unsigned v) { return v; }
inline unsigned pack_bf16x2_rn(float lo, float hi) { return hipmla_lanes::bf16_rne(lo) | (hipmla_lanes::bf16_rne(hi) << 16); }
inline unsigned pack_f16x2_rn(float lo, float hi) { return f16_rne(lo) | (f16_rne(hi) << 16); }

inline float exp2_approx(float x) {
    const float r = std::exp2(x);
    return r < 0x1p-126f ? 0.0f : r;
}

// Shared memory is one array here; an "address" is the offset into it.
inline unsigned smem_address(const void* p) {
    return unsigned(static_cast<const unsigned char*>(p) - hipmla_sm90_smem);
}

// cp.async groups of this thread while copies land late: the sizes of the committed groups
// still pending, oldest first, and the copies issued since the last commit (their copies
// wait in hipmla::host_copies, in issue order; what is pending when the thread ends, the
// launch counts).
inline thread_local std::deque<int> host_async_groups;
inline thread_local int host_async_open = 0;
inline const unsigned char host_zeros[16] = {};

inline void cp_async_16(unsigned dst, const void* src, unsigned src_bytes) {
    if (src_bytes != 16u && src_bytes != 0u) hipmla_lanes::unsupported("tests/host_sm90.h", "a partial cp.async");
    hipmla::host_copy(hipmla_sm90_smem + dst, src_bytes ? src : host_zeros, 16);
    if (hipmla::host_late_copies) ++host_async_open;
}
inline void cp_async_commit() {
    if (!hipmla::host_late_copies) return;
    host_async_groups.push_back(host_async_open);
    host_async_open = 0;
}
// Lands the oldest groups until at most N are pending (cp.async.wait_group N); the copies
// since the last commit are in no group and stay pending.
template <int N>
inline void cp_async_wait() {
    while (int(host_async_groups.size()) > N) {
        for (int k = host_async_groups.front(); k > 0; --k) {
            const hipmla::HostCopy c = hipmla::host_copies.front();
            hipmla::host_copies.pop_front();
            std::memcpy(c.dst, c.src, c.n);
        }
        host_async_groups.pop_front();
    }
}

inline unsigned dynamic_smem_size() { return HOST_SMEM_BYTES; }

template <class T>
inline T warp_xor_max(T v, int lane_mask) {
    const T o = exchange(v, [lane_mask](auto peer) { return peer(lane() ^ lane_mask); });
    return o > v ? o : v;
}
inline float warp_xor_sum(float v, int lane_mask) {
    return v + exchange(v, [lane_mask](auto peer) { return peer(lane() ^ lane_mask); });
}
inline bool warp_all(bool v) {
    return exchange(v, [](auto peer) {
        bool all = true;
        for (int l = 0; l < WARP; ++l) all = all && peer(l);
        return all;
    });
}
inline bool warp_any(bool v) {
    return exchange(v, [](auto peer) {
        bool any = false;
        for (int l = 0; l < WARP; ++l) any = any || peer(l);
        return any;
    });
}

}  // namespace sm90
}  // namespace hipmla
