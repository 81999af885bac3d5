// Feasibility probe (not a library kernel): the token-split design for MXFP4 on sm_90a.
// scripts/sm90_wgmma_probe.py builds it after arch/sm90.h (its dequantization helpers)
// and times it; see that script's docstring for what it measures and what it leaves out.
//
// Block = 2 warpgroups (256 threads), one block an SM (the shared memory below is the
// whole opt-in limit). Block b reads rows [b n, (b + 1) n) of a contiguous MXFP4 cache;
// warpgroup wg takes 64-token tiles wg, wg + 2, ... with its own 2-stage cp.async ring,
// its own online softmax (running max per 64 tokens) and its own O^T; both are written
// out unmerged (the script merges them).
// Per tile, warp w of a warpgroup owns tokens 16 w .. 16 w + 15 for Q.K:
//   S^T = K' Q'^T   wgmma.m64n16k16, A = K' dequantized into registers (mma A-fragment
//                   layout: lane (g, t) rows g, g + 8), B = Q'^T from shared memory
//                   (K-major, no swizzle, one 512-byte block of 4 core matrices a k-step);
//                   k-step kk's 16 slots are dims 8 word + 2 (kk & 1) + r + 4 e of the
//                   words 16 t + kk / 2 (latent) / 64 + 2 t + kk / 2 - 16 (rope) of lane t.
//   V               the latent words, once dequantized, also go to shared memory as bf16
//                   (16-byte stores, 128-byte swizzle), V^T's MN-major atoms for P.V.
//   P^T             movmatrix'd into K-major core matrices (B of P.V).
//   O^T += V^T P^T  wgmma.m64n16k16, A = V^T from shared memory (transposed), B = P^T;
//                   8 M-blocks of 64 dims: O^T is 64 f32 a thread.
// Descriptors (checked on the H200 against float64, PROBE_VDESC): K-major without swizzle,
// LBO is the stride between core matrices along K and SBO along M / N; for the MN-major
// 128-byte-swizzled V^T, SBO is the stride between 8-row groups along K (1 KiB here) and
// LBO the stride between 64-element atoms along M (unused at M = 64): LBO 1 KiB / SBO 8 KiB
// gives wrong results, LBO 8 KiB / SBO 1 KiB and LBO = SBO = 1 KiB right ones.
// Measured on the H200 (2026-12-02, scripts/results/h200-2026-12-02-sm90-wgmma-probe.txt):
// 473 us for 128 x 16384 tokens (the bytes of 256 x 8k; 32.8% of the read bandwidth),
// where the decoder's whole split_sm90 kernel takes 464 us at 256 x 8k. 255 registers and
// the whole shared memory leave 8 warps an SM: 0.59 of 2 warps eligible a scheduler, 4.35
// cycles an issued instruction (short scoreboard 0.88, fixed latency 0.79, instruction
// fetch 0.46), L1/TEX throughput 65%; 86.7 warp-instructions a token against 108.
// PROBE_ROLLED=1 (the latent chunks' loop kept a loop): 454.6 us against 472.9 unrolled in
// a later run.
#include "common/platform.h"
#include "common/numerics.h"
#include "arch/sm90.h"

// Ablations (timing only: the results are wrong): 1 no V stores, 2 no P.V wgmma, 3 no Q.K
// wgmma, 4 no dequantization (the packed words used as bf16 pairs).
#ifndef PROBE_ABLATE
#define PROBE_ABLATE 0
#endif
// 1: the latent chunks' loop not unrolled (a quarter of Q.K's code: instruction fetch).
#ifndef PROBE_ROLLED
#define PROBE_ROLLED 0
#endif
#ifndef PROBE_VDESC
#define PROBE_VDESC 2  // V^T's descriptor: 0 LBO = SBO = 1 KiB; 1 LBO 1 KiB, SBO 8 KiB (wrong); 2 LBO 8 KiB, SBO 1 KiB
#endif

