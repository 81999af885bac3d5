// Wave64 building blocks shared by the CDNA fast kernels (gfx942, gfx950): lane roles of
// the 16x16 MFMA tiles and cross-lane reductions. Both architectures lay out every 16x16
// f32 accumulator the same way (column = lane % 16, rows 4 * (lane / 16) + 0..3), and
// A rows / B columns by lane % 16 (sources: arch/gfx942.h, arch/gfx950.h).
#pragma once

#include "common/platform.h"

namespace hipmla {
namespace cdna {

constexpr int WAVE = 64;
constexpr int MFMA_N = 16;                 // rows and columns of every MFMA tile used here
constexpr int LANE_GROUPS = WAVE / MFMA_N; // lane / 16: the k-group of A/B, the row group of D

HIPMLA_DEVICE int lane_id() { return int(thread_index()) % WAVE; }
HIPMLA_DEVICE int wave_id() { return __builtin_amdgcn_readfirstlane(int(thread_index()) / WAVE); }
// lane_col: A row, B column, D column. lane_rowgroup: k-group of A/B, D rows 4g..4g+3.
HIPMLA_DEVICE int lane_col() { return lane_id() % MFMA_N; }
HIPMLA_DEVICE int lane_rowgroup() { return lane_id() / MFMA_N; }

// x from the lane `lane_id() ^ MASK` (ds_bpermute: no LDS storage, any lane pattern).
template <int MASK>
HIPMLA_DEVICE float lane_xor(float x) {
    const int src = (lane_id() ^ MASK) * 4;
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src, __builtin_bit_cast(int, x)));
}

// Max / sum over the four lane groups (lanes l, l ^ 16, l ^ 32, l ^ 48).
HIPMLA_DEVICE float max_over_rowgroups(float x) {
    x = __builtin_fmaxf(x, lane_xor<16>(x));
    return __builtin_fmaxf(x, lane_xor<32>(x));
}
HIPMLA_DEVICE float sum_over_rowgroups(float x) {
    x += lane_xor<16>(x);
    return x + lane_xor<32>(x);
}

}  // namespace cdna
}  // namespace hipmla
