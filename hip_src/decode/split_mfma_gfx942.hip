// gfx942 fast split kernel: bf16 Q, bf16 / fp8 (e4m3fnuz) / MXFP4 KV, items of any
// length (a masked partial last tile); Q.K and P.V both run on the bf16 MFMA, KV is
// turned into bf16 in registers. Launched with the same grid as decode/split.hip: block
// i derives work item i from the batch (core/schedule.h). With p.fast_tile = 0 it runs
// every item, empty and bad ones included (the decoder then launches no portable kernel
// for this variant); with p.fast_tile > 0 only the items split.hip skips (it.fast: whole
// tiles), otherwise it returns. It writes what a portable item writes: bf16 output +
// natural-log LSE for a sequence of one item, else its partial slot, after which the
// last item of the sequence to finish (whichever kernel ran it) merges the slots
// (core/merge.h). An empty item (only ever a whole empty sequence) writes 0 and LSE
// -inf; a bad item (it.bad) sets the error word, reads no KV and writes NaN (output, or
// partial: m, l and acc NaN), as split.hip does.
// Numerics: those of hip_src/KERNELS.md for Q precision bf16, walked in the same
// schedule as the gfx950 fast kernel (hipmla.emulate.GFX942_SCHEDULE, "Fast paths" in
// hip_src/KERNELS.md).
//
// Specialisation (all required):
//   HIPMLA_KV_FORMAT    0 bf16, 1 fp8, 2 mxfp4
//   HIPMLA_Q_PRECISION  0 (bf16: the bf16 MFMA takes Q as it is, nothing to quantize)
//   HIPMLA_FP8_FNUZ     1 (gfx942 fp8 is e4m3fnuz)
//
// Why bf16 everywhere: gfx942 has no scaled MFMA, and the fp8 MFMA would need Q and P in
// fp8 (far less accurate). An E2M1 value times a power of two and an e4m3fnuz value are
// both exact in bf16, so dequantizing to bf16 loses nothing; the fp8 tensor scale stays
// out of the products and multiplies the score and the accumulator, as in split.hip.
//
// Block = 4 waves. An item of n tokens is ceil(n / 128) tiles; each tile is cut in four
// 32-token quarters, quarter w to wave w (two 16-token MFMA groups), as on gfx950. A wave keeps its own online softmax for
// all 16 heads (running max per quarter) and a 16 x 512 f32 accumulator; the waves meet
// only to merge their states at the end, in wave order, through LDS.
//
// No KV goes through LDS: every lane loads the KV bytes its MFMA operands need straight
// from global memory (16 contiguous elements of one row for Q.K; one dword of each of 4
// rows for P.V, the first 512 columns read a second time from cache). That keeps LDS at
// Q (18,688 B, in one union with the 16 KiB merge buffer and the schedule's 2 KiB: 18,704
// B in all), far inside gfx942's 64 KiB, so LDS
// never limits occupancy.
//
// Rows come from core/paged.h, so any page size (1..128) and any page ids work: at the
// start of a tile each wave reads its quarter's 32 rows, one per lane (arch/cdna.h
// QuarterRows: one page-table read per lane), and a lane takes the row of each token it
// loads from there (ds_bpermute): one row per Q.K group, four per P.V group.
//
// Masked tail (arch/cdna.h): only the last tile may be partial. A token t of a quarter
// with t >= valid (valid = the quarter's tokens before the item's end, wave-uniform, <= 0
// for a quarter wholly past it) is loaded from the row of the item's last token
// (quarter_rows clamps the row index: one v_min per quarter, so no load leaves the item,
// the cache or the sequence's pages) and gets score -inf (masked_score: one compare and
// one select per score, 8 per lane and tile; the lane's token base 4 g comes from the
// opaque lane id inside the loop, which keeps fp8 at 2 waves per SIMD), so P = 0 exactly
// and its finite V adds exact zeros. The running max starts at -FLT_MAX
// (running_max_start): a wave with no valid token yet keeps alpha = 1 and P = 0, and an
// empty wave merges with weight 0. report_bad_item sits at the very end: its atomic at the
// top cost 5 VGPRs here.
//
// Lane roles (arch/gfx942.h): Q.K is computed transposed, S^T = K Q^T (A = K rows, B =
// Q), so a lane ends with the scores of ONE head (lane_col) for tokens 4g..4g+3 of each
// group (g = lane_rowgroup). Those four P values are exactly the lane's B operand of the
// transposed P.V, O^T = V^T P^T, whose outputs again belong to one head per lane: alpha
// rescales with no cross-lane traffic.
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/merge.h"
#include "core/paged.h"
#include "core/schedule.h"
#include "arch/gfx942.h"

