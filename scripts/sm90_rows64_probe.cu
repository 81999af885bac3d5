// Feasibility probe (not a library kernel): 64 rows a block on wgmma for an MXFP4 cache,
// sm_90a. scripts/sm90_rows64_probe.py builds it after arch/sm90.h (its dequantization
// helpers), checks it against float64 attention and times it beside the decoder.
//
// The rows of one sequence that read the same tokens (64 heads of a query token, or 16
// heads x 4 MTP tokens) fill the M = 64 of a wgmma, so K is dequantized once for 64 rows
// (the decoder's sm_90 kernel: once per 16) and neither product needs a transpose:
//   K' tile        every thread dequantizes (token, E8M0 block) pairs of the 64-token tile
//                  from the raw ring into bf16 in shared memory, in 128-byte-swizzled
//                  chunks of 64 dims: [chunk 9][token 64][128 B], 16-byte unit u of row r at
//                  u ^ (r & 7). Unit u of chunk c holds word 8c + u of the row, its 8 dims
//                  in the order 0 4 1 5 2 6 3 7 (e2m1x8_to_bf16x2_scaled_down's pairs).
//   S  = Q' K'^T   wgmma.m64n64k16 SS, both K-major: A = Q' (the same layout, dims in the
//                  same order, written once), B = K'. Warpgroup wg takes dims
//                  [288 wg, 288 wg + 288) (18 k-steps) of all 64 tokens; the two partial
//                  S trade halves through shared memory, so warpgroup wg owns tokens
//                  [32 wg, 32 wg + 32) of the tile, whole.
//   softmax        a running max a row over 64-token tiles: the quad's max, then the two
//                  warpgroups' maxima through shared memory; P rounded to bf16 RNE into
//                  shared memory, [row][token 128 B swizzled] (K-major A of P.V).
//   O += P V'      wgmma.m64n64k16 SS: A = P, B = V' = the first 512 dims of the K' tile
//                  read MN-major (transposed B: the dims of a token are contiguous).
//                  Warpgroup wg owns output dims [256 wg, 256 wg + 256): 4 chunks,
//                  O is 128 f32 a thread.
// Descriptors (PTX ISA 9.7.15.5.1, matrix descriptor): 128-byte swizzle (layout 1);
// K-major: SBO 1 KiB (8-row groups), a k-step adds 32 B inside the 128-byte row, a
// chunk 8 KiB; MN-major V': SBO 1 KiB (8-token groups along K), LBO 8 KiB (64-dim atoms
// along N: unused at N = 64), a k-step of 16 tokens adds 2 KiB.
// Block = 2 warpgroups, 64 rows (blockIdx.y: which 64 of the rows), tokens
// [blockIdx.x n, (blockIdx.x + 1) n) of a contiguous cache (n a multiple of 64); no
// schedule, paging, masking, merge or epilogue: O (times 2^-64), m (log2 domain) and l
// per warpgroup go out unmerged and the script merges them.
// Design 1 (hipmla_probe_rows64_mxfp4, 256 threads): per 64-token tile 2 block barriers and
// 3 of the consumers (raw tile in and the last P.V done; K' written; partial scores traded;
// row maxima traded; P written); K' is single-buffered, so the next tile's dequantization
// waits for this tile's P.V. Design 2 (hipmla_probe_rows64_ws_mxfp4, 384 threads): below.
// Measured on an H100 80GB (2026-12-06, no H200 came; scripts/results/h100-2026-12-06-
// rows64-probe-*.txt; L2 flushed, 128 blocks x 2048 tokens = the tokens of bs 32 x 8k):
// design 1 120.5 us at 64 heads, 235.6 at 128 (303 / 310 TFLOP/s, 38-39% of the bf16 matmul
// measured in the run), the decoder's sm_90 kernel at bs 32 x 8k 228.8 / 434.7 (160 / 168
// TFLOP/s): 1.9x. Error against float64 1.1e-3 of max |ref|. Each part taken out saves
// 9-51 us of 236 (K' stores 51, Q.K 45, P.V 35, the conversion arithmetic 9): the phases
// run one after the other, 2 warps a scheduler (255 registers), 0.42 eligible (Nsight
// Compute). Design 2 is slower (154.6 / 304.6 us): its 32-token tiles read Q' (the A
// operand, 72 KiB) from shared memory once per 32 tokens instead of 64, and Q.K alone
// then costs 84 us of 305; with 64-token tiles, Q' and two K' buffers do not fit 227 KiB.
#include "common/platform.h"
#include "common/numerics.h"
#include "arch/sm90.h"

