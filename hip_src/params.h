// hipmla kernel parameters: the one struct every decode kernel takes by value.
//
// Mirrored in Python by hipmla.kernels.DecodeParams (ctypes); tests/test_kernels.py
// checks field offsets and the size against this file, so change both together.
// Shape vocabulary: b = batch (sequences), h_q = query heads, d_qk = 576, d_v = 512,
// n_work = work items of the plan, n_slots = split partial slots of the plan.
#pragma once

#ifndef HIPMLA_PARAMS_NO_STDINT
typedef int int32_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#endif

struct MlaDecodeParams {
    const void* q;              // [b, h_q, d_qk] bf16 (q_len 1: query row i belongs to sequence i)
    const void* kv;             // bf16 [total_kv, d_qk] | fp8 [total_kv, d_qk] | mxfp4 [total_kv, d_qk/2] u8
    const uint8_t* kv_scale;    // mxfp4: [total_kv, stride_kv_scale] E8M0; otherwise null
    const int32_t* kv_indptr;   // [b + 1]: sequence i owns KV rows kv_indptr[i] .. kv_indptr[i+1]-1
    const int32_t* work;        // [n_work, 4]: (seq, token_begin, token_end, slot); slot -1 = write output
    const int32_t* seq_slots;   // [b + 1]: partial slots of sequence i are seq_slots[i] .. seq_slots[i+1]-1
    float* part_acc;            // [n_slots, h_q, d_v] f32 unnormalised P.V
    float* part_ml;             // [n_slots, h_q, 2] f32 (running max m in log2 units, sum l)
    void* out;                  // [b, h_q, d_v] bf16
    float* lse;                 // [b, h_q] f32 natural-log LSE, or null
    float sm_scale_log2;        // softmax scale * log2(e)
    float kv_fp8_scale;         // fp8: dequantised value = fp8 * kv_fp8_scale; otherwise 1
    int32_t stride_kv_scale;    // mxfp4: bytes per scale row (>= d_qk / 32); otherwise 0
    int32_t batch;              // b
    int32_t n_work;             // work items (grid of the split kernel)
    int32_t pad_;               // keeps sizeof a multiple of 8 on every ABI
};