#if !defined(HIPMLA_KV_FORMAT) || !defined(HIPMLA_Q_PRECISION) || !defined(HIPMLA_FP8_FNUZ)
#error "split_mfma_gfx942.hip needs -DHIPMLA_KV_FORMAT=<0|1|2> -DHIPMLA_Q_PRECISION=0 -DHIPMLA_FP8_FNUZ=1"
#endif
#if HIPMLA_Q_PRECISION != 0 || HIPMLA_FP8_FNUZ != 1
#error "split_mfma_gfx942.hip: bf16 Q (HIPMLA_Q_PRECISION=0) and e4m3fnuz (HIPMLA_FP8_FNUZ=1) only"
#endif
#if HIPMLA_KV_FORMAT == 0
#define HIPMLA_FAST_NAME hipmla_decode_split_gfx942_bf16_qbf16
#elif HIPMLA_KV_FORMAT == 1
#define HIPMLA_FAST_NAME hipmla_decode_split_gfx942_fp8_qbf16
#elif HIPMLA_KV_FORMAT == 2
#define HIPMLA_FAST_NAME hipmla_decode_split_gfx942_mxfp4_qbf16
#else
#error "split_mfma_gfx942.hip: HIPMLA_KV_FORMAT must be 0 (bf16), 1 (fp8) or 2 (mxfp4)"
#endif