namespace probe {
using namespace hipmla;
using namespace hipmla::sm90;

constexpr int WG_TOKENS = 64;
constexpr int STAGES = 2;
constexpr int ROW = 288;                  // bytes of an mxfp4 row: 256 latent + 32 rope
constexpr int SC_ROW = 18;                // E8M0 bytes a row (contiguous cache, stride 18)
constexpr int SC_STAGE = WG_TOKENS * SC_ROW;  // 1152, a whole number of 16-byte copies

struct ProbeParams {
    const unsigned char* kv;
    const unsigned char* scales;
    const unsigned short* q;  // [block][16][576] bf16
    float* out;               // [block][2][16][512] unnormalised O per warpgroup
    float* ml;                // [block][2][16][2]  m (log2 domain), l
    int tokens;               // per block, a multiple of 128
    float scale_log2;
};

struct alignas(1024) Smem {
    unsigned char v[2][64 * 1024];                 // per warpgroup: V^T atoms [j 8][tb 8][1 KiB]
    unsigned char kv[2][STAGES][WG_TOKENS * ROW];
    unsigned char sc[2][STAGES][SC_STAGE];
    unsigned short pt[2][64 * 16];                 // per warpgroup: P^T cores [tb 8][hb 2][8][8]; red aliases it
    unsigned short qt[36 * 256];                   // Q'^T cores [kk][hb 2][kb 2][8][8]
};

HIPMLA_DEVICE unsigned long long desc(unsigned addr, unsigned lbo, unsigned sbo, unsigned swizzle) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | ((unsigned long long)swizzle << 62);
}

HIPMLA_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
HIPMLA_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
HIPMLA_DEVICE void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
HIPMLA_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
HIPMLA_DEVICE void wg_barrier(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); }

// D (64 x 16 f32) += A (registers) B (descriptor), bf16 (PTX ISA 9.7.15.5 wgmma.mma_async).
HIPMLA_DEVICE void wgmma_rs(float (&d)[8], const unsigned (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
// D += A (descriptor, transposed: MN-major) B (descriptor, K-major).
HIPMLA_DEVICE void wgmma_ss_ta(float (&d)[8], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b));
}

// Keeps an A fragment alive where an ablation drops its wgmma.
HIPMLA_DEVICE void keep(const unsigned (&a)[4], unsigned long long) {
    asm volatile("" ::"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]));
}

HIPMLA_DEVICE unsigned mult(unsigned s) { return ((s < 193u ? s : 193u) + 62u) * 0x00800080u; }

// Eight E2M1 codes of a row to four bf16x2 words of K' (value x its block's multiplier).
HIPMLA_DEVICE void dequant_word(unsigned word, unsigned m, unsigned (&x)[4]) {
#if PROBE_ABLATE == 4
    x[0] = word; x[1] = word >> 1; x[2] = word >> 2; x[3] = word >> 3;
#else
    e2m1x8_to_bf16x2_scaled_down(word, x);
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = mul_bf16x2(x[i], m);
}

// The A fragments of the word pair's two k-steps: rows r0 (xa) and r1 (xb), words 2 kh, 2 kh + 1.
HIPMLA_DEVICE void a_fragments(const unsigned (&xa)[4], const unsigned (&xb)[4], unsigned (&frag)[2][4]) {
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
        frag[kh][0] = xa[2 * kh];
        frag[kh][1] = xb[2 * kh];
        frag[kh][2] = xa[2 * kh + 1];
        frag[kh][3] = xb[2 * kh + 1];
    }
}

// S^T += K' Q'^T over k-step kk (PROBE_ABLATE 3: the fragment kept, no wgmma).
HIPMLA_DEVICE void qk_step(float (&s)[8], const unsigned (&frag)[4], unsigned long long q_desc, int kk) {
#if PROBE_ABLATE != 3
    wgmma_rs(s, frag, q_desc + kk * 32);
#else
    keep(frag, q_desc + kk * 32);
#endif
}

}  // namespace probe

