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
// Numerics: those of hip_src/KERNELS.md for Q precision bf16 with 16-token softmax tiles
// and ONE softmax state per block: hipmla.emulate.emulate_work_item(tile=GFX942_TILE_TOKENS)
// is its model (the reduction order inside a score is KERNELS.md's "any order").
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
// Block = 4 waves, 256 threads; tile = 16 tokens (one MFMA group), staged in LDS. The
// waves split the DIMENSIONS, not the tokens (as the sm_90 kernel's warps do): wave w owns
// latent columns [128 w, 128 w + 128) -- 8 k-steps of Q.K and the 128 output columns of
// its P.V -- and rope dims [512 + 16 w, 512 + 16 w + 16), one k-step. Per tile:
//   Q.K   S^T_w = K Q^T over the wave's 144 dims, 9 v_mfma_f32_16x16x16_bf16 (A = K rows:
//         token = lane % 16, 4 dims per lane and k-step; B = Q^T: head = lane % 16, Q held
//         in 18 VGPRs for the whole item). A lane reads 16 consecutive dims of its token
//         per chunk of 64 (one or two 16-byte LDS reads), 4 per k-step, and Q's registers
//         follow the same map, so the k order agrees.
//   sum   each wave writes its 16 x 16 partial to LDS (red); after a barrier wave w owns
//         heads 4 w .. 4 w + 3, one score a lane (head 4 w + lane / 16, D row lane % 16):
//         it adds the four partials in wave order, keeps those heads' running max (a
//         16-lane max) and per-lane sums, and writes P = bf16_rne(exp2(s - m)) and alpha to
//         LDS -- one softmax state per block, split over the waves (every wave running
//         all of it cost ~60 VALU a tile more). After a second barrier a lane reads P^T
//         (head lane % 16, D rows 4 g .. 4 g + 3: 8 bytes) as its P.V B operand, and its
//         head's alpha.
//   P.V   O^T_w += V^T P^T over the wave's 128 columns: 8 MFMAs, A = V^T (column = lane %
//         16, the lane's 4 tokens), one dword of each of 4 rows per value group (element n
//         of the dword is accumulator tile n). O^T stays in registers (32 per lane) and
//         belongs to one head per lane, so alpha rescales it with no cross-lane traffic.
// Copies: a ring of STAGES = 3 tiles filled by global_load_lds_dword (arch/gfx942.h; gfx942
// has no 16-byte form), two tiles ahead: tile t + 2 is issued right after tile t's first
// barrier, 18 / 9 / 5 copies of 256 B per wave (bf16 / fp8 / mxfp4; mxfp4's 4.5 per wave
// are rounded up, the spare copies land in LDS no one reads). The page-table entries of
// tile t + 3 are read (one load per lane: KvRows::entry) before tile t + 2's copies are
// issued, and MXFP4's E8M0 bytes (16 rows x 18, at any stride and alignment: 2 byte loads
// per thread) between them. At the top of tile t + 1 the wave finishes tile t + 2's issue
// (finish_issue: its scale bytes to the stage, the rows of tile t + 3 from their
// entries), which waits for every load but tile t + 2's copies: vector memory completes in
// order, so that is also the wait for this wave's copies of tile t + 1 (wait_vm<COPIES>
// says so), and the copies never wait on a page-table read issued after older copies
// (which would drain the ring: vmcnt cannot skip over the oldest). Then a barrier
// publishes the stage. Barriers per tile: 3 (stage landed and the last tile done;
// partials written; P written).
//
// LDS: a stage is the tile's rows as a contiguous cache would hold them (no padding, so
// the copies are whole 256-byte blocks), with UNIT-byte units of a row permuted by an XOR
// of the row (unit_xor); and the Q.K rows / P.V k-slots take the tokens in the order
// token_of (the lane groups of one read land on different banks). Planned against 32
// banks of 4 bytes (an assumption of how gfx942 serves 8-, 16- and 32-lane read phases):
// bf16 (1152-byte rows, all on bank 0): 16-byte units, 3 XOR bits, rows 2e + (g & 1) +
// 8 (g >> 1); fp8 (576 bytes, rows alternate halves of the banks): 16-byte units, 2 bits;
// mxfp4 (288 bytes, rows 8 banks apart): 8-byte units, 2 bits, rows 4 e + 2 (g & 1) +
// (g >> 1). With those, the 8 lanes of a 16-byte Q.K read (16 of an 8-byte one) and the 32
// lanes of a P.V dword read hit distinct banks. Nothing has measured this on a gfx942.
// Sizes: stages 3 x 18,448 (bf16), 3 x 9,232 (fp8; both with a 16-byte stub of the scale
// array), 3 x (5,120 + 320 scale bytes) (mxfp4),
// + 4,096 B of partial scores that the schedule's scan shares, + P, alpha and the final l
// (640 B): 60,096 / 32,448 / 21,072 B, so 1 / 2 / 3 blocks fit a CU's 64 KiB. Registers
// (clang-22): 178 / 146 / 162 VGPRs, no AGPRs, no spills: the LDS bound holds (mxfp4's 3
// waves per SIMD need <= 168). Per wave and tile (hipmla.aot's loop counts): 17 MFMAs,
// 143 / 165 / 337 VALU (mxfp4 377 before its scale products went two a v_pk_mul_f32 and
// its E8M0 decode to one FMA), no vector-memory wait between a tile's first MFMA and its last
// (all at its top: with finish_issue at the end of the tile clang placed its wait among
// the P.V MFMAs).
//
// Rows come from core/paged.h, so any page size (1..128) and any page ids work. Masked
// tail: only the last tile may be partial. A token past the item's end (the tile's
// `valid` tokens, wave-uniform) is copied from the row of the item's last token (the
// token index is clamped before its page-table read, so no load leaves the item, the cache
// or the sequence's pages) and gets score -inf (masked_score), so P = 0 exactly and its
// finite V adds exact zeros. The running max starts at -FLT_MAX (running_max_start): the
// first tile with a valid token gives alpha 0 and the state that of a max starting at
// -inf. Below 16 heads a row holds several query tokens (core/schedule.h, row_heads): a
// head of an earlier one sees `cut` tokens fewer of the item (slot_tokens), compared as
// my_token + cut against the same wave-uniform valid, so any tile may mask some heads and
// a head may see none of a tile (it stays at -FLT_MAX, P = 0). report_bad_item sits at
// the very end, where nothing is live.
// After the last tile, the owners write their heads' m and l (partial slot or LSE) and l to
// LDS, where every wave reads its lanes' head's l to normalise its own output columns.
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
constexpr bool MXFP4 = KV == FORMAT_MXFP4;
constexpr int WAVES = 4;
constexpr int THREADS = WAVES * WAVE;
constexpr int TILE = MFMA_N;                       // tokens per tile and softmax step (p.fast_tile)
constexpr int STAGES = 3;                          // tiles in LDS: the one read, two in flight
constexpr int ELEMS_PER_DWORD = MXFP4 ? 8 : KV == FORMAT_FP8 ? 4 : 2;
constexpr int ROW_BYTES = D_QK * 4 / ELEMS_PER_DWORD;
constexpr int V_DIMS = D_V / WAVES;                // 128 latent columns per wave
constexpr int ROPE_DIMS = (D_QK - D_V) / WAVES;    // 16 rope dims per wave: one k-step
// Q.K: a lane takes 16 consecutive elements of its row per chunk of 64, 4 per k-step.
constexpr int CHUNK = LANE_GROUPS * K_PER_LANE * LANE_GROUPS;  // 64 elements: 4 k-steps x 4 lane groups
constexpr int CHUNKS = V_DIMS / CHUNK;                         // 2 per wave
constexpr int LANE_CHUNK = CHUNK / LANE_GROUPS;                // 16 elements of one lane
constexpr int STEPS_PER_CHUNK = LANE_CHUNK / K_PER_LANE;       // 4
// P.V: lane r reads dword 16 vg + r of the wave's columns; element n of it is tile n.
constexpr int V_GROUPS = V_DIMS / (MFMA_N * ELEMS_PER_DWORD);  // 4 / 2 / 1
constexpr int V_TILES = V_GROUPS * ELEMS_PER_DWORD;            // 8 for every format
// Copies: 256-byte blocks of a stage, COPIES per wave (mxfp4 rounded up: 18 -> 20 blocks).
constexpr int STAGE_KV_BYTES = TILE * ROW_BYTES;
constexpr int COPIES = (STAGE_KV_BYTES / 256 + WAVES - 1) / WAVES;
constexpr int STAGE_COPY_BYTES = COPIES * WAVES * 256;
constexpr int SCALES = D_QK / MX_BLOCK;                        // 18 E8M0 per row
constexpr int SCALE_STRIDE = 20;                               // LDS bytes per row of scales
constexpr int SCALE_LOADS = MXFP4 ? (TILE * SCALES + THREADS - 1) / THREADS : 0;  // 2 bytes per thread
constexpr int VM_PER_TILE = 1 + COPIES + SCALE_LOADS;          // vector loads a wave issues per tile
// Swizzle: units of UNIT bytes, XOR_BITS of the unit index flipped per row.
constexpr int UNIT = MXFP4 ? 8 : 16;
constexpr int XOR_BITS = KV == FORMAT_BF16 ? 3 : 2;

