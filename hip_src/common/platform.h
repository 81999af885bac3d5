// Everything that differs between the compilers hipmla's kernels meet, in one place.
//
// The same source is built by hiprtc and by offline clang (-nogpuinc, so no HIP header
// defines __global__, threadIdx or __syncthreads) for AMD GPUs, and by NVRTC for NVIDIA
// GPUs. On AMD both compilers are clang, so the clang attributes and amdgcn builtins
// serve both and no HIP header is needed; NVRTC gets the CUDA spellings. Kernel bodies
// use only the names below and never test the platform themselves.
//
// Nothing here assumes a warp width: kernels synchronise through shared memory and
// block_sync() only, so 64-lane wavefronts and 32-lane warps run the same code.
#pragma once

#if defined(HIPMLA_HOST_PLATFORM)
// A CPU test harness (tests/test_kernels.py) defines the names below itself and runs
// the kernels with one host thread per GPU thread.
#elif defined(__AMDGCN__)

#define HIPMLA_DEVICE __attribute__((device)) __attribute__((always_inline)) inline
#define HIPMLA_SHARED __attribute__((shared))
// The work-group bound lets the register allocator budget for `threads`, not for 1024.
#define HIPMLA_KERNEL(threads) \
    extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(1, threads)))

namespace hipmla {

typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));
typedef float f32x2 __attribute__((ext_vector_type(2)));
typedef float f32x4 __attribute__((ext_vector_type(4)));

HIPMLA_DEVICE unsigned thread_index() { return __builtin_amdgcn_workitem_id_x(); }
HIPMLA_DEVICE unsigned block_index() { return __builtin_amdgcn_workgroup_id_x(); }

// What __syncthreads is on AMD: the fences make shared-memory writes before the barrier
// visible to every wave of the block after it.
HIPMLA_DEVICE void block_sync() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

HIPMLA_DEVICE float f32_from_bits(unsigned u) { return __builtin_bit_cast(float, u); }
HIPMLA_DEVICE unsigned bits_from_f32(float x) { return __builtin_bit_cast(unsigned, x); }
// v itself, as a value the optimizer cannot see through (an empty asm that "changes" it):
// what is derived from it is recomputed where it is used, not hoisted and kept live.
HIPMLA_DEVICE int opaque_int(int v) {
    asm volatile("" : "+v"(v));
    return v;
}
// Every lane of the wave is here: what one lane wrote to shared memory before it, another
// reads after it. On AMD a wave runs in lockstep and its LDS operations in order, so this
// only keeps the compiler from moving code across (wave_barrier emits no instruction); the
// CPU harness, whose lanes are threads, meets here.
HIPMLA_DEVICE void wave_sync() { __builtin_amdgcn_wave_barrier(); }
// llvm.exp2 / llvm.log2: the backend expands them with denormal handling, no libcall.
HIPMLA_DEVICE float exp2_f32(float x) { return __builtin_exp2f(x); }
HIPMLA_DEVICE float log2_f32(float x) { return __builtin_log2f(x); }

