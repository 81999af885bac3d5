// Split-KV decode, the portable kernel: block i of the grid runs work item i of the
// device-side schedule (core/schedule.h) -- Q.K, the tiled online softmax and P.V for
// all heads over the item's token range -- then writes the normalised output + LSE (a
// sequence of one item) or its partial; the last item of a split sequence to finish
// merges the sequence's partials (core/merge.h). Numerics: hip_src/KERNELS.md.
//
// Specialisation (all required):
//   HIPMLA_KV_FORMAT    0 bf16, 1 fp8, 2 mxfp4   (hip_src/common/config.h)
//   HIPMLA_Q_PRECISION  0 bf16, 1 fp8, 2 mxfp4
//   HIPMLA_FP8_FNUZ     0 e4m3fn (gfx950, NVIDIA), 1 e4m3fnuz (gfx942)
//
// Block layout (BLOCK_THREADS = 256, any warp width). Shared memory holds Q (bf16, after
// the block's own quantization), one 288-byte slab of each of the tile's 64 KV rows, and
// the tile's scores. Per tile:
//   Q.K   thread = (token j = tid % 64, heads 4g..4g+3 with g = tid / 64); K is staged
//         slab by slab (bf16 4, fp8 2, mxfp4 1 slabs per row), so every thread keeps its
//         4 scores in registers and no cross-thread sum is needed.
//   max   thread = (head h = tid / 16, tokens i, i+16, i+32, i+48 with i = tid % 16);
//         it also owns head h's running max and a sixteenth of its running sum.
//   P.V   thread = (4-byte column group c = tid % 64 of a 256-byte V slab, heads 4g..);
//         V is restaged in 256-byte slabs (bf16 4, fp8 2; for mxfp4 the whole row is
//         already resident), so each thread owns 32 accumulators for the whole range.
// Rows come from core/paged.h, so a paged cache and a contiguous one run the same code.
// Below 16 heads a row holds several query tokens (core/schedule.h, row_heads): Q.K gives
// each head's tokens past its own query token's causal bound (slot_tokens) score -inf, and
// the running max starts at -FLT_MAX (running_max_start) for a head that sees none of a tile.
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/merge.h"
#include "core/paged.h"
#include "core/schedule.h"

#if !defined(HIPMLA_KV_FORMAT) || !defined(HIPMLA_Q_PRECISION) || !defined(HIPMLA_FP8_FNUZ)
#error "split.hip needs -DHIPMLA_KV_FORMAT=<0|1|2> -DHIPMLA_Q_PRECISION=<0|1|2> -DHIPMLA_FP8_FNUZ=<0|1>"
#endif

// The kernel symbol names its specialisation: hipmla_decode_split_<kv>_q<qp>.
#if HIPMLA_KV_FORMAT == 0
#define HIPMLA_KV_NAME bf16
#elif HIPMLA_KV_FORMAT == 1
#define HIPMLA_KV_NAME fp8
#elif HIPMLA_KV_FORMAT == 2
#define HIPMLA_KV_NAME mxfp4
#else
#error "HIPMLA_KV_FORMAT must be 0 (bf16), 1 (fp8) or 2 (mxfp4)"
#endif
#if HIPMLA_Q_PRECISION == 0
#define HIPMLA_Q_NAME qbf16
#elif HIPMLA_Q_PRECISION == 1
#define HIPMLA_Q_NAME qfp8
#elif HIPMLA_Q_PRECISION == 2
#define HIPMLA_Q_NAME qmxfp4
#else
#error "HIPMLA_Q_PRECISION must be 0 (bf16), 1 (fp8) or 2 (mxfp4)"
#endif
#define HIPMLA_CAT3(a, b, c) a##b##_##c
#define HIPMLA_SPLIT_SYMBOL(kv, q) HIPMLA_CAT3(hipmla_decode_split_, kv, q)
#define HIPMLA_SPLIT_NAME HIPMLA_SPLIT_SYMBOL(HIPMLA_KV_NAME, HIPMLA_Q_NAME)

