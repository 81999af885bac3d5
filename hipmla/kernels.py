"""What the device kernels are: their parameter struct, specialisations and launch shapes.

The kernels are HIP C++ under ``hip_src/`` (contract and numerics in
``hip_src/KERNELS.md``). This module describes them for whoever compiles and launches
them (:mod:`hipmla.runtime`, :mod:`hipmla.aot`) and imports no GPU library:

- :class:`DecodeParams` mirrors ``struct MlaDecodeParams`` (``hip_src/params.h``), the
  one argument every kernel takes by value;
- :class:`KernelSpec` names a kernel symbol, its source and its ``-D`` specialisation;
- :func:`fast_split_kernel` picks an arch's fast split kernel for whole tiles (gfx950
  MXFP4: the scaled MFMA; gfx942 any cache with bf16 Q: the bf16 MFMA), or None where
  the portable kernel does everything; :func:`decoder_kernel` is the one kernel a
  decoder launches (that fast kernel, else the sm_90 or the portable kernel);
- :func:`translation_unit` turns a source file into one self-contained string, because
  hiprtc and NVRTC see no include path.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

# Shapes, formats and the tile are the numerics' (mirrored in hip_src/common/config.h).
from hipmla.emulate import FAST_SCHEDULES, Q_PRECISIONS, SM90_TILE_TOKENS, TILE_TOKENS
from hipmla.formats import KV_FORMATS
from hipmla.queries import PADDED_HEADS
from hipmla.reference import D_QK, D_V, HEADS
from hipmla.schedule import DEFAULT_ITEMS_PER_CU, row_shape

BLOCK_THREADS = 256
#: int32 words of the placement scratch before its per-SM words (hip_src/core/placement.h).
PLACEMENT_HEADER = 4
#: Integer codes of HIPMLA_KV_FORMAT / HIPMLA_Q_PRECISION (hip_src/common/config.h).
FORMAT_CODES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
#: Architectures whose fp8 is e4m3fnuz (MI300 family); everything else is OCP e4m3fn.
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")

SPLIT_SOURCE = "decode/split.hip"
FAST_SOURCES = {"gfx950": "decode/split_mfma_gfx950.hip", "gfx942": "decode/split_mfma_gfx942.hip"}
#: Tokens per tile of each arch's fast kernel (a partial last tile is masked in the kernel),
#: as its emulator schedule walks them: gfx950 128, gfx942 16.
FAST_TILE_TOKENS = {arch: schedule.tile_tokens for arch, schedule in FAST_SCHEDULES.items()}
#: (kv_format, q_precision) pairs each arch's fast kernel implements.
FAST_VARIANTS = {
    "gfx950": (("mxfp4", "bf16"), ("mxfp4", "fp8"), ("mxfp4", "mxfp4")),
    # gfx942 has no scaled MFMA: every cache is dequantized to bf16 for the bf16 MFMA,
    # which takes Q as it is, so bf16 Q is both the most accurate and the only choice.
    "gfx942": (("bf16", "bf16"), ("fp8", "bf16"), ("mxfp4", "bf16")),
}
#: What ``q_precision="auto"`` picks on every device: bf16 Q, used as it is (the most
#: accurate Q), and on gfx950 only instructions the seed kernel ran on MI355X (the scaled
#: fp4 -> bf16 convert and the bf16 MFMA). MXFP8 Q rests on an fp4 x fp8 operand layout no
#: hardware run has confirmed, so it is opt-in (``q_precision="fp8"``), as is MXFP4 Q (the
#: seed's fp4 x fp4 MFMA: the fastest and least accurate); the known-answer self-test
#: (``hipmla.selftest``) guards every fast kernel before it serves. The model's price of
#: bf16 Q on gfx950 (``python -m hipmla build --report``): ~20% more predicted issue time
#: than MXFP8 Q at 256 x 8k, both issue-bound there (predictions, not measurements).
AUTO_Q_PRECISION = "bf16"


def placement_words(sms: int) -> int:
    """int32 words of the placement scratch for ``sms`` SMs (16-byte aligned; the kernel
    clears them in 16-byte stores): the header, the SM words padded to a multiple of 4."""
    return PLACEMENT_HEADER + (sms + 3) // 4 * 4


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


class DecodeParams(ctypes.Structure):
    """``struct MlaDecodeParams`` field for field (device pointers as integers)."""

    _fields_ = [
        ("q", ctypes.c_void_p),  # [t_q, h_q, d_qk] bf16
        ("kv", ctypes.c_void_p),  # bf16 / fp8 [rows, d_qk] | mxfp4 [rows, d_qk/2] u8
        ("kv_scale", ctypes.c_void_p),  # mxfp4: [rows, stride_kv_scale] E8M0
        ("kv_indptr", ctypes.c_void_p),  # [b + 1] int32: row (contiguous) or page (paged) offsets
        ("kv_indices", ctypes.c_void_p),  # paged: int32 page ids; null: contiguous
        ("kv_last_page_len", ctypes.c_void_p),  # paged: [b] int32
        ("qo_indptr", ctypes.c_void_p),  # [b + 1] int32 query tokens per sequence, or null (1 each)
        ("counters", ctypes.c_void_p),  # [t_q x head_groups][2] int32, zero between launches
        ("errors", ctypes.c_void_p),  # one int32 of ERR_* bits, or null
        ("placement", ctypes.c_void_p),  # [placement_words(placement_sms)] int32 (core/placement.h), or null
        ("part_acc", ctypes.c_void_p),  # [n_slots, 16, d_v] f32
        ("part_ml", ctypes.c_void_p),  # [n_slots, 16, 2] f32
        ("out", ctypes.c_void_p),  # [t_q, h_q, d_v] bf16
        ("lse", ctypes.c_void_p),  # [t_q, h_q] f32 natural log, or null
        ("sm_scale_log2", ctypes.c_float),
        ("kv_fp8_scale", ctypes.c_float),
        ("stride_kv_scale", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("page_shift", ctypes.c_int32),
        ("split_target", ctypes.c_int32),
        ("split_min_tokens", ctypes.c_int32),
        ("split_align", ctypes.c_int32),
        ("fast_tile", ctypes.c_int32),
        ("kv_rows", ctypes.c_int32),  # 0: unknown (raw address); -1: an empty cache
        ("n_indices", ctypes.c_int32),  # 0: unknown; -1: an empty page table
        ("head_groups", ctypes.c_int32),  # h_q / 16 (below 16 heads: 1)
        ("q_tokens", ctypes.c_int32),  # t_q
        ("split_max_ranges", ctypes.c_int32),  # 0: no cap
        ("split_long_range", ctypes.c_int32),
        ("placement_sms", ctypes.c_int32),
        ("split_lone_items", ctypes.c_int32),  # 0: no lone split
        ("split_lone_below", ctypes.c_int32),
        ("split_lone_max_ranges", ctypes.c_int32),
        ("split_fit", ctypes.c_int32),  # 0: no fit
        ("row_tokens", ctypes.c_int32),  # query tokens a schedule row (0, 1: one)
        ("heads_in_row", ctypes.c_int32),  # heads of q / out / lse in a row of 16: h_q below 16, else 16 (0: 16)
    ]

    def set_split(self, policy) -> None:
        """The split fields from a hipmla.schedule.SplitPolicy (the one place they are copied)."""
        self.split_target = policy.target_items
        self.split_min_tokens = policy.min_split_tokens
        self.split_align = policy.align_tokens
        self.fast_tile = policy.fast_tile
        self.split_max_ranges = policy.max_ranges
        self.split_long_range = policy.long_range_tokens
        self.split_lone_items = policy.lone_items
        self.split_lone_below = policy.lone_below_tokens
        self.split_lone_max_ranges = policy.lone_max_ranges
        self.split_fit = int(policy.fit)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel: what to build and how to launch it."""

    symbol: str  # extern "C" name
    source: str  # file under hip_src
    defines: tuple[tuple[str, str], ...]
    block_threads: int
    dynamic_shared_bytes: int  # 0: the kernels use static shared memory only
    archs: tuple[str, ...] = ()  # processors it builds for; () = every target
    tile_tokens: int = 0  # > 0: a tiled fast kernel's step (partial last tiles masked inside); 0: none
    softmax_tile: int = TILE_TOKENS  # tokens per online-softmax step (the emulator's tile)
    products: str = "bf16"  # what its tensor-core products take (the emulator's products)
    row_heads: int = HEADS  # query rows (heads x query tokens) of one schedule row
    items_per_cu: int = DEFAULT_ITEMS_PER_CU  # work items the split aims for per CU / SM: its resident blocks
    arch_suffix: str = ""  # compiled for the arch plus this ("a": sm_90a, for wgmma)

    def builds_for(self, arch: str) -> bool:
        """Whether this kernel exists for ``arch`` (target features ignored)."""
        return not self.archs or arch.split(":", 1)[0] in self.archs

    def compile_arch(self, arch: str) -> str:
        """The target it is compiled for on ``arch``: ``arch`` itself, or for a kernel of
        arch-specific instructions the processor plus its suffix (``"sm_90"`` -> ``"sm_90a"``)."""
        return arch.split(":", 1)[0] + self.arch_suffix if self.arch_suffix else arch

    def serves_heads(self, heads: int) -> bool:
        """Whether a model of ``heads`` heads fills this kernel's rows: with a multiple of
        ``row_heads`` heads, or (16+ heads dividing it) with row_heads / heads query tokens;
        a kernel of 16-head rows also serves fewer heads (PADDED_HEADS), several query tokens
        a row."""
        if self.row_heads == HEADS and heads in PADDED_HEADS:
            return True
        return heads % self.row_heads == 0 or (heads >= HEADS and self.row_heads % heads == 0)

    def schedule_rows(self, heads: int) -> tuple[int, int]:
        """``(p.head_groups, p.row_tokens)`` for ``heads`` heads (hipmla.schedule.row_shape:
        fewer heads than the row's query rows share a row among row_heads // heads query
        tokens rounded down to a power of two, e.g. 8 heads x 2 in a 16-head row)."""
        return row_shape(heads, self.row_heads)

    def options(self, arch: str) -> list[str]:
        """``-D`` options for ``arch`` (``"gfx950"``, ``"gfx942:sramecc+:xnack-"``,
        ``"sm_90"``): the specialisation plus the arch's fp8 variant. Not the arch flag
        or the optimisation level; the compiler's caller adds those."""
        if not isinstance(arch, str) or not arch.strip():
            raise ValueError(f"arch: expected an offload arch such as 'gfx950' or 'sm_90', got {arch!r}")
        fnuz = arch.split(":", 1)[0] in FNUZ_ARCHS
        defines = self.defines + (("HIPMLA_FP8_FNUZ", "1" if fnuz else "0"),)
        return [f"-D{name}={value}" for name, value in defines]


