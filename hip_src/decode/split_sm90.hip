// sm_90 (Hopper) tensor-core split kernel: any cache format (bf16, fp8 e4m3fn, MXFP4),
// any Q precision (bf16, MXFP8, MXFP4), any item length (the last tile is masked inside), on the project's serving core.
// Block i derives work item i from the batch (core/schedule.h); a sequence of one item
// writes bf16 output + natural-log LSE, otherwise the item writes its partial slot and the
// row's items merge the slots, a share of the columns each (core/merge.h). With p.fast_tile > 0
// it takes only the items of whole fast_tile tiles (as the AMD fast kernels do), so it can
// run beside the portable kernel; with p.fast_tile = 0 it takes every item.
// Numerics: hip_src/KERNELS.md with 32-token softmax tiles, ONE softmax state per block,
// and for an fp8 cache f16 products: hipmla.emulate.emulate_work_item(tile=SM90_TILE_TOKENS,
// products=kernels.sm90_split_kernel(kv, qp).products) is its model, on quantize_q's Q.
//
// Specialisation (all required):
//   HIPMLA_KV_FORMAT    0 bf16, 1 fp8 (e4m3fn), 2 mxfp4
//   HIPMLA_Q_PRECISION  0 bf16 Q: the bf16 products take it as it is, the fp8 cache's f16
//                       products per head times a power of two (q_exponent); 1 fp8, 2 mxfp4:
//                       the block quantizes Q once, in shared memory (mx_quantize_q_row_bf16,
//                       as split.hip does), into bf16 values, which then take bf16 Q's path
//                       (an MX value is a bf16 value unless below 2^-126: KERNELS.md)
//   HIPMLA_FP8_FNUZ     0 (NVIDIA fp8 is e4m3fn)
// Test only: HIPMLA_SELFTEST_BREAK scales the output by 1.5 (hipmla.selftest.broken).
// The CPU harness runs it too (tests/host_sm90.h defines arch/sm90.h's PTX helpers).
//
// Block = 8 warps, 256 threads. Tile = 32 tokens (4 n-tiles of 8). The warps split the
// DIMENSIONS, not the tokens: warp w owns latent columns [64w, 64w + 64) (4 k16-steps of
// Q.K and the 64 output columns of its P.V) and rope dims [512 + 8w, 512 + 8w + 8) (one
// k8-step of Q.K). Per tile:
//   Q.K   S_w = Q K^T over the warp's dims, mma.m16n8k16 (M = 16 heads, N = 8 tokens):
//         A = Q (held in registers for the whole item, 18 per lane), B = K dequantized to
//         bf16 (fp8: f16) in registers. Lane (g, t) takes row 8j + g of the stage (token of n-tile j)
//         and 16 consecutive latent dims 64w + 16t .. (+ 2 rope dims 512 + 8w + 2t), so one
//         16 / 8 / 4-byte shared load feeds all 4 k-steps (bf16 / fp8 / mxfp4). The dims of
//         a k-step are permuted (dim_offset below); Q's registers follow the same map.
//   sum   the 8 warps' partial scores go through shared memory (red); warp w sums heads
//         2w, 2w+1 (lane: head 2w + lane / 16, tokens 2 (lane % 16), +1), owns their running
//         max and sum, forms P = bf16_rne(exp2(s - m)) and alpha, and writes P in the
//         register order of the P.V A operand (pfrag) -- the one softmax state of the block.
//         A tile none of whose scores exceeds the running max (a warp-wide vote) keeps m
//         and alpha = 1 without the 4-shuffle max chain: the values that chain would give.
//         Scores past the item, or (below 16 heads, several query tokens a row) past the
//         head's own token's bound (n_sh, core/schedule.h slot_tokens), are -inf; m starts
//         at -FLT_MAX (running_max_start), so a head that sees none of a tile stays finite.
//   P.V   O_w += P V over the tile's 32 tokens (2 k16-steps) and the warp's 64 columns
//         (8 n-tiles): V is NOT dequantized again. The K registers of Q.K hold exactly the
//         V values of the warp's columns (V = the first 512 dims of the row), and
//         movmatrix.trans turns a Q.K B operand (token, dim pair) into the P.V B operand
//         (token pair, dim): 1 instruction per register instead of a second dequantization.
//         O (16 x 64 f32 per warp, 32 per lane) never leaves registers; alpha rescales it
//         (skipped when every alpha of the tile is 1).
// Copies: a ring of STAGES tiles (bf16 2, fp8 and mxfp4 4) filled by cp.async.cg (16 B, with
// zero fill for rows past the item) one ring ahead: tile + STAGES is issued right after the
// softmax -> P.V barrier of tile, in the same straight code as tile's P.V (issued at the top
// of the next tile instead, the two ran one after the other). Thread (row tid / 8, chunks
// lead + tid % 8 + 8k mod CHUNKS, lead = the row's first chunk on a 128-byte line: each copy
// instruction writes whole lines, see issue_tile) reads one page-table entry per tile
// through kv_rows().row(). Stages start on lines too (whole-line copies took fp8's tile
// from ~12 shared-memory wavefronts a copy instruction to 4). MXFP4 E8M0 bytes are read
// with plain loads one ring ahead, issued before the tile's copies, and stored as bf16x2
// multipliers one tile later (a whole tile of math hides their latency; the prologue has
// all its tiles' bytes in flight at once and stores them after Q's fragments), in the
// order [row % 8][block][row / 8] (mult_index): a lane's 4 n-tiles of one block are 16
// bytes, so it loads its latent and rope multipliers of a tile in 2 loads, not 8. (Issued
// after the copies, they waited behind them.)
// Barriers per tile: fp8 / mxfp4 (EARLY_WAIT) 2 -- the wait for tile + 1 sits before the
// softmax -> P.V barrier, which then also publishes the next stage; bf16 (2 stages) 3.
// Prologue and epilogue: the row's Q (18 KiB) is copied into shared memory by 16-byte
// cp.async (in the partial-score exchange, free until the first tile) as the oldest copy
// group, in flight beside the first tiles', and the fragments are built from there once
// it has landed (one memory latency for both, not Q's and then the tiles'); O goes back
// through the ring after the last tile and leaves in 16-byte stores (8-byte for the bf16
// output) of whole head rows: read or written from the fragments directly they would be 2-
// and 4-byte accesses a sector each. The stores go through store_global (through
// reinterpret_cast pointers NVVM splits them into 4-byte stores).
// Dynamic shared memory: sizeof(Smem) = hipmla.kernels.sm90_shared_bytes(kv_format)
// (the kernel traps if it gets less).
//
// Numerics (what differs from split.hip is inside KERNELS.md's "any order", except fp8's
// f16 products, which the emulator models: products="f16"):
//   bf16 KV: K, V used as stored. fp8: the products take f16, not bf16: the hardware
//   converts two e4m3 codes to f16x2 in one instruction (exact, subnormals included; the
//   NaN codes 0x7f / 0xff give NaN), where placing the bits into bf16 by hand took 3.5
//   instructions a word (sm_90 has no e4m3 -> bf16 conversion). Q' = f16_rne(Q * 2^k) per
//   head (q_exponent: the head's largest |q| times 2^k in [2^14, 2^15), so every bf16
//   value within 2^-29 of it is exact and the scores are the bf16 products' ones; smaller
//   values round to f16's subnormals: hipmla.emulate.f16_q) and the scores are multiplied
//   by 2^-k before the scale; P enters P.V as f16(bf16_rne(p)), exact for P >= 2^-17,
//   while l sums the bf16 values. The tensor scale multiplies scores (sm_scale_log2 *
//   kv_fp8_scale, that product first) and the final accumulator, as in split.hip.
//   mxfp4: each E2M1 code becomes bf16(v * 2^-126) (the
//   subnormal code 0.5 -> 2^-127), multiplied by 2^(s - 65) for its block's E8M0 s, i.e.
//   K' = V' = value * 2^-64 exactly, and Q' = Q * 2^64 (exact), so Q'K' = QK exactly and
//   the final accumulator is multiplied by 2^64. Exact for block scales 2^(s-127) in
//   [2^-68, 2^65] (E8M0 59..192) and |q| < 2^64: a smaller block scale rounds the block's
//   elements to bf16 subnormals (they are below 2^-66 anyway), a larger one saturates the
//   multiplier to +inf (E8M0 255, NaN by the format, also gives inf / NaN outputs).
//   Scores: f32 partial dot products per warp (tensor-core order), added over the 8 warps
//   in warp order, times the scale. exp2 is the MUFU ex2.approx.ftz (a few ulp, results below 2^-126 flushed:
//   such P and alpha are 0 here). P rounded to bf16 RNE (cvt.rn.bf16x2); l kept per lane (16 lanes per head) and added at the
//   end; f32 accumulation on the tensor cores; output bf16 RNE.
//
// Shared memory is dynamic (the stages do not fit 48 KiB); registers: __launch_bounds__
// (256, 2) -- two blocks, 16 warps per SM.
//
// Budget (nvcc 13.0 / ptxas, sm_90): registers <= 128 in every format (the cap of 2 blocks
// per SM), no stack, no spills; dynamic shared memory 96,768 / 96,000 / 67,840 B. The path
// a warp runs on most tiles (no O rescale, no max chain, a contiguous cache's rows;
// scripts/sm90_counts.py counts it from the SASS; 2026-12-04) is bf16 202, fp8 244, mxfp4
// 392 instructions, i.e. x 8 warps / 32 tokens = 50.5 / 61.0 / 98.0 warp-instructions a
// token, of which 9 HMMA + 8 MOVM (fp8 359 = 89.8 before its f16 products, 2026-12-04:
// 36 F2FP.F16.E4M3.UNPACK_B took the place of ~150 shifts, lop3 and bf16x2 multiplies);
// the O rescale adds 32 (a tile that lowers alpha), the
// max chain 19 (a tile that raises the running max), a paged cache's page-table read 15.
// mxfp4's K dequantization (56 shifts and 48 lop3 for the 32 latent words, 2 multiplies and
// 2 lop3 for each of the 4 rope words, 36 bf16x2 multiplies) is ~156 of the 392.
//
// Measurements, ablations and the designs tried and dropped (mma.sync rates, wgmma, bulk
// copies, V through shared memory, software pipelining ...): hip_src/KERNELS.md, "sm_90: what
// was measured, tried and dropped".
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/merge.h"
#include "core/paged.h"
#include "core/schedule.h"
#include "arch/sm90.h"

