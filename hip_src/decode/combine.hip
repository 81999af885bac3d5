// Combine: one block per sequence merges the partial slots seq_slots[b] ..
// seq_slots[b+1]-1 the split kernel wrote into the bf16 output (+ natural-log LSE).
// A sequence without slots was finished by the split kernel itself and is skipped.
// Numerics: hip_src/KERNELS.md, step 5.
//
// Thread = (head h = tid / 16, lane i = tid % 16); lane i owns columns 4 * (i + 16 * k),
// k = 0..7, so the 16 lanes of a head read 256 contiguous bytes per step. Every lane
// reads the slots' (m, l) of its head itself; that is a handful of cached loads.
#include "params.h"
#include "common/config.h"
#include "common/numerics.h"
#include "common/platform.h"

namespace hipmla {
namespace combine {

constexpr int LANES = BLOCK_THREADS / HEADS;
constexpr int VEC = 4;
constexpr int STEPS = D_V / (LANES * VEC);
static_assert(STEPS * LANES * VEC == D_V, "lanes must cover the V columns");

}  // namespace combine
}  // namespace hipmla

HIPMLA_KERNEL(hipmla::BLOCK_THREADS) void hipmla_decode_combine(const MlaDecodeParams p) {
    using namespace hipmla;
    using namespace hipmla::combine;

    const int seq = int(block_index());
    const int first = p.seq_slots[seq];
    const int last = p.seq_slots[seq + 1];
    if (first == last) return;

    const int tid = int(thread_index());
    const int h = tid / LANES;
    const int i = tid % LANES;
    const float* ml = p.part_ml + h * 2;  // slot s: ml[s * HEADS * 2 + {0: m, 1: l}]

    float big_m = f32_from_bits(0xff800000u);
    for (int s = first; s < last; ++s) {
        const float m = ml[(long long)s * HEADS * 2];
        big_m = m > big_m ? m : big_m;
    }
    // All slots empty: weights would be exp2(-inf - -inf); the state is the empty one.
    const bool empty = big_m == f32_from_bits(0xff800000u);
    const float shift = empty ? 0.0f : big_m;

    float acc[STEPS][VEC];
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[k][e] = 0.0f;
    }
    float big_l = 0.0f;
    for (int s = first; s < last; ++s) {
        const float w = exp2_f32(ml[(long long)s * HEADS * 2] - shift);
        big_l += w * ml[(long long)s * HEADS * 2 + 1];
        const f32x4* part = reinterpret_cast<const f32x4*>(p.part_acc + ((long long)s * HEADS + h) * D_V);
#pragma unroll
        for (int k = 0; k < STEPS; ++k) {
            const f32x4 a = part[i + LANES * k];
            acc[k][0] += w * a.x;
            acc[k][1] += w * a.y;
            acc[k][2] += w * a.z;
            acc[k][3] += w * a.w;
        }
    }

    const bool zero = big_l <= 0.0f;
    u32x2* out = reinterpret_cast<u32x2*>(static_cast<unsigned short*>(p.out) + ((long long)seq * HEADS + h) * D_V);
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = zero ? 0.0f : acc[k][e] / big_l;
        out[i + LANES * k] = u32x2{pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3])};
    }
    if (i == 0 && p.lse != nullptr) {
        p.lse[seq * HEADS + h] = zero ? f32_from_bits(0xff800000u) : (big_m + log2_f32(big_l)) * 0.6931471805599453f;
    }
}
