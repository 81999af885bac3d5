// Issue cycles of an sm_90 SM per instruction kind, for the design of the sm_90 kernel: how
// long a scheduler (SM sub-partition) spends on mma.sync m16n8k16 / m16n8k8 (bf16, f32
// accumulators), wgmma m64n16k16 (A from registers or shared memory, B from shared memory)
// and the extra instructions below, CHAINS independent accumulators a warp. Not a library
// kernel: the operands are arbitrary bits, only the time means something.
// scripts/sm90_mma_rate.py builds and runs it.
//   RATE_OP 0 mma.m16n8k16, 1 mma.m16n8k8, 2 wgmma.m64n16k16 RS, 3 wgmma.m64n16k16 SS,
//           4 none (the extra instructions alone)
#include "common/platform.h"

#ifndef RATE_OP
#define RATE_OP 0
#endif
#ifndef RATE_CHAINS
#define RATE_CHAINS 4
#endif
#ifndef RATE_ALU
#define RATE_ALU 0
#endif
// The extra instructions: RATE_ALU of RATE_ALU_KIND, then RATE_ALU2 of RATE_ALU_KIND2, after
// each tensor instruction. Kinds: 0 lop3, 1 bf16x2 fma, 2 shift right (SHF), 3 integer
// multiply-add (IMAD), 4 movmatrix.trans, 5 f32 fma, 6 prmt, 7 f32 add, 8 ld.shared.v4,
// 9 ldmatrix.x4.trans, 10 st.shared.v4, 11 ex2.approx, 12 ld.shared.v2, 13 ld.shared.b32,
// 14 st.shared.v2, 15 shfl.bfly. Each works on one of 8 independent chains.
#ifndef RATE_ALU_KIND
#define RATE_ALU_KIND 0
#endif
#ifndef RATE_ALU2
#define RATE_ALU2 0
#endif
#ifndef RATE_ALU_KIND2
#define RATE_ALU_KIND2 0
#endif