namespace probe {
// One warpgroup's loop; WG a template argument so that its shared-memory bases, hence the
// wgmma descriptors, are compile-time offsets (uniform registers, one add a wgmma).
template <int WG>
HIPMLA_DEVICE void warpgroup_loop(const ProbeParams& p, Smem& sm, int tid) {
    constexpr int wg = WG;
    const int wtid = tid & 127, w = wtid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int blk = int(block_index());
    const long long row0 = (long long)blk * p.tokens;
    const int n_tiles = p.tokens / (2 * WG_TOKENS);  // tiles of this warpgroup

    // The warpgroup's copies of its tile `it` (global tile 2 it + wg) into `stage`.
    auto issue = [&](int it, int stage) {
        if (it < n_tiles) {
            const long long r = row0 + (long long)(2 * it + wg) * WG_TOKENS;
            const unsigned char* src = p.kv + r * ROW;
            const unsigned dst = smem_address(sm.kv[wg][stage]);
            for (int c = wtid; c < WG_TOKENS * ROW / 16; c += 128) cp_async_16(dst + 16 * c, src + 16 * c, 16u);
            const unsigned char* ssrc = p.scales + r * SC_ROW;
            const unsigned sdst = smem_address(sm.sc[wg][stage]);
            if (wtid < SC_STAGE / 16) cp_async_16(sdst + 16 * wtid, ssrc + 16 * wtid, 16u);
        }
        cp_async_commit();
    };

    float o[8][8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[j][e] = 0.0f;
    float m_run[4], l_run[4];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        m_run[h] = f32_from_bits(0xff800000u);
        l_run[h] = 0.0f;
    }
    const unsigned v_base = smem_address(sm.v[wg]);
    const unsigned pt_base = smem_address(sm.pt[wg]);
    const unsigned qt_base = smem_address(sm.qt);
    float* red = reinterpret_cast<float*>(sm.pt[wg]);  // [4 warps][16 heads], read before P^T is written
    // Descriptors formed once; a k-step or block adds its offset / 16 to the address field
    // (shared addresses are below 2^18, so the 14-bit field never carries).
    const unsigned long long q_desc = desc(qt_base, 128, 256, 0);
    const unsigned long long p_desc = desc(pt_base, 256, 128, 0);
#if PROBE_VDESC == 0
    const unsigned long long v_desc = desc(v_base, 1024, 1024, 1);
#elif PROBE_VDESC == 1
    const unsigned long long v_desc = desc(v_base, 1024, 8192, 1);
#else
    const unsigned long long v_desc = desc(v_base, 8192, 1024, 1);
#endif

    issue(0, 0);
    issue(1, 1);
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
        const int stage = it & 1;
        cp_async_wait<1>();
        wg_barrier(wg);
        const unsigned char* kv = sm.kv[wg][stage];
        const unsigned char* sc = sm.sc[wg][stage];
        const int r0 = 16 * w + g, r1 = r0 + 8;

        float s[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] = 0.0f;
        // The previous tile's P.V reads V and P^T: done before they are written again.
        wg_wait<0>();
#if PROBE_ROLLED
#pragma unroll 1
#else
#pragma unroll
#endif
        for (int c = 0; c < 4; ++c) {  // latent words 16 t + 4 c .. + 3 (m = 4 c + mm): block 4 t + c
            const u32x4 a = *reinterpret_cast<const u32x4*>(kv + r0 * ROW + 64 * t + 16 * c);
            const u32x4 b = *reinterpret_cast<const u32x4*>(kv + r1 * ROW + 64 * t + 16 * c);
            const unsigned ma = mult(sc[r0 * SC_ROW + 4 * t + c]), mb = mult(sc[r1 * SC_ROW + 4 * t + c]);
            const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
            unsigned frag[4][2][4];
#pragma unroll
            for (int mm = 0; mm < 4; ++mm) {
                const int m = 4 * c + mm;
                unsigned xa[4], xb[4];
                dequant_word(wa[mm], ma, xa);
                dequant_word(wb[mm], mb, xb);
                // V: octet ob = 8 (m >> 1) + 2 t + (m & 1) of O^T's row order, 128-byte swizzle.
                const unsigned chunk = unsigned(2 * t + (m & 1));
                const unsigned atom = v_base + (m >> 1) * 8192;
                const unsigned va = atom + (2 * w) * 1024 + g * 128 + ((chunk ^ g) << 4);
                const unsigned vb = atom + (2 * w + 1) * 1024 + g * 128 + ((chunk ^ g) << 4);
#if PROBE_ABLATE != 1
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(va), "r"(xa[0]), "r"(xa[1]), "r"(xa[2]), "r"(xa[3]) : "memory");
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(vb), "r"(xb[0]), "r"(xb[1]), "r"(xb[2]), "r"(xb[3]) : "memory");
#endif
                a_fragments(xa, xb, frag[mm]);
            }
            wg_fence();
#pragma unroll
            for (int mm = 0; mm < 4; ++mm)
#pragma unroll
                for (int kh = 0; kh < 2; ++kh) qk_step(s, frag[mm][kh], q_desc, 2 * (4 * c + mm) + kh);
            wg_commit();
        }
        {  // rope: words 64 + 2 t, 65 + 2 t (m = 16, 17): block 16 + t / 2
            const u32x2 a = *reinterpret_cast<const u32x2*>(kv + r0 * ROW + 256 + 8 * t);
            const u32x2 b = *reinterpret_cast<const u32x2*>(kv + r1 * ROW + 256 + 8 * t);
            const unsigned ma = mult(sc[r0 * SC_ROW + 16 + (t >> 1)]), mb = mult(sc[r1 * SC_ROW + 16 + (t >> 1)]);
            const unsigned wa[2] = {a.x, a.y}, wb[2] = {b.x, b.y};
            unsigned frag[2][2][4];
#pragma unroll
            for (int mm = 0; mm < 2; ++mm) {
                unsigned xa[4], xb[4];
                dequant_word(wa[mm], ma, xa);
                dequant_word(wb[mm], mb, xb);
                a_fragments(xa, xb, frag[mm]);
            }
            wg_fence();
#pragma unroll
            for (int mm = 0; mm < 2; ++mm)
#pragma unroll
                for (int kh = 0; kh < 2; ++kh) qk_step(s, frag[mm][kh], q_desc, 32 + 2 * mm + kh);
            wg_commit();
        }
        wg_wait<0>();
        // The stage is read: the warpgroup's tile it + 2 goes into it once all 4 warps are past.
        // (s: rows g, g + 8 = tokens r0, r1; cols 2t, 2t+1 | 8 + 2t, 9 + 2t = heads.)
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] *= p.scale_log2;
        float tmax[4];
        tmax[0] = fmaxf(s[0], s[2]);
        tmax[1] = fmaxf(s[1], s[3]);
        tmax[2] = fmaxf(s[4], s[6]);
        tmax[3] = fmaxf(s[5], s[7]);
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            tmax[h] = warp_xor_max(tmax[h], 4);
            tmax[h] = warp_xor_max(tmax[h], 8);
            tmax[h] = warp_xor_max(tmax[h], 16);
        }
        if (g == 0) {
            red[w * 16 + 2 * t] = tmax[0];
            red[w * 16 + 2 * t + 1] = tmax[1];
            red[w * 16 + 8 + 2 * t] = tmax[2];
            red[w * 16 + 9 + 2 * t] = tmax[3];
        }
        wg_barrier(wg);
        issue(it + 2, stage);
        float alpha[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int head = (h >> 1) * 8 + 2 * t + (h & 1);
            float mx = red[head];
#pragma unroll
            for (int ww = 1; ww < 4; ++ww) mx = fmaxf(mx, red[ww * 16 + head]);
            const float m_new = fmaxf(m_run[h], mx);
            alpha[h] = exp2_approx(m_run[h] - m_new);
            m_run[h] = m_new;
        }
        wg_barrier(wg);  // red is read: P^T may overwrite it
        const unsigned p00 = pack_bf16x2_rn(exp2_approx(s[0] - m_run[0]), exp2_approx(s[1] - m_run[1]));
        const unsigned p10 = pack_bf16x2_rn(exp2_approx(s[2] - m_run[0]), exp2_approx(s[3] - m_run[1]));
        const unsigned p01 = pack_bf16x2_rn(exp2_approx(s[4] - m_run[2]), exp2_approx(s[5] - m_run[3]));
        const unsigned p11 = pack_bf16x2_rn(exp2_approx(s[6] - m_run[2]), exp2_approx(s[7] - m_run[3]));
        const unsigned pw[4] = {p00, p10, p01, p11};
        // l: the rounded P of each head (lane: heads 2t, 2t+1 of blocks 0, 1; tokens r0, r1).
        {
            const float a0 = f32_from_bits(p00 << 16) + f32_from_bits(p10 << 16);
            const float a1 = f32_from_bits(p00 & 0xffff0000u) + f32_from_bits(p10 & 0xffff0000u);
            const float a2 = f32_from_bits(p01 << 16) + f32_from_bits(p11 << 16);
            const float a3 = f32_from_bits(p01 & 0xffff0000u) + f32_from_bits(p11 & 0xffff0000u);
            l_run[0] = l_run[0] * alpha[0] + a0;
            l_run[1] = l_run[1] * alpha[1] + a1;
            l_run[2] = l_run[2] * alpha[2] + a2;
            l_run[3] = l_run[3] * alpha[3] + a3;
        }
        // P^T cores: (tb = 2w + tokens-half, hb) at tb * 256 + hb * 128; lane: head g, tokens 2t, 2t+1.
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int half = k & 1, hb = k >> 1;
            const unsigned tr = movmatrix_trans(pw[k]);
            const unsigned addr = pt_base + (2 * w + half) * 256 + hb * 128 + g * 16 + 4 * t;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(tr) : "memory");
        }
        fence_async_smem();
        if (!warp_all(alpha[0] == 1.0f && alpha[1] == 1.0f && alpha[2] == 1.0f && alpha[3] == 1.0f)) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                o[j][0] *= alpha[0]; o[j][1] *= alpha[1]; o[j][2] *= alpha[0]; o[j][3] *= alpha[1];
                o[j][4] *= alpha[2]; o[j][5] *= alpha[3]; o[j][6] *= alpha[2]; o[j][7] *= alpha[3];
            }
        }
        wg_barrier(wg);  // V and P^T of every warp written (and fenced for the async proxy)
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#if PROBE_ABLATE != 2
                wgmma_ss_ta(o[j], v_desc + (j * 8192 + 2 * ks * 1024) / 16, p_desc + 2 * ks * 256 / 16);
