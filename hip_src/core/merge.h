// The split merge, inside the decode kernel: every item of a split row (16 heads of one
// query token, or below 16 heads those of several) writes its partial (acc, m, l) to its
// slot, then arrives at the row's counter, and the row's slots are merged into the bf16
// output and LSE. No combine
// kernel, no second launch.
//
// Who merges. One block reading every slot of a row is bound by what one SM pulls from
// L2 (on the H200, 8 slots of 32 KiB took ~4 us, 16 took ~6), so when one kernel runs
// every item of the step (fast_tile = 0) the row's items share the merge: the item that
// arrived k-th of n merges column groups [k G / n, (k + 1) G / n) (G = D_V / 4 groups of
// 4 columns) of all the row's slots, once it has seen all n arrive. A block waits for its
// siblings at most HIPMLA_MERGE_WAIT_NS: they may not be resident (a later wave of blocks, or
// SMs held by other work), and a slot held that long costs more than one block merging
// the row. A block that stops waiting says so in the same counter (MERGE_QUIT), so the
// one atomic order decides: a quit before the last arrival makes the last item merge
// the whole row; after it, the quitter saw everyone arrive and merges its share. When the
// last item merges the whole row, the siblings still waiting merge their shares too:
// those columns are written twice, with the same bytes.
// With fast_tile > 0 (two kernels, one after the other), or more than G items, the last
// item to arrive merges everything, as before.
// Tried and dropped (H200, 2026-12-03, sm_90 kernel, A/B in one process, L2 flushed;
// scripts/results/h200-2026-12-03-sm90-ab-vstore-staged-merge.txt): a share staged in the
// kernel's free shared memory -- every thread's loads of it issued at once, then the sums
// in slot order from there -- to make a share one L2 round trip for any item count and so
// allow finer splits of short batches. As built (the (m, l) loads scheduled after the
// first stores into the stage, a division per element) the merge took 5.2 us at 4 x 1k
// against 1.9 (mxfp4 4 x 1k 18.0 -> 21.2 us, 4 x 8k 33.6 -> 36.2), and in the same run no
// finer split won: 32 slots a row made 4 x 8k 36.1 -> 39.8 us, 16 made 4 x 1k 21.2 -> 20.3.
// Measured and not adopted (H200, 2026-12-05, scripts/sm90_cluster_probe.py, the hand-off
// alone on rows x items blocks that hold a partial each; scripts/results/
// h200-2026-12-05-sm90-cluster-probe-10c1155.txt): a row's items as one thread-block
// cluster, merging from the siblings' shared memory after a cluster barrier, hand off
// 0.7-1.7 us sooner than this merge (CUDA events, L2 flushed: 4 x 8 items 8.35 -> 6.82 us,
// 32 x 4 9.31 -> 8.19, 64 x 4 11.17 -> 9.50; same bytes). But a launch is clustered as a
// whole, and one launch serves every step: the hardware put clusters of 8 on 120-124 of
// the 132 SMs, so 128 blocks of one an SM ran as two waves on 8 of them (32 x 4, one
// block an SM: 9.38 us this merge, 9.90 through the cluster, 13.76 this merge in a
// clustered launch), and 256 blocks paid ~4 us for the clustered launch alone (11.17 ->
// 15.2-15.4). Short steps would win ~1.5 us where their items fit the clusters, while the
// lone split's one item an SM (up to 132) and every long step would lose SMs.
//
// Counters: two words per row, zero between launches. word 0: arrivals + MERGE_QUIT x
// quits; word 1 (shared merges only): blocks done with word 0, the n-th of which resets
// both. The last arriver of an unshared merge resets word 0.
// Ordering: each thread's partial stores are released at device scope (agent scope on
// AMD) before the block's arrival; a merging block acquires at the same scope before it
// reads the partials (with loads that skip non-coherent caches).
// Numerics (hip_src/KERNELS.md, step 5): M = max_i m_i, w_i = exp2(m_i - M),
// L = sum_i w_i l_i and acc = sum_i w_i acc_i in slot order, out = bf16_rne(acc / L):
// per column, whoever merges it, the same sums in the same order.
#pragma once

#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/schedule.h"

#if !defined(HIPMLA_MERGE_WAIT_NS)
// How long an item waits for the rest of its row (ns); tests build with 0 too.
#define HIPMLA_MERGE_WAIT_NS 4000
#endif

