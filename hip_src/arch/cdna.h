// Wave64 building blocks shared by the CDNA fast kernels (gfx942, gfx950): lane roles of
// the 16x16 MFMA tiles, cross-lane reads and reductions, and the KV rows of a quarter
// spread over the wave. Both architectures lay out every 16x16 f32 accumulator the same
// way (column = lane % 16, rows 4 * (lane / 16) + 0..3), and A rows / B columns by
// lane % 16 (sources: arch/gfx942.h, arch/gfx950.h).
#pragma once

#include "common/platform.h"
#include "core/paged.h"

namespace hipmla {
namespace cdna {

constexpr int WAVE = 64;
constexpr int MFMA_N = 16;                 // rows and columns of every MFMA tile used here
constexpr int LANE_GROUPS = WAVE / MFMA_N; // lane / 16: the k-group of A/B, the row group of D

HIPMLA_DEVICE int lane_id() { return int(thread_index()) % WAVE; }
// lane_id() as a value the compiler cannot see through: what a loop body derives from it
// is recomputed there, not hoisted out of the loop and held in registers across it (the
// gfx950 kernel's 9 per-copy row and chunk indices would otherwise sit next to the
// accumulators for the whole tile loop).
HIPMLA_DEVICE int lane_id_fresh() { return opaque_int(lane_id()); }
HIPMLA_DEVICE int wave_id() { return __builtin_amdgcn_readfirstlane(int(thread_index()) / WAVE); }
// lane_col: A row, B column, D column. lane_rowgroup: k-group of A/B, D rows 4g..4g+3.
HIPMLA_DEVICE int lane_col() { return lane_id() % MFMA_N; }
HIPMLA_DEVICE int lane_rowgroup() { return lane_id() / MFMA_N; }

// Nothing moves across this point, neither loads nor anything else, in the compiler's IR or
// its instruction schedulers: a kernel that counts its loads in flight (s_waitcnt vmcnt(N)
// names "all but the N youngest") needs them issued in the order it wrote them.
HIPMLA_DEVICE void keep_issue_order() {
    asm volatile("" ::: "memory");
    __builtin_amdgcn_sched_barrier(0);
}

// x counts as used here, so the load that produced it is issued (and waited for here)
// even where nothing else reads it.
HIPMLA_DEVICE void keep_loaded(int x) {
#if defined(HIPMLA_HOST_PLATFORM)
    (void)x;
#else
    asm volatile("" ::"v"(x));
#endif
}

// x, as two registers the compiler must hold both of (an empty asm that "changes" the pair),
// so v_pk_* instructions read a pair of its own rather than x.x beside an unrelated register.
HIPMLA_DEVICE void opaque_pair(f32x2& x) {
#if !defined(HIPMLA_HOST_PLATFORM)
    asm volatile("" : "+v"(x));
#endif
}

// x of lane `src` (0..63) of the wave (ds_bpermute: no LDS storage, any lane pattern;
// every lane of the wave must be active).
HIPMLA_DEVICE unsigned lane_read(unsigned x, int src) {
    return unsigned(__builtin_amdgcn_ds_bpermute(src * 4, int(x)));
}

// x from the lane `lane_id() ^ MASK`.
template <int MASK>
HIPMLA_DEVICE float lane_xor(float x) {
    return f32_from_bits(lane_read(bits_from_f32(x), lane_id() ^ MASK));
}

// The KV rows of a 32-token quarter (core/paged.h's row(token)), spread over the wave:
// lane l holds the row of the quarter's token l % 32 (lanes 32..63 repeat lanes 0..31),
// so a quarter costs one page-table read per lane; any lane gets the row of token r
// (0..31) with at(r), one ds_bpermute. Rows are held in 32 bits: a row index is below
// 2^32 in any cache that fits a device (2^32 rows of MXFP4's 288 bytes are 1.2 TB).
constexpr int QUARTER_ROWS = 32;

struct QuarterRows {
    unsigned mine;

    HIPMLA_DEVICE long long at(int r) const { return (long long)lane_read(mine, r); }
};

// The rows of the quarter whose first token is `token0`, for an item whose last token is
// `last` (>= 0, sequence-relative): a token past `last` (a partial last tile, or a quarter
// wholly past the item's end) takes the row of `last` instead, so no lane reads a page id
// or a row outside the item (past the cache, or another sequence's page). The kernels
// give such tokens score -inf (masked_score), so P = 0 for them, and the clamped row is
// one of the item's own, finite wherever the item's data is finite: P.V adds exactly 0.
// One v_min per quarter.
HIPMLA_DEVICE QuarterRows quarter_rows(const KvRows& kv, int token0, int last) {
    const int t = token0 + lane_id() % QUARTER_ROWS;
    return QuarterRows{unsigned(kv.row(t < last ? t : last))};
}

// The score of a token of a quarter: `score` if the token's index in the quarter,
// `base + offset` (base per lane, offset a constant of the unrolled loop), is below `valid`
// (the quarter's tokens before the item's end: wave-uniform, any value, <= 0 for a
// quarter past the end), else -inf. One compare and one select per score; written as
// base < valid - offset so the subtraction stays scalar.
HIPMLA_DEVICE float masked_score(float score, int base, int offset, int valid) {
    return base < valid - offset ? score : f32_from_bits(0xff800000u);
}

// Max / sum over the lanes l ^ m for every combination of the masks (an xor butterfly,
// one exchange per mask, in the order given).
template <int... MASKS>
HIPMLA_DEVICE float max_over_xor(float x) {
    ((x = __builtin_fmaxf(x, lane_xor<MASKS>(x))), ...);
    return x;
}
template <int... MASKS>
HIPMLA_DEVICE float sum_over_xor(float x) {
    ((x += lane_xor<MASKS>(x)), ...);
    return x;
}
// ... over the four lane groups (lanes l, l ^ 16, l ^ 32, l ^ 48)
HIPMLA_DEVICE float max_over_rowgroups(float x) { return max_over_xor<16, 32>(x); }
HIPMLA_DEVICE float sum_over_rowgroups(float x) { return sum_over_xor<16, 32>(x); }
// ... and over the 16 lanes of a row group (lanes 16 (l / 16) .. + 15).
HIPMLA_DEVICE float max_over_cols(float x) { return max_over_xor<1, 2, 4, 8>(x); }
HIPMLA_DEVICE float sum_over_cols(float x) { return sum_over_xor<1, 2, 4, 8>(x); }

}  // namespace cdna
}  // namespace hipmla
