// Feasibility probe (scripts/sm90_cluster_probe.py): the hand-off at the end of a split
// row -- n items of one row, each holding its partial (acc 16 x 512 f32, m and l of 16
// heads) in shared memory as the sm_90 kernel does after its last tile -- timed three
// ways on a grid of rows x n blocks and nothing else:
//   PROBE_MODE 0  no hand-off: each block writes the bf16 output of its partial (what a
//                 row of one item does); the floor of launch, block start and one store.
//   PROBE_MODE 1  the library's hand-off: the partial's 16-byte stores to its slot, then
//                 core/merge.h's merge_split_row (release fence, arrival counter, a share
//                 of the columns merged from every slot, counters reset) -- the code the
//                 decoder's kernels run.
//   PROBE_MODE 2  a cluster of the row's n blocks (__cluster_dims__): one cluster barrier
//                 (release / acquire), each block merges its share of the columns from
//                 the n blocks' shared memory (mapa + ld.shared::cluster) with the same
//                 sums in the same order as merge_columns, one more cluster barrier so
//                 that no block leaves while a sibling still reads it.
//   PROBE_MODE 3  mode 1's hand-off in blocks launched as clusters, which leave together
//                 (one cluster barrier at the end): what a kernel launched in clusters
//                 pays for the rows that do not fit one cluster and merge as today.
// PROBE_ITEMS = n (the cluster size in mode 2). Modes 1 and 2 write the same output bytes
// (the script compares them). Every block records its %smid: where the hardware puts a
// cluster's blocks.
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"
#include "core/merge.h"

#ifndef PROBE_MODE
#error "PROBE_MODE (0 none, 1 global, 2 cluster, 3 global in clusters)"
#endif
#ifndef PROBE_ITEMS
#error "PROBE_ITEMS (items of a row)"
#endif

namespace probe {
using namespace hipmla;

constexpr int THREADS = 256;
constexpr int N = PROBE_ITEMS;
constexpr int LANES = THREADS / HEADS;  // a head's threads in the merge
static_assert(N >= 1 && N <= 16, "items of a row");

struct Smem {
    float acc[HEADS][D_V];
    float m[HEADS];
    float l[HEADS];
    int flag;
};

// A deterministic partial for block b: values of both signs, m per head in log2 units.
HIPMLA_DEVICE float acc_value(int b, int h, int d) { return float((b * 131 + h * 17 + d * 7) % 97 - 48) * 0.03125f; }
HIPMLA_DEVICE float m_value(int b, int h) { return float((b * 5 + h * 3) % 11) * 0.375f - 2.0f; }
HIPMLA_DEVICE float l_value(int b, int h) { return 1.0f + float((b * 7 + h) % 13) * 0.25f; }

#if PROBE_MODE >= 2
// Address `local` (a generic pointer into this block's shared memory) in block `rank`'s
// shared memory of the cluster (PTX ISA "mapa", .shared::cluster).
HIPMLA_DEVICE unsigned cluster_address(const void* local, unsigned rank) {
    unsigned d;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(unsigned(__cvta_generic_to_shared(local))), "r"(rank));
    return d;
}
HIPMLA_DEVICE float load_cluster(unsigned a) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
HIPMLA_DEVICE f32x4 load_cluster4(unsigned a) {
    f32x4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a)
                 : "memory");
    return v;
}
// Every thread of every block of the cluster (PTX ISA "barrier.cluster"): stores before
// the arrive are visible to loads after the wait.
HIPMLA_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Columns [g0, g1) (groups of 4) of the row, merged from the N blocks' shared memory into
// the output: M = max m_j, w_j = exp2(m_j - M), L = sum w_j l_j, acc = sum w_j acc_j in
// block order, out = bf16_rne(acc / L) -- merge_columns' sums.
template <int STEPS>
HIPMLA_DEVICE void merge_share(const MlaDecodeParams& p, Smem& sm, int row, int g0, int g1) {
    const int tid = int(thread_index());
    const int h = tid / LANES, i = tid % LANES;
    const float neg_inf = f32_from_bits(0xff800000u);
    float mj[N], lj[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        mj[j] = load_cluster(cluster_address(&sm.m[h], j));
        lj[j] = load_cluster(cluster_address(&sm.l[h], j));
    }
    f32x4 a[N][STEPS];
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
            const int g = g0 + i + LANES * k;
            a[j][k] = g < g1 ? load_cluster4(cluster_address(&sm.acc[h][4 * g], j)) : f32x4{0.0f, 0.0f, 0.0f, 0.0f};
        }
    float big_m = neg_inf;