namespace hipmla {

constexpr int MERGE_GROUPS = D_V / 4;        // column groups of 4 (one f32x4 of a head's row)
constexpr int MERGE_QUIT = 1 << 16;          // word 0: arrivals below, quits above
constexpr int MERGE_ARRIVED = MERGE_QUIT - 1;
constexpr int MERGE_NONE = -1;               // this block merges nothing
constexpr int MERGE_ALL = -2;                // this block merges every column of the row
static_assert(MERGE_GROUPS < MERGE_QUIT && MERGE_GROUPS * MERGE_QUIT < 0x7fffffff,
              "arrivals and quits of up to MERGE_GROUPS items fit one int");

// Columns [LANES-strided groups g0 .. g1) of every slot of the row, merged into the
// output (and the LSE if `lse`). Thread = (head h = tid / LANES, lane i = tid % LANES);
// lane i owns groups g0 + i + LANES k (k < STEPS), so the lanes of a head read contiguous
// bytes. BATCH slots' loads are issued together: the first batch beside the m pass (it
// does not depend on M), the rest BATCH per L2 round trip. A row of at most BATCH items
// takes M from the first batch and skips the m pass: the merge runs once per block from
// cold code, and on the H200 Nsight Compute put 63% of a share's stall samples on the
// instruction fetch (mxfp4 32 x 1k, 2026-12-03); skipping it took 32 x 1k 23.8 -> 23.3 us
// and 4 x 8k 33.2 -> 32.9 (scripts/results/h200-2026-12-03-sm90-ab-merge-small-scan.txt).
template <int THREADS, int STEPS, int BATCH>
HIPMLA_DEVICE void merge_columns(const MlaDecodeParams& p, const WorkItem& it, int g0, int g1, bool lse) {
    constexpr int LANES = THREADS / HEADS;
    constexpr int VEC = 4;
    constexpr int M_ROUND = 16;
    static_assert(LANES * HEADS == THREADS && LANES * VEC * STEPS <= D_V, "lanes must cover heads x columns");

    const int tid = int(thread_index());
    const int h = tid / LANES;
    const int i = tid % LANES;
    const int s0 = it.first_slot;
    const int s1 = it.first_slot + it.n_items * it.slot_stride;
    const int ds = it.slot_stride;
    const float neg_inf = f32_from_bits(0xff800000u);

    // Slot s's (m, l) and this thread's groups of its acc (zeros past g1).
    auto load_slot = [&](int s, float (&ml)[2], f32x4 (&a)[STEPS]) {
        const f32x2 v = load_coherent(reinterpret_cast<const f32x2*>(p.part_ml + ((long long)s * HEADS + h) * 2));
        ml[0] = v.x;
        ml[1] = v.y;
        const f32x4* part = reinterpret_cast<const f32x4*>(p.part_acc + ((long long)s * HEADS + h) * D_V);
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
            const int g = g0 + i + LANES * k;
            a[k] = g < g1 ? load_coherent(part + g) : f32x4{0.0f, 0.0f, 0.0f, 0.0f};
        }
    };
    // A slot past the row's loads the first one again rather than branch; it is not added.
    f32x4 head_acc[BATCH][STEPS];
    float head_ml[BATCH][2];
#pragma unroll
    for (int j = 0; j < BATCH; ++j) load_slot(s0 + j * ds < s1 ? s0 + j * ds : s0, head_ml[j], head_acc[j]);
    // M: from the first batch when it holds every slot, else in rounds of M_ROUND slots
    // whose loads are all in flight at once (predicated, so a merge of up to M_ROUND slots
    // is one round trip, with no remainder loop after it).
    // A NaN m (a bad item's) never wins the compare, in any order: M is order-free.
    float big_m = neg_inf;
    if (s1 - s0 <= BATCH * ds) {  // the first batch holds every slot: M from its loads
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            if (s0 + j * ds < s1) big_m = head_ml[j][0] > big_m ? head_ml[j][0] : big_m;
        }
    } else {
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
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
        if (s0 + j * ds < s1) add_slot(head_ml[j][0], head_ml[j][1], head_acc[j]);
    }
    for (int s = s0 + BATCH * ds; s < s1; s += BATCH * ds) {
        f32x4 a[BATCH][STEPS];
        float ml[BATCH][2];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) load_slot(s + j * ds < s1 ? s + j * ds : s, ml[j], a[j]);
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            if (s + j * ds < s1) add_slot(ml[j][0], ml[j][1], a[j]);
        }
    }

    const bool zero = big_l <= 0.0f;  // all slots empty; NaN (a bad item's slot) stays NaN
    if (h >= row_heads(p, it)) return;  // a slot that is no query head of the step: no output
    u32x2* out = reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) + head_index(p, it.row, h) * D_V);
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const int g = g0 + i + LANES * k;
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = zero ? 0.0f : acc[k][e] / big_l;
        if (g < g1) out[g] = u32x2{pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3])};
    }
    if (lse && i == 0 && p.lse != nullptr) {
        p.lse[head_index(p, it.row, h)] = zero ? neg_inf : (big_m + log2_f32(big_l)) * 0.6931471805599453f;
    }
}