#if !defined(HIPMLA_KV_FORMAT) || !defined(HIPMLA_Q_PRECISION) || !defined(HIPMLA_FP8_FNUZ)
#error "split_sm90.hip needs -DHIPMLA_KV_FORMAT=<0|1|2> -DHIPMLA_Q_PRECISION=<0|1|2> -DHIPMLA_FP8_FNUZ=0"
#endif
#if HIPMLA_FP8_FNUZ != 0
#error "split_sm90.hip: NVIDIA fp8 is e4m3fn (HIPMLA_FP8_FNUZ=0)"
#endif
#if HIPMLA_KV_FORMAT == 0
#define HIPMLA_SM90_KV bf16
#elif HIPMLA_KV_FORMAT == 1
#define HIPMLA_SM90_KV fp8
#elif HIPMLA_KV_FORMAT == 2
#define HIPMLA_SM90_KV mxfp4
#else
#error "HIPMLA_KV_FORMAT must be 0 (bf16), 1 (fp8) or 2 (mxfp4)"
#endif
#if HIPMLA_Q_PRECISION == 0
#define HIPMLA_SM90_Q bf16
#elif HIPMLA_Q_PRECISION == 1
#define HIPMLA_SM90_Q fp8
#elif HIPMLA_Q_PRECISION == 2
#define HIPMLA_SM90_Q mxfp4
#else
#error "HIPMLA_Q_PRECISION must be 0 (bf16), 1 (fp8) or 2 (mxfp4)"
#endif
#define HIPMLA_SM90_GLUE(kv, q) hipmla_decode_split_sm90_##kv##_q##q
#define HIPMLA_SM90_SYMBOL(kv, q) HIPMLA_SM90_GLUE(kv, q)
#define HIPMLA_SM90_NAME HIPMLA_SM90_SYMBOL(HIPMLA_SM90_KV, HIPMLA_SM90_Q)