// Ablations (timing only: the results are wrong): 1 no K' stores, 2 no Q.K wgmma,
// 3 no P.V wgmma, 4 no dequantization arithmetic (the packed words stored as they are).
#ifndef PROBE_ABLATE
#define PROBE_ABLATE 0
#endif

namespace rows64 {
using namespace hipmla;
using namespace hipmla::sm90;

constexpr int ROWS = 64;                 // M of every wgmma
constexpr int TILE = 64;                 // tokens a tile
constexpr int DQK = 576;
constexpr int DV = 512;
constexpr int CHUNKS = DQK / 64;         // 128-byte chunks of a bf16 row
constexpr int CHUNK_BYTES = 64 * 128;    // one chunk of 64 rows
constexpr int ROW = 288;                 // mxfp4 bytes of a cache row
constexpr int SC_ROW = 18;               // E8M0 bytes of a row
constexpr int STAGES = 2;
constexpr int THREADS = 256;
constexpr int QK_STEPS = DQK / 16 / 2;   // k-steps of Q.K a warpgroup
// Named barriers: the 256 consumer threads; design 2's 3 K' buffers b full / empty, its producer.
constexpr int CONSUMERS = 1, FULL = 2, EMPTY = 5, PRODUCER = 8;

struct alignas(1024) Smem {
    unsigned char q[CHUNKS * CHUNK_BYTES];
    unsigned char k[CHUNKS * CHUNK_BYTES];
    unsigned char p[CHUNK_BYTES];
    unsigned char raw[STAGES][TILE * ROW];
    unsigned char sc[STAGES][TILE * SC_ROW];
    f32x4 xs[2][4][128];                 // partial scores a warpgroup hands the other
    float mx[2][ROWS];                   // row maxima of each warpgroup's 32 tokens
};
static_assert(sizeof(Smem) == 211968, "scripts/sm90_rows64_probe.py launches with SHARED bytes");

struct Params {
    const unsigned char* kv;
    const unsigned char* scales;
    const unsigned short* q;  // [blockIdx.x][gridDim.y * 64][576] bf16
    float* out;               // [blockIdx.x][gridDim.y * 64][512] O * 2^-64, unnormalised
    float* ml;                // [blockIdx.x][2 warpgroups][gridDim.y * 64][2]: m (log2), l
    int tokens;               // per block, a multiple of 64
    float scale_log2;
};

HIPMLA_DEVICE unsigned long long desc128(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
HIPMLA_DEVICE unsigned swz(unsigned base, int row, int unit) {
    return base + unsigned(row) * 128u + (unsigned((unit ^ (row & 7))) << 4);
}
HIPMLA_DEVICE void st_shared_v4(unsigned a, const unsigned (&x)[4]) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
}
HIPMLA_DEVICE void st_shared_b32(unsigned a, unsigned x) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(x) : "memory"); }
HIPMLA_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
HIPMLA_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
HIPMLA_DEVICE void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
HIPMLA_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int N>
HIPMLA_DEVICE void pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 64 f32) += A B, both from shared memory (PTX ISA 9.7.15.5.2 wgmma.mma_async);
// TB = 1: B is MN-major.
template <int TB>
HIPMLA_DEVICE void wgmma_n64(float (&d)[32], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %34;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "n"(TB));
}

// D (64 x 32 f32) += A B, both K-major from shared memory.
HIPMLA_DEVICE void wgmma_n32(float (&d)[16], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b));
}
// Named barriers (PTX ISA 9.7.13.1 bar / barrier): the producer arrives, the consumers wait, or back.
HIPMLA_DEVICE void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
HIPMLA_DEVICE void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

HIPMLA_DEVICE unsigned mult(unsigned s) { return ((s < 193u ? s : 193u) + 62u) * 0x00800080u; }
// Element x (0..7) of a 16-byte unit holds dim 8 word + perm(x).
HIPMLA_DEVICE constexpr int perm(int x) { return (x >> 1) + 4 * (x & 1); }