// Cross-block hand-off (the last block of a sequence merges its partials). Agent scope:
// the L2 is per XCD on MI300/MI355, so only agent-scope release/acquire make one
// block's partial visible to a block on another XCD.
HIPMLA_DEVICE void fence_release_device() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
HIPMLA_DEVICE void fence_acquire_device() { __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "agent"); }
HIPMLA_DEVICE int atomic_add_device(int* p, int v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
HIPMLA_DEVICE void atomic_store_device(int* p, int v) {
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
HIPMLA_DEVICE void atomic_or_device(int* p, int v) {
    __hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Shared memory, within the block (a flag several threads may raise at once).
HIPMLA_DEVICE void atomic_or_block(int* p, int v) {
    __hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
// One 16- / 8-byte store to global memory (a vector store on AMD either way).
HIPMLA_DEVICE void store_global(f32x4* p, f32x4 v) { *p = v; }
HIPMLA_DEVICE void store_global(u32x2* p, u32x2 v) { *p = v; }
// After fence_acquire_device the vector caches are invalidated: a plain load is coherent.
HIPMLA_DEVICE f32x4 load_coherent(const f32x4* p) { return *p; }
HIPMLA_DEVICE f32x2 load_coherent(const f32x2* p) { return *p; }
HIPMLA_DEVICE float load_coherent(const float* p) { return *p; }
// A counter another block moves, read where it is kept (the merge's wait for its row).
HIPMLA_DEVICE int load_relaxed_device(const int* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
HIPMLA_DEVICE unsigned long long atomic_add_device_u64(unsigned long long* p, unsigned long long v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Blocks of the launch (grid_size_x counts work-items on AMD).
HIPMLA_DEVICE unsigned block_count() { return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(); }
// The compute unit a block runs on, as a dense index: none here (HW_ID's CU, SH and SE
// fields are not one; core/placement.h then counts every block as a second one, and the
// decoder passes no placement words on AMD).
HIPMLA_DEVICE int sm_id() { return -1; }
// Nanoseconds of a clock every block of the device shares: s_memrealtime, a constant
// 100 MHz on gfx9 (CDNA3 ISA, "S_MEMREALTIME").
HIPMLA_DEVICE unsigned long long timer_ns() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
// A pause between polls that leaves the issue slots to the other waves (s_sleep 1: 64 clocks).
HIPMLA_DEVICE void wait_briefly() { __builtin_amdgcn_s_sleep(1); }

}  // namespace hipmla

#elif defined(__CUDACC__)

#define HIPMLA_DEVICE __device__ __forceinline__
#define HIPMLA_SHARED __shared__
#define HIPMLA_KERNEL(threads) extern "C" __global__ __launch_bounds__(threads)

namespace hipmla {

typedef uint2 u32x2;
typedef uint4 u32x4;
typedef float2 f32x2;
typedef float4 f32x4;

HIPMLA_DEVICE unsigned thread_index() { return threadIdx.x; }
HIPMLA_DEVICE unsigned block_index() { return blockIdx.x; }
HIPMLA_DEVICE void block_sync() { __syncthreads(); }

HIPMLA_DEVICE float f32_from_bits(unsigned u) { return __uint_as_float(u); }
HIPMLA_DEVICE unsigned bits_from_f32(float x) { return __float_as_uint(x); }
HIPMLA_DEVICE int opaque_int(int v) {
    asm volatile("" : "+r"(v));
    return v;
}
HIPMLA_DEVICE void wave_sync() { __syncwarp(); }
HIPMLA_DEVICE float exp2_f32(float x) { return exp2f(x); }
HIPMLA_DEVICE float log2_f32(float x) { return log2f(x); }

// Cross-block hand-off: fence.acq_rel.gpu before the relaxed atomic is a release
// pattern, after it an acquire pattern (PTX ISA 8.x, "Memory Consistency Model":
// release and acquire patterns), which is all the merge needs; __threadfence is the
// sequentially consistent fence.sc.gpu (MEMBAR.SC.GPU). The merger reads partials with
// ld.global.cg, which skips the SM's non-coherent L1.
HIPMLA_DEVICE void fence_release_device() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
HIPMLA_DEVICE void fence_acquire_device() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
HIPMLA_DEVICE int atomic_add_device(int* p, int v) { return atomicAdd(p, v); }
HIPMLA_DEVICE void atomic_store_device(int* p, int v) { atomicExch(p, v); }
HIPMLA_DEVICE void atomic_or_device(int* p, int v) { atomicOr(p, v); }
HIPMLA_DEVICE void atomic_or_block(int* p, int v) { atomicOr_block(p, v); }
// One 16- / 8-byte store to global memory, kept in L2 (st.global.cg.v4.f32 / .v2.u32).
// A plain store through a reinterpret_cast pointer is not always one: NVVM split the
// sm_90 epilogue's f32x4 and u32x2 stores into 4-byte ones (4x the store instructions,
// each writing part of every sector it touches).
HIPMLA_DEVICE void store_global(f32x4* p, f32x4 v) { __stcg(p, v); }
HIPMLA_DEVICE void store_global(u32x2* p, u32x2 v) { __stcg(p, v); }
HIPMLA_DEVICE f32x4 load_coherent(const f32x4* p) { return __ldcg(p); }
HIPMLA_DEVICE f32x2 load_coherent(const f32x2* p) { return __ldcg(p); }
HIPMLA_DEVICE float load_coherent(const float* p) { return __ldcg(p); }
HIPMLA_DEVICE int load_relaxed_device(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
HIPMLA_DEVICE unsigned long long atomic_add_device_u64(unsigned long long* p, unsigned long long v) {
    return atomicAdd(p, v);
}
HIPMLA_DEVICE unsigned block_count() { return gridDim.x; }
// The SM a block runs on (%smid: 0 .. 131 on the H200, as scripts/sm90_timeline.py saw).
HIPMLA_DEVICE int sm_id() {
    int s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
// %globaltimer: nanoseconds, one clock for the whole GPU (PTX ISA 10.x, "%globaltimer").
HIPMLA_DEVICE unsigned long long timer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
HIPMLA_DEVICE void wait_briefly() { __nanosleep(32); }

}  // namespace hipmla

#else
#error "hipmla: compile the kernels as HIP for AMD GPUs (hiprtc, clang) or with NVRTC for NVIDIA GPUs"
#endif
