// Where a token's KV row is: the one place in the kernels that knows about pages.
//
// Contiguous cache (kv_indices null): sequence s owns rows kv_indptr[s] .. kv_indptr[s+1]-1.
// Paged cache (the FlashInfer / aiter convention): sequence s owns the pages
// kv_indices[kv_indptr[s] .. kv_indptr[s+1]-1] in that order (any page ids, repeats
// allowed), a page is 2^page_shift consecutive rows (data and mxfp4 scale rows alike),
// and only kv_last_page_len[s] rows of its last page are used.
#pragma once

#include "params.h"
#include "common/config.h"
#include "common/platform.h"

namespace hipmla {

// Bits of the error word (p.errors) for device-side input the host cannot check: the
// schedule sets them, and the sequence they concern gets NaN output and LSE instead of a
// read outside the arrays it was given (hipmla.decode.DEVICE_ERRORS mirrors them).
constexpr int ERR_INDPTR = 1;     // kv_indptr decreases at the sequence, or is negative
constexpr int ERR_BOUNDS = 2;     // its rows (contiguous) or page-table entries (paged) pass the end,
                                  // or it has more than MAX_SEQ_TOKENS tokens
constexpr int ERR_PAGE = 4;       // a page id is negative or its rows pass the end of the cache
constexpr int ERR_LAST_PAGE = 8;  // kv_last_page_len outside 1 .. page_size
constexpr int ERR_QO = 16;        // qo_indptr decreases, is negative or passes q_tokens
constexpr int ERR_Q_LEN = 32;     // a sequence has fewer kv tokens than query tokens

// An extent of kv_rows / n_indices as a bound: 0 is "unknown" (a raw address, whose extent
// is the caller's promise: nothing is checked), -1 an empty array (every index passes it).
// The decoder passes -1 for an empty buffer, whose address (possibly null) bounds nothing.
HIPMLA_DEVICE bool bounded(int extent) { return extent != 0; }
HIPMLA_DEVICE int bound_of(int extent) { return extent > 0 ? extent : 0; }

struct SeqExtent {
    int tokens;  // 0 for an invalid sequence
    int bad;     // ERR_* bits
};

// Tokens of sequence `seq`, and whether its indptr entries (and last-page length) are valid.
HIPMLA_DEVICE SeqExtent seq_extent(const MlaDecodeParams& p, int seq) {
    const int first = p.kv_indptr[seq];
    const int end = p.kv_indptr[seq + 1];
    // In 64 bits: an int64 offset past 2^31 that a runtime cast to int32 wraps negative, and
    // end - first in int32 would then wrap back to a large positive count.
    const long long n = (long long)end - first;
    int bad = (first < 0 || n < 0) ? ERR_INDPTR : 0;
    if (p.kv_indices == nullptr) {
        if (bounded(p.kv_rows) && end > bound_of(p.kv_rows)) bad |= ERR_BOUNDS;
        if (n > MAX_SEQ_TOKENS) bad |= ERR_BOUNDS;
        return bad ? SeqExtent{0, bad} : SeqExtent{int(n), 0};
    }
    if (bounded(p.n_indices) && end > bound_of(p.n_indices)) bad |= ERR_BOUNDS;
    // Loaded whatever n is, so the load goes out beside kv_indptr's, not after it (a second
    // memory latency in the schedule; seq < batch, so the entry exists).
    const int last_len = p.kv_last_page_len[seq];
    const int last = n > 0 ? last_len : 1;
    if (last < 1 || last > (1 << p.page_shift)) bad |= ERR_LAST_PAGE;
    // More pages than MAX_SEQ_TOKENS tokens: only a corrupt kv_indptr with a raw page-table
    // address (n_indices = 0, so no bound above) or shared pages get here.
    const long long tokens = n <= 0 ? 0 : ((n - 1) << p.page_shift) + last;
    if (tokens > MAX_SEQ_TOKENS) bad |= ERR_BOUNDS;
    if (bad) return SeqExtent{0, bad};
    return SeqExtent{int(tokens), 0};
}

// The query tokens of a sequence: qo_indptr's range, or token `seq` alone without one.
struct SeqQuery {
    int first;  // its first query token (row of q / out / lse in tokens)
    int n;      // query tokens; 0 for an invalid range
    int bad;    // ERR_QO
};

HIPMLA_DEVICE SeqQuery seq_query(const MlaDecodeParams& p, int seq) {
    if (p.qo_indptr == nullptr) return SeqQuery{seq, 1, 0};
    const int first = p.qo_indptr[seq];
    const int end = p.qo_indptr[seq + 1];
    if (first < 0 || end < first || (p.q_tokens > 0 && end > p.q_tokens)) return SeqQuery{0, 0, ERR_QO};
    return SeqQuery{first, end - first, 0};
}

// h_q / 16 (below 16 heads: 1); a struct that never set it (0) means 16 heads.
HIPMLA_DEVICE int head_groups(const MlaDecodeParams& p) { return p.head_groups > 1 ? p.head_groups : 1; }
// Query tokens of a schedule row: 1, 2, 4, 8 or 16; a struct that never set it (0) means 1.
HIPMLA_DEVICE int row_tokens(const MlaDecodeParams& p) { return p.row_tokens > 1 ? p.row_tokens : 1; }
// log2 of row_tokens, so the schedule's row counts are shifts.
HIPMLA_DEVICE int row_token_shift(const MlaDecodeParams& p) {
    return (p.row_tokens >= 2) + (p.row_tokens >= 4) + (p.row_tokens >= 8) + (p.row_tokens >= 16);
}
// Heads of q / out / lse a query token has in a row of 16 (the model's, below 16); a
// struct that never set it (0) means 16. Slot h of a row whose first query token is `row`
// has its q, out and lse entry at head_index(p, row, h), for h < row_heads (core/schedule.h:
// below 16 heads a row holds several query tokens); the others get zero Q and write nothing.
HIPMLA_DEVICE int heads_in_row(const MlaDecodeParams& p) {
    return p.heads_in_row > 0 && p.heads_in_row < HEADS ? p.heads_in_row : HEADS;
}
HIPMLA_DEVICE long long head_index(const MlaDecodeParams& p, int row, int h) {
    return (long long)row * heads_in_row(p) + h;
}
// Rows of the step (16 heads of one query token each): q_tokens x groups with qo_indptr, else batch x groups.
HIPMLA_DEVICE long long step_rows(const MlaDecodeParams& p) {
    return (long long)(p.qo_indptr != nullptr ? p.q_tokens : p.batch) * head_groups(p);
}

// Whether page `page` is a page of the cache (kv_rows 0: the caller promised it is).
HIPMLA_DEVICE bool page_in_cache(const MlaDecodeParams& p, int page) {
    return page >= 0 && (!bounded(p.kv_rows) || page < (bound_of(p.kv_rows) >> p.page_shift));
}

struct KvRows {
    const int* pages;  // the sequence's page ids; null: contiguous from `first`
    long long first;
    int shift;