namespace rate {
constexpr int CHAINS = RATE_CHAINS;

HIPMLA_DEVICE void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
HIPMLA_DEVICE void mma1688(float (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}
#if RATE_OP == 2 || RATE_OP == 3
HIPMLA_DEVICE void wgmma_rs(float (&d)[8], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}
HIPMLA_DEVICE void wgmma_ss(float (&d)[8], unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(a), "l"(b));
}
#endif

// One extra instruction of kind K on chain value x. The shared-memory kinds take a fixed
// address (lane l at 16 l: 4 wavefronts for every width, the 4- and 8-byte ones bank-
// conflicted) instead: they stand alone, no address math.
template <int K>
HIPMLA_DEVICE unsigned extra(unsigned x, unsigned a, unsigned b, unsigned addr) {
    unsigned r, r1, r2, r3;
    if (K == 0) asm volatile("lop3.b32 %0, %1, %2, %3, 0xE4;\n" : "=r"(r) : "r"(x), "r"(a), "r"(b));
    if (K == 1) asm volatile("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(a), "r"(b));
    if (K == 2) asm volatile("shr.b32 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(b & 7u));
    if (K == 3) asm volatile("mad.lo.u32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(a), "r"(b));
    if (K == 4) asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    if (K == 5) asm volatile("fma.rn.f32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(a), "r"(b));
    if (K == 6) asm volatile("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(a), "r"(b));
    if (K == 7) asm volatile("add.f32 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(a));
    if (K == 8) {
        asm volatile("ld.volatile.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
    }
    if (K == 9) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
        r ^= x;  // ptxas drops an ldmatrix whose result is dead: one lop3 keeps it (kind 9 = ldmatrix + lop3)
    }
    if (K == 10) {
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(a ^ 1u), "r"(b ^ 1u) : "memory");
        r = x;
    }
    if (K == 11) asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=r"(r) : "r"(x));
    if (K == 12) asm volatile("ld.volatile.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(r), "=r"(r1) : "r"(addr));
    if (K == 13) asm volatile("ld.volatile.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(addr));
    if (K == 14) {
        asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(a), "r"(b) : "memory");
        r = x;
    }
    if (K == 15) asm volatile("shfl.sync.bfly.b32 %0, %1, 4, 31, -1;\n" : "=r"(r) : "r"(x));
    return r;
}
}  // namespace rate

struct RateParams {
    long long* stamps;  // [block][warp][5]: clock64 and %globaltimer before and after the loop, %smid
    float* sink;        // keeps the accumulators
    int iters;
};

HIPMLA_DEVICE long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
HIPMLA_DEVICE unsigned sm_id() {
    unsigned r;
    asm("mov.u32 %0, %%smid;\n" : "=r"(r));
    return r;
}

extern "C" __global__ void __launch_bounds__(256) hipmla_probe_mma_rate(const RateParams p) {
    using namespace rate;
    long long* stamps = p.stamps;
    float* sink = p.sink;
    const int iters = p.iters;
    __shared__ __align__(1024) unsigned char smem[32768];
    const unsigned tid = threadIdx.x;
    for (unsigned i = tid; i < 32768 / 4; i += blockDim.x) reinterpret_cast<unsigned*>(smem)[i] = 0x3f803f80u ^ (i & 7);
    __syncthreads();
    unsigned a0 = 0x3f803f80u ^ tid, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = a0 + 4, b1 = a0 + 5;
    unsigned x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = tid * (i + 3);
    const unsigned sbase = unsigned(__cvta_generic_to_shared(smem));
    const unsigned lane_addr = sbase + 16u * (tid & 31);  // (^ 512 a round) + 1 KiB (k + 8 (c % 4)) below: < 32 KiB
#if RATE_OP == 2 || RATE_OP == 3
    float d[CHAINS][8];
    const unsigned long long desc = (unsigned long long)((sbase & 0x3FFFF) >> 4) | (8ull << 16) | (16ull << 32);
#else
    float d[CHAINS][4];
#endif
#pragma unroll
    for (int c = 0; c < CHAINS; ++c)
#pragma unroll
        for (int e = 0; e < int(sizeof(d[0]) / 4); ++e) d[c][e] = 0.0f;
    __syncthreads();
    const long long g0 = global_ns();
    const long long t0 = clock64();
#pragma unroll 1
    for (int it = 0; it < iters; ++it) {
#if RATE_OP == 2 || RATE_OP == 3
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
        const unsigned it_addr = lane_addr ^ ((it & 1u) << 9);  // shared-memory kinds: a new address each round
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
#if RATE_OP == 0
            mma16816(d[c], a0, a1, a2, a3, b0, b1);
#elif RATE_OP == 1
            mma1688(d[c], a0, a1, b0);
#elif RATE_OP == 2
            wgmma_rs(d[c], a0, a1, a2, a3, desc);
#elif RATE_OP == 3
            wgmma_ss(d[c], desc, desc + 64);
#endif
#pragma unroll
            for (int k = 0; k < RATE_ALU; ++k) x[k & 7] = extra<RATE_ALU_KIND>(x[k & 7], a0, b0, it_addr + 1024u * ((k & 7) + 8 * (c & 3)));
#pragma unroll
            for (int k = 0; k < RATE_ALU2; ++k) x[(k + 4) & 7] = extra<RATE_ALU_KIND2>(x[(k + 4) & 7], a0, b0, it_addr + 1024u * (((k + 4) & 7) + 8 * (c & 3)));
        }
#if RATE_OP == 2 || RATE_OP == 3
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
    }
    const long long t1 = clock64();
    const long long g1 = global_ns();
    if ((tid & 31) == 0) {
        long long* st = stamps + 5 * (blockIdx.x * (blockDim.x / 32) + tid / 32);
        st[0] = t0;
        st[1] = t1;
        st[2] = g0;
        st[3] = g1;
        st[4] = sm_id();
    }
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c)
#pragma unroll
        for (int e = 0; e < int(sizeof(d[0]) / 4); ++e) s += d[c][e];
#pragma unroll
    for (int i = 0; i < 8; ++i) s += float(x[i] & 1);
    sink[blockIdx.x * blockDim.x + tid] = s;
}
