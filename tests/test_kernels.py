"""hipmla.kernels and the kernel sources under hip_src/.

No GPU here, so the kernels are checked three ways: their parameter struct against the
C header, their compilation for every target (clang for gfx950/gfx942, NVRTC for
sm_90) with resource limits, and their arithmetic by running the very same source on
the CPU (one host thread per GPU thread) against the numpy emulator.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from hipmla import decode, kernels
from hipmla.emulate import FAST_SCHEDULES, SM90_TILE_TOKENS, emulate_decode
from hipmla.formats import KVCache, quantize_kv
from hipmla.inputs import random_cache
from hipmla.kernels import (
    DecodeParams,
    KernelSpec,
    all_kernels,
    grid_decode,
    hip_src_dir,
    split_kernel,
    translation_unit,
)
from host_harness import host_source
from p_flips import assert_within_p_flips
from hipmla.paging import KvLayout, random_page_table, scatter, take_rows
from hipmla.reference import mla_decode_reference
from hipmla.queries import head_groups, heads_in_row
from hipmla.schedule import SplitPolicy, schedule

CLANG = shutil.which("clang++-22")
READELF = shutil.which("llvm-readelf-22")
CC = shutil.which("cc") or shutil.which("gcc")
ARCHS = ("gfx950", "gfx942")
FIELDS = [name for name, _ in DecodeParams._fields_]


# --------------------------------------------------------------------- description


def test_constants_match_config_header():
    text = (hip_src_dir() / "common" / "config.h").read_text()
    values = {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (\w+) = (\d+);", text)}
    for name in ("HEADS", "D_QK", "D_V", "TILE_TOKENS", "BLOCK_THREADS"):
        assert values[name] == getattr(kernels, name), name
    for fmt, code in kernels.FORMAT_CODES.items():
        assert values[f"FORMAT_{fmt.upper()}"] == code
    from hipmla.validate import MAX_SEQ_TOKENS

    assert "constexpr int MAX_SEQ_TOKENS = 1 << 30;" in text and MAX_SEQ_TOKENS == 1 << 30


def test_error_bits_match_the_decoder():
    from hipmla.decode import DEVICE_ERRORS

    text = (hip_src_dir() / "core" / "paged.h").read_text()
    bits = {int(m.group(2)): m.group(1) for m in re.finditer(r"constexpr int (ERR_\w+) = (\d+);", text)}
    assert set(bits) == set(DEVICE_ERRORS) and len(bits) == 6


def test_all_kernels_are_every_specialisation():
    specs = all_kernels()
    assert len(specs) == 9
    assert len({s.symbol for s in specs}) == 9
    s = split_kernel("mxfp4", "fp8")
    assert s.symbol == "hipmla_decode_split_mxfp4_qfp8"
    assert s.source == "decode/split.hip"
    assert s.block_threads == 256 and s.dynamic_shared_bytes == 0
    assert hash(s) == hash(split_kernel("mxfp4", "fp8"))  # runtime caches by spec


def test_options_carry_specialisation_and_fp8_variant():
    s = split_kernel("fp8", "mxfp4")
    assert s.options("gfx950") == ["-DHIPMLA_KV_FORMAT=1", "-DHIPMLA_Q_PRECISION=2", "-DHIPMLA_FP8_FNUZ=0"]
    assert "-DHIPMLA_FP8_FNUZ=1" in s.options("gfx942:sramecc+:xnack-")
    assert "-DHIPMLA_FP8_FNUZ=0" in s.options("sm_90")
    assert not any(o.startswith(("--offload-arch", "-O")) for o in s.options("gfx950"))


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: split_kernel("int4", "bf16"), "kv_format"),
        (lambda: split_kernel("bf16", "fp16"), "q_precision"),
        (lambda: grid_decode(0), "max_items"),
        (lambda: split_kernel("bf16", "bf16").options(""), "arch"),
        (lambda: translation_unit("decode/nope.hip"), "source"),
    ],
)
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises((ValueError, FileNotFoundError), match=name):
        call()


def test_unknown_format_lists_allowed_values():
    with pytest.raises(ValueError, match="bf16, fp8, mxfp4"):
        split_kernel("fp4", "bf16")


def test_grids():
    assert grid_decode(37) == (37, 1, 1)


def test_translation_unit_inlines_each_header_once():
    for spec in (split_kernel("bf16", "bf16"),):
        tu = translation_unit(spec.source)
        assert '#include "' not in tu
        assert "#pragma once" not in tu
        assert tu.count("struct MlaDecodeParams {") == 1
        assert tu.count("HIPMLA_DEVICE float bf16_to_f32") == 1
        assert tu.count("struct KvRows {") == 1 and tu.count("struct WorkItem {") == 1
        assert spec.symbol in tu or "HIPMLA_SPLIT_NAME" in tu


def test_translation_unit_of_a_probe_outside_hip_src():
    """text= is the top file (a script's probe, named as if under hip_src); its includes
    still resolve under hip_src, each once."""
    tu = translation_unit("probe/p.hip", '#include "params.h"\n#include "common/config.h"\nint probe_marker;\n')
    assert tu.startswith('#line 1 "probe/p.hip"') and "int probe_marker;" in tu
    assert tu.count("struct MlaDecodeParams {") == 1 and '#include "' not in tu
    with pytest.raises(FileNotFoundError, match="nope.h"):
        translation_unit("probe/p.hip", '#include "nope.h"\n')


# --------------------------------------------------------------------- struct layout


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_params_layout_matches_header(tmp_path):
    prints = "\n".join(
        f'    printf("{f} %zu\\n", offsetof(struct MlaDecodeParams, {f}));' for f in FIELDS
    )
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stddef.h>\n#include <stdint.h>\n#include <stdio.h>\n"
        "#define HIPMLA_PARAMS_NO_STDINT\n"
        f'#include "{hip_src_dir() / "params.h"}"\n'
        "int main(void) {\n"
        '    printf("sizeof %zu\\n", sizeof(struct MlaDecodeParams));\n'
        f"{prints}\n    return 0;\n}}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run([CC, "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    assert int(got["sizeof"]) == ctypes.sizeof(DecodeParams)
    for f in FIELDS:
        assert int(got[f]) == getattr(DecodeParams, f).offset, f
    assert len(FIELDS) == len(got) - 1  # no field of the header is missing here


# --------------------------------------------------------------------- offline AMD builds


def _notes_value(notes: str, key: str) -> int:
    m = re.search(rf"^\s*\.{key}:\s+(\d+)", notes, re.M)
    assert m, f"{key} missing from notes"
    return int(m.group(1))


@pytest.fixture(scope="module")
def amd_builds(tmp_path_factory):
    """(spec, arch) -> (returncode, stderr, notes, symbols) for every kernel, built in parallel."""
    if CLANG is None or READELF is None:
        pytest.skip("clang++-22 / llvm-readelf-22 not installed")
    out = tmp_path_factory.mktemp("co")

    def build(job):
        spec, arch = job
        # One file per (kernel, arch): two jobs rewriting a file clang has mapped crash it.
        tu = out / f"{spec.symbol}.{arch}.hip"
        tu.write_text(translation_unit(spec.source))
        co = out / f"{spec.symbol}.{arch}.co"
        proc = subprocess.run(
            [CLANG, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib",
             "-nogpuinc", "--no-gpu-bundle-output", "-O3", "-std=c++17", *spec.options(arch),
             str(tu), "-o", str(co)],
            capture_output=True, text=True,
        )
        if proc.returncode:
            return proc.returncode, proc.stderr, "", ""
        notes = subprocess.run([READELF, "--notes", str(co)], capture_output=True, text=True).stdout
        syms = subprocess.run([READELF, "--symbols", str(co)], capture_output=True, text=True).stdout
        return 0, proc.stderr, notes, syms

    jobs = ([(s, a) for s in all_kernels() for a in ARCHS] + [(s, "gfx950") for s in FAST_950]
            + [(s, "gfx942") for s in FAST_942])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(jobs, pool.map(build, jobs)))


FAST_950 = kernels.fast_kernels("gfx950")
FAST_942 = kernels.fast_kernels("gfx942")


def assert_within_budget(build, spec: KernelSpec, lds_limit: int) -> None:
    """Built, named in the notes, no scratch, no spills, LDS within ``lds_limit``."""
    rc, err, notes, _syms = build
    assert rc == 0, err
    assert re.search(rf"^\s*\.name:\s+{spec.symbol}$", notes, re.M)
    assert _notes_value(notes, "private_segment_fixed_size") == 0
    assert _notes_value(notes, "vgpr_spill_count") == 0
    assert _notes_value(notes, "sgpr_spill_count") == 0
    assert _notes_value(notes, "group_segment_fixed_size") <= lds_limit
    assert _notes_value(notes, "max_flat_workgroup_size") == spec.block_threads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", all_kernels(), ids=lambda s: s.symbol)
def test_offline_build(amd_builds, spec: KernelSpec, arch: str):
    assert_within_budget(amd_builds[(spec, arch)], spec, 48 * 1024)
    # (A libcall the -nogpulib build cannot resolve fails the link, so rc covers it.)
    syms = amd_builds[(spec, arch)][3]
    assert re.search(rf"\bFUNC\s+GLOBAL\s+\S+\s+\S+\s+{spec.symbol}$", syms, re.M)


@pytest.mark.parametrize("spec", FAST_950, ids=lambda s: s.symbol)
def test_fast_gfx950_build_within_budget(amd_builds, spec: KernelSpec):
    """The gfx950 fast kernels: no scratch, no spills, LDS within a gfx950 CU (160 KiB)."""
    assert_within_budget(amd_builds[(spec, "gfx950")], spec, 160 * 1024)


@pytest.mark.parametrize("spec", FAST_950, ids=lambda s: s.symbol)
def test_fast_gfx950_code_uses_the_matrix_cores(spec: KernelSpec, tmp_path):
    """llvm-objdump of the build: the scaled MFMA (fp8 or fp4 B operand as specialised;
    none at all with bf16 Q, whose Q.K is the convert + bf16 MFMA the seed ran), the bf16
    MFMA, the scaled fp4 -> bf16 convert and the global -> LDS copy are there."""
    text = _disassemble(spec, "gfx950", tmp_path)
    scaled = re.findall(r"v_mfma_scale_f32_16x16x128_f8f6f4 .*", text)
    q_bf16, q_fp4 = spec.symbol.endswith("qbf16"), spec.symbol.endswith("qmxfp4")
    assert len(scaled) == (0 if q_bf16 else 10)  # 2 score groups x 5 k-steps, unrolled
    # A = K is always e2m1 (cbsz:4); B = Q is e2m1 (blgp:4) or e4m3 (blgp omitted: 0)
    assert all("cbsz:4" in line and (("blgp:4" in line) == q_fp4) for line in scaled)
    # P.V: 32 bf16 MFMAs on 128 converts; bf16 Q.K: 2 groups x 18 k-steps, 4 converts each
    assert len(re.findall(r"\bv_mfma_f32_16x16x32_bf16\b", text)) == 32 + (36 if q_bf16 else 0)
    assert len(re.findall(r"\bv_cvt_scalef32_pk_bf16_fp4\b", text)) == 128 + (144 if q_bf16 else 0)
    assert re.search(r"\bglobal_load_lds_dwordx4\b", text)
    assert re.search(r"\bds_bpermute_b32\b", text)


# LDS of the gfx942 kernel (split_mfma_gfx942.hip: 3 stages of 16 rows, 4 KiB of partial
# scores, 640 B of P, alpha and l) and the blocks it lets a 64 KiB CU hold.
GFX942_LDS = {"bf16": (60_096, 1), "fp8": (32_448, 2), "mxfp4": (21_072, 3)}


@pytest.mark.parametrize("spec", FAST_942, ids=lambda s: s.symbol)
def test_fast_gfx942_build_within_budget(amd_builds, spec: KernelSpec):
    """The gfx942 fast kernels: no scratch, no spills, and the LDS of a 3-stage ring of
    16-token tiles: one block per CU for bf16 (18 KiB stages), two for fp8, three for MXFP4."""
    build = amd_builds[(spec, "gfx942")]
    lds, blocks = GFX942_LDS[kernels.variant_of(spec)[0]]
    assert_within_budget(build, spec, 64 * 1024 // blocks)
    assert _notes_value(build[2], "group_segment_fixed_size") == lds
    assert 64 * 1024 // (blocks + 1) < lds  # the figure the occupancy model works from


def _disassemble(spec: KernelSpec, arch: str, tmp_path: Path) -> str:
    objdump = shutil.which("llvm-objdump-22")
    if CLANG is None or objdump is None:
        pytest.skip("clang++-22 / llvm-objdump-22 not installed")
    tu = tmp_path / "k.hip"
    tu.write_text(translation_unit(spec.source))
    co = tmp_path / "k.co"
    subprocess.run([CLANG, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib",
                    "-nogpuinc", "--no-gpu-bundle-output", "-O3", "-std=c++17", *spec.options(arch),
                    str(tu), "-o", str(co)], check=True, capture_output=True)
    return subprocess.run([objdump, "-d", str(co)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("spec", FAST_942, ids=lambda s: s.symbol)
def test_fast_gfx942_code_uses_the_matrix_cores(spec: KernelSpec, tmp_path):
    """llvm-objdump of the build: per 16-token tile a wave runs 9 Q.K + 8 P.V bf16 MFMAs
    (the loop's only ones), stages the tile in LDS with global_load_lds_dword (18 / 9 / 5
    copies a wave, issued for the two tiles of the prologue and once per tile), and waits
    for them with counted vmcnts; fp8 and MXFP4 KV go through the fnuz fp8 -> f32
    converts (MXFP4 after the v_perm table), bf16 KV needs neither."""
    text = _disassemble(spec, "gfx942", tmp_path)
    kv = kernels.variant_of(spec)[0]
    assert len(re.findall(r"\bv_mfma_f32_16x16x16_bf16\b", text)) == 9 + 8
    assert not re.search(r"v_mfma_scale|v_mfma_f32_16x16x32", text)  # gfx950-only instructions
    copies = {"bf16": 18, "fp8": 9, "mxfp4": 5}[kv]
    assert len(re.findall(r"\bglobal_load_lds_dword\b", text)) == 3 * copies
    converts = len(re.findall(r"\bv_cvt_pk_f32_fp8", text))
    # per tile and lane, 2 converts per fp8 dword, 4 per MXFP4 dword: Q.K 2 chunks of 4 /
    # 2 dwords + the rope dword (MXFP4's rope is 2 bytes: 2 converts), P.V one dword of 4
    # rows per value group (2 / 1 groups)
    assert converts == {"bf16": 0, "fp8": 2 * (9 + 8), "mxfp4": 4 * (4 + 4) + 2}[kv]
    assert re.search(r"\bv_perm_b32\b", text)
    assert re.search(r"\bds_bpermute_b32\b", text)
    assert not re.search(r"\bscratch_", text)


def test_fast_split_kernel_choice():
    spec = kernels.fast_split_kernel("gfx950", "mxfp4", "fp8")
    assert spec.symbol == "hipmla_decode_split_gfx950_mxfp4_qfp8" and spec.tile_tokens == 128
    assert spec.options("gfx950") == ["-DHIPMLA_KV_FORMAT=2", "-DHIPMLA_Q_PRECISION=1", "-DHIPMLA_FP8_FNUZ=0"]
    assert spec.builds_for("gfx950") and not spec.builds_for("gfx942") and not spec.builds_for("sm_90")
    assert kernels.fast_split_kernel("gfx950:xnack-", "mxfp4", "mxfp4").symbol.endswith("_qmxfp4")
    assert kernels.fast_split_kernel("gfx950", "mxfp4", "bf16").symbol.endswith("_mxfp4_qbf16")
    # no fast kernel: other formats, other archs (the portable kernel does it all)
    for arch, kv, qp in (("gfx950", "fp8", "fp8"), ("gfx950", "bf16", "bf16"),
                         ("gfx942", "mxfp4", "fp8"), ("sm_90", "mxfp4", "fp8")):
        assert kernels.fast_split_kernel(arch, kv, qp) is None
    assert kernels.fast_kernels("sm_90") == [] and kernels.kernels_for_arch("sm_90") == all_kernels()
    assert [s.symbol for s in kernels.kernels_for_arch("gfx950")][-3:] == [s.symbol for s in FAST_950]
    assert all(s.builds_for("sm_90") for s in all_kernels())
    assert [s.symbol for s in kernels.kernels_for_arch("gfx942")][-3:] == [s.symbol for s in FAST_942]
    with pytest.raises(ValueError, match="arch: expected an offload arch"):
        kernels.fast_split_kernel("", "mxfp4", "fp8")
    with pytest.raises(ValueError, match="q_precision: expected one of"):
        kernels.fast_split_kernel("gfx950", "mxfp4", "fp16")


def test_missing_specialisation_stops_the_build(tmp_path):
    if CLANG is None:
        pytest.skip("clang++-22 not installed")
    tu = tmp_path / "split.hip"
    tu.write_text(translation_unit("decode/split.hip"))
    proc = subprocess.run([CLANG, "-x", "hip", "--offload-arch=gfx950", "--cuda-device-only", "-nogpulib",
                           "-nogpuinc", "-fsyntax-only", str(tu)], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "HIPMLA_KV_FORMAT" in proc.stderr


# --------------------------------------------------------------------- NVRTC


def _find_nvrtc() -> str | None:
    try:
        import nvidia  # the pip packages nvidia-cuda-nvrtc & co. share this namespace
    except ImportError:
        nvidia = None
    if nvidia is not None:
        for base in nvidia.__path__:
            hits = sorted(glob.glob(os.path.join(base, "cu*", "lib", "libnvrtc.so*")))
            hits += sorted(glob.glob(os.path.join(base, "cuda_nvrtc", "lib", "libnvrtc.so*")))
            hits = [h for h in hits if "builtins" not in h]
            if hits:
                return hits[0]
    return ctypes.util.find_library("nvrtc")


@pytest.fixture(scope="module")
def nvrtc():
    path = _find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not installed")
    lib = ctypes.CDLL(path)
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def nvrtc_compile(nvrtc, src: str, name: str, opts: list[str]) -> None:
    """Compiles ``src`` to PTX with NVRTC; fails the test with its log on an error."""
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    try:
        raw = [o.encode() for o in opts]
        rc = nvrtc.nvrtcCompileProgram(prog, len(raw), (ctypes.c_char_p * len(raw))(*raw))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        print(log.value.decode(errors="replace"))
        assert rc == 0, log.value.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("spec", all_kernels(), ids=lambda s: s.symbol)
def test_nvrtc_build(nvrtc, spec: KernelSpec):
    nvrtc_compile(nvrtc, translation_unit(spec.source), spec.source, ["-arch=sm_90", *spec.options("sm_90")])


PROBES = {"sm90_wgmma_probe.cu": ["-DPROBE_ABLATE=0", "-DPROBE_ABLATE=4"]}


@pytest.mark.parametrize("probe,define", [(p, d) for p, ds in PROBES.items() for d in ds])
def test_probe_builds_for_sm90a(nvrtc, probe: str, define: str):
    """The wgmma probes under scripts/ (their scripts build them on the GPU the same way)
    still compile against this tree's arch/sm90.h, every ablation too."""
    text = (Path(__file__).resolve().parent.parent / "scripts" / probe).read_text()
    nvrtc_compile(nvrtc, translation_unit(f"probe/{probe}", text), probe, ["-arch=sm_90a", define])


# --------------------------------------------------------------------- CPU execution

@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """spec -> a launch function running the kernel source on the CPU."""
    if CLANG is None:
        pytest.skip("clang++-22 not installed (the harness uses clang vector types)")
    out = tmp_path_factory.mktemp("host")
    cache: dict[tuple[KernelSpec, str], object] = {}

    def get(spec: KernelSpec, arch: str = "gfx950"):
        key = (spec, arch)
        if key not in cache:
            # One file per build: two builds of a symbol (a test-only define) at one path
            # would load as one library.
            src = out / f"{spec.symbol}.{arch}.{len(cache)}.cpp"
            src.write_text(host_source(spec.source, arch))
            lib = out / f"{spec.symbol}.{arch}.{len(cache)}.so"
            subprocess.run([CLANG, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                            *spec.options(arch), f"-DHIPMLA_HOST_KERNEL={spec.symbol}", str(src),
                            "-o", str(lib)], check=True, capture_output=True, text=True)
            cache[key] = HostLaunch(ctypes.CDLL(str(lib)))
        return cache[key]

    return get


class HostLaunch:
    """A kernel built for the CPU harness: call it to launch; ``late_copies`` switches
    where its asynchronous copies land (tests/host_harness.py)."""

    def __init__(self, lib: ctypes.CDLL):
        self._launch = lib.hipmla_host_launch
        self._launch.argtypes = [DecodeParams, ctypes.c_int, ctypes.c_int]
        self._late = lib.hipmla_host_late_copies
        self._late.argtypes = [ctypes.c_int]
        self._late.restype = ctypes.c_int
        self.sms = lib.hipmla_host_sms  # block b on SM b % sms for the next launches (0: no SM ids)
        self.sms.argtypes = [ctypes.c_int]

    def __call__(self, p, grid: int, threads: int) -> None:
        self._launch(p, grid, threads)

    def late_copies(self, on: bool) -> int:
        """Copies land at the wait that covers them (on) or when issued (off); returns
        the copies left pending at a thread's end since the last call."""
        return self._late(1 if on else 0)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def run_on_host(host_kernels, q, kv: KVCache, layout: KvLayout, policy: SplitPolicy, sm_scale: float,
                q_precision: str, arch: str, errors: np.ndarray | None = None, qo: np.ndarray | None = None,
                spec: KernelSpec | None = None, placement_sms: int = 0, sms: int | None = None):
    """A kernel over the whole grid, on the CPU; returns (out f32, lse, counters). The
    portable kernel unless ``spec`` names another (a CDNA fast kernel: tests/host_cdna.h;
    an sm_90 one: tests/host_sm90.h, and for the 64-row kernel tests/host_sm90a.h, launched
    with its schedule rows and 4 partial slots an item as the decoder launches it).
    ``errors`` (one int32) receives the kernel's error word; ``qo`` is a qo_indptr (q then
    has its rows, and any of 16..128 heads). ``placement_sms`` > 0: the blocks claim their
    items (core/placement.h), block b on SM b % ``sms`` (default placement_sms); the words
    must reset."""
    batch = layout.batch
    t_q, heads = q.shape[0], q.shape[1]
    rows = t_q * head_groups(heads)  # counters: a row's first query token keys them (below 16 heads too)
    # Schedule rows as the decoder sets them (below 16 heads, several query tokens a row).
    groups, row_tokens = (spec or split_kernel(kv.format, q_precision)).schedule_rows(heads)
    slots = spec.row_heads // 16 if spec is not None else 1  # 16-head partial slots an item
    # NaN: unwritten output shows; one more query token's worth after the step's, which no
    # kernel may write (a head index past the model's heads, a row past t_q).
    out = np.full((t_q + 1, heads, 512), 0x7FC1, dtype=np.uint16)
    lse = np.full((t_q + 1, heads), np.nan, dtype=np.float32)
    grid = policy.max_items(t_q * groups)
    part_acc = np.full((grid * slots, 16, 512), np.nan, dtype=np.float32)
    part_ml = np.full((grid * slots, 16, 2), np.nan, dtype=np.float32)
    counters = np.zeros(2 * rows, dtype=np.int32)  # two merge counters a row (core/merge.h)
    qo32 = None if qo is None else np.ascontiguousarray(qo, dtype=np.int32)
    indptr = np.ascontiguousarray(layout.kv_indptr, dtype=np.int32)
    indices = None if not layout.paged else np.ascontiguousarray(layout.kv_indices, dtype=np.int32)
    last = None if not layout.paged else np.ascontiguousarray(layout.kv_last_page_len, dtype=np.int32)
    words = np.zeros(kernels.placement_words(placement_sms), dtype=np.int32) if placement_sms else None
    keep = [q, kv.data, kv.scales, indptr, indices, last, errors, qo32, words]
    # Extents as the decoder passes them (an empty buffer: -1 and, here, a null address, so
    # that any read through it crashes the test; an empty page table: kv_indptr's address).
    kv_rows = decode._extent(kv.data.shape)
    n_indices = 0 if indices is None or getattr(layout, "unbounded", False) else decode._extent(indices.shape)
    p = DecodeParams(
        q=_ptr(q), kv=_ptr(kv.data) if kv.rows else None, kv_scale=_ptr(kv.scales) if kv.rows else None,
        kv_indptr=_ptr(indptr), kv_indices=_ptr(indptr if n_indices == decode.EXTENT_EMPTY else indices),
        kv_last_page_len=_ptr(last), qo_indptr=_ptr(qo32), counters=_ptr(counters),
        part_acc=_ptr(part_acc), part_ml=_ptr(part_ml), out=_ptr(out), lse=_ptr(lse),
        sm_scale_log2=np.float32(np.float32(sm_scale) * np.float32(1.4426950408889634)),
        kv_fp8_scale=kv.fp8_scale if kv.format == "fp8" else 1.0,
        stride_kv_scale=kv.scales.shape[1] if kv.scales is not None else 0,
        batch=batch, page_shift=layout.page_size.bit_length() - 1,
        errors=_ptr(errors), kv_rows=kv_rows, n_indices=n_indices,
        head_groups=groups, q_tokens=t_q, placement=_ptr(words), placement_sms=placement_sms, row_tokens=row_tokens,
        heads_in_row=heads_in_row(heads),
    )
    p.set_split(policy)
    launch = host_kernels(spec or split_kernel(kv.format, q_precision), arch)
    if placement_sms:
        launch.sms(placement_sms if sms is None else sms)
    try:
        launch(p, grid_decode(grid)[0], 256)
    finally:
        if placement_sms:
            launch.sms(0)
    assert words is None or not words.any(), f"placement words left {words}"
    del keep
    assert (out[t_q] == 0x7FC1).all() and np.isnan(lse[t_q]).all(), "a kernel wrote past the step's output"
    return out[:t_q].view(ml_dtypes.bfloat16).astype(np.float32), lse[:t_q], counters


# Lengths that hit the empty sequence, a single token, exact tiles, partial tails and
# sequences split into several items (align 64 so splits are short here).
LENS = [0, 1, 64, 65, 130, 300, 37]
POLICY = SplitPolicy(target_items=8, min_split_tokens=64, align_tokens=64)


def _case(kv_format: str, fp8_variant: str, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(LENS), 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rows = sum(LENS)
    if kv_format == "bf16":
        kv = quantize_kv(rng.standard_normal((rows, 576), dtype=np.float32), "bf16")
    else:
        # Random codes: every e4m3 / E2M1 value incl. subnormals, varied block scales,
        # a padded scale row (24 bytes) as real producers write it.
        kv = random_cache(rows, kv_format, rng, fp8_variant=fp8_variant, scale_stride=24)
    items = schedule(LENS, POLICY)
    # Split items with partial tails (64..130, 192..300) and whole-sequence items.
    assert (items.n_items > 1).sum() == 5 and (items.n_items == 1).sum() == 5
    return q, kv, KvLayout.contiguous(LENS)


@pytest.mark.parametrize(
    "kv_format, q_precision, arch",
    [
        ("bf16", "bf16", "gfx950"),
        ("fp8", "bf16", "gfx950"),
        ("fp8", "fp8", "gfx942"),  # e4m3fnuz cache and Q
        ("mxfp4", "bf16", "gfx950"),
        ("mxfp4", "mxfp4", "gfx950"),
        ("bf16", "fp8", "gfx950"),
    ],
)
def test_kernels_on_cpu_match_emulator(host_kernels, kv_format, q_precision, arch):
    fp8_variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    q, kv, layout = _case(kv_format, fp8_variant, seed=len(kv_format) * 7 + len(q_precision))
    sm_scale = 1 / 24
    out, lse, counters = run_on_host(host_kernels, q, kv, layout, POLICY, sm_scale, q_precision, arch)
    ref_out, ref_lse = emulate_decode(q, kv, layout, sm_scale, POLICY, q_precision=q_precision)
    ref_out = ref_out.astype(np.float32)

    assert (counters == 0).all()  # every merger reset its sequence's counter
    assert_matches_emulator(out, lse, ref_out, ref_lse)


def assert_matches_emulator(out, lse, emu_out, emu_lse) -> None:
    """A kernel's output and LSE over the LENS batch as the emulator predicts them: every
    row written, empty sequences 0 / -inf."""
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    empty = np.array(LENS) == 0
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    np.testing.assert_allclose(lse, emu_lse, rtol=1e-5, atol=1e-5)
    # Dot products are summed in another order than the emulator's, so a p_j close to
    # a bf16 rounding boundary may round the other way: rare one-ulp differences.
    np.testing.assert_allclose(out, emu_out, rtol=1e-2, atol=1e-3)
    assert np.mean(out != emu_out) < 2e-3


@pytest.mark.parametrize("kv_format, page_size", [("mxfp4", 1), ("fp8", 16), ("bf16", 64)])
def test_paged_cache_on_cpu_is_bit_identical_to_contiguous(host_kernels, kv_format, page_size):
    """The same tokens through a page table (random page order, spare pages in the
    pool) and laid out contiguously: the same bits out, and both as the emulator says."""
    q, kv, contiguous = _case(kv_format, "e4m3fn", seed=page_size)
    rng = np.random.default_rng(page_size + 1)
    paged = random_page_table(LENS, page_size, rng, spare_pages=3)
    pool = scatter(kv, paged)
    out_c, lse_c, _ = run_on_host(host_kernels, q, kv, contiguous, POLICY, 1 / 24, "bf16", "gfx950")
    out_p, lse_p, counters = run_on_host(host_kernels, q, pool, paged, POLICY, 1 / 24, "bf16", "gfx950")
    assert np.array_equal(out_c.view(np.uint32), out_p.view(np.uint32))
    assert np.array_equal(lse_c.view(np.uint32), lse_p.view(np.uint32))
    assert (counters == 0).all()
    ref_out, _ = emulate_decode(q, pool, paged, 1 / 24, POLICY)
    assert np.mean(out_p != ref_out.astype(np.float32)) < 2e-3


# The CDNA fast kernels, whole, on the CPU: their wave64 instructions emulated from the
# operand layouts the arch headers cite (tests/host_cdna.h says what that can and cannot
# prove). Masked tails: the policy has no fast_tile, so they take every item.
FAST_CASES = [("gfx950", "mxfp4", "bf16"), ("gfx950", "mxfp4", "fp8"), ("gfx950", "mxfp4", "mxfp4"),
              ("gfx942", "bf16", "bf16"), ("gfx942", "fp8", "bf16"), ("gfx942", "mxfp4", "bf16")]


@pytest.mark.parametrize("arch, kv_format, q_precision", FAST_CASES)
def test_fast_kernels_on_cpu_match_emulator(host_kernels, arch, kv_format, q_precision):
    fp8_variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    q, kv, layout = _case(kv_format, fp8_variant, seed=len(arch) + len(kv_format) + len(q_precision))
    spec = kernels.fast_split_kernel(arch, kv_format, q_precision)
    errors = np.zeros(1, np.int32)
    out, lse, counters = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, q_precision, arch, errors,
                                     spec=spec)
    emu_out, emu_lse = emulate_decode(q, kv, layout, 1 / 24, POLICY, q_precision=q_precision,
                                      fast_schedule=FAST_SCHEDULES[arch], fast_any_length=True)
    assert errors[0] == 0 and (counters == 0).all()
    assert_matches_emulator(out, lse, emu_out.astype(np.float32), emu_lse)


def test_gfx942_mxfp4_nan_block_scale_poisons_only_its_sequence(host_kernels):
    """E8M0 255 is NaN (hipmla.formats): the gfx942 kernel decodes it to NaN (ldexp's
    infinity through x * 0 + x), so every output of the sequence holding that block is
    NaN, and the other sequences are exactly what they are without it."""
    q, kv, layout = _case("mxfp4", "e4m3fnuz", seed=942)
    spec = kernels.fast_split_kernel("gfx942", "mxfp4", "bf16")
    seq = LENS.index(300)
    row = sum(LENS[:seq]) + 150  # a token of a split sequence, inside a tile
    poisoned = KVCache(kv.format, kv.data, scales=kv.scales.copy(), fp8_scale=kv.fp8_scale,
                       fp8_variant=kv.fp8_variant, dim=kv.dim)
    poisoned.scales[row, 3] = 255
    errors = np.zeros(1, np.int32)
    out_c, lse_c, _ = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, "bf16", "gfx942", errors, spec=spec)
    out_p, lse_p, counters = run_on_host(host_kernels, q, poisoned, layout, POLICY, 1 / 24, "bf16", "gfx942",
                                         errors, spec=spec)
    assert errors[0] == 0 and (counters == 0).all()
    assert np.isnan(out_p[seq]).all() and np.isnan(lse_p[seq]).all()
    others = [s for s in range(len(LENS)) if s != seq]
    assert np.array_equal(out_c[others].view(np.uint32), out_p[others].view(np.uint32))
    assert np.array_equal(lse_c[others].view(np.uint32), lse_p[others].view(np.uint32))


