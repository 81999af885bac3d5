// Which work item a block runs: the first block to reach each SM runs the first items.
//
// Why. The grid holds a block for the largest step (max_items, more than twice the SMs);
// a step with fewer items than SMs leaves the rest empty. Item i used to be block i's, and
// the hardware does not spread a launch's first blocks one an SM: on the H200 8 x 8k's 128
// items (blocks 0..127) ran on 120 SMs, 8 of them two items, and those 8 set the step's
// time (scripts/sm90_timeline.py, scripts/results/h200-2026-12-04-sm90-timeline-placement.txt;
// the same kernel launched so that one block fits an SM took 34.0 us instead of 48.6).
// With p.placement set, the block that comes first to an SM (its "first" block) takes
// the next of the items [0, E), E = min(p.placement_sms, grid), and every other block
// (a "second" block) the next of [E, grid): a step of n <= E items runs one item an SM
// whatever order the blocks come in, as long as n SMs get a block of the launch (an item
// a gap claim takes, below, runs beside another), and nobody waits for anybody.
//
// Protocol (p.placement: the decoder's scratch, zero between launches; thread
// THREADS - 1 of each block, between the schedule's two scans):
//   words 0, 1  one u64 of three 21-bit counts: firsts' claims f (bits 0..20), seconds'
//               claims s (21..41), gap claims g (42..62);
//   words PLACEMENT_HEADER + s  blocks that came to SM s (s < p.placement_sms), padded to a
//               multiple of 4 words (placement_words), 16-byte aligned.
//   1. At the block's start: rank = atomic add on its SM's word (placement_arrive); an SM
//      id outside [0, p.placement_sms) (none on AMD: sm_id() < 0) makes a second block.
//   2. A first block adds 1: its item is f_old. A second block adds 2^21: its item is
//      E + s_old while that is below grid. Past grid, an SM had no first block (held by
//      other work, or fewer SMs than counted: a partitioned GPU), and its first items
//      [f, E) would be left: the block adds 2^42 and takes E - 1 - g_old. A second block
//      passes grid only when fewer than E first blocks come (there are grid - f seconds,
//      grid - E of them below grid), E - f of them, so the firsts' [0, f) and the gap
//      claims' [f, E) meet exactly, in whatever order they come. An item at or past the
//      step's count (items are [0, n)) is no item: the block returns.
//   3. The claim after which f + s = grid and g = max(0, E + s - grid) is the launch's
//      last access to the words (every block's SM word was counted before its claim):
//      that block resets them.
// Cost, in thread THREADS - 1: the SM word's atomic (none for an SM id out of range),
// issued at the block's start and waited for after the first scan; a device-scope fence
// and the claim's atomic (a second one for a gap claim) before the second scan's barrier,
// which the other threads reach after the chunk and item counts; the reset (16-byte
// stores, none waited for) in one block. On the H200 (a7d4087, the A/B file below): 25-35%
// off steps of at most one item an SM that the hardware had doubled up (mxfp4 8 x 8k
// 48.4 -> 34.0 us, 2 x 32k 61.7 -> 41.0), 0-2% on steps of more items than SMs but at
// most E rows (64 x 8k 125.4 -> 126.4, rag64 185.1 -> 188.8), where it cannot help.
// Measured before this form (H200, 2026-12-04, scripts/sm90_ablation.py --no-placement,
// scripts/results/h200-2026-12-04-sm90-placement-ab.txt): a second block that waited
// until E first blocks had claimed (or 2 us) cost the steps of more items than SMs 1-2%
// (mxfp4 64 x 8k 124.9 -> 126.0 us); a reset by atomic exchanges (one thread's 132 of
// them, each waited for: they wrote the same register) took that block 35 us (4 x 1k
// 17.4 -> 40.0 us).
#pragma once

#include "params.h"
#include "common/platform.h"
#include "core/paged.h"