static_assert(THREADS == BLOCK_THREADS, "the fast kernel launches the project's block size");
static_assert(HEADS == MFMA_N, "one head per lane_col: H = 16");
static_assert(WAVES * WAVE == HEADS * TILE && HEADS / WAVES * MFMA_N == WAVE,
              "the split softmax: one score of the tile per lane, 4 heads of 16 lanes per wave");
static_assert(CHUNKS * CHUNK == V_DIMS && ROPE_DIMS == LANE_GROUPS * K_PER_LANE,
              "a wave's dims: whole chunks of latent + one rope k-step");
static_assert(V_TILES == 8 && V_GROUPS * MFMA_N * ELEMS_PER_DWORD == V_DIMS, "8 accumulator tiles per wave");
static_assert(STAGE_KV_BYTES % 256 == 0 || MXFP4, "bf16 / fp8 stages are whole copy rounds");
static_assert(ROW_BYTES % (UNIT << XOR_BITS) == 0, "the XOR stays inside the row");
static_assert(LANE_CHUNK * 4 / ELEMS_PER_DWORD % UNIT == 0 || LANE_CHUNK * 4 / ELEMS_PER_DWORD == UNIT,
              "a lane's chunk is whole units");
static_assert(MX_BLOCK % LANE_CHUNK == 0, "a lane's chunk sits in one MX block");
static_assert(!MXFP4 || SCALE_LOADS * THREADS >= TILE * SCALES, "the scale loads cover the tile's E8M0 bytes");
static_assert(VM_PER_TILE + 1 < 64, "the waits' counts fit vmcnt");