@pytest.mark.parametrize("arch, kv_format, q_precision", FAST_CASES)
def test_fast_kernels_on_cpu_wait_for_their_copies(host_kernels, arch, kv_format, q_precision):
    """The same batch with every global -> LDS copy landing only at the s_waitcnt vmcnt that
    covers it (fewer than the hardware lands there: the harness does not count the plain
    loads): the output is bit-identical to copies landing when issued, so no read of a stage
    comes before its wait; and no copy is still in flight when a thread ends."""
    fp8_variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    q, kv, layout = _case(kv_format, fp8_variant, seed=len(arch) + len(kv_format) + len(q_precision))
    spec = kernels.fast_split_kernel(arch, kv_format, q_precision)
    launch = host_kernels(spec, arch)
    early = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, q_precision, arch, spec=spec)
    assert launch.late_copies(True) == 0
    try:
        late = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, q_precision, arch, spec=spec)
    finally:
        left = launch.late_copies(False)
    assert left == 0, f"{left} copies still in flight when their threads ended"
    for a, b in zip(early, late):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("spec", [kernels.sm90_split_kernel(kv) for kv in kernels.KV_FORMATS] +
                         [kernels.sm90_rows64_kernel(kv) for kv in kernels.ROWS64_FORMATS],
                         ids=lambda s: s.symbol)
