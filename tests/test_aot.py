"""Tests of hipmla.aot: toolchain discovery, offline builds, the resource report and the
prebuilt lookup. Builds need a clang that targets gfx950 (Debian's clang-22 will do) and
are skipped without one; parsing, the occupancy model and the budget run everywhere."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hipmla import aot, perfmodel


def _have_clang() -> bool:
    try:
        aot.find_clang()
    except aot.ToolchainNotFound:
        return False
    return True


needs_clang = pytest.mark.skipif(not _have_clang(), reason="no clang that targets gfx950")

# Kernels bring their own platform prelude because builds use -nogpuinc.
PRELUDE = """
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
"""


def lds_kernel(name: str, lds_bytes: int, threads: int) -> str:
    return PRELUDE + f"""
extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, {threads})))
{name}(float* out) {{
  __shared__ float buf[{lds_bytes // 4}];
  int t = __builtin_amdgcn_workitem_id_x();
  buf[t] = t * SCALE;
  __builtin_amdgcn_s_barrier();
  out[t] = buf[{lds_bytes // 4 - 1} - t];
}}
"""


AGPR_KERNEL = PRELUDE + """
extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, 256)))
agpr_user(float* out, const float* in) {
  int t = __builtin_amdgcn_workitem_id_x();
  float a0, a1, a2, r0, r1, r2;
  asm volatile("v_accvgpr_write_b32 %0, %1" : "=a"(a0) : "v"(in[t]));
  asm volatile("v_accvgpr_write_b32 %0, %1" : "=a"(a1) : "v"(in[t + 256]));
  asm volatile("v_accvgpr_write_b32 %0, %1" : "=a"(a2) : "v"(in[t + 512]));
  asm volatile("v_accvgpr_read_b32 %0, %1" : "=v"(r0) : "a"(a0));
  asm volatile("v_accvgpr_read_b32 %0, %1" : "=v"(r1) : "a"(a1));
  asm volatile("v_accvgpr_read_b32 %0, %1" : "=v"(r2) : "a"(a2));
  out[t] = r0 + r1 * r2;
}
"""

# 96 live accumulators: ~111 VGPRs, so registers, not LDS, limit occupancy (4 waves).
HEAVY_KERNEL = PRELUDE + """
extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, 256)))
heavy(float* out, const float* in) {
  int t = __builtin_amdgcn_workitem_id_x();
  float acc[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) acc[i] = in[t + i * 256];
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = acc[i] * acc[(i + 1) % 96] + 1.0f;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) s += acc[i] * (i + 1);
  out[t] = s;
}
"""

# A dynamically indexed private array lives in scratch.
SCRATCH_KERNEL = PRELUDE + """
extern "C" __global__ void __attribute__((amdgpu_flat_work_group_size(1, 256)))
uses_scratch(float* out, const int* idx) {
  float priv[64];
  int t = __builtin_amdgcn_workitem_id_x();
  for (int i = 0; i < 64; ++i) priv[i] = out[t * 64 + i];
  out[t] = priv[idx[t] & 63];
}
"""


def compiler_occupancy(source: str, arch: str, tmp_path: Path) -> int:
    """The occupancy clang itself computes (its assembly comment), to check our model."""
    tu = tmp_path / "occ.hip"
    tu.write_text(source)
    flags = [f for f in aot.BUILD_FLAGS if f != "--no-gpu-bundle-output"]
    asm = subprocess.run(
        [aot.find_clang(), *flags, f"--offload-arch={arch}", "-DSCALE=1", str(tu), "-S", "-o", "-"],
        capture_output=True, text=True, check=True,
    ).stdout
    return int(re.search(r"; Occupancy: (\d+)", asm).group(1))


# --- find_clang ------------------------------------------------------------------------


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_clang_lists_every_candidate_when_none_exists(monkeypatch, tmp_path):
    monkeypatch.delenv("HIPMLA_CLANG", raising=False)
    monkeypatch.delenv("ROCM_HOME", raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(aot.ToolchainNotFound) as err:
        aot.find_clang()
    message = str(err.value)
    for name in ("amdclang++", "clang++-22", "clang++:", "HIPMLA_CLANG"):
        assert name in message


def test_find_clang_rejects_a_clang_without_gfx950(monkeypatch, tmp_path):
    monkeypatch.delenv("HIPMLA_CLANG", raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    monkeypatch.setenv("PATH", str(tmp_path))
    old = _script(tmp_path / "clang++", "echo 'error: unsupported HIP gpu architecture: gfx950' >&2; exit 1")
    with pytest.raises(aot.ToolchainNotFound) as err:
        aot.find_clang()
    assert f"{old}: rejects --offload-arch=gfx950 (error: unsupported HIP gpu architecture" in str(err.value)


def test_find_clang_explicit_choice_must_work(monkeypatch, tmp_path):
    monkeypatch.setenv("HIPMLA_CLANG", str(tmp_path / "missing-clang"))
    with pytest.raises(aot.ToolchainNotFound, match="HIPMLA_CLANG=.*missing-clang.*not an executable"):
        aot.find_clang()
    broken = _script(tmp_path / "broken-clang", "exit 3")
    monkeypatch.setenv("HIPMLA_CLANG", str(broken))
    with pytest.raises(aot.ToolchainNotFound, match="HIPMLA_CLANG=.*broken-clang.*exit 3"):
        aot.find_clang()


@needs_clang
def test_find_clang_falls_through_to_a_working_candidate(monkeypatch, tmp_path):
    real = aot.find_clang()
    monkeypatch.delenv("HIPMLA_CLANG", raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    _script(tmp_path / "amdclang++", "exit 1")
    (tmp_path / "clang++").symlink_to(real)
    monkeypatch.setenv("PATH", str(tmp_path))
    found = aot.find_clang()
    assert found == str(tmp_path / "clang++")
    # The readelf of the same LLVM is found through the symlink's target.
    assert Path(aot.find_readelf(found)).parent == Path(os.path.realpath(real)).parent


# --- notes parsing ----------------------------------------------------------------------

NOTES = """
Displaying notes found in: .note
  Owner                Data size 	Description
  AMDGPU               0x0000022a	NT_AMDGPU_METADATA (AMDGPU Metadata)
    AMDGPU Metadata:
        ---