namespace hipmla {
namespace sm90k {

using namespace sm90;

constexpr int KV = HIPMLA_KV_FORMAT;
constexpr int QP = HIPMLA_Q_PRECISION;
constexpr bool MXFP4 = KV == FORMAT_MXFP4;
constexpr bool FP8 = KV == FORMAT_FP8;
// The tensor-core products take f16 inputs for the fp8 cache (the hardware converts two e4m3
// codes to f16x2 in one instruction; there is no such conversion to bf16 on sm_90), bf16
// otherwise.
constexpr bool F16 = FP8;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * WARP;
constexpr int TILE = 32;                            // tokens per softmax step (emulator tile)
constexpr int NTILES = TILE / 8;                    // Q.K n-tiles per tile
constexpr int PV_STEPS = TILE / 16;                 // P.V k-steps per tile
constexpr int V_DIMS = D_V / WARPS;                 // 64 latent columns per warp
constexpr int ROPE_DIMS = (D_QK - D_V) / WARPS;     // 8 rope dims per warp: one k8-step
constexpr int KSTEPS = V_DIMS / 16;                 // 4 k16-steps per warp
constexpr int BITS = KV == FORMAT_BF16 ? 16 : FP8 ? 8 : 4;
constexpr int ROW_BYTES = D_QK * BITS / 8;
// bf16 rows get 16 bytes of padding: the 8 lanes of a 16-byte load phase (rows g, g+1,
// columns 32t) then start 16 banks apart; fp8 (576) and mxfp4 (288) rows are already
// conflict-free for this kernel's loads.
constexpr int ROW_STRIDE = KV == FORMAT_BF16 ? ROW_BYTES + 16 : ROW_BYTES;
constexpr int CHUNKS = ROW_BYTES / 16;
constexpr int LINE = 128;                           // bytes of a shared-memory wavefront
constexpr bool ROTATE = !MXFP4;                     // copies rotated onto whole lines (issue_tile)
constexpr int NO_WRAP = (CHUNKS - 7) / 8;           // copies c with 14 + 8 c < CHUNKS (first <= 14)
constexpr int SCALES = D_QK / MX_BLOCK;             // 18 E8M0 per row
// mxfp4 had 6 until 2026-12-03: 4 measured 2.0-2.6% faster on the large shapes (H200, A/B in
// one process, scripts/results/h200-2026-12-03-sm90-stages-vstage.txt), 3 the same as 4, 5
// the same as 6.
constexpr int STAGES = KV == FORMAT_BF16 ? 2 : 4;
// With 4+ stages the wait for tile + 1 moves to the barrier before P.V (2 barriers a tile);
// bf16's 2 stages keep it at the top of the loop, a whole tile after the copies were issued.
constexpr bool EARLY_WAIT = STAGES >= 4;
constexpr int QSHIFT = MXFP4 ? 64 : 0;              // Q' = Q * 2^QSHIFT, K' = K * 2^-QSHIFT
constexpr int RED_STRIDE = 40;                      // floats per (warp, head) row of red
constexpr int PRODUCER_ROWS = THREADS / 8;          // one row per 8 threads
constexpr int SCALE_SLOTS = (SCALES + 7) / 8;       // E8M0 bytes per producer thread
// dims of a lane's register: dim = 64 w + 16 t + dim_offset(kk, r) + DIM_STEP * e, where
// kk = k-step, r = register of the B operand (slots 2t.. or 2t+8..), e = half.
constexpr int DIM_STEP = MXFP4 ? 4 : 1;

static_assert(THREADS == BLOCK_THREADS, "the kernel launches the project's block size");
static_assert(HEADS == 16, "16 heads are the M dimension of mma.m16n8k16");
static_assert(PRODUCER_ROWS == TILE, "one producer row per 8 threads covers a tile");
static_assert(KSTEPS * 16 == V_DIMS && ROPE_DIMS == 8, "4 k16-steps + 1 k8-step per warp");
static_assert(WARPS * 2 == HEADS, "softmax: two heads per warp");
static_assert(ROW_BYTES % 16 == 0 && ROW_STRIDE % 16 == 0, "16-byte copies");
static_assert(MX_BLOCK % 16 == 0, "a lane's 16 latent dims lie in one E8M0 block");

HIPMLA_DEVICE constexpr int dim_offset(int kk, int r) {
    return MXFP4 ? 8 * (kk >> 1) + 2 * (kk & 1) + r : 4 * kk + 2 * r;
}
HIPMLA_DEVICE int dim_of(int w, int t, int kk, int r, int e) { return V_DIMS * w + 16 * t + dim_offset(kk, r) + DIM_STEP * e; }

// Stages start on 128-byte lines (the dynamic shared memory of a block does: it follows the
// driver's 1 KiB), so the copies' line alignment below is the same in every stage.
struct alignas(128) Stage {
    alignas(128) unsigned char kv[TILE * ROW_STRIDE];
    unsigned mult[MXFP4 ? TILE * SCALES : 4];        // mxfp4: bf16x2 2^(s - 65) per (row, block)
};

constexpr int OUT_STRIDE = D_V + 4;  // f32 per head row of the output stage: 2-way bank conflicts, 16-byte rows

struct alignas(128) Smem {
    union {
        Stage stage[STAGES];
        float out[HEADS][OUT_STRIDE];                 // after the last tile: O, for coalesced stores
    } ring;
    union {
        float red[WARPS][HEADS][RED_STRIDE];          // partial scores [warp][head][token]
        ScheduleSmem<THREADS> sched;                  // before the first tile
        unsigned short q[HEADS * D_QK];               // the row's Q, read coalesced, before the first tile
    } x;
    alignas(16) unsigned pfrag[PV_STEPS][WARP][4];    // P in P.V A-operand order
    float alpha[HEADS];
    float l[HEADS];
    int qexp[HEADS];  // f16 products: Q' = Q * 2^qexp[h] (q_exponent)
    WorkItem item;  // read back after the tiles, whose registers it would otherwise hold
    int last;
};
// The union members must not grow the ring and the exchange that sm90_shared_bytes counts.
static_assert(sizeof(float) * HEADS * OUT_STRIDE <= sizeof(Stage) * STAGES, "O's stage fits in the ring");
static_assert(sizeof(unsigned short) * HEADS * D_QK <= sizeof(float) * WARPS * HEADS * RED_STRIDE,
              "Q's stage fits in the partial-score exchange");

// bf16 bits of Q[h][d] * 2^QSHIFT (exact unless |q| >= 2^(128 - QSHIFT)).
HIPMLA_DEVICE unsigned q_scaled(const unsigned short* q, int h, int d) {
    const unsigned bits = q[h * D_QK + d];
    if (QSHIFT == 0) return bits;
    return f32_to_bf16_bits(bf16_to_f32(bits) * exp2_int(QSHIFT));
}

// The f16 products' Q: Q' = Q * 2^k for head h, k = 141 - E with E the largest exponent
// field of the head's bf16 values (`max_bits`: the largest |q| as bits), so that the largest
// |q'| lies in [2^14, 2^15): every bf16 value within 2^-29 of the head's largest is an f16
// normal, exact, and the f32 scores times 2^-k are the bf16 products' scores. At most 126
// (2^-k stays an f32 normal): a head of zeros or of values below 2^-112 keeps less headroom.
// A non-finite q (E = 255) gives k = -114, and its inf or NaN stays one.
HIPMLA_DEVICE unsigned max_u32(unsigned a, unsigned b) { return a > b ? a : b; }
HIPMLA_DEVICE int q_exponent(unsigned max_bits) {
    const int k = 141 - int(max_bits >> 7);
    return k < 126 ? k : 126;
}

// Two Q values of head h as the A operand's word (d0 in the low half): bf16 bits * 2^QSHIFT
// for bf16 products, f16(q * mul) rounded to nearest even for f16 products (mul = 2^k).
HIPMLA_DEVICE unsigned q_pair(const unsigned short* q, int h, int d0, int d1, float mul) {
    if (F16) return pack_f16x2_rn(bf16_to_f32(q[h * D_QK + d0]) * mul, bf16_to_f32(q[h * D_QK + d1]) * mul);
    return q_scaled(q, h, d0) | (q_scaled(q, h, d1) << 16);
}

// Stage.mult's order: the multipliers of rows g, g + 8, g + 16, g + 24 and one block are
// 16 consecutive bytes, so a lane loads its 4 n-tiles' multipliers of a block at once.
HIPMLA_DEVICE constexpr int mult_index(int row, int block) { return ((row & 7) * SCALES + block) * 4 + (row >> 3); }
static_assert(NTILES == 4 && (TILE * ROW_STRIDE) % 16 == 0, "a lane's 4 multipliers of a block: one 16-byte load");

}  // namespace sm90k
}  // namespace hipmla