namespace hipmla {
namespace fast942 {

using namespace gfx942;

constexpr int KV = HIPMLA_KV_FORMAT;
constexpr int WAVES = 4;
constexpr int THREADS = WAVES * WAVE;
constexpr int TILE = 128;                          // tokens per block step (p.fast_tile)
constexpr int QUARTER = TILE / WAVES;              // tokens per wave step
constexpr int GROUPS = QUARTER / MFMA_N;           // 16-token MFMA groups per quarter
constexpr int ELEMS_PER_DWORD = KV == FORMAT_MXFP4 ? 8 : KV == FORMAT_FP8 ? 4 : 2;
constexpr int ROW_BYTES = D_QK * 4 / ELEMS_PER_DWORD;
// Q.K: a lane takes 16 consecutive elements of its row per chunk, 4 per k-step.
constexpr int CHUNK = LANE_GROUPS * K_PER_LANE * LANE_GROUPS;  // 64 elements: 4 k-steps x 4 lane groups
constexpr int CHUNKS = D_QK / CHUNK;                           // 9
constexpr int LANE_CHUNK = CHUNK / LANE_GROUPS;                // 16 elements of one lane
constexpr int LANE_CHUNK_DWORDS = LANE_CHUNK / ELEMS_PER_DWORD;
constexpr int STEPS_PER_CHUNK = LANE_CHUNK / K_PER_LANE;       // 4
// P.V: lane r reads dword 16 vg + r of a V row; element n of that dword is MFMA tile n.
constexpr int V_GROUPS = D_V / (MFMA_N * ELEMS_PER_DWORD);
constexpr int V_TILES = V_GROUPS * ELEMS_PER_DWORD;            // 32 for every format
constexpr int MERGE_TILES = 16;                                // tiles per merge round (16 KiB of LDS)
constexpr int MERGE_ROUNDS = V_TILES / MERGE_TILES;
constexpr int TILES_PER_WAVE = MERGE_TILES / WAVES;            // output tiles each wave writes per round

static_assert(THREADS == BLOCK_THREADS, "the fast kernel launches the project's block size");
static_assert(HEADS == MFMA_N, "one head per lane_col: H = 16");
static_assert(QUARTER % MFMA_N == 0, "a quarter is whole MFMA groups");
static_assert(QUARTER == QUARTER_ROWS, "a quarter's rows are one QuarterRows");
static_assert(D_QK % CHUNK == 0, "Q.K chunks tile the row");
static_assert(LANE_CHUNK % MX_BLOCK == 0 || MX_BLOCK % LANE_CHUNK == 0, "a lane's chunk sits in one MX block");
static_assert(V_TILES == 32 && V_TILES % MERGE_TILES == 0, "32 accumulator tiles, merged in whole rounds");
static_assert(TILES_PER_WAVE % 2 == 0 && ELEMS_PER_DWORD % 2 == 0, "outputs are written in column pairs");
static_assert(GROUPS * MFMA_N == QUARTER && K_PER_LANE * LANE_GROUPS == MFMA_N && TILE == WAVES * QUARTER,
              "masking: score (s, i) is token 16 s + 4 g + i of the quarter");

struct Merge {
    float m[WAVES][HEADS];
    float l[WAVES][HEADS];
    alignas(16) float acc[MERGE_TILES * 4][WAVE];  // one round of a wave's accumulators, register order
};

// Q in LDS, [head][dim] rows padded so that the 16 heads' reads of one k-step start 4
// banks apart (2 lanes a bank: the fewest passes for 16 lanes x 4 dwords).
constexpr int Q_STRIDE = D_QK + 8;                             // bf16 per head row (1,168 B)

struct Smem {
    union {
        ScheduleSmem<THREADS> sched;                   // the block's work item (start)
        alignas(16) unsigned short q[HEADS * Q_STRIDE];  // bf16 Q (the tile loop)
        Merge merge;                                   // the four waves' states (end)
    };
    int last;                                          // arrive_last's flag
};
static_assert(Q_STRIDE % 8 == 0, "16-byte Q rows");

HIPMLA_DEVICE const unsigned char* row_ptr(const MlaDecodeParams& p, long long row) {
    return static_cast<const unsigned char*>(p.kv) + row * ROW_BYTES;
}

// The f32 scale of MX block `blk` of `row` (1 for formats without block scales).
HIPMLA_DEVICE float block_scale(const MlaDecodeParams& p, long long row, int blk) {
    if constexpr (KV == FORMAT_MXFP4) return e8m0_to_f32(p.kv_scale[row * p.stride_kv_scale + blk]);
    return 1.0f;
}

// ELEMS_PER_DWORD values of one KV dword as f32 (exact), element order; MXFP4 times its
// block scale. Not for bf16, whose words are operands already.
template <int F>
HIPMLA_DEVICE void dword_to_f32(unsigned w, float scale, float* out) {
    static_assert(F == FORMAT_FP8 || F == FORMAT_MXFP4, "bf16 words need no conversion");
    if constexpr (F == FORMAT_FP8) {
        const f32x2 lo = fp8x2_to_f32<false>(w), hi = fp8x2_to_f32<true>(w);
        out[0] = lo.x; out[1] = lo.y; out[2] = hi.x; out[3] = hi.y;
    } else {
        e2m1x8_to_f32(w, out);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] *= scale;
    }
}

// This lane's Q.K operands of chunk j: 16 consecutive elements of `src` starting at
// 64 j + 16 g, as 8 dwords of bf16 pairs (k-step i = dwords 2i, 2i + 1). Q (bf16) and
// K rows (any format) go through the same mapping, so the k order agrees.
HIPMLA_DEVICE void k_chunk(const MlaDecodeParams& p, long long row, int j, unsigned* dw) {
    const int e0 = CHUNK * j + LANE_CHUNK * lane_rowgroup();
    const unsigned char* src = row_ptr(p, row) + e0 * 4 / ELEMS_PER_DWORD;
    if constexpr (KV == FORMAT_BF16) {
        const u32x4 a = reinterpret_cast<const u32x4*>(src)[0], b = reinterpret_cast<const u32x4*>(src)[1];
        const unsigned w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) dw[k] = w[k];
    } else {
        unsigned w[LANE_CHUNK_DWORDS];
        if constexpr (KV == FORMAT_FP8) {
            const u32x4 a = *reinterpret_cast<const u32x4*>(src);
            w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        } else {
            const u32x2 a = *reinterpret_cast<const u32x2*>(src);
            w[0] = a.x; w[1] = a.y;
        }
        const float scale = block_scale(p, row, e0 / MX_BLOCK);
        float f[LANE_CHUNK];
#pragma unroll
        for (int d = 0; d < LANE_CHUNK_DWORDS; ++d) dword_to_f32<KV>(w[d], scale, f + d * ELEMS_PER_DWORD);
#pragma unroll
        for (int k = 0; k < 8; ++k) dw[k] = bf16_pair_exact(f[2 * k], f[2 * k + 1]);
    }
}

