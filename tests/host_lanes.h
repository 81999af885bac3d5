// Lanes that meet: the rendezvous of the CPU harness's emulated cross-lane instructions
// (tests/host_cdna.h: 64-lane waves, tests/host_sm90.h: 32-lane warps). The harness runs
// one host thread per GPU thread; a cross-lane instruction is a meeting of the threads of
// one lane group: each deposits its operands, all wait, each computes its own result from
// everyone's, all wait again (so no lane overwrites a slot still being read).
#pragma once

#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hipmla_lanes {

constexpr int SLOT_BYTES = 80;  // the largest operand set: two 32-byte MFMA operands + scales

template <int WIDTH>
struct Group {
    std::barrier<> bar{WIDTH};
    alignas(16) unsigned char slot[WIDTH][SLOT_BYTES];
};

// A block of up to 1024 threads in groups of WIDTH lanes, reused block after block.
template <int WIDTH>
inline Group<WIDTH> groups[1024 / WIDTH];

template <int WIDTH>
inline int lane() { return int(hipmla::host_thread % WIDTH); }

// f(peer) with peer(l) = lane l's `mine`, for every lane of this thread's group.
template <int WIDTH, class T, class F>
auto exchange(const T& mine, F&& f) {
    static_assert(sizeof(T) <= SLOT_BYTES, "operands larger than a slot");
    Group<WIDTH>& g = groups<WIDTH>[hipmla::host_thread / WIDTH];
    std::memcpy(g.slot[lane<WIDTH>()], &mine, sizeof(T));
    g.bar.arrive_and_wait();
    auto peer = [&g](int l) {
        T t;
        std::memcpy(&t, g.slot[l], sizeof(T));
        return t;
    };
    auto result = f(peer);
    g.bar.arrive_and_wait();
    return result;
}

template <int WIDTH>
inline void meet() {
    exchange<WIDTH>(0, [](auto) { return 0; });
}

[[noreturn]] inline void unsupported(const char* header, const char* what) {
    std::fprintf(stderr, "%s: %s is not emulated\n", header, what);
    std::abort();
}

// f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN).
inline unsigned bf16_rne(float x) {
    const unsigned u = __builtin_bit_cast(unsigned, x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;
}

inline double bf16_value(unsigned h) { return double(__builtin_bit_cast(float, (h & 0xffffu) << 16)); }

}  // namespace hipmla_lanes
