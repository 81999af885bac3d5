// sm_90a (Hopper) split kernel of 64 query rows a work item: an MXFP4 or fp8 (e4m3fn) cache
// with bf16 Q, on the project's serving core, for models of 64 or 128 heads, and for 16 or
// 32 heads when a step has several query tokens a sequence (MTP: 16 heads x 4 tokens, 32 x
// 2). Built for sm_90a (wgmma).
//
// Why a second sm_90 kernel. With 16 rows (decode/split_sm90.hip) every tensor-core form of
// sm_90 runs at N <= 16, K is dequantized once per 16 rows and transposed for P.V, and
// MXFP4 stays near 40% of the read bandwidth (KERNELS.md, "The bound"). Where a sequence
// has 64+ rows (heads x query tokens), 64 of them fill wgmma's M = 64: K is dequantized
// once for 64 rows, and both products read it from shared memory, Q.K as the K-major B
// operand and P.V as the MN-major (transposed) B operand, so nothing is transposed by
// instructions.
//
// Schedule: the decoder launches it with p.head_groups = max(heads / 64, 1) and, below 64
// heads, p.row_tokens = 64 / heads, so a row of the schedule (core/schedule.h) is 64 heads
// of one query token or 64 / heads query tokens of all heads (it.queries of them: fewer
// where a sequence's query tokens run out). Item i takes tokens [begin, end) of its sequence
// for those rows, as up to 4 rows of 16 heads for everything the rest of the core keys by
// row: 16-head row sub_rows().first + j (its q, out, lse and merge counter; the query
// rows of a step are 16-head rows in a row, so the 64 are consecutive), partial slot
// 4 it.slot + j (first_slot 4 it.first_slot + j, stride 4 it.slot_stride). The decoder
// sizes the scratch for 4 slots an item. A block's rows arrive at their counters together
// and it merges its shares of them one after the other (core/merge.h, merge_split_rows:
// per row as the 16-head kernels merge). Causal within the step: the item
// ends where its last query token's view does (it.sees); the warp of an earlier query
// token's 16 heads masks the tokens past its own (row_seen), and Q rows past the item's
// query tokens are zero and write nothing.
//
// Block = 2 warpgroups (256 threads), one block an SM (mxfp4 212,992 B of shared memory,
// fp8 211,968 B).
// Tile = 64 tokens; an item of n tokens is ceil(n / 64) tiles, the last one masked.
//   copies      thread (token tid / 4, part tid % 4) copies 16-byte chunks part + 4 c of its
//               token's row (mxfp4 288 bytes; fp8 576, at a 592-byte stride: RAW_STRIDE;
//               cp.async, zero-filled past the item) into a ring of raw tiles (mxfp4 2
//               stages; fp8 1, as 2 would not fit beside Q' and K': its copies of tile + 1
//               run under tile's Q.K, softmax and P.V), its row from kv_rows() (one
//               page-table read a tile); mxfp4 also loads E8M0 bytes part + 4 c with plain
//               loads, stored to the ring a tile later.
//   K' tile     every thread dequantizes (token, 16-byte chunk) pairs pi = tid + 256 k of the
//               raw tile into bf16 in shared memory, in 128-byte-swizzled chunks of 64 dims:
//               [chunk 9][token 64][128 B], unit u of row r at u ^ (r & 7). Unit u of chunk c
//               holds dims 8 (8 c + u) + perm(x), x = 0..7. mxfp4: value * 2^-64
//               (e2m1x8_to_bf16x2_scaled_down times e8m0_multiplier; perm 0 4 1 5 2 6 3 7,
//               that conversion's pairs); fp8: the e4m3 value, exact (e4m3x4_to_bf16x2;
//               perm the identity), the tensor scale p.kv_fp8_scale left to the scores and O.
//   Q'          Q * 2^QSHIFT (mxfp4 2^64, fp8 1; exact in bf16) of the item's 64 heads,
//               written once in K''s layout and dim order: the K-major A operand of every Q.K.
//   S = Q'K'^T  wgmma.m64n64k16, both operands K-major in shared memory; warpgroup wg takes
//               dims [288 wg, 288 wg + 288) (18 k-steps) of the 64 tokens, hands the other
//               its partial scores for the other's 32 tokens (xs), and so owns tokens
//               [32 wg, 32 wg + 32) of the tile, whole.
//   softmax     one running max a head (log2 domain) moving once a 64-token tile: the quad's
//               max, then both warpgroups' maxima through mx; P = bf16_rne(exp2(s - m)) into
//               the P tile ([head][token], 128-byte swizzled: P.V's K-major A operand);
//               masked tokens (past the item, or past what the warp's query token sees)
//               score -inf, so their P is 0 exactly. (A non-finite V' of a token an earlier
//               query token does not see still reaches its O as 0 x inf: the cache rows of a
//               step's own tokens are the caller's to keep finite.)
//   O += P V'   wgmma.m64n256k16 with B = the K' tile's first 512 dims read MN-major; warpgroup
//               wg owns output dims [256 wg, 256 wg + 256): 4 chunks, O is 128 f32 a thread.
// Lane roles: wgmma's accumulator layout (arch/sm90a.h): thread (warp w of its warpgroup,
// g = lane / 4, t = lane % 4) holds heads r0 = 16 w + g and r1 = r0 + 8, tokens / columns
// 8 j + 2 t, + 1.
// Barriers per tile (all 256 threads): raw tile in and the last P.V done; K' written;
// partial scores traded; maxima traded; P written. K' is single-buffered, so the next tile's
// dequantization waits for this tile's P.V.
//
// Numerics (KERNELS.md "Numerics", the portable kernel's bf16 products with 64-token
// softmax tiles: hipmla.emulate.emulate_work_item(tile=64) per 16-head row, row_heads=64 in
// emulate_decode; for fp8 too, unlike the 16-head kernel's f16 products): mxfp4 K' = V' =
// value * 2^-64 and Q' = Q * 2^64 exactly (block scales 2^(s-127) in [2^-68, 2^65], |q| <
// 2^64; a larger scale saturates to +inf); fp8 K' = V' = the e4m3 value and Q' = Q (an
// e4m3fn NaN code gives NaN); f32 scores on the tensor cores (each warpgroup's 288 dims in
// tensor-core order, then the two halves added), times sm_scale log2(e) (fp8: times
// kv_fp8_scale, that product first); exp2 is ex2.approx.ftz; P rounded to bf16 RNE, l the
// sum of those bf16 values (each warpgroup its 32 tokens of a tile, the two added at the
// end), alpha rescales O; f32 accumulation; the final O times 2^QSHIFT (fp8: times
// kv_fp8_scale) / l rounded to bf16 RNE.
//
// Budget (nvcc 13.0 / ptxas, sm_90a): 255 registers at most (__launch_bounds__(256, 1)), no
// stack, no spills; dynamic shared memory = hipmla.kernels.sm90_rows64_shared_bytes(kv_format).
// Measured against the 16-head kernels: README, "64 rows a block on sm_90"; the probe that
// led here (hot loop alone): KERNELS.md, "64 rows a block on wgmma, measured".
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/merge.h"
#include "core/paged.h"
#include "core/schedule.h"
#include "arch/sm90.h"
#include "arch/sm90a.h"

