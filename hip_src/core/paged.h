// Where a token's KV row is: the one place in the kernels that knows about pages.
//
// Contiguous cache (kv_indices null): sequence s owns rows kv_indptr[s] .. kv_indptr[s+1]-1.
// Paged cache (the FlashInfer / aiter convention): sequence s owns the pages
// kv_indices[kv_indptr[s] .. kv_indptr[s+1]-1] in that order (any page ids, repeats
// allowed), a page is 2^page_shift consecutive rows (data and mxfp4 scale rows alike),
// and only kv_last_page_len[s] rows of its last page are used.
#pragma once

#include "params.h"
#include "common/platform.h"

namespace hipmla {

// Tokens of sequence `seq`.
HIPMLA_DEVICE int seq_tokens(const MlaDecodeParams& p, int seq) {
    const int first = p.kv_indptr[seq];
    const int n = p.kv_indptr[seq + 1] - first;
    if (p.kv_indices == nullptr) return n;
    return n <= 0 ? 0 : ((n - 1) << p.page_shift) + p.kv_last_page_len[seq];
}

struct KvRows {
    const int* pages;  // the sequence's page ids; null: contiguous from `first`
    long long first;
    int shift;

    // Cache row of token `t` of the sequence (64-bit: page id x page size exceeds int32).
    HIPMLA_DEVICE long long row(int t) const {
        if (pages == nullptr) return first + t;
        return ((long long)pages[t >> shift] << shift) | (t & ((1 << shift) - 1));
    }
};

HIPMLA_DEVICE KvRows kv_rows(const MlaDecodeParams& p, int seq) {
    const int first = p.kv_indptr[seq];
    if (p.kv_indices == nullptr) return KvRows{nullptr, first, 0};
    return KvRows{p.kv_indices + first, 0, p.page_shift};
}

}  // namespace hipmla