    // Cache row of token `t` of the sequence (64-bit: page id x page size exceeds int32).
    HIPMLA_DEVICE long long row(int t) const { return row_at(t, pages == nullptr ? 0 : pages[t >> shift]); }

    // row(t) in two steps, for a kernel that reads the page table a tile before it uses
    // the rows and counts its loads in flight (decode/split_mfma_gfx942.hip): entry()
    // reads one int in either layout -- the page id, or for a contiguous cache `anchor`
    // (any int the kernel may read; row_at() does not use it) -- so every tile can issue
    // the same number of vector loads, provided the caller keeps the value as used (a
    // compiler drops an unused load); row_at() forms the row from what it read.
    HIPMLA_DEVICE int entry(int t, const int* anchor) const {
        const int* src = pages != nullptr ? pages + (t >> shift) : anchor;
        return *src;
    }
    HIPMLA_DEVICE long long row_at(int t, int entry) const {
        if (pages == nullptr) return first + t;
        return ((long long)entry << shift) | (t & ((1 << shift) - 1));
    }
};

HIPMLA_DEVICE KvRows kv_rows(const MlaDecodeParams& p, int seq) {
    const int first = p.kv_indptr[seq];
    if (p.kv_indices == nullptr) return KvRows{nullptr, first, 0};
    return KvRows{p.kv_indices + first, 0, p.page_shift};
}

}  // namespace hipmla
