// hipmla kernel parameters: the one struct every decode kernel takes by value.
//
// Mirrored in Python by hipmla.kernels.DecodeParams (ctypes); tests/test_kernels.py
// checks field offsets and the size against this file, so change both together.
// Shape vocabulary: b = batch (sequences), h_q = query heads (16 x head_groups, or 1..15), t_q =
// query tokens of the step (b with q_len 1), d_qk = 576, d_v = 512, n_slots = split partial
// slots (sized once by the decoder for its largest step). A "row" is 16 heads of one query
// token: row = query token x head_groups + head group; every kernel computes 16 heads (a
// model of fewer, e.g. 8, shares them among row_tokens query tokens: heads_in_row,
// core/paged.h head_index, core/schedule.h row_heads and slot_tokens). The
// 64-row sm_90a kernel's schedule row is 64 heads (head_groups = h_q / 64) or, below 64
// heads, row_tokens = 64 / h_q query tokens of them; it keys q, out, lse, counters and
// partials by rows of 16 heads all the same.
//
// Everything a step changes lives in device memory (indptr, page table, last-page
// lengths): the struct itself is the same for every step of a batch size, so a launch
// captured into a graph replays for every step.
#pragma once

#ifndef HIPMLA_PARAMS_NO_STDINT
typedef int int32_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#endif

struct MlaDecodeParams {
    const void* q;                   // [t_q, h_q, d_qk] bf16 (no qo_indptr: query token i is sequence i's)
    const void* kv;                  // bf16 [rows, d_qk] | fp8 [rows, d_qk] | mxfp4 [rows, d_qk/2] u8
    const uint8_t* kv_scale;         // mxfp4: [rows, stride_kv_scale] E8M0; otherwise null
    const int32_t* kv_indptr;        // [b + 1]: contiguous: sequence i owns rows kv_indptr[i] .. kv_indptr[i+1]-1;
                                     //          paged: its pages are kv_indices[kv_indptr[i] .. kv_indptr[i+1]-1]
    const int32_t* kv_indices;       // paged: page ids (page p = rows p * page_size ..); null: contiguous
    const int32_t* kv_last_page_len; // paged: [b] rows used in each sequence's last page (1 .. page_size)
    const int32_t* qo_indptr;        // [b + 1]: sequence i's query tokens are qo_indptr[i] .. qo_indptr[i+1]-1,
                                     //          causal (token j of n sees kv tokens 0 .. len - n + j); null: 1 each
    int32_t* counters;               // [t_q x head_groups][2] the merge's counters (core/merge.h); 0 between launches
    int32_t* errors;                 // one word: ERR_* bits of invalid device-side input (core/paged.h), or null
    int32_t* placement;              // [placement_words(placement_sms)], 16-byte aligned: which block runs which
                                     //          item (core/placement.h); 0 between launches; null: item i is block i's
    float* part_acc;                 // [n_slots, 16, d_v] f32 unnormalised P.V (one slot per item of a row)
    float* part_ml;                  // [n_slots, 16, 2] f32 (running max m in log2 units, sum l)
    void* out;                       // [t_q, h_q, d_v] bf16
    float* lse;                      // [t_q, h_q] f32 natural-log LSE, or null
    float sm_scale_log2;             // softmax scale * log2(e)
    float kv_fp8_scale;              // fp8: dequantised value = fp8 * kv_fp8_scale; otherwise 1
    int32_t stride_kv_scale;         // mxfp4: bytes per scale row (>= d_qk / 32); otherwise 0
    int32_t batch;                   // b
    int32_t page_shift;              // log2(page_size), 0..7 (contiguous: 0)
    int32_t split_target;            // work items the schedule aims for (compute units x items per unit)
    int32_t split_min_tokens;        // shortest split worth its partial traffic
    int32_t split_align;             // split boundaries fall on multiples of this (a power of two)
    int32_t fast_tile;               // > 0: a sequence's partial last tile is an item of its own, and the
                                     //      items of whole fast_tile tiles belong to the arch's fast kernel
    int32_t kv_rows;                 // rows of the cache (kv and kv_scale): no row past it is read; 0: unknown
                                     //      (a raw address: the caller's promise); -1: none (an empty cache)
    int32_t n_indices;               // paged: entries of kv_indices: no entry past it is read; 0: unknown;
                                     //      -1: none (kv_indices must still be non-null: it selects paging)
    int32_t head_groups;             // h_q / 16 (1, 2, 4 or 8; below 16 heads 1; the 64-row kernel max(h_q / 64, 1))
    int32_t q_tokens;                // t_q: rows of q / out / lse; with qo_indptr no entry past it is used
    int32_t split_max_ranges;        // > 0: most token ranges (items of a row) per sequence; 0: no cap
    int32_t split_long_range;        // ... unless ceil(len / this) is more: ranges this long are worth a slot
    int32_t placement_sms;           // SM words of placement (the device's SM count)
    int32_t split_lone_items;        // > 0: steps whose split_target chunk is below split_lone_below
    int32_t split_lone_below;        //      tokens take the split aiming at split_lone_items items
    int32_t split_lone_max_ranges;   //      (capped at split_lone_max_ranges) when it gives at most that many
    int32_t split_fit;               // 1: a usual split of more than split_target items takes the first of
                                     //      two longer chunks that gives at most that many (core/schedule.h)
    int32_t row_tokens;              // query tokens of a schedule row, a power of two (0 or 1: one; the 64-row
                                     //      sm_90a kernel below 64 heads: 64 / h_q; the 16-head kernels below
                                     //      16 heads: as many as fit, rounded down to a power of two)
    int32_t heads_in_row;            // heads of q / out / lse in a row of 16: h_q below 16 (1..15), else 16 (0: 16);
                                     //      the 16-head kernels give a row's slots past its query tokens'
                                     //      heads zero Q and write nothing of them (not the 64-row kernel:
                                     //      16+ heads only)
};
