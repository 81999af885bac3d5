// gfx950 fast split kernel: MXFP4 KV, items of any length (a masked partial last tile),
// Q.K on the bf16 MFMA (bf16 Q, the default) or the scaled MFMA (MXFP8 / MXFP4 Q, opt-in),
// P.V on the bf16 MFMA. Launched with the same grid as
// decode/split.hip: block i derives work item i from the batch (core/schedule.h). With
// p.fast_tile = 0 it runs every item, empty and bad ones included (the decoder then
// launches no portable kernel for this variant); with p.fast_tile > 0 only the items
// split.hip skips (it.fast: whole tiles), otherwise it returns. It writes what a portable
// item writes: bf16 output + natural-log LSE for a sequence of one item, else its partial
// slot, after which the last item of the sequence to finish (whichever kernel ran it)
// merges the slots (core/merge.h). An empty item (only ever a whole empty sequence)
// writes 0 and LSE -inf; a bad item (it.bad) sets the error word, reads no KV and writes
// NaN (output, or partial: m, l and acc NaN), as split.hip does.
// Numerics: those of hip_src/KERNELS.md for the Q precision, walked in the schedule
// below; hipmla.emulate.emulate_fast_item models it ("Fast paths" in hip_src/KERNELS.md).
//
// Specialisation (all required):
//   HIPMLA_KV_FORMAT    2 (mxfp4; the only format of this kernel)
//   HIPMLA_Q_PRECISION  0 (bf16 Q as it is: K converted to bf16 by v_cvt_scalef32_pk_bf16_fp4,
//                       Q.K on v_mfma_f32_16x16x32_bf16 -- only instructions the seed kernel
//                       ran on MI355X; the decoder's default), 1 (Q as MXFP8 e4m3, fp4 x fp8
//                       scaled MFMA: its B layout is unconfirmed, opt-in) or 2 (Q as MXFP4,
//                       fp4 x fp4 scaled MFMA, as the seed ran it)
//   HIPMLA_FP8_FNUZ     0 (gfx950 fp8 is e4m3fn)
//
// Block = 4 waves. An item of n tokens is ceil(n / 128) tiles; each tile is cut in four
// 32-token quarters, quarter w to wave w. With quantized Q a wave owns two LDS buffers
// for its quarters (filled by asynchronous global -> LDS copies one tile ahead); with
// bf16 Q one, refilled as soon as the tile's P.V has read it (see Smem),
// its own online-softmax state for all 16 heads and a 16 x 512 f32 accumulator; the
// waves meet only to quantize Q at the start and to merge their states at the end.
//
// Rows come from core/paged.h, so any page size (1..128) and any page ids work: each wave
// holds its quarter's 32 rows one per lane (arch/cdna.h QuarterRows: one page-table read
// per lane, made at the end of the tile before the copy that uses them), and in each of
// a quarter's 9 1 KiB copies every lane gathers its own 16-byte chunk (copy c, lane l:
// chunk k = 64 c + l, i.e. bytes 16 (k % 18).. of the row of token k / 18, taken from
// QuarterRows by ds_bpermute), while the LDS side stays contiguous: 32 rows x 288 bytes,
// exactly as a contiguous cache would land. Lane l also loads the 9 E8M0 bytes
// 9 (l % 2).. of token l / 2's scale row, held packed in registers until they go to LDS.
// LDS: quantized Q, two buffers per wave (78,848 B, + a 16-byte stub of the bf16 Q array
// = 78,864 B); the schedule's scan and a quantized Q stage in the second buffers before
// the first prefetch, the wave merge reuses all of it at the end. bf16 Q stays in LDS of
// its own (18,688 B with padded rows), because every k-step of every tile reads it: in
// registers it would take 72 VGPRs per lane. With two buffers that was 97,536 B, one block
// per CU; with one buffer per wave it is 58,112 B, so two blocks (2 waves per SIMD) fit,
// and a wave's wait for its next quarter is meant to pass under the other block's
// compute (a PREDICTION: nothing has run on gfx950; the model counts the same bytes in
// flight per CU either way and does not charge the wave's own serial wait).
// Registers (clang-22): quantized Q 249 (fp8) / 230 (mxfp4), bf16 Q 206, so with their
// LDS two blocks (2 waves per SIMD) fit a CU in every variant. Next to the 128 accumulators and the Q operand
// (fp8 40 + 5 scales, mxfp4 20 + 5) the tile loop holds little else: its LDS reads are
// immediate offsets from a few per-lane bases, not an address register per token
// (quarter_scores, quarter_pv), and the last k-step's empty half is a select, not a branch
// that had both score groups' K (40 VGPRs) live at once (quarter_scores).
//
// Masked tail (arch/cdna.h): only the last tile may be partial. A token t of a quarter
// with t >= valid (valid = the quarter's tokens before the item's end, wave-uniform, <= 0
// for a quarter wholly past it) is copied from the row of the item's last token
// (quarter_rows clamps the row index: one v_min per quarter, so no copy leaves the item,
// the cache or the sequence's pages) and gets score -inf (masked_score: one compare and
// one select per score, 8 per lane and tile), so P = bf16(exp2(-inf - m)) = 0 exactly and
// its finite V adds exact zeros. The running max starts at -FLT_MAX (running_max_start),
// so a wave with no valid token yet keeps alpha = 1 and P = 0 instead of exp2(-inf - -inf)
// = NaN, and an empty wave merges with weight exp2(-FLT_MAX - M) = 0. An item of a few
// tokens still costs a whole tile (4 x 9 KiB of copies, mostly the same row from L2).
// Below 16 heads a row holds several query tokens (core/schedule.h, row_heads): a head of
// an earlier one sees `cut` tokens fewer of the item (slot_tokens), and its lanes compare
// token_base + cut against the same wave-uniform valid, so any tile may mask some heads.
//
// Per quarter, in wave64 lane roles (arch/gfx950.h): Q.K is computed transposed,
// S^T = K Q^T (A = K rows, B = Q; bf16 Q: 18 k-steps of 32, each one E8M0 block of K,
// quarter_scores_bf16; quantized Q: 5 scaled k-steps of 128), so each lane ends with scores of ONE head
// (lane_col) for 8 tokens; the head's max is a 4-lane reduction, and P^T is already in
// the B-operand layout of the transposed P.V, O^T = V^T P^T, whose outputs again belong
// to one head per lane: alpha rescales with no cross-lane traffic.
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/merge.h"
#include "core/paged.h"
#include "core/schedule.h"
#include "arch/gfx950.h"