def test_sm90_kernels_on_cpu_wait_for_their_copies(host_kernels, spec):
    """Both sm_90 kernels with every cp.async landing only at the cp.async.wait_group that
    covers its group (tests/host_sm90.h): bit-identical to copies landing when issued, so
    no stage is read before its wait (the 64-row kernel's one-stage fp8 ring included), and
    no copy is still in flight when a thread ends. 16 heads with rows of up to 4 query
    tokens for the 64-row kernel."""
    kv_format, _ = kernels.variant_of(spec)
    q, kv, layout = _case(kv_format, "e4m3fn", seed=len(spec.symbol))
    launch = host_kernels(spec, "sm_90")
    early = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, "bf16", "sm_90", spec=spec)
    assert launch.late_copies(True) == 0
    try:
        late = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, "bf16", "sm_90", spec=spec)
    finally:
        left = launch.late_copies(False)
    assert left == 0, f"{left} copies still in flight when their threads ended"
    assert np.isfinite(early[0]).all()
    for a, b in zip(early, late):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("arch, kv_format, q_precision, page_size",
                         [("gfx950", "mxfp4", "bf16", 16), ("gfx950", "mxfp4", "fp8", 1),
                          ("gfx950", "mxfp4", "mxfp4", 64),
                          ("gfx942", "fp8", "bf16", 16), ("gfx942", "mxfp4", "bf16", 1)])