// Q' = Q 2^64 (exact in bf16) of the block's 64 rows, once, in K''s layout and dim order.
HIPMLA_DEVICE void fill_q(unsigned q_base, const Params& p, int tid, int threads) {
    const int rows = int(gridDim.y) * ROWS;
    const unsigned short* q = p.q + ((long long)blockIdx.x * rows + blockIdx.y * ROWS) * DQK;
    for (int i = tid; i < ROWS * DQK / 8; i += threads) {
        const int r = i / (DQK / 8), word = i % (DQK / 8);
        const u32x4 v = *reinterpret_cast<const u32x4*>(q + r * DQK + 8 * word);
        const unsigned src[4] = {v.x, v.y, v.z, v.w};
        unsigned x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            unsigned half[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int d = perm(2 * e + h);
                const unsigned bits = (src[d >> 1] >> (16 * (d & 1))) & 0xffffu;
                half[h] = f32_to_bf16_bits(bf16_to_f32(bits) * 18446744073709551616.0f);
            }
            x[e] = half[0] | (half[1] << 16);
        }
        st_shared_v4(swz(q_base + (word >> 3) * CHUNK_BYTES, r, word & 7), x);
    }
}

// cp.async of TOKENS raw rows from `row` of the contiguous cache (codes and E8M0 bytes)
// into a ring stage, by `threads` threads, committed as one group (an empty one past the end).
template <int TOKENS>
HIPMLA_DEVICE void issue_raw(const Params& p, bool valid, long long row, unsigned raw, unsigned sc, int tid, int threads) {
    if (valid) {
        const unsigned char* src = p.kv + row * ROW;
        for (int c = tid; c < TOKENS * ROW / 16; c += threads) cp_async_16(raw + 16 * c, src + 16 * c, 16u);
        if (tid < TOKENS * SC_ROW / 16) cp_async_16(sc + 16 * tid, p.scales + row * SC_ROW + 16 * tid, 16u);
    }
    cp_async_commit();
}

// Every thread of the block: Q' into shared memory, then the caller's roles.
template <class S>
HIPMLA_DEVICE S& block_start(const Params& p, unsigned char* smem, int tid, int threads) {
    S& sm = *reinterpret_cast<S*>(smem);
    if (dynamic_smem_size() < sizeof(S)) __trap();
    fill_q(smem_address(sm.q), p, tid, threads);
    fence_async_smem();
    block_sync();
    return sm;
}

// Dequantizes (token, E8M0 block) pairs pi = first + THREADS k < TOKENS * 18 of a raw tile
// into K' chunks of TOKENS rows (the lanes of a warp: consecutive tokens of one block, so
// each 16-byte store phase covers 8 rows' different swizzled units). Every pair's bytes
// are loaded before the first is converted: one shared-memory latency, not one a pair
// (the stores carry no memory clobber, so nothing holds the loads behind them).
template <int TOKENS, int THREADS_>
HIPMLA_DEVICE void dequant_tile(const unsigned char* raw, const unsigned char* sc, unsigned k_base, int first) {
    constexpr int N = (TOKENS * SC_ROW + THREADS_ - 1) / THREADS_;
    u32x4 v[N];
    unsigned m[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int pi = first + THREADS_ * k;
        if (pi < TOKENS * SC_ROW) {
            const int r = pi % TOKENS, b = pi / TOKENS;
            v[k] = *reinterpret_cast<const u32x4*>(raw + r * ROW + 16 * b);
            m[k] = sc[r * SC_ROW + b];
        }
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int pi = first + THREADS_ * k;
        if (pi >= TOKENS * SC_ROW) break;
        const int r = pi % TOKENS, b = pi / TOKENS;
        const unsigned mk = mult(m[k]);
        const unsigned wv[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            unsigned x[4];
#if PROBE_ABLATE == 4
            x[0] = wv[i]; x[1] = wv[i] >> 1; x[2] = wv[i] >> 2; x[3] = wv[i] >> 3;
#else
            e2m1x8_to_bf16x2_scaled_down(wv[i], x);
#pragma unroll
            for (int j = 0; j < 4; ++j) x[j] = mul_bf16x2(x[j], mk);
#endif
            const int word = 4 * b + i;
#if PROBE_ABLATE == 1
            asm volatile("" ::"r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]));
#else
            const unsigned a = swz(k_base + (word >> 3) * TOKENS * 128, r, word & 7);
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]));
#endif
        }
    }
}