namespace hipmla {

constexpr int PLACEMENT_HEADER = 4;  // the claim word, then padding: the SM words start 16-byte aligned
constexpr int PLACEMENT_BITS = 21;   // of each count in the claim word
// A grid of this many blocks or more runs item i on block i (the counts would not fit).
constexpr unsigned PLACEMENT_MAX_GRID = 1u << PLACEMENT_BITS;
constexpr unsigned long long PLACEMENT_MASK = PLACEMENT_MAX_GRID - 1u;

// int32 words of p.placement for `sms` SMs (hipmla.kernels.placement_words).
HIPMLA_DEVICE constexpr int placement_words(int sms) { return PLACEMENT_HEADER + (sms + 3) / 4 * 4; }

// Whether this launch hands its items out (block-uniform: the same for every block). Not
// for a grid too large for the counts, nor for a step of more than E rows: every row is an
// item at least, and with more items than SMs the order cannot matter to a kernel of two
// blocks an SM (the sm_90 kernel) -- the two block slots hold the first wave, so no SM
// gets a third item while another has none, and some SM has two anyway. (A kernel of
// more blocks an SM, such as the portable one, could put three on one SM there; the
// protocol does not order past first and second blocks either.) On the H200 the protocol
// cost such steps ~1% (mxfp4 256 x 1k 71.9 -> 72.8 us). Assumed, seen on the H200 only:
// %smid below the device's SM count (0 .. 131); a partitioned GPU whose ids are not is
// still right (such blocks are seconds), only not placed.
HIPMLA_DEVICE bool placement_pays(const MlaDecodeParams& p) {
    const unsigned grid = block_count();
    if (p.placement == nullptr || grid >= PLACEMENT_MAX_GRID) return false;
    const long long rows = step_rows(p);
    return rows <= (long long)(unsigned(p.placement_sms) < grid ? unsigned(p.placement_sms) : grid);
}

// Step 1: whether this block is its SM's first.
HIPMLA_DEVICE bool placement_arrive(const MlaDecodeParams& p) {
    const int s = sm_id();
    if (s < 0 || s >= p.placement_sms) return false;
    return atomic_add_device(p.placement + PLACEMENT_HEADER + s, 1) == 0;
}

struct PlacementCounts {
    unsigned f, s, g;
};

HIPMLA_DEVICE PlacementCounts placement_counts(unsigned long long w) {
    return PlacementCounts{unsigned(w & PLACEMENT_MASK), unsigned((w >> PLACEMENT_BITS) & PLACEMENT_MASK),
                           unsigned((w >> 2 * PLACEMENT_BITS) & PLACEMENT_MASK)};
}

// Whether the claim word `w` (after a claim) is the launch's last: every block claimed.
HIPMLA_DEVICE bool placement_done(unsigned long long w, unsigned e, unsigned grid) {
    const PlacementCounts c = placement_counts(w);
    const unsigned gaps = e + c.s > grid ? e + c.s - grid : 0u;
    return c.f + c.s == grid && c.g == gaps;
}

// Step 2: the item this block runs (>= the step's items: none); `last`: this block resets
// the words. grid < PLACEMENT_MAX_GRID.
HIPMLA_DEVICE int placement_claim(const MlaDecodeParams& p, bool first, bool& last) {
    unsigned long long* word = reinterpret_cast<unsigned long long*>(p.placement);
    const unsigned grid = block_count();
    const unsigned e = unsigned(p.placement_sms) < grid ? unsigned(p.placement_sms) : grid;
    // Release: this block's SM word was counted before its claim, so the last claimer's
    // reset comes after it.
    fence_release_device();
    const unsigned long long add = first ? 1ull : 1ull << PLACEMENT_BITS;
    unsigned long long old = atomic_add_device_u64(word, add);
    const PlacementCounts c = placement_counts(old);
    if (first || e + c.s < grid) {
        last = placement_done(old + add, e, grid);
        return int(first ? c.f : e + c.s);
    }
    const unsigned long long gap = 1ull << 2 * PLACEMENT_BITS;
    old = atomic_add_device_u64(word, gap);
    last = placement_done(old + gap, e, grid);
    return int(e - 1u - placement_counts(old).g);
}

// Step 3, by the block whose claim was the launch's last.
HIPMLA_DEVICE void placement_reset(const MlaDecodeParams& p) {
    fence_acquire_device();
    f32x4* words = reinterpret_cast<f32x4*>(p.placement);
    const f32x4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < placement_words(p.placement_sms) / 4; ++i) store_global(words + i, zero);
}

}  // namespace hipmla