#if !defined(HIPMLA_KV_FORMAT) || !defined(HIPMLA_Q_PRECISION) || !defined(HIPMLA_FP8_FNUZ)
#error "split_sm90_rows64.hip needs -DHIPMLA_KV_FORMAT=<1|2> -DHIPMLA_Q_PRECISION=0 -DHIPMLA_FP8_FNUZ=0"
#endif
#if (HIPMLA_KV_FORMAT != 1 && HIPMLA_KV_FORMAT != 2) || HIPMLA_Q_PRECISION != 0
#error "split_sm90_rows64.hip reads an fp8 or mxfp4 cache with bf16 Q only (HIPMLA_KV_FORMAT=1 or 2, HIPMLA_Q_PRECISION=0)"
#endif
#if HIPMLA_FP8_FNUZ != 0
#error "split_sm90_rows64.hip: NVIDIA fp8 is e4m3fn (HIPMLA_FP8_FNUZ=0)"
#endif
#if HIPMLA_KV_FORMAT == 1
#define HIPMLA_ROWS64_NAME hipmla_decode_split_sm90_rows64_fp8_qbf16
#else
#define HIPMLA_ROWS64_NAME hipmla_decode_split_sm90_rows64_mxfp4_qbf16
#endif

namespace hipmla {
namespace sm90r {

using namespace sm90;
using namespace sm90a;

constexpr bool MX = HIPMLA_KV_FORMAT == FORMAT_MXFP4;  // else fp8 (e4m3fn, one tensor scale)
constexpr int ROW_HEADS = 64;                  // heads of a schedule row: wgmma's M
constexpr int SUB_ROWS = ROW_HEADS / HEADS;    // 16-head rows of an item (q, out, lse, merge)
constexpr int TILE = 64;                       // tokens a tile (wgmma's N of Q.K)
constexpr int THREADS = 256;                   // 2 warpgroups
constexpr int CHUNKS = D_QK / 64;              // 128-byte chunks of a bf16 row of Q' / K'
constexpr int CHUNK_BYTES = TILE * 128;        // one chunk of 64 rows
constexpr int ROW_BYTES = MX ? D_QK / 2 : D_QK;  // bytes of a cache row
// Bytes a raw row takes in the ring. fp8's 576 (16 banks mod 32) would put the 8 tokens of
// a 16-byte load phase on 2 bank groups, a 4-way conflict; 592 puts them on 8. mxfp4's 288
// (a 2-way conflict) is the layout its figures were measured with.
constexpr int RAW_STRIDE = MX ? ROW_BYTES : ROW_BYTES + 16;
constexpr int SCALES = D_QK / MX_BLOCK;        // E8M0 bytes of an mxfp4 row
constexpr int STAGES = MX ? 2 : 1;             // raw tiles in the ring (a power of two)
constexpr int QK_STEPS = D_QK / 16 / 2;        // k-steps of Q.K a warpgroup
constexpr int V_CHUNKS = D_V / 64 / 2;         // output chunks of 64 dims a warpgroup
constexpr int O_REGS = V_CHUNKS * 64 * ROW_HEADS / 128;  // O's f32 a thread (m64n256's accumulator)
constexpr int PART = 4;                        // copy threads a token
constexpr int COPIES = (ROW_BYTES / 16 + PART - 1) / PART;
constexpr int SCALE_LOADS = (SCALES + PART - 1) / PART;
constexpr int UNITS = ROW_BYTES / 16;          // 16-byte chunks of a raw row
constexpr int PAIRS = (TILE * UNITS + THREADS - 1) / THREADS;  // (token, chunk) pairs a thread
constexpr int PAIR_BATCH = 5;                  // pairs loaded before the first is converted
constexpr int OUT_STRIDE = D_V + 4;            // f32 a head row of the output stage
constexpr int QSHIFT = MX ? 64 : 0;            // Q' = Q * 2^QSHIFT, K' = K * 2^-QSHIFT

// The cache's tensor scale: fp8's one f32 (it multiplies the scores and O), 1 for mxfp4.
HIPMLA_DEVICE float tensor_scale(const MlaDecodeParams& p) { return MX ? 1.0f : p.kv_fp8_scale; }

static_assert(THREADS == BLOCK_THREADS, "the kernel launches the project's block size");
static_assert(ROW_HEADS == 64 && SUB_ROWS * HEADS == ROW_HEADS, "64 heads: wgmma's M");
static_assert(TILE * PART == THREADS, "PART copy threads a token cover the tile");
static_assert(!MX || (MX_BLOCK == 32 && UNITS == SCALES), "a 16-byte chunk of mxfp4 codes is one E8M0 block");
static_assert(ROW_BYTES % 16 == 0 && TILE % 32 == 0, "whole chunks; a warp's 32 pairs share their chunk");
static_assert((STAGES & (STAGES - 1)) == 0, "tile & (STAGES - 1) is the stage");
static_assert(CHUNKS * 64 == D_QK && V_CHUNKS * 2 * 64 == D_V, "64-dim chunks");
static_assert(O_REGS == 128, "a warpgroup's O is one m64n256 accumulator");

struct alignas(1024) Smem {
    union {
        struct {
            unsigned char q[CHUNKS * CHUNK_BYTES];  // Q' [chunk][head][128 B swizzled]
            unsigned char k[CHUNKS * CHUNK_BYTES];  // K' [chunk][token][128 B swizzled]
        } t;
        float out[ROW_HEADS][OUT_STRIDE];           // after the last tile: O, for whole-row stores
    } u;
    unsigned char p[CHUNK_BYTES];                   // P [head][token 128 B swizzled]
    unsigned char raw[STAGES][TILE * RAW_STRIDE];
    unsigned char sc[STAGES][MX ? TILE * SCALES : 16];  // E8M0 bytes (fp8: unused)
    union {
        f32x4 xs[2][4][128];                        // partial scores a warpgroup hands the other
        ScheduleSmem<THREADS> sched;                // before the first tile
    } x;
    float mx[2][ROW_HEADS];                         // each warpgroup's maxima of a tile
    float lsum[2][ROW_HEADS];                       // each warpgroup's l at the end
    WorkItem item;
    int last[SUB_ROWS];  // merge_split_rows' shares
};
static_assert(sizeof(Smem) == (MX ? 212992 : 211968), "hipmla.kernels.sm90_rows64_shared_bytes(kv) launches with this");
static_assert(sizeof(float) * ROW_HEADS * OUT_STRIDE <= sizeof(Smem::u), "O's stage fits over Q' and K'");

// The item's 16-head rows: the first (its q, out, lse and merge counter; the next ones
// follow), how many exist (a row of fewer query tokens than p.row_tokens has fewer) and
// how many a query token has.
struct SubRows {
    int first, count, per_token;
};
HIPMLA_DEVICE SubRows sub_rows(const MlaDecodeParams& p, const WorkItem& it) {
    const int per_token = SUB_ROWS / row_tokens(p);
    return SubRows{it.row * per_token, it.queries * per_token, per_token};
}
// Tokens of the item that 16-head row j sees: the item's, less the last ones for a query
// token before the row's last (causal); 0 past the item's rows or for a bad item.
HIPMLA_DEVICE int row_seen(const WorkItem& it, const SubRows& sr, int j) {
    if (it.bad || j >= sr.count) return 0;
    const int sees = it.sees - (it.queries - 1 - j / sr.per_token);
    const int end = it.end < sees ? it.end : sees;
    return end > it.begin ? end - it.begin : 0;
}

// Element x (0..7) of a 16-byte unit holds dim 8 word + perm(x): mxfp4 the pairs of
// e2m1x8_to_bf16x2_scaled_down (0 4 1 5 2 6 3 7), fp8 in order.
HIPMLA_DEVICE constexpr int perm(int x) { return MX ? (x >> 1) + 4 * (x & 1) : x; }

// Q' = Q * 2^QSHIFT of the item's 64 heads (exact in bf16 for |q| < 2^64), once, in K''s layout.
// A thread's 18 16-byte pieces go in Q_BATCH loads at a time, all in flight together: one
// memory latency a batch, not one a piece.
constexpr int Q_PIECES = ROW_HEADS * D_QK / 8 / THREADS;
constexpr int Q_BATCH = 6;
static_assert(Q_PIECES * THREADS * 8 == ROW_HEADS * D_QK && Q_PIECES % Q_BATCH == 0, "whole batches of Q");
// Rows from `rows` on are no query row of the step (a row of fewer query tokens than
// row_tokens): they are zero, not read.
HIPMLA_DEVICE void fill_q(unsigned q_base, const unsigned short* q, int rows, int tid) {
#pragma unroll 1
    for (int b0 = 0; b0 < Q_PIECES; b0 += Q_BATCH) {
        u32x4 batch[Q_BATCH];
#pragma unroll
        for (int k = 0; k < Q_BATCH; ++k) {
            const int i = tid + THREADS * (b0 + k);
            batch[k] = i / (D_QK / 8) < rows ? *reinterpret_cast<const u32x4*>(q + 8 * i) : u32x4{0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int k = 0; k < Q_BATCH; ++k) {
            const int i = tid + THREADS * (b0 + k);
            const int r = i / (D_QK / 8), word = i % (D_QK / 8);
            const u32x4 v = batch[k];
            const unsigned src[4] = {v.x, v.y, v.z, v.w};
            unsigned x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                unsigned half[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int d = perm(2 * e + h);
                    const unsigned bits = (src[d >> 1] >> (16 * (d & 1))) & 0xffffu;
                    half[h] = f32_to_bf16_bits(bf16_to_f32(bits) * exp2_int(QSHIFT));
                }
                x[e] = half[0] | (half[1] << 16);
            }
            st_shared_v4(swizzled_unit(q_base + (word >> 3) * CHUNK_BYTES, r, word & 7), x);
        }
    }
}

// The thread's (token, 16-byte chunk) pairs pi = tid + THREADS k of a raw tile into K' (the
// lanes of a warp: consecutive tokens of one chunk, so each 16-byte store phase covers 8
// rows' different swizzled units). PAIR_BATCH pairs' bytes are loaded before the first of
// them is converted: one shared-memory latency a batch, not one a pair (mxfp4's 5 pairs are
// one batch; fp8's 9 two, which keeps the registers within the budget beside O).
HIPMLA_DEVICE void dequant_tile(const unsigned char* raw, const unsigned char* sc, unsigned k_base, int tid) {
    // Without st_shared_v4's memory clobber, as the mxfp4 loop was measured with: the
    // compiler may move the conversions of other pairs across the stores.
    auto store = [k_base](int r, int unit, const unsigned (&x)[4]) {
        st_shared_v4_no_clobber(swizzled_unit(k_base + (unit >> 3) * CHUNK_BYTES, r, unit & 7), x);
    };
#pragma unroll
    for (int k0 = 0; k0 < PAIRS; k0 += PAIR_BATCH) {
        u32x4 v[PAIR_BATCH];
        unsigned m[PAIR_BATCH];
#pragma unroll
        for (int k = 0; k < PAIR_BATCH; ++k) {
            const int pi = tid + THREADS * (k0 + k);
            if (k0 + k < PAIRS && pi < TILE * UNITS) {
                const int r = pi % TILE, b = pi / TILE;
                v[k] = *reinterpret_cast<const u32x4*>(raw + r * RAW_STRIDE + 16 * b);
                if constexpr (MX) m[k] = sc[r * SCALES + b];
            }
        }
#pragma unroll
        for (int k = 0; k < PAIR_BATCH; ++k) {
            const int pi = tid + THREADS * (k0 + k);
            if (k0 + k >= PAIRS || pi >= TILE * UNITS) break;
            const int r = pi % TILE, b = pi / TILE;
            const unsigned wv[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
            if constexpr (MX) {  // word i: 8 dims, one unit
                const unsigned mk = e8m0_multiplier(m[k]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    unsigned x[4];
                    e2m1x8_to_bf16x2_scaled_down(wv[i], x);
#pragma unroll
                    for (int j = 0; j < 4; ++j) x[j] = mul_bf16x2(x[j], mk);
                    store(r, 4 * b + i, x);
                }
            } else {  // words 2 j, 2 j + 1: 8 dims, one unit
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    unsigned x[4];
                    e4m3x4_to_bf16x2(wv[2 * j], x[0], x[1]);
                    e4m3x4_to_bf16x2(wv[2 * j + 1], x[2], x[3]);
                    store(r, 2 * b + j, x);
                }
            }
        }
    }
}

// A thread's share of the 64 heads (rows r0, r1 of every accumulator): O for its
// warpgroup's 4 chunks of output dims, the running max (log2 domain) and its tokens' sum.
template <int WG>
struct Rows {
    float o[O_REGS];  // element 4 j + e: column 8 j + 2 t + (e & 1) of the warpgroup's 256 dims
    float m_run[2], l_run[2];
    int r0, r1, t, wtid;
    int n_row;  // tokens of the item its 16-head row (the warp's: heads r0, r1) sees