#if !defined(HIPMLA_KV_FORMAT) || !defined(HIPMLA_Q_PRECISION) || !defined(HIPMLA_FP8_FNUZ)
#error "split_mfma_gfx950.hip needs -DHIPMLA_KV_FORMAT=2 -DHIPMLA_Q_PRECISION=<0|1|2> -DHIPMLA_FP8_FNUZ=0"
#endif
#if HIPMLA_KV_FORMAT != 2 || HIPMLA_FP8_FNUZ != 0
#error "split_mfma_gfx950.hip: MXFP4 KV (HIPMLA_KV_FORMAT=2) and e4m3fn (HIPMLA_FP8_FNUZ=0) only"
#endif
#if HIPMLA_Q_PRECISION == 0
#define HIPMLA_FAST_NAME hipmla_decode_split_gfx950_mxfp4_qbf16
#elif HIPMLA_Q_PRECISION == 1
#define HIPMLA_FAST_NAME hipmla_decode_split_gfx950_mxfp4_qfp8
#elif HIPMLA_Q_PRECISION == 2
#define HIPMLA_FAST_NAME hipmla_decode_split_gfx950_mxfp4_qmxfp4
#else
#error "split_mfma_gfx950.hip: HIPMLA_Q_PRECISION must be 0 (bf16), 1 (fp8) or 2 (mxfp4)"
#endif

