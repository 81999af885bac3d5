// The device-side schedule: which work item a block of the decode grid runs, derived
// from the batch itself (kv_indptr and, paged, kv_last_page_len; qo_indptr for several
// query tokens), so the host passes nothing that changes from step to step and no
// metadata kernel runs before the decode.
//
// Every block computes the same split from the same lengths (hipmla/schedule.py is the
// bit-for-bit host model; tests/test_schedule.py holds them together):
//
//   rows_s = ceil(n_s / row_tokens) x head_groups: sequence s's rows (16 heads of one of its
//            n_s query tokens, or row_tokens of them below 16 (64 in the 64-row kernel) heads)
//   total  = sum over s of len_s x rows_s (the work, in token-rows)
//   chunk  = round_up(max(ceil(total / split_target), split_min_tokens), split_align)
//   k_s    = max(ceil(len_s / chunk), 1) token ranges of sequence s; when
//            split_max_ranges > 0 at most max(split_max_ranges, ceil(len_s /
//            split_long_range)) of them (longer items instead: a row's merge grows with
//            its slots, but ranges of split_long_range tokens are worth theirs), cut on
//            split_align units as evenly as possible: range k = units [floor(U k / k_s),
//            floor(U (k+1) / k_s)) with U = ceil(len_s / split_align), clamped to len_s;
//   lone   split_lone_items > 0 and chunk < split_lone_below: the same with chunk from
//            split_lone_items (one item per SM) and split_lone_max_ranges, if that gives
//            at most split_lone_items items (short items run faster one to an SM than two;
//            measured in hipmla/schedule.py). Both counts go through one scan.
//   fast_tile > 0: a last range with whole fast tiles and a remainder becomes two ranges
//            (the whole tiles, then the remainder), so every range is either whole tiles
//            for the arch's fast kernel or shorter than one tile.
//   items  = k_s x rows_s per sequence, range-major: item (k, r) of s is number
//            first_s + k rows_s + r, so the rows that read the same kv range run side by
//            side (they share it through L2). Row r = query token j = r / head_groups,
//            head group r % head_groups (row_tokens > 1: query tokens j = r row_tokens ..
//            + queries - 1); its item covers the range clamped to the tokens its last
//            query token j sees: len_s - n_s + j + 1 (causal within the step; the kernel
//            masks what an earlier token of the row does not see).
//            The items of one row are slots first_s + r + k rows_s (stride rows_s).
//
// Item i is block i's and writes partial slot i. A sequence whose indptr entries are
// invalid (core/paged.h, ERR_*) counts as empty and its items are `bad`; so is an item
// whose page ids leave the cache (each block checks the pages of its own item), and every
// row of a sequence with fewer kv tokens than query tokens (ERR_Q_LEN; without qo_indptr
// an empty sequence is valid: output 0, LSE -inf). An invalid qo_indptr (a range that
// falls, a negative entry, not 0 .. q_tokens) voids the whole step: no block gets an item
// (no output is written, no counter moves) and block 0 sets ERR_QO. Bad items go to the portable kernel, never to a
// fast kernel (`fast`); the block that runs one sets the error word (report_bad_item) and
// writes NaN (output, or partial: the merge turns one NaN partial into a NaN output).
// Sum over s of k_s rows_s <= total / chunk + sum rows_s <= split_target + t_q head_groups
// (chunk >= total / split_target; the lone split has at most split_lone_items), plus as
// much again with fast_tile: max_items() sizes
// the grid and the scratch. Cost per block: ceil(b / THREADS) length reads per thread and
// two block scans (one barrier each up to SMALL_SCAN sequences, else three); divisions
// in 32 bits where the values fit.
#pragma once

#include "params.h"
#include "common/platform.h"
#include "core/paged.h"
#include "core/placement.h"