amdhsa.kernels:
  - .agpr_count:     4
    .args:
      - .address_space:  global
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
      - .offset:         8
        .size:           4
        .value_kind:     by_value
    .group_segment_fixed_size: 40960
    .kernarg_segment_align: 8
    .kernarg_segment_size: 12
    .max_flat_workgroup_size: 256
    .name:           first
    .private_segment_fixed_size: 0
    .sgpr_count:     14
    .sgpr_spill_count: 0
    .symbol:         first.kd
    .uniform_work_group_size: 1
    .uses_dynamic_stack: false
    .vgpr_count:     132
    .vgpr_spill_count: 0
    .wavefront_size: 64
  - .args:           []
    .group_segment_fixed_size: 0
    .max_flat_workgroup_size: 1024
    .name:           second
    .private_segment_fixed_size: 48
    .sgpr_count:     104
    .sgpr_spill_count: 2
    .symbol:         second.kd
    .uses_dynamic_stack: true
    .vgpr_count:     9
    .vgpr_spill_count: 5
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-
amdhsa.version:
  - 1
  - 2
...
"""


def test_parse_notes_reads_the_named_kernel():
    r = aot.parse_notes(NOTES, symbol="first")
    assert r == aot.KernelResources(
        symbol="first", arch="gfx942", vgpr=132, sgpr=14, agpr=4, lds_bytes=40960,
        scratch_bytes=0, vgpr_spills=0, sgpr_spills=0,
        # 132 -> 136 VGPRs: 3 waves by registers; 65536 // 40960 = 1 block of 4 waves by LDS.
        waves_per_simd=1, dynamic_stack=False,
    )
    s = aot.parse_notes(NOTES, symbol="second", block_threads=64)
    assert (s.agpr, s.scratch_bytes, s.vgpr_spills, s.sgpr_spills, s.dynamic_stack) == (0, 48, 5, 2, True)
    assert s.waves_per_simd == 7  # > 100 SGPRs


def test_parse_notes_block_size_and_dynamic_lds_change_occupancy():
    default = aot.parse_notes(NOTES, symbol="first")
    assert default.waves_per_simd == 1
    # Still one block by LDS, but its 8 waves put 2 on every SIMD.
    assert aot.parse_notes(NOTES, symbol="first", block_threads=512).waves_per_simd == 2
    # 16 waves need 4 per SIMD; 136 VGPRs allow 3.
    assert aot.parse_notes(NOTES, symbol="first", block_threads=1024).waves_per_simd == 0
    big = aot.parse_notes(NOTES, symbol="first", dynamic_lds_bytes=32768)
    assert big.lds_bytes == 40960 + 32768
    assert big.waves_per_simd == 0  # 72 KiB is more than a gfx942 CU has


def test_parse_notes_rejects_ambiguous_or_unknown_input():
    with pytest.raises(ValueError, match=r"symbol: the object holds kernels \['first', 'second'\]"):
        aot.parse_notes(NOTES)
    with pytest.raises(ValueError, match="symbol: expected one of .* got 'third'"):
        aot.parse_notes(NOTES, symbol="third")
    with pytest.raises(ValueError, match="amdhsa.target"):
        aot.parse_notes(NOTES.replace("amdhsa.target", "amdhsa.tagret"))
    with pytest.raises(ValueError, match=r"lacks metadata keys \['.vgpr_count'\]"):
        aot.parse_notes(NOTES.replace("    .vgpr_count:     132\n", ""), symbol="first")
    with pytest.raises(ValueError, match="arch: expected one of"):
        aot.parse_notes(NOTES.replace("gfx942:sramecc+", "gfx1100:sramecc+"), symbol="first")


# --- occupancy model ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, vgpr, sgpr, lds, threads, waves",
    [
        ("gfx950", 1, 10, 0, 256, 8),
        ("gfx950", 64, 10, 0, 256, 8),  # 512 // 64 = 8
        ("gfx950", 65, 10, 0, 256, 7),  # 72 per wave -> 7
        ("gfx950", 128, 10, 0, 256, 4),
        ("gfx950", 129, 10, 0, 256, 3),  # 136 -> 3
        ("gfx950", 256, 10, 0, 256, 2),
        ("gfx950", 512, 10, 0, 256, 1),  # all arch VGPRs + AGPRs of the SIMD
        ("gfx950", 44, 101, 0, 256, 7),  # SGPRs beyond 100
        ("gfx950", 32, 10, 40960, 256, 4),  # 4 blocks x 4 waves over 4 SIMDs
        ("gfx942", 32, 10, 40960, 256, 1),
        ("gfx950", 32, 10, 30000, 64, 2),  # 5 one-wave blocks: the busiest SIMD holds 2
        ("gfx950", 32, 10, 163840, 256, 1),
        ("gfx942", 32, 10, 65537, 256, 0),  # does not fit
        ("gfx950", 128, 10, 0, 1024, 4),  # one 16-wave block: 4 per SIMD, as registers allow
        ("gfx950", 129, 10, 0, 1024, 0),  # 16 waves need 4 per SIMD, registers allow 3
    ],
)
def test_waves_per_simd_known_cases(arch, vgpr, sgpr, lds, threads, waves):
    assert aot.waves_per_simd(arch, vgpr=vgpr, sgpr=sgpr, lds_bytes=lds, block_threads=threads) == waves


def test_waves_per_simd_rejects_bad_arguments():
    with pytest.raises(ValueError, match="arch: expected one of .* got 'gfx90a'"):
        aot.waves_per_simd("gfx90a", vgpr=8, sgpr=8, lds_bytes=0, block_threads=64)
    with pytest.raises(ValueError, match="block_threads: expected >= 1, got 0"):
        aot.waves_per_simd("gfx950", vgpr=8, sgpr=8, lds_bytes=0, block_threads=0)


# --- budget and report -------------------------------------------------------------------

CLEAN = aot.KernelResources(
    symbol="k", arch="gfx950", vgpr=96, sgpr=40, agpr=0, lds_bytes=160 * 1024, scratch_bytes=0,
    vgpr_spills=0, sgpr_spills=0, waves_per_simd=1, dynamic_stack=False,
)


def test_check_budget_passes_a_clean_kernel_at_the_lds_limit():
    assert aot.check_budget([CLEAN, replace(CLEAN, arch="gfx942", lds_bytes=64 * 1024)]) == []


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(scratch_bytes=16), "k on gfx950: 16 bytes of scratch"),
        (dict(vgpr_spills=3), "k on gfx950: spills 3 VGPRs and 0 SGPRs"),
        (dict(sgpr_spills=1), "spills 0 VGPRs and 1 SGPRs"),
        (dict(lds_bytes=160 * 1024 + 4, waves_per_simd=0), "163844 bytes of LDS (budget 163840"),
        (dict(arch="gfx942", lds_bytes=64 * 1024 + 4, waves_per_simd=0), "k on gfx942: 65540 bytes of LDS (budget 65536"),
        (dict(dynamic_stack=True), "dynamic stack"),
        (dict(waves_per_simd=0), "does not fit on a CU"),
    ],
)
def test_check_budget_flags_each_violation(change, expected):
    problems = aot.check_budget([CLEAN, replace(CLEAN, **change)])
    assert len(problems) == 1
    assert expected in problems[0]


def test_format_report_has_one_aligned_line_per_row():
    rows = [CLEAN, replace(CLEAN, symbol="hipmla_decode_split_mxfp4_qbf16", arch="gfx942", vgpr_spills=2)]
    lines = aot.format_report(rows).splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:3] == ["symbol", "arch", "VGPR(+AGPR)"]
    assert lines[2].split() == ["hipmla_decode_split_mxfp4_qbf16", "gfx942", "96", "0", "40", "163840", "0", "2/0", "1"]
    assert len({len(line) for line in lines}) == 1  # right-aligned numbers end in one column


# --- building and reading real code objects -----------------------------------------------


@needs_clang
@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
@pytest.mark.parametrize("lds, threads", [(40960, 256), (30000, 64), (4096, 1024)])
def test_compile_and_read_resources_match_the_compiler(arch, lds, threads, tmp_path):
    source = lds_kernel("tiny", lds, threads)
    co = aot.compile_source(source, "tiny", arch, ["-DSCALE=2"], tmp_path)
    assert co.name.startswith(f"tiny-{arch}-") and co.suffix == ".co"
    assert co.read_bytes()[:4] == b"\x7fELF"
    r = aot.read_resources(co)
    assert (r.symbol, r.arch, r.lds_bytes, r.scratch_bytes, r.agpr) == ("tiny", arch, lds, 0, 0)
    assert 0 < r.vgpr <= 32 and r.sgpr > 0
    assert r.waves_per_simd == compiler_occupancy(source, arch, tmp_path)
    assert aot.check_budget([r]) == []


@needs_clang
@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_register_limited_occupancy_matches_the_compiler(arch, tmp_path):
    co = aot.compile_source(HEAVY_KERNEL, "heavy", arch, [], tmp_path)
    r = aot.read_resources(co)
    assert r.vgpr > 64  # really register-limited
    assert r.waves_per_simd == compiler_occupancy(HEAVY_KERNEL, arch, tmp_path) < 8


@needs_clang
@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_vgpr_count_already_includes_agprs(arch, tmp_path):
    co = aot.compile_source(AGPR_KERNEL, "agpr_user", arch, [], tmp_path)
    r = aot.read_resources(co, symbol="agpr_user")
    assert r.agpr == 3
    # Unified file: arch VGPRs rounded up to 4, then the AGPRs.
    assert r.vgpr % 4 == 3 and r.vgpr >= 4 + 3


@needs_clang
def test_dynamic_lds_counts_towards_the_budget(tmp_path):
    co = aot.compile_source(lds_kernel("tiny", 40960, 256), "tiny", "gfx942", ["-DSCALE=1"], tmp_path)
    assert aot.read_resources(co).waves_per_simd == 1
    r = aot.read_resources(co, block_threads=256, dynamic_lds_bytes=32768)
    assert r.lds_bytes == 40960 + 32768
    assert any("bytes of LDS" in p for p in aot.check_budget([r]))


@needs_clang
def test_scratch_is_reported_and_over_budget(tmp_path):
    co = aot.compile_source(SCRATCH_KERNEL, "uses_scratch", "gfx950", [], tmp_path)
    r = aot.read_resources(co)
    assert r.scratch_bytes >= 64 * 4
    assert any("bytes of scratch" in p for p in aot.check_budget([r]))


@needs_clang
def test_compile_error_carries_the_compiler_stderr(tmp_path):
    with pytest.raises(aot.CompileError) as err:
        aot.compile_source(PRELUDE + "extern \"C\" __global__ void bad() { undefined_thing(); }",
                           "bad", "gfx950", [], tmp_path)
    assert "undefined_thing" in err.value.stderr
    assert "bad for gfx950" in str(err.value)
    assert err.value.command[0] == aot.find_clang()
    assert not list(tmp_path.iterdir())  # no partial object left behind


@needs_clang
def test_compile_source_reuses_an_identical_build(tmp_path):
    source = lds_kernel("tiny", 4096, 256)
    first = aot.compile_source(source, "tiny", "gfx950", ["-DSCALE=1"], tmp_path)
    os.utime(first, (1, 1))
    assert aot.compile_source(source, "tiny", "gfx950", ["-DSCALE=1"], tmp_path) == first
    assert first.stat().st_mtime == 1  # not rebuilt
    other = aot.compile_source(source, "tiny", "gfx950", ["-DSCALE=3"], tmp_path)
    assert other != first


@needs_clang
def test_a_broken_object_is_rebuilt_and_never_found(monkeypatch, tmp_path):
    """An object emptied or overwritten since its build (a full disk, a copy gone wrong) is
    built again, and the runtime's lookup passes over it: hiprtc would load an empty blob."""
    source = lds_kernel("tiny", 4096, 256)
    co = aot.compile_source(source, "tiny", "gfx950", ["-DSCALE=1"], tmp_path)
    good = co.read_bytes()
    monkeypatch.setenv("HIPMLA_AOT_DIR", str(tmp_path))
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", tmp_path / "package-aot")
    for broken in (b"", b"not an object"):
        co.write_bytes(broken)
        assert aot.find_prebuilt(FakeSpec("tiny"), "gfx950", source, ["-DSCALE=1"]) is None
        assert aot.compile_source(source, "tiny", "gfx950", ["-DSCALE=1"], tmp_path) == co
        assert co.read_bytes()[:4] == b"\x7fELF" and len(co.read_bytes()) == len(good)