struct alignas(16) Stage {
    alignas(16) unsigned char kv[STAGE_COPY_BYTES];             // TILE rows (+ mxfp4's spare copies)
    unsigned char scale[MXFP4 ? TILE * SCALE_STRIDE : 16];      // mxfp4: [row][block] E8M0
};

struct alignas(16) Smem {
    Stage stage[STAGES];
    union {
        ScheduleSmem<THREADS> sched;                             // the block's work item (start)
        alignas(16) f32x4 red[WAVES][WAVE];                      // the waves' partial scores (tiles)
    };
    alignas(16) unsigned short pt[HEADS][TILE];                  // the tile's P (bf16), [head][D row]
    float alpha[HEADS];                                          // the tile's rescale per head
    float head_l[HEADS];                                         // the item's l per head (end)
    int last;                                                    // merge_split_row's flag
};
static_assert(sizeof(ScheduleSmem<THREADS>) <= sizeof(f32x4) * WAVES * WAVE, "the scan fits the partials");

// Token (0..15) of D row / k-slot 4 g + e of a tile: rows a 16- or 32-lane read phase
// reads together sit on different banks (see the header).
HIPMLA_DEVICE constexpr int token_step() { return MXFP4 ? 4 : 2; }
HIPMLA_DEVICE int token_base(int g) { return MXFP4 ? 2 * (g & 1) + (g >> 1) : (g & 1) + 8 * (g >> 1); }
HIPMLA_DEVICE int token_of(int x) { return token_base(x / 4) + token_step() * (x % 4); }

// Byte offset in the stage of byte `b` of row `r` (and, the XOR being an involution, the
// source byte that lands at LDS byte b of row r).
HIPMLA_DEVICE int unit_xor(int r) {
    if constexpr (KV == FORMAT_BF16) return ((r & 1) << 2) | ((r >> 1) & 3);
    if constexpr (KV == FORMAT_FP8) return (r >> 1) & 3;
    return (r >> 2) & 3;
}
HIPMLA_DEVICE int stage_offset(int r, int b) { return r * ROW_BYTES + (b ^ (unit_xor(r) * UNIT)); }

// The f32 scale of an E8M0 byte in the stage (1 for formats without block scales).
HIPMLA_DEVICE float stage_scale(const Stage& st, int r, int blk) {
    if constexpr (MXFP4) return e8m0_to_f32(st.scale[r * SCALE_STRIDE + blk]);
    return 1.0f;
}

// ELEMS_PER_DWORD values of one KV dword as f32 (exact), element order; MXFP4 times its
// block scale. Not for bf16, whose words are operands already.
template <int F = KV>
HIPMLA_DEVICE void dword_to_f32(unsigned w, float scale, float* out) {
    static_assert(F != FORMAT_BF16, "bf16 words need no conversion");
    if constexpr (F == FORMAT_FP8) {
        const f32x2 lo = fp8x2_to_f32<false>(w), hi = fp8x2_to_f32<true>(w);
        out[0] = lo.x; out[1] = lo.y; out[2] = hi.x; out[3] = hi.y;
    } else {
        e2m1x8_to_f32_scaled(w, scale, out);
    }
}