extern "C" __global__ void __launch_bounds__(hipmla::sm90k::THREADS, 2) HIPMLA_SM90_NAME(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::sm90k;
    extern __shared__ __align__(16) unsigned char hipmla_sm90_smem[];
    Smem& sm = *reinterpret_cast<Smem*>(hipmla_sm90_smem);
    if (dynamic_smem_size() < sizeof(Smem)) __trap();

    const int tid = int(thread_index());
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const WorkItem it = schedule_item<THREADS, HEADS>(p, int(block_index()), sm.x.sched);
    if (it.seq < 0) return;
    if (p.fast_tile > 0 && !it.fast) return;  // the portable kernel's item
    // An item with invalid device-side input reads nothing and writes NaN (below).
    report_bad_item(p, it);
    const int n = it.bad ? 0 : it.end - it.begin;
    const int seq = it.seq;  // its kv rows
    const int row = it.row;  // its q: 16 heads of one query token (or fewer, of several)
    if (tid == 0) sm.item = it;
    const KvRows rows = kv_rows(p, seq);
    const float neg_inf = f32_from_bits(0xff800000u);
    const int n_tiles = (n + TILE - 1) / TILE;

    // The row's 18 KiB of Q go through shared memory in 16-byte copies (read where the
    // fragments need them, they would be 2-byte loads touching a sector each; the
    // schedule's scan, which x.sched held, is over). They are the oldest copy group, in
    // flight beside the prologue's tiles (whose page-table reads would otherwise follow
    // Q's memory latency instead of overlapping it).
    {
        // Slots past the row's query heads (row_heads: below 16 heads) are zero-filled, read from nowhere.
        const unsigned short* qg = static_cast<const unsigned short*>(p.q) + head_index(p, row, 0) * D_QK;
        const int present = row_heads(p, it) * (D_QK / 8);
        for (int i = tid; i < HEADS * D_QK / 8; i += THREADS)
            cp_async_16(smem_address(sm.x.q + 8 * i), qg + 8 * (i < present ? i : 0), i < present ? 16u : 0u);
        cp_async_commit();
    }
    // Producer role: row prow of every tile, E8M0 bytes psub + 8k, and 16-byte chunks
    // (lead + psub + 8c) mod CHUNKS of the row, c = 0, 1, ...: the row's 8 threads write one
    // 128-byte line of shared memory per copy instruction, never a line and a half. lead is
    // the row's first chunk on a line (fp8 rows are 4.5 lines long, so odd rows begin
    // mid-line: copied from chunk 0, each of their copies wrote two lines, and on the H200 a
    // tile's copies took 3x the shared-memory wavefronts of aligned ones; Nsight Compute,
    // fp8 64x8k). mxfp4 keeps lead 0: its wrap would cost registers it does not have.
    const int prow = tid >> 3, psub = tid & 7;
    const int first = (ROTATE ? (LINE - prow * ROW_STRIDE % LINE) % LINE / 16 : 0) + psub;  // lead + psub < 15
    // Bytes of copy c past chunk `first`: copies c < NO_WRAP never pass the row's end.
    auto copy_offset = [&](int c) {
        return !ROTATE || c < NO_WRAP || first + 8 * c < CHUNKS ? 128 * c : 128 * c - 16 * CHUNKS;
    };
    const unsigned char* kv_base = static_cast<const unsigned char*>(p.kv);
    unsigned scale_bytes[SCALE_SLOTS];
    // The thread's producer row of `tile` (0 past the item), read before the tile's loads:
    // an E8M0 load issued after the copies waits behind them (on the H200 the prologue's
    // scales, loaded after 5 tiles' copies, came back ~4 us later than Q did at 32 x 1k).
    auto tile_row = [&](int tile) -> long long {
        const int tok = tile * TILE + prow;
        return tile < n_tiles && tok < n ? rows.row(it.begin + tok) : 0;
    };
    auto issue_tile = [&](int tile, int stage, long long row) {
        if (tile < n_tiles) {
            const bool valid = tile * TILE + prow < n;
            const unsigned char* src = kv_base + row * ROW_BYTES + 16 * first;
            const unsigned dst = smem_address(sm.ring.stage[stage].kv + prow * ROW_STRIDE + 16 * first);
            const unsigned bytes = valid ? 16u : 0u;
#pragma unroll
            for (int c = 0; c < CHUNKS / 8; ++c) cp_async_16(dst + copy_offset(c), src + copy_offset(c), bytes);
            if (psub < CHUNKS % 8) cp_async_16(dst + copy_offset(CHUNKS / 8), src + copy_offset(CHUNKS / 8), bytes);
        }
        cp_async_commit();
    };
    auto load_scales = [&](int tile, long long row) {
        const bool valid = tile < n_tiles && tile * TILE + prow < n;
#pragma unroll
        for (int k = 0; k < SCALE_SLOTS; ++k) {
            const int b = psub + 8 * k;
            // A row past the item keeps any scale: its data is zero-filled.
            scale_bytes[k] = valid && b < SCALES ? unsigned(p.kv_scale[row * p.stride_kv_scale + b]) : 0u;
        }
    };
    auto store_scales = [&](int tile, int stage) {
        if (tile >= n_tiles) return;
#pragma unroll
        for (int k = 0; k < SCALE_SLOTS; ++k) {
            const int b = psub + 8 * k;
            if (b < SCALES) sm.ring.stage[stage].mult[mult_index(prow, b)] = e8m0_multiplier(scale_bytes[k]);
        }
    };

    // Softmax role: head sh = 2 warp + lane / 16, tokens 2 su, 2 su + 1 of the tile.
    const int sh = 2 * warp + (lane >> 4), su = lane & 15;
    const float qk_scale = p.sm_scale_log2 * (FP8 ? p.kv_fp8_scale : 1.0f);
    // Tokens of the item head sh sees: n, or fewer for an earlier query token of a row of
    // several (slot_tokens); its scores past them are masked.
    const int n_sh = slot_tokens(p, it, sh);
    // From -FLT_MAX (running_max_start): a head may see none of a tile's tokens.
    float m_run = running_max_start(), l_run = 0.0f;
    // Where the thread's alpha and P go (byte offsets in shared memory), formed once: inside
    // the loop ptxas rebuilt them from the thread index every tile. Tokens 16 kk' + 2u, +1
    // (u = su % 8) are P.V k-slots 2u, 2u + 1 of step kk'.
    const unsigned a_dst = loop_invariant(unsigned(reinterpret_cast<unsigned char*>(&sm.alpha[sh]) - hipmla_sm90_smem));
    const unsigned p_dst = [&] {
        const int step = su >> 3, u = su & 7;
        return loop_invariant(unsigned((reinterpret_cast<unsigned char*>(&sm.pfrag[step][4 * (sh & 7) + (u & 3)]
                                                                        [(sh >> 3) + 2 * (u >> 2)]) - hipmla_sm90_smem)));
    }();
    float o[KSTEPS][2][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[kk][r][e] = 0.0f;

    // The schedule's scan lives in red: every thread is past it (schedule_item syncs).
    // Prologue: the first STAGES - 1 tiles. Their E8M0 bytes are all in flight before the
    // first is stored (one memory latency, not STAGES - 1), issued ahead of the tiles'
    // copies, and stored once Q's fragments are built.
    unsigned pro[STAGES - 1][SCALE_SLOTS];
    {
        long long pro_row[STAGES - 1];
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) pro_row[s] = tile_row(s);
        if (MXFP4) {
#pragma unroll
            for (int s = 0; s < STAGES - 1; ++s) {
                load_scales(s, pro_row[s]);
#pragma unroll
                for (int k = 0; k < SCALE_SLOTS; ++k) pro[s][k] = scale_bytes[k];
            }
        }
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) issue_tile(s, s, pro_row[s]);
    }
    // Q' as the A operand of the warp's 4 k16-steps (reg 2r + hh: heads g + 8hh, slots
    // 2t + 8r + e) and of its rope k8-step, once Q's group (older than the STAGES - 1
    // tiles') has landed.
    unsigned qa[KSTEPS][4];
    unsigned qr[2];
    cp_async_wait<STAGES - 1>();
    block_sync();
    // Quantized Q: the row's 18 blocks a head quantized in place (the emulator's
    // quantize_q). Their values are bf16 values, so from here on it is bf16 Q's path.
    // P's stage (pfrag, first written by tile 0's softmax) holds the blocks' exponents.
    if (QP != FORMAT_BF16) {
        static_assert(sizeof(Smem::pfrag) >= Q_BLOCKS, "the exponents fit P's stage");
        mx_quantize_q_row_bf16<QP, false, THREADS>(sm.x.q, reinterpret_cast<signed char*>(&sm.pfrag[0][0][0]), tid);
        block_sync();
    }
    if (F16) {  // each head's exponent (q_exponent): 16 threads a head, 36 values each
        const int h = tid >> 4, part = tid & 15;
        static_assert(HEADS * 16 == THREADS && D_QK == 16 * 36, "16 threads of 36 values a head");
        const u32x2* src = reinterpret_cast<const u32x2*>(sm.x.q + h * D_QK + 36 * part);
        unsigned lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 9; ++i) {
            const u32x2 v = src[i];
            lo = max_u32(lo, max_u32(v.x & 0x7fffu, v.y & 0x7fffu));
            hi = max_u32(hi, max_u32(v.x & 0x7fff0000u, v.y & 0x7fff0000u));
        }
        unsigned big = max_u32(lo, hi >> 16);
        big = warp_xor_max(big, 8);
        big = warp_xor_max(big, 4);
        big = warp_xor_max(big, 2);
        big = warp_xor_max(big, 1);
        if (part == 0) sm.qexp[h] = q_exponent(big);
        block_sync();
    }
    {
        const unsigned short* q = sm.x.q;
        const float qmul[2] = {F16 ? exp2_int(sm.qexp[g]) : 1.0f, F16 ? exp2_int(sm.qexp[g + 8]) : 1.0f};
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int h = g + 8 * hh;
                    qa[kk][2 * r + hh] = q_pair(q, h, dim_of(warp, t, kk, r, 0), dim_of(warp, t, kk, r, 1), qmul[hh]);
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int d = D_V + ROPE_DIMS * warp + 2 * t;
            qr[hh] = q_pair(q, g + 8 * hh, d, d + 1, qmul[hh]);
        }
    }

    // f16 products: the scores' 2^-k of the softmax role's head (exact).
    const float q_unscale = F16 ? exp2_int(-sm.qexp[sh]) : 1.0f;

    if (MXFP4) {  // visible at the sync before the first tile's Q.K
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
#pragma unroll
            for (int k = 0; k < SCALE_SLOTS; ++k) scale_bytes[k] = pro[s][k];
            store_scales(s, s);
        }
    }
    // x is the partial-score exchange from here on: the sync before the first tile's Q.K
    // (below, or at the top of the loop without EARLY_WAIT) orders these reads first.
    if (EARLY_WAIT) {  // tile 0's copies, made visible by the sync below
        cp_async_wait<STAGES - 2>();
        block_sync();
    }
    // The ring's last tile. From here on tile + STAGES is issued right after the softmax ->
    // P.V barrier of tile (its stage was last read by Q.K of tile), in the same straight
    // code as tile's P.V, so the two interleave instead of waiting for each other.
    {
        const long long r = tile_row(STAGES - 1);
        if (MXFP4) load_scales(STAGES - 1, r);
        issue_tile(STAGES - 1, STAGES - 1, r);
    }

    int stage = 0, prev_stage = STAGES - 1;  // tile % STAGES, (tile - 1) % STAGES