def test_fast_kernels_on_cpu_paged_is_bit_identical_to_contiguous(host_kernels, arch, kv_format, q_precision,
                                                                  page_size):
    fp8_variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    q, kv, contiguous = _case(kv_format, fp8_variant, seed=page_size + 5)
    rng = np.random.default_rng(page_size + 6)
    paged = random_page_table(LENS, page_size, rng, spare_pages=3)
    pool = scatter(kv, paged)
    spec = kernels.fast_split_kernel(arch, kv_format, q_precision)
    out_c, lse_c, _ = run_on_host(host_kernels, q, kv, contiguous, POLICY, 1 / 24, q_precision, arch, spec=spec)
    out_p, lse_p, counters = run_on_host(host_kernels, q, pool, paged, POLICY, 1 / 24, q_precision, arch,
                                         spec=spec)
    assert np.array_equal(out_c.view(np.uint32), out_p.view(np.uint32))
    assert np.array_equal(lse_c.view(np.uint32), lse_p.view(np.uint32))
    assert (counters == 0).all() and np.isfinite(out_p).all()


@pytest.mark.parametrize("kv_format, q_precision", [(kv, "bf16") for kv in kernels.KV_FORMATS] + [
    ("bf16", "fp8"), ("bf16", "mxfp4"), ("fp8", "fp8"), ("fp8", "mxfp4"), ("mxfp4", "fp8"), ("mxfp4", "mxfp4")])
