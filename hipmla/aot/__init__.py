"""Ahead-of-time builds of the hipmla kernels with clang, and their resource report.

``python -m hipmla build --arch gfx950,gfx942`` compiles every kernel of
``hipmla.kernels.kernels_for_arch(arch)`` (the portable kernels, plus the arch's fast
ones) into a code object per architecture, reads the
register, LDS and scratch use the compiler recorded in each object's AMDGPU metadata
note, prints one line per kernel and architecture and fails when a kernel breaks the
project's budget (no scratch, no spills, LDS within one CU). This is the compile
evidence for AMD targets on machines that have no AMD GPU.

With ``--report`` it also counts the tile loops of the fast kernels (llvm-objdump) and
hands the counts to the performance model (:mod:`hipmla.perfmodel`), which prints the
H200 calibration and the PREDICTED MI355X / MI300X times.

The same objects serve the runtime: before it compiles a kernel with hiprtc it calls
:func:`find_prebuilt`, which returns an object only when it was built from exactly the
translation unit and options the runtime is about to compile.

Object names are ``<symbol>-<arch>-<key>-<compiler>.co``: ``key`` hashes the
translation unit, the options, the architecture and the fixed compiler flags;
``compiler`` hashes the ``clang --version`` text. A changed source therefore never
matches, and a rebuild with another compiler writes a new object instead of reusing
one made by the old compiler. The runtime looks up by ``key`` alone, because it has no
clang to ask for a version: any compiler's build of the same source and options is a
valid build of that kernel.

Its modules: :mod:`~hipmla.aot.occupancy` (the targets and the occupancy model),
:mod:`~hipmla.aot.toolchain` (clang and the LLVM tools, one build),
:mod:`~hipmla.aot.prebuilt` (the runtime's lookup), :mod:`~hipmla.aot.resources`
(registers, LDS, scratch of every build; the report and the budget),
:mod:`~hipmla.aot.counts` (the fast kernels' tile loops for the performance model) and
:mod:`~hipmla.aot.cli` (``python -m hipmla build``).
"""

from __future__ import annotations

from pathlib import Path

#: Where ``build`` writes by default and the runtime looks after ``$HIPMLA_AOT_DIR``:
#: None means :func:`default_aot_dir` at the time of the call (a Path set here wins:
#: :mod:`~hipmla.aot.prebuilt` reads it here when called, so it is defined before that
#: module is imported).
DEFAULT_AOT_DIR: Path | None = None

from hipmla.aot.occupancy import (  # noqa: E402
    ARCH_LIMITS,
    MAX_WAVES_PER_SIMD,
    SGPRS_FOR_FULL_OCCUPANCY,
    VGPR_GRANULE,
    VGPRS_PER_SIMD_LANE,
    WAVE_SIZE,
    ArchLimits,
    waves_per_simd,
)
from hipmla.aot.toolchain import (  # noqa: E402
    BUILD_FLAGS,
    COMPILE_TIMEOUT_S,
    FORMAT_VERSION,
    PROBE_ARCH,
    CompileError,
    ToolchainNotFound,
    compile_offline,
    compile_source,
    compiler_version,
    find_clang,
    find_objdump,
    find_readelf,
    object_key,
)
from hipmla.aot.prebuilt import PACKAGE_AOT_DIR, default_aot_dir, find_prebuilt, search_dirs  # noqa: E402
from hipmla.aot.resources import (  # noqa: E402
    KernelResources,
    build_all,
    check_budget,
    format_report,
    parse_notes,
    read_resources,
)
from hipmla.aot.counts import (  # noqa: E402
    Instruction,
    LoopCounts,
    count_fast,
    count_loop,
    fast_kernel_models,
    fast_report,
    format_counts,
    kernel_model,
    loop_counts,
    main_loop,
    parse_disassembly,
)
from hipmla.aot.cli import main  # noqa: E402

__all__ = [
    "ARCH_LIMITS",
    "ArchLimits",
    "BUILD_FLAGS",
    "COMPILE_TIMEOUT_S",
    "CompileError",
    "DEFAULT_AOT_DIR",
    "FORMAT_VERSION",
    "Instruction",
    "KernelResources",
    "LoopCounts",
    "MAX_WAVES_PER_SIMD",
    "PACKAGE_AOT_DIR",
    "PROBE_ARCH",
    "SGPRS_FOR_FULL_OCCUPANCY",
    "ToolchainNotFound",
    "VGPRS_PER_SIMD_LANE",
    "VGPR_GRANULE",
    "WAVE_SIZE",
    "build_all",
    "check_budget",
    "compile_offline",
    "compile_source",
    "compiler_version",
    "count_fast",
    "count_loop",
    "default_aot_dir",
    "fast_kernel_models",
    "fast_report",
    "find_clang",
    "find_objdump",
    "find_prebuilt",
    "find_readelf",
    "format_counts",
    "format_report",
    "kernel_model",
    "loop_counts",
    "main",
    "main_loop",
    "object_key",
    "parse_disassembly",
    "parse_notes",
    "read_resources",
    "search_dirs",
    "waves_per_simd",
]