    HIPMLA_DEVICE void init(int tid, int n_row_) {
        n_row = n_row_;
        wtid = tid & 127;
        const int lane = tid & 31;
        r0 = 16 * (wtid >> 5) + (lane >> 2);
        r1 = r0 + 8;
        t = lane & 3;
#pragma unroll
        for (int e = 0; e < O_REGS; ++e) o[e] = 0.0f;
        m_run[0] = m_run[1] = f32_from_bits(0xff800000u);
        l_run[0] = l_run[1] = 0.0f;
    }

    // The tile's scores S (this warpgroup's partial over its dims, 8 column blocks of 8
    // tokens) -> P in shared memory: the warpgroups trade halves through xs (warpgroup 0
    // keeps blocks 0-3, 1 blocks 4-7), take the row maxima of their halves, trade them
    // through mx, and write P rounded to bf16 into the P tile, fenced for the async proxy;
    // alpha rescales O. Tokens at or past `valid` (the thread's row's) score -inf; a row may
    // have none left in a tile (an earlier query token of a row of several), so a max of
    // -inf is taken as 0: alpha and P are then 0, not NaN. The caller's wgmma wait covered
    // the last P.V, which read P.
    HIPMLA_DEVICE void softmax(const float (&s)[32], f32x4* xs, float (*mx)[ROW_HEADS], unsigned p_base, float scale,
                               int valid) {
        constexpr int NB = 4;
        constexpr int GIVE = WG == 0 ? NB : 0, KEEP = WG == 0 ? 0 : NB;
        const float neg_inf = f32_from_bits(0xff800000u);
#pragma unroll
        for (int k = 0; k < NB; ++k)
            xs[(WG * NB + k) * 128 + wtid] = f32x4{s[4 * (GIVE + k)], s[4 * (GIVE + k) + 1], s[4 * (GIVE + k) + 2],
                                                   s[4 * (GIVE + k) + 3]};
        block_sync();
        float sv[4 * NB];
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const f32x4 o4 = xs[((1 - WG) * NB + k) * 128 + wtid];
            const int tok = 8 * (KEEP + k) + 2 * t;
            const bool v0 = tok < valid, v1 = tok + 1 < valid;
            sv[4 * k] = v0 ? (s[4 * (KEEP + k)] + o4.x) * scale : neg_inf;
            sv[4 * k + 1] = v1 ? (s[4 * (KEEP + k) + 1] + o4.y) * scale : neg_inf;
            sv[4 * k + 2] = v0 ? (s[4 * (KEEP + k) + 2] + o4.z) * scale : neg_inf;
            sv[4 * k + 3] = v1 ? (s[4 * (KEEP + k) + 3] + o4.w) * scale : neg_inf;
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
        block_sync();
        const float prev0 = m_run[0], prev1 = m_run[1];
        m_run[0] = fmaxf(prev0, fmaxf(mx[0][r0], mx[1][r0]));
        m_run[1] = fmaxf(prev1, fmaxf(mx[0][r1], mx[1][r1]));
        const float mn0 = m_run[0] == neg_inf ? 0.0f : m_run[0];
        const float mn1 = m_run[1] == neg_inf ? 0.0f : m_run[1];
        const float a0 = exp2_approx(prev0 - mn0), a1 = exp2_approx(prev1 - mn1);
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const int jj = KEEP + k;  // the column block: tokens 8 jj + 2t, + 1
            const unsigned p0 = pack_bf16x2_rn(exp2_approx(sv[4 * k] - mn0), exp2_approx(sv[4 * k + 1] - mn0));
            const unsigned p1 = pack_bf16x2_rn(exp2_approx(sv[4 * k + 2] - mn1), exp2_approx(sv[4 * k + 3] - mn1));
            ls0 += f32_from_bits(p0 << 16) + f32_from_bits(p0 & 0xffff0000u);
            ls1 += f32_from_bits(p1 << 16) + f32_from_bits(p1 & 0xffff0000u);
            st_shared_b32(swizzled_unit(p_base, r0, jj) + 4 * t, p0);
            st_shared_b32(swizzled_unit(p_base, r1, jj) + 4 * t, p1);
        }
        l_run[0] = l_run[0] * a0 + ls0;
        l_run[1] = l_run[1] * a1 + ls1;
        if (!warp_all(a0 == 1.0f && a1 == 1.0f)) {
#pragma unroll
            for (int j = 0; j < O_REGS / 4; ++j) {
                o[4 * j] *= a0;
                o[4 * j + 1] *= a0;
                o[4 * j + 2] *= a1;
                o[4 * j + 3] *= a1;
            }
        }
        fence_async_smem();
        block_sync();  // P whole (both warpgroups' tokens)
    }