// `n` elements of row `r` starting at element e0 (n / ELEMS_PER_DWORD dwords, one read) as
// bf16 pairs: n = 16 for a Q.K chunk (8 pairs), 4 for the rope k-step (2 pairs).
template <int N>
HIPMLA_DEVICE void k_pairs(const Stage& st, int r, int e0, unsigned* dw) {
    constexpr int DWORDS = N / ELEMS_PER_DWORD;
    const int b = e0 * 4 / ELEMS_PER_DWORD;
    if constexpr (KV == FORMAT_BF16) {
        // 32 bytes = two units: each is read from its own (XOR-permuted) place.
#pragma unroll
        for (int u = 0; u < DWORDS; u += 4) {
            const int bu = b + 4 * u;
            if constexpr (DWORDS >= 4) {
                const u32x4 a = *reinterpret_cast<const u32x4*>(st.kv + stage_offset(r, bu));
                dw[u] = a.x; dw[u + 1] = a.y; dw[u + 2] = a.z; dw[u + 3] = a.w;
            } else {
                const u32x2 a = *reinterpret_cast<const u32x2*>(st.kv + stage_offset(r, bu));
                dw[u] = a.x; dw[u + 1] = a.y;
            }
        }
    } else {
        unsigned w[DWORDS > 0 ? DWORDS : 1];
        if constexpr (N == LANE_CHUNK && KV == FORMAT_FP8) {
            const u32x4 a = *reinterpret_cast<const u32x4*>(st.kv + stage_offset(r, b));
            w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        } else if constexpr (N == LANE_CHUNK) {
            const u32x2 a = *reinterpret_cast<const u32x2*>(st.kv + stage_offset(r, b));
            w[0] = a.x; w[1] = a.y;
        } else if constexpr (KV == FORMAT_FP8) {
            w[0] = *reinterpret_cast<const unsigned*>(st.kv + stage_offset(r, b));
        } else {
            w[0] = *reinterpret_cast<const unsigned short*>(st.kv + stage_offset(r, b));
        }
        const float scale = stage_scale(st, r, e0 / MX_BLOCK);
        float f[N > ELEMS_PER_DWORD ? N : ELEMS_PER_DWORD];
#pragma unroll
        for (int d = 0; d < (N + ELEMS_PER_DWORD - 1) / ELEMS_PER_DWORD; ++d)
            dword_to_f32(w[d], scale, f + d * ELEMS_PER_DWORD);
#pragma unroll
        for (int k = 0; k < N / 2; ++k) dw[k] = bf16_pair_exact(f[2 * k], f[2 * k + 1]);
    }
}

// Element offsets of this lane's Q.K operands: chunk j (16 elements) and the rope k-step.
HIPMLA_DEVICE int chunk_elem(int w, int j, int g) { return V_DIMS * w + CHUNK * j + LANE_CHUNK * g; }
HIPMLA_DEVICE int rope_elem(int w, int g) { return D_V + ROPE_DIMS * w + K_PER_LANE * g; }

// This lane's Q^T operand (head lane_col, the dims chunk_elem / rope_elem give), straight
// from global memory into the registers it keeps for the item.
struct QSlice {
    u32x4 c[CHUNKS][2];
    u32x2 rope;
};
// A slot from `heads` on (row_heads: below 16 heads) reads head 0's row and keeps zeros.
HIPMLA_DEVICE QSlice load_q(const MlaDecodeParams& p, int row, int heads, int w) {
    const bool present = lane_col() < heads;
    const unsigned short* q =
        static_cast<const unsigned short*>(p.q) + head_index(p, row, present ? lane_col() : 0) * D_QK;
    const u32x4 z4 = {0u, 0u, 0u, 0u};
    QSlice s;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        const u32x4* src = reinterpret_cast<const u32x4*>(q + chunk_elem(w, j, lane_rowgroup()));
        s.c[j][0] = present ? src[0] : z4;
        s.c[j][1] = present ? src[1] : z4;
    }
    const u32x2 rope = *reinterpret_cast<const u32x2*>(q + rope_elem(w, lane_rowgroup()));
    s.rope = present ? rope : u32x2{0u, 0u};
    return s;
}