#pragma unroll 1
    for (int tile = 0; tile < n_tiles; ++tile) {
        if (!EARLY_WAIT) {
            cp_async_wait<STAGES - 1>();  // tile + 1 is in flight too
            block_sync();  // tile's copies visible; the previous tile's reads of red/pfrag and its stage are done
        }
        const Stage& st = sm.ring.stage[stage];

        // ---- Q.K over the warp's dims; K' fragments kept for P.V
        unsigned kf[NTILES][KSTEPS][2];
        unsigned kr[NTILES];
        unsigned mvs[NTILES] = {}, mrs[NTILES] = {};  // mxfp4: the n-tiles' latent and rope multipliers
        if (MXFP4) {
            const u32x4 v = *reinterpret_cast<const u32x4*>(&st.mult[mult_index(g, 2 * warp + (t >> 1))]);
            const u32x4 r = *reinterpret_cast<const u32x4*>(&st.mult[mult_index(g, D_V / MX_BLOCK + (warp >> 2))]);
            mvs[0] = v.x; mvs[1] = v.y; mvs[2] = v.z; mvs[3] = v.w;
            mrs[0] = r.x; mrs[1] = r.y; mrs[2] = r.z; mrs[3] = r.w;
        }
#pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            const int srow = 8 * j + g;
            const unsigned char* row = st.kv + srow * ROW_STRIDE;
            unsigned krj;
            if (KV == FORMAT_BF16) {
                const u32x4* src = reinterpret_cast<const u32x4*>(row + 2 * (V_DIMS * warp + 16 * t));
                const u32x4 v0 = src[0], v1 = src[1];
                const unsigned wv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    kf[j][kk][0] = wv[2 * kk];
                    kf[j][kk][1] = wv[2 * kk + 1];
                }
                krj = *reinterpret_cast<const unsigned*>(row + 2 * (D_V + ROPE_DIMS * warp + 2 * t));
            } else if (FP8) {
                const u32x4 v = *reinterpret_cast<const u32x4*>(row + V_DIMS * warp + 16 * t);
                const unsigned wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    kf[j][kk][0] = e4m3x2_to_f16x2<0>(wv[kk]);
                    kf[j][kk][1] = e4m3x2_to_f16x2<1>(wv[kk]);
                }
                krj = e4m3x2_to_f16x2<0>(*reinterpret_cast<const unsigned short*>(row + D_V + ROPE_DIMS * warp + 2 * t));
            } else {
                const u32x2 v = *reinterpret_cast<const u32x2*>(row + (V_DIMS * warp + 16 * t) / 2);
                const unsigned mv = mvs[j], mr = mrs[j];
                const unsigned wv[2] = {v.x, v.y};
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    unsigned w4[4];
                    e2m1x8_to_bf16x2_scaled_down(wv[k], w4);
#pragma unroll
                    for (int i = 0; i < 4; ++i) kf[j][2 * k + (i >> 1)][i & 1] = mul_bf16x2(w4[i], mv);
                }
                krj = mul_bf16x2(e2m1x2_to_bf16x2_scaled_down(row[(D_V + ROPE_DIMS * warp) / 2 + t]), mr);
            }
            kr[j] = krj;
        }
        // The n-tiles' accumulator chains interleaved: 4 independent mma in flight, not 1.
        float s[NTILES][4];