// Q of `row` into LDS as it is: 16-byte chunks, 4.5 per thread.
HIPMLA_DEVICE void stage_q(unsigned short* qs, const MlaDecodeParams& p, int row) {
    const unsigned short* q = static_cast<const unsigned short*>(p.q) + (long long)row * HEADS * D_QK;
    constexpr int PER_HEAD = D_QK / 8;
    for (int c = int(thread_index()); c < HEADS * PER_HEAD; c += THREADS) {
        const int h = c / PER_HEAD, k = c % PER_HEAD;
        *reinterpret_cast<u32x4*>(qs + h * Q_STRIDE + 8 * k) = *reinterpret_cast<const u32x4*>(q + h * D_QK + 8 * k);
    }
}

// S^T of 16-token group s of the quarter of `rows`: D[4g + i][h] = k_{16 s + 4g + i} . q_h
// (raw). B = Q^T (column = head lane_col) from LDS, the same 16 elements per chunk as K
// (64 j + 16 g ..): Q in registers would hold 72 VGPRs across the tile loop.
HIPMLA_DEVICE f32x4 group_scores(const MlaDecodeParams& p, const QuarterRows& rows, int s, const unsigned short* qs) {
    const long long row = rows.at(MFMA_N * s + lane_col());  // A row = token
    const unsigned short* qrow = qs + lane_col() * Q_STRIDE + LANE_CHUNK * lane_rowgroup();
    f32x4 d = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        unsigned dw[8];
        k_chunk(p, row, j, dw);
        const u32x4 qa = reinterpret_cast<const u32x4*>(qrow + CHUNK * j)[0];
        const u32x4 qb = reinterpret_cast<const u32x4*>(qrow + CHUNK * j)[1];
        const u32x2 qstep[STEPS_PER_CHUNK] = {{qa.x, qa.y}, {qa.z, qa.w}, {qb.x, qb.y}, {qb.z, qb.w}};
#pragma unroll
        for (int i = 0; i < STEPS_PER_CHUNK; ++i) d = mfma_bf16_16x16x16(u32x2{dw[2 * i], dw[2 * i + 1]}, qstep[i], d);
    }
    return d;
}

// acc[vg * ELEMS_PER_DWORD + n] += V^T P^T for group s of the quarter of `rows`: D row x
// of that tile is value column ELEMS_PER_DWORD * (16 vg + x) + n, D column the head
// lane_col. `pt` is P^T as this lane's bf16 pairs (tokens 16 s + 4g + 0..3).
HIPMLA_DEVICE void group_pv(const MlaDecodeParams& p, const QuarterRows& rows, int s, u32x2 pt, f32x4* acc) {
    const int r = lane_col();
    // Tokens 16 s + 4 g + e: the lane id is opaque here, so the bpermute indices are made
    // per call instead of eight of them being held across the tile loop.
    const int t0 = MFMA_N * s + K_PER_LANE * (lane_id_fresh() / MFMA_N);
    long long row[K_PER_LANE];
#pragma unroll
    for (int e = 0; e < K_PER_LANE; ++e) row[e] = rows.at(t0 + e);
#pragma unroll
    for (int vg = 0; vg < V_GROUPS; ++vg) {
        // One value group at a time: hoisting the next group's loads and converts would
        // hold their registers next to the 128 accumulators.
        __builtin_amdgcn_sched_barrier(0);
        const int word = MFMA_N * vg + r;
        unsigned w[K_PER_LANE];
#pragma unroll
        for (int e = 0; e < K_PER_LANE; ++e) w[e] = reinterpret_cast<const unsigned*>(row_ptr(p, row[e]))[word];
        if constexpr (KV == FORMAT_BF16) {
            acc[2 * vg] = mfma_bf16_16x16x16(u32x2{pick_halves<true>(w[0], w[1]), pick_halves<true>(w[2], w[3])}, pt, acc[2 * vg]);
            acc[2 * vg + 1] = mfma_bf16_16x16x16(u32x2{pick_halves<false>(w[0], w[1]), pick_halves<false>(w[2], w[3])}, pt,
                                                 acc[2 * vg + 1]);
        } else {
            float f[K_PER_LANE][ELEMS_PER_DWORD];
#pragma unroll
            for (int e = 0; e < K_PER_LANE; ++e) {
                const float scale = block_scale(p, row[e], word * ELEMS_PER_DWORD / MX_BLOCK);
                dword_to_f32<KV>(w[e], scale, f[e]);
            }
#pragma unroll
            for (int n = 0; n < ELEMS_PER_DWORD; ++n) {
                const u32x2 a = {bf16_pair_exact(f[0][n], f[1][n]), bf16_pair_exact(f[2][n], f[3][n])};
                acc[vg * ELEMS_PER_DWORD + n] = mfma_bf16_16x16x16(a, pt, acc[vg * ELEMS_PER_DWORD + n]);
            }
        }
    }
}