@needs_clang
def test_a_compiler_that_writes_nothing_is_a_compile_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HIPMLA_CLANG", "/bin/true")
    monkeypatch.setattr(aot.toolchain, "compiler_version", lambda clang: "true")
    with pytest.raises(aot.CompileError, match="clang exited 0 but wrote no code object"):
        aot.compile_source(lds_kernel("tiny", 4096, 256), "tiny", "gfx950", ["-DSCALE=1"], tmp_path)
    assert not list(tmp_path.iterdir())


def test_compile_source_rejects_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="arch: expected one of .* got 'sm_90'"):
        aot.compile_source("", "k", "sm_90", [], tmp_path)


# --- prebuilt lookup ----------------------------------------------------------------------


@dataclass(frozen=True)
class FakeSpec:
    symbol: str


@needs_clang
def test_find_prebuilt_only_for_the_identical_build(monkeypatch, tmp_path):
    aot_dir = tmp_path / "aot"
    monkeypatch.setenv("HIPMLA_AOT_DIR", str(aot_dir))
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", tmp_path / "package-aot")
    source = lds_kernel("tiny", 4096, 256)
    options = ["-DSCALE=2"]
    co = aot.compile_source(source, "tiny", "gfx950", options, aot_dir)
    spec = FakeSpec("tiny")

    assert aot.find_prebuilt(spec, "gfx950", source, options) == co.read_bytes()
    # Device arch strings carry target features; the featureless build serves them.
    assert aot.find_prebuilt(spec, "gfx950:sramecc+:xnack-", source, options) == co.read_bytes()

    assert aot.find_prebuilt(spec, "gfx950", source.replace("SCALE", "(SCALE + 1)"), options) is None
    assert aot.find_prebuilt(spec, "gfx950", source, ["-DSCALE=3"]) is None
    assert aot.find_prebuilt(spec, "gfx942", source, options) is None
    assert aot.find_prebuilt(spec, "sm_90", source, options) is None
    assert aot.find_prebuilt(FakeSpec("other"), "gfx950", source, options) is None

    monkeypatch.delenv("HIPMLA_AOT_DIR")
    assert aot.find_prebuilt(spec, "gfx950", source, options) is None
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", aot_dir)
    assert aot.find_prebuilt(spec, "gfx950", source, options) == co.read_bytes()