#pragma unroll
        for (int j = 0; j < NTILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
            for (int j = 0; j < NTILES; ++j) mma_16816<F16>(s[j], qa[kk], kf[j][kk][0], kf[j][kk][1]);
#pragma unroll
        for (int j = 0; j < NTILES; ++j) mma_1688<F16>(s[j], qr[0], qr[1], kr[j]);
#pragma unroll
        for (int j = 0; j < NTILES; ++j) {
            *reinterpret_cast<f32x2*>(&sm.x.red[warp][g][8 * j + 2 * t]) = f32x2{s[j][0], s[j][1]};
            *reinterpret_cast<f32x2*>(&sm.x.red[warp][g + 8][8 * j + 2 * t]) = f32x2{s[j][2], s[j][3]};
        }
        block_sync();

        // ---- softmax of heads 2 warp, 2 warp + 1: the block's one state for them
        {
            f32x2 sum = *reinterpret_cast<const f32x2*>(&sm.x.red[0][sh][2 * su]);
#pragma unroll
            for (int w = 1; w < WARPS; ++w) {
                const f32x2 part = *reinterpret_cast<const f32x2*>(&sm.x.red[w][sh][2 * su]);
                sum.x += part.x;
                sum.y += part.y;
            }
            const int tok = tile * TILE + 2 * su;
            const float s0 = tok < n_sh ? sum.x * q_unscale * qk_scale : neg_inf;
            const float s1 = tok + 1 < n_sh ? sum.y * q_unscale * qk_scale : neg_inf;
            // Once the running max has settled, no score of a tile exceeds it: then the
            // max over the tile is m_run itself and alpha is exactly 1, so one vote replaces
            // the 4-shuffle reduction chain and the ex2 (the same m and alpha either way).
            float m_new = m_run, alpha = 1.0f;
            if (warp_any(s0 > m_run || s1 > m_run)) {
                float tmax = s0 > s1 ? s0 : s1;
                tmax = warp_xor_max(tmax, 8);
                tmax = warp_xor_max(tmax, 4);
                tmax = warp_xor_max(tmax, 2);
                tmax = warp_xor_max(tmax, 1);
                m_new = m_run > tmax ? m_run : tmax;
                alpha = exp2_approx(m_run - m_new);
            }
            const unsigned pp = pack_bf16x2_rn(exp2_approx(s0 - m_new), exp2_approx(s1 - m_new));
            const float p0 = f32_from_bits(pp << 16), p1 = f32_from_bits(pp & 0xffff0000u);
            l_run = l_run * alpha + (p0 + p1);
            m_run = m_new;
            // f16 products: the bf16 P as f16 (exact for P >= 2^-17; smaller P round to
            // f16's subnormal grid). l stays the sum of the bf16 values.
            *reinterpret_cast<unsigned*>(hipmla_sm90_smem + p_dst) = F16 ? pack_f16x2_rn(p0, p1) : pp;
            if (su == 0) *reinterpret_cast<float*>(hipmla_sm90_smem + a_dst) = alpha;
        }
        // EARLY_WAIT: tile + 1's copies are made visible by this barrier too, so a tile
        // costs 2 barriers.
        if (EARLY_WAIT) cp_async_wait<STAGES - 2>();
        block_sync();

        // ---- P.V over the warp's 64 columns: V = movmatrix.trans of the K' fragments.
        // The transposes are written first, apart from the tensor-core chain: they depend on
        // K' alone, so ptxas moves them up into the softmax (their latency passes under it)
        // instead of issuing them in front of each mma.
        unsigned vt[PV_STEPS][KSTEPS][2][2];
#pragma unroll
        for (int step = 0; step < PV_STEPS; ++step)
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    vt[step][kk][r][0] = movmatrix_trans(kf[2 * step][kk][r]);
                    vt[step][kk][r][1] = movmatrix_trans(kf[2 * step + 1][kk][r]);
                }

        // The ring moves on: the E8M0 bytes loaded a tile ago go to their stage (last read by
        // Q.K of tile - 1), and tile + STAGES replaces tile.
        if (MXFP4) store_scales(tile + STAGES - 1, prev_stage);
        {
            const long long r = tile_row(tile + STAGES);
            if (MXFP4) load_scales(tile + STAGES, r);
            issue_tile(tile + STAGES, stage, r);
        }

        const float a_lo = sm.alpha[g], a_hi = sm.alpha[g + 8];
        if (!warp_all(a_lo == 1.0f && a_hi == 1.0f)) {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    o[kk][r][0] *= a_lo;
                    o[kk][r][1] *= a_lo;
                    o[kk][r][2] *= a_hi;
                    o[kk][r][3] *= a_hi;
                }
        }