// S^T_w of the tile in `st`: D[4g + i][h] = k_{token_of(4g + i)} . q_h over wave w's dims.
HIPMLA_DEVICE f32x4 partial_scores(const Stage& st, const QSlice& q, int w) {
    const int r = token_of(lane_col());  // A row lane_col = this token's row
    const int g = lane_rowgroup();
    f32x4 d = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        unsigned dw[8];
        k_pairs<LANE_CHUNK>(st, r, chunk_elem(w, j, g), dw);
        const u32x2 qs[STEPS_PER_CHUNK] = {{q.c[j][0].x, q.c[j][0].y}, {q.c[j][0].z, q.c[j][0].w},
                                           {q.c[j][1].x, q.c[j][1].y}, {q.c[j][1].z, q.c[j][1].w}};
#pragma unroll
        for (int i = 0; i < STEPS_PER_CHUNK; ++i) d = mfma_bf16_16x16x16(u32x2{dw[2 * i], dw[2 * i + 1]}, qs[i], d);
    }
    unsigned rp[2];
    k_pairs<K_PER_LANE>(st, r, rope_elem(w, g), rp);
    return mfma_bf16_16x16x16(u32x2{rp[0], rp[1]}, q.rope, d);
}

// acc[vg * ELEMS_PER_DWORD + n] += V^T P^T over the tile in `st`: D row x of that tile is
// value column V_DIMS w + ELEMS_PER_DWORD (16 vg + x) + n, D column the head lane_col.
// `pt` is P^T as this lane's bf16 pairs (k-slots 4 g + 0..3).
HIPMLA_DEVICE void tile_pv(const Stage& st, int w, u32x2 pt, f32x4* acc) {
    const int c = lane_col();
    const int g = lane_rowgroup();
#pragma unroll
    for (int vg = 0; vg < V_GROUPS; ++vg) {
        const int word = V_DIMS * w / ELEMS_PER_DWORD + MFMA_N * vg + c;
        unsigned wd[K_PER_LANE];
#pragma unroll
        for (int e = 0; e < K_PER_LANE; ++e)
            wd[e] = *reinterpret_cast<const unsigned*>(st.kv + stage_offset(token_of(4 * g + e), 4 * word));
        if constexpr (KV == FORMAT_BF16) {
            acc[2 * vg] = mfma_bf16_16x16x16(u32x2{pick_halves<true>(wd[0], wd[1]), pick_halves<true>(wd[2], wd[3])}, pt,
                                             acc[2 * vg]);
            acc[2 * vg + 1] = mfma_bf16_16x16x16(
                u32x2{pick_halves<false>(wd[0], wd[1]), pick_halves<false>(wd[2], wd[3])}, pt, acc[2 * vg + 1]);
        } else {
            float f[K_PER_LANE][ELEMS_PER_DWORD];
#pragma unroll
            for (int e = 0; e < K_PER_LANE; ++e)
                dword_to_f32(wd[e], stage_scale(st, token_of(4 * g + e), word * ELEMS_PER_DWORD / MX_BLOCK), f[e]);
#pragma unroll
            for (int n = 0; n < ELEMS_PER_DWORD; ++n) {
                const u32x2 a = {bf16_pair_exact(f[0][n], f[1][n]), bf16_pair_exact(f[2][n], f[3][n])};
                acc[vg * ELEMS_PER_DWORD + n] = mfma_bf16_16x16x16(a, pt, acc[vg * ELEMS_PER_DWORD + n]);
            }
        }
    }
}

// Output column of accumulator tile `tile`, D row 4 g + i, of wave w.
HIPMLA_DEVICE int value_column(int w, int tile, int g, int i) {
    return V_DIMS * w + ELEMS_PER_DWORD * (MFMA_N * (tile / ELEMS_PER_DWORD) + K_PER_LANE * g + i) +
           tile % ELEMS_PER_DWORD;
}

// The item's tiles as the copies see them: the token a lane's page-table read is for
// (lane l: token l % 16 of tile u, clamped to the item's last), and the row it gives.
struct ItemRows {
    KvRows kv;
    const int* anchor;  // a readable int for KvRows::entry on a contiguous cache
    int begin, last;

    HIPMLA_DEVICE int token(int u) const {
        const int t = begin + TILE * u + lane_id() % TILE;
        return t < last ? t : last;
    }
    HIPMLA_DEVICE int entry(int u) const { return kv.entry(token(u), anchor); }
    // The row of this lane's token of tile u, in 32 bits (arch/cdna.h QuarterRows: rows of
    // any cache that fits a device do).
    HIPMLA_DEVICE unsigned row(int u, int entry) const { return unsigned(kv.row_at(token(u), entry)); }
};