    // O += P V' over the K' tile: issued and committed, not waited for. One m64n256k16 a
    // k-step (the warpgroup's 4 chunks of dims, CHUNK_BYTES apart: v_desc's LBO) reads the
    // P tile once a k-step, not once per chunk.
    HIPMLA_DEVICE void pv(unsigned long long p_desc, unsigned long long v_desc) {
        pin(o);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < TILE / 16; ++ks)
            wgmma_m64n256k16_tb(o, p_desc + unsigned(ks * 32 >> 4),
                                v_desc + (unsigned(V_CHUNKS * WG * CHUNK_BYTES + ks * 2048) >> 4));
        wg_commit();
    }
};

// The item's tiles for warpgroup WG; the copies are every thread's (both warpgroups').
template <int WG>
HIPMLA_DEVICE void run_tiles(const MlaDecodeParams& p, Smem& sm, const WorkItem& it, int n, int tid, Rows<WG>& st) {
    const KvRows rows = kv_rows(p, it.seq);
    const int n_tiles = (n + TILE - 1) / TILE;
    const int ct = tid / PART, cs = tid % PART;  // copy role: token ct, chunks / E8M0 bytes cs + PART c
    const unsigned char* kv = static_cast<const unsigned char*>(p.kv);
    const unsigned k_base = smem_address(sm.u.t.k), p_base = smem_address(sm.p);
    const unsigned long long q_desc = desc_sw128(smem_address(sm.u.t.q), 16, 1024), k_desc = desc_sw128(k_base, 16, 1024);
    const unsigned long long p_desc = desc_sw128(p_base, 16, 1024), v_desc = desc_sw128(k_base, 8192, 1024);

    // The thread's copy row of `tile` (0 past the item: its copies zero-fill).
    auto row_of = [&](int tile) -> long long {
        const int tok = tile * TILE + ct;
        return tile < n_tiles && tok < n ? rows.row(it.begin + tok) : 0;
    };
    auto issue = [&](int tile, int stage, long long r) {
        if (tile < n_tiles) {
            const unsigned bytes = tile * TILE + ct < n ? 16u : 0u;
            const unsigned char* src = kv + r * ROW_BYTES;
            const unsigned dst = smem_address(sm.raw[stage] + ct * RAW_STRIDE);
#pragma unroll
            for (int c = 0; c < COPIES; ++c) {
                const int chunk = cs + PART * c;
                if (chunk < ROW_BYTES / 16) cp_async_16(dst + 16 * chunk, src + 16 * chunk, bytes);
            }
        }
        cp_async_commit();
    };
    // mxfp4's E8M0 bytes: loaded with the tile's copies, stored to the ring a tile later
    // (after the math of a tile has hidden their latency). A row past the item takes 0: its
    // codes are zero-filled. fp8 has none.
    auto load_scales = [&](int tile, long long r, unsigned (&b)[SCALE_LOADS]) {
        if constexpr (MX) {
            const bool valid = tile < n_tiles && tile * TILE + ct < n;
#pragma unroll
            for (int c = 0; c < SCALE_LOADS; ++c) {
                const int k = cs + PART * c;
                b[c] = valid && k < SCALES ? unsigned(p.kv_scale[r * p.stride_kv_scale + k]) : 0u;
            }
        }
    };
    auto store_scales = [&](int tile, int stage, const unsigned (&b)[SCALE_LOADS]) {
        if constexpr (MX) {
            if (tile >= n_tiles) return;
#pragma unroll
            for (int c = 0; c < SCALE_LOADS; ++c) {
                const int k = cs + PART * c;
                if (k < SCALES) sm.sc[stage][ct * SCALES + k] = (unsigned char)b[c];
            }
        }
    };

    unsigned next[SCALE_LOADS];
    {
        long long r[STAGES];
        unsigned first[STAGES][SCALE_LOADS];
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            r[s] = row_of(s);
            load_scales(s, r[s], first[s]);
        }
#pragma unroll
        for (int s = 0; s < STAGES; ++s) issue(s, s, r[s]);
        const SubRows sr = sub_rows(p, it);
        fill_q(smem_address(sm.u.t.q), static_cast<const unsigned short*>(p.q) + (long long)sr.first * HEADS * D_QK,
               sr.count * HEADS, tid);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) store_scales(s, s, first[s]);
        fence_async_smem();  // Q' for the first Q.K (the loop's first barrier orders it)
    }
    const float scale = p.sm_scale_log2 * tensor_scale(p);
