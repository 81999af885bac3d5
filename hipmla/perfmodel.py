"""The performance model of the decode kernels: a predicted time per decode step, as a range.

One model serves every kernel with a tile loop: the sm_90 tensor-core kernel on the H200
(where we can measure) and the AMD fast kernels on MI355X / MI300X (where we cannot).
For one uniform batch (``batch`` sequences of ``kv_len`` tokens) in one launch:

    time = launch + prologue + max(HBM, issue, memory latency) + merge

(a) **HBM**: the bytes a step must move at the share ``stream_efficiency`` of the HBM
    bandwidth; never below the **HBM floor**, the bytes at the datasheet peak.
(b) **issue**: the busiest CU's tiles (of all its resident blocks) times the CU cycles one
    block's tile takes at perfect issue (from instruction counts), over the issue
    efficiency (the share of the peak issue rate the kernel reaches: dependency stalls,
    barriers, a lone block's few warps).
(c) **memory latency** (Little's law): a CU sustains ``in_flight / latency`` bytes per
    second, in_flight = the kernel's copy ring (stages x tile bytes x resident blocks), so
    the busiest CU's bytes can never take less than bytes / (in_flight / latency): the
    per-tile latency of a lone block is latency / stages.
(d) the **prologue** of an item on the critical path (the schedule's read of the batch,
    Q, the first tile's latency) and the **merge** of the last split sequence (its last
    block reads n_slots partials of 16 x 512 f32, one or two round trips per slot, after
    the release fence and the counter's atomic);
(e) the **launch**: one fixed time per step.

Every term is a range [low, high]: the low end takes each uncertain input at its
optimistic value, the high end at its pessimistic one; the inputs and where each comes
from are the constants below, all in one place. The three free factors -- issue
efficiency, stream efficiency, launch -- are fitted once to the H200 measurements
(:data:`H200_MEASURED`) by least squares in log space on the middle of each range
(:func:`fit_calibration`), and the same factors, with the AMD datasheet figures, make the
MI355X / MI300X predictions (:func:`calibration_report`; ``python -m hipmla model``).
Those AMD numbers are predictions: no AMD GPU has run these kernels.

The AMD instruction counts come from the built code objects (``hipmla.aot.loop_counts``);
this module only turns counts into time and needs no toolchain.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hipmla.formats import default_scale_stride
from hipmla.reference import D_QK, D_V, HEADS
from hipmla.schedule import SplitPolicy, schedule
from hipmla.validate import arch_list_arg, folder_arg

if TYPE_CHECKING:  # aot imports this module; the counts type is only needed for hints
    from hipmla.aot import LoopCounts


class Range(NamedTuple):
    """A quantity between an optimistic ``low`` and a pessimistic ``high`` end."""

    low: float
    high: float

    @property
    def mid(self) -> float:
        """The geometric middle: what the calibration fits, and what a ratio is taken of."""
        return math.sqrt(self.low * self.high)

    def scale(self, factor: float) -> Range:
        return Range(self.low * factor, self.high * factor)


def range_max(*ranges: Range) -> Range:
    return Range(max(r.low for r in ranges), max(r.high for r in ranges))


def range_sum(*ranges: Range) -> Range:
    return Range(sum(r.low for r in ranges), sum(r.high for r in ranges))


# =====================================================================================
# Every constant of the model, with where it comes from:
#   datasheet  -- the vendor's published figure
#   measured   -- measured by this project (where, when)
#   assumption -- our estimate; nothing measured it
#   derived    -- computed from the figures above it
# The free factors are not here: fit_calibration derives them from H200_MEASURED.
# =====================================================================================

#: KV bytes per token of each cache format (mxfp4 adds its scale row stride). Derived:
#: 576 dims x 2 / 1 / 0.5 bytes.
KV_ROW_BYTES = {"bf16": 2 * D_QK, "fp8": D_QK, "mxfp4": D_QK // 2}
#: The E8M0 row stride of the benchmark inputs (hipmla.inputs: 18 scales padded to 24),
#: which the H200 measurements used; the AMD predictions read the same inputs.
BENCH_SCALE_STRIDE = default_scale_stride(D_QK)
#: DESIGN.md's benchmark: bs x kv_len, q_len 1, 16 heads.
BENCHMARK_SHAPES = tuple((bs, n) for bs in (4, 32, 64, 256) for n in (1024, 8192))

# --- AMD issue costs (used by hipmla.aot.count_loop to weigh the instructions it counts) ---
#: Issue cycles of one MFMA on MI355X, from the datasheet's dense peaks at 2.4 GHz over
#: 256 CUs x 4 SIMDs: bf16 2.5 PFLOP/s = 1024 FLOP per SIMD and clock -> 16x16x32 (16,384
#: FLOP) takes 16; MXFP4 10 PFLOP/s -> 16x16x128 (65,536 FLOP) fp4 x fp4 takes 16, with an
#: fp8 operand the 5 PFLOP/s fp8 rate -> 32. Derived from datasheets.
#: On MI300X (gfx942; only the gfx942 kernel uses the k = 16 bf16 MFMA), from AMD's MI300X
#: datasheet: 1307.4 TFLOP/s dense bf16 at 2.1 GHz over 304 CUs x 4 SIMDs = 512 FLOP per
#: SIMD and clock -> 16x16x16 (8,192 FLOP) takes 16.
MFMA_CYCLES = {
    "v_mfma_f32_16x16x32_bf16": 16,
    "v_mfma_f32_16x16x16_bf16": 16,
    "v_mfma_scale_f32_16x16x128_f8f6f4/fp4": 16,
    "v_mfma_scale_f32_16x16x128_f8f6f4/fp8": 32,
}
#: A wave64 VALU instruction on a 16-lane SIMD: 4 cycles (the 157 TFLOP/s fp32 vector peak
#: counts packed dual FMAs); transcendentals run at a quarter of that rate. Datasheet / ISA.
VALU_CYCLES = 4
TRANSCENDENTAL_CYCLES = 16
#: LDS bandwidth per CU and clock (CDNA3/CDNA4 ISA guides: 128 bytes). ISA guide.
LDS_BYTES_PER_CLOCK = 128

# --- memory and clock: measured on the H200, carried to AMD as assumptions ---
#: NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 1.98 GHz boost clock.
H200_HBM_BYTES_PER_S = 4.8e12
H200_BOOST_HZ = 1.98e9
#: A read-only stream's share of the datasheet HBM peak. Measured on the H200 2026-12-01:
#: torch.sum over 1 GiB (hipmla.bench's read probe) 4203 GB/s. Assumption on AMD: the
#: same share (nothing measured there).
H200_READ_BYTES_PER_S = 4203e9
READ_FRACTION = H200_READ_BYTES_PER_S / H200_HBM_BYTES_PER_S
#: The SM clock under load over the boost clock. Measured: Nsight Compute saw 1.81 GHz
#: at mxfp4 64 x 8k. Assumption on AMD: the same share.
H200_LOADED_HZ = 1.81e9
LOADED_CLOCK_FRACTION = H200_LOADED_HZ / H200_BOOST_HZ
#: One load's round trip to HBM, unloaded. Assumption: 600-800 ns on the H200 (no
#: microbenchmark of ours); the same range is assumed on MI355X and MI300X.
DRAM_LATENCY_S = Range(600e-9, 800e-9)
#: A merge read's round trip on the H200: an L2 hit. Assumption: a few hundred cycles at
#: ~2 GHz, 150-300 ns. On AMD the merge's loads skip the XCD's non-coherent L2
#: (core/merge.h), so they take the DRAM range there (assumption).
H200_L2_LATENCY_S = Range(150e-9, 300e-9)

# --- the critical path's round trips (assumptions read off the kernels' structure) ---
#: Per item, before its first tile's math: the schedule's read of kv_indptr (two block
#: scans on chip are ~100s of cycles, left out), Q, the first tile's copy.
PROLOGUE_ROUND_TRIPS = 3
#: The merge, once per split sequence: the release fence after the partial write and the
#: counter's atomic, then per slot one round trip (loads of all slots in flight together:
#: the merge's slot loops are unrolled) or two (m / l first, then acc). This is the
#: one-block merge the calibration timed; since f0a29c4 a row's items share the merge
#: (core/merge.h, a batch of slots per round trip each), which needs the calibration
#: shapes measured again before the model follows it.
MERGE_FIXED_ROUND_TRIPS = 2
MERGE_ROUND_TRIPS_PER_SLOT = Range(1, 2)


@dataclass(frozen=True)
class Device:
    """Datasheet figures of a prediction's target, plus the (assumed) latencies."""

    name: str
    num_cus: int  # CUs (AMD) or SMs (NVIDIA)
    clock_hz: float  # peak engine / boost clock
    hbm_bytes_per_s: float  # datasheet peak
    issue_units: int  # per CU: SIMDs (AMD), warp schedulers (NVIDIA)
    cu_word: str = "CUs"
    read_fraction: float = READ_FRACTION
    loaded_clock_fraction: float = LOADED_CLOCK_FRACTION
    dram_latency_s: Range = DRAM_LATENCY_S
    merge_latency_s: Range = DRAM_LATENCY_S

    @property
    def clock(self) -> Range:
        """Cycles per second, under load .. boost (a time's high and low ends)."""
        return Range(self.clock_hz * self.loaded_clock_fraction, self.clock_hz)

    @property
    def hbm(self) -> Range:
        """Bytes per second, what a read stream reaches .. the datasheet peak."""
        return Range(self.hbm_bytes_per_s * self.read_fraction, self.hbm_bytes_per_s)