// Wave w's copies of a tile: copy c moves the 256 stage bytes of block 4 c + w, lane l the
// dword at byte 4 l of it, i.e. byte b of stage row r, from byte b ^ XOR of the cache row
// of token r. The (r, b ^ XOR) of each copy are the same every tile: made once per lane
// (copy_map, 16 + 16 bits) and held across the loop. Spare blocks past the tile (mxfp4)
// copy the tile's first dword again.
struct CopyMap {
    unsigned at[COPIES];  // (stage row r) << 16 | source byte within the row
};
HIPMLA_DEVICE CopyMap copy_map(int w) {
    CopyMap m;
#pragma unroll
    for (int c = 0; c < COPIES; ++c) {
        const int at = 256 * (WAVES * c + w) + 4 * lane_id();
        const bool spare = MXFP4 && at >= STAGE_KV_BYTES;
        const int r = spare ? 0 : at / ROW_BYTES;
        const int src = spare ? 0 : (at % ROW_BYTES) ^ (unit_xor(r) * UNIT);
        m.at[c] = unsigned(r) << 16 | unsigned(src);
    }
    return m;
}

// The cache rows of a tile's copies come from `mine` (lane r: the row of token r) by
// ds_bpermute, all of them before the first copy so the exchanges pipeline.
HIPMLA_DEVICE void issue_copies(Stage& st, const MlaDecodeParams& p, unsigned mine, const CopyMap& m, int w) {
    const unsigned char* kv = static_cast<const unsigned char*>(p.kv);
    unsigned row[COPIES];
#pragma unroll
    for (int c = 0; c < COPIES; ++c) row[c] = lane_read(mine, int(m.at[c] >> 16));
#pragma unroll
    for (int c = 0; c < COPIES; ++c)
        gather_256_to_lds(kv + (unsigned long long)row[c] * ROW_BYTES + (m.at[c] & 0xffffu),
                          st.kv + 256 * (WAVES * c + w));
}

// MXFP4: this thread's E8M0 bytes of a tile (thread k: bytes k and k + 256 of the tile's
// 16 x 18, the second a repeat of the first where it is past them), loaded with the
// tile's copies and stored to its stage at the end of the tile in which they were issued.
struct ScaleBytes {
    unsigned b[SCALE_LOADS > 0 ? SCALE_LOADS : 1];
};
HIPMLA_DEVICE int scale_index(int k) {
    const int i = int(thread_index()) + THREADS * k;
    return i < TILE * SCALES ? i : int(thread_index());
}
HIPMLA_DEVICE ScaleBytes load_scales(const MlaDecodeParams& p, unsigned mine) {
    ScaleBytes s;
#pragma unroll
    for (int k = 0; k < SCALE_LOADS; ++k) {
        const int i = scale_index(k);
        const long long row = (long long)lane_read(mine, i / SCALES);
        s.b[k] = p.kv_scale[row * p.stride_kv_scale + i % SCALES];
    }
    return s;
}
HIPMLA_DEVICE void store_scales(Stage& st, const ScaleBytes& s) {
#pragma unroll
    for (int k = 0; k < SCALE_LOADS; ++k) {
        const int i = scale_index(k);
        st.scale[(i / SCALES) * SCALE_STRIDE + i % SCALES] = (unsigned char)s.b[k];
    }
}

// Tile u's loads, in the order the waits count on: the page-table entries of tile u + 1
// (`entry`), tile u's scale bytes, then its copies (rows from `mine`). Every tile issues
// all of them, tiles past the item's end included (their tokens clamp to its last: the
// same row again, mostly from cache), so each wave issues VM_PER_TILE loads per tile and
// every wait is one constant: no branch, no merge of paths for the compiler's own waits
// to be conservative about (one that was cost a vmcnt(0) per tile). The loads are not
// waited for here: their registers are used only by the next tile's finish_issue.
HIPMLA_DEVICE ScaleBytes issue_tile(Stage& dst, const MlaDecodeParams& p, const ItemRows& rows, int u, unsigned mine,
                                    const CopyMap& m, int& entry, int w) {
    keep_issue_order();
    entry = rows.entry(u + 1);
    keep_issue_order();
    ScaleBytes s = {};
    if constexpr (MXFP4) s = load_scales(p, mine);
    keep_issue_order();
    issue_copies(dst, p, mine, m, w);
    keep_issue_order();
    return s;
}

// Tile u's issue finished, at the top of the tile before it: its scale bytes go to the
// stage and tile u + 1's rows are formed from their entries. Both wait (the compiler's
// vmcnt) for all but tile u's copies. The entry is kept as loaded (keep_loaded): a
// contiguous cache does not use its value, and a load the compiler drops would leave
// every count one short (one of a tile's copies still in flight at its wait).
HIPMLA_DEVICE unsigned finish_issue(Stage& dst, const ItemRows& rows, int u, const ScaleBytes& s, int entry) {
    if constexpr (MXFP4) store_scales(dst, s);
    keep_loaded(entry);
    return rows.row(u + 1, entry);
}

}  // namespace fast942
}  // namespace hipmla