// A consumer thread's share of the 64 rows, the same in both designs: rows r0 = 16 w + g and
// r1 = r0 + 8 of every accumulator (wgmma's D layout: element 4 j + e of an m64nN fragment
// is row r0 + 8 (e >> 1), column 8 j + 2 t + (e & 1)), O for its warpgroup's 4 chunks of
// 64 output dims, the running max (log2 domain) and sum.
template <int WG>
struct Rows {
    float o[4][32];
    float m_run[2], l_run[2];
    int r0, r1, t, wtid;

    HIPMLA_DEVICE void init(int tid) {
        wtid = tid & 127;
        const int lane = tid & 31;
        r0 = 16 * (wtid >> 5) + (lane >> 2);
        r1 = r0 + 8;
        t = lane & 3;
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int e = 0; e < 32; ++e) o[c][e] = 0.0f;
        m_run[0] = m_run[1] = f32_from_bits(0xff800000u);
        l_run[0] = l_run[1] = 0.0f;
    }

    // The tile's scores S (this warpgroup's partial over its dims: 2 NB column blocks of 8
    // tokens) -> P in shared memory: the two warpgroups trade halves through xs (warpgroup
    // 0 keeps blocks 0 .. NB - 1, 1 the rest), take the row maxima of their halves, trade
    // them through mx, and write P rounded to bf16 into the P tile ([row][token], 128-byte
    // swizzled), fenced for the async proxy; alpha rescales O. Three barriers of the 256
    // consumer threads; the caller's wgmma.wait covered the last P.V, which read P.
    template <int NB>
    HIPMLA_DEVICE void softmax(const float (&s)[8 * NB], f32x4* xs, float (*mx)[ROWS], unsigned p_base, float scale) {
        constexpr int GIVE = WG == 0 ? NB : 0, KEEP = WG == 0 ? 0 : NB;
#pragma unroll
        for (int k = 0; k < NB; ++k)
            xs[(WG * NB + k) * 128 + wtid] = f32x4{s[4 * (GIVE + k)], s[4 * (GIVE + k) + 1], s[4 * (GIVE + k) + 2],
                                                   s[4 * (GIVE + k) + 3]};
        bar_sync(CONSUMERS, 256);
        float sv[4 * NB];
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const f32x4 o4 = xs[((1 - WG) * NB + k) * 128 + wtid];
            sv[4 * k] = (s[4 * (KEEP + k)] + o4.x) * scale;
            sv[4 * k + 1] = (s[4 * (KEEP + k) + 1] + o4.y) * scale;
            sv[4 * k + 2] = (s[4 * (KEEP + k) + 2] + o4.z) * scale;
            sv[4 * k + 3] = (s[4 * (KEEP + k) + 3] + o4.w) * scale;
        }
        float mx0 = sv[0], mx1 = sv[2];
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            mx0 = fmaxf(mx0, fmaxf(sv[4 * k], sv[4 * k + 1]));
            mx1 = fmaxf(mx1, fmaxf(sv[4 * k + 2], sv[4 * k + 3]));
        }
        mx0 = warp_xor_max(warp_xor_max(mx0, 1), 2);
        mx1 = warp_xor_max(warp_xor_max(mx1, 1), 2);
        if (t == 0) {
            mx[WG][r0] = mx0;
            mx[WG][r1] = mx1;
        }
        bar_sync(CONSUMERS, 256);
        const float mn0 = fmaxf(m_run[0], fmaxf(mx[0][r0], mx[1][r0]));
        const float mn1 = fmaxf(m_run[1], fmaxf(mx[0][r1], mx[1][r1]));
        const float a0 = exp2_approx(m_run[0] - mn0), a1 = exp2_approx(m_run[1] - mn1);
        m_run[0] = mn0;
        m_run[1] = mn1;
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const int jj = KEEP + k;  // the column block: tokens 8 jj + 2t, + 1
            const unsigned p0 = pack_bf16x2_rn(exp2_approx(sv[4 * k] - mn0), exp2_approx(sv[4 * k + 1] - mn0));
            const unsigned p1 = pack_bf16x2_rn(exp2_approx(sv[4 * k + 2] - mn1), exp2_approx(sv[4 * k + 3] - mn1));
            ls0 += f32_from_bits(p0 << 16) + f32_from_bits(p0 & 0xffff0000u);
            ls1 += f32_from_bits(p1 << 16) + f32_from_bits(p1 & 0xffff0000u);
            st_shared_b32(swz(p_base, r0, jj) + 4 * t, p0);
            st_shared_b32(swz(p_base, r1, jj) + 4 * t, p1);
        }
        l_run[0] = l_run[0] * a0 + ls0;
        l_run[1] = l_run[1] * a1 + ls1;
        if (!warp_all(a0 == 1.0f && a1 == 1.0f)) {
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    o[c][4 * j] *= a0;
                    o[c][4 * j + 1] *= a0;
                    o[c][4 * j + 2] *= a1;
                    o[c][4 * j + 3] *= a1;
                }
        }
        fence_async_smem();
        bar_sync(CONSUMERS, 256);  // P whole (both warpgroups' tokens)
    }

    // O += P V' over TOKENS tokens of the K' tile (chunks of TOKENS rows): issued, committed,
    // not waited for.
    template <int TOKENS>
    HIPMLA_DEVICE void pv(unsigned long long p_desc, unsigned long long v_desc) {
#pragma unroll
        for (int c = 0; c < 4; ++c) pin(o[c]);
        wg_fence();
#if PROBE_ABLATE != 3
#pragma unroll
        for (int ks = 0; ks < TOKENS / 16; ++ks)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                wgmma_n64<1>(o[c], p_desc + unsigned(ks * 32 >> 4),
                             v_desc + (unsigned((4 * WG + c) * TOKENS * 128 + ks * 2048) >> 4));
#endif
        wg_commit();
    }

    // After the last tile: O (times 2^-64, dims back in order), m and the warpgroup's l.
    HIPMLA_DEVICE void store(const Params& p) {
        wg_wait<0>();
#pragma unroll
        for (int c = 0; c < 4; ++c) pin(o[c]);
        const int rows = int(gridDim.y) * ROWS, grp = int(blockIdx.y);
        const long long blk = blockIdx.x;
        float* out = p.out + (blk * rows + grp * ROWS) * DV;
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = e < 2 ? r0 : r1;
                    const int dim = 64 * (4 * WG + c) + 8 * j + perm(2 * t + (e & 1));
                    out[row * DV + dim] = o[c][4 * j + e];
                }
        const float l0 = warp_xor_sum(warp_xor_sum(l_run[0], 1), 2);
        const float l1 = warp_xor_sum(warp_xor_sum(l_run[1], 1), 2);
        if (t == 0) {
            float* ml = p.ml + ((blk * 2 + WG) * rows + grp * ROWS) * 2;
            ml[r0 * 2] = m_run[0];
            ml[r0 * 2 + 1] = l0;
            ml[r1 * 2] = m_run[1];
            ml[r1 * 2 + 1] = l1;
        }
    }
};