#: SIMDs per CU on gfx942 / gfx950 (CDNA3 / CDNA4 ISA guides), each issuing for its own
#: waves; hipmla.aot's occupancy model spreads waves over the same four.
SIMDS_PER_CU = 4
#: AMD Instinct MI355X datasheet: 256 CUs, 2.4 GHz peak engine clock, 8 TB/s HBM3E.
MI355X = Device("MI355X", num_cus=256, clock_hz=2.4e9, hbm_bytes_per_s=8.0e12, issue_units=SIMDS_PER_CU)
#: AMD Instinct MI300X datasheet: 304 CUs, 2.1 GHz peak engine clock, 5.3 TB/s HBM3.
MI300X = Device("MI300X", num_cus=304, clock_hz=2.1e9, hbm_bytes_per_s=5.3e12, issue_units=SIMDS_PER_CU)
#: NVIDIA H200 SXM datasheet: 132 SMs; 4 warp schedulers per SM, each issuing one
#: warp-instruction a clock (Hopper whitepaper).
H200 = Device("H200", num_cus=132, clock_hz=H200_BOOST_HZ, hbm_bytes_per_s=H200_HBM_BYTES_PER_S, issue_units=4,
              cu_word="SMs", merge_latency_s=H200_L2_LATENCY_S)