namespace hipmla {
namespace split {

constexpr int KV = HIPMLA_KV_FORMAT;
constexpr int QP = HIPMLA_Q_PRECISION;
constexpr bool FNUZ = HIPMLA_FP8_FNUZ != 0;

constexpr int BITS = KV == FORMAT_BF16 ? 16 : KV == FORMAT_FP8 ? 8 : 4;  // per KV element
constexpr int ROW_BYTES = D_QK * BITS / 8;
constexpr int ELEMS_PER_WORD = 32 / BITS;

constexpr int SLAB_BYTES = 288;                      // staged bytes per row for Q.K
constexpr int SLAB_ELEMS = SLAB_BYTES * 8 / BITS;
constexpr int K_SLABS = ROW_BYTES / SLAB_BYTES;
constexpr int CHUNKS = SLAB_BYTES / 16;              // 16-byte loads per row and slab
constexpr int CHUNK_ELEMS = 16 * 8 / BITS;
constexpr int V_SLAB_BYTES = 256;                    // staged bytes per row for P.V
constexpr int V_SLAB_ELEMS = V_SLAB_BYTES * 8 / BITS;
constexpr int V_SLABS = D_V / V_SLAB_ELEMS;
constexpr int V_PER_THREAD = ELEMS_PER_WORD;         // one word of each V slab per thread
constexpr bool V_RESIDENT = K_SLABS == 1;            // the staged K slab already holds V

// 16 bytes of padding per row move the row starts 4 banks apart, so the 16-byte reads
// of 8 consecutive rows at one column hit distinct banks.
constexpr int ROW_STRIDE = SLAB_BYTES + 16;
constexpr int SCALE_STRIDE = 20;                     // 18 scales per row; odd word stride
constexpr int SCALES = D_QK / MX_BLOCK;

constexpr int HEADS_PER_THREAD = 4;
constexpr int HEAD_GROUPS = HEADS / HEADS_PER_THREAD;
constexpr int MAX_LANES = BLOCK_THREADS / HEADS;     // threads per head in the max phase
constexpr int ACC = V_SLABS * V_PER_THREAD;          // accumulators per head and thread

static_assert(ROW_BYTES % SLAB_BYTES == 0, "K slabs must tile a row");
static_assert(D_V % V_SLAB_ELEMS == 0 && V_SLAB_BYTES / 4 == TILE_TOKENS, "V slab: one word per column thread");
static_assert(TILE_TOKENS * HEAD_GROUPS == BLOCK_THREADS, "Q.K: one thread per token and head group");
static_assert(MAX_LANES * 4 == TILE_TOKENS, "max phase: four tokens per thread");
static_assert(CHUNK_ELEMS % 8 == 0 && (KV != FORMAT_MXFP4 || CHUNK_ELEMS == MX_BLOCK),
              "a 16-byte mxfp4 chunk is one scale block");

struct alignas(16) Smem {
    alignas(16) unsigned short q[HEADS * D_QK];      // bf16 bits
    alignas(16) unsigned char kv[TILE_TOKENS * ROW_STRIDE];
    alignas(16) float score[TILE_TOKENS * HEADS];    // [token][head]: scores, then p
    unsigned char scale[KV == FORMAT_MXFP4 ? TILE_TOKENS * SCALE_STRIDE : 4];
    float red[HEADS * MAX_LANES];                    // [head][lane]: tile maxima, later l parts
    float alpha[HEADS];
    float l[HEADS];
    ScheduleSmem<BLOCK_THREADS> sched;
    int last;
};

// The KV element values of one 32-bit word, in memory order, as the dot products use
// them: bf16 and fp8 exactly; mxfp4 as twice the E2M1 value (the block's half-scale is
// applied to the sum, which is exact because it is a power of two).
HIPMLA_DEVICE void decode_word(unsigned w, float* out) {
    if (KV == FORMAT_BF16) {
        out[0] = f32_from_bits(w << 16);
        out[1] = f32_from_bits(w & 0xffff0000u);
    } else if (KV == FORMAT_FP8) {
#pragma unroll
        for (int b = 0; b < 4; ++b) out[b] = fp8_to_f32<FNUZ>((w >> (8 * b)) & 0xffu);
    } else {
#pragma unroll
        for (int n = 0; n < 8; ++n) out[n] = e2m1_twice((w >> (4 * n)) & 0xfu);
    }
}

// Copies bytes [byte0, byte0 + 16 * chunks) of the KV rows of tokens token0 .. token0 +
// rows - 1 into the slab buffer with coalesced 16-byte loads.
HIPMLA_DEVICE void stage_slab(Smem& sm, const MlaDecodeParams& p, KvRows kv, int token0, int rows,
                              int byte0, int chunks) {
    const unsigned char* base = static_cast<const unsigned char*>(p.kv) + byte0;
    for (int c = int(thread_index()); c < rows * chunks; c += BLOCK_THREADS) {
        const int r = c / chunks;
        const int x = c - r * chunks;
        const u32x4 v = *reinterpret_cast<const u32x4*>(base + kv.row(token0 + r) * ROW_BYTES + 16 * x);
        *reinterpret_cast<u32x4*>(sm.kv + r * ROW_STRIDE + 16 * x) = v;
    }
}

HIPMLA_DEVICE void stage_scales(Smem& sm, const MlaDecodeParams& p, KvRows kv, int token0, int rows) {
    for (int c = int(thread_index()); c < rows * SCALES; c += BLOCK_THREADS) {
        const int r = c / SCALES;
        const int x = c - r * SCALES;
        sm.scale[r * SCALE_STRIDE + x] = p.kv_scale[kv.row(token0 + r) * p.stride_kv_scale + x];
    }
}

// Q of the row into shared memory, quantized in place when QP asks for it.
HIPMLA_DEVICE void load_q(Smem& sm, const MlaDecodeParams& p, int row, int heads) {
    constexpr int chunks = HEADS * D_QK * 2 / 16;
    constexpr int head_chunks = D_QK * 2 / 16;
    // The row's query heads (row_heads), zeros for the rest of the 16.
    const int present = heads * head_chunks;
    const u32x4* src = static_cast<const u32x4*>(p.q) + head_index(p, row, 0) * head_chunks;
    for (int c = int(thread_index()); c < chunks; c += BLOCK_THREADS) {
        reinterpret_cast<u32x4*>(sm.q)[c] = c < present ? src[c] : u32x4{0u, 0u, 0u, 0u};
    }
    if (QP == FORMAT_BF16) return;
    block_sync();
    // The tiles' KV stage is free until the first tile: it holds the blocks' exponents.
    static_assert(sizeof(sm.kv) >= Q_BLOCKS, "the exponents fit the KV stage");
    mx_quantize_q_row_bf16<QP, FNUZ, BLOCK_THREADS>(sm.q, reinterpret_cast<signed char*>(sm.kv), int(thread_index()));
}

// Adds this slab's part of q_h . k_j for the thread's token and 4 heads to `s`
// (raw units: fp8 without its tensor scale, mxfp4 with its block scales).
HIPMLA_DEVICE void qk_slab(const Smem& sm, int slab, int j, int g, float* s) {
    const unsigned char* row = sm.kv + j * ROW_STRIDE;
    for (int i = 0; i < CHUNKS; ++i) {
        const u32x4 chunk = *reinterpret_cast<const u32x4*>(row + 16 * i);
        const unsigned words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
        const int d0 = slab * SLAB_ELEMS + i * CHUNK_ELEMS;
        float part[HEADS_PER_THREAD] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int piece = 0; piece < CHUNK_ELEMS / 8; ++piece) {
            float k[8];
#pragma unroll
            for (int w = 0; w < 8 / ELEMS_PER_WORD; ++w) decode_word(words[piece * 8 / ELEMS_PER_WORD + w], k + w * ELEMS_PER_WORD);
#pragma unroll
            for (int h = 0; h < HEADS_PER_THREAD; ++h) {
                const u32x4 q = *reinterpret_cast<const u32x4*>(sm.q + (g * HEADS_PER_THREAD + h) * D_QK + d0 + 8 * piece);
                const unsigned qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    part[h] += f32_from_bits(qw[e] << 16) * k[2 * e];
                    part[h] += f32_from_bits(qw[e] & 0xffff0000u) * k[2 * e + 1];
                }
            }
        }
        const float block_scale = KV == FORMAT_MXFP4 ? e8m0_half(sm.scale[j * SCALE_STRIDE + slab * (SLAB_ELEMS / MX_BLOCK) + i]) : 1.0f;
#pragma unroll
        for (int h = 0; h < HEADS_PER_THREAD; ++h) s[h] += part[h] * block_scale;
    }
}

