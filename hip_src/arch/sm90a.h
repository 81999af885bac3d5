// NVIDIA Hopper warpgroup instructions (sm_90a: wgmma needs the "a" target), as
// small named helpers around inline PTX, for decode/split_sm90_rows64.hip. Each cites the
// PTX ISA (9.0) section it follows.
//
// Shared-memory operands of wgmma are described by a 64-bit matrix descriptor (PTX ISA
// 9.7.15.5.1): start address >> 4 (bits 0-13), leading-dimension byte offset >> 4 (LBO,
// bits 16-29), stride-dimension byte offset >> 4 (SBO, bits 32-45), layout (bits 62-63;
// 1 = 128-byte swizzle). Every tile here uses the 128-byte swizzle: a "chunk" is 8-row
// groups of 128-byte rows, 16-byte unit u of row r stored at unit u ^ (r & 7) (swizzled_unit),
// so the 8 rows of a group hit 8 different bank quads. K-major operand (the k index runs
// along the 128-byte row): SBO = 1 KiB (the next 8-row group), a k-step of 16 bf16 adds
// 32 B to the start address. MN-major operand (the m / n index runs along the row):
// SBO = 1 KiB (the next 8 k-rows), LBO = the next 64-wide atom along m / n.
//
// Accumulator layout of wgmma.m64nNk16 (PTX ISA 9.7.15.5.1.1, "Register Fragments"):
// warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8 (g = lane >> 2,
// t = lane & 3); element 4 j + e of the N / 2 f32 per thread is row 16 w + g + 8 (e >> 1),
// column 8 j + 2 t + (e & 1).
#pragma once

#include "common/platform.h"

#if !defined(__CUDACC__) && !defined(HIPMLA_HOST_PLATFORM)
#error "arch/sm90a.h is for NVRTC / nvcc builds for sm_90a only (and the CPU harness, tests/host_sm90a.h)"
#endif

namespace hipmla {
namespace sm90a {

// The descriptor of a 128-byte-swizzled operand at shared address `addr` (PTX ISA 9.7.15.5.1).
HIPMLA_DEVICE unsigned long long desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// Shared address of 16-byte unit `unit` (0..7) of 128-byte row `row` of a swizzled chunk at `base`.
HIPMLA_DEVICE unsigned swizzled_unit(unsigned base, int row, int unit) {
    return base + unsigned(row) * 128u + (unsigned(unit ^ (row & 7)) << 4);
}

#if !defined(HIPMLA_HOST_PLATFORM)  // the CPU harness has its own (tests/host_sm90a.h)
HIPMLA_DEVICE void st_shared_v4(unsigned a, const unsigned (&x)[4]) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3])
                 : "memory");
}
// The same store without the memory clobber, so the compiler may move other work (the
// conversions of other registers) across it: for stores that the thread itself does not
// read back before a barrier.
HIPMLA_DEVICE void st_shared_v4_no_clobber(unsigned a, const unsigned (&x)[4]) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]));
}
HIPMLA_DEVICE void st_shared_b32(unsigned a, unsigned x) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(x) : "memory"); }

// wgmma's ordering (PTX ISA 9.7.15.6): fence before the first wgmma that reads registers
// written since; commit closes a group; wait_group N returns once at most N groups are pending.
HIPMLA_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
HIPMLA_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
HIPMLA_DEVICE void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy shared-memory writes made visible to the async proxy (wgmma's operand
// reads), PTX ISA 9.7.13.4.7 (fence.proxy.async); a barrier then orders them across threads.
HIPMLA_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across a wgmma's asynchrony.
template <int N>
HIPMLA_DEVICE void pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 64 f32) += A B, wgmma.mma_async.m64n64k16.f32.bf16.bf16 with both operands in
// shared memory and K-major (PTX ISA 9.7.15.5.2).
HIPMLA_DEVICE void wgmma_m64n64k16(float (&d)[32], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b));
}

// D (64 x 256 f32) += A B, wgmma.mma_async.m64n256k16.f32.bf16.bf16, A K-major and B MN-major
// (transposed) in shared memory (PTX ISA 9.7.15.5.2): B's four 64-column atoms LBO apart. One
// instruction reads A once for 256 columns, where four m64n64k16 read it four times.
HIPMLA_DEVICE void wgmma_m64n256k16_tb(float (&d)[128], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b));
}

#endif  // !HIPMLA_HOST_PLATFORM

}  // namespace sm90a
}  // namespace hipmla