namespace hipmla {
namespace fast950 {

using namespace gfx950;

constexpr bool Q_BF16 = HIPMLA_Q_PRECISION == FORMAT_BF16;
constexpr bool Q_FP8 = HIPMLA_Q_PRECISION == FORMAT_FP8;
constexpr int Q_FMT = Q_FP8 ? MFMA_FMT_E4M3 : MFMA_FMT_E2M1;
constexpr int WAVES = 4;
constexpr int THREADS = WAVES * WAVE;
constexpr int TILE = 128;                          // tokens per block step (p.fast_tile)
constexpr int QUARTER = TILE / WAVES;              // tokens per wave step
constexpr int GROUPS = QUARTER / MFMA_N;           // 16-token score groups per quarter
constexpr int ROW_BYTES = D_QK / 2;                // 288: MXFP4 row
constexpr int SCALES = D_QK / MX_BLOCK;            // 18 E8M0 per row
constexpr int SCALE_STRIDE = 20;                   // LDS bytes per row of scales
constexpr int QUARTER_BYTES = QUARTER * ROW_BYTES; // 9216
constexpr int COPIES = QUARTER_BYTES / 1024;       // 1 KiB async copies per quarter
constexpr int ROW_CHUNKS = ROW_BYTES / 16;         // 18 16-byte chunks per row
constexpr int K_STEPS = (D_QK + SCALED_K - 1) / SCALED_K;  // 5; the last one half empty
constexpr int Q_BYTES_PER_HEAD = Q_FP8 ? D_QK : D_QK / 2;
constexpr int V_GROUPS = D_V / (MFMA_N * 8);       // 4: 128 columns, one dword of a row per lane
constexpr int V_TILES = 8;                         // MFMA tiles per V group: nibble n of the dword
constexpr int SCALE_BYTES_PER_LANE = QUARTER * SCALES / WAVE;  // 9
constexpr int BF16_STEPS = D_QK / BF16_K;          // 18 bf16 Q.K k-steps: one E8M0 block each
// bf16 Q rows in LDS, padded so that the 16 heads' reads of one k-step start 4 banks apart.
constexpr int Q_STRIDE = D_QK + 8;

static_assert(THREADS == BLOCK_THREADS, "the fast kernel launches the project's block size");
static_assert(HEADS == MFMA_N, "one head per lane_col: H = 16");
static_assert(QUARTER_BYTES % 1024 == 0 && 1024 == 16 * WAVE, "a quarter is whole copies of 16 bytes per lane");
static_assert(ROW_CHUNKS * 16 == ROW_BYTES, "a row is whole 16-byte chunks");
static_assert(QUARTER == QUARTER_ROWS, "a quarter's rows are one QuarterRows");
static_assert(QUARTER == BF16_K, "one bf16 MFMA k-step per quarter");
static_assert(QUARTER * SCALES == SCALE_BYTES_PER_LANE * WAVE && SCALE_BYTES_PER_LANE == 9,
              "scales: 9 bytes per lane (LaneScales)");
static_assert(D_V == V_GROUPS * MFMA_N * 8, "V groups tile the value width");
static_assert(GROUPS * MFMA_N == QUARTER && TILE == WAVES * QUARTER,
              "masking: score (i, j) is token 16 i + 4 j + token_base of the quarter");
static_assert(BF16_STEPS * BF16_K == D_QK && BF16_K == MX_BLOCK,
              "bf16 Q.K: whole k-steps of 32, one E8M0 block of K each");

struct Buffer {
    alignas(16) unsigned char kv[QUARTER_BYTES];
    unsigned char scale[QUARTER * SCALE_STRIDE];
};

// quarter_scores reads the last k-step's 16 bytes and scale of lanes g >= 2 before it
// zeroes them: the furthest (token 31, lane group 3) must still be inside the Buffer.
static_assert((QUARTER - 1) * ROW_BYTES + 16 * (LANE_GROUPS - 1) + SCALED_K / 2 * (K_STEPS - 1) + 16 <=
                      int(sizeof(Buffer)) &&
                  (QUARTER - 1) * SCALE_STRIDE + (LANE_GROUPS - 1) + SCALED_K / MX_BLOCK * (K_STEPS - 1) <
                      QUARTER * SCALE_STRIDE,
              "the last k-step's reads past a row stay inside the Buffer");

struct QStage {                                   // block-wide, before the first tile
    alignas(16) unsigned char q[HEADS * Q_BYTES_PER_HEAD];
    unsigned char scale[HEADS * SCALE_STRIDE];
};

struct Merge {                                    // after the last tile
    float m[WAVES][HEADS];
    float l[WAVES][HEADS];
    alignas(16) float acc[V_GROUPS * V_TILES * 4][WAVE];  // one wave's accumulators, register order
    int last;                                     // merge_split_row's flag
};

// Quantized Q: two buffers per wave, the next tile's quarter copied into one while the
// other is read. buf[1] is free until the first prefetch, so the schedule's scan and the
// quantized Q are staged there (the schedule is done before Q is staged; both before the
// first prefetch). bf16 Q is read from LDS by every k-step of every tile, so it has LDS
// of its own (18,688 B): with two buffers a block took 97,536 B and a CU held one. So bf16
// Q has ONE buffer per wave (58,112 B: two blocks, 2 waves per SIMD): the next quarter's
// copy starts once the wave's P.V has read the buffer and lands while the other block's
// waves compute (the wait moves from the wave's next tile to the SIMD's other wave). The
// scan overlaps the buffer: it is done before the first copy.
constexpr int BUFFERS = Q_BF16 ? 1 : 2;
template <bool ONE_BUFFER>
struct Start {
    Buffer first[WAVES];
    QStage q;
    ScheduleSmem<THREADS> sched;
};
template <>
struct Start<true> {
    ScheduleSmem<THREADS> sched;
    QStage q;  // unused (bf16 Q has q_bf16); declared so the quantized-Q branches compile
};
struct alignas(16) Smem {
    union alignas(16) {
        Buffer buf[BUFFERS][WAVES];
        Start<BUFFERS == 1> start;
        Merge merge;
    };
    alignas(16) unsigned short q_bf16[Q_BF16 ? HEADS * Q_STRIDE : 8];  // [head][dim], padded rows
};
static_assert(sizeof(Start<BUFFERS == 1>) <= sizeof(Buffer) * BUFFERS * WAVES,
              "the schedule and Q stage inside the second buffers (one buffer: the scan inside it)");
static_assert(sizeof(Smem) == sizeof(Buffer) * BUFFERS * WAVES + (Q_BF16 ? 2 * HEADS * Q_STRIDE : 16),
              "LDS is the buffers of every wave (and bf16 Q)");

// Token of a quarter that score group i, D row x holds. The 4 lane groups read rows
// {0, 2, 1, 3} + 4j, so the two 32-lane halves of a P.V dword read start on rows two
// apart (16 banks apart with 288-byte rows) and do not conflict on a 32-bank LDS.
HIPMLA_DEVICE int score_token(int i, int x) {
    const int g = x / 4, j = x % 4;
    return MFMA_N * i + 4 * j + ((g & 1) << 1) + (g >> 1);
}
// Token of P.V k-slot e (0..7) of lane group g: the same token the scores of that lane
// hold in group e / 4, register e % 4 (P^T needs no shuffle).
HIPMLA_DEVICE int pv_token(int g, int e) { return score_token(e / 4, 4 * g + e % 4); }

// Exact element codes of values already on the element grid (after mx_round_element).
HIPMLA_DEVICE unsigned e4m3fn_code(float r) {
    const unsigned u = bits_from_f32(r);
    const unsigned sign = (u >> 24) & 0x80u;
    const float a = f32_from_bits(u & 0x7fffffffu);
    if (a < 0.015625f) return sign | unsigned(a * 512.0f);        // subnormal: m * 2^-9
    return sign | ((((u >> 23) & 0xffu) - 120u) << 3) | ((u >> 20) & 7u);
}
HIPMLA_DEVICE unsigned e2m1_code(float r) {
    const unsigned u = bits_from_f32(r);
    const unsigned sign = (u >> 28) & 0x8u;
    const float a = f32_from_bits(u & 0x7fffffffu);
    if (a < 1.0f) return sign | (a == 0.5f ? 1u : 0u);
    return sign | ((((u >> 23) & 0xffu) - 126u) << 1) | ((u >> 22) & 1u);
}

// Quantizes Q of `seq` block by block (OCP floor rule, RNE, saturating) into element
// codes + E8M0 in shared memory: the numerics of hip_src/KERNELS.md step 1.
// Slots from `present` on (row_heads: below 16 heads) read head 0's values as zeros.
HIPMLA_DEVICE void stage_q(QStage& qs, const MlaDecodeParams& p, int row, int present) {
    const unsigned short* q = static_cast<const unsigned short*>(p.q) + head_index(p, row, 0) * D_QK;
    for (int b = int(thread_index()); b < HEADS * SCALES; b += THREADS) {
        const int h = b / SCALES, blk = b % SCALES;
        const unsigned keep = h < present ? 0xffffffffu : 0u;
        const unsigned short* x = q + (h < present ? h : 0) * D_QK + blk * MX_BLOCK;
        float v[MX_BLOCK];
        float amax = 0.0f;
#pragma unroll
        for (int c = 0; c < MX_BLOCK / 8; ++c) {
            const u32x4 w = *reinterpret_cast<const u32x4*>(x + 8 * c);
            const unsigned ws[4] = {w.x & keep, w.y & keep, w.z & keep, w.w & keep};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[8 * c + 2 * k] = f32_from_bits(ws[k] << 16);
                v[8 * c + 2 * k + 1] = f32_from_bits(ws[k] & 0xffff0000u);
            }
        }
#pragma unroll
        for (int k = 0; k < MX_BLOCK; ++k) amax = __builtin_fmaxf(amax, __builtin_fabsf(v[k]));
        const int e = mx_block_exponent(amax, Q_FP8 ? E4M3FN::emax : E2M1::emax);
        const float down = exp2_int(-e);
        unsigned char* dst = qs.q + h * Q_BYTES_PER_HEAD + blk * MX_BLOCK * (Q_FP8 ? 1 : 0) +
                             blk * (MX_BLOCK / 2) * (Q_FP8 ? 0 : 1);
#pragma unroll
        for (int k = 0; k < MX_BLOCK; k += 2) {
            if constexpr (Q_FP8) {
                dst[k] = (unsigned char)e4m3fn_code(mx_round_element<E4M3FN>(v[k] * down));
                dst[k + 1] = (unsigned char)e4m3fn_code(mx_round_element<E4M3FN>(v[k + 1] * down));
            } else {
                dst[k / 2] = (unsigned char)(e2m1_code(mx_round_element<E2M1>(v[k] * down)) |
                                             (e2m1_code(mx_round_element<E2M1>(v[k + 1] * down)) << 4));
            }
        }
        qs.scale[h * SCALE_STRIDE + blk] = (unsigned char)(e + 127);
    }
}

// bf16 Q of `row` into LDS as it is ([head][dim]): 16-byte chunks, 4.5 per thread; zeros
// for the slots from `heads` on (row_heads: below 16 heads).
HIPMLA_DEVICE void stage_q_bf16(unsigned short* qs, const MlaDecodeParams& p, int row, int heads) {
    const u32x4* q = reinterpret_cast<const u32x4*>(static_cast<const unsigned short*>(p.q) +
                                                    head_index(p, row, 0) * D_QK);
    u32x4* dst = reinterpret_cast<u32x4*>(qs);
    constexpr int PER_HEAD = D_QK / 8;
    const int present = heads * PER_HEAD;
    for (int c = int(thread_index()); c < HEADS * PER_HEAD; c += THREADS)
        dst[(c / PER_HEAD) * (Q_STRIDE / 8) + c % PER_HEAD] = c < present ? q[c] : u32x4{0u, 0u, 0u, 0u};
}

// This lane's B operand (Q^T: column = head lane_col) of k-step s, and its scale.
struct QOperand {
    i32x8 data[K_STEPS];
    unsigned scale[K_STEPS];
};

HIPMLA_DEVICE QOperand load_q_operand(const QStage& qs) {
    QOperand op;
    const int h = lane_col(), g = lane_rowgroup();
    const unsigned char* row = qs.q + h * Q_BYTES_PER_HEAD;
#pragma unroll
    for (int s = 0; s < K_STEPS; ++s) {
        u32x4 lo = {0u, 0u, 0u, 0u}, hi = {0u, 0u, 0u, 0u};
        if constexpr (Q_FP8) {
            // Two 16-element stripes: k = 16g.. and 64 + 16g.. of the step.
            const int k0 = s * SCALED_K + 16 * g, k1 = k0 + 64;
            if (k0 < D_QK) lo = *reinterpret_cast<const u32x4*>(row + k0);
            if (k1 < D_QK) hi = *reinterpret_cast<const u32x4*>(row + k1);
        } else {
            const int k0 = s * SCALED_K + 32 * g;
            if (k0 < D_QK) lo = *reinterpret_cast<const u32x4*>(row + k0 / 2);
        }
        op.data[s] = i32x8{int(lo.x), int(lo.y), int(lo.z), int(lo.w), int(hi.x), int(hi.y), int(hi.z), int(hi.w)};
        const int blk = s * (SCALED_K / MX_BLOCK) + g;
        op.scale[s] = blk < SCALES ? qs.scale[h * SCALE_STRIDE + blk] : 127u;
    }
    return op;
}

// A lane's 9 scale bytes of a quarter (bytes 9 (l % 2) .. + 8 of the quarter's row l / 2),
// held as loaded (bytes 0..7, byte 8) until put_scales: nothing reads them in between,
// so the compiler has no reason to wait for the load before the tile's compute.
struct LaneScales {
    u32x2 lo;
    unsigned hi;
};

// Starts the copy of one quarter (the 32 rows of `rows`) into `b`: in copy c lane l moves
// chunk k = 64 c + l of the quarter's 32 x 18 chunks, i.e. chunk k % 18 of row k / 18, to
// LDS byte 16 k (rows back to back, whatever rows they are). Its scales come back in
// registers, written to LDS by put_scales once they have landed.
HIPMLA_DEVICE LaneScales fetch_quarter(Buffer& b, const MlaDecodeParams& p, const QuarterRows& rows) {
    const unsigned char* kv = static_cast<const unsigned char*>(p.kv);
    const unsigned lane = unsigned(lane_id_fresh());  // the copy indices are recomputed per tile
#pragma unroll
    for (int c = 0; c < COPIES; ++c) {
        const unsigned k = WAVE * c + lane;
        const unsigned r = k / ROW_CHUNKS;
        gather_1k_to_lds(kv + rows.at(int(r)) * ROW_BYTES + 16 * (k - ROW_CHUNKS * r), b.kv + 1024 * c);
    }
    const unsigned r = lane / 2, half = lane % 2;
    const unsigned char* s = p.kv_scale + rows.at(int(r)) * p.stride_kv_scale + SCALE_BYTES_PER_LANE * half;
    LaneScales sc;
    __builtin_memcpy(&sc.lo, s, 8);  // any alignment: scale rows have any stride
    sc.hi = s[8];
    return sc;
}

HIPMLA_DEVICE void put_scales(Buffer& b, const LaneScales& sc) {
    const int lane = lane_id();
    unsigned char* d = b.scale + (lane / 2) * SCALE_STRIDE + SCALE_BYTES_PER_LANE * (lane % 2);
    __builtin_memcpy(d, &sc.lo, 8);
    d[8] = (unsigned char)sc.hi;
}

// S^T of one quarter: score[i][j] = q_{lane_col} . k_{score_token(i, 4 g + j)} (raw).
HIPMLA_DEVICE void quarter_scores(const Buffer& b, const QOperand& q, f32x4* score) {
    const int x = lane_col(), g = lane_rowgroup();
    // Per-lane bases, everything else an immediate offset (score_token(i, x) is 16 i
    // past score_token(0, x)): no address register per group and k-step.
    const int t0 = score_token(0, x);
    const unsigned char* kv = b.kv + t0 * ROW_BYTES + 16 * g;
    const unsigned char* ksc = b.scale + t0 * SCALE_STRIDE + g;
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
        f32x4 d = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < K_STEPS; ++s) {
            const int k0 = s * SCALED_K + 32 * g;  // e2m1 K: 32 consecutive k per lane
            // Past the row (the last k-step's lanes g >= 2) the reads land in the next row,
            // the scale array or a row's scale padding, all inside the Buffer, and are
            // replaced by zeros: a select, where a branch around the reads made each group
            // its own block and the compiler held both groups' K at once.
            u32x4 k = *reinterpret_cast<const u32x4*>(kv + MFMA_N * i * ROW_BYTES + SCALED_K / 2 * s);
            unsigned ks = ksc[MFMA_N * i * SCALE_STRIDE + SCALED_K / MX_BLOCK * s];
            if (k0 >= D_QK) {
                k = u32x4{0u, 0u, 0u, 0u};
                ks = 127u;
            }
            const i32x8 a = {int(k.x), int(k.y), int(k.z), int(k.w), 0, 0, 0, 0};
            d = mfma_scaled_16x16x128<MFMA_FMT_E2M1, Q_FMT>(a, ks, q.data[s], q.scale[s], d);
        }
        score[i] = d;
    }
}