// acc[h][slab * V_PER_THREAD + e] += p[j][h] * v[j][col] for the tokens of the tile.
HIPMLA_DEVICE void pv_slab(const Smem& sm, int slab, int rows, int c, int g, float (*acc)[ACC]) {
    for (int j = 0; j < rows; ++j) {
        const unsigned w = *reinterpret_cast<const unsigned*>(sm.kv + j * ROW_STRIDE + 4 * c);
        const f32x4 p4 = *reinterpret_cast<const f32x4*>(sm.score + j * HEADS + g * HEADS_PER_THREAD);
        float pj[HEADS_PER_THREAD] = {p4.x, p4.y, p4.z, p4.w};
        if (KV == FORMAT_MXFP4) {
            // 8 columns per thread: one scale block holds 4 threads' columns.
            const float half = e8m0_half(sm.scale[j * SCALE_STRIDE + c * V_PER_THREAD / MX_BLOCK]);
#pragma unroll
            for (int h = 0; h < HEADS_PER_THREAD; ++h) pj[h] *= half;
        }
        float v[V_PER_THREAD];
        decode_word(w, v);
#pragma unroll
        for (int h = 0; h < HEADS_PER_THREAD; ++h) {
#pragma unroll
            for (int e = 0; e < V_PER_THREAD; ++e) acc[h][slab * V_PER_THREAD + e] += pj[h] * v[e];
        }
    }
}

}  // namespace split
}  // namespace hipmla

