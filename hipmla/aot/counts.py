"""Instruction counts of the fast kernels' tile loops: the performance model's input.

:func:`loop_counts` disassembles a code object (llvm-objdump) and counts the main loop
of one kernel by kind (:class:`LoopCounts`); :func:`fast_report` and
:func:`fast_kernel_models` hand the counts of the fast kernels to
:mod:`hipmla.perfmodel`.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hipmla import perfmodel
from hipmla.aot.occupancy import WAVE_SIZE
from hipmla.aot.prebuilt import default_aot_dir
from hipmla.aot.resources import KernelResources, build_all
from hipmla.aot.toolchain import compile_offline, find_clang, find_objdump
from hipmla.kernels import FORMAT_CODES, KernelSpec, kernels_for_arch
from hipmla.perfmodel import MFMA_CYCLES

# Static counts of a kernel's tile loop (the backward branch whose body holds the most
# MFMAs), read from ``llvm-objdump -d``. For the fast kernels one trip of that loop is one
# 128-token tile for each of the block's waves, so the counts are per wave and tile. The
# cycles an MFMA issues for are the model's (hipmla.perfmodel.MFMA_CYCLES).

_INSTRUCTION = re.compile(r"^\s+([a-z][a-z0-9_]*)\b(.*?//\s*([0-9A-Fa-f]+):.*)$")
_BRANCH_TARGET = re.compile(r"<[^>+]+\+0x([0-9a-fA-F]+)>")


@dataclass(frozen=True)
class Instruction:
    address: int
    mnemonic: str
    operands: str  # the rest of objdump's line: operands, encoding, branch target


@dataclass(frozen=True)
class LoopCounts:
    """Instructions of one trip of a kernel's main loop, by kind."""

    symbol: str
    mfma: int  # v_mfma* (scaled and plain)
    mfma_cycles: int  # their issue cycles on the kernel's target (MFMA_CYCLES)
    valu: int  # other v_* (including the converts)
    transcendental: int  # the quarter-rate part of ``valu`` (exp, log, rcp, sqrt)
    lds: int  # ds_* (reads, writes, bpermute)
    lds_bytes: int  # bytes those move per wave
    global_loads: int  # global_load* / buffer_load* (LDS copies included)
    salu: int  # s_* (waits and branches included)
    total: int
    # s_waitcnt on vmcnt between the first and last MFMA of one trip, the trip taken from
    # the top of a tile (main_loop): a wait for memory inside the tile's math (the next
    # tile's copies must not be waited for there)
    vm_waits_in_math: int = 0
    # the instruction forms the loop rests on, with their counts: MFMAs (a scaled one with
    # its A / B element formats), converts and global -> LDS copies, in order of first use
    forms: tuple[tuple[str, int], ...] = ()


def parse_disassembly(text: str, symbol: str) -> list[Instruction]:
    """The instructions of ``symbol`` in ``llvm-objdump -d`` output, with addresses."""
    start = re.search(rf"^[0-9a-fA-F]+ <{re.escape(symbol)}>:\s*$", text, re.M)
    if start is None:
        raise ValueError(f"symbol: no function {symbol!r} in the disassembly")
    out = []
    for line in text[start.end():].splitlines():
        if re.match(r"^[0-9a-fA-F]+ <", line):
            break
        m = _INSTRUCTION.match(line)
        if m:
            out.append(Instruction(int(m.group(3), 16), m.group(1), m.group(2).strip()))
    if not out:
        raise ValueError(f"symbol: {symbol!r} has no instructions in the disassembly")
    return out


def main_loop(instructions: Sequence[Instruction], symbol: str, base: int) -> list[Instruction]:
    """Body of the backward branch whose range holds the most MFMAs (ties: the shortest).
    ``base`` is the function's address, to which objdump's ``<sym+0x..>`` targets are
    relative."""
    best: list[Instruction] = []
    best_key = (-1, 0)
    for i, ins in enumerate(instructions):
        if not ins.mnemonic.startswith(("s_branch", "s_cbranch")):
            continue
        m = _BRANCH_TARGET.search(ins.operands)
        if m is None:
            continue
        target = base + int(m.group(1), 16)
        if target > ins.address:
            continue
        body = [x for x in instructions[: i + 1] if x.address >= target]
        key = (sum(x.mnemonic.startswith("v_mfma") for x in body), -len(body))
        if key > best_key:
            best, best_key = body, key
    if not best:
        raise ValueError(f"symbol: {symbol!r} has no loop")
    return _from_the_top(best, base)


