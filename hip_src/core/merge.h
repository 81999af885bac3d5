// The split merge, inside the decode kernel: every item of a split row (16 heads of one
// query token) writes its partial (acc, m, l) to its slot, then arrives at the row's
// counter; the block that arrives last merges all the row's slots into the bf16 output
// and LSE and resets the counter for the next launch. No combine kernel, no second launch.
//
// Ordering: each thread's partial stores are released at device scope (agent scope on
// AMD) before the block's one atomic increment; the last block acquires at the same
// scope before it reads the partials (with loads that skip non-coherent caches).
// Numerics (hip_src/KERNELS.md, step 5): M = max_i m_i, w_i = exp2(m_i - M),
// L = sum_i w_i l_i and acc = sum_i w_i acc_i in slot order, out = bf16_rne(acc / L).
#pragma once

#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/schedule.h"

namespace hipmla {

// Called by every thread of the block after its partial stores; true in every thread
// of the block that completed the sequence. `flag` is one int of shared memory.
HIPMLA_DEVICE bool arrive_last(const MlaDecodeParams& p, const WorkItem& it, int* flag) {
    fence_release_device();
    block_sync();
    if (thread_index() == 0) {
        const bool last = atomic_add_device(p.counters + it.row, 1) == it.n_items - 1;
        if (last) atomic_store_device(p.counters + it.row, 0);
        *flag = last ? 1 : 0;
    }
    block_sync();
    const bool last = *flag != 0;
    if (last) fence_acquire_device();
    return last;
}

// Thread = (head h = tid / LANES, lane i = tid % LANES); lane i owns the 16-byte column
// groups i + LANES k, so the lanes of a head read contiguous bytes per step.
template <int THREADS>
HIPMLA_DEVICE void merge_partials(const MlaDecodeParams& p, const WorkItem& it) {
    constexpr int LANES = THREADS / HEADS;
    constexpr int VEC = 4;
    constexpr int STEPS = D_V / (LANES * VEC);
    constexpr int M_ROUND = 16;
    static_assert(LANES * HEADS == THREADS && STEPS * LANES * VEC == D_V, "lanes must cover heads x columns");

    const int tid = int(thread_index());
    const int h = tid / LANES;
    const int i = tid % LANES;
    const int s0 = it.first_slot;
    const int s1 = it.first_slot + it.n_items * it.slot_stride;
    const int ds = it.slot_stride;
    const float neg_inf = f32_from_bits(0xff800000u);

    // A merge is otherwise a chain of L2 round trips: the first two slots' partials are
    // loaded beside the m pass (they do not depend on its max), so a merge of two slots is
    // one round trip; later slots follow two per round trip.
    // Slot s's (m, l) and this thread's columns of its acc.
    auto load_slot = [&](int s, float (&ml)[2], f32x4 (&a)[STEPS]) {
        const float* slot_ml = p.part_ml + ((long long)s * HEADS + h) * 2;
        ml[0] = load_coherent(slot_ml);
        ml[1] = load_coherent(slot_ml + 1);
        const f32x4* part = reinterpret_cast<const f32x4*>(p.part_acc + ((long long)s * HEADS + h) * D_V);
#pragma unroll
        for (int k = 0; k < STEPS; ++k) a[k] = load_coherent(part + i + LANES * k);
    };
    const bool second = s0 + ds < s1;  // a merge has two slots or more; one is read once
    f32x4 head_acc[2][STEPS];
    float head_ml[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) load_slot(second ? s0 + j * ds : s0, head_ml[j], head_acc[j]);
    // M in rounds of M_ROUND slots whose loads are all in flight at once (predicated, so a
    // merge of up to M_ROUND slots is one round trip, with no remainder loop after it).
    // A NaN m (a bad item's) never wins the compare, in any order: M is order-free.
    float big_m = neg_inf;
    for (int s = s0; s < s1; s += M_ROUND * ds) {
        float m[M_ROUND];
#pragma unroll
        for (int k = 0; k < M_ROUND; ++k) {
            const int sk = s + k * ds;
            m[k] = sk < s1 ? load_coherent(p.part_ml + ((long long)sk * HEADS + h) * 2) : neg_inf;
        }
#pragma unroll
        for (int k = 0; k < M_ROUND; ++k) big_m = m[k] > big_m ? m[k] : big_m;
    }
    // All slots empty: weights would be exp2(-inf - -inf); the state is the empty one.
    const float shift = big_m == neg_inf ? 0.0f : big_m;

    float acc[STEPS][VEC];
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[k][e] = 0.0f;
    }
    float big_l = 0.0f;
    // Slot by slot in slot order, whichever loads brought them: the same sums either way.
    auto add_slot = [&](float m, float l, const f32x4* a) {
        const float w = exp2_f32(m - shift);
        big_l += w * l;
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
            acc[k][0] += w * a[k].x;
            acc[k][1] += w * a[k].y;
            acc[k][2] += w * a[k].z;
            acc[k][3] += w * a[k].w;
        }
    };
    add_slot(head_ml[0][0], head_ml[0][1], head_acc[0]);
    if (second) add_slot(head_ml[1][0], head_ml[1][1], head_acc[1]);
    // The later slots two per round trip (their loads issued together; a lone last slot
    // loads its own partial twice rather than branch around the second load).
    for (int s = s0 + 2 * ds; s < s1; s += 2 * ds) {
        const bool pair = s + ds < s1;
        f32x4 a[2][STEPS];
        float ml[2][2];
#pragma unroll
        for (int j = 0; j < 2; ++j) load_slot(j == 1 && pair ? s + ds : s, ml[j], a[j]);
        add_slot(ml[0][0], ml[0][1], a[0]);
        if (pair) add_slot(ml[1][0], ml[1][1], a[1]);
    }

    const bool zero = big_l <= 0.0f;  // all slots empty; NaN (a bad item's slot) stays NaN
    u32x2* out = reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) + ((long long)it.row * HEADS + h) * D_V);
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = zero ? 0.0f : acc[k][e] / big_l;
        out[i + LANES * k] = u32x2{pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3])};
    }
    if (i == 0 && p.lse != nullptr) {
        p.lse[(long long)it.row * HEADS + h] = zero ? neg_inf : (big_m + log2_f32(big_l)) * 0.6931471805599453f;
    }
}

}  // namespace hipmla