// Output column of accumulator tile `tile`, D row 4 g + i.
HIPMLA_DEVICE int value_column(int tile, int g, int i) {
    return ELEMS_PER_DWORD * (MFMA_N * (tile / ELEMS_PER_DWORD) + K_PER_LANE * g + i) + tile % ELEMS_PER_DWORD;
}

}  // namespace fast942
}  // namespace hipmla

HIPMLA_KERNEL(hipmla::fast942::THREADS) void HIPMLA_FAST_NAME(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::gfx942;
    using namespace hipmla::fast942;
    HIPMLA_SHARED Smem smem;
    Merge& sm = smem.merge;

    const WorkItem it = schedule_item<THREADS>(p, int(block_index()), smem.sched);
    // p.fast_tile = 0: every item (any length, empty and bad ones too). p.fast_tile > 0:
    // only the items split.hip skips (valid, whole fast tiles), as before masked tails.
    if (it.seq < 0 || (p.fast_tile > 0 && !it.fast)) return;
    // An item with invalid device-side input reads no KV and writes NaN (below).
    const int n_tokens = it.bad ? 0 : it.end - it.begin;
    const int seq = it.seq;  // its kv rows
    const int row = it.row;  // its q, out and lse: 16 heads of one query token
    const int n_tiles = (n_tokens + TILE - 1) / TILE;  // the last one may be partial
    const int last = it.begin + n_tokens - 1;          // the item's last token (n_tokens > 0)
    const int slot = it.n_items > 1 ? it.slot : -1;
    const int w = wave_id();
    const int lane = lane_id();
    const int h = lane_col();
    const int g = lane_rowgroup();
    const KvRows kv = kv_rows(p, seq);
    const int quarter_begin = it.begin + QUARTER * w;  // this wave's first token of tile 0
    // fp8: the tensor scale stays out of the products (split.hip's order: c * scale first).
    const float score_scale = KV == FORMAT_FP8 ? p.sm_scale_log2 * p.kv_fp8_scale : p.sm_scale_log2;
    const float value_scale = KV == FORMAT_FP8 ? p.kv_fp8_scale : 1.0f;

    stage_q(smem.q, p, row);  // over the schedule's scan: every thread is past it
    block_sync();

    float m_run = running_max_start();  // head h, log2 units; equal in the 4 lane groups
    float l_lane = 0.0f;    // head h, this lane's tokens
    f32x4 acc[V_TILES];
#pragma unroll
    for (int t = 0; t < V_TILES; ++t) acc[t] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};

    for (int tile = 0; tile < n_tiles; ++tile) {
        // The quarter's rows, read where nothing else is in flight: row() uses the page id
        // as soon as it has read it, so a read a tile ahead would only move the wait (and
        // the loop-carried copy costs registers that fp8 does not have below 256).
        // Rows past the item's end are clamped to its last token (a partial last tile).
        const QuarterRows rows = quarter_rows(kv, quarter_begin + TILE * tile, last);
        // Tokens of this quarter before the item's end (wave-uniform; >= 32 but on the last
        // tile): the others get -inf, so P = 0 for them.
        const int valid = it.begin + n_tokens - (quarter_begin + TILE * tile);
        // Score (s, i) of this lane is token 16 s + 4 g + i of its quarter (D row 4 g + i);
        // g from the opaque lane id, made here rather than held across the loop.
        const int token_base = K_PER_LANE * (lane_id_fresh() / MFMA_N);
        f32x4 score[GROUPS];
        float tile_max = running_max_start();
#pragma unroll
        for (int s = 0; s < GROUPS; ++s) {
            score[s] = group_scores(p, rows, s, smem.q);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                score[s][i] = masked_score(score[s][i] * score_scale, token_base, MFMA_N * s + i, valid);
                tile_max = __builtin_fmaxf(tile_max, score[s][i]);
            }
        }
        const float m_new = __builtin_fmaxf(m_run, max_over_rowgroups(tile_max));
        const float alpha = exp2_f32(m_run - m_new);
        m_run = m_new;
        u32x2 pt[GROUPS];
        float psum = 0.0f;