def test_sm90_kernel_on_cpu_matches_emulator(host_kernels, kv_format, q_precision):
    """The sm_90 tensor-core kernel, whole, on the CPU (tests/host_sm90.h: its warp
    instructions in the PTX ISA's fragment layouts); its numerics are the emulator's with
    32-token softmax tiles, on Q quantized as the emulator's quantize_q (fp8 cache: then
    through f16_q). On every CI machine, not only the H200 (tests/test_sm90.py)."""
    q, kv, layout = _case(kv_format, "e4m3fn", seed=len(kv_format) + 11)
    errors = np.zeros(1, np.int32)
    spec = kernels.sm90_split_kernel(kv_format, q_precision)
    out, lse, counters = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, q_precision, "sm_90", errors,
                                     spec=spec)
    emu_out, emu_lse = emulate_decode(q, kv, layout, 1 / 24, POLICY, q_precision=q_precision, q_fp8_variant="e4m3fn",
                                      tile_tokens=SM90_TILE_TOKENS, products=spec.products)
    if q_precision != "bf16":  # a kernel that skipped the quantization would fail the match below
        bf16_out, _ = emulate_decode(q, kv, layout, 1 / 24, POLICY, tile_tokens=SM90_TILE_TOKENS,
                                     products=spec.products)
        assert not np.allclose(bf16_out.astype(np.float32), emu_out.astype(np.float32), rtol=1e-2, atol=1e-3)
    assert errors[0] == 0 and (counters == 0).all()
    assert_matches_emulator(out, lse, emu_out.astype(np.float32), emu_lse)


def test_sm90_fp8_kernel_on_cpu_f16_products_of_extreme_q(host_kernels):
    """The fp8 cache's f16 products (each head's Q times its own power of two) on heads at
    both ends of the bf16 range, a head of zeros and one whose values span 2^40: the kernel
    as the emulator's f16_q says, where Q in f16 without the power of two would overflow or
    flush whole heads."""
    from test_sm90 import extreme_q

    q, kv, layout = _case("fp8", "e4m3fn", seed=31)
    q = extreme_q(np.random.default_rng(32), len(LENS))
    errors = np.zeros(1, np.int32)
    spec = kernels.sm90_split_kernel("fp8")
    out, lse, counters = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, "bf16", "sm_90", errors, spec=spec)
    emu_out, emu_lse = emulate_decode(q, kv, layout, 1 / 24, POLICY, tile_tokens=SM90_TILE_TOKENS, products="f16")
    assert errors[0] == 0 and (counters == 0).all()
    assert_matches_emulator(out, lse, emu_out.astype(np.float32), emu_lse)


def test_sm90_kernel_on_cpu_paged_is_bit_identical_to_contiguous(host_kernels):
    q, kv, contiguous = _case("mxfp4", "e4m3fn", seed=21)
    paged = random_page_table(LENS, 16, np.random.default_rng(22), spare_pages=3)
    spec = kernels.sm90_split_kernel("mxfp4")
    out_c, lse_c, _ = run_on_host(host_kernels, q, kv, contiguous, POLICY, 1 / 24, "bf16", "sm_90", spec=spec)
    out_p, lse_p, counters = run_on_host(host_kernels, q, scatter(kv, paged), paged, POLICY, 1 / 24, "bf16", "sm_90",
                                         spec=spec)
    assert np.array_equal(out_c.view(np.uint32), out_p.view(np.uint32))
    assert np.array_equal(lse_c.view(np.uint32), lse_p.view(np.uint32))
    assert (counters == 0).all() and np.isfinite(out_p).all()


def test_sm90_kernel_on_cpu_with_claimed_items_is_bit_identical(host_kernels):
    # core/placement.h in the whole kernel: blocks claim their items and the last claim
    # resets the words (run_on_host checks them); the bits are item i on block i's. 9 SMs
    # counted, blocks on 8 (b % 8), 7 rows, 10 items, grid 15: blocks 0..7 (firsts) run
    # items 0..7, block 8 (a second) item 9 and block 14 (a gap claim) item 8.
    q, kv, layout = _case("mxfp4", "e4m3fn", seed=23)
    spec = kernels.sm90_split_kernel("mxfp4")
    out_a, lse_a, _ = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, "bf16", "sm_90", spec=spec)
    out_b, lse_b, counters = run_on_host(host_kernels, q, kv, layout, POLICY, 1 / 24, "bf16", "sm_90", spec=spec,
                                         placement_sms=9, sms=8)
    assert np.array_equal(out_a.view(np.uint32), out_b.view(np.uint32))
    assert np.array_equal(lse_a.view(np.uint32), lse_b.view(np.uint32))
    assert (counters == 0).all() and np.isfinite(out_b).all()