HIPMLA_KERNEL(hipmla::fast942::THREADS) void HIPMLA_FAST_NAME(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::gfx942;
    using namespace hipmla::fast942;
    HIPMLA_SHARED Smem smem;

    const WorkItem it = schedule_item<THREADS, HEADS>(p, int(block_index()), smem.sched);
    // p.fast_tile = 0: every item (any length, empty and bad ones too). p.fast_tile > 0:
    // only the items split.hip skips (valid, whole fast tiles).
    if (it.seq < 0 || (p.fast_tile > 0 && !it.fast)) return;
    // An item with invalid device-side input reads no KV and writes NaN (below).
    const int n_tokens = it.bad ? 0 : it.end - it.begin;
    const int row = it.row;  // its q, out and lse: 16 heads of one query token (or fewer, of several)
    const int present = row_heads(p, it);
    const int n_tiles = (n_tokens + TILE - 1) / TILE;  // the last one may be partial
    const int slot = it.n_items > 1 ? it.slot : -1;
    const int w = wave_id();
    const int lane = lane_id();
    const int h = lane_col();
    const int g = lane_rowgroup();
    const ItemRows rows{kv_rows(p, it.seq), p.kv_indptr + it.seq, it.begin, it.begin + n_tokens - 1};
    // fp8: the tensor scale stays out of the products (split.hip's order: c * scale first).
    const float score_scale = KV == FORMAT_FP8 ? p.sm_scale_log2 * p.kv_fp8_scale : p.sm_scale_log2;
    const float value_scale = KV == FORMAT_FP8 ? p.kv_fp8_scale : 1.0f;


    // The softmax is split over the waves: wave w owns heads 4 w .. 4 w + 3, a lane one
    // score of the tile: head my_head, D row my_row (token token_of(my_row)), which the
    // partials hold at lane my_head + 16 (my_row / 4), element my_row % 4.
    const int my_head = 4 * w + lane / MFMA_N;
    const int my_row = lane % MFMA_N;
    // Compared `cut` tokens later where my_head, of an earlier query token of a row of
    // several, sees that many fewer of the item (slot_tokens), so `valid` stays wave-uniform.
    const int my_token = token_of(my_row) + (n_tokens - slot_tokens(p, it, my_head));
    const float* my_partial =
        reinterpret_cast<const float*>(&smem.red[0][my_head + MFMA_N * (my_row / 4)]) + my_row % 4;
    float m_run = running_max_start();  // head my_head, log2 units
    float l_lane = 0.0f;                // head my_head, this lane's tokens
    f32x4 acc[V_TILES];
#pragma unroll
    for (int t = 0; t < V_TILES; ++t) acc[t] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};

    // An empty or bad item reads nothing (its tokens would clamp to no row).
    if (n_tiles > 0) {
        // Q first, then the ring's first two tiles. Q's loads are on the only path into the
        // loop, and the prologue's finish_issue waits for all but tile 0's copies, so the
        // compiler knows Q's registers have landed when the loop starts (with Q's loads still
        // pending on some path into it, it waited for them every tile, vmcnt(13) in fp8, behind
        // the next tile's copies).
        const QSlice q = load_q(p, row, present, w);
        const CopyMap map = copy_map(w);
        int entry = 0;
        unsigned mine = rows.row(0, rows.entry(0));  // this lane's row of the next tile to issue
        ScaleBytes sb = issue_tile(smem.stage[0], p, rows, 0, mine, map, entry, w);
        mine = finish_issue(smem.stage[0], rows, 0, sb, entry);
        sb = issue_tile(smem.stage[1], p, rows, 1, mine, map, entry, w);

        for (int tile = 0; tile < n_tiles; ++tile) {
            Stage& st = smem.stage[tile % STAGES];
            Stage& refill = smem.stage[(tile + STAGES - 1) % STAGES];  // tile + 2's
            // Tile + 1's loads but its copies have landed (its scale bytes go to its stage, the
            // rows of tile + 2 are formed), and with them this wave's copies of this tile,
            // issued before them: the younger loads are tile + 1's copies alone.
            mine = finish_issue(smem.stage[(tile + 1) % STAGES], rows, tile + 1, sb, entry);
            wait_vm<COPIES>();
            // Every wave's copies of this tile have landed, and every wave is done with tile
            // - 1 (its stage, refilled next, and the partial scores).
            lds_barrier();
            sb = issue_tile(refill, p, rows, tile + STAGES - 1, mine, map, entry, w);

            smem.red[w][lane] = partial_scores(st, q, w);
            lds_barrier();
            // This lane's score: the four waves' partials added in wave order.
            float s = my_partial[0];
    #pragma unroll
            for (int k = 1; k < WAVES; ++k) s += my_partial[k * WAVE * 4];
            // Tokens of this tile before the item's end (wave-uniform; 16 but on the last tile).
            const int valid = n_tokens - TILE * tile;
            s = masked_score(s * score_scale, my_token, 0, valid);
            const float m_new = __builtin_fmaxf(m_run, max_over_cols(s));
            const float alpha = exp2_f32(m_run - m_new);
            m_run = m_new;
            const unsigned bits = f32_to_bf16_bits(exp2_f32(s - m_new));
            l_lane = l_lane * alpha + bf16_to_f32(bits);
            smem.pt[my_head][my_row] = (unsigned short)bits;
            if (my_row == 0) smem.alpha[my_head] = alpha;
            lds_barrier();
            // P^T as this lane's B operand (head h, D rows 4 g .. 4 g + 3) and head h's alpha.
            const u32x2 pt = *reinterpret_cast<const u32x2*>(&smem.pt[h][K_PER_LANE * g]);
            const float a = smem.alpha[h];
            // As a real (a, a) register pair: with a alone clang fed v_pk_mul_f32 a pair whose
            // other half held MXFP4's scale byte in flight, so the rescale waited for that load.
            f32x2 a2 = {a, a};
            opaque_pair(a2);
    #pragma unroll
            for (int t = 0; t < V_TILES; ++t) {
                acc[t].xy *= a2;
                acc[t].zw *= a2;
            }
            tile_pv(st, w, pt, acc);
        }
        // The loads issued for the two tiles past the end land before the block leaves (they
        // write LDS).
        wait_vm<0>();
    }

    // Head my_head's state: m_run, and l over its 16 lanes.
    float big_m = m_run;
    float big_l = sum_over_cols(l_lane);
    float weight = value_scale;
    if (it.bad) {  // NaN partial or output: the merge turns it into NaN for the sequence
        const float nan = f32_from_bits(0x7fc00000u);
        big_m = nan;
        big_l = nan;
        weight = nan;  // every accumulator cell becomes NaN
    }
    // An empty item (an empty sequence: one item, slot < 0) has big_l = 0 and acc = 0:
    // dividing by 1 gives its output 0, and its LSE is -inf. NaN stays NaN.
    if (my_row == 0) {
        smem.head_l[my_head] = big_l;
        if (slot >= 0) {
            p.part_ml[(slot * HEADS + my_head) * 2] = big_m;
            p.part_ml[(slot * HEADS + my_head) * 2 + 1] = big_l;
        } else if (p.lse != nullptr && my_head < present) {
            p.lse[head_index(p, row, my_head)] =
                big_l <= 0.0f ? f32_from_bits(0xff800000u) : (big_m + log2_f32(big_l)) * 0.6931471805599453f;
        }
    }
    lds_barrier();
    const float l_h = smem.head_l[h];  // head h's l, for this lane's outputs
    const float denom = l_h <= 0.0f ? 1.0f : l_h;
    // Tiles vg * E + 0..E-1 at D row 4 g + i are E adjacent columns of head h.