def test_find_prebuilt_ignores_the_compiler_but_not_the_key(monkeypatch, tmp_path):
    # Objects of two compilers for the same key are both valid; the newest is taken.
    monkeypatch.setenv("HIPMLA_AOT_DIR", str(tmp_path))
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", tmp_path / "none")
    key = aot.object_key("src", ["-DA=1"], "gfx942")
    old = tmp_path / f"k-gfx942-{key}-aaaaaaaaaaaaaaaa.co"
    new = tmp_path / f"k-gfx942-{key}-bbbbbbbbbbbbbbbb.co"
    old.write_bytes(b"\x7fELF old")
    new.write_bytes(b"\x7fELF new")
    os.utime(old, (1, 1))
    assert aot.find_prebuilt(FakeSpec("k"), "gfx942", "src", ["-DA=1"]) == b"\x7fELF new"
    assert aot.find_prebuilt(FakeSpec("k"), "gfx942", "src ", ["-DA=1"]) is None
    new.write_bytes(b"")  # the newest is empty: the older build serves
    assert aot.find_prebuilt(FakeSpec("k"), "gfx942", "src", ["-DA=1"]) == b"\x7fELF old"


# --- CLI -----------------------------------------------------------------------------------


def test_main_expands_out_and_names_it_when_it_cannot_write(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(aot.cli, "build_all", lambda archs, out_dir, jobs: calls.append(out_dir) or [CLEAN])
    assert aot.main(["--arch", "gfx950", "--out", "~/objs"]) == 0
    assert calls == [tmp_path / "objs"]  # as a shell would, not a folder named '~'
    capsys.readouterr()
    a_file = tmp_path / "a_file"
    a_file.write_text("")

    def cannot_write(archs, out_dir, jobs):
        raise FileExistsError(17, "File exists", str(out_dir))

    monkeypatch.setattr(aot.cli, "build_all", cannot_write)
    assert aot.main(["--arch", "gfx950", "--out", str(a_file)]) == 2
    assert f"hipmla build: --out {a_file}: File exists" in capsys.readouterr().err

    def tool_failed(archs, out_dir, jobs):
        raise RuntimeError("llvm-readelf --notes k.co exited 1: not a valid object file")

    monkeypatch.setattr(aot.cli, "build_all", tool_failed)
    assert aot.main(["--arch", "gfx950", "--out", str(tmp_path)]) == 2  # a message, not a traceback
    assert "hipmla build: llvm-readelf --notes k.co exited 1" in capsys.readouterr().err


def test_main_prints_the_report_and_fails_on_violations(monkeypatch, capsys, tmp_path):
    calls = []

    def fake_build_all(archs, out_dir, jobs):
        calls.append((archs, out_dir, jobs))
        return [CLEAN, replace(CLEAN, symbol="spiller", vgpr_spills=4)]

    monkeypatch.setattr(aot.cli, "build_all", fake_build_all)
    assert aot.main(["--arch", "gfx950, gfx942", "--out", str(tmp_path), "--jobs", "3"]) == 1
    assert calls == [(["gfx950", "gfx942"], tmp_path, 3)]
    out, err = capsys.readouterr()
    assert "spiller" in out and "k " in out
    assert "over budget: spiller on gfx950: spills 4 VGPRs" in err

    monkeypatch.setattr(aot.cli, "build_all", lambda archs, out_dir, jobs: [CLEAN])
    assert aot.main([]) == 0


def test_main_reports_build_failures(monkeypatch, capsys):
    def failing(archs, out_dir, jobs):
        raise aot.CompileError("1 of 2 builds failed", [], "k.hip:1:1: error: boom")

    monkeypatch.setattr(aot.cli, "build_all", failing)
    assert aot.main(["--arch", "gfx950"]) == 2
    assert "error: boom" in capsys.readouterr().err



# --- default output folder: the user cache ------------------------------------------------


def test_default_out_dir_is_the_user_cache_not_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert aot.default_aot_dir() == tmp_path / "xdg" / "hipmla" / "aot"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert aot.default_aot_dir() == tmp_path / "home" / ".cache" / "hipmla" / "aot"
    package = Path(aot.__file__).resolve().parent.parent  # hipmla/, of which aot is a part
    assert package not in aot.default_aot_dir().parents


def test_build_writes_to_the_user_cache_by_default(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(aot.cli, "build_all", lambda archs, out_dir, jobs: calls.append(out_dir) or [CLEAN])
    assert aot.main(["--arch", "gfx950"]) == 0
    assert calls == [tmp_path / "hipmla" / "aot"]
    assert f"code objects in {tmp_path / 'hipmla' / 'aot'}" in capsys.readouterr().out


def test_prebuilt_objects_are_found_in_the_default_out_dir(monkeypatch, tmp_path):
    # What `build` wrote without --out is found with no $HIPMLA_AOT_DIR; $HIPMLA_AOT_DIR
    # comes first, the package's own _aot last.
    monkeypatch.setattr(aot, "DEFAULT_AOT_DIR", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HIPMLA_AOT_DIR", raising=False)
    default = aot.default_aot_dir()
    default.mkdir(parents=True)
    key = aot.object_key("src", ["-DA=1"], "gfx950")
    (default / f"k-gfx950-{key}-aaaaaaaaaaaaaaaa.co").write_bytes(b"\x7fELF from the cache")
    assert aot.search_dirs() == [default, aot.PACKAGE_AOT_DIR]
    assert aot.find_prebuilt(FakeSpec("k"), "gfx950", "src", ["-DA=1"]) == b"\x7fELF from the cache"
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    (explicit / f"k-gfx950-{key}-bbbbbbbbbbbbbbbb.co").write_bytes(b"\x7fELF from HIPMLA_AOT_DIR")
    monkeypatch.setenv("HIPMLA_AOT_DIR", str(explicit))
    assert aot.search_dirs()[:2] == [explicit, default]
    assert aot.find_prebuilt(FakeSpec("k"), "gfx950", "src", ["-DA=1"]) == b"\x7fELF from HIPMLA_AOT_DIR"


def test_build_rejects_bad_arguments(capsys):
    for argv, name in ((["--jobs", "0"], "--jobs"), (["--jobs", "x"], "--jobs"), (["--arch", ","], "--arch"),
                       (["--arch", "gfx950,sm_90"], "--arch: .*'sm_90' is not one of them"),
                       (["--arch", "GFX950"], "--arch")):
        with pytest.raises(SystemExit) as e:
            aot.main(argv)
        assert e.value.code == 2 and re.search(f"argument {name}", capsys.readouterr().err)


def test_build_takes_each_target_once(monkeypatch, capsys, tmp_path):
    calls = []
    monkeypatch.setattr(aot.cli, "build_all", lambda archs, out_dir, jobs: calls.append(archs) or [CLEAN])
    assert aot.main(["--arch", "gfx942, gfx950,gfx942", "--out", str(tmp_path)]) == 0
    assert calls == [["gfx942", "gfx950"]]


# --- build_all ------------------------------------------------------------------------------


@needs_clang
def test_ctrl_c_stops_a_build_and_leaves_no_temporaries(tmp_path):
    """The queued compiles do not start after Ctrl-C, and neither this build's temporaries
    nor clang's own (it writes them to $TMPDIR) stay behind."""
    import signal
    import sys
    import time

    tmpdir, out = tmp_path / "tmp", tmp_path / "out"
    tmpdir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hipmla", "build", "--arch", "gfx950,gfx942", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmpdir)})
    deadline = time.monotonic() + 60
    while not (out.is_dir() and any(f.suffix == ".co" for f in out.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)  # under way: its first object is written
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    assert time.monotonic() - start < 5.0  # a full build of both targets takes ~10 s on 2 cores
    assert list(tmpdir.iterdir()) == []
    assert not out.exists() or all(f.suffix == ".co" for f in out.iterdir())


@dataclass(frozen=True)
class TinySpec:
    """Stands in for hipmla.kernels.KernelSpec; ``source`` is the whole translation unit."""

    symbol: str
    source: str
    block_threads: int = 256
    dynamic_shared_bytes: int = 0

    def options(self, arch: str) -> list[str]:
        return ["-DSCALE=2"] + (["-DON_GFX942=1"] if arch == "gfx942" else [])


@pytest.fixture
def fake_kernels(monkeypatch):
    """Makes build_all see the given specs, whose sources are their own TUs."""

    def install(specs):
        monkeypatch.setattr(aot.resources, "kernels_for_arch", lambda arch: list(specs))
        monkeypatch.setattr(aot.toolchain, "translation_unit", lambda source: source)

    return install


@needs_clang
def test_build_all_compiles_every_kernel_for_every_arch(fake_kernels, monkeypatch, tmp_path):
    specs = [
        TinySpec("tiny", lds_kernel("tiny", 40960, 256)),
        TinySpec("heavy", HEAVY_KERNEL, dynamic_shared_bytes=1024),
        TinySpec("uses_scratch", SCRATCH_KERNEL),
    ]
    fake_kernels(specs)
    rows = aot.build_all(["gfx950", "gfx942"], tmp_path, jobs=2)
    assert [(r.symbol, r.arch) for r in rows] == [
        (s.symbol, arch) for arch in ("gfx950", "gfx942") for s in specs
    ]
    assert rows[0].lds_bytes == 40960 and rows[1].lds_bytes == 1024
    assert len(list(tmp_path.glob("*.co"))) == 6
    # What the runtime asks for (translation unit + spec.options(arch)) finds these builds.
    monkeypatch.setenv("HIPMLA_AOT_DIR", str(tmp_path))
    for spec in specs:
        for arch in ("gfx950", "gfx942"):
            code = aot.find_prebuilt(spec, arch, spec.source, spec.options(arch))
            assert code is not None and code[:4] == b"\x7fELF"
    problems = aot.check_budget(rows)
    assert [p.split(":")[0] for p in problems] == ["uses_scratch on gfx950", "uses_scratch on gfx942"]


def test_build_all_rejects_bad_arguments(fake_kernels, tmp_path):
    fake_kernels([])
    with pytest.raises(ValueError, match="arch: expected one of"):
        aot.build_all(["gfx950", "gfx1200"], tmp_path)
    with pytest.raises(ValueError, match="archs: expected a non-empty list"):
        aot.build_all("gfx950", tmp_path)
    with pytest.raises(ValueError, match="jobs: expected an integer >= 1, got 0"):
        aot.build_all(["gfx950"], tmp_path, jobs=0)


@needs_clang
def test_build_all_reports_every_failure(fake_kernels, tmp_path):
    fake_kernels([
        TinySpec("broken_one", PRELUDE + 'extern "C" __global__ void broken_one() { nope_one(); }'),
        TinySpec("tiny", lds_kernel("tiny", 4096, 256)),
        TinySpec("broken_two", PRELUDE + 'extern "C" __global__ void broken_two() { nope_two(); }'),
    ])
    with pytest.raises(aot.CompileError, match="2 of 3 builds failed") as err:
        aot.build_all(["gfx950"], tmp_path)
    assert "nope_one" in err.value.stderr and "nope_two" in err.value.stderr


@pytest.fixture(scope="module")
def gfx950_rows(tmp_path_factory):
    kernels = pytest.importorskip("hipmla.kernels")
    if not _have_clang():
        pytest.skip("no clang that targets gfx950")
    return kernels, aot.build_all(["gfx950"], tmp_path_factory.mktemp("aot-gfx950"), jobs=2)


def test_all_project_kernels_build_for_gfx950_within_budget(gfx950_rows):
    kernels, rows = gfx950_rows
    assert sorted(r.symbol for r in rows) == sorted(s.symbol for s in kernels.kernels_for_arch("gfx950"))
    assert {"hipmla_decode_split_gfx950_mxfp4_qfp8", "hipmla_decode_split_gfx950_mxfp4_qmxfp4"} <= {r.symbol for r in rows}
    assert all(r.arch == "gfx950" and r.waves_per_simd >= 1 for r in rows)
    assert aot.check_budget(rows) == [], aot.format_report(rows)


# VGPR(+AGPR) ceilings of the masked fast kernels (clang-22): gfx950 qbf16 206, qfp8 249,
# qmxfp4 230, no AGPRs (were 235, 304 and 264: an address register per token, group and
# k-step until the LDS reads took immediate offsets from per-lane bases, and both groups'
# K at once while a branch skipped the last k-step's empty half; quantized Q now runs 2
# waves per SIMD); gfx942 (waves split the dimensions over a 3-stage LDS ring of 16-token
# tiles: 32 accumulators, 18 of Q and the copies' per-lane map a wave) bf16 178, fp8 146,
# mxfp4 162 (was 248 / 254 / 306 when each wave walked its own tokens with a 16 x 512
# accumulator and no KV through LDS). A ceiling a few registers above the figure catches
# what once cost 7 (an atomic); 256 is the 2-wave line, 168 the 3-wave one (mxfp4, whose
# 20 KiB of LDS let 3 blocks share a CU).
FAST_VGPR_CEILINGS = {
    "hipmla_decode_split_gfx950_mxfp4_qbf16": 209,
    "hipmla_decode_split_gfx950_mxfp4_qfp8": 252,
    "hipmla_decode_split_gfx950_mxfp4_qmxfp4": 233,
    "hipmla_decode_split_gfx942_bf16_qbf16": 182,
    "hipmla_decode_split_gfx942_fp8_qbf16": 150,
    "hipmla_decode_split_gfx942_mxfp4_qbf16": 168,
}
#: LDS per block of the gfx950 fast kernels, two blocks in a CU's 160 KiB each: quantized
#: Q has two buffers per wave; bf16 Q its resident 16 x 584 bf16 and one buffer per wave
#: (with two it took 97,536 B, one block per CU).
GFX950_LDS = {"qbf16": 58_112, "qfp8": 78_864, "qmxfp4": 78_864}


def test_gfx950_fast_kernels_hold_their_registers(gfx950_rows):
    _, rows = gfx950_rows
    fast = [r for r in rows if r.symbol in FAST_VGPR_CEILINGS]
    assert len(fast) == 3
    for r in fast:
        assert r.vgpr <= FAST_VGPR_CEILINGS[r.symbol], aot.format_report(fast)
        assert r.lds_bytes == GFX950_LDS[r.symbol.rsplit("_", 1)[1]], aot.format_report(fast)
    assert all(r.lds_bytes <= 80 * 1024 for r in fast)
    # two blocks per CU by LDS, and by registers: <= 256 VGPR(+AGPR), 2 waves per SIMD
    assert all(r.waves_per_simd == 2 for r in fast), aot.format_report(fast)


# --- instruction counts of the fast kernels (the model itself: tests/test_perfmodel.py) ---

DISASM = """
/tmp/k.co:\tfile format elf64-amdgpu

Disassembly of section .text:

0000000000001000 <kern>:
\ts_mov_b32 s0, 0                                          // 000000001000: BE800080
\tv_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3] // 000000001004: D3B50000 04021104
\tds_read_b128 v[4:7], v1                                  // 00000000100C: D9FE0000 04000001
\tv_exp_f32_e32 v2, v2                                     // 000000001014: 7E044102
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[0:3], v20, v21 op_sel_hi:[0,0,0] cbsz:4 blgp:4 // 000000001018: D3AC0000
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[0:3], v20, v21 op_sel_hi:[0,0,0] cbsz:4 // 000000001028: D3AC0000
\tglobal_load_lds_dwordx4 v[2:3], off                       // 000000001038: DDF88000
\ts_cbranch_scc1 65530                                      // 000000001040: BF85FFFA <kern+0x4>
\tv_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3] // 000000001044: D3B50000 04021104
\ts_endpgm                                                 // 000000001048: BF810000

0000000000001100 <other>:
\ts_endpgm                                                 // 000000001100: BF810000
"""


def test_main_loop_counts_one_trip_by_kind():
    ins = aot.parse_disassembly(DISASM, "kern")
    assert len(ins) == 10 and ins[0].address == 0x1000
    body = aot.main_loop(ins, "kern", 0x1000)
    assert [x.address for x in body][0] == 0x1004 and body[-1].mnemonic == "s_cbranch_scc1"
    c = aot.count_loop(body, "kern")
    # bf16 16 + fp4 x fp4 16 + fp8 x fp4 32 cycles; the MFMA after the loop is not counted
    assert (c.mfma, c.mfma_cycles) == (3, 64)
    assert (c.valu, c.transcendental) == (1, 1)
    assert (c.lds, c.global_loads, c.salu, c.total) == (1, 1, 1, 7)
    assert c.lds_bytes == 64 * 16 + 64 * 16  # one b128 read + one 1 KiB copy into LDS
    # the forms the loop rests on: objdump leaves cbsz / blgp out when 0 (e4m3)
    assert c.forms == (("v_mfma_f32_16x16x32_bf16", 1),
                       ("v_mfma_scale_f32_16x16x128_f8f6f4 (A e2m1, B e2m1)", 1),
                       ("v_mfma_scale_f32_16x16x128_f8f6f4 (A e2m1, B e4m3)", 1),
                       ("global_load_lds_dwordx4", 1))


def test_memory_waits_inside_the_math_are_counted():
    """A vmcnt wait between the loop's first and last MFMA is a wait inside the math; one
    before the first or after the last (the top of the next tile) is not, nor an LDS wait."""
    mfma = "v_mfma_f32_16x16x32_bf16"
    body = [aot.Instruction(4 * i, m, ops) for i, (m, ops) in enumerate([
        ("s_waitcnt", "vmcnt(0)"), (mfma, ""), ("s_waitcnt", "lgkmcnt(0)"), ("s_waitcnt", "vmcnt(1) lgkmcnt(0)"),
        (mfma, ""), ("s_waitcnt", "vmcnt(0)"), ("s_cbranch_scc1", "")])]
    assert aot.count_loop(body, "k").vm_waits_in_math == 1
    assert aot.count_loop(body[:3] + body[4:], "k").vm_waits_in_math == 0


def test_a_rotated_loop_is_counted_from_the_top_of_its_tile():
    """clang may rotate a loop so its backward branch lands mid-trip: the exit test then
    ends a trip, and a wait at the top of the next tile (between the previous tile's last
    MFMA and this one's first) is not a wait inside the math."""
    mfma = "v_mfma_f32_16x16x16_bf16"
    ops = [
        (mfma, ""),                                   # 0x0: the end of the last tile's P.V (backedge target)
        ("s_cbranch_scc1", "3 // <k+0x30>"),          # 0x4: the exit test, out of the loop
        ("s_waitcnt", "vmcnt(9)"),                    # 0x8: the top of the next tile
        ("s_barrier", ""),                            # 0xc
        (mfma, ""),                                   # 0x10: its Q.K
        ("s_waitcnt", "lgkmcnt(0)"),                  # 0x14
        (mfma, ""),                                   # 0x18
        ("s_cbranch_execz", "65528 // <k+0x0>"),      # 0x1c: backward
    ]
    body = [aot.Instruction(4 * i, m, o) for i, (m, o) in enumerate(ops)]
    loop = aot.main_loop(body, "k", 0)
    assert [x.address for x in loop] == [0x8, 0xc, 0x10, 0x14, 0x18, 0x1c, 0x0, 0x4]
    assert aot.count_loop(loop, "k").vm_waits_in_math == 0
    # the same wait inside the tile's math is counted
    inside = body[:5] + [aot.Instruction(0x14, "s_waitcnt", "vmcnt(2)")] + body[6:]
    assert aot.count_loop(aot.main_loop(inside, "k", 0), "k").vm_waits_in_math == 1


def test_disassembly_errors_name_the_symbol():
    with pytest.raises(ValueError, match="symbol: no function 'nope'"):
        aot.parse_disassembly(DISASM, "nope")
    with pytest.raises(ValueError, match="symbol: 'other' has no loop"):
        aot.main_loop(aot.parse_disassembly(DISASM, "other"), "other", 0x1100)


@pytest.fixture(scope="module")
def fast_counts(gfx950_rows, tmp_path_factory):
    kernels, rows = gfx950_rows
    out = {}
    for spec in kernels.fast_kernels("gfx950"):
        co = aot.compile_offline(spec, "gfx950", tmp_path_factory.mktemp("fast"))
        out[spec.symbol] = aot.loop_counts(co, spec.symbol)
    return out


def test_fast_kernel_loop_is_one_tile_of_mfmas(fast_counts):
    """Per wave and tile: Q.K = 2 score groups x 5 k-steps of the scaled MFMA (bf16 Q: x 18
    k-steps of the bf16 MFMA), P.V = 32 bf16 MFMAs; 9 KiB of KV by 9 LDS copies + 9 scale
    bytes + ... (11 loads in all)."""
    assert len(fast_counts) == 3
    for symbol, c in fast_counts.items():
        qk, qk_cycles = {"qbf16": (36, 16), "qfp8": (10, 32), "qmxfp4": (10, 16)}[symbol.rsplit("_", 1)[1]]
        assert c.mfma == qk + 32, (symbol, c)
        # the next tile's copies and scales are waited for at the top of the loop, never
        # inside this tile's MFMAs (issue 11, item 4)
        assert c.vm_waits_in_math == 0, (symbol, c)
        assert c.global_loads >= 9, (symbol, c)
        assert c.mfma_cycles == qk * qk_cycles + 32 * 16, (symbol, c)
        # bf16 Q, the default, rests only on forms the seed kernel ran on MI355X (issue 11,
        # item 1); MXFP8 Q on the fp4 x fp8 scaled MFMA, MXFP4 Q on the seed's fp4 x fp4
        forms = dict(c.forms)
        scaled = {"qbf16": None, "qfp8": "(A e2m1, B e4m3)", "qmxfp4": "(A e2m1, B e2m1)"}[symbol.rsplit("_", 1)[1]]
        expected = {"global_load_lds_dwordx4": 9, "v_mfma_f32_16x16x32_bf16": 32 + (36 if scaled is None else 0),
                    "v_cvt_scalef32_pk_bf16_fp4": 128 + (144 if scaled is None else 0)}
        if scaled is not None:
            expected[f"v_mfma_scale_f32_16x16x128_f8f6f4 {scaled}"] = 10
        assert forms == expected, (symbol, c.forms)


def test_report_prints_predictions_for_every_benchmark_shape(gfx950_rows, tmp_path):
    kernels, rows = gfx950_rows
    fast = [r for r in rows if r.symbol.startswith("hipmla_decode_split_gfx950_")]
    text = aot.fast_report(fast, tmp_path)
    assert text.count("PREDICTED MI355X") == 3 and "not measured" in text
    assert "predicted (calibrated) vs measured" in text  # the H200 calibration follows the counts
    for bs, n in perfmodel.BENCHMARK_SHAPES:
        assert f"{bs:>3}x{n:<5}" in text


# --- the gfx942 fast kernels and their report ------------------------------------------


@pytest.fixture(scope="module")
def gfx942_fast(tmp_path_factory):
    kernels = pytest.importorskip("hipmla.kernels")
    if not _have_clang():
        pytest.skip("no clang that targets gfx950")
    out = tmp_path_factory.mktemp("aot-gfx942")
    rows, counts = [], {}
    for spec in kernels.fast_kernels("gfx942"):
        co = aot.compile_offline(spec, "gfx942", out)
        rows.append(aot.read_resources(co, symbol=spec.symbol, block_threads=spec.block_threads))
        counts[spec.symbol] = aot.loop_counts(co, spec.symbol)
    return out, rows, counts


#: LDS per block of the gfx942 fast kernels (3 stages of 16 rows, 4 KiB of partial scores,
#: 640 B of P, alpha and l) and the waves per SIMD (= blocks per CU) that and the registers allow.
GFX942_FAST = {"bf16": (60_096, 1), "fp8": (32_448, 2), "mxfp4": (21_072, 3)}


def test_gfx942_fast_kernels_within_budget(gfx942_fast):
    """No scratch, no spills; LDS and registers give bf16 one block per CU (18 KiB stages),
    fp8 two and MXFP4 three."""
    _, rows, _ = gfx942_fast
    assert len(rows) == 3 and aot.check_budget(rows) == [], aot.format_report(rows)
    for r in rows:
        lds, waves = GFX942_FAST[r.symbol.split("_")[4]]
        assert r.arch == "gfx942" and (r.lds_bytes, r.waves_per_simd) == (lds, waves), aot.format_report(rows)
        assert r.vgpr <= FAST_VGPR_CEILINGS[r.symbol], aot.format_report(rows)


def test_gfx942_fast_loop_is_one_tile_of_bf16_mfmas(gfx942_fast):
    """Per wave and 16-token tile: 9 Q.K + 8 P.V bf16 MFMAs of 16 MI300X cycles; the loads
    of the tile two ahead -- one page-table read, the copies (18 / 9 / 5 of 256 B) and
    MXFP4's 2 scale bytes -- and no vector-memory wait between a tile's first MFMA and its
    last: the ring's waits sit at the top of the tile."""
    _, _, counts = gfx942_fast
    loads = {"bf16": 1 + 18, "fp8": 1 + 9, "mxfp4": 1 + 5 + 2}
    for symbol, c in counts.items():
        kv = symbol.split("_")[4]
        assert (c.mfma, c.mfma_cycles) == (17, 17 * 16), (symbol, c)
        assert c.global_loads == loads[kv] and c.vm_waits_in_math == 0, (symbol, c)
        converts = {"bf16": {}, "fp8": {"v_cvt_pk_f32_fp8": 34}, "mxfp4": {"v_cvt_pk_f32_fp8": 34}}[kv]
        assert dict(c.forms) == {"v_mfma_f32_16x16x16_bf16": 17, "global_load_lds_dword": loads[kv] - 1 - (kv == "mxfp4") * 2,
                                 **converts}, (symbol, c.forms)
        # the copies' LDS writes (4 bytes a lane) are counted with the reads
        assert c.lds_bytes >= (loads[kv] - 1 - (2 if kv == "mxfp4" else 0)) * 256, (symbol, c)
    # converting the cache costs VALU in the order bf16 < fp8 < mxfp4
    by_kv = {kv: next(c.valu for s, c in counts.items() if f"_{kv}_" in s) for kv in ("bf16", "fp8", "mxfp4")}
    assert by_kv["bf16"] < by_kv["fp8"] < by_kv["mxfp4"], by_kv


def test_report_predicts_mi300x_for_gfx942(gfx942_fast):
    out, rows, _ = gfx942_fast
    text = aot.fast_report(rows, out)
    assert text.count("PREDICTED MI300X") == 3 and "MI355X" not in text
    for bs, n in perfmodel.BENCHMARK_SHAPES:
        assert f"{bs:>3}x{n:<5}" in text
    # each kernel's instruction forms under its counts
    assert text.count("    forms: ") == 3 and "v_mfma_f32_16x16x16_bf16 x17" in text


def test_fast_kernel_models_build_only_the_fast_kernels(gfx942_fast):
    """``python -m hipmla model``'s path: the fast kernels alone (found already built here,
    so no object appears), each modelled on the arch's device."""
    out, rows, counts = gfx942_fast
    before = sorted(out.glob("*.co"))
    models = aot.fast_kernel_models(["gfx942"], out)
    assert sorted(out.glob("*.co")) == before
    assert [m.kv_format for m in models] == ["bf16", "fp8", "mxfp4"]
    assert [m.name for m in models] == [r.symbol for r in rows]
    for m, r in zip(models, rows):
        assert m.device is perfmodel.MI300X and m.tile_tokens == 16
        assert m.blocks_per_cu == r.waves_per_simd  # 4 waves a block on 4 SIMDs
        assert m.tile_issue_cycles == perfmodel.amd_tile_cycles(counts[m.name])