def _from_the_top(body: list[Instruction], base: int) -> list[Instruction]:
    """The body in the order one trip runs it from the top of a tile. clang may rotate a
    loop: the backward branch's target is then mid-trip and the exit test (a conditional
    branch out of the body) ends a trip; the instructions after the exit test start one.
    Only vm_waits_in_math depends on the order."""
    first, last = body[0].address, body[-1].address
    exits = [i for i, x in enumerate(body[:-1]) if x.mnemonic.startswith("s_cbranch")
             and (m := _BRANCH_TARGET.search(x.operands)) is not None
             and not first <= base + int(m.group(1), 16) <= last]
    if not exits:
        return body
    k = exits[-1] + 1
    return body[k:] + body[:k]


_TRANSCENDENTAL = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")
_LDS_WIDTH = {"b128": 16, "b96": 12, "b64": 8, "2addr_b64": 16}
_LDS_COPY_WIDTH = {"global_load_lds_dwordx4": 16, "global_load_lds_dword": 4}


def _mfma_cycles(ins: Instruction) -> int:
    if ins.mnemonic.startswith("v_mfma_scale_f32_16x16x128_f8f6f4"):
        # cbsz / blgp name the A / B formats; objdump omits them when 0 (e4m3).
        cbsz = re.search(r"cbsz:(\d)", ins.operands)
        blgp = re.search(r"blgp:(\d)", ins.operands)
        fp4 = all(m is not None and int(m.group(1)) == 4 for m in (cbsz, blgp))
        return MFMA_CYCLES["v_mfma_scale_f32_16x16x128_f8f6f4/" + ("fp4" if fp4 else "fp8")]
    if ins.mnemonic not in MFMA_CYCLES:
        raise ValueError(f"no cycle count for {ins.mnemonic}; add it to MFMA_CYCLES")
    return MFMA_CYCLES[ins.mnemonic]


#: Element formats of the scaled MFMA's cbsz / blgp codes (LLVM's IntrinsicsAMDGPU.td).
_SCALED_FORMATS = {0: "e4m3", 1: "e5m2", 2: "e2m3", 3: "e3m2", 4: "e2m1"}


def instruction_form(ins: Instruction) -> str | None:
    """The form of an instruction the loop's numerics or copies rest on (an MFMA, a
    convert, a global -> LDS copy), encoding suffixes dropped; None for any other."""
    name = re.sub(r"_(e32|e64|sdwa|dpp)$", "", ins.mnemonic)
    if name.startswith("v_mfma_scale"):
        codes = [re.search(rf"{k}:(\d)", ins.operands) for k in ("cbsz", "blgp")]
        a, b = (_SCALED_FORMATS.get(int(m.group(1)), "?") if m else "e4m3" for m in codes)
        return f"{name} (A {a}, B {b})"
    if name.startswith(("v_mfma", "v_cvt", "global_load_lds", "buffer_load_lds")):
        return name
    return None


def count_loop(instructions: Sequence[Instruction], symbol: str) -> LoopCounts:
    """Counts of a loop body (see :class:`LoopCounts`)."""
    mfma = [x for x in instructions if x.mnemonic.startswith("v_mfma")]
    valu = [x for x in instructions if x.mnemonic.startswith("v_") and not x.mnemonic.startswith("v_mfma")]
    lds = [x for x in instructions if x.mnemonic.startswith("ds_")]
    lds_bytes = 0
    for x in lds:
        suffix = x.mnemonic.split("_", 2)[-1]
        lds_bytes += 64 * _LDS_WIDTH.get(suffix, 4)
    glds = [x for x in instructions if x.mnemonic.startswith(("global_load", "buffer_load"))]
    # LDS copies write their bytes into LDS: 16 (gfx950's dwordx4) or 4 (dword) per lane.
    lds_bytes += sum(64 * _LDS_COPY_WIDTH[x.mnemonic] for x in glds if x.mnemonic in _LDS_COPY_WIDTH)
    at = [i for i, x in enumerate(instructions) if x.mnemonic.startswith("v_mfma")]
    math = instructions[at[0]:at[-1] + 1] if at else []
    return LoopCounts(
        symbol=symbol,
        mfma=len(mfma),
        mfma_cycles=sum(_mfma_cycles(x) for x in mfma),
        valu=len(valu),
        transcendental=sum(x.mnemonic.startswith(_TRANSCENDENTAL) for x in valu),
        lds=len(lds),
        lds_bytes=lds_bytes,
        global_loads=len(glds),
        salu=sum(x.mnemonic.startswith("s_") for x in instructions),
        total=len(instructions),
        vm_waits_in_math=sum(x.mnemonic == "s_waitcnt" and "vmcnt" in x.operands for x in math),
        forms=tuple(Counter(f for x in instructions if (f := instruction_form(x)) is not None).items()),
    )


