// The warpgroup instructions of the 64-row sm_90a kernel (hip_src/arch/sm90a.h), emulated
// on the CPU so that tests/test_sm90_rows64.py runs hip_src/decode/split_sm90_rows64.hip,
// whole and unchanged, on the host harness (after tests/host_sm90.h, whose warp
// instructions, copies and shared memory it shares).
//
// wgmma reads both operands from shared memory through their descriptors (PTX ISA
// 9.7.15.5.1: start address, LBO, SBO, the 128-byte swizzle: address bits 4-6 XOR bits
// 7-9) and adds A B to the thread's own accumulators in the register-fragment layout of
// arch/sm90a.h's header, exact products summed in double and rounded once. It is as late
// as the PTX ISA lets it be: a wgmma runs at the wgmma.wait_group that covers its
// commit group (9.7.15.6), reading shared memory and writing the accumulators then, so a
// kernel that read its accumulators before that wait, or let an operand be overwritten
// before it, computes something else here and fails its comparison. A read of shared
// memory another thread is still writing, without a barrier between, is a
// ThreadSanitizer report as for any other load. The async-proxy fence is a no-op (the
// host has one proxy). What this proves: the schedule, the copies and dequantization, the
// operands' shared-memory layouts as the descriptors describe them, the wgmma ordering,
// the softmax with its masks, the output and the merges, as written.
#pragma once

#include <cstring>
#include <deque>
#include <vector>

// The kernel's `extern __shared__` array: the same host array as the 16-head kernel's.
#define hipmla_rows64_smem hipmla_sm90_smem

namespace hipmla {
namespace sm90a {

inline void st_shared_v4(unsigned a, const unsigned (&x)[4]) { std::memcpy(hipmla_sm90_smem + a, x, 16); }
inline void st_shared_v4_no_clobber(unsigned a, const unsigned (&x)[4]) { st_shared_v4(a, x); }
inline void st_shared_b32(unsigned a, unsigned x) { std::memcpy(hipmla_sm90_smem + a, &x, 4); }

inline void fence_async_smem() {}
template <int N>
inline void pin(float (&)[N]) {}

// A descriptor's byte fields (bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4); only
// the 128-byte swizzle (layout 1 in bits 62-63) is emulated.
struct HostDesc {
    unsigned start, lbo, sbo;
};
inline HostDesc host_desc(unsigned long long d) {
    if ((d >> 62) != 1ull) hipmla_lanes::unsupported("tests/host_sm90a.h", "a descriptor without the 128-byte swizzle");
    return HostDesc{unsigned(d & 0x3FFFu) << 4, unsigned((d >> 16) & 0x3FFFu) << 4, unsigned((d >> 32) & 0x3FFFu) << 4};
}
// The bf16 at logical shared address `a` of a 128-byte-swizzled operand.
inline double host_operand(unsigned a) {
    const unsigned at = a ^ (((a >> 7) & 7u) << 4);
    unsigned short h;
    std::memcpy(&h, hipmla_sm90_smem + at, 2);
    return hipmla_lanes::bf16_value(h);
}
// K-major: element (row, k), k along the 128-byte line, 8-line groups SBO apart.
inline unsigned k_major(const HostDesc& d, int row, int k) {
    return d.start + unsigned(row / 8) * d.sbo + unsigned(row % 8) * 128u + 2u * unsigned(k);
}
// MN-major: element (k, col), col along the line (64 a line, further 64s LBO apart), 8-line
// groups of k SBO apart.
inline unsigned mn_major(const HostDesc& d, int k, int col) {
    return d.start + unsigned(col / 64) * d.lbo + unsigned(k / 8) * d.sbo + unsigned(k % 8) * 128u +
           2u * unsigned(col % 64);
}

// D (64 x N) += A B for the thread's accumulators: warp w of the warpgroup, lane 4 g + t,
// element 4 j + e = row 16 w + g + 8 (e >> 1), column 8 j + 2 t + (e & 1).
template <int N, int TB>
inline void wgmma_host(float* d, unsigned long long a_desc, unsigned long long b_desc) {
    const HostDesc a = host_desc(a_desc), b = host_desc(b_desc);
    const int wt = int(host_thread % 128u), w = wt / 32, g = (wt % 32) / 4, t = wt % 4;
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * w + g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
            double sum = 0.0;
            for (int k = 0; k < 16; ++k)
                sum += host_operand(k_major(a, row, k)) * host_operand(TB ? mn_major(b, k, col) : k_major(b, col, k));
            d[4 * j + e] = float(double(d[4 * j + e]) + sum);
        }
}

// This thread's wgmma not yet run: those issued since the last commit, and the committed
// groups, oldest first.
struct HostWgmma {
    void (*run)(float*, unsigned long long, unsigned long long);
    float* d;
    unsigned long long a, b;
};
inline thread_local std::vector<HostWgmma> host_wg_open;
inline thread_local std::deque<std::vector<HostWgmma>> host_wg_groups;

inline void wg_fence() {}
inline void wg_commit() {
    host_wg_groups.push_back(std::move(host_wg_open));
    host_wg_open.clear();
}
// Runs the oldest groups until at most N are pending.
template <int N>
inline void wg_wait() {
    while (int(host_wg_groups.size()) > N) {
        for (const HostWgmma& w : host_wg_groups.front()) w.run(w.d, w.a, w.b);
        host_wg_groups.pop_front();
    }
}

inline void wgmma_m64n64k16(float (&d)[32], unsigned long long a, unsigned long long b) {
    host_wg_open.push_back(HostWgmma{&wgmma_host<64, 0>, d, a, b});
}
inline void wgmma_m64n256k16_tb(float (&d)[128], unsigned long long a, unsigned long long b) {
    host_wg_open.push_back(HostWgmma{&wgmma_host<256, 1>, d, a, b});
}

}  // namespace sm90a
}  // namespace hipmla
