#!/usr/bin/env python3
"""Instruction counts of the sm_90 kernel's tile loop, from its SASS (no GPU needed).

On the H200 the kernel is issue-bound and its time follows its instruction count
(hip_src/KERNELS.md, "sm_90: what was measured, tried and dropped"), so a change to the loop is counted
before it is timed. This compiles each cache format's kernel with nvcc (``-arch=sm_90
-O3``, the NVRTC build's options), disassembles it with cuobjdump and finds the tile loop:
the backward branch whose body holds the most HMMAs. It reports the loop's length, the
blocks inside it that a forward branch skips in the steady state (the O rescale when no
running max moved, the running max's shuffle chain, a paged cache's page-table read: each
named by what it holds), the straight path a warp runs on most tiles, and that path per
token (x 8 warps / 32 tokens), with the instruction mix.

    python3 scripts/sm90_counts.py [--formats mxfp4,fp8,bf16] [--src DIR] [--mix] [--cost]
    python3 scripts/sm90_counts.py --rows64 [--formats mxfp4,fp8] [--src DIR] [--mix]

``--rows64`` counts the 64-row sm_90a kernel (decode/split_sm90_rows64.hip) instead: its
two warpgroups run a tile loop each (the backward branches around the HGMMAs), and a token
is (both loops' straight paths) x 4 warps / 64 tokens. The cost model has no HGMMA price.

``--src`` counts another hip_src tree (a trial change) with this tree's Python. ``--cost``
prices the straight path with the issue cycles that ``scripts/sm90_mma_rate.py`` measured
on the H200 (ISSUE_CYCLES below): the scheduler time of a warp's tile, from the pipes
overlapping as far as they did there to not at all (issue_bounds), the share of the read
bandwidth the fewest allow at 256 x 8k (an estimate from the instruction mix, not a
measurement of the kernel), and how busy the shared memory would be meanwhile (its
wavefronts at best, SMEM_WAVEFRONTS).
Needs nvcc and cuobjdump (``pip install nvidia-cuda-cuobjdump``; hipmla.nvidia.find_cuda_tool).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hipmla import kernels, nvidia  # noqa: E402

WARPS, TILE = 8, 32  # split_sm90.hip: 8 warps split a 32-token tile's dimensions
ROWS64_WARPS, ROWS64_TILE = 4, 64  # split_sm90_rows64.hip: a loop a warpgroup (4 warps), 64-token tiles

#: Cycles of its scheduler that one warp-instruction takes when every scheduler runs 4 warps
#: (two 8-warp blocks an SM), by opcode prefix, the first match counting: measured by
#: scripts/sm90_mma_rate.py on the H200 (2026-12-03, clock64 cycles over each SM's span,
#: scripts/results/h200-2026-12-03-sm90-mma-rate.txt; the SM clock was 1.98 GHz for ALU
#: work and 1.80 GHz with the tensor cores busy, as Nsight Compute saw for the kernel).
#: HMMA.16816 6.2-6.7 (4-8 independent chains), and it adds to ALU work (with 4 lop3 13.6,
#: alone 6.7 + 8.3) and to f32 fma (11.6 against 6.7 + 4.4); lop3 (ALU pipe) and IMAD (the
#: FMA-heavy pipe) partly overlap (8 mixed 10.8, alone 8.3 + 8.0). Opcodes marked "alu" but
#: not measured take the lop3 figure; anything else (loads, stores, branches, barriers) one
#: issue cycle: their latency and the shared-memory bandwidth are not in these cycles.
ISSUE_CYCLES: tuple[tuple[str, float, str], ...] = (
    ("HMMA.16816", 6.5, "tensor"), ("HMMA.1688", 4.3, "tensor"), ("MOVM", 4.0, "tensor"),
    ("MUFU", 8.0, "mufu/shfl"), ("SHFL", 4.0, "mufu/shfl"),
    ("IMAD", 2.0, "imad"), ("HFMA2", 1.17, "fma"), ("HMUL2", 1.17, "fma"), ("HADD2", 1.17, "fma"),
    ("FFMA", 1.1, "fma"), ("FADD", 1.1, "fma"), ("FMUL", 1.1, "fma"),
    ("LOP3", 2.06, "alu"), ("SHF", 2.06, "alu"), ("PRMT", 2.06, "alu"),
    *((op, 2.06, "alu") for op in ("ISETP", "FSETP", "SEL", "FSEL", "LEA", "IADD3", "VIADD", "VIMNMX", "VOTE", "F2FP")),
)


def issue_bounds(by: dict[str, float]) -> tuple[float, float]:
    """(fewest, most) scheduler cycles of a path priced by kind: the ALU work beside the
    FMA-pipe work (IMAD, fma) at best, every kind after the other at worst; the tensor
    instructions, MUFU / SHFL and the rest add in both."""
    alone = sum(v for k, v in by.items() if k not in ("alu", "imad", "fma"))
    alu, fma = by.get("alu", 0.0), by.get("imad", 0.0) + by.get("fma", 0.0)
    return alone + max(alu, fma), alone + alu + fma


#: Shared-memory wavefronts (128 bytes each, the SM's shared memory serving about one a
#: cycle) a warp-instruction takes at best, without bank conflicts, by opcode prefix: the
#: one resource beside issue that the tile loop loads heavily. Moving V through shared
#: memory (8 STS.128 + 8 LDSM.x4 for 32 MOVM) cut the issue cycles by 11-17% and ran 6-8%
#: slower on the H200 (fp8, mxfp4), with these wavefronts at 112% / 100% of the fewest issue
#: cycles (the kernel as it is: 54% / 49%).
SMEM_WAVEFRONTS: tuple[tuple[str, int], ...] = (
    ("LDSM.16.MT88.4", 4), ("LDSM.16.M88.4", 4), ("LDSM.16.MT88.2", 2), ("LDSM.16.M88.2", 2), ("LDSM", 1),
    ("LDS.128", 4), ("LDS.64", 2), ("LDS", 1), ("STS.128", 4), ("STS.64", 2), ("STS", 1),
    ("LDGSTS.E.BYPASS.128", 4), ("LDGSTS.E.128", 4), ("LDGSTS.E.BYPASS.64", 2), ("LDGSTS", 1),
)
#: The 256 x 8k benchmark shape on the H200: warp-tiles a scheduler runs (2^21 tokens over 132
#: SMs, 32-token tiles of 8 warps, 4 schedulers), the SM clock Nsight Compute reported for
#: the kernel (1.80 GHz, clocks not locked) and the read bandwidth of the bench runs (4.1 TB/s).
WARP_TILES_PER_SCHEDULER = 256 * 8192 / 132 / TILE * WARPS / 4
CLOCK_HZ, READ_BYTES_PER_S = 1.80e9, 4.1e12
ROW_BYTES = {"bf16": 1152, "fp8": 576, "mxfp4": 288 + 18}  # what a token of the cache reads


def issue_cycles(mix: Counter) -> dict[str, float]:
    """Scheduler cycles of a straight path by kind (ISSUE_CYCLES), with "other" at 1 a warp-instruction."""
    out: dict[str, float] = {}
    for op, n in mix.items():
        cost, kind = next(((c, k) for prefix, c, k in ISSUE_CYCLES if op.startswith(prefix)), (1.0, "other"))
        out[kind] = out.get(kind, 0.0) + cost * n
    return out


def smem_wavefronts(mix: Counter) -> int:
    """Shared-memory wavefronts of a straight path at best (SMEM_WAVEFRONTS)."""
    return sum(n * next((w for prefix, w in SMEM_WAVEFRONTS if op.startswith(prefix)), 0) for op, n in mix.items())


def smem_share(mix: Counter, cycles: float) -> float:
    """How busy the SM's shared memory is (one wavefront a cycle) while a scheduler issues
    ``cycles`` for each of its 4 warps' tiles: the SM's 16 warps' wavefronts over 4 cycles."""
    warps_per_sm, warps_per_scheduler = 2 * WARPS, 2 * WARPS // 4
    return warps_per_sm * smem_wavefronts(mix) / (warps_per_scheduler * cycles) if cycles else 0.0