#pragma unroll
    for (int vg = 0; vg < V_GROUPS; ++vg) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = value_column(w, vg * ELEMS_PER_DWORD, g, i);
            float v[ELEMS_PER_DWORD];
#pragma unroll
            for (int n = 0; n < ELEMS_PER_DWORD; ++n) v[n] = acc[vg * ELEMS_PER_DWORD + n][i] * weight;
            if (slot >= 0) {
                float* dst = p.part_acc + ((long long)slot * HEADS + h) * D_V + col;
#pragma unroll
                for (int n = 0; n < ELEMS_PER_DWORD; n += 2) *reinterpret_cast<f32x2*>(dst + n) = f32x2{v[n], v[n + 1]};
            } else if (h < present) {
                unsigned* dst = reinterpret_cast<unsigned*>(static_cast<unsigned short*>(p.out) +
                                                            head_index(p, row, h) * D_V + col);
#pragma unroll
                for (int n = 0; n < ELEMS_PER_DWORD; n += 2) dst[n / 2] = pack_bf16x2(v[n] / denom, v[n + 1] / denom);
            }
        }
    }
    // A bad item's error bits: here, where nothing else is live.
    report_bad_item(p, it);
    // A split row: its items merge the slots (core/merge.h: shares of the columns, or the
    // last to finish all of them when this kernel runs beside split.hip).
    if (slot >= 0) merge_split_row<THREADS>(p, it, &smem.last);
}
