// The device-side schedule: which work item a block of the decode grid runs, derived
// from the batch itself (kv_indptr and, paged, kv_last_page_len), so the host passes
// nothing that changes from step to step and no metadata kernel runs before the decode.
//
// Every block computes the same split from the same lengths (hipmla/schedule.py is the
// bit-for-bit host model; tests/test_schedule.py holds them together):
//
//   total  = sum of the batch's token counts
//   chunk  = round_up(max(ceil(total / split_target), split_min_tokens), split_align)
//   n_s    = max(ceil(len_s / chunk), 1) items for sequence s, cut on split_align units as
//            evenly as possible: item k = units [floor(U k / n_s), floor(U (k+1) / n_s))
//            with U = ceil(len_s / split_align), clamped to len_s;
//   fast_tile > 0: a last item with whole fast tiles and a remainder becomes two items
//            (the whole tiles, then the remainder), so every item is either whole tiles
//            for the arch's fast kernel or shorter than one tile.
//
// Items are numbered sequence by sequence; item i is block i's and writes partial slot i.
// A sequence whose indptr entries are invalid (core/paged.h, ERR_*) counts as empty and
// its one item is `bad`; so is an item whose page ids leave the cache (each block checks
// the pages of its own item). Bad items go to the portable kernel, never to a fast kernel
// (`fast`); the block that runs one sets the error word (report_bad_item) and writes NaN
// (output, or partial: the merge turns one NaN partial into a NaN output).
// Sum over s of n_s <= total / chunk + b <= split_target + b (chunk >= total /
// split_target), plus b with fast_tile: max_items() sizes the grid and the scratch.
// Cost per block: ceil(b / THREADS) length reads per thread and two block scans.
#pragma once

#include "params.h"
#include "common/platform.h"
#include "core/paged.h"

namespace hipmla {

struct WorkItem {
    int seq;         // -1: the grid is sized for the largest split; this block has no item
    int begin, end;  // tokens [begin, end) of the sequence
    int slot;        // this item's partial slot
    int first_slot;  // the slot of the sequence's first item (its slots are consecutive)
    int n_items;     // items of the sequence; 1: the item writes the output itself
    int bad;         // ERR_* bits: the item writes NaN instead of reading its rows
    int fast;        // whole fast_tile tiles of a valid item: the arch's fast kernel runs it
};

template <int THREADS>
struct ScheduleSmem {
    long long scan[THREADS];
    WorkItem item;
    int bad_page;
};

// Exclusive prefix sum over the block of one value per thread; `total` gets the sum.
template <int THREADS>
HIPMLA_DEVICE long long block_exclusive_scan(long long v, long long* buf, long long& total) {
    const int tid = int(thread_index());
    buf[tid] = v;
    block_sync();
    for (int d = 1; d < THREADS; d *= 2) {
        const long long add = tid >= d ? buf[tid - d] : 0;
        block_sync();
        buf[tid] += add;
        block_sync();
    }
    total = buf[THREADS - 1];
    const long long inclusive = buf[tid];
    block_sync();
    return inclusive - v;
}

// Items of a sequence of `len` tokens, and the token range of its item k.
struct SeqSplit {
    long long chunk;
    int align, fast_tile;

    HIPMLA_DEVICE int base_items(int len) const {
        const long long n = (len + chunk - 1) / chunk;
        return n > 1 ? int(n) : 1;
    }
    HIPMLA_DEVICE bool tail_item(int len) const {
        if (fast_tile <= 0) return false;
        const int n = base_items(len);
        const long long units = (len + align - 1) / align;
        const long long last_begin = units * (n - 1) / n * align;
        const int tail = len % fast_tile;
        return tail > 0 && len - last_begin > tail;
    }
    HIPMLA_DEVICE int items(int len) const { return base_items(len) + (tail_item(len) ? 1 : 0); }
    HIPMLA_DEVICE void range(int len, int k, int& begin, int& end) const {
        const int n = base_items(len);
        const long long units = (len + align - 1) / align;
        if (k == n) {  // the remainder item after the last item's whole tiles
            begin = len - len % fast_tile;
            end = len;
            return;
        }
        const long long b = units * k / n * align;
        const long long e = units * (k + 1) / n * align;
        begin = int(b < len ? b : len);
        end = int(e < len ? e : len);
        if (k == n - 1 && tail_item(len)) end = len - len % fast_tile;
    }
};

// Records a bad item's ERR_* bits in the error word (one thread; kept out of
// schedule_item, where the fast kernels would pay registers for an atomic they never need).
HIPMLA_DEVICE void report_bad_item(const MlaDecodeParams& p, const WorkItem& it) {
    if (it.bad && thread_index() == 0 && p.errors != nullptr) atomic_or_device(p.errors, it.bad);
}

template <int THREADS>
HIPMLA_DEVICE WorkItem schedule_item(const MlaDecodeParams& p, int block, ScheduleSmem<THREADS>& sm) {
    const int tid = int(thread_index());
    const int per = (p.batch + THREADS - 1) / THREADS;
    const int s0 = tid * per < p.batch ? tid * per : p.batch;
    const int s1 = s0 + per < p.batch ? s0 + per : p.batch;

    long long mine = 0;
    for (int s = s0; s < s1; ++s) mine += seq_extent(p, s).tokens;
    long long total = 0;
    block_exclusive_scan<THREADS>(mine, sm.scan, total);

    long long chunk = (total + p.split_target - 1) / p.split_target;
    chunk = chunk > p.split_min_tokens ? chunk : p.split_min_tokens;
    chunk = (chunk + p.split_align - 1) / p.split_align * p.split_align;
    const SeqSplit split{chunk, p.split_align, p.fast_tile};

    long long count = 0;
    for (int s = s0; s < s1; ++s) count += split.items(seq_extent(p, s).tokens);
    if (tid == 0) {
        sm.item = WorkItem{-1, 0, 0, -1, -1, 0, 0, 0};
        sm.bad_page = 0;
    }
    long long n_all = 0;
    long long first = block_exclusive_scan<THREADS>(count, sm.scan, n_all);
    if (block >= first && block < first + count) {
        for (int s = s0; s < s1; ++s) {
            const SeqExtent e = seq_extent(p, s);
            const int n = split.items(e.tokens);
            if (block < first + n) {
                WorkItem it;
                it.seq = s;
                split.range(e.tokens, int(block - first), it.begin, it.end);
                it.slot = block;
                it.first_slot = int(first);
                it.n_items = n;
                it.bad = e.bad;
                it.fast = 0;
                sm.item = it;
                break;
            }
            first += n;
        }
    }
    block_sync();
    WorkItem it = sm.item;
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