#pragma unroll
        for (int step = 0; step < PV_STEPS; ++step) {
            const u32x4 pa = *reinterpret_cast<const u32x4*>(sm.pfrag[step][lane]);
            const unsigned a[4] = {pa.x, pa.y, pa.z, pa.w};
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
                for (int r = 0; r < 2; ++r) mma_16816<F16>(o[kk][r], a, vt[step][kk][r][0], vt[step][kk][r][1]);
        }
        prev_stage = stage;
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }

    // ---- the item's state: m, l of head sh; O of heads g, g + 8
    const WorkItem done = sm.item;  // what the tiles' registers made room for
    const int out_row = done.row;   // its out and lse
    const int slot = done.n_items > 1 ? done.slot : -1;
    const int present = row_heads(p, done);  // slots that are query heads of the step
    if (done.bad) {  // NaN partial or output: the merge turns it into NaN for the sequence
        const float nan = f32_from_bits(0x7fc00000u);
        m_run = nan;
        l_run = nan;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[kk][r][e] = nan;
    }
    float l = l_run;
    l = warp_xor_sum(l, 8);
    l = warp_xor_sum(l, 4);
    l = warp_xor_sum(l, 2);
    l = warp_xor_sum(l, 1);
    if (su == 0) {
        sm.l[sh] = l;
        if (slot >= 0) {
            p.part_ml[(slot * HEADS + sh) * 2] = m_run;
            p.part_ml[(slot * HEADS + sh) * 2 + 1] = l;
        } else if (p.lse != nullptr && sh < present) {
            // l = 0 only for an empty sequence; NaN (a bad item) stays NaN.
            p.lse[head_index(p, out_row, sh)] = !(l <= 0.0f) ? (m_run + log2_f32(l)) * 0.6931471805599453f : neg_inf;
        }
    }
    block_sync();

    // 2^QSHIFT undoes K' = K * 2^-QSHIFT (exact); fp8's tensor scale is one factor (split.hip).
