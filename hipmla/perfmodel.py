"""The performance model of the AMD fast kernels: a predicted time per decode step.

``hipmla.aot`` counts the instructions of a fast kernel's tile loop in its code object;
this module turns those counts, the kernel's occupancy and the target's datasheet figures
into a time per benchmark shape next to the HBM bound (``python -m hipmla build --report``).
It needs no toolchain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hipmla.schedule import SplitPolicy, schedule

if TYPE_CHECKING:  # aot imports this module; the counts type is only needed for hints
    from hipmla.aot import LoopCounts

#: SIMDs per CU on gfx942 / gfx950 (CDNA3 / CDNA4 ISA guides), each issuing for its own
#: waves; hipmla.aot's occupancy model spreads waves over the same four.
SIMDS_PER_CU = 4
#: Issue cycles of one MFMA on MI355X, from the datasheet's dense peaks at 2.4 GHz over
#: 256 CUs x 4 SIMDs: bf16 2.5 PFLOP/s = 1024 FLOP per SIMD and clock -> 16x16x32 (16,384
#: FLOP) takes 16; MXFP4 10 PFLOP/s -> 16x16x128 (65,536 FLOP) fp4 x fp4 takes 16, with an
#: fp8 operand the 5 PFLOP/s fp8 rate -> 32.
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
#: counts packed dual FMAs); transcendentals run at a quarter of that rate.
VALU_CYCLES = 4
TRANSCENDENTAL_CYCLES = 16
#: LDS bandwidth per CU and clock (CDNA3/CDNA4 ISA guides: 128 bytes).
LDS_BYTES_PER_CLOCK = 128


@dataclass(frozen=True)
class Device:
    """Datasheet numbers of the prediction's target."""

    name: str
    num_cus: int
    clock_hz: float
    hbm_bytes_per_s: float


MI355X = Device("MI355X", num_cus=256, clock_hz=2.4e9, hbm_bytes_per_s=8.0e12)
#: AMD Instinct MI300X datasheet: 304 CUs, 2.1 GHz peak engine clock, 5.3 TB/s HBM3.
MI300X = Device("MI300X", num_cus=304, clock_hz=2.1e9, hbm_bytes_per_s=5.3e12)
#: The device each arch's fast kernels are predicted on.
DEVICES = {"gfx950": MI355X, "gfx942": MI300X}
#: KV bytes per token of each cache format (mxfp4 adds its scale row stride).
KV_ROW_BYTES = {"bf16": 1152, "fp8": 576, "mxfp4": 288}
#: DESIGN.md's benchmark: bs x kv_len, q_len 1, 16 heads.
BENCHMARK_SHAPES = tuple((bs, n) for bs in (4, 32, 64, 256) for n in (1024, 8192))


@dataclass(frozen=True)
class Prediction:
    batch: int
    kv_len: int
    hbm_us: float  # bytes moved at the datasheet bandwidth: the floor
    compute_us: tuple[float, float]  # issue-bound makespan: MFMA and VALU overlapped / serial
    predicted_us: tuple[float, float]  # max(hbm, compute), both ends


def predict(counts: LoopCounts, waves_per_simd: int, batch: int, kv_len: int, *,
            device: Device = MI355X, waves_per_block: int = 4, kv_format: str = "mxfp4",
            scale_stride: int = 18) -> Prediction:
    """A roofline prediction for one uniform batch on the fast kernel (all of the
    benchmark's lengths are whole tiles). Per tile, each of the block's waves runs one
    loop trip on its own SIMD: MFMA and VALU cycles overlapped (low) or serial (high), the
    LDS at LDS_BYTES_PER_CLOCK per CU; blocks resident per CU share the SIMDs. Items come
    from the device schedule (hipmla.schedule) and are dealt longest first to the least loaded CU. Not modelled:
    launch latency, the per-item schedule prologue / merge, memory latency.
    ``kv_format`` sets the bytes per token (``scale_stride`` the mxfp4 scale row)."""
    # the decoder's policy on gfx950/gfx942: the fast kernel takes every item
    items = schedule([kv_len] * batch, SplitPolicy.for_device(device.num_cus))
    length = items.end - items.begin
    whole = length > 0
    blocks_per_cu = max(1, waves_per_simd * SIMDS_PER_CU // waves_per_block)
    valu = counts.valu * VALU_CYCLES + counts.transcendental * (TRANSCENDENTAL_CYCLES - VALU_CYCLES)
    lds = counts.lds_bytes * waves_per_block / LDS_BYTES_PER_CLOCK
    per_tile = (max(counts.mfma_cycles, valu, lds), max(counts.mfma_cycles + valu, lds))
    tiles = -(-length[whole] // 128)  # a partial last tile costs a whole one
    loads = [0] * (device.num_cus * blocks_per_cu)
    for t in sorted(tiles.tolist(), reverse=True):
        i = loads.index(min(loads))
        loads[i] += t
    # A CU's resident blocks interleave on its SIMDs: a slot runs at 1 / blocks_per_cu.
    makespan_tiles = max(loads) * blocks_per_cu
    compute = tuple(makespan_tiles * c / device.clock_hz * 1e6 for c in per_tile)
    if kv_format not in KV_ROW_BYTES:
        raise ValueError(f"kv_format: expected one of {', '.join(KV_ROW_BYTES)}, got {kv_format!r}")
    token_bytes = KV_ROW_BYTES[kv_format] + (scale_stride if kv_format == "mxfp4" else 0)
    bytes_moved = (batch * kv_len * token_bytes + batch * 16 * 576 * 2 + batch * 16 * 512 * 2
                   + int((items.n_items > 1).sum()) * 16 * (512 + 2) * 4 * 2)
    hbm = bytes_moved / device.hbm_bytes_per_s * 1e6
    return Prediction(batch, kv_len, hbm, compute, (max(hbm, compute[0]), max(hbm, compute[1])))


def format_predictions(symbol: str, predictions: Sequence[Prediction], device: Device = MI355X) -> str:
    lines = [f"{symbol}: PREDICTED {device.name} time per decode (not measured; roofline model of "
             f"hipmla.perfmodel.predict), us", "  shape      HBM bound   compute (overlap..serial)   predicted"]
    for p in predictions:
        lines.append(f"  {p.batch:>3}x{p.kv_len:<5} {p.hbm_us:9.1f}   {p.compute_us[0]:9.1f} .. {p.compute_us[1]:<9.1f}"
                     f"   {p.predicted_us[0]:.1f} .. {p.predicted_us[1]:.1f}")
    return "\n".join(lines)


