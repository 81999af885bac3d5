"""The AMD targets hipmla builds for, and how many waves of a kernel one of their SIMDs holds.

:data:`ARCH_LIMITS` names the targets (a build, a resource report or a prebuilt lookup
for any other arch is refused); :func:`waves_per_simd` is the occupancy model the
resource report and the performance model use, sources in the comment below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hipmla.perfmodel import SIMDS_PER_CU


# Occupancy model (waves resident per SIMD) of the gfx90a-family CUs, gfx942 and gfx950:
# - Register file: 512 VGPRs per lane per SIMD, shared by arch VGPRs and AGPRs (the
#   "unified" file), handed out in granules of 8; at most 8 waves per SIMD. Sources:
#   the AMD Instinct MI200 (CDNA2) ISA guide, section 3.6.4, cited by LLVM commit
#   b7611370 (512 in total, at most 256 each of VGPR and AGPR; CDNA3/4 keep the design);
#   LLVM AMDGPUBaseInfo getTotalNumVGPRs / getVGPRAllocGranule / getMaxWavesPerEU
#   (gfx90a-family: 512, 8, 8); ROCm "GPU hardware specifications" table (a 512 KiB
#   VGPR file per CU for MI300X and MI355X = 4 SIMDs x 512 x 64 lanes x 4 B).
#   The metadata's .vgpr_count is already that unified total (arch VGPRs rounded up to
#   4, plus AGPRs; LLVM getTotalNumVGPRs): a kernel with 4 arch VGPRs and 3 AGPRs
#   reports .vgpr_count 7 and .agpr_count 3. Adding .agpr_count again would double-count.
#   waves_vgpr = min(8, 512 // roundup(vgpr, 8)).
# - SGPRs: 800 per SIMD on GFX9-generation chips; LLVM getOccupancyWithNumSGPRs gives
#   at most 8 waves up to 100 SGPRs and 7 above, so only > 100 can bind at the cap of 8.
# - LDS per CU: gfx950 160 KiB, gfx942 64 KiB (ROCm "GPU hardware specifications";
#   LLVM's local memory size for these targets); 4 SIMDs per CU, wave64.
#   blocks_per_cu = min(lds_per_cu // block_lds, (4 * min(waves_vgpr, waves_sgpr)) //
#   waves_per_block); waves_per_simd = ceil(blocks_per_cu * waves_per_block / 4): the
#   waves of the resident blocks spread as evenly as possible over the 4 SIMDs, the
#   same rounding LLVM's getOccupancyWithWorkGroupSizes uses. The 16 barrier slots per
#   CU never bind here: 8 waves x 4 SIMDs of blocks of >= 2 waves is <= 16 blocks.
#   0 means one block does not fit on a CU at all (LLVM would say 1; we want it seen).
# Checked against the "; Occupancy:" comment clang-22 writes for test kernels.
VGPRS_PER_SIMD_LANE = 512
VGPR_GRANULE = 8
MAX_WAVES_PER_SIMD = 8
SGPRS_FOR_FULL_OCCUPANCY = 100
WAVE_SIZE = 64  # SIMDS_PER_CU (4) comes from hipmla.perfmodel, which issues on the same SIMDs


@dataclass(frozen=True)
class ArchLimits:
    lds_per_cu: int  # bytes of LDS one CU shares among its resident blocks


ARCH_LIMITS: dict[str, ArchLimits] = {
    "gfx950": ArchLimits(lds_per_cu=160 * 1024),
    "gfx942": ArchLimits(lds_per_cu=64 * 1024),
}


def _check_arch(arch: str) -> str:
    if arch not in ARCH_LIMITS:
        raise ValueError(f"arch: expected one of {sorted(ARCH_LIMITS)}, got {arch!r}")
    return arch


def waves_per_simd(arch: str, *, vgpr: int, sgpr: int, lds_bytes: int, block_threads: int) -> int:
    """Waves of one kernel resident per SIMD (model and sources in the comment above)."""
    limits = ARCH_LIMITS[_check_arch(arch)]
    if block_threads < 1:
        raise ValueError(f"block_threads: expected >= 1, got {block_threads}")
    by_vgpr = min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD_LANE // (-(-max(vgpr, 1) // VGPR_GRANULE) * VGPR_GRANULE))
    by_sgpr = MAX_WAVES_PER_SIMD if sgpr <= SGPRS_FOR_FULL_OCCUPANCY else MAX_WAVES_PER_SIMD - 1
    waves_per_block = -(-block_threads // WAVE_SIZE)
    blocks_by_regs = SIMDS_PER_CU * min(by_vgpr, by_sgpr) // waves_per_block
    blocks_by_lds = limits.lds_per_cu // lds_bytes if lds_bytes else blocks_by_regs
    blocks = min(blocks_by_regs, blocks_by_lds)
    return math.ceil(blocks * waves_per_block / SIMDS_PER_CU)