#pragma unroll 1
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile & (STAGES - 1);
        cp_async_wait<STAGES - 1>();
        wg_wait<0>();   // this warpgroup's P.V of the last tile has read K' and P
        block_sync();   // ... and the other's; the raw tile and its E8M0 bytes are in
        dequant_tile(sm.raw[stage], sm.sc[stage], k_base, tid);
        fence_async_smem();
        block_sync();
        {
            const long long r = row_of(tile + STAGES);
            load_scales(tile + STAGES, r, next);
            issue(tile + STAGES, stage, r);
        }

        float s[32];
#pragma unroll
        for (int e = 0; e < 32; ++e) s[e] = 0.0f;
        pin(s);
        wg_fence();
#pragma unroll
        for (int i = 0; i < QK_STEPS; ++i) {
            const int kk = QK_STEPS * WG + i;
            const unsigned off = unsigned((kk >> 2) * CHUNK_BYTES + (kk & 3) * 32) >> 4;
            wgmma_m64n64k16(s, q_desc + off, k_desc + off);
        }
        wg_commit();
        wg_wait<0>();
        pin(s);
        st.softmax(s, &sm.x.xs[0][0][0], sm.mx, p_base, scale, st.n_row - tile * TILE);
        st.pv(p_desc, v_desc);
        // The stage's E8M0 bytes were read by this tile's dequantization, before its barrier.
        store_scales(tile + STAGES, stage, next);
    }
    wg_wait<0>();
    pin(st.o);
}