// S^T of one quarter with bf16 Q (the instructions the seed ran on MI355X: the scaled
// fp4 -> bf16 convert and the bf16 MFMA): k-step s is dims 32 s .. 32 s + 31, one E8M0
// block; lane (x, g) converts the 8 E2M1 of dims 32 s + 8 g .. + 7 of token score_token(i,
// x) (one dword of its row, times the block's scale: exact in bf16) into its A operand,
// and reads Q[lane_col][32 s + 8 g .. + 7] from LDS as its B operand, shared by the
// quarter's two groups. score[i][j] as in quarter_scores.
HIPMLA_DEVICE void quarter_scores_bf16(const Buffer& b, const unsigned short* qs, f32x4* score) {
    const int x = lane_col(), g = lane_rowgroup();
    int token[GROUPS];
    f32x4 d[GROUPS];
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
        token[i] = score_token(i, x);
        d[i] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
    }
#pragma unroll
    for (int s = 0; s < BF16_STEPS; ++s) {
        const u32x4 qb = *reinterpret_cast<const u32x4*>(qs + x * Q_STRIDE + BF16_K * s + 8 * g);
#pragma unroll
        for (int i = 0; i < GROUPS; ++i) {
            const unsigned kw = *reinterpret_cast<const unsigned*>(b.kv + token[i] * ROW_BYTES + 16 * s + 4 * g);
            const float ks = e8m0_to_f32(b.scale[token[i] * SCALE_STRIDE + s]);
            const u32x4 a = {cvt_fp4x2_bf16x2<0>(kw, ks), cvt_fp4x2_bf16x2<1>(kw, ks),
                             cvt_fp4x2_bf16x2<2>(kw, ks), cvt_fp4x2_bf16x2<3>(kw, ks)};
            d[i] = mfma_bf16_16x16x32(a, qb, d[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) score[i] = d[i];
}

// Tiles n = 2 BYTE, 2 BYTE + 1 of a value group: columns 8 x + n from byte BYTE of each
// token's dword (`words`, scales `scale`), transposed to k-pairs of tokens.
template <int BYTE>
HIPMLA_DEVICE void pv_byte(const unsigned* words, const float* scale, u32x4 pt, f32x4& acc_lo, f32x4& acc_hi) {
    unsigned x[8];  // bf16 of columns 2 BYTE, 2 BYTE + 1 of token e
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = cvt_fp4x2_bf16x2<BYTE>(words[e], scale[e]);
    const u32x4 lo = {pick_halves<true>(x[0], x[1]), pick_halves<true>(x[2], x[3]),
                      pick_halves<true>(x[4], x[5]), pick_halves<true>(x[6], x[7])};
    const u32x4 hi = {pick_halves<false>(x[0], x[1]), pick_halves<false>(x[2], x[3]),
                      pick_halves<false>(x[4], x[5]), pick_halves<false>(x[6], x[7])};
    acc_lo = mfma_bf16_16x16x32(lo, pt, acc_lo);
    acc_hi = mfma_bf16_16x16x32(hi, pt, acc_hi);
}

// acc[vg][n] += V^T P^T for one quarter: D row x of tile (vg, n) is value column
// 128 vg + 8 x + n, D column the head lane_col. `pt` is P^T as this lane's bf16 pairs
// (k-slot e = token pv_token(lane_rowgroup, e)).
HIPMLA_DEVICE void quarter_pv(const Buffer& b, u32x4 pt, f32x4 (*acc)[V_TILES]) {
    const int r = lane_col(), g = lane_rowgroup();
    // Per-lane bases, everything else an immediate offset (pv_token(g, e) is pv_token(0, e)
    // past pv_token(g, 0)): no address register per token.
    const int t0 = pv_token(g, 0);
    const unsigned char* kv = b.kv + t0 * ROW_BYTES + 4 * r;
    const unsigned char* vsc = b.scale + t0 * SCALE_STRIDE + (8 * r) / MX_BLOCK;
#pragma unroll
    for (int vg = 0; vg < V_GROUPS; ++vg) {
        // One value group at a time: hoisting the next group's loads and converts would
        // hold their registers next to the 128 accumulators.
        __builtin_amdgcn_sched_barrier(0);
        unsigned words[8];
        float scale[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int dt = pv_token(0, e);
            words[e] = *reinterpret_cast<const unsigned*>(kv + dt * ROW_BYTES + vg * 64);
            scale[e] = e8m0_to_f32(vsc[dt * SCALE_STRIDE + vg * 128 / MX_BLOCK]);
        }
        pv_byte<0>(words, scale, pt, acc[vg][0], acc[vg][1]);
        pv_byte<1>(words, scale, pt, acc[vg][2], acc[vg][3]);
        pv_byte<2>(words, scale, pt, acc[vg][4], acc[vg][5]);
        pv_byte<3>(words, scale, pt, acc[vg][6], acc[vg][7]);
    }
}

}  // namespace fast950
}  // namespace hipmla