// Thread 0: the row's arrival protocol (the header); returns this block's share: an
// arrival index k, MERGE_ALL or MERGE_NONE. `done` gets the block's count in word 1
// (shared merges; -1 otherwise), which the caller checks for the reset at its end.
HIPMLA_DEVICE int arrive(const MlaDecodeParams& p, const WorkItem& it, int& done) {
    int* word = p.counters + 2 * it.row;
    const int n = it.n_items;
    done = -1;
    if (p.fast_tile != 0 || n > MERGE_GROUPS) {
        const bool last = atomic_add_device(word, 1) == n - 1;
        if (last) atomic_store_device(word, 0);
        return last ? MERGE_ALL : MERGE_NONE;
    }
    const int before = atomic_add_device(word, 1);
    const int k = before & MERGE_ARRIVED;
    int share = k;
    if (k == n - 1) {
        if (before >= MERGE_QUIT) share = MERGE_ALL;  // someone stopped waiting: its share is ours
    } else {
        const unsigned long long t0 = timer_ns();
        int seen = before + 1;
        while ((seen & MERGE_ARRIVED) < n && timer_ns() - t0 < HIPMLA_MERGE_WAIT_NS) {
            wait_briefly();
            seen = load_relaxed_device(word);
        }
        if ((seen & MERGE_ARRIVED) < n) {
            // Quit, unless the last arrival came first after all.
            share = (atomic_add_device(word, MERGE_QUIT) & MERGE_ARRIVED) == n ? k : MERGE_NONE;
        }
    }
    fence_release_device();  // every access to word 0 before the count in word 1
    done = atomic_add_device(word + 1, 1);  // its value is needed only at the block's end
    return share;
}

// Thread 0, at the block's end: the n-th block done with word 0 resets the row's counters.
HIPMLA_DEVICE void reset_counters(const MlaDecodeParams& p, const WorkItem& it, int done) {
    if (done != it.n_items - 1) return;
    fence_acquire_device();
    atomic_store_device(p.counters + 2 * it.row, 0);
    atomic_store_device(p.counters + 2 * it.row + 1, 0);
}

// This block's share of the row's columns (an arrival index k or MERGE_ALL), merged by
// every thread.
template <int THREADS>
HIPMLA_DEVICE void merge_share(const MlaDecodeParams& p, const WorkItem& it, int share) {
    fence_acquire_device();
    if (share == MERGE_ALL) {
        merge_columns<THREADS, 8, 2>(p, it, 0, MERGE_GROUPS, true);
    } else {
        const int n = it.n_items;
        const int g0 = share * MERGE_GROUPS / n, g1 = (share + 1) * MERGE_GROUPS / n;
        constexpr int LANES = THREADS / HEADS;
        // A share's groups are LANES x at most 4 steps (2 items or more); 8 loads a
        // thread in flight per round trip. (16, for one round trip up to 16 items, made
        // the merge slower on the H200: 4 x 1k 1.8 -> 3.0 us.)
        if (g1 - g0 <= LANES) merge_columns<THREADS, 1, 8>(p, it, g0, g1, share == 0);
        else if (g1 - g0 <= 2 * LANES) merge_columns<THREADS, 2, 4>(p, it, g0, g1, share == 0);
        else merge_columns<THREADS, 4, 2>(p, it, g0, g1, share == 0);
    }
}

// Called by every thread of a block of a split row (slot >= 0) after its partial stores.
// `flag` is one int of shared memory.
template <int THREADS>
HIPMLA_DEVICE void merge_split_row(const MlaDecodeParams& p, const WorkItem& it, int* flag) {
    fence_release_device();
    block_sync();
    const bool t0 = thread_index() == 0;
    int done = -1;
    if (t0) *flag = arrive(p, it, done);
    block_sync();
    const int share = *flag;
    if (share != MERGE_NONE) merge_share<THREADS>(p, it, share);
    if (t0) reset_counters(p, it, done);
}

// Several 16-head rows of one block's item (the 64-row kernel's, `count` of them, row_of(j)
// the j-th as a WorkItem), called by every thread after the partial stores: thread j
// arrives at row j's counter, all rows at once, so the block waits for its siblings once,
// not once a row; then every thread merges the rows' shares one row after the other.
// `flags` is `count` ints of shared memory.
template <int THREADS, class RowOf>
HIPMLA_DEVICE void merge_split_rows(const MlaDecodeParams& p, int count, RowOf row_of, int* flags) {
    fence_release_device();
    block_sync();
    const int tid = int(thread_index());
    int done = -1;
    if (tid < count) flags[tid] = arrive(p, row_of(tid), done);
    block_sync();
#pragma unroll 1
    for (int j = 0; j < count; ++j) {
        const int share = flags[j];
        if (share != MERGE_NONE) merge_share<THREADS>(p, row_of(j), share);
    }
    if (tid < count) reset_counters(p, row_of(tid), done);
}

}  // namespace hipmla
