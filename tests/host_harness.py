"""The CPU harness for kernel sources: the names hip_src/common/platform.h leaves to a
host build, so the very same device code runs on the CPU (tests/test_kernels.py,
tests/test_schedule.py)."""

# The names hip_src/common/platform.h leaves to a harness: one std::thread per GPU
# thread, a std::barrier for block_sync, blocks one after another.
HOST_PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>
#define HIPMLA_HOST_PLATFORM 1
#define HIPMLA_DEVICE inline
#define HIPMLA_SHARED static
#define HIPMLA_KERNEL(threads) extern "C"
namespace hipmla {
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));
typedef float f32x2 __attribute__((ext_vector_type(2)));
typedef float f32x4 __attribute__((ext_vector_type(4)));
inline thread_local unsigned host_thread;
// Per thread: a launch may run several blocks at once (tests/test_placement.py), each
// thread of a block sets both when it starts.
inline thread_local unsigned host_block;
inline thread_local std::barrier<>* host_barrier;
inline unsigned thread_index() { return host_thread; }
inline unsigned block_index() { return host_block; }
inline void block_sync() { host_barrier->arrive_and_wait(); }
inline int opaque_int(int v) { return v; }
inline float f32_from_bits(unsigned u) { return __builtin_bit_cast(float, u); }
inline unsigned bits_from_f32(float x) { return __builtin_bit_cast(unsigned, x); }
inline float exp2_f32(float x) { return std::exp2(x); }
inline float log2_f32(float x) { return std::log2(x); }
inline void fence_release_device() { std::atomic_thread_fence(std::memory_order_release); }
inline void fence_acquire_device() { std::atomic_thread_fence(std::memory_order_acquire); }
inline int atomic_add_device(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline void atomic_store_device(int* p, int v) { std::atomic_ref<int>(*p).store(v); }
inline void atomic_or_device(int* p, int v) { std::atomic_ref<int>(*p).fetch_or(v); }
inline void atomic_or_block(int* p, int v) { std::atomic_ref<int>(*p).fetch_or(v); }
inline void store_global(f32x4* p, f32x4 v) { *p = v; }
inline void store_global(u32x2* p, u32x2 v) { *p = v; }
inline f32x4 load_coherent(const f32x4* p) { return *p; }
inline f32x2 load_coherent(const f32x2* p) { return *p; }
inline float load_coherent(const float* p) { return *p; }
inline int load_relaxed_device(const int* p) { return std::atomic_ref<int>(*const_cast<int*>(p)).load(); }
inline unsigned long long atomic_add_device_u64(unsigned long long* p, unsigned long long v) {
    return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
// The launch's blocks, and the "SM" each runs on: host_sm_map[b] if set, else block b on
// SM b % host_sms (hipmla_host_launch runs the blocks one after another, so there an
// SM's first block always claims before its second); no SM ids while host_sms is 0.
inline unsigned host_grid = 1;
inline int host_sms = 0;
inline const int* host_sm_map = nullptr;
inline unsigned block_count() { return host_grid; }
inline int sm_id() {
    if (host_sm_map != nullptr) return host_sm_map[host_block];
    return host_sms > 0 ? int(host_block % unsigned(host_sms)) : -1;
}
inline unsigned long long timer_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline void wait_briefly() { std::this_thread::yield(); }
// Asynchronous copies (the CDNA global -> LDS copies, tests/host_cdna.h). They land when
// issued, unless host_late_copies is set: then a copy lands only when its lane's
// s_waitcnt vmcnt covers it (host_wait_vm(n): all but the lane's n newest copies -- fewer
// than the hardware lands, whose count also holds the plain loads that complete at once
// here), so a wait that does not cover a copy its reader needs shows as stale data. A copy
// still pending when its thread ends is LDS written after the block: the launch counts it.
struct HostCopy {
    void* dst;
    const void* src;
    size_t n;
};
inline thread_local std::deque<HostCopy> host_copies;
inline int host_late_copies = 0;
inline std::atomic<int> host_copies_left{0};
inline void host_copy(void* dst, const void* src, size_t n) {
    if (host_late_copies) host_copies.push_back(HostCopy{dst, src, n});
    else std::memcpy(dst, src, n);
}
inline void host_wait_vm(int n) {
    while (int(host_copies.size()) > n) {
        const HostCopy c = host_copies.front();
        host_copies.pop_front();
        std::memcpy(c.dst, c.src, c.n);
    }
}
}  // namespace hipmla
"""

# core/schedule.h block by block (tests/test_schedule.py, tests/test_placement.py): block
# b on SM b % sms (0: no SM ids); out[11 b ..]: seq, begin, end, slot, first_slot, n_items,
# row, slot_stride, bad, queries, sees of its item. Rows of up to 4 query tokens
# (p.row_tokens), as the 64-row kernel builds it: with row_tokens 1 the same items as the
# other kernels' build.
#: ints a block writes in dump_schedule's out.
SCHEDULE_FIELDS = 11
SCHEDULE_DUMP = r"""
extern "C" void dump_schedule(MlaDecodeParams p, int grid, int sms, int* out) {
    std::barrier<> bar(256);
    hipmla::host_grid = unsigned(grid);
    hipmla::host_sms = sms;
    static hipmla::ScheduleSmem<256> sm;
    for (int b = 0; b < grid; ++b) {
        std::vector<std::thread> pool;
        for (int t = 0; t < 256; ++t)
            pool.emplace_back([&, t] {
                hipmla::host_barrier = &bar;
                hipmla::host_block = unsigned(b);
                hipmla::host_thread = unsigned(t);
                const hipmla::WorkItem it = hipmla::schedule_item<256, 4>(p, b, sm);
                if (t == 0) {
                    int* o = out + 11 * b;
                    o[0] = it.seq; o[1] = it.begin; o[2] = it.end;
                    o[3] = it.slot; o[4] = it.first_slot; o[5] = it.n_items;
                    o[6] = it.row; o[7] = it.slot_stride; o[8] = it.bad;
                    o[9] = it.queries; o[10] = it.sees;
                }
            });
        for (auto& th : pool) th.join();
    }
    hipmla::host_sms = 0;
}
"""

HOST_LAUNCH = r"""
extern "C" void hipmla_host_launch(MlaDecodeParams p, int grid, int threads) {
    std::barrier<> bar(threads);
    hipmla::host_grid = unsigned(grid);
    for (int b = 0; b < grid; ++b) {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
            pool.emplace_back([p, t, b, &bar] {
                hipmla::host_barrier = &bar;
                hipmla::host_block = unsigned(b);
                hipmla::host_thread = unsigned(t);
                HIPMLA_HOST_KERNEL(p);
                hipmla::host_copies_left += int(hipmla::host_copies.size());
                hipmla::host_copies.clear();
            });
        for (auto& th : pool) th.join();
    }
}
// Late copies on (1) or off (0) for the next launches; returns the copies left pending at
// thread ends since the last call.
// Blocks on `sms` SMs, block b on SM b % sms, for the next launches (0: no SM ids).
extern "C" void hipmla_host_sms(int sms) { hipmla::host_sms = sms; }
extern "C" int hipmla_host_late_copies(int on) {
    hipmla::host_late_copies = on;
    return hipmla::host_copies_left.exchange(0);
}
"""


def _header(name: str) -> str:
    """A harness header under tests/, with the harness headers it includes inlined."""
    from pathlib import Path

    text = (Path(__file__).with_name(name)).read_text()
    return text.replace('#include "host_lanes.h"\n', (Path(__file__).with_name("host_lanes.h")).read_text())


def host_source(source: str, arch: str) -> str:
    """The whole C++ file that runs kernel ``source`` (under hip_src) on the CPU for
    ``arch``: the prelude, for the CDNA fast kernels also their wave64 instructions
    (tests/host_cdna.h, with the arch's macro defined) and for the sm_90 kernel its warp
    instructions (tests/host_sm90.h; the 64-row kernel also its warpgroup instructions,
    tests/host_sm90a.h), the kernel, the launcher."""
    from hipmla.kernels import FAST_SOURCES, SM90_ROWS64_SOURCE, SM90_SOURCE, translation_unit

    prelude = HOST_PRELUDE
    if source in FAST_SOURCES.values():
        prelude += f"#define __{arch}__ 1\n" + _header("host_cdna.h")
    elif source == SM90_SOURCE:
        prelude += _header("host_sm90.h")
    elif source == SM90_ROWS64_SOURCE:
        prelude += _header("host_sm90.h") + _header("host_sm90a.h")
    return prelude + translation_unit(source) + HOST_LAUNCH