def byte_cycles(kv_format: str) -> float:
    """Scheduler cycles a warp-tile may take for 256 x 8k to run at the read bandwidth: a
    tile that issues for longer caps the kernel at that share of it."""
    return ROW_BYTES[kv_format] * 256 * 8192 / READ_BYTES_PER_S * CLOCK_HZ / WARP_TILES_PER_SCHEDULER


_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA\s+(?:0x)?([0-9a-f]+)")


@dataclass
class Sass:
    address: int
    text: str

    @property
    def opcode(self) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split()[0]


@dataclass
class LoopCount:
    symbol: str
    loop: int  # instructions in the loop's body, every block counted once
    skipped: dict[str, int] = field(default_factory=dict)  # what the steady state branches over
    mix: Counter = field(default_factory=Counter)  # opcodes of the straight path

    @property
    def straight(self) -> int:
        return self.loop - sum(self.skipped.values())

    @property
    def per_token(self) -> float:
        return self.straight * WARPS / TILE


def parse(sass: str, symbol: str) -> list[Sass]:
    """The instructions of ``symbol``'s function in cuobjdump -sass output."""
    out, inside = [], False
    for line in sass.splitlines():
        if line.strip().startswith("Function :"):
            inside = line.split(":", 1)[1].strip() == symbol
            continue
        m = _LINE.match(line)
        if inside and m:
            out.append(Sass(int(m.group(1), 16), m.group(2)))
    if not out:
        raise ValueError(f"{symbol}: not in the disassembly")
    return out