// After the tiles: O (times 2^QSHIFT and the tensor scale; / l for an output) through
// shared memory, m and l.
template <int WG>
HIPMLA_DEVICE void write_state(const MlaDecodeParams& p, Smem& sm, const WorkItem& it, Rows<WG>& st) {
    const float l0 = warp_xor_sum(warp_xor_sum(st.l_run[0], 1), 2);
    const float l1 = warp_xor_sum(warp_xor_sum(st.l_run[1], 1), 2);
    if (st.t == 0) {
        sm.lsum[WG][st.r0] = l0;
        sm.lsum[WG][st.r1] = l1;
    }
#ifdef HIPMLA_SELFTEST_BREAK  // test only (hipmla.selftest.broken): a wrong build its check must catch
    const float out_scale = 1.5f * exp2_int(QSHIFT) * tensor_scale(p);
#else
    const float out_scale = exp2_int(QSHIFT) * tensor_scale(p);
#endif
    const float nan = f32_from_bits(0x7fc00000u);
    block_sync();  // every P.V done (each warpgroup waited for its own): Q' and K' are free
#pragma unroll
    for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = e < 2 ? st.r0 : st.r1;
                const int dim = 64 * (V_CHUNKS * WG + c) + 8 * j + perm(2 * st.t + (e & 1));
                sm.u.out[row][dim] = it.bad ? nan : st.o[32 * c + 4 * j + e] * out_scale;
            }
    if (WG == 0 && st.t == 0) {
        const int slot = it.n_items > 1 ? it.slot : -1;
        const SubRows sr = sub_rows(p, it);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = h ? st.r1 : st.r0;
            const float m = it.bad ? nan : st.m_run[h];
            const float l = it.bad ? nan : sm.lsum[0][row] + sm.lsum[1][row];
            if (slot >= 0) {
                const long long at = (long long)slot * ROW_HEADS + row;  // 16-head slot 4 slot + row / 16
                p.part_ml[at * 2] = m;
                p.part_ml[at * 2 + 1] = l;
            } else if (p.lse != nullptr && row < sr.count * HEADS) {
                // l = 0 only for a row that sees no token; NaN (a bad item) stays NaN.
                p.lse[(long long)sr.first * HEADS + row] =
                    !(l <= 0.0f) ? (m + log2_f32(l)) * 0.6931471805599453f : f32_from_bits(0xff800000u);
            }
        }
    }
}

}  // namespace sm90r
}  // namespace hipmla