#ifdef HIPMLA_SELFTEST_BREAK  // test only (hipmla.selftest.broken): a wrong build its check must catch
    const float out_scale = 1.5f * exp2_int(QSHIFT) * (FP8 ? p.kv_fp8_scale : 1.0f);
#else
    const float out_scale = exp2_int(QSHIFT) * (FP8 ? p.kv_fp8_scale : 1.0f);
#endif
    // O goes through the ring (no copy is in flight: every tile issued was waited for, the
    // ones past the item copy nothing) so that the stores below are whole 16-byte runs of
    // a head's row; from the fragments they would be 4-byte stores a sector each.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    sm.ring.out[g + 8 * hh][dim_of(warp, t, kk, r, e)] = o[kk][r][2 * hh + e] * out_scale;
    block_sync();
    constexpr int QUADS = D_V / 4;  // f32x4 per head row
    constexpr int OUT_STEPS = HEADS * QUADS / THREADS;
    static_assert(OUT_STEPS * THREADS == HEADS * QUADS, "the threads cover O's quads evenly");
    // All of a thread's shared-memory reads first: the stores (asm with a memory clobber)
    // would otherwise hold each read back behind the store before it.
    f32x4 quad[OUT_STEPS];
#pragma unroll
    for (int k = 0; k < OUT_STEPS; ++k) {
        const int i = tid + k * THREADS;
        quad[k] = *reinterpret_cast<const f32x4*>(&sm.ring.out[i / QUADS][4 * (i % QUADS)]);
    }
#pragma unroll
    for (int k = 0; k < OUT_STEPS; ++k) {
        const int i = tid + k * THREADS;
        const int head = i / QUADS, d = 4 * (i % QUADS);
        const f32x4 a = quad[k];
        if (slot >= 0) {
            store_global(reinterpret_cast<f32x4*>(p.part_acc + ((long long)slot * HEADS + head) * D_V + d), a);
        } else if (head < present) {
            // An empty sequence has l = 0 and O = 0: its output is 0 (a bad one NaN).
            const float lh = sm.l[head];
            const bool keep = !(lh <= 0.0f);
            const unsigned b0 = f32_to_bf16_bits(keep ? a.x / lh : 0.0f), b1 = f32_to_bf16_bits(keep ? a.y / lh : 0.0f);
            const unsigned b2 = f32_to_bf16_bits(keep ? a.z / lh : 0.0f), b3 = f32_to_bf16_bits(keep ? a.w / lh : 0.0f);
            store_global(reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) + head_index(p, out_row, head) * D_V + d),
                         u32x2{b0 | (b1 << 16), b2 | (b3 << 16)});
        }
    }
    if (slot >= 0) merge_split_row<THREADS>(p, done, &sm.last);
}