def _target(ins: Sass) -> int | None:
    m = _BRANCH.match(ins.text)
    return int(m.group(1), 16) if m else None


def tile_loops(code: list[Sass], tensor: str = "HMMA") -> list[list[Sass]]:
    """The bodies of the backward branches that enclose the most ``tensor`` instructions
    (HMMA: the 16-head kernel's one loop; HGMMA: the 64-row kernel's loop of each
    warpgroup), in address order."""
    at = {ins.address: k for k, ins in enumerate(code)}
    loops: list[tuple[int, list[Sass]]] = []
    for k, ins in enumerate(code):
        tgt = _target(ins)
        if tgt is None or tgt >= ins.address or tgt not in at:
            continue
        body = code[at[tgt]:k + 1]
        n = sum(i.opcode.startswith(tensor) for i in body)
        if n:
            loops.append((n, body))
    if not loops:
        raise ValueError(f"no loop with an {tensor}")
    most = max(n for n, _ in loops)
    return [body for n, body in loops if n == most]


def tile_loop(code: list[Sass]) -> list[Sass]:
    """The body of the backward branch that encloses the most HMMAs."""
    return tile_loops(code)[0]


def steady_skips(body: list[Sass]) -> list[tuple[int, int, str]]:
    """Blocks ``body[a:b]`` that a forward branch in the loop skips on a tile whose running
    max did not move, on a contiguous cache, named by their content: (a, b, name). Of nested
    blocks of one kind only the innermost counts (the page-table read sits inside the
    block that a row past the item skips)."""
    at = {ins.address: k for k, ins in enumerate(body)}
    found = []
    for k, ins in enumerate(body):
        tgt = _target(ins)
        if tgt is None or tgt <= ins.address or tgt not in at or not ins.text.startswith("@"):
            continue
        a, b = k + 1, at[tgt]
        ops = Counter(i.opcode for i in body[a:b])
        if ops["FMUL"] >= 32:
            found.append((a, b, "O rescale"))
        elif ops["SHFL.BFLY"] >= 4 and b - a < 40:
            found.append((a, b, "max chain"))
        elif any(op.startswith("LD.E") for op in ops) and b - a < 40 and not ops["HMMA.16816.F32.BF16"]:
            found.append((a, b, "page-table read"))
    return [f for f in found if not any(g != f and g[2] == f[2] and f[0] <= g[0] and g[1] <= f[1] for g in found)]


def count(sass: str, symbol: str) -> LoopCount:
    return count_body(symbol, tile_loop(parse(sass, symbol)))


def count_rows64(sass: str, symbol: str) -> list[LoopCount]:
    """The 64-row kernel's tile loops, one a warpgroup, counted as :func:`count` counts."""
    return [count_body(symbol, body) for body in tile_loops(parse(sass, symbol), "HGMMA")]


def rows64_per_token(loops: list[LoopCount]) -> float:
    """Warp-instructions a token of the 64-row kernel's straight paths: each warpgroup's 4
    warps run their loop once a 64-token tile."""
    return sum(c.straight for c in loops) * ROWS64_WARPS / ROWS64_TILE


def count_body(symbol: str, body: list[Sass]) -> LoopCount:
    result = LoopCount(symbol, len(body))
    drop: set[int] = set()
    for a, b, name in steady_skips(body):
        result.skipped[name] = result.skipped.get(name, 0) + b - a
        drop.update(range(a, b))
    result.mix = Counter(ins.opcode for k, ins in enumerate(body) if k not in drop)
    return result