HIPMLA_KERNEL(hipmla::fast950::THREADS) void HIPMLA_FAST_NAME(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::gfx950;
    using namespace hipmla::fast950;
    HIPMLA_SHARED Smem sm;

    const WorkItem it = schedule_item<THREADS, HEADS>(p, int(block_index()), sm.start.sched);
    // p.fast_tile = 0: every item (any length, empty and bad ones too). p.fast_tile > 0:
    // only the items split.hip skips (valid, whole fast tiles), as before masked tails.
    if (it.seq < 0 || (p.fast_tile > 0 && !it.fast)) return;
    // An item with invalid device-side input reads no KV and writes NaN (below).
    const int n_tokens = it.bad ? 0 : it.end - it.begin;
    const int seq = it.seq;  // its kv rows
    const int row = it.row;  // its q, out and lse: 16 heads of one query token (or fewer, of several)
    const int present = row_heads(p, it);
    const int n_tiles = (n_tokens + TILE - 1) / TILE;  // the last one may be partial
    const int last = it.begin + n_tokens - 1;          // the item's last token (n_tokens > 0)
    const int slot = it.n_items > 1 ? it.slot : -1;
    const int w = wave_id();
    const int lane = lane_id();
    const int h = lane_col();
    const int g = lane_rowgroup();
    const KvRows kv = kv_rows(p, seq);
    const int quarter_begin = it.begin + QUARTER * w;  // this wave's first token of tile 0

    LaneScales scales = {};
    if (n_tiles > 0) scales = fetch_quarter(sm.buf[0][w], p, quarter_rows(kv, quarter_begin, last));
    if constexpr (Q_BF16) {
        stage_q_bf16(sm.q_bf16, p, row, present);
    } else {
        stage_q(sm.start.q, p, row, present);
    }
    block_sync();
    QOperand q;
    if constexpr (!Q_BF16) q = load_q_operand(sm.start.q);
    if constexpr (!Q_BF16) block_sync();  // buf[1] (where Q or the schedule was) is free for the first prefetch
    // The rows of a quarter are read a tile before its copy (the last tile reads its own
    // again: no token past the item). With two buffers that is just before the wait for
    // the copies in flight: row() uses a page id as soon as it has read it, so reading it
    // anywhere else would wait for those copies early. With one buffer (bf16 Q) the read
    // follows the tile's own copies, so its wait is theirs, which the next tile has at its
    // top anyway: nothing runs in between. Rows past the item's end are clamped to its last
    // token (quarter_rows), so a partial tile copies only the item's own rows.
    QuarterRows next_rows = {0u};
    if (n_tiles > 0) next_rows = quarter_rows(kv, quarter_begin + (n_tiles > 1 ? TILE : 0), last);
    // Score (i, j) of this lane is token score_token(i, 4 g + j) = 16 i + 4 j + token_base
    // of its quarter; masked_score compares token_base with the quarter's valid count. Head
    // h of an earlier query token of a row of several sees `cut` tokens fewer of the item
    // (slot_tokens): its tokens are compared `cut` later, so `valid` stays wave-uniform.
    const int token_base = ((g & 1) << 1) + (g >> 1) + (n_tokens - slot_tokens(p, it, h));

    float m_run = running_max_start();  // head h, log2 units; equal in the 4 lane groups
    float l_lane = 0.0f;    // head h, this lane's tokens
    f32x4 acc[V_GROUPS][V_TILES];
#pragma unroll
    for (int vg = 0; vg < V_GROUPS; ++vg) {
#pragma unroll
        for (int n = 0; n < V_TILES; ++n) acc[vg][n] = f32x4{0.0f, 0.0f, 0.0f, 0.0f};
    }

    for (int tile = 0; tile < n_tiles; ++tile) {
        Buffer& cur = sm.buf[tile % BUFFERS][w];
        wait_global_loads();
        put_scales(cur, scales);
        wave_sync();  // other lanes of the wave read these scales
        if (BUFFERS == 2 && tile + 1 < n_tiles) scales = fetch_quarter(sm.buf[(tile + 1) % BUFFERS][w], p, next_rows);

        f32x4 score[GROUPS];
        if constexpr (Q_BF16) {
            quarter_scores_bf16(cur, sm.q_bf16, score);
        } else {
            quarter_scores(cur, q, score);
        }
        // Tokens of this quarter before the item's end (wave-uniform; >= 32 but on the last
        // tile): the others get -inf, so P = 0 for them.
        const int valid = it.begin + n_tokens - (quarter_begin + TILE * tile);
        float tile_max = running_max_start();
#pragma unroll
        for (int i = 0; i < GROUPS; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                score[i][j] = masked_score(score[i][j] * p.sm_scale_log2, token_base, MFMA_N * i + 4 * j, valid);
                tile_max = __builtin_fmaxf(tile_max, score[i][j]);
            }
        }
        const float m_new = __builtin_fmaxf(m_run, max_over_rowgroups(tile_max));
        const float alpha = exp2_f32(m_run - m_new);
        m_run = m_new;
        unsigned pt_words[4];
        float psum = 0.0f;
#pragma unroll
        for (int d = 0; d < 4; ++d) {  // k-slots 2d, 2d + 1 = group d / 2, registers 2 (d % 2) + 0, 1
            const unsigned lo = f32_to_bf16_bits(exp2_f32(score[d / 2][2 * (d % 2)] - m_new));
            const unsigned hi = f32_to_bf16_bits(exp2_f32(score[d / 2][2 * (d % 2) + 1] - m_new));
            psum += bf16_to_f32(lo) + bf16_to_f32(hi);
            pt_words[d] = lo | (hi << 16);
        }
        l_lane = l_lane * alpha + psum;
#pragma unroll
        for (int vg = 0; vg < V_GROUPS; ++vg) {
#pragma unroll
            for (int n = 0; n < V_TILES; ++n) acc[vg][n] *= alpha;
        }
        quarter_pv(cur, u32x4{pt_words[0], pt_words[1], pt_words[2], pt_words[3]}, acc);
        if (BUFFERS == 1 && tile + 1 < n_tiles) {
            wait_lds_reads();  // the wave's reads of cur have returned before the copies overwrite it
            scales = fetch_quarter(cur, p, next_rows);
        }
        next_rows = quarter_rows(kv, quarter_begin + TILE * (tile + 2 < n_tiles ? tile + 2 : tile), last);
    }

    // Merge the four waves: M = max m_w, weights exp2(m_w - M), L = sum in wave order,
    // acc = ((w0 a0 + w1 a1) + w2 a2) + w3 a3, accumulated through one LDS buffer.
    const float l_wave = sum_over_rowgroups(l_lane);
    block_sync();  // every wave is done with its buffers
    if (g == 0) {
        sm.merge.m[w][h] = m_run;
        sm.merge.l[w][h] = l_wave;
    }
    block_sync();
    float big_m = sm.merge.m[0][h];