def _check_choice(value: str, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _specialisation(kv_format: str, q_precision: str) -> tuple[tuple[str, str], ...]:
    """The ``-D`` defines every decode kernel takes (hip_src/common/config.h codes)."""
    return (("HIPMLA_KV_FORMAT", str(FORMAT_CODES[kv_format])),
            ("HIPMLA_Q_PRECISION", str(FORMAT_CODES[q_precision])))


def split_kernel(kv_format: str, q_precision: str) -> KernelSpec:
    """The split-KV kernel for a cache format and a Q precision."""
    _check_choice(kv_format, "kv_format", KV_FORMATS)
    _check_choice(q_precision, "q_precision", Q_PRECISIONS)
    return KernelSpec(
        symbol=f"hipmla_decode_split_{kv_format}_q{q_precision}",
        source=SPLIT_SOURCE,
        defines=_specialisation(kv_format, q_precision),
        block_threads=BLOCK_THREADS,
        dynamic_shared_bytes=0,
    )


def all_kernels() -> list[KernelSpec]:
    """Every portable specialisation (any target): 3 cache formats x 3 Q precisions."""
    return [split_kernel(kv, qp) for kv in KV_FORMATS for qp in Q_PRECISIONS]


def fast_split_kernel(arch: str, kv_format: str, q_precision: str) -> KernelSpec | None:
    """The fast split kernel of ``arch`` (``"gfx950"``, ``"gfx942:sramecc+:xnack-"``,
    ``"sm_90"``), which walks items in ``FAST_TILE_TOKENS[arch]`` tiles and masks a partial last
    one, so it takes every item by itself; or None when the arch has none for this cache
    format and Q precision (the main kernel then takes every item)."""
    if not isinstance(arch, str) or not arch.strip():
        raise ValueError(f"arch: expected an offload arch such as 'gfx950' or 'sm_90', got {arch!r}")
    _check_choice(kv_format, "kv_format", KV_FORMATS)
    _check_choice(q_precision, "q_precision", Q_PRECISIONS)
    processor = arch.split(":", 1)[0]
    if (kv_format, q_precision) not in FAST_VARIANTS.get(processor, ()):
        return None
    return KernelSpec(
        symbol=f"hipmla_decode_split_{processor}_{kv_format}_q{q_precision}",
        source=FAST_SOURCES[processor],
        defines=_specialisation(kv_format, q_precision),
        block_threads=BLOCK_THREADS,
        dynamic_shared_bytes=0,
        archs=(processor,),
        tile_tokens=FAST_TILE_TOKENS[processor],
    )


def fast_kernels(arch: str) -> list[KernelSpec]:
    """Every fast kernel ``arch`` has (empty for archs without a fast path)."""
    processor = arch.split(":", 1)[0] if isinstance(arch, str) else arch
    return [spec for kv, qp in FAST_VARIANTS.get(processor, ())
            if (spec := fast_split_kernel(arch, kv, qp)) is not None]


def kernels_for_arch(arch: str) -> list[KernelSpec]:
    """What an offline build for ``arch`` compiles: the portable kernels, then its fast ones."""
    return all_kernels() + fast_kernels(arch)


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return value


def grid_decode(max_items: int) -> tuple[int, int, int]:
    """One block per possible work item of the device schedule (blocks past the batch's
    items return at once), so the grid is fixed for a batch size."""
    return (_check_count(max_items, "max_items"), 1, 1)


def hip_src_dir() -> Path:
    """The kernel sources: the package data ``hipmla._hip_src`` when installed that way,
    else the ``hip_src/`` folder of the repository this module lives in."""
    # hip_src/ has no __init__.py: installed, it is a namespace package, whose
    # search locations (not importlib.resources' multiplexed view) are real folders.
    spec = importlib.util.find_spec("hipmla._hip_src")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "params.h").is_file():
            return Path(location)
    return Path(__file__).resolve().parent.parent / "hip_src"