def _tsan_runtime() -> str | None:
    """clang-22's ThreadSanitizer runtime, to preload into a child Python."""
    if CLANG is None:
        return None
    out = subprocess.run([CLANG, "-print-file-name=libclang_rt.tsan-x86_64.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


TSAN_CHILD = """
import ctypes, sys
sys.path[:0] = [{tests!r}, {root!r}]
import numpy as np
import test_kernels as T
from hipmla import kernels
arch, kv_format, q_precision, symbol, lib = sys.argv[1:6]
fn = ctypes.CDLL(lib).hipmla_host_launch
fn.argtypes = [T.DecodeParams, ctypes.c_int, ctypes.c_int]
spec = next(s for s in T.HOST_SPECS if s.symbol == symbol)
q, kv, layout = T._case(kv_format, "e4m3fnuz" if arch == "gfx942" else "e4m3fn", seed=3)
out, lse, counters = T.run_on_host(lambda s, a: fn, q, kv, layout, T.POLICY, 1 / 24, q_precision, arch, spec=spec)
assert np.isfinite(out).all() and (counters == 0).all()
print("ran")
"""


#: Every kernel the CPU harness runs: the portable ones, the CDNA fast ones, sm_90's.
HOST_SPECS = (all_kernels() + FAST_950 + FAST_942 +
              [kernels.sm90_split_kernel(kv, qp) for kv in kernels.KV_FORMATS for qp in kernels.Q_PRECISIONS] +
              [kernels.sm90_rows64_kernel(kv) for kv in kernels.ROWS64_FORMATS])


@pytest.mark.parametrize("arch, spec", [
    ("gfx950", kernels.fast_split_kernel("gfx950", "mxfp4", "bf16")),
    ("gfx942", kernels.fast_split_kernel("gfx942", "fp8", "bf16")),
    ("gfx950", split_kernel("mxfp4", "bf16")),
    ("sm_90", kernels.sm90_split_kernel("mxfp4")),
    ("sm_90", kernels.sm90_split_kernel("fp8", "mxfp4")),
    ("sm_90", kernels.sm90_rows64_kernel("mxfp4")),  # 16 heads: rows of up to 4 query tokens
    ("sm_90", kernels.sm90_rows64_kernel("fp8")),
    ("gfx950", split_kernel("mxfp4", "fp8"))], ids=lambda x: getattr(x, "symbol", x))
def test_kernels_on_cpu_have_no_data_race(tmp_path, arch, spec):
    """ThreadSanitizer over a whole kernel on the CPU harness: a missing block_sync or
    wave_sync (a lane reading shared memory another thread is still writing, or the merge
    overwriting Q while a wave still reads it) is a race report, even where the numbers
    happen to come out right."""
    runtime_lib = _tsan_runtime()
    if runtime_lib is None:
        pytest.skip("clang++-22 with its ThreadSanitizer runtime is not installed")
    kv_format, q_precision = kernels.variant_of(spec)
    src = tmp_path / "k.cpp"
    src.write_text(host_source(spec.source, arch))
    lib = tmp_path / "k.so"
    subprocess.run([CLANG, "-std=c++20", "-O1", "-g", "-shared", "-fPIC", "-pthread", "-fsanitize=thread",
                    "-shared-libsan", *spec.options(arch), f"-DHIPMLA_HOST_KERNEL={spec.symbol}", str(src),
                    "-o", str(lib)], check=True, capture_output=True, text=True)
    here = Path(__file__).resolve().parent
    child = TSAN_CHILD.format(tests=str(here), root=str(here.parent))
    env = {**os.environ, "LD_PRELOAD": runtime_lib, "TSAN_OPTIONS": "halt_on_error=0 exitcode=66"}
    proc = subprocess.run([sys.executable, "-c", child, arch, kv_format, q_precision, spec.symbol, str(lib)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert "WARNING: ThreadSanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr[-4000:]


@dataclass
class RawLayout:
    """A page table as the device sees it: no host-side validation, so it can be wrong."""

    kv_indptr: np.ndarray
    kv_indices: np.ndarray | None = None
    kv_last_page_len: np.ndarray | None = None
    page_size: int = 1
    unbounded: bool = False  # kv_indices as a raw address: the kernel gets no table length

    @property
    def batch(self) -> int:
        return self.kv_indptr.shape[0] - 1

    @property
    def paged(self) -> bool:
        return self.kv_indices is not None


@pytest.mark.parametrize("kv_format, heads, page_size, fast", [
    ("mxfp4", 32, 16, None), ("bf16", 64, 1, None), ("fp8", 16, 1, None),
    ("mxfp4", 32, 16, ("gfx950", "fp8")), ("fp8", 64, 1, ("gfx942", "bf16"))])
def test_several_query_tokens_and_heads_on_cpu_match_emulator_and_reference(host_kernels, kv_format, heads,
                                                                            page_size, fast):
    """Ragged q_len 0..4 in one batch (the causal rule at a split boundary, on a
    sequence with exactly as many kv tokens as query tokens), 16..64 heads, paged or not;
    the portable kernel, and (``fast``: arch, Q precision) a CDNA fast kernel."""
    arch, q_precision = fast or ("gfx950", "bf16")
    spec = kernels.fast_split_kernel(arch, kv_format, q_precision) if fast else None
    fp8_variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    emu_kw = dict(fast_schedule=FAST_SCHEDULES[arch], fast_any_length=True, q_precision=q_precision) if fast else {}
    rng = np.random.default_rng(len(kv_format) + heads + page_size)
    lens = np.array([3, 70, 2, 129, 0, 40])
    q_lens = np.array([3, 4, 1, 2, 0, 1])
    qo = np.concatenate([[0], np.cumsum(q_lens)])
    layout = random_page_table(lens, page_size, rng, spare_pages=3) if page_size > 1 else KvLayout.contiguous(lens)
    rows = int(layout.kv_indices.max(initial=0) + 1) * page_size if layout.paged else int(lens.sum())
    kv = (quantize_kv(rng.standard_normal((rows, 576), dtype=np.float32), "bf16") if kv_format == "bf16"
          else random_cache(rows, kv_format, rng, scale_stride=24, fp8_variant=fp8_variant))
    q = rng.standard_normal((int(qo[-1]), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    sm_scale = 576 ** -0.5
    errors = np.zeros(1, np.int32)
    out, lse, counters = run_on_host(host_kernels, q, kv, layout, POLICY, sm_scale, q_precision, arch, errors, qo,
                                     spec=spec)
    emu_out, emu_lse = emulate_decode(q, kv, layout, sm_scale, POLICY, qo_indptr=qo, **emu_kw)
    ref_out, ref_lse = mla_decode_reference(q, kv, layout, sm_scale, qo_indptr=qo)
    assert errors[0] == 0 and (counters == 0).all()
    assert np.isfinite(out).all() and not np.isnan(lse).any()  # every row written
    # As in test_kernels_on_cpu_match_emulator: rare one-ulp differences in P.
    emu_out = emu_out.astype(np.float32)
    np.testing.assert_allclose(lse, emu_lse, rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(out, emu_out, rtol=1e-2, atol=1e-3)
    assert np.mean(out != emu_out) < 2e-3
    if q_precision == "bf16":  # a quantized Q is the emulator's to bound (test_emulate.py)
        scale = np.abs(ref_out).max()
        assert np.abs(out - ref_out).max() <= 2e-2 * scale
    # Query token j of n sees len - n + j + 1 tokens: the first token of sequence 0 sees one.
    k0 = kv.dequantize(layout.rows(0, 0, 1))
    np.testing.assert_allclose(ref_out[0], np.broadcast_to(k0[0, :512], (heads, 512)), rtol=1e-6)


@pytest.mark.parametrize("kv_format, q_precision, arch, kernel, heads", [
    ("mxfp4", "bf16", "gfx950", "portable", 8), ("fp8", "fp8", "gfx950", "portable", 8),
    ("bf16", "bf16", "gfx950", "portable", 3),
    ("mxfp4", "bf16", "sm_90", "sm90", 8), ("fp8", "bf16", "sm_90", "sm90", 8), ("bf16", "mxfp4", "sm_90", "sm90", 8),
    ("mxfp4", "bf16", "sm_90", "sm90", 5), ("fp8", "bf16", "sm_90", "sm90", 1),
    ("mxfp4", "bf16", "gfx950", "fast", 8), ("mxfp4", "mxfp4", "gfx950", "fast", 8),
    ("mxfp4", "fp8", "gfx950", "fast", 12), ("mxfp4", "bf16", "gfx950", "fast", 4),
    ("fp8", "bf16", "gfx942", "fast", 8), ("mxfp4", "bf16", "gfx942", "fast", 8),
    ("bf16", "bf16", "gfx942", "fast", 1), ("fp8", "bf16", "gfx942", "fast", 6)])
def test_fewer_heads_on_cpu_pack_query_tokens_into_rows(host_kernels, kv_format, q_precision, arch, kernel, heads):
    """A model of fewer than 16 heads (8: DeepSeek-V3 at TP16, Kimi K2 at TP8) shares each
    16-head row among query tokens of a sequence (8 x 2, 5 x 2, 6 x 2, 4 x 4, 1 x 16): every
    kernel reads their q and writes their out and lse at that many heads a query token and
    masks each slot at its own query token's causal bound. Ragged query tokens (a sequence's
    last row holding fewer tokens than a row can; a split boundary inside the last tokens'
    reach), split rows, a paged cache: the emulator's numbers, exact attention within the
    project's bound, every head of every token written and nothing past the step's output.
    With one query token a sequence the rows hold one token, and the output is bit for bit
    that of the same heads with zero heads after them up to 16."""
    spec = {"portable": None, "sm90": kernels.sm90_split_kernel(kv_format, q_precision),
            "fast": kernels.fast_split_kernel(arch, kv_format, q_precision)}[kernel]
    sixteen = spec or split_kernel(kv_format, q_precision)
    # As many query tokens as fit, rounded down to a power of two (the device's row counts are shifts).
    row_tokens = {1: 16, 3: 4, 4: 4, 5: 2, 6: 2, 8: 2, 12: 1}[heads]
    assert sixteen.serves_heads(heads) and sixteen.schedule_rows(heads) == (1, row_tokens)
    fp8_variant = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
    if kernel == "fast":
        emu_kw = dict(fast_schedule=FAST_SCHEDULES[arch], fast_any_length=True)
    elif kernel == "sm90":
        emu_kw = dict(tile_tokens=SM90_TILE_TOKENS, products=spec.products)
    else:
        emu_kw = {}
    rng = np.random.default_rng(len(kv_format) + len(q_precision) + len(arch) + heads)
    # The step's last row is a split row (merged) in one order, a row of one item (written
    # by its block) in the other: a slot past the row's heads written from either would
    # land in the guard run_on_host keeps after the output. q_len 7 and 20: rows of
    # row_tokens and a last row of fewer; 129 tokens with 20 queries: a split boundary (64)
    # that the earlier queries' bounds straddle. The third batch, split finer, has items
    # that the first tokens of their rows see none of (65 tokens, 16 queries: the row of
    # queries 14 and 15 has items [0, 64) and [64, 65), and query 14 sees 64 tokens): those
    # heads' partials are empty (m = -FLT_MAX, l = 0) and weigh nothing in the merge.
    fine = SplitPolicy(target_items=64, min_split_tokens=64, align_tokens=64)
    for lens, q_lens, policy in (([3, 70, 2, 129, 0, 40, 300], [3, 4, 1, 20, 0, 1, 7], POLICY),
                                 ([300, 40, 0, 129, 2, 70, 3], [1, 1, 0, 20, 1, 4, 3], POLICY),
                                 ([65, 16, 65, 66, 130, 17], [16, 16, 16, 12, 16, 16], fine)):
        if policy is fine and row_tokens > 1:
            s = schedule(lens, policy, q_lens=q_lens, row_tokens=row_tokens)
            assert ((s.begin >= s.sees - (s.queries - 1)) & (s.end > s.begin)).any()
        qo = np.concatenate([[0], np.cumsum(q_lens)])
        layout = random_page_table(np.array(lens), 16, rng, spare_pages=3)
        rows = int(layout.kv_indices.max(initial=0) + 1) * 16
        kv = (quantize_kv(rng.standard_normal((rows, 576), dtype=np.float32), "bf16") if kv_format == "bf16"
              else random_cache(rows, kv_format, rng, scale_stride=24, fp8_variant=fp8_variant))
        qh = rng.standard_normal((int(qo[-1]), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        errors = np.zeros(1, np.int32)
        out, lse, counters = run_on_host(host_kernels, qh, kv, layout, policy, 1 / 24, q_precision, arch,
                                         errors, qo, spec=spec)
        assert errors[0] == 0 and (counters == 0).all()
        assert np.isfinite(out).all() and not np.isnan(lse).any()  # every head of every query token written
        emu_out, emu_lse = emulate_decode(qh, kv, layout, 1 / 24, policy, qo_indptr=qo, q_precision=q_precision,
                                          q_fp8_variant=fp8_variant, **emu_kw)
        v_max = float(np.abs(kv.dequantize(np.arange(kv.rows))[:, :512]).max())
        assert_within_p_flips(out.astype(ml_dtypes.bfloat16), lse, emu_out, emu_lse, v_max,
                              f"{kernel} {kv_format} q{q_precision} {heads} heads")
        if q_precision == "bf16":  # and the right values: exact attention over the same cache
            ref_out, ref_lse = mla_decode_reference(qh, kv, layout, 1 / 24, qo_indptr=qo)
            assert np.abs(out - ref_out).max() <= 2e-2 * np.abs(ref_out).max()
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-2)

    # One query token a sequence: rows of one token, the 16-head kernel's own output.
    q1 = rng.standard_normal((len(lens), heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    q16 = np.concatenate([q1, np.zeros((q1.shape[0], 16 - heads, 576), q1.dtype)], axis=1)
    out_h, lse_h, _ = run_on_host(host_kernels, q1, kv, layout, POLICY, 1 / 24, q_precision, arch, spec=spec)
    out16, lse16, _ = run_on_host(host_kernels, q16, kv, layout, POLICY, 1 / 24, q_precision, arch, spec=spec)
    assert np.array_equal(out_h.view(np.uint32), out16[:, :heads].view(np.uint32))
    assert np.array_equal(lse_h.view(np.uint32), lse16[:, :heads].view(np.uint32))


@pytest.mark.parametrize("kind", ["decreasing indptr", "rows past the cache", "page past the cache",
                                  "negative page id", "indptr past kv_indices", "last page length",
                                  "more tokens than int32", "indptr wrapped past int32"])
@pytest.mark.parametrize("arch", ["portable", "gfx942"])
def test_invalid_device_input_gives_nan_and_an_error_bit(host_kernels, kind, arch):
    """The host never reads kv_indptr / kv_indices / kv_last_page_len: the kernel checks
    them, reads nothing outside the arrays it was given, writes NaN for the sequence it
    cannot trust and sets the error word; every other sequence stays right. The portable
    kernel and the gfx942 fast kernel (bf16 cache: tests/host_cdna.h)."""
    spec = kernels.fast_split_kernel(arch, "bf16", "bf16") if arch != "portable" else None
    arch = "gfx950" if arch == "portable" else arch
    q, kv, contiguous = _case("bf16", "e4m3fn", seed=3)
    rng = np.random.default_rng(4)
    paged = random_page_table(LENS, 16, rng)
    pool = scatter(kv, paged)
    cache = kv
    if kind == "decreasing indptr":
        indptr = contiguous.kv_indptr.copy()
        indptr[6] = indptr[5] - 1  # sequence 5 (300 tokens) ends before it starts; 6 gets longer
        lay, hit, bit = RawLayout(indptr), [5], 1
    elif kind == "indptr wrapped past int32":
        # An int64 offset past 2^31 a runtime cast to int32: in int32, end - first of
        # sequence 5 wrapped back to a count of ~2^31 tokens read from row indptr[5] on.
        indptr = contiguous.kv_indptr.astype(np.int32)
        indptr[6] = -2**31 + 2
        lay, hit, bit = RawLayout(indptr), [5, 6], 1
    elif kind == "rows past the cache":
        cache = take_rows(kv, np.arange(kv.rows - 10))  # the last sequence's rows are gone
        lay, hit, bit = RawLayout(contiguous.kv_indptr), [len(LENS) - 1], 2
    else:
        idx, last, ip = paged.kv_indices.copy(), paged.kv_last_page_len.copy(), paged.kv_indptr.copy()
        cache = pool
        if kind == "page past the cache":
            idx[ip[5] + 1] = pool.rows // 16 + 3  # a page of sequence 5 past the pool
            hit, bit = [5], 4
        elif kind == "negative page id":
            idx[ip[3]] = -2
            hit, bit = [3], 4
        elif kind == "indptr past kv_indices":
            idx = idx[: ip[-1] - 1]  # the table is one entry short for the last sequence
            hit, bit = [len(LENS) - 1], 2
        elif kind == "more tokens than int32":
            # A raw table address (no length to check against) and 2^27 more pages of 16
            # rows for the last sequence: its token count leaves int32. It must be flagged
            # before anything reads those entries or splits that count.
            ip[-1] += 1 << 27
            hit, bit = [len(LENS) - 1], 2
        else:
            last[2] = 17  # page size 16
            hit, bit = [2], 8
        lay = RawLayout(ip, idx, last, 16, unbounded=kind == "more tokens than int32")
    errors = np.zeros(1, dtype=np.int32)
    out, lse, counters = run_on_host(host_kernels, q, cache, lay, POLICY, 1 / 24, "bf16", arch, errors, spec=spec)
    assert errors[0] & bit, (kind, int(errors[0]))
    assert np.isnan(out[hit]).all() and np.isnan(lse[hit]).all(), kind
    ok = [s for s in range(len(LENS)) if s not in hit]
    assert not np.isnan(out[ok]).any() and not np.isnan(lse[ok]).any(), kind
    assert (counters == 0).all()  # merges of poisoned sequences still reset their counters
    clean_out, clean_lse, _ = run_on_host(host_kernels, q, kv, contiguous, POLICY, 1 / 24, "bf16", arch, spec=spec)
    # sequence 6 of the decreasing indptr reads other rows now: finite, but not the clean output
    good = [s for s in ok if not (kind == "decreasing indptr" and s == 6)]
    np.testing.assert_allclose(out[good], clean_out[good], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kernel", ["portable", "gfx942", "gfx950", "sm90", "sm90_rows64"])
def test_an_empty_cache_serves_empty_sequences_and_flags_the_rest(host_kernels, kernel, paged):
    """A cache of no rows (and, paged, a page table of no entries), passed as the decoder
    passes an empty buffer: extent -1 and a null address. A step of empty sequences gives
    0 / -inf with no error; a sequence with tokens is flagged (ERR_BOUNDS) and NaN, and
    nothing is read (a read through the null address would crash the test)."""
    kv_format = "mxfp4"
    spec = {"portable": None, "gfx942": kernels.fast_split_kernel("gfx942", kv_format, "bf16"),
            "gfx950": kernels.fast_split_kernel("gfx950", kv_format, "bf16"),
            "sm90": kernels.sm90_split_kernel(kv_format), "sm90_rows64": kernels.sm90_rows64_kernel(kv_format)}[kernel]
    arch = "gfx942" if kernel == "gfx942" else "gfx950"
    empty = quantize_kv(np.zeros((0, 576), np.float32), kv_format)
    heads = 64 if kernel == "sm90_rows64" else 16
    q = np.random.default_rng(5).standard_normal((3, heads, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)

    def layout(lens):
        if not paged:
            return RawLayout(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        # every sequence's pages would start at entry 0 of the (empty) table
        return RawLayout(np.concatenate([[0], np.cumsum(-(-np.array(lens) // 16))]).astype(np.int32),
                         np.zeros(0, np.int32), np.where(np.array(lens) > 0, (np.array(lens) - 1) % 16 + 1, 1), 16)

    for lens, hit in (([0, 0, 0], []), ([0, 0, 5], [2])):
        errors = np.zeros(1, dtype=np.int32)
        out, lse, counters = run_on_host(host_kernels, q, empty, layout(lens), POLICY, 1 / 24, "bf16", arch,
                                         errors, spec=spec)
        ok = [s for s in range(3) if s not in hit]
        assert (out[ok] == 0).all() and np.isneginf(lse[ok]).all(), (kernel, lens)
        assert np.isnan(out[hit]).all() and np.isnan(lse[hit]).all(), (kernel, lens)
        assert errors[0] == (2 if hit else 0), (kernel, lens, int(errors[0]))
        assert (counters == 0).all()


def test_gfx942_fast_kernels_take_bf16_q_for_every_cache():
    """gfx942 routes whole tiles of bf16, fp8 and MXFP4 caches to its bf16-MFMA kernel,
    with bf16 Q only (the decoder's "auto" Q, so "auto" lands on the fast kernel)."""
    assert kernels.AUTO_Q_PRECISION == "bf16"
    for kv in kernels.KV_FORMATS:
        spec = kernels.fast_split_kernel("gfx942:sramecc+:xnack-", kv, "bf16")
        assert spec.symbol == f"hipmla_decode_split_gfx942_{kv}_qbf16"
        assert spec.source == "decode/split_mfma_gfx942.hip" and spec.tile_tokens == 16
        assert spec.options("gfx942") == [f"-DHIPMLA_KV_FORMAT={kernels.FORMAT_CODES[kv]}",
                                          "-DHIPMLA_Q_PRECISION=0", "-DHIPMLA_FP8_FNUZ=1"]
        assert spec.builds_for("gfx942") and not spec.builds_for("gfx950")
        assert kernels.fast_split_kernel("gfx942", kv, "fp8") is None
        assert kernels.fast_split_kernel("gfx942", kv, "mxfp4") is None
        assert kernels.fast_split_kernel("sm_90", kv, "bf16") is None  # nothing changes elsewhere


def test_gfx942_kernel_rejects_other_specialisations(tmp_path):
    if CLANG is None:
        pytest.skip("clang++-22 not installed")
    tu = tmp_path / "k.hip"
    tu.write_text(translation_unit("decode/split_mfma_gfx942.hip"))
    base = [CLANG, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc", "-fsyntax-only", str(tu)]
    fp8_q = subprocess.run(base + ["--offload-arch=gfx942", "-DHIPMLA_KV_FORMAT=2", "-DHIPMLA_Q_PRECISION=1",
                                   "-DHIPMLA_FP8_FNUZ=1"], capture_output=True, text=True)
    assert fp8_q.returncode != 0 and "bf16 Q" in fp8_q.stderr
    wrong_arch = subprocess.run(base + ["--offload-arch=gfx950", "-DHIPMLA_KV_FORMAT=2", "-DHIPMLA_Q_PRECISION=0",
                                        "-DHIPMLA_FP8_FNUZ=1"], capture_output=True, text=True)
    assert wrong_arch.returncode != 0 and "gfx942 only" in wrong_arch.stderr


def test_hip_src_dir_of_an_installed_wheel(tmp_path, monkeypatch):
    # Installed, hip_src/ is the namespace package hipmla._hip_src: its search location
    # is the folder, whatever importlib.resources would call it.
    import importlib.machinery
    import importlib.util

    import hipmla.kernels as kernels_module

    (tmp_path / "params.h").write_text("// installed copy\n")
    spec = importlib.machinery.ModuleSpec("hipmla._hip_src", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "hipmla._hip_src" else real(name, *a))
    assert kernels_module.hip_src_dir() == tmp_path


@pytest.mark.parametrize("qo", [[0, 4, 0, 4, 0, 4], [1, 2, 3, 4, 4, 4], [0, 1, 2, 3, 3, 3]],
                         ids=["overlapping", "not from 0", "short of q"])
def test_an_invalid_qo_indptr_voids_the_step_and_leaves_the_counters_clean(host_kernels, qo):
    """Found in review: a falling qo_indptr let sequences share rows and counters, so a
    later valid step merged stale partials. Now no block takes an item: nothing written,
    every counter 0, ERR_QO set."""
    rng = np.random.default_rng(5)
    lens = np.array([4, 0, 4, 0, 4096])
    kv = quantize_kv(rng.standard_normal((int(lens.sum()), 576), dtype=np.float32), "bf16")
    q = rng.standard_normal((4, 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
    errors = np.zeros(1, np.int32)
    policy = SplitPolicy(16, 256, 128)
    out, lse, counters = run_on_host(host_kernels, q, kv, KvLayout.contiguous(lens), policy, 0.05, "bf16",
                                     "gfx950", errors, np.array(qo))
    assert errors[0] == 16 and (counters == 0).all()
    assert np.isnan(out).all() and np.isnan(lse).all()  # the harness's poison: nothing was written