#: The device each arch's kernels are predicted on.
DEVICES = {"gfx950": MI355X, "gfx942": MI300X, "sm_90": H200}

# --- the sm_90 kernel (measured: SASS) ---
#: SASS instructions of the tile loop per warp and 32-token tile (nvcc 13.0, the 32-FMUL
#: rescale included): bf16 294, fp8 440, mxfp4 522 -- the kernel H200_MEASURED timed, so
#: the calibration holds together. The kernel has changed since (its header: 260 / 410 / 498
#: at a00b93a, 261 / 418 / 469 on 2026-12-02); refitting needs its times measured again.
SM90_INSTRUCTIONS = {"bf16": 294, "fp8": 440, "mxfp4": 522}
#: The copy ring: 32-token tiles of KV in flight per block (STAGES in the source).
SM90_STAGES = {"bf16": 2, "fp8": 4, "mxfp4": 6}
SM90_TILE_TOKENS = 32
SM90_WARPS = 8  # per block (256 threads)
SM90_BLOCKS_PER_SM = 2  # __launch_bounds__(256, 2): 128 registers, 16 warps per SM
#: Measured by Nsight Compute at mxfp4 64 x 8k: IPC 1.98 of 4. A check of the fitted
#: issue efficiency, not an input.
SM90_MEASURED_IPC = 1.98

# --- the AMD fast kernels' copy rings (from their sources) ---
#: Tiles (of the kernel's own tile_tokens) of a block in flight. gfx950 (128-token tiles):
#: with quantized Q two LDS buffers per wave, copies one tile ahead
#: (split_mfma_gfx950.hip) -> 2; bf16 Q ("gfx950 qbf16") one buffer per wave, refilled
#: after the tile's P.V -> 1 (and twice the resident blocks; the wave's own wait for that
#: copy, in series with its math, is not modelled: an assumption that the other resident
#: block's waves cover it). gfx942 (16-token tiles): a 3-stage LDS ring, tiles t + 1 and
#: t + 2 in flight while tile t is computed (split_mfma_gfx942.hip) -> 2.
AMD_STAGES = {"gfx950": 2.0, "gfx950 qbf16": 1.0, "gfx942": 2.0}
AMD_WAVES_PER_BLOCK = 4


# =====================================================================================
# The kernel as the model sees it
# =====================================================================================


@dataclass(frozen=True)
class KernelModel:
    """What the model needs to know of one kernel on one device."""

    name: str
    device: Device
    kv_format: str
    tile_tokens: int  # tokens per trip of a block's tile loop
    tile_issue_cycles: Range  # CU cycles of one block's tile at perfect issue (low: pipes overlapped)
    blocks_per_cu: int  # resident blocks per CU / SM
    stages: float  # tiles of a block's copy ring in flight
    token_bytes: int  # KV bytes per token

    @property
    def tile_bytes(self) -> int:
        return self.tile_tokens * self.token_bytes

    def in_flight_bytes(self, resident_blocks: int) -> float:
        """Bytes a CU has in flight with this many blocks resident: its copy rings."""
        return self.stages * self.tile_bytes * resident_blocks


def token_bytes(kv_format: str, scale_stride: int = BENCH_SCALE_STRIDE) -> int:
    if kv_format not in KV_ROW_BYTES:
        raise ValueError(f"kv_format: expected one of {', '.join(KV_ROW_BYTES)}, got {kv_format!r}")
    return KV_ROW_BYTES[kv_format] + (scale_stride if kv_format == "mxfp4" else 0)


@lru_cache(maxsize=None)
def sm90_kernel(kv_format: str, device: Device = H200) -> KernelModel:
    """The sm_90 tensor-core kernel: every instruction goes through one of the SM's warp
    schedulers, so a block's tile is warps x instructions / schedulers cycles at best."""
    row = token_bytes(kv_format)  # checks the format
    n = SM90_INSTRUCTIONS[kv_format]
    cycles = SM90_WARPS * n / device.issue_units
    return KernelModel(
        name=f"hipmla_decode_split_sm90_{kv_format}_qbf16", device=device, kv_format=kv_format,
        tile_tokens=SM90_TILE_TOKENS, tile_issue_cycles=Range(cycles, cycles),
        blocks_per_cu=SM90_BLOCKS_PER_SM, stages=SM90_STAGES[kv_format], token_bytes=row)