namespace hipmla {

struct WorkItem {
    int seq;         // -1: the grid is sized for the largest split; this block has no item
    int row;         // 16 heads of one query token, or it.queries tokens from this one on (row_heads
                     // below): q, out, lse and the counter of row
    int begin, end;  // tokens [begin, end) of the sequence
    int slot;        // this item's partial slot
    int first_slot;  // the slot of the row's first item
    int slot_stride; // its items' slots are first_slot + k slot_stride
    int n_items;     // items of the row; 1: the item writes the output itself
    int bad;         // ERR_* bits: the item writes NaN instead of reading its rows
    int fast;        // whole fast_tile tiles of a valid item: the arch's fast kernel runs it
    int queries;     // query tokens of the row (1; with p.row_tokens > 1 up to that many: a kernel's
                     // 64-row or, below 16 heads, 16-slot row)
    int sees;        // kv tokens its last query token sees (end <= sees; the earlier ones see fewer)
};

// A row of the 16-head kernels below 16 heads packs p.row_tokens query tokens, 16 / h_q
// rounded down to a power of two (8 heads x 2, 4 x 4, 5 x 2, 3 x 4, ...): head slot h of
// the row is head h % heads_in_row of its query token h / heads_in_row, and since q, out
// and lse are [token][head], slot h's entry is head_index(p, it.row, h) for the row's first
// token it.row, as at one token a row. The row's slots past its query tokens' heads get
// zero Q and write nothing.

// Slots of the item's row that are query heads of the step (16 at 16+ heads).
HIPMLA_DEVICE int row_heads(const MlaDecodeParams& p, const WorkItem& it) { return it.queries * heads_in_row(p); }
// Tokens of the item head slot h sees from it.begin on: its query token's causal bound
// (the row's last token sees it.sees, each earlier one a token less) within the item's
// (none of a bad item's, which reads nothing); <= 0 where it sees none of them. The
// kernels mask the slot's scores past it.
HIPMLA_DEVICE int slot_tokens(const MlaDecodeParams& p, const WorkItem& it, int h) {
    const int n = it.bad ? 0 : it.end - it.begin;
    if (it.queries <= 1) return n;
    const int sees = it.sees - (it.queries - 1 - h / heads_in_row(p)) - it.begin;
    return sees < n ? sees : n;
}

// Values per first-level group of the block scan: THREADS / SCAN_GROUP group sums.
constexpr int SCAN_GROUP = 16;
// A batch of at most this many sequences takes the one-barrier scan.
constexpr int SMALL_SCAN = 8;

template <int THREADS>
struct ScheduleSmem {
    long long scan[THREADS];
    long long group_sum[THREADS / SCAN_GROUP];
    WorkItem item;
    int claimed;  // the item placement_claim gave this block
    int bad_page;
    int qo_bad;
};

// Exclusive prefix sum over the block of one value per thread; `total` gets the sum.
// `set` (0, 1) is the schedule's first or second scan. Only `active` threads (those with
// sequences) get the sum and their prefix; the others get 0 and only meet the barriers.
// Every block runs the schedule before its first load, all blocks at once: on the H200
// (4 x 1k, 2 blocks of 8 warps an SM) it took ~3.7 us while every warp ran all of it,
// though a batch of 4 gives one warp any work; 3.0 since. Its barriers wait for the
// slowest warp, and Nsight Compute put 2,072 of the schedule's 3,911 stall samples at
// them (32 x 1k, 2026-12-03).
// A batch of at most SMALL_SCAN sequences (one a thread: threads 0 .. batch - 1): one
// barrier. The values go to their set's SMALL_SCAN entries, so the second scan's stores
// need not wait for the first's readers, and each active thread adds all of them itself
// (broadcast loads, all in flight at once). On the H200 (sm_90 kernel, A/B in one
// process, L2 flushed, scripts/results/h200-2026-12-03-sm90-ab-merge-small-scan.txt) it
// took mxfp4 / fp8 4 x 1k 17.6 -> 17.1 / 17.2 -> 16.5 us and 4 x 8k 32.9 -> 32.4 /
// 32.0 -> 31.2; with SMALL_SCAN 32 the 32 x 1k batch ran 0.3-1.0 us slower instead.
// Otherwise two levels through shared memory, three barriers (a log-step scan takes two
// per step, 18 at 256 threads): one thread per group of SCAN_GROUP sums its group, then
// every thread adds the group sums before its own and the values before it in its group
// (2 SCAN_GROUP loads, mostly broadcasts).
template <int THREADS>
HIPMLA_DEVICE long long block_exclusive_scan(long long v, ScheduleSmem<THREADS>& sm, int set, int batch, long long& total,
                                             bool active) {
    static_assert(THREADS % SCAN_GROUP == 0, "whole scan groups");
    static_assert(2 * SMALL_SCAN <= THREADS, "both small scans fit the scan array");
    constexpr int GROUPS = THREADS / SCAN_GROUP;
    const int tid = int(thread_index());
    long long before = 0, all = 0;
    if (batch <= SMALL_SCAN) {  // block-uniform
        long long* scan = sm.scan + set * SMALL_SCAN;
        if (active) scan[tid] = v;
        block_sync();
        if (active) {
#pragma unroll
            for (int j = 0; j < SMALL_SCAN; ++j) {
                const long long x = j < batch ? scan[j] : 0;
                all += x;
                before += j < tid ? x : 0;
            }
        }
        total = all;
        return before;
    }
    sm.scan[tid] = v;
    block_sync();
    if (tid < GROUPS) {
        long long sum = 0;
        for (int i = 0; i < SCAN_GROUP; ++i) sum += sm.scan[SCAN_GROUP * tid + i];
        sm.group_sum[tid] = sum;
    }
    block_sync();
    const int group = tid / SCAN_GROUP;
    if (active) {
        for (int k = 0; k < GROUPS; ++k) {
            const long long sum = sm.group_sum[k];
            all += sum;
            before += k < group ? sum : 0;
        }
        // A fixed trip count, so the SCAN_GROUP loads issue together (the loop to tid was a
        // chain of dependent shared-memory round trips, up to 15 of them).
#pragma unroll
        for (int i = 0; i < SCAN_GROUP; ++i) {
            const int j = SCAN_GROUP * group + i;
            before += j < tid ? sm.scan[j] : 0;
        }
    }
    total = all;
    block_sync();  // sm is free for the next scan
    return before;
}

// a / b for 0 <= a and 1 <= b, in 32 bits whenever both fit: a 64-bit division is a
// subroutine of dependent instructions, and the schedule's chunk and range divisions sit
// in front of every block's first load.
HIPMLA_DEVICE long long div_nonneg(long long a, long long b) {
    if ((((unsigned long long)a | (unsigned long long)b) >> 32) == 0) return (long long)(unsigned(a) / unsigned(b));
    return a / b;
}

// Items of a sequence of `len` tokens, and the token range of its item k.
struct SeqSplit {
    long long chunk;
    int align, fast_tile, max_ranges, long_range;