#pragma unroll
    for (int j = 0; j < N; ++j) big_m = mj[j] > big_m ? mj[j] : big_m;
    const float shift = big_m == neg_inf ? 0.0f : big_m;
    float acc[STEPS][4];
#pragma unroll
    for (int k = 0; k < STEPS; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.0f;
    float big_l = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const float w = exp2_f32(mj[j] - shift);
        big_l += w * lj[j];
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
            acc[k][0] += w * a[j][k].x;
            acc[k][1] += w * a[j][k].y;
            acc[k][2] += w * a[j][k].z;
            acc[k][3] += w * a[j][k].w;
        }
    }
    const bool zero = big_l <= 0.0f;
    u32x2* out = reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) + ((long long)row * HEADS + h) * D_V);
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const int g = g0 + i + LANES * k;
        float o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = zero ? 0.0f : acc[k][e] / big_l;
        if (g < g1) out[g] = u32x2{pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3])};
    }
}
#endif

}  // namespace probe

extern "C" __global__ void __launch_bounds__(256, 2)
#if PROBE_MODE >= 2
    __cluster_dims__(PROBE_ITEMS, 1, 1)
#endif
        hipmla_probe_cluster(const MlaDecodeParams p, int* smids) {
    using namespace hipmla;
    using namespace probe;
    extern __shared__ __align__(16) unsigned char probe_smem[];
    Smem& sm = *reinterpret_cast<Smem*>(probe_smem);
    const int tid = int(thread_index());
    const int b = int(block_index());
    // Clusters of N tile the 1-D grid in order: block b is rank b % N of cluster b / N (mode 2).
    const int row = b / N, k = b % N;
    if (tid == 0) smids[b] = sm_id();
    // The partial as the kernel leaves it after its last tile: acc in shared memory, m, l.
    for (int x = tid; x < HEADS * D_V; x += THREADS) sm.acc[x / D_V][x % D_V] = acc_value(b, x / D_V, x % D_V);
    if (tid < HEADS) {
        sm.m[tid] = m_value(b, tid);
        sm.l[tid] = l_value(b, tid);
    }
    block_sync();
    constexpr int QUADS = D_V / 4;
    constexpr int OUT_STEPS = HEADS * QUADS / THREADS;
#if PROBE_MODE == 0
    for (int s = 0; s < OUT_STEPS; ++s) {
        const int x = tid + s * THREADS, head = x / QUADS, d = 4 * (x % QUADS);
        const f32x4 a = *reinterpret_cast<const f32x4*>(&sm.acc[head][d]);
        const float lh = sm.l[head];
        store_global(reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) + ((long long)row * HEADS + head) * D_V + d),
                     u32x2{pack_bf16x2(a.x / lh, a.y / lh), pack_bf16x2(a.z / lh, a.w / lh)});
    }
#elif PROBE_MODE == 1 || PROBE_MODE == 3
    if (tid < HEADS) {
        p.part_ml[(b * HEADS + tid) * 2] = sm.m[tid];
        p.part_ml[(b * HEADS + tid) * 2 + 1] = sm.l[tid];
    }
    f32x4 quad[OUT_STEPS];
#pragma unroll
    for (int s = 0; s < OUT_STEPS; ++s) {
        const int x = tid + s * THREADS;
        quad[s] = *reinterpret_cast<const f32x4*>(&sm.acc[x / QUADS][4 * (x % QUADS)]);
    }
#pragma unroll
    for (int s = 0; s < OUT_STEPS; ++s) {
        const int x = tid + s * THREADS;
        store_global(reinterpret_cast<f32x4*>(p.part_acc + ((long long)b * HEADS + x / QUADS) * D_V + 4 * (x % QUADS)), quad[s]);
    }
    WorkItem it;
    it.seq = row;
    it.row = row;
    it.begin = 0;
    it.end = 1;
    it.slot = b;
    it.first_slot = row * N;
    it.slot_stride = 1;
    it.n_items = N;
    it.bad = 0;
    it.fast = 0;
    if (N > 1) merge_split_row<THREADS>(p, it, &sm.flag);
#if PROBE_MODE == 3
    cluster_sync();
#endif
#else
    cluster_sync();
    constexpr int G = D_V / 4;
    const int g0 = k * G / N, g1 = (k + 1) * G / N;
    // A share is at most ceil(G / N) groups: one instantiation, no spills.
    constexpr int STEPS = ((G + N - 1) / N + LANES - 1) / LANES;
    merge_share<STEPS>(p, sm, row, g0, g1);
    cluster_sync();
#endif
}