def translation_unit(source: str, text: str | None = None) -> str:
    """``source`` (a path under :func:`hip_src_dir`) with every ``#include "..."``
    replaced by the file it names, recursively, each file once (so ``#pragma once``
    lines are blanked). Include names are relative to ``hip_src``. ``#line``
    directives keep compiler messages pointing at the original files. With ``text``,
    that is the top file's content (a probe kept outside hip_src, named ``source``)."""
    root = hip_src_dir()
    seen: set[str] = set()
    out: list[str] = []

    def emit(name: str, included_from: str | None) -> None:
        path = root / name
        if included_from is None and text is not None:
            content = text
        elif path.is_file():
            content = path.read_text()
        else:
            where = f" (included from {included_from})" if included_from else ""
            raise FileNotFoundError(f"source: no file {name!r} under {root}{where}")
        seen.add(name)
        out.append(f'#line 1 "{name}"')
        for number, line in enumerate(content.splitlines(), start=1):
            include = _INCLUDE.match(line)
            if include:
                child = include.group(1)
                if child not in seen:
                    emit(child, f"{name}:{number}")
                out.append(f'#line {number + 1} "{name}"')
            else:
                out.append("" if _PRAGMA_ONCE.match(line) else line)

    if not isinstance(source, str) or not source:
        raise ValueError(f"source: expected a file name under hip_src such as {SPLIT_SOURCE!r}, got {source!r}")
    emit(source, None)
    return "\n".join(out) + "\n"