    HIPMLA_DEVICE int base_items(int len) const {
        // 0 <= len and 1 <= chunk <= INT32_MAX (schedule_item clamps it: a chunk of at least
        // len_s is one item either way), so the sum fits 32 bits unsigned: every thread runs
        // this for its sequences, and a 32-bit division is a fraction of a 64-bit one.
        // (len < 0 cannot come from seq_extent; it would be one item here, as before.)
        unsigned n = len > 0 ? (unsigned(len) + unsigned(chunk) - 1u) / unsigned(chunk) : 0u;
        if (max_ranges > 0) {
            const unsigned step = long_range > 0 ? unsigned(long_range) : 0x7fffffffu;
            const unsigned longs = len > 0 ? (unsigned(len) + step - 1u) / step : 0u;
            const unsigned cap = longs > unsigned(max_ranges) ? longs : unsigned(max_ranges);
            if (n > cap) n = cap;
        }
        return n > 1 ? int(n) : 1;
    }
    // n = base_items(len).
    HIPMLA_DEVICE bool tail_item(int len, int n) const {
        if (fast_tile <= 0) return false;
        const long long units = (unsigned(len) + unsigned(align) - 1u) / unsigned(align);
        const long long last_begin = div_nonneg(units * (n - 1), n) * align;
        const int tail = len % fast_tile;
        return tail > 0 && len - last_begin > tail;
    }
    // n = base_items(len), which the caller has.
    HIPMLA_DEVICE void range(int len, int n, int k, int& begin, int& end) const {
        const long long units = (unsigned(len) + unsigned(align) - 1u) / unsigned(align);
        if (k == n) {  // the remainder item after the last item's whole tiles
            begin = len - len % fast_tile;
            end = len;
            return;
        }
        const long long b = div_nonneg(units * k, n) * align;
        const long long e = div_nonneg(units * (k + 1), n) * align;
        begin = int(b < len ? b : len);
        end = int(e < len ? e : len);
        if (k == n - 1 && tail_item(len, n)) end = len - len % fast_tile;
    }
};

// The split aiming at `target` items over `total` token-rows: its chunk (rounded up to
// the alignment, at least split_min_tokens; clamped to 32 bits: a chunk of at least a
// sequence's length is one item either way) and at most `max_ranges` ranges a sequence.
HIPMLA_DEVICE SeqSplit seq_split(const MlaDecodeParams& p, long long total, int target, int max_ranges) {
    long long chunk = div_nonneg(total + target - 1, target);
    chunk = chunk > p.split_min_tokens ? chunk : p.split_min_tokens;
    chunk = (chunk + p.split_align - 1) & ~(long long)(p.split_align - 1);  // a power of two: no division
    return SeqSplit{chunk < 0x7fffffffLL ? chunk : 0x7fffffffLL, p.split_align, p.fast_tile, max_ranges,
                    p.split_long_range};
}

// The lone split is tried only for steps of fewer rows than this (hipmla.schedule.LONE_MAX_ROWS).
constexpr long long LONE_MAX_ROWS = 1LL << 30;
// The fit (hipmla.schedule.FIT_EIGHTHS): a usual split of more than split_target items
// takes the first of the chunks usual + usual e / 8 (e in FIT_EIGHTHS, rounded up to the
// alignment) that gives at most split_target. The second scan then counts the usual,
// lone and both fit splits in 16 bits each, which they fit below FIT_MAX_ROWS rows +
// max(split_target, split_lone_items).
// Built for NVIDIA and the CPU harness only: in the gfx950 / gfx942 builds, whose schedules
// already hold 104-106 SGPRs, it spilled 4-14 of them (tests/test_aot.py's budget is 0), so
// there p.split_fit is ignored and the decoder leaves it 0 (hipmla.schedule.SplitPolicy.fit).
// FIT_EIGHTHS = {1, 4} (a function: nvcc keeps a constexpr array out of device code).
HIPMLA_DEVICE constexpr int fit_eighths(int k) { return k == 0 ? 1 : 4; }
constexpr long long FIT_MAX_ROWS = 1LL << 15;
#if defined(__CUDACC__) || defined(HIPMLA_HOST_PLATFORM)
constexpr bool FIT_BUILT = true;
#else
constexpr bool FIT_BUILT = false;
#endif

HIPMLA_DEVICE SeqSplit fit_split(const MlaDecodeParams& p, const SeqSplit& usual, int k) {
    long long c = usual.chunk + usual.chunk * fit_eighths(k) / 8;
    c = (c + p.split_align - 1) & ~(long long)(p.split_align - 1);
    return SeqSplit{c < 0x7fffffffLL ? c : 0x7fffffffLL, usual.align, usual.fast_tile, usual.max_ranges, usual.long_range};
}

// Field k (16 bits) of the fit's packed counts: 0 fit 2, 1 fit 1, 2 lone, 3 usual.
HIPMLA_DEVICE long long fit_field(long long x, int k) { return (x >> (16 * k)) & 0xffff; }

// Records a bad item's ERR_* bits in the error word (one thread; kept out of
// schedule_item, where the fast kernels would pay registers for an atomic they never need).
HIPMLA_DEVICE void report_bad_item(const MlaDecodeParams& p, const WorkItem& it) {
    if (it.bad && thread_index() == 0 && p.errors != nullptr) atomic_or_device(p.errors, it.bad);
}

// `block`: the block's index, its item unless p.placement hands the items out
// (core/placement.h: thread THREADS - 1 claims one between the two scans).
// MAX_ROW_TOKENS > 1: a kernel whose row may hold several query tokens (p.row_tokens, at
// most this many: the 64-row kernel's 4, the 16-head kernels' 16 below 16 heads); with
// p.row_tokens 1 (16+ heads) the rows need no division.
template <int THREADS, int MAX_ROW_TOKENS = 1>
HIPMLA_DEVICE WorkItem schedule_item(const MlaDecodeParams& p, int block, ScheduleSmem<THREADS>& sm) {
    const int tid = int(thread_index());
    // The last thread has no sequence while the batch is below THREADS: its atomics wait
    // beside the other threads' length reads, not in front of them.
    const bool placed = placement_pays(p);
    const bool claimer = placed && tid == THREADS - 1;
    const bool first_on_sm = claimer && placement_arrive(p);
    const int per = (p.batch + THREADS - 1) / THREADS;
    const int s0 = tid * per < p.batch ? tid * per : p.batch;
    const int s1 = s0 + per < p.batch ? s0 + per : p.batch;
    const int groups = head_groups(p);
    // rt = 2^rt_shift: a row count is a shift, and held in a vector register (opaque_int):
    // as a division, then as a scalar, it cost the CDNA builds 2-8 SGPRs they did not have.
    const int rt_shift = MAX_ROW_TOKENS > 1 ? opaque_int(row_token_shift(p)) : 0;
    const int rt = 1 << rt_shift;
    // A sequence's rows: its query tokens in groups of rt, times the head groups.
    auto seq_rows = [&](int n) { return ((n + rt - 1) >> rt_shift) * groups; };

    long long mine = 0;
    int qo_bad = 0;
    // The thread's first sequence (its only one while the batch is at most THREADS) stays
    // in registers for the count and the search: read again after the scans' barriers, it
    // was a load round trip in front of each.
    SeqExtent e0{0, 0};
    SeqQuery q0{0, 0, 0};
    for (int s = s0; s < s1; ++s) {
        const SeqQuery qy = seq_query(p, s);
        const SeqExtent e = seq_extent(p, s);
        if (s == s0) {
            e0 = e;
            q0 = qy;
        }
        qo_bad |= qy.bad;
        mine += (long long)e.tokens * seq_rows(qy.n);
    }
    // A thread with no sequence has no item to find: past the scans it only meets barriers.
    const bool active = s0 < s1;
    long long total = 0;
    block_exclusive_scan<THREADS>(mine, sm, 0, p.batch, total, active);
    if (claimer) {
        bool last = false;
        sm.claimed = placement_claim(p, first_on_sm, last);  // published by the second scan's barrier
        if (last) placement_reset(p);
    }

    // (No thread without a sequence uses the splits: it has no total.)
    const SeqSplit usual = seq_split(p, total, p.split_target, p.split_max_ranges);
    // The lone split (hipmla/schedule.py, split_ranges): the usual chunk is short, so the
    // split aiming at split_lone_items items runs if it gives at most that many. Both
    // splits' counts go through the second scan in one 64-bit value, 32 bits each: the
    // row bound keeps each total below 2^31 (at most 2 (target + rows) items).
    // (q_tokens > 0: the row bound below trusts it, and the qo_indptr check only runs then.)
    const int most_items = p.split_target > p.split_lone_items ? p.split_target : p.split_lone_items;
    const bool lone_try = active && p.split_lone_items > 0 && p.q_tokens > 0 && usual.chunk < p.split_lone_below &&
                          (long long)p.q_tokens * groups + most_items < LONE_MAX_ROWS;
    const SeqSplit lone = lone_try ? seq_split(p, total, p.split_lone_items, p.split_lone_max_ranges) : usual;
    // The fit's counts ride along in the same scan (16 bits each) where every count fits.
    const bool fit_try = FIT_BUILT && active && p.split_fit != 0 && step_rows(p) + most_items < FIT_MAX_ROWS;

    // The thread's first sequence's item count, kept for the search below (the one
    // sequence of every thread while the batch is at most THREADS).
    int first_base = 0, first_base_lone = 0;
    long long count = 0, count_lone = 0, count_fit0 = 0, count_fit1 = 0;
    for (int s = s0; s < s1; ++s) {
        const int len = s == s0 ? e0.tokens : seq_extent(p, s).tokens;
        const int rows = seq_rows((s == s0 ? q0 : seq_query(p, s)).n);
        const int base = usual.base_items(len);
        count += (long long)(base + (usual.tail_item(len, base) ? 1 : 0)) * rows;
        int base_lone = 0;
        if (lone_try) {
            base_lone = lone.base_items(len);
            count_lone += (long long)(base_lone + (lone.tail_item(len, base_lone) ? 1 : 0)) * rows;
        }
        if (fit_try) {
            const SeqSplit f0 = fit_split(p, usual, 0), f1 = fit_split(p, usual, 1);
            const int b0 = f0.base_items(len), b1 = f1.base_items(len);
            count_fit0 += (long long)(b0 + (f0.tail_item(len, b0) ? 1 : 0)) * rows;
            count_fit1 += (long long)(b1 + (f1.tail_item(len, b1) ? 1 : 0)) * rows;
        }
        if (s == s0) {
            first_base = base;
            first_base_lone = base_lone;
        }
    }
    if (tid == 0) {
        sm.item = WorkItem{-1, -1, 0, 0, -1, -1, 0, -1, 0, 0, 0, 0};
        sm.bad_page = 0;
        // qo_indptr must run from 0 to the query tokens of q, besides rising everywhere.
        sm.qo_bad = p.qo_indptr != nullptr &&
                    (p.qo_indptr[0] != 0 || (p.q_tokens > 0 && p.qo_indptr[p.batch] != p.q_tokens));
    }
    long long n_all = 0;
    const long long packed = fit_try ? count << 48 | count_lone << 32 | count_fit0 << 16 | count_fit1
                             : lone_try ? count << 32 | count_lone
                                        : count;
    long long first = block_exclusive_scan<THREADS>(packed, sm, 1, p.batch, n_all, active);
    bool take_lone = false;
    int fit = 0;  // the fit's chunk taken: 1 or 2 (FIT_EIGHTHS[fit - 1]); 0 none
    if (fit_try) {
        take_lone = lone_try && fit_field(n_all, 2) <= p.split_lone_items;
        if (!take_lone && fit_field(n_all, 3) > p.split_target)
            fit = fit_field(n_all, 1) <= p.split_target ? 1 : fit_field(n_all, 0) <= p.split_target ? 2 : 0;
        first = fit_field(first, take_lone ? 2 : fit ? 2 - fit : 3);
        count = take_lone ? count_lone : fit == 1 ? count_fit0 : fit == 2 ? count_fit1 : count;
    } else if (lone_try) {
        constexpr long long LOW = 0xffffffffLL;
        take_lone = (n_all & LOW) <= p.split_lone_items;
        first = take_lone ? first & LOW : first >> 32;
        count = take_lone ? count_lone : count;
    }
    first_base = take_lone ? first_base_lone : first_base;
    const SeqSplit split = take_lone ? lone : fit ? fit_split(p, usual, fit - 1) : usual;
    if (fit) first_base = split.base_items(e0.tokens);
    if (placed) block = sm.claimed;
    if (qo_bad) atomic_or_block(&sm.qo_bad, 1);  // after the scan's syncs: thread 0 set it first
    if (block >= first && block < first + count) {
        for (int s = s0; s < s1; ++s) {
            const SeqExtent e = s == s0 ? e0 : seq_extent(p, s);
            const SeqQuery qy = s == s0 ? q0 : seq_query(p, s);
            const int base = s == s0 ? first_base : split.base_items(e.tokens);
            const int n = base + (split.tail_item(e.tokens, base) ? 1 : 0);
            const int rows = seq_rows(qy.n);
            if (block < first + (long long)n * rows) {
                const int local = int(block - first);
                // One query token of 16 heads (rows = 1) needs no division.
                const int k = rows == 1 ? local : local / rows, r = rows == 1 ? 0 : local % rows;
                // The row's first query token j (of rt) and how many it has.
                const int j = (groups == 1 ? r : r / groups) << rt_shift;
                const int queries = rt == 1 ? 1 : (qy.n - j < rt ? qy.n - j : rt);
                WorkItem it;
                it.seq = s;
                it.row = (qy.first + j) * groups + (groups == 1 ? 0 : r % groups);
                split.range(e.tokens, base, k, it.begin, it.end);
                // Causal within the step: query token j of n sees len - n + j + 1 tokens;
                // the item covers what the row's last one sees.
                const int sees = e.tokens - qy.n + j + queries;
                const int short_seq = p.qo_indptr != nullptr && !e.bad && e.tokens < qy.n;
                if (it.end > sees) it.end = sees > 0 ? sees : 0;
                if (it.begin > it.end) it.begin = it.end;
                it.slot = block;
                it.first_slot = int(first) + r;
                it.slot_stride = rows;
                it.n_items = n;
                it.bad = e.bad | (short_seq ? ERR_Q_LEN : 0);
                it.fast = 0;
                it.queries = queries;
                it.sees = sees > 0 ? sees : 0;
                sm.item = it;
                break;
            }
            first += (long long)n * rows;
        }
    }
    block_sync();
    WorkItem it = sm.item;
    if (sm.qo_bad) {
        // Rows of sequences may overlap or fall past the grid: the step computes nothing
        // (no output, no counter touched) and block 0 reports it.
        if (block == 0 && tid == 0 && p.errors != nullptr) atomic_or_device(p.errors, ERR_QO);
        it = WorkItem{-1, -1, 0, 0, -1, -1, 0, -1, 0, 0, 0, 0};
    }
    if (it.seq >= 0 && p.kv_indices != nullptr && it.end > it.begin) {
        // The item's page ids, checked before any row of them is read.
        const int* pages = p.kv_indices + p.kv_indptr[it.seq];
        const int q0 = it.begin >> p.page_shift;
        const int q1 = ((it.end - 1) >> p.page_shift) + 1;
        for (int q = q0 + tid; q < q1; q += THREADS) {
            if (!page_in_cache(p, pages[q])) atomic_or_block(&sm.bad_page, 1);
        }
        block_sync();
        if (sm.bad_page) it.bad |= ERR_PAGE;
    }
    const int len = it.end - it.begin;
    it.fast = it.seq >= 0 && !it.bad && p.fast_tile > 0 && len > 0 && len % p.fast_tile == 0;
    block_sync();  // sm is free for the kernel's own use after this
    return it;
}

}  // namespace hipmla