extern "C" __global__ void __launch_bounds__(hipmla::sm90r::THREADS, 1) HIPMLA_ROWS64_NAME(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::sm90r;
    extern __shared__ __align__(1024) unsigned char hipmla_rows64_smem[];
    Smem& sm = *reinterpret_cast<Smem*>(hipmla_rows64_smem);
    if (dynamic_smem_size() < sizeof(Smem)) __trap();

    const int tid = int(thread_index());
    const WorkItem it = schedule_item<THREADS, SUB_ROWS>(p, int(block_index()), sm.x.sched);
    if (it.seq < 0) return;
    report_bad_item(p, it);
    if (tid == 0) sm.item = it;
    const int n = it.bad ? 0 : it.end - it.begin;
    const int n_row = row_seen(it, sub_rows(p, it), (tid & 127) >> 5);  // the warp's 16 heads
    if (tid < 128) {
        Rows<0> st;
        st.init(tid, n_row);
        run_tiles<0>(p, sm, it, n, tid, st);
        write_state<0>(p, sm, it, st);
    } else {
        Rows<1> st;
        st.init(tid, n_row);
        run_tiles<1>(p, sm, it, n, tid, st);
        write_state<1>(p, sm, it, st);
    }
    block_sync();

    // O leaves in 16-byte runs of a head's row: a partial (64 consecutive 16-head slot rows)
    // or the bf16 output divided by l.
    const WorkItem done = sm.item;
    const int slot = done.n_items > 1 ? done.slot : -1;
    const SubRows sr = sub_rows(p, done);
    constexpr int QUADS = D_V / 4;
    constexpr int OUT_STEPS = ROW_HEADS * QUADS / THREADS;
    static_assert(OUT_STEPS * THREADS == ROW_HEADS * QUADS, "the threads cover O's quads evenly");
#pragma unroll 4
    for (int k = 0; k < OUT_STEPS; ++k) {
        const int i = tid + k * THREADS;
        const int row = i / QUADS, d = 4 * (i % QUADS);
        const f32x4 a = *reinterpret_cast<const f32x4*>(&sm.u.out[row][d]);
        if (slot >= 0) {
            store_global(reinterpret_cast<f32x4*>(p.part_acc + ((long long)slot * ROW_HEADS + row) * D_V + d), a);
        } else if (row < sr.count * HEADS) {
            // A row that sees no token has l = 0 and O = 0: its output is 0 (a bad one NaN).
            const float lh = done.bad ? f32_from_bits(0x7fc00000u) : sm.lsum[0][row] + sm.lsum[1][row];
            const bool keep = !(lh <= 0.0f);
            const unsigned b0 = f32_to_bf16_bits(keep ? a.x / lh : 0.0f), b1 = f32_to_bf16_bits(keep ? a.y / lh : 0.0f);
            const unsigned b2 = f32_to_bf16_bits(keep ? a.z / lh : 0.0f), b3 = f32_to_bf16_bits(keep ? a.w / lh : 0.0f);
            store_global(reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) +
                                                  ((long long)sr.first * HEADS + row) * D_V + d),
                         u32x2{b0 | (b1 << 16), b2 | (b3 << 16)});
        }
    }
    if (slot >= 0) {
        // The item's 16-head rows, each merged as a 16-head kernel's row; they arrive together.
        const auto row_of = [&](int j) {
            WorkItem sub = done;
            sub.row = sr.first + j;
            sub.slot = SUB_ROWS * done.slot + j;
            sub.first_slot = SUB_ROWS * done.first_slot + j;
            sub.slot_stride = SUB_ROWS * done.slot_stride;
            return sub;
        };
        merge_split_rows<THREADS>(p, sr.count, row_of, sm.last);
    }
}