template <int WG>
HIPMLA_DEVICE void warpgroup_loop(const Params& p, Smem& sm, int tid) {
    const long long row0 = (long long)blockIdx.x * p.tokens;
    const int n_tiles = p.tokens / TILE;
    const unsigned k_base = smem_address(sm.k), p_base = smem_address(sm.p);
    const unsigned long long q_desc = desc128(smem_address(sm.q), 16, 1024), k_desc = desc128(k_base, 16, 1024);
    const unsigned long long p_desc = desc128(p_base, 16, 1024), v_desc = desc128(k_base, 8192, 1024);

    auto issue = [&](int tile, int stage) {
        issue_raw<TILE>(p, tile < n_tiles, row0 + (long long)tile * TILE, smem_address(sm.raw[stage]),
                        smem_address(sm.sc[stage]), tid, THREADS);
    };
    Rows<WG> st;
    st.init(tid);

    issue(0, 0);
    issue(1, 1);
#pragma unroll 1
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile & 1;
        cp_async_wait<1>();
        wg_wait<0>();   // this warpgroup's P.V of the last tile has read K' and P
        block_sync();   // ... and the other's; the raw tile is in
        // ---- K' = V' of the tile, bf16, swizzled
        dequant_tile<TILE, THREADS>(sm.raw[stage], sm.sc[stage], k_base, tid);
        fence_async_smem();
        block_sync();
        issue(tile + 2, stage);

        // ---- S = Q' K'^T over the warpgroup's dims
        float s[32];
#pragma unroll
        for (int e = 0; e < 32; ++e) s[e] = 0.0f;
        pin(s);
        wg_fence();
#if PROBE_ABLATE != 2
#pragma unroll
        for (int i = 0; i < QK_STEPS; ++i) {
            const int kk = QK_STEPS * WG + i;
            const unsigned off = unsigned((kk >> 2) * CHUNK_BYTES + (kk & 3) * 32) >> 4;
            wgmma_n64<0>(s, q_desc + off, k_desc + off);
        }
#endif
        wg_commit();
        wg_wait<0>();
        pin(s);
        st.template softmax<4>(s, &sm.xs[0][0][0], sm.mx, p_base, p.scale_log2);
        st.template pv<TILE>(p_desc, v_desc);
    }
    st.store(p);
}
}  // namespace rows64