HIPMLA_KERNEL(hipmla::BLOCK_THREADS) void HIPMLA_SPLIT_NAME(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::split;
    HIPMLA_SHARED Smem sm;

    const int tid = int(thread_index());
    const WorkItem it = schedule_item<BLOCK_THREADS, HEADS>(p, int(block_index()), sm.sched);
    // No item for this block, or whole fast tiles, which the arch's fast kernel runs.
    if (it.seq < 0 || it.fast) return;
    // An item with invalid device-side input reads nothing and writes NaN (below).
    report_bad_item(p, it);
    const int n_tokens = it.bad ? 0 : it.end - it.begin;
    const int seq = it.seq;  // its kv rows
    const int row = it.row;  // its q, out and lse: 16 heads of one query token (or fewer, of several)
    const int present = row_heads(p, it);
    const int token_begin = it.begin;
    const int slot = it.n_items > 1 ? it.slot : -1;
    const KvRows kv = kv_rows(p, seq);

    // Q.K and P.V roles: token / column group and head group.
    const int lane64 = tid % TILE_TOKENS;
    const int g = tid / TILE_TOKENS;
    // Max-phase role: head and lane within the head.
    const int mh = tid / MAX_LANES;
    const int mi = tid % MAX_LANES;
    // Tokens of the item each of the thread's Q.K heads sees (n_tokens but for an earlier
    // query token of a row of several).
    int head_tokens[HEADS_PER_THREAD];
#pragma unroll
    for (int h = 0; h < HEADS_PER_THREAD; ++h) head_tokens[h] = slot_tokens(p, it, g * HEADS_PER_THREAD + h);

    const float neg_inf = f32_from_bits(0xff800000u);
    const float qk_scale = p.sm_scale_log2 * (KV == FORMAT_FP8 ? p.kv_fp8_scale : 1.0f);
    float m_run = running_max_start();  // head mh, log2 units (a head may see none of a tile)
    float l_part = 0.0f;    // head mh, this thread's tokens
    float acc[HEADS_PER_THREAD][ACC];
#pragma unroll
    for (int h = 0; h < HEADS_PER_THREAD; ++h) {
#pragma unroll
        for (int e = 0; e < ACC; ++e) acc[h][e] = 0.0f;
    }

    load_q(sm, p, row, present);

    for (int t0 = 0; t0 < n_tokens; t0 += TILE_TOKENS) {
        const int rows = n_tokens - t0 < TILE_TOKENS ? n_tokens - t0 : TILE_TOKENS;
        const int token0 = token_begin + t0;

        float s[HEADS_PER_THREAD] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int slab = 0; slab < K_SLABS; ++slab) {
            block_sync();  // Q is ready / the previous slab or tile is consumed
            stage_slab(sm, p, kv, token0, rows, slab * SLAB_BYTES, CHUNKS);
            if (KV == FORMAT_MXFP4) stage_scales(sm, p, kv, token0, rows);
            block_sync();
            if (lane64 < rows) qk_slab(sm, slab, lane64, g, s);
        }
        // Tokens past the item or past what the head's query token sees: -inf, P = 0.
        const int tok = t0 + lane64;
        *reinterpret_cast<f32x4*>(sm.score + lane64 * HEADS + g * HEADS_PER_THREAD) =
            f32x4{tok < head_tokens[0] ? s[0] * qk_scale : neg_inf, tok < head_tokens[1] ? s[1] * qk_scale : neg_inf,
                  tok < head_tokens[2] ? s[2] * qk_scale : neg_inf, tok < head_tokens[3] ? s[3] * qk_scale : neg_inf};
        block_sync();

        // Q.K is done with the slab buffer: fetch the first V slab while the softmax runs.
        if (!V_RESIDENT) stage_slab(sm, p, kv, token0, rows, 0, V_SLAB_BYTES / 16);

        float st[4];
        float tile_max = neg_inf;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            st[k] = sm.score[(mi + MAX_LANES * k) * HEADS + mh];
            tile_max = st[k] > tile_max ? st[k] : tile_max;
        }
        sm.red[mh * MAX_LANES + mi] = tile_max;
        block_sync();