#pragma unroll
    for (int k = 1; k < WAVES; ++k) big_m = __builtin_fmaxf(big_m, sm.merge.m[k][h]);
    float big_l = 0.0f;
#pragma unroll
    for (int k = 0; k < WAVES; ++k) big_l += exp2_f32(sm.merge.m[k][h] - big_m) * sm.merge.l[k][h];
    float weight = exp2_f32(m_run - big_m);
    if (it.bad) {  // NaN partial or output: the merge turns it into NaN for the sequence
        const float nan = f32_from_bits(0x7fc00000u);
        big_m = nan;
        big_l = nan;
        weight = nan;  // every accumulator cell becomes NaN
    }
    // An empty item (an empty sequence: one item, slot < 0) has big_l = 0 and acc = 0:
    // dividing by 1 gives its output 0, and big_m + log2(0) its LSE -inf. NaN stays NaN.
    const float denom = big_l <= 0.0f ? 1.0f : big_l;
    for (int k = 0; k < WAVES; ++k) {
        if (k == w) {
#pragma unroll
            for (int vg = 0; vg < V_GROUPS; ++vg) {
#pragma unroll
                for (int n = 0; n < V_TILES; ++n) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        float* cell = &sm.merge.acc[(vg * V_TILES + n) * 4 + j][lane];
                        const float mine = acc[vg][n][j] * weight;
                        *cell = k == 0 ? mine : *cell + mine;
                    }
                }
            }
        }
        block_sync();
    }

    // Wave 0 writes m, l or the LSE (every wave holds the same values); wave w writes value
    // group w: lane (h, g) holds columns 128 w + 32 g + 8 j + n.
    if (slot >= 0 && lane < HEADS && w == 0) {
        p.part_ml[(slot * HEADS + h) * 2] = big_m;
        p.part_ml[(slot * HEADS + h) * 2 + 1] = big_l;
    } else if (slot < 0 && lane < HEADS && w == 0 && p.lse != nullptr && h < present) {
        p.lse[head_index(p, row, h)] = big_l <= 0.0f ? f32_from_bits(0xff800000u) : (big_m + log2_f32(big_l)) * 0.6931471805599453f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float v[V_TILES];
#pragma unroll
        for (int n = 0; n < V_TILES; ++n) v[n] = sm.merge.acc[(w * V_TILES + n) * 4 + j][lane];
        const int col = 128 * w + 32 * g + 8 * j;
        if (slot >= 0) {
            f32x4* dst = reinterpret_cast<f32x4*>(p.part_acc + ((long long)slot * HEADS + h) * D_V + col);
            dst[0] = f32x4{v[0], v[1], v[2], v[3]};
            dst[1] = f32x4{v[4], v[5], v[6], v[7]};
        } else if (h < present) {
            u32x4* dst = reinterpret_cast<u32x4*>(static_cast<unsigned short*>(p.out) + head_index(p, row, h) * D_V + col);
            *dst = u32x4{pack_bf16x2(v[0] / denom, v[1] / denom), pack_bf16x2(v[2] / denom, v[3] / denom),
                         pack_bf16x2(v[4] / denom, v[5] / denom), pack_bf16x2(v[6] / denom, v[7] / denom)};
        }
    }
    // A bad item's error bits: here, where nothing else is live (at the top of the kernel
    // the atomic's registers would stay allocated next to the accumulators).
    report_bad_item(p, it);
    // A split row: its items merge the slots (core/merge.h: shares of the columns, or the
    // last to finish all of them when this kernel runs beside split.hip).
    if (slot >= 0) merge_split_row<THREADS>(p, it, &sm.merge.last);
}