extern "C" __global__ void __launch_bounds__(256, 1) hipmla_probe_rows64_mxfp4(const rows64::Params p) {
    using namespace rows64;
    extern __shared__ __align__(1024) unsigned char probe_smem[];
    const int tid = int(thread_index());
    Smem& sm = block_start<Smem>(p, probe_smem, tid, THREADS);
    if (tid < 128) warpgroup_loop<0>(p, sm, tid);
    else warpgroup_loop<1>(p, sm, tid);
}

// ---------------------------------------------------------------- design 2: a producer warpgroup
// Block = 3 warpgroups: warpgroup 2 produces (cp.async of the raw tiles into a 3-stage ring,
// dequantization into 3 K' buffers), warpgroups 0 and 1 consume over 32-token tiles with
// Q.K one tile ahead: Q.K of tile + 1 is issued before the softmax of tile, so the tensor
// cores work through it while the consumers run the softmax, and a tile's dequantization
// runs beside the tensor work of the tiles before. Per tile a consumer issues Q.K (t + 1),
// waits for Q.K (t) and P.V (t - 1) (wgmma groups complete in order), runs the softmax
// of t and issues P.V (t). Registers: setmaxnreg (PTX ISA 9.7.17.2; sm_90a) 80 for the
// producer (56 spilled its hoisted store addresses), 208 for the consumers (two S fragments
// of 16 beside O's 128). The pool is what the launch gave the block (168 x 384): a request
// past it never returns (216 hung the block). Named barriers:
// FULL b (the producer arrives once K' buffer b is written, 384 threads), EMPTY b (the
// consumers arrive once Q.K and P.V have read buffer b), CONSUMERS, PRODUCER (its 128).
// (An earlier form, d51f053: 2 K' buffers, Q.K waited for before the softmax: slower than
// design 1, scripts/results/h100-2026-12-06-rows64-probe-d51f053.txt.)
namespace rows64 {
constexpr int T2 = 32;
constexpr int STAGES2 = 3;
constexpr int KBUFS = 3;
constexpr int KBUF = CHUNKS * T2 * 128;
constexpr int PRODUCER_REGS = 80, CONSUMER_REGS = 208, LAUNCH_REGS = 168;  // 65,536 / 384, down to a multiple of 8
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 384 * LAUNCH_REGS, "setmaxnreg.inc must find its registers");

struct alignas(1024) Smem2 {
    unsigned char q[CHUNKS * CHUNK_BYTES];
    unsigned char k[KBUFS][KBUF];            // [chunk][token 32][128 B swizzled]
    unsigned char p[CHUNK_BYTES];            // P: 64 rows of 128 B, the first 64 used
    unsigned char raw[STAGES2][T2 * ROW];
    unsigned char sc[STAGES2][T2 * SC_ROW];
    f32x4 xs[2][2][128];
    float mx[2][ROWS];
};
static_assert(sizeof(Smem2) == 231424, "scripts/sm90_rows64_probe.py launches with DESIGNS[2]'s bytes");

HIPMLA_DEVICE void producer(const Params& p, Smem2& sm, int ptid) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
    const long long row0 = (long long)blockIdx.x * p.tokens;
    const int n_tiles = p.tokens / T2;
    auto issue = [&](int tile) {
        issue_raw<T2>(p, tile < n_tiles, row0 + (long long)tile * T2, smem_address(sm.raw[tile % STAGES2]),
                      smem_address(sm.sc[tile % STAGES2]), ptid, 128);
    };
    issue(0);
    issue(1);