#pragma unroll
        for (int k = 0; k < MAX_LANES; ++k) {
            const float x = sm.red[mh * MAX_LANES + k];
            tile_max = x > tile_max ? x : tile_max;
        }
        const float m_new = m_run > tile_max ? m_run : tile_max;
        const float alpha = exp2_f32(m_run - m_new);
        float psum = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float pk = round_bf16(exp2_f32(st[k] - m_new));
            sm.score[(mi + MAX_LANES * k) * HEADS + mh] = pk;
            psum += pk;
        }
        l_part = l_part * alpha + psum;
        m_run = m_new;
        if (mi == 0) sm.alpha[mh] = alpha;
        block_sync();

#pragma unroll
        for (int h = 0; h < HEADS_PER_THREAD; ++h) {
            const float a = sm.alpha[g * HEADS_PER_THREAD + h];
#pragma unroll
            for (int e = 0; e < ACC; ++e) acc[h][e] *= a;
        }
        pv_slab(sm, 0, rows, lane64, g, acc);
#pragma unroll
        for (int slab = 1; slab < V_SLABS; ++slab) {
            block_sync();
            stage_slab(sm, p, kv, token0, rows, slab * V_SLAB_BYTES, V_SLAB_BYTES / 16);
            block_sync();
            pv_slab(sm, slab, rows, lane64, g, acc);
        }
    }

    if (it.bad) {  // NaN partial or output: the merge turns it into NaN for the sequence
        const float nan = f32_from_bits(0x7fc00000u);
        m_run = nan;
        l_part = nan;
#pragma unroll
        for (int h = 0; h < HEADS_PER_THREAD; ++h) {
#pragma unroll
            for (int e = 0; e < ACC; ++e) acc[h][e] = nan;
        }
    }

    // Running sum of each head: its sixteen parts, added in a fixed order.
    block_sync();
    sm.red[mh * MAX_LANES + mi] = l_part;
    block_sync();
    if (mi == 0) {
        float l = 0.0f;
        for (int k = 0; k < MAX_LANES; ++k) l += sm.red[mh * MAX_LANES + k];
        sm.l[mh] = l;
        if (slot >= 0) {
            p.part_ml[(slot * HEADS + mh) * 2] = m_run;
            p.part_ml[(slot * HEADS + mh) * 2 + 1] = l;
        } else if (p.lse != nullptr && mh < present) {
            // l = 0 only for an empty sequence; NaN (a bad item) stays NaN.
            p.lse[head_index(p, row, mh)] = !(l <= 0.0f) ? (m_run + log2_f32(l)) * 0.6931471805599453f : neg_inf;
        }
    }
    block_sync();

    // fp8's tensor scale was left out of P.V; it is one factor for the whole range.
    const float v_scale = KV == FORMAT_FP8 ? p.kv_fp8_scale : 1.0f;
#pragma unroll
    for (int h = 0; h < HEADS_PER_THREAD; ++h) {
        const int head = g * HEADS_PER_THREAD + h;
        const float l = sm.l[head];
#pragma unroll
        for (int slab = 0; slab < V_SLABS; ++slab) {
            const int col = slab * V_SLAB_ELEMS + lane64 * V_PER_THREAD;
#pragma unroll
            for (int e = 0; e < V_PER_THREAD; e += 2) {
                const float a0 = acc[h][slab * V_PER_THREAD + e] * v_scale;
                const float a1 = acc[h][slab * V_PER_THREAD + e + 1] * v_scale;
                if (slot >= 0) {
                    float* dst = p.part_acc + ((long long)slot * HEADS + head) * D_V + col + e;
                    *reinterpret_cast<f32x2*>(dst) = f32x2{a0, a1};
                } else if (head < present) {
                    // An empty sequence has l = 0 and acc = 0: its output is 0 (a bad one NaN).
                    const float o0 = !(l <= 0.0f) ? a0 / l : 0.0f;
                    const float o1 = !(l <= 0.0f) ? a1 / l : 0.0f;
                    unsigned* dst = static_cast<unsigned*>(p.out) + (head_index(p, row, head) * D_V + col + e) / 2;
                    *dst = pack_bf16x2(o0, o1);
                }
            }
        }
    }
    if (slot >= 0) merge_split_row<BLOCK_THREADS>(p, it, &sm.last);
}