# --- sm_90 tensor-core split kernel (hip_src/decode/split_sm90.hip) ------------------------
#
# The decoder's kernel on sm_90 for every cache format and Q precision (main_split_kernel;
# quantized Q is quantized in the block as the portable kernel does it). It takes any item
# length, so tile_tokens = 0; launched with p.fast_tile = 0 it runs every item of the
# schedule by itself.

SM90_SOURCE = "decode/split_sm90.hip"
SM90_THREADS = 256


def sm90_shared_bytes(kv_format: str) -> int:
    """Dynamic shared memory of the sm_90 kernel: ``sizeof(Smem)`` of split_sm90.hip
    (its ring of KV stages, the partial-score exchange, P, and the softmax state)."""
    _check_choice(kv_format, "kv_format", KV_FORMATS)
    tile, warps, heads, scales = SM90_TILE_TOKENS, SM90_THREADS // 32, HEADS, D_QK // 32
    row_bytes = {"bf16": 2 * D_QK, "fp8": D_QK, "mxfp4": D_QK // 2}[kv_format]
    row_stride = row_bytes + 16 if kv_format == "bf16" else row_bytes
    stages = {"bf16": 2, "fp8": 4, "mxfp4": 4}[kv_format]
    mult = tile * scales * 4 if kv_format == "mxfp4" else 16
    stage = -(-(tile * row_stride + mult) // 128) * 128  # stages on 128-byte lines
    red = warps * heads * 40 * 4  # larger than the schedule's scan, which shares it
    pfrag = (tile // 16) * 32 * 4 * 4
    tail = 3 * heads * 4 + 10 * 4 + 4  # alpha, l, qexp, the work item (10 ints), the arrive flag
    return -(-(stages * stage + red + pfrag + tail) // 128) * 128


def sm90_split_kernel(kv_format: str, q_precision: str = "bf16") -> KernelSpec:
    """The sm_90 tensor-core split kernel for a cache format and a Q precision."""
    _check_choice(kv_format, "kv_format", KV_FORMATS)
    _check_choice(q_precision, "q_precision", Q_PRECISIONS)
    return KernelSpec(
        symbol=f"hipmla_decode_split_sm90_{kv_format}_q{q_precision}",
        source=SM90_SOURCE,
        defines=_specialisation(kv_format, q_precision),
        block_threads=SM90_THREADS,
        dynamic_shared_bytes=sm90_shared_bytes(kv_format),
        archs=("sm_90",),
        tile_tokens=0,
        softmax_tile=SM90_TILE_TOKENS,
        products="f16" if kv_format == "fp8" else "bf16",
    )


# --- sm_90a kernel of 64 heads a work item (hip_src/decode/split_sm90_rows64.hip) --------
#
# An MXFP4 or fp8 cache with bf16 Q for steps of 64+ query rows a sequence (heads x query
# tokens: 64 or 128 heads, or 16 / 32 heads with MTP): 64 rows are wgmma's M, so K is
# dequantized once per 64 rows. A schedule row is 64 rows (row_heads): the decoder passes
# head_groups = max(heads / 64, 1), row_tokens = 64 / heads below 64 heads, and sizes 4
# partial slots an item.

SM90_ROWS64_SOURCE = "decode/split_sm90_rows64.hip"
SM90_ROWS64_HEADS = 64
#: Query rows a sequence's step needs (heads x q_len) before the decoder takes the 64-row
#: kernel: then its rows are full (see README, "64 rows a block on sm_90").
ROWS64_MIN_ROWS = 64
#: Tokens per online-softmax step of the 64-head kernel (its tile).
SM90_ROWS64_TILE = 64
#: Cache formats the 64-row kernel reads (with bf16 Q). A bf16 cache's 72 KiB raw tile does
#: not fit beside Q' and K' (72 KiB each) in an SM's 227 KiB.
ROWS64_FORMATS = ("fp8", "mxfp4")


def sm90_rows64_shared_bytes(kv_format: str) -> int:
    """Dynamic shared memory of the 64-head sm_90a kernel for a cache format: ``sizeof(Smem)``
    of split_sm90_rows64.hip (Q' and K' of 9 swizzled 8 KiB chunks each, P, a ring of raw
    rows -- mxfp4 2 stages and their E8M0 bytes, fp8 1 stage of rows 16 bytes apart (against
    bank conflicts) and the 16 unused bytes that stand for the E8M0 array -- the
    partial-score exchange, maxima and sums, the item)."""
    _check_choice(kv_format, "kv_format", ROWS64_FORMATS)
    tile, chunk = SM90_ROWS64_TILE, SM90_ROWS64_TILE * 128
    qk = 2 * (D_QK // 64) * chunk
    ring = 2 * tile * (D_QK // 2 + D_QK // 32) if kv_format == "mxfp4" else tile * (D_QK + 16) + 16
    exchange = 2 * 4 * 128 * 16
    state = 2 * 2 * SM90_ROWS64_HEADS * 4 + 10 * 4 + 4  # mx, lsum, the work item, the arrive flag
    return -(-(qk + chunk + ring + exchange + state) // 1024) * 1024


def sm90_rows64_kernel(kv_format: str) -> KernelSpec:
    """The sm_90a kernel of 64 heads a work item for an MXFP4 or fp8 cache (bf16 Q)."""
    _check_choice(kv_format, "kv_format", ROWS64_FORMATS)
    return KernelSpec(
        symbol=f"hipmla_decode_split_sm90_rows64_{kv_format}_qbf16",
        source=SM90_ROWS64_SOURCE,
        defines=_specialisation(kv_format, "bf16"),
        block_threads=SM90_THREADS,
        dynamic_shared_bytes=sm90_rows64_shared_bytes(kv_format),
        archs=("sm_90",),
        tile_tokens=0,
        softmax_tile=SM90_ROWS64_TILE,
        row_heads=SM90_ROWS64_HEADS,
        items_per_cu=1,
        arch_suffix="a",
    )


def main_split_kernel(arch: str, kv_format: str, q_precision: str, heads: int = HEADS,
                      q_len: int = 1) -> KernelSpec:
    """The kernel that takes every item a fast kernel does not: on sm_90 the 64-row kernel
    for an MXFP4 or fp8 cache with bf16 Q where a sequence's step has 64+ query rows
    (``heads`` x ``q_len`` query tokens, at least ROWS64_MIN_ROWS, and 16+ heads), else the sm_90 tensor-core
    kernel (with bf16 Q it ran on the H200 against the emulator: tests/test_sm90.py,
    tests/test_decode_gpu.py; with quantized Q on an H100, in the quantization's first form:
    docs/BENCHMARKS.md, "Quantized Q on sm_90"); elsewhere the portable kernel."""
    if isinstance(arch, str) and arch.split(":", 1)[0] == "sm_90":
        if kv_format in ROWS64_FORMATS and q_precision == "bf16" and heads * q_len >= ROWS64_MIN_ROWS:
            rows64 = sm90_rows64_kernel(kv_format)
            if rows64.serves_heads(heads):
                return rows64
        return sm90_split_kernel(kv_format, q_precision)
    return split_kernel(kv_format, q_precision)


def decoder_kernel(arch: str, kv_format: str, q_precision: str, heads: int = HEADS, q_len: int = 1) -> KernelSpec:
    """The one kernel a decoder of ``heads`` heads and steps of ``q_len`` query tokens a
    sequence launches for every item of a step: the arch's fast kernel where it has one for
    the cache format and Q, else :func:`main_split_kernel`'s."""
    return fast_split_kernel(arch, kv_format, q_precision) or \
        main_split_kernel(arch, kv_format, q_precision, heads, q_len)


def variant_of(spec: KernelSpec) -> tuple[str, str]:
    """``(kv_format, q_precision)`` a kernel is specialised for, read from its defines."""
    names = {str(code): name for name, code in FORMAT_CODES.items()}
    defines = dict(spec.defines)
    return names[defines["HIPMLA_KV_FORMAT"]], names[defines["HIPMLA_Q_PRECISION"]]


def check_serves(spec: KernelSpec, arch: str, kv_format: str, q_precision: str, heads: int = HEADS) -> KernelSpec:
    """``spec``, if it builds for ``arch``, reads this cache format with this Q precision
    and fills its rows with ``heads`` heads."""
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"kernel: expected a hipmla.kernels.KernelSpec, got {type(spec).__name__}")
    if not spec.builds_for(arch):
        raise ValueError(f"kernel: {spec.symbol} builds for {', '.join(spec.archs)}, not {arch}")
    if not spec.serves_heads(heads):
        raise ValueError(f"kernel: {spec.symbol} computes {spec.row_heads} heads a row, this decoder has {heads}")
    kv, qp = variant_of(spec)
    if (kv, qp) != (kv_format, q_precision):
        raise ValueError(f"kernel: {spec.symbol} reads a {kv} cache with {qp} Q, this decoder a "
                         f"{kv_format} cache with {q_precision} Q")
    return spec