def amd_tile_cycles(counts: LoopCounts, waves_per_block: int = AMD_WAVES_PER_BLOCK,
                    issue_units: int = SIMDS_PER_CU) -> Range:
    """CU cycles of one block's tile from a wave's loop counts: each wave runs one trip on
    a SIMD, MFMA and VALU overlapped (low) or serial (high); the block's LDS traffic is
    shared by the CU at LDS_BYTES_PER_CLOCK."""
    valu = counts.valu * VALU_CYCLES + counts.transcendental * (TRANSCENDENTAL_CYCLES - VALU_CYCLES)
    lds = counts.lds_bytes * waves_per_block / LDS_BYTES_PER_CLOCK
    per_simd = waves_per_block / issue_units  # waves of one block on each SIMD
    return Range(max(counts.mfma_cycles * per_simd, valu * per_simd, lds),
                 max((counts.mfma_cycles + valu) * per_simd, lds))


def amd_kernel(counts: LoopCounts, waves_per_simd: int, arch: str, kv_format: str, *,
               tile_tokens: int = 128, waves_per_block: int = AMD_WAVES_PER_BLOCK,
               scale_stride: int = BENCH_SCALE_STRIDE) -> KernelModel:
    """An AMD fast kernel from its counted tile loop and its occupancy (hipmla.aot)."""
    device = DEVICES[arch]
    simds = device.issue_units
    return KernelModel(
        name=counts.symbol, device=device, kv_format=kv_format, tile_tokens=tile_tokens,
        tile_issue_cycles=amd_tile_cycles(counts, waves_per_block, simds),
        blocks_per_cu=max(1, waves_per_simd * simds // waves_per_block),
        stages=amd_stages(arch, counts.symbol), token_bytes=token_bytes(kv_format, scale_stride))


def amd_stages(arch: str, symbol: str) -> float:
    """AMD_STAGES of a fast kernel (its symbol ends in its Q precision)."""
    return AMD_STAGES.get(f"{arch} {symbol.rsplit('_', 1)[-1]}", AMD_STAGES[arch])


# =====================================================================================
# Where the items land (the schedule, dealt onto the CUs)
# =====================================================================================


@dataclass(frozen=True)
class Placement:
    """What the time terms need of a batch's schedule on a device: the busiest CU and
    block slot, and the widest split."""

    split_items: int  # items that write a partial slot
    merge_slots: int  # slots of the widest split sequence (0: no sequence is split)
    cu_tiles: int  # tiles of the busiest CU, over all its blocks
    slot_items: int  # items of the slot with the most
    tokens_per_resident_block: float  # max over CUs of their tokens / their resident blocks


@lru_cache(maxsize=512)
def place(num_cus: int, blocks_per_cu: int, tile_tokens: int, batch: int, kv_len: int,
          split: tuple[int, int] | None = None) -> Placement:
    """Items from the device schedule (hipmla.schedule, the decoder's policy on every
    device: SplitPolicy.for_device(num_cus), or with ``split`` = (min_split_tokens,
    max_ranges) instead of its defaults), dealt longest first to the least loaded block
    slot; slot s sits on CU s mod num_cus (the dispatcher fills every CU once before it
    puts a second block on any). A partial last tile costs a whole one. The H200's
    dispatcher does not keep that (128 item blocks of a launch ran on 120 SMs, 8 of them
    two: scripts/results/h200-2026-12-04-sm90-timeline-placement.txt); the kernels make it
    true on NVIDIA by handing the items to the SMs' first blocks first
    (hip_src/core/placement.h). On AMD, where a block does not know its CU, a step of
    fewer items than CUs may still take longer than predicted."""
    policy = SplitPolicy.for_device(num_cus)
    if split is not None:
        policy = replace(policy, min_split_tokens=split[0], max_ranges=split[1])
    items = schedule([kv_len] * batch, policy)
    length = (items.end - items.begin).astype(np.int64)
    tiles = -(-length // tile_tokens)
    n_slots = num_cus * blocks_per_cu
    slot_tiles = np.zeros(n_slots, np.int64)
    slot_tokens = np.zeros(n_slots, np.int64)
    slot_items = np.zeros(n_slots, np.int64)
    for i in np.argsort(-tiles, kind="stable"):
        if length[i] <= 0:
            continue
        s = int(np.argmin(slot_tiles))
        slot_tiles[s] += tiles[i]
        slot_tokens[s] += length[i]
        slot_items[s] += 1
    cu = np.arange(n_slots) % num_cus
    cu_tiles = np.bincount(cu, slot_tiles, num_cus)
    cu_tokens = np.bincount(cu, slot_tokens, num_cus)
    resident = np.minimum(np.bincount(cu, slot_items > 0, num_cus), blocks_per_cu)
    busy = resident > 0
    split = items.n_items > 1
    return Placement(
        split_items=int(split.sum()),
        merge_slots=int(items.n_items[split].max()) if split.any() else 0,
        cu_tiles=int(cu_tiles.max()), slot_items=int(slot_items.max()),
        tokens_per_resident_block=float((cu_tokens[busy] / resident[busy]).max()) if busy.any() else 0.0)


def bytes_moved(kernel: KernelModel, batch: int, kv_len: int, split_items: int) -> int:
    """KV, Q, the output, and the split partials (written, then read back by the merge)."""
    partial = HEADS * (D_V + 2) * 4
    return (batch * kv_len * kernel.token_bytes + batch * HEADS * D_QK * 2 + batch * HEADS * D_V * 2
            + split_items * partial * 2)


# =====================================================================================
# The free factors, and the terms: small pure functions, each a Range of seconds
# =====================================================================================


@dataclass(frozen=True)
class Calibration:
    """The model's free factors (fitted to H200_MEASURED by fit_calibration)."""

    issue_efficiency: float  # share of the peak issue rate the kernel's CUs reach
    stream_efficiency: float  # share of the HBM bandwidth (read stream .. peak) its copies reach
    launch_s: float  # the launch, and whatever fixed cost per step the other terms miss


#: No stalls, full bandwidth, no launch: the plain roofline (the model before calibration).
ROOFLINE = Calibration(issue_efficiency=1.0, stream_efficiency=1.0, launch_s=0.0)


def hbm_floor(nbytes: float, device: Device) -> float:
    """(a) the bytes at the datasheet peak: no step can be faster."""
    return nbytes / device.hbm_bytes_per_s


def hbm_time(nbytes: float, device: Device, cal: Calibration) -> Range:
    """(a) the bytes at the kernel's share of the peak (low) .. of a read stream (high)."""
    return Range(nbytes / (device.hbm.high * cal.stream_efficiency),
                 nbytes / (device.hbm.low * cal.stream_efficiency))


def issue_time(kernel: KernelModel, cu_tiles: int, cal: Calibration) -> Range:
    """(b) the busiest CU issues every tile of its resident blocks; at boost (low) or
    loaded (high) clock, with overlapped (low) or serial (high) pipes."""
    c = kernel.tile_issue_cycles.scale(cu_tiles / cal.issue_efficiency)
    clock = kernel.device.clock
    return Range(c.low / clock.high, c.high / clock.low)


def sustained_bytes_per_s(kernel: KernelModel, resident_blocks: int, latency_s: float) -> float:
    """Little's law: what a CU can read with its copy rings in flight, each byte taking
    the latency to arrive."""
    return kernel.in_flight_bytes(resident_blocks) / latency_s


def latency_time(kernel: KernelModel, tokens_per_resident_block: float) -> Range:
    """(c) the busiest CU's bytes at the rate its in-flight bytes sustain: a CU with r
    resident blocks reads r times one block's rate, so tokens per resident block decide."""
    nbytes = tokens_per_resident_block * kernel.token_bytes
    lat = kernel.device.dram_latency_s
    return Range(nbytes / sustained_bytes_per_s(kernel, 1, lat.low),
                 nbytes / sustained_bytes_per_s(kernel, 1, lat.high))


def prologue_time(device: Device, slot_items: int) -> Range:
    """(d) the prologue of the first item (low: later items' prologues hide behind the
    other resident blocks) .. of every item of the busiest slot, one after another (high)."""
    trips = device.dram_latency_s.scale(PROLOGUE_ROUND_TRIPS)
    return Range(trips.low, trips.high * max(slot_items, 1))


def merge_time(device: Device, merge_slots: int) -> Range:
    """(d) the last split sequence's merge: the release and the atomic, then its slots'
    partials read one after another, 1..2 round trips a slot at the device's merge
    latency (an L2 hit on the H200); nothing without a split."""
    if merge_slots <= 1:
        return Range(0.0, 0.0)
    lat = device.merge_latency_s
    per = MERGE_ROUND_TRIPS_PER_SLOT
    return Range((MERGE_FIXED_ROUND_TRIPS + merge_slots * per.low) * lat.low,
                 (MERGE_FIXED_ROUND_TRIPS + merge_slots * per.high) * lat.high)


@dataclass(frozen=True)
class Prediction:
    """Time of one decode step of a uniform batch, by term, in µs."""

    kernel: str
    device: str
    batch: int
    kv_len: int
    floor_us: float  # the HBM floor: bytes at the datasheet peak
    hbm_us: Range
    issue_us: Range
    latency_us: Range
    prologue_us: Range
    merge_us: Range
    launch_us: Range

    @property
    def streaming_us(self) -> Range:
        """The terms that overlap: whichever is slowest sets the pace."""
        return range_max(self.hbm_us, self.issue_us, self.latency_us)

    @property
    def total_us(self) -> Range:
        """launch + prologue + max(HBM, issue, latency) + merge."""
        return range_sum(self.launch_us, self.prologue_us, self.streaming_us, self.merge_us)

    @property
    def bound(self) -> str:
        """The streaming term that sets the middle of the range."""
        terms = {"HBM": self.hbm_us, "issue": self.issue_us, "latency": self.latency_us}
        return max(terms, key=lambda k: terms[k].mid)

    @property
    def fixed_us(self) -> Range:
        return range_sum(self.launch_us, self.prologue_us, self.merge_us)


def predict(kernel: KernelModel, batch: int, kv_len: int, cal: Calibration = ROOFLINE,
            split: tuple[int, int] | None = None) -> Prediction:
    """The model (module docstring) for ``batch`` sequences of ``kv_len`` tokens, split by
    the decoder's policy (or ``split``: see :func:`place`)."""
    dev = kernel.device
    p = place(dev.num_cus, kernel.blocks_per_cu, kernel.tile_tokens, batch, kv_len, split)
    nbytes = bytes_moved(kernel, batch, kv_len, p.split_items)
    terms = {
        "hbm": hbm_time(nbytes, dev, cal),
        "issue": issue_time(kernel, p.cu_tiles, cal),
        "latency": latency_time(kernel, p.tokens_per_resident_block),
        "prologue": prologue_time(dev, p.slot_items),
        "merge": merge_time(dev, p.merge_slots),
        "launch": Range(cal.launch_s, cal.launch_s),
    }
    us = {k: v.scale(1e6) for k, v in terms.items()}
    return Prediction(kernel.name, dev.name, batch, kv_len, hbm_floor(nbytes, dev) * 1e6, us["hbm"], us["issue"],
                      us["latency"], us["prologue"], us["merge"], us["launch"])


# =====================================================================================
# Calibration on the H200
# =====================================================================================


@dataclass(frozen=True)
class Measurements:
    """Measured µs per step of one kernel family, and how they were taken."""

    device: str
    date: str
    commit: str
    script: str
    method: str
    points: tuple[tuple[str, int, int, float], ...]  # (kv_format, batch, kv_len, µs)
    split: tuple[int, int]  # (min_split_tokens, max_ranges) of the policy the run used


#: The calibration data: the sm_90 kernel alone (p.fast_tile = 0), contiguous rows, bf16 Q.
H200_MEASURED = Measurements(
    device="NVIDIA H200", date="2026-12-01", commit="efe9567", script="scripts/sm90_trial.py",
    method="HIP events around one launch, no L2 flush, median of 20 after 3 warm-ups",
    points=(
        # kv      batch kv_len    µs
        ("bf16",      4,  1024,  33.4),
        ("bf16",     32,  8192, 120.8),
        ("bf16",     64,  8192, 187.3),
        ("bf16",    256,  8192, 641.0),
        ("fp8",       4,  1024,  35.2),
        ("fp8",      32,  8192, 106.2),
        ("fp8",      64,  8192, 162.9),
        ("fp8",     256,  8192, 549.8),
        ("mxfp4",     4,  1024,  35.4),
        ("mxfp4",    32,  8192, 105.9),
        ("mxfp4",    64,  8192, 162.9),
        ("mxfp4",   256,  8192, 541.2),
    ),
    split=(256, 0))  # the policy before the 16-range cap

#: Where the fit looks (a factor that ends on a bound is reported as such).
FIT_BOUNDS = {"issue_efficiency": (0.05, 1.0), "stream_efficiency": (0.3, 1.0), "launch_us": (0.0, 60.0)}
FIT_GRID = 11  # points per factor and round (issue x stream efficiency)
FIT_ROUNDS = 6  # each round narrows the box to two grid steps either side of the best point
#: The calibration must reproduce every measured point within this factor (tested).
CALIBRATION_TOLERANCE = 1.2


def log_residuals(cal: Calibration, data: Measurements = H200_MEASURED) -> list[float]:
    """ln(measured / predicted middle) per measured point."""
    return [math.log(t / predict(sm90_kernel(fmt), b, n, cal, data.split).total_us.mid) for fmt, b, n, t in data.points]


def _log_sse(lows: Sequence[float], highs: Sequence[float], measured: Sequence[float], launch: float) -> float:
    return sum((math.log(t) - 0.5 * math.log((lo + launch) * (hi + launch))) ** 2
               for lo, hi, t in zip(lows, highs, measured))


def best_launch(lows: Sequence[float], highs: Sequence[float], measured: Sequence[float]) -> float:
    """The launch (µs) that minimises the log residuals of ranges (µs) that lack it: it adds
    to both ends of every range, so this is a one-dimensional search (golden section over
    FIT_BOUNDS; the sum of squares is unimodal in it)."""
    a, b = FIT_BOUNDS["launch_us"]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(40):  # 60 us x 0.618^40: far below a printed digit
        c, d = b - g * (b - a), a + g * (b - a)
        if _log_sse(lows, highs, measured, c) <= _log_sse(lows, highs, measured, d):
            b = d
        else:
            a = c
    return (a + b) / 2


@lru_cache(maxsize=4)
def fit_calibration(data: Measurements = H200_MEASURED) -> Calibration:
    """Least squares in log space over every measured point: the factors minimising
    sum ln(measured / predicted middle)^2. A grid over issue x stream efficiency,
    narrowed around its best point FIT_ROUNDS times, with the best launch for each grid
    point found by :func:`best_launch`. Deterministic; no optimiser dependency."""
    points = data.points
    measured = [t for *_, t in points]
    box = [FIT_BOUNDS["issue_efficiency"], FIT_BOUNDS["stream_efficiency"]]
    best: tuple[float, Calibration] | None = None
    for _ in range(FIT_ROUNDS):
        axes = [[lo + (hi - lo) * i / (FIT_GRID - 1) for i in range(FIT_GRID)] for lo, hi in box]
        for e in axes[0]:
            for eta in axes[1]:
                ranges = [predict(sm90_kernel(fmt), b, n, Calibration(e, eta, 0.0), data.split).total_us
                          for fmt, b, n, _ in points]
                lows, highs = [r.low for r in ranges], [r.high for r in ranges]
                launch = best_launch(lows, highs, measured)
                sse = _log_sse(lows, highs, measured, launch)
                if best is None or sse < best[0]:
                    best = (sse, Calibration(e, eta, launch * 1e-6))
        assert best is not None
        centre = (best[1].issue_efficiency, best[1].stream_efficiency)
        names = ("issue_efficiency", "stream_efficiency")
        box = [(max(FIT_BOUNDS[k][0], x - 2 * (hi - lo) / (FIT_GRID - 1)),
                min(FIT_BOUNDS[k][1], x + 2 * (hi - lo) / (FIT_GRID - 1)))
               for k, (lo, hi), x in zip(names, box, centre)]
    assert best is not None
    return best[1]


# =====================================================================================
# Reports
# =====================================================================================


def _shape(batch: int, kv_len: int) -> str:
    return f"{batch:>3}x{kv_len:<5}"


def _r(r: Range) -> str:
    return f"{r.low:6.1f} .. {r.high:<6.1f}"


def _ns(r: Range) -> str:
    return f"{r.low * 1e9:.0f}-{r.high * 1e9:.0f} ns"


def format_constants(devices: Sequence[Device]) -> str:
    """The model's inputs for ``devices``, each with its kind (the sources are beside each
    constant in hipmla/perfmodel.py)."""
    lines = ["constants (datasheet / measured / assumption; hipmla/perfmodel.py gives each one's source)"]
    for d in devices:
        lines.append(f"  {d.name}: {d.num_cus} {d.cu_word}, {d.clock_hz / 1e9:.2f} GHz, "
                     f"{d.hbm_bytes_per_s / 1e12:.1f} TB/s HBM, {d.issue_units} issue units per {d.cu_word[:-1]} "
                     f"(datasheet); DRAM round trip {_ns(d.dram_latency_s)}, "
                     f"merge round trip {_ns(d.merge_latency_s)} (assumption)")
    lines += [
        f"  read stream {READ_FRACTION:.3f} of the HBM peak (measured on the H200: torch.sum "
        f"{H200_READ_BYTES_PER_S / 1e9:.0f} of {H200_HBM_BYTES_PER_S / 1e9:.0f} GB/s; assumed on AMD)",
        f"  clock under load {LOADED_CLOCK_FRACTION:.3f} of boost (measured on the H200: {H200_LOADED_HZ / 1e9:.2f} of "
        f"{H200_BOOST_HZ / 1e9:.2f} GHz under Nsight Compute; assumed on AMD)",
        f"  prologue {PROLOGUE_ROUND_TRIPS} DRAM round trips per item; merge {MERGE_FIXED_ROUND_TRIPS} + "
        f"{MERGE_ROUND_TRIPS_PER_SLOT.low:.0f}..{MERGE_ROUND_TRIPS_PER_SLOT.high:.0f} round trips per slot "
        "(assumption)",
        "  sm_90 kernel: " + ", ".join(f"{k} {v}" for k, v in SM90_INSTRUCTIONS.items())
        + f" SASS instructions per warp and {SM90_TILE_TOKENS}-token tile (measured, split_sm90.hip), "
        f"{SM90_WARPS} warps x {SM90_BLOCKS_PER_SM} blocks per SM, copy rings of "
        + "/".join(str(v) for v in SM90_STAGES.values()) + " tiles (source)",
        "  AMD fast kernels: instruction counts of the built tile loops (hipmla.aot), copy rings "
        + ", ".join(f"{k} {v:g}" for k, v in AMD_STAGES.items()) + " tiles in flight (gfx950 128-token tiles, "
        "gfx942 16-token tiles; source)",
    ]
    return "\n".join(lines)


def _bound_note(name: str, value: float) -> str:
    lo, hi = FIT_BOUNDS[name]
    return " (at the fit's bound)" if math.isclose(value, lo, abs_tol=1e-9) or math.isclose(value, hi) else ""


def format_calibration(cal: Calibration, data: Measurements = H200_MEASURED) -> str:
    res = log_residuals(cal, data)
    worst = math.exp(max(abs(r) for r in res))
    rms = math.exp(math.sqrt(sum(r * r for r in res) / len(res)))
    stream = H200.hbm.scale(cal.stream_efficiency)
    return "\n".join([
        f"calibration: {data.device}, measured {data.date} at commit {data.commit} by {data.script} "
        f"({data.method}); fitted by least squares in log space on the middle of each range, {len(res)} points",
        f"  issue efficiency   {cal.issue_efficiency:.3f}{_bound_note('issue_efficiency', cal.issue_efficiency)}"
        f"  (check: Nsight Compute at mxfp4 64x8k, IPC {SM90_MEASURED_IPC} of 4 = {SM90_MEASURED_IPC / 4:.3f})",
        f"  stream efficiency  {cal.stream_efficiency:.3f}{_bound_note('stream_efficiency', cal.stream_efficiency)}"
        f"  of {H200.hbm.low / 1e9:.0f}..{H200.hbm.high / 1e9:.0f} GB/s = {stream.low / 1e9:.0f}.."
        f"{stream.high / 1e9:.0f} GB/s for the kernel's copies",
        f"  launch             {cal.launch_s * 1e6:.1f} us{_bound_note('launch_us', cal.launch_s * 1e6)}"
        "  (a fixed cost per step: the launch, and what else the terms miss)",
        f"  measured / predicted middle: worst x{worst:.3f}, rms x{rms:.3f} (tested within x{CALIBRATION_TOLERANCE})",
    ])


def format_measured(cal: Calibration, data: Measurements = H200_MEASURED) -> str:
    """Calibrated predictions of the sm_90 kernel next to the measurements."""
    lines = [f"sm_90 kernel on the {data.device}: predicted (calibrated) vs measured, us",
             "  kv     shape       predicted low .. high    mid  measured  meas/mid  in range  bound"]
    for fmt, b, n, t in data.points:
        p = predict(sm90_kernel(fmt), b, n, cal, data.split)
        inside = "yes" if p.total_us.low <= t <= p.total_us.high else "no"
        lines.append(f"  {fmt:<6} {_shape(b, n)}   {_r(p.total_us)}  {p.total_us.mid:6.1f}  {t:8.1f}  "
                     f"{t / p.total_us.mid:8.3f}  {inside:>8}  {p.bound}")
    return "\n".join(lines)


def format_predictions(kernel: KernelModel, predictions: Sequence[Prediction]) -> str:
    """One kernel's predicted ranges per shape, with the terms that make them (µs)."""
    lines = [f"{kernel.name}: PREDICTED {kernel.device.name} time per decode (not measured; hipmla.perfmodel, "
             f"the H200 calibration with {kernel.device.name} datasheet figures), us",
             "  shape      HBM floor   HBM              issue            latency  fixed   "
             "predicted low .. high    mid  bound"]
    for p in predictions:
        lines.append(f"  {_shape(p.batch, p.kv_len)} {p.floor_us:9.1f}   {_r(p.hbm_us)}   {_r(p.issue_us)}  "
                     f"{p.latency_us.high:7.1f}  {p.fixed_us.mid:5.1f}   {_r(p.total_us)}  {p.total_us.mid:6.1f}  "
                     f"{p.bound}")
    return "\n".join(lines)


def calibration_report(amd_kernels: Sequence[KernelModel] = (), shapes: Sequence[tuple[int, int]] = BENCHMARK_SHAPES,
                       data: Measurements = H200_MEASURED) -> str:
    """The constants, the fitted factors, H200 predicted vs measured, then the PREDICTED
    times of ``amd_kernels`` (built from hipmla.aot's counts) with the same factors."""
    cal = fit_calibration(data)
    devices = [H200] + list(dict.fromkeys(k.device for k in amd_kernels))
    parts = [
        "performance model (hipmla.perfmodel): time = launch + prologue + max(HBM, issue, memory latency) + merge; "
        "each term a range: low = every input at its optimistic value, high = at its pessimistic one",
        format_constants(devices),
        format_calibration(cal, data),
        format_measured(cal, data),
    ]
    parts += [format_predictions(k, [predict(k, b, n, cal) for b, n in shapes]) for k in amd_kernels]
    if amd_kernels:
        parts.append("The AMD times are PREDICTIONS, not measurements: no AMD GPU has run these kernels. They carry "
                     "the H200's fitted factors and assumed latencies to other machines, which nothing has checked.")
    return "\n\n".join(parts)


# =====================================================================================
# CLI: python -m hipmla model
# =====================================================================================


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hipmla model``: the calibration report; 2 when the AMD kernels cannot be counted."""
    from hipmla.aot.occupancy import ARCH_LIMITS  # here: hipmla.aot imports this module

    parser = argparse.ArgumentParser(
        prog="python -m hipmla model",
        description="The performance model: its constants, the factors fitted to the H200 measurements of the "
                    "sm_90 kernel, predicted vs measured per shape, then PREDICTED MI355X (gfx950) and MI300X "
                    "(gfx942) times of the AMD fast kernels, whose tile loops are counted in clang builds.")
    parser.add_argument("--arch", default="gfx950,gfx942", type=arch_list_arg(tuple(ARCH_LIMITS), allow_none=True),
                        help="comma-separated AMD targets to predict (default: gfx950,gfx942); 'none': the "
                             "H200 calibration alone, no clang needed")
    parser.add_argument("--out", type=folder_arg, default=None,
                        help="folder of the code objects (default: where 'python -m hipmla build' writes)")
    args = parser.parse_args(argv)
    archs = args.arch
    kernels: list[KernelModel] = []
    if archs:
        from hipmla import aot  # the toolchain, only when AMD kernels are to be counted

        try:
            kernels = aot.fast_kernel_models(archs, args.out)
        except (aot.ToolchainNotFound, aot.CompileError, ValueError, RuntimeError, OSError) as e:
            print(f"hipmla model: {e}", file=sys.stderr)
            return 2
    print(calibration_report(kernels))
    return 0