#endif
            }
        wg_commit();
    }
    wg_wait<0>();

    // Out: O^T row (j, w, hh, g) = dim 8 (16 w + 2 j + hh) + (g >> 1) + 4 (g & 1); cols heads.
    float* out = p.out + ((long long)blk * 2 + wg) * 16 * 512;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int hh = (e >> 1) & 1, head = (e >> 2) * 8 + 2 * t + (e & 1);
            const int dim = 8 * (16 * w + 2 * j + hh) + (g >> 1) + 4 * (g & 1);
            out[head * 512 + dim] = o[j][e];
        }
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        float l = l_run[h];
        l = warp_xor_sum(l, 4);
        l = warp_xor_sum(l, 8);
        l = warp_xor_sum(l, 16);
        l_run[h] = l;
    }
    // l per warp (its 16 tokens of each tile) -> sum over the 4 warps through the ml buffer's atomics.
    float* ml = p.ml + ((long long)blk * 2 + wg) * 16 * 2;
    if (g == 0) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int head = (h >> 1) * 8 + 2 * t + (h & 1);
            if (w == 0) ml[head * 2] = m_run[h];
            atomicAdd(&ml[head * 2 + 1], l_run[h]);
        }
    }
}
}  // namespace probe

extern "C" __global__ void __launch_bounds__(256, 1) hipmla_probe_wgmma_mxfp4(const probe::ProbeParams p) {
    using namespace probe;
    extern __shared__ __align__(1024) unsigned char probe_smem[];
    Smem& sm = *reinterpret_cast<Smem*>(probe_smem);
    static_assert(sizeof(Smem) == 232448, "the script launches with 227 KiB");
    if (dynamic_smem_size() < sizeof(Smem)) __trap();
    const int tid = int(thread_index());
    const int blk = int(block_index());

    // Q'^T = (Q 2^64)^T in k-step order, by every thread (18 KiB, once).
    {
        const unsigned short* q = p.q + (long long)blk * 16 * 576;
        for (int i = tid; i < 36 * 256; i += 256) {
            const int kk = i >> 8, hb = (i >> 7) & 1, kb = (i >> 6) & 1, h8 = (i >> 3) & 7, k8 = i & 7;
            const int slot = 8 * kb + k8, st = (slot & 7) >> 1, e = slot & 1, r = slot >> 3, m = kk >> 1;
            const int word = m < 16 ? 16 * st + m : 64 + 2 * st + (m - 16);
            const int dim = 8 * word + 2 * (kk & 1) + r + 4 * e;
            const float v = bf16_to_f32(q[(8 * hb + h8) * 576 + dim]) * 18446744073709551616.0f;
            sm.qt[i] = (unsigned short)f32_to_bf16_bits(v);
        }
    }
    fence_async_smem();
    block_sync();
    if (tid < 128) warpgroup_loop<0>(p, sm, tid);
    else warpgroup_loop<1>(p, sm, tid);
}