#pragma unroll
        for (int s = 0; s < GROUPS; ++s) {
            unsigned bits[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                bits[i] = f32_to_bf16_bits(exp2_f32(score[s][i] - m_new));
                psum += bf16_to_f32(bits[i]);
            }
            pt[s] = u32x2{bits[0] | (bits[1] << 16), bits[2] | (bits[3] << 16)};
        }
        l_lane = l_lane * alpha + psum;
#pragma unroll
        for (int t = 0; t < V_TILES; ++t) acc[t] *= alpha;
#pragma unroll
        for (int s = 0; s < GROUPS; ++s) group_pv(p, rows, s, pt[s], acc);
    }

    // Merge the four waves: M = max m_w, weights exp2(m_w - M), L = sum in wave order,
    // acc = ((w0 a0 + w1 a1) + w2 a2) + w3 a3, accumulated through LDS in two rounds of
    // 16 tiles (the fp8 tensor scale rides on the weight).
    const float l_wave = sum_over_rowgroups(l_lane);
    block_sync();  // every wave is done with Q, which the merge overwrites
    if (g == 0) {
        sm.m[w][h] = m_run;
        sm.l[w][h] = l_wave;
    }
    block_sync();
    float big_m = sm.m[0][h];
#pragma unroll
    for (int k = 1; k < WAVES; ++k) big_m = __builtin_fmaxf(big_m, sm.m[k][h]);
    float big_l = 0.0f;
#pragma unroll
    for (int k = 0; k < WAVES; ++k) big_l += exp2_f32(sm.m[k][h] - big_m) * sm.l[k][h];
    float weight = exp2_f32(m_run - big_m) * value_scale;
    if (it.bad) {  // NaN partial or output: the merge turns it into NaN for the sequence
        const float nan = f32_from_bits(0x7fc00000u);
        big_m = nan;
        big_l = nan;
        weight = nan;  // every accumulator cell becomes NaN
    }
    // An empty item (an empty sequence: one item, slot < 0) has big_l = 0 and acc = 0:
    // dividing by 1 gives its output 0, and big_m + log2(0) its LSE -inf. NaN stays NaN.
    const float denom = big_l <= 0.0f ? 1.0f : big_l;

    if (slot >= 0 && lane < HEADS && w == 0) {
        p.part_ml[(slot * HEADS + h) * 2] = big_m;
        p.part_ml[(slot * HEADS + h) * 2 + 1] = big_l;
    } else if (slot < 0 && lane < HEADS && w == 0 && p.lse != nullptr) {
        p.lse[(long long)row * HEADS + h] = big_l <= 0.0f ? f32_from_bits(0xff800000u) : (big_m + log2_f32(big_l)) * 0.6931471805599453f;
    }
#pragma unroll
    for (int round = 0; round < MERGE_ROUNDS; ++round) {
        for (int k = 0; k < WAVES; ++k) {
            if (k == w) {
#pragma unroll
                for (int t = 0; t < MERGE_TILES; ++t) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float* cell = &sm.acc[t * 4 + i][lane];
                        const float mine = acc[round * MERGE_TILES + t][i] * weight;
                        *cell = k == 0 ? mine : *cell + mine;
                    }
                }
            }
            block_sync();
        }
        // Wave w writes tiles 4w..4w+3 of the round; tiles 2u, 2u + 1 are adjacent columns.
#pragma unroll
        for (int u = 0; u < TILES_PER_WAVE; u += 2) {
            const int t = TILES_PER_WAVE * w + u;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float v0 = sm.acc[t * 4 + i][lane], v1 = sm.acc[(t + 1) * 4 + i][lane];
                const int col = value_column(round * MERGE_TILES + t, g, i);
                if (slot >= 0) {
                    *reinterpret_cast<f32x2*>(p.part_acc + ((long long)slot * HEADS + h) * D_V + col) = f32x2{v0, v1};
                } else {
                    *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(p.out) + ((long long)row * HEADS + h) * D_V + col) =
                        pack_bf16x2(v0 / denom, v1 / denom);
                }
            }
        }
        block_sync();  // the buffer is free for the next round
    }
    // A bad item's error bits: here, where nothing else is live (at the top of the kernel
    // the atomic's registers would stay allocated next to the accumulators).
    report_bad_item(p, it);
    // A split sequence: the last of its items to finish (this kernel's or split.hip's)
    // merges the slots.
    if (slot >= 0 && arrive_last(p, it, &smem.last)) merge_partials<THREADS>(p, it);
}