def loop_counts(co_path: Path, symbol: str) -> LoopCounts:
    """Disassembles a code object with the clang's own llvm-objdump and counts ``symbol``'s
    main loop."""
    objdump = find_objdump(find_clang())
    proc = subprocess.run([objdump, "-d", str(co_path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{objdump} -d {co_path} exited {proc.returncode}: {proc.stderr.strip()}")
    instructions = parse_disassembly(proc.stdout, symbol)
    base = int(re.search(rf"^([0-9a-fA-F]+) <{re.escape(symbol)}>:", proc.stdout, re.M).group(1), 16)
    return count_loop(main_loop(instructions, symbol, base), symbol)


def format_counts(rows: Sequence[tuple[KernelResources, LoopCounts]]) -> str:
    lines = ["per wave and tile (main loop, static; gfx950 tiles of 128 tokens, gfx942 of 16): "
             "symbol  MFMA (cycles)  VALU (transc.)  LDS (bytes)  global loads  SALU  total  "
             "memory waits inside the math"]
    for r, c in rows:
        lines.append(f"{c.symbol} {r.arch}: MFMA {c.mfma} ({c.mfma_cycles} cyc)  VALU {c.valu} ({c.transcendental})  "
                     f"LDS {c.lds} ({c.lds_bytes} B)  global loads {c.global_loads}  SALU {c.salu}  total {c.total}  "
                     f"vm waits in math {c.vm_waits_in_math}")
        lines.append("    forms: " + ", ".join(f"{f} x{n}" for f, n in c.forms))
    return "\n".join(lines)


# --- the fast kernels, counted for the performance model --------------------------------


def count_fast(rows: Sequence[KernelResources], out_dir: Path) -> list[tuple[KernelResources, KernelSpec, LoopCounts]]:
    """The fast kernels among ``rows`` (built into ``out_dir`` by :func:`build_all`), each
    with its tile loop counted."""
    counted = []
    for r in rows:
        spec = next((s for s in kernels_for_arch(r.arch) if s.symbol == r.symbol), None)
        if spec is None or not spec.tile_tokens:
            continue
        co = compile_offline(spec, r.arch, out_dir)  # already built: returns the object
        counted.append((r, spec, loop_counts(co, r.symbol)))
    return counted


def kernel_model(r: KernelResources, spec: KernelSpec, counts: LoopCounts) -> perfmodel.KernelModel:
    """What the performance model needs of a counted fast kernel on its arch's device."""
    kv = next(k for k, code in FORMAT_CODES.items() if ("HIPMLA_KV_FORMAT", str(code)) in spec.defines)
    return perfmodel.amd_kernel(counts, r.waves_per_simd, r.arch, kv, tile_tokens=spec.tile_tokens,
                                waves_per_block=-(-spec.block_threads // WAVE_SIZE))


def fast_report(rows: Sequence[KernelResources], out_dir: Path) -> str:
    """Instruction counts of the fast kernels among ``rows``, then the performance model's
    report: the H200 calibration and their PREDICTED times (MI355X for gfx950, MI300X for
    gfx942)."""
    counted = count_fast(rows, out_dir)
    if not counted:
        return "no fast kernels among the built archs"
    models = [kernel_model(*c) for c in counted]
    return format_counts([(r, c) for r, _, c in counted]) + "\n\n" + perfmodel.calibration_report(models)


def fast_kernel_models(archs: Sequence[str], out_dir: Path | None = None, jobs: int = 2) -> list[perfmodel.KernelModel]:
    """Build (or find built) the fast kernels of ``archs`` and model each from its counts."""
    out = default_aot_dir() if out_dir is None else Path(out_dir)
    rows = build_all(archs, out, jobs, fast_only=True)
    return [kernel_model(*c) for c in count_fast(rows, out)]