def compile_sass(kv_format: str, src: Path | None, work: Path, rows64: bool = False) -> tuple[str, str]:
    """(symbol, cuobjdump -sass text) of the sm_90 kernel for ``kv_format`` (``rows64``: the
    64-row sm_90a kernel)."""
    nvcc, cuobjdump = nvidia.find_cuda_tool("nvcc"), nvidia.find_cuda_tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        raise SystemExit("needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump)")
    spec = kernels.sm90_rows64_kernel(kv_format) if rows64 else kernels.sm90_split_kernel(kv_format)
    original = kernels.hip_src_dir
    if src is not None:
        kernels.hip_src_dir = lambda: src
    try:
        text = kernels.translation_unit(spec.source)
    finally:
        kernels.hip_src_dir = original
    tu, cubin = work / f"{kv_format}.cu", work / f"{kv_format}.cubin"
    tu.write_text(text)
    subprocess.run([nvcc, f"-arch=sm_90{spec.arch_suffix}", "-cubin", "-O3", *spec.options("sm_90"), "-x", "cu",
                    str(tu), "-o", str(cubin)], check=True, capture_output=True, text=True)
    return spec.symbol, subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                                       text=True).stdout


def mix_line(c: LoopCount) -> str:
    """A straight path's opcodes, most frequent first."""
    return "       " + ", ".join(f"{op} {n}" for op, n in c.mix.most_common())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=None, help="bf16,fp8,mxfp4 (--rows64: fp8,mxfp4)")
    ap.add_argument("--src", type=Path, default=None, help="a hip_src tree to count instead of this one")
    ap.add_argument("--mix", action="store_true", help="print the straight path's opcodes")
    ap.add_argument("--cost", action="store_true", help="price the straight path with the H200's measured issue cycles")
    ap.add_argument("--rows64", action="store_true", help="count the 64-row sm_90a kernel (fp8, mxfp4)")
    args = ap.parse_args(argv)
    formats = (args.formats or ",".join(kernels.ROWS64_FORMATS if args.rows64 else kernels.KV_FORMATS)).split(",")
    if args.rows64:
        if args.cost:
            raise SystemExit("--rows64: the cost model has no price for HGMMA; count without --cost")
        bad = [f for f in formats if f not in kernels.ROWS64_FORMATS]
        if bad:
            raise SystemExit(f"--rows64: the 64-row kernel reads {', '.join(kernels.ROWS64_FORMATS)}, "
                             f"not {', '.join(bad)}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.rows64:
            for fmt in formats:
                symbol, sass = compile_sass(fmt, args.src.resolve() if args.src else None, Path(tmp), rows64=True)
                loops = count_rows64(sass, symbol)
                parts = "; ".join(
                    f"warpgroup {wg}: loop {c.loop}, skipped "
                    f"{', '.join(f'{name} {n}' for name, n in c.skipped.items()) or 'none'}, straight {c.straight} "
                    f"(HGMMA {sum(v for k, v in c.mix.items() if k.startswith('HGMMA'))})"
                    for wg, c in enumerate(loops))
                print(f"{fmt:>5}: {parts}; {rows64_per_token(loops):.1f} warp-instructions a token (64 rows)")
                if args.mix:
                    for c in loops:
                        print(mix_line(c))
            return 0
        for fmt in formats:
            symbol, sass = compile_sass(fmt, args.src.resolve() if args.src else None, Path(tmp))
            c = count(sass, symbol)
            skips = ", ".join(f"{name} {n}" for name, n in c.skipped.items()) or "none"
            print(f"{fmt:>5}: loop {c.loop} instructions; skipped in the steady state: {skips}; straight path "
                  f"{c.straight} a warp and tile = {c.per_token:.1f} warp-instructions a token "
                  f"(HMMA {sum(v for k, v in c.mix.items() if k.startswith('HMMA'))}, MOVM {c.mix['MOVM.16.MT88']})")
            if args.mix:
                print(mix_line(c))
            if args.cost:
                by = issue_cycles(c.mix)
                low, high = issue_bounds(by)
                parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
                budget = byte_cycles(fmt)
                print(f"       issue model: {low:.0f}-{high:.0f} scheduler cycles a warp and tile ({parts}); "
                      f"at 256x8k >= {low * WARP_TILES_PER_SCHEDULER / CLOCK_HZ * 1e6:.0f} us, at most "
                      f"{100 * min(1.0, budget / low):.0f}% of the read bandwidth; the tile's bytes take "
                      f"{budget:.0f} cycles at it, the tensor part alone {by.get('tensor', 0.0):.0f}; "
                      f"shared memory: {smem_wavefronts(c.mix)} wavefronts a warp and tile at best, "
                      f"busy {100 * smem_share(c.mix, low):.0f}% of the fewest cycles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