#pragma unroll 1
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int b = tile % KBUFS;
        cp_async_wait<1>();
        bar_sync(PRODUCER, 128);  // tile's bytes in; every producer thread past tile - 1
        issue(tile + 2);          // into the stage tile - 1 read
        if (tile >= KBUFS) bar_sync(EMPTY + b, 384);
        dequant_tile<T2, 128>(sm.raw[tile % STAGES2], sm.sc[tile % STAGES2], smem_address(sm.k[b]), ptid);
        fence_async_smem();
        bar_arrive(FULL + b, 384);
    }
}

template <int WG>
struct Consumer {
    Rows<WG> st;
    unsigned long long q_desc, p_desc, k_desc, v_desc;
    unsigned p_base;
    int n_tiles;

    // Q.K of `tile` into s, once the producer has filled its buffer; committed, not waited for.
    HIPMLA_DEVICE void qk(float (&s)[16], int tile) {
        const int b = tile % KBUFS;
        bar_sync(FULL + b, 384);
#pragma unroll
        for (int e = 0; e < 16; ++e) s[e] = 0.0f;
        pin(s);
        wg_fence();
#if PROBE_ABLATE != 2
        const unsigned buf = unsigned(b * KBUF) >> 4;
#pragma unroll
        for (int i = 0; i < QK_STEPS; ++i) {
            const int kk = QK_STEPS * WG + i;
            wgmma_n32(s, q_desc + (unsigned((kk >> 2) * CHUNK_BYTES + (kk & 3) * 32) >> 4),
                      k_desc + buf + (unsigned((kk >> 2) * T2 * 128 + (kk & 3) * 32) >> 4));
        }
#endif
        wg_commit();
    }
    // One tile: s holds its Q.K (issued), next gets tile + 1's.
    HIPMLA_DEVICE void step(float (&s)[16], float (&next)[16], int tile, const Params& p, Smem2& sm) {
        if (tile + 1 < n_tiles) {
            qk(next, tile + 1);
            wg_wait<1>();  // Q.K (tile) and P.V (tile - 1) are done, Q.K (tile + 1) may run on
        } else {
            wg_wait<0>();
        }
        pin(s);
        // buffer of tile - 1 read by both of its products (the producer's tile + 2 goes there)
        if (tile >= 1 && tile + 2 < n_tiles) bar_arrive(EMPTY + (tile - 1) % KBUFS, 384);
        st.template softmax<2>(s, &sm.xs[0][0][0], sm.mx, p_base, p.scale_log2);
        st.template pv<T2>(p_desc, v_desc + (unsigned((tile % KBUFS) * KBUF) >> 4));
    }
};

template <int WG>
HIPMLA_DEVICE void consumer(const Params& p, Smem2& sm, int tid) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
    Consumer<WG> c;
    c.n_tiles = p.tokens / T2;
    c.p_base = smem_address(sm.p);
    c.q_desc = desc128(smem_address(sm.q), 16, 1024);
    c.p_desc = desc128(c.p_base, 16, 1024);
    c.k_desc = desc128(smem_address(sm.k[0]), 16, 1024);
    c.v_desc = desc128(smem_address(sm.k[0]), 8192, 1024);
    c.st.init(tid);
    float sa[16], sb[16];
    c.qk(sa, 0);
#pragma unroll 1
    for (int tile = 0; tile < c.n_tiles; tile += 2) {  // the S fragments alternate: the loop goes by 2
        c.step(sa, sb, tile, p, sm);
        if (tile + 1 < c.n_tiles) c.step(sb, sa, tile + 1, p, sm);
    }
    c.st.store(p);
}
}  // namespace rows64

extern "C" __global__ void __launch_bounds__(384, 1) hipmla_probe_rows64_ws_mxfp4(const rows64::Params p) {
    using namespace rows64;
    extern __shared__ __align__(1024) unsigned char probe_smem[];
    const int tid = int(thread_index());
    Smem2& sm = block_start<Smem2>(p, probe_smem, tid, 384);
    if (tid >= 256) producer(p, sm, tid - 256);
    else if (tid >= 128) consumer<1>(p, sm, tid);
    else consumer<0>(p, sm, tid);
}
