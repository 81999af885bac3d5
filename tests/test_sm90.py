"""The sm_90 tensor-core split kernel (hip_src/decode/split_sm90.hip).

CPU: every cache format compiles for sm_90 exactly as the GPU run compiles it (hiprtc ->
hipmla's HIP-on-CUDA library -> NVRTC), the cubin has the symbol and no local memory;
with the CUDA toolkit present, ptxas reports no stack or spills, and the kernel's
``sizeof(Smem)`` equals the dynamic shared memory its KernelSpec asks for. The emulator
schedule it follows (one softmax state, 32-token tiles) is checked against exact math, and
every variant of scripts/sm90_ablation.py still applies to the sources.
GPU (``gpu``): the kernel alone against that emulator for ragged paged batches in all
formats (scripts/sm90_trial.py has the runner).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from hipmla import kernels, nvidia
from hipmla.inputs import spread_sample
from hipmla.emulate import Q_PRECISIONS, SM90_TILE_TOKENS, emulate_decode, emulate_work_item, quantize_q
from hipmla.formats import KV_FORMATS
from hipmla.inputs import make_inputs, random_cache
from hipmla.paging import random_page_table
from hipmla.reference import mla_decode_reference
from hipmla.schedule import SplitPolicy

REPO = Path(__file__).resolve().parent.parent
SPECS = [kernels.sm90_split_kernel(kv, qp) for kv in KV_FORMATS for qp in Q_PRECISIONS]


def _ids(spec):
    return spec.symbol


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("q_precision", Q_PRECISIONS)
def test_spec(kv_format, q_precision):
    spec = kernels.sm90_split_kernel(kv_format, q_precision)
    assert spec.symbol == f"hipmla_decode_split_sm90_{kv_format}_q{q_precision}"
    assert spec.source == "decode/split_sm90.hip" and spec.archs == ("sm_90",)
    assert spec.tile_tokens == 0 and spec.block_threads == 256
    assert spec.builds_for("sm_90") and not spec.builds_for("gfx950")
    assert f"-DHIPMLA_Q_PRECISION={'bf16 fp8 mxfp4'.split().index(q_precision)}" in spec.options("sm_90")
    assert spec.products == ("f16" if kv_format == "fp8" else "bf16")
    assert kernels.decoder_kernel("sm_90", kv_format, q_precision) == spec
    assert "-DHIPMLA_FP8_FNUZ=0" in spec.options("sm_90")
    # two blocks per SM: 2 x (dynamic + 1 KiB reserved per block) within an H100/H200 SM's 228 KiB
    assert 2 * (spec.dynamic_shared_bytes + 1024) <= 228 * 1024


def test_not_wired_into_the_fast_path():
    assert "sm_90" not in kernels.FAST_VARIANTS
    assert kernels.fast_split_kernel("sm_90", "mxfp4", "bf16") is None


def test_bad_format_names_itself():
    with pytest.raises(ValueError, match="kv_format"):
        kernels.sm90_split_kernel("int4")
    with pytest.raises(ValueError, match="q_precision"):
        kernels.sm90_split_kernel("mxfp4", "e5m2")


# ----------------------------------------------------------------------------- NVRTC via the shim

def _nvrtc_available() -> bool:
    return nvidia.find_nvrtc() is not None


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="no NVRTC library found")

#: Everything the decoder runs on sm_90: the tensor-core kernel for every cache format and
#: Q precision, and the portable kernel it falls back to when a self-test fails (one build
#: per cache format is enough to catch a compile error).
BUILDS = [("sm90_split_kernel", (kv, qp)) for kv in KV_FORMATS for qp in Q_PRECISIONS] + \
    [("split_kernel", (kv, qp)) for kv, qp in (("bf16", "fp8"), ("fp8", "mxfp4"), ("mxfp4", "fp8"))] + \
    [("sm90_rows64_kernel", (kv,)) for kv in kernels.ROWS64_FORMATS]

COMPILE_SCRIPT = """
import importlib.util
import json
from hip import hiprtc
from hipmla import kernels
from hipmla.kernels import translation_unit


def build(source, symbol, flags):
    status, prog = hiprtc.hiprtcCreateProgram(source.encode(), symbol.encode(), 0, [], [])
    (status,) = hiprtc.hiprtcCompileProgram(prog, len(flags), [f.encode() for f in flags])
    _, log_size = hiprtc.hiprtcGetProgramLogSize(prog)
    log = bytearray(log_size)
    hiprtc.hiprtcGetProgramLog(prog, log)
    code = b""
    if int(status) == 0:
        _, size = hiprtc.hiprtcGetCodeSize(prog)
        buffer = bytearray(size)
        hiprtc.hiprtcGetCode(prog, buffer)
        code = bytes(buffer)
    hiprtc.hiprtcDestroyProgram(prog.createRef())
    return code, {"ok": int(status) == 0, "elf": code[:4] == b"\\x7fELF", "has": symbol.encode() in code,
                  "local": b".nv.local." in code, "log": log.rstrip(b"\\0").decode()[-3000:]}


out = {}
for factory, args in BUILDS:
    spec = getattr(kernels, factory)(*args)
    flags = [f"--offload-arch={spec.compile_arch('sm_90')}", "-O3", *spec.options("sm_90")]  # as runtime.load_kernel
    code, r = build(translation_unit(spec.source), spec.symbol, flags)
    path = OUT + "/" + spec.symbol + ".cubin"
    open(path, "wb").write(code)
    out[spec.symbol] = {**r, "path": path}
# scripts/sm90_wgmma_probe.cu (wgmma needs sm_90a): the script's default build and its option.
spec_ = importlib.util.spec_from_file_location("wgmma_probe", REPO + "/scripts/sm90_wgmma_probe.py")
probe = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(probe)
source = probe.probe_source()
for variant, defines in (("", []), (" rolled", ["-DPROBE_ROLLED=1"])):
    _, r = build(source, probe.SYMBOL, ["--offload-arch=sm_90a", "-O3", *defines])
    out[probe.SYMBOL + variant] = {**r, "path": "", "shared": probe.SHARED}
# scripts/sm90_mma_rate.cu: every tensor instruction, and every extra-instruction kind beside one.
spec_ = importlib.util.spec_from_file_location("mma_rate", REPO + "/scripts/sm90_mma_rate.py")
rate = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(rate)
source = rate.source()
for op in rate.OPS:
    for kind in range(len(rate.KINDS)) if op == 0 else (0,):
        _, r = build(source, rate.SYMBOL, ["--offload-arch=sm_90a", "-O3", f"-DRATE_OP={op}", "-DRATE_ALU=2",
                                           f"-DRATE_ALU_KIND={kind}", "-DRATE_ALU2=1", "-DRATE_ALU_KIND2=3"])
        out[f"{rate.SYMBOL} {op} {kind}"] = {**r, "path": ""}
# scripts/sm90_cluster_probe.cu: every mode of the split row's hand-off (none, core/merge.h's,
# through a cluster's shared memory, core/merge.h's in clusters) for small, portable and largest clusters.
spec_ = importlib.util.spec_from_file_location("cluster_probe", REPO + "/scripts/sm90_cluster_probe.py")
cluster = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(cluster)
source = cluster.probe_source()
for mode in cluster.MODES:
    for items in (2, 8, 16):
        _, r = build(source, cluster.SYMBOL, ["--offload-arch=sm_90", "-O3", *cluster.build_options(mode, items)])
        out[f"{cluster.SYMBOL} {mode} {items}"] = {**r, "path": ""}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def nvrtc_builds(tmp_path_factory) -> dict:
    if not _nvrtc_available():
        pytest.skip("no NVRTC library found")
    import json

    shim = nvidia.build_shim(tmp_path_factory.mktemp("shim"))
    out_dir = tmp_path_factory.mktemp("cubins")
    env = {**os.environ, **nvidia.shim_env(shim), "HIPMLA_LIBCUDA": "/nonexistent/libcuda.so.1"}
    done = subprocess.run([sys.executable, "-c", f"OUT = {str(out_dir)!r}\nREPO = {str(REPO)!r}\nBUILDS = {BUILDS!r}\n"
                           + COMPILE_SCRIPT],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, f"child failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_nvrtc
def test_portable_kernels_compile_for_sm_90_through_hiprtc(nvrtc_builds):
    """The portable kernel (schedule, paged rows, guard and in-kernel merge included) builds
    for sm_90 exactly as the GPU run builds it."""
    for factory, args in BUILDS:
        if factory == "split_kernel":
            symbol = kernels.split_kernel(*args).symbol
            r = nvrtc_builds[symbol]
            assert r["ok"], f"{symbol}:\n{r['log']}"
            assert r["elf"] and r["has"], symbol


@needs_nvrtc
def test_rows64_kernel_compiles_for_sm_90a_through_hiprtc(nvrtc_builds):
    """The 64-head kernel (split_sm90_rows64.hip) builds as the decoder builds it for each
    cache it reads: hiprtc -> the HIP-on-CUDA library -> NVRTC for sm_90a (wgmma), no local
    memory."""
    for kv_format in kernels.ROWS64_FORMATS:
        symbol = kernels.sm90_rows64_kernel(kv_format).symbol
        r = nvrtc_builds[symbol]
        assert r["ok"] and r["elf"] and r["has"], f"{symbol}:\n{r['log']}"
        assert not r["local"], f"{symbol}: the cubin has local memory"


@needs_nvrtc
def test_wgmma_probe_compiles_for_sm_90a(nvrtc_builds):
    """scripts/sm90_wgmma_probe.cu (the token-split wgmma design's hot loop, timed on the
    H200 by its script) builds for sm_90a through the same hiprtc -> NVRTC path, with no
    local memory: the probe behind the notes' figures keeps compiling as hip_src moves."""
    for variant in ("", " rolled"):  # the default build and PROBE_ROLLED=1
        r = nvrtc_builds["hipmla_probe_wgmma_mxfp4" + variant]
        assert r["ok"] and r["elf"] and r["has"], r["log"]
        assert not r["local"], f"the probe{variant} spills to local memory"
    # The script launches with the shared memory the kernel's static_assert holds it to
    # (with less the kernel traps; the first H200 run, with less, faulted).
    text = (REPO / "scripts" / "sm90_wgmma_probe.cu").read_text()
    assert f"static_assert(sizeof(Smem) == {r['shared']}," in text


@needs_nvrtc
def test_mma_rate_probe_compiles_for_sm_90a(nvrtc_builds):
    """scripts/sm90_mma_rate.cu (the issue cycles behind sm90_counts.py's cost model) builds
    for every tensor instruction and every extra-instruction kind, without local memory."""
    names = [name for name in nvrtc_builds if name.startswith("hipmla_probe_mma_rate ")]
    assert len(names) == 4 + len(_script("sm90_mma_rate").KINDS)  # ops 1..4 with lop3, op 0 with each kind
    for name in names:
        r = nvrtc_builds[name]
        assert r["ok"] and r["elf"] and r["has"], f"{name}:\n{r['log']}"
        assert not r["local"], name


@needs_nvrtc
def test_cluster_probe_compiles_for_sm_90(nvrtc_builds):
    """scripts/sm90_cluster_probe.cu (a split row's hand-off through a thread-block cluster,
    for the H200) builds in every mode for clusters of 2 to 16 blocks,
    with the library's merge (core/merge.h) inlined and no local memory."""
    names = [name for name in nvrtc_builds if name.startswith("hipmla_probe_cluster ")]
    assert len(names) == len(_script("sm90_cluster_probe").MODES) * 3
    for name in names:
        r = nvrtc_builds[name]
        assert r["ok"] and r["elf"] and r["has"], f"{name}:\n{r['log']}"
        assert not r["local"], f"{name} spills to local memory"


@needs_nvrtc
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_compiles_for_sm_90_through_hiprtc(nvrtc_builds, spec):
    r = nvrtc_builds[spec.symbol]
    assert r["ok"], f"{spec.symbol}:\n{r['log']}"
    assert r["elf"] and r["has"], spec.symbol
    assert not r["local"], f"{spec.symbol}: the cubin has local memory (spills or a stack array)"


@needs_nvrtc
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_resources_of_the_nvrtc_cubin(nvrtc_builds, spec):
    """Two blocks of 8 warps per SM: <= 128 registers, no stack, no local memory."""
    tool = nvidia.find_cuda_tool("cuobjdump")
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    usage = subprocess.run([tool, "-res-usage", nvrtc_builds[spec.symbol]["path"]], capture_output=True,
                           text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert m, usage
    reg, stack, local = map(int, m.groups())
    assert reg <= 128 and stack == 0 and local == 0, usage


def _nvcc() -> str | None:
    return shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc")
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_ptxas_no_spills_and_shared_size_matches(spec, tmp_path):
    tu = tmp_path / "k.cu"
    tu.write_text(kernels.translation_unit(spec.source))
    defines = spec.options("sm_90")
    done = subprocess.run([_nvcc(), "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", *defines, "-x", "cu", str(tu),
                           "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in done.stderr, done.stderr
    regs = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    assert regs <= 128
    host = tmp_path / "size.cu"
    host.write_text(tu.read_text() + '\n#include <cstdio>\nint main() { std::printf("%zu\\n", '
                    "sizeof(hipmla::sm90k::Smem)); return 0; }\n")
    exe = tmp_path / "size"
    done = subprocess.run([_nvcc(), "-arch=sm_90", *defines, "-x", "cu", str(host), "-o", str(exe)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert int(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout) == \
        spec.dynamic_shared_bytes


def test_source_rejects_other_specialisations(tmp_path):
    source = kernels.translation_unit("decode/split_sm90.hip")
    assert "#error" in source and "HIPMLA_FP8_FNUZ=0" in source and "HIPMLA_Q_PRECISION must be" in source


# ----------------------------------------------------------------------------- the emulated schedule


def test_tile_is_the_kernels():
    text = (REPO / "hip_src" / "decode" / "split_sm90.hip").read_text()
    assert re.search(r"constexpr int TILE = (\d+);", text).group(1) == str(SM90_TILE_TOKENS)


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_sm90_schedule_close_to_exact_attention(kv_format):
    """emulate_decode with 32-token tiles (the kernel's one softmax state) stays within the
    project's reference tolerance for ragged lengths around the tile edges."""
    lens = np.array([0, 1, 31, 32, 33, 64, 200, 1000])
    inputs = make_inputs(lens, kv_format, seed=5, sm_scale=1 / 24)
    policy = SplitPolicy.for_device(4)
    out, lse = emulate_decode(inputs.q, inputs.kv, inputs.layout, 1 / 24, policy, tile_tokens=SM90_TILE_TOKENS)
    ref_out, ref_lse = mla_decode_reference(inputs.q, inputs.kv, inputs.layout, 1 / 24)
    err = np.abs(np.asarray(out, np.float32) - ref_out)
    assert (err <= 2e-2 * (1 + np.abs(ref_out))).all()
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~fin).all()
    assert np.abs(lse[fin] - ref_lse[fin]).max() < 1e-2


def test_one_tile_items_do_not_depend_on_the_tile_size():
    rng = np.random.default_rng(1)
    q = quantize_q(rng.standard_normal((16, 576)).astype(ml_dtypes.bfloat16).astype(np.float32), "bf16")
    k = rng.standard_normal((32, 576)).astype(np.float32)
    a = emulate_work_item(q, k, np.float32(0.06), tile=SM90_TILE_TOKENS)
    b = emulate_work_item(q, k, np.float32(0.06), tile=64)
    assert np.array_equal(a.acc, b.acc) and np.array_equal(a.m, b.m) and np.array_equal(a.l, b.l)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SYNTHETIC_SASS = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/              @P0  BRA 0x60 ;
        /*0030*/                   FMUL R4, R4, R2 ;
        /*0040*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;
        /*0050*/                   FMUL R5, R5, R2 ;
        /*0060*/                   MOVM.16.MT88 R6, R7 ;
        /*0070*/                   HMMA.16816.F32.BF16 R4, R8, R6, R4 ;
        /*0080*/              @!P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_sm90_counts_finds_the_tile_loop_and_its_skipped_blocks():
    """scripts/sm90_counts.py on a hand-made disassembly: the loop is the backward branch
    around the HMMAs; a forward-branched block is only counted as skipped when it is one
    of the named steady-state blocks (this one, 3 instructions, is not)."""
    counts = _script("sm90_counts")
    body = counts.tile_loop(counts.parse(SYNTHETIC_SASS, "k"))
    assert [i.address for i in body] == list(range(0x10, 0x90, 0x10))
    c = counts.count(SYNTHETIC_SASS, "k")
    assert c.loop == 8 and c.skipped == {} and c.straight == 8 and c.per_token == 8 * 8 / 32
    assert c.mix["HMMA.16816.F32.BF16"] == 2 and c.mix["MOVM.16.MT88"] == 1
    with pytest.raises(ValueError, match="not in the disassembly"):
        counts.parse(SYNTHETIC_SASS, "other")


SYNTHETIC_ROWS64_SASS = """
        Function : r
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   FADD R4, R4, R2 ;
        /*0030*/              @!P1 BRA 0x10 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/                   FADD R4, R4, R2 ;
        /*0070*/                   LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT ;
        /*0080*/              @!P1 BRA 0x50 ;
        /*0090*/                   EXIT ;
"""


def test_sm90_counts_finds_the_64_row_kernels_two_loops():
    """--rows64: each warpgroup of the 64-row kernel has a tile loop of its own (the
    backward branches around the HGMMAs), and a token costs both loops' straight paths x
    4 warps / 64 tokens; the 16-head kernel's count finds no HMMA loop there."""
    counts = _script("sm90_counts")
    loops = counts.count_rows64(SYNTHETIC_ROWS64_SASS, "r")
    assert [c.loop for c in loops] == [3, 4] and all(c.mix["HGMMA.64x64x16.F32.BF16"] == 1 for c in loops)
    assert counts.rows64_per_token(loops) == pytest.approx((3 + 4) * 4 / 64)
    with pytest.raises(ValueError, match="no loop with an HMMA"):
        counts.count(SYNTHETIC_ROWS64_SASS, "r")
    with pytest.raises(SystemExit, match="--rows64: the 64-row kernel reads fp8, mxfp4, not bf16"):
        counts.main(["--rows64", "--formats", "bf16"])
    with pytest.raises(SystemExit, match="no price for HGMMA"):
        counts.main(["--rows64", "--cost"])


def test_sm90_counts_cost_model_prices_each_kind():
    """--cost: the loop above is 2 HMMA.16816 + 1 MOVM (tensor), 2 FMUL (fma), 1 SHFL and
    2 BRA (one issue cycle each, "other"), priced with ISSUE_CYCLES; the byte budget of a
    tile scales with the bytes a token reads."""
    counts = _script("sm90_counts")
    by = counts.issue_cycles(counts.count(SYNTHETIC_SASS, "k").mix)
    price = {prefix: cost for prefix, cost, _ in counts.ISSUE_CYCLES}
    assert by["tensor"] == pytest.approx(2 * price["HMMA.16816"] + price["MOVM"])
    assert by["fma"] == pytest.approx(2 * price["FMUL"]) and by["mufu/shfl"] == pytest.approx(price["SHFL"])
    assert by["other"] == 2.0 and set(by) == {"tensor", "fma", "mufu/shfl", "other"}
    assert counts.byte_cycles("bf16") == pytest.approx(2 * counts.byte_cycles("fp8"))
    assert counts.byte_cycles("mxfp4") / counts.byte_cycles("fp8") == pytest.approx(306 / 576)
    # Shared memory: none in that loop; 16-, 8- and 4-byte accesses are 4, 2 and 1 wavefronts.
    assert counts.smem_wavefronts(counts.count(SYNTHETIC_SASS, "k").mix) == 0
    mix = counts.Counter({"LDS.128": 2, "STS.64": 1, "LDSM.16.MT88.4": 1, "LDS.U8": 3, "LDGSTS.E.BYPASS.128": 1})
    assert counts.smem_wavefronts(mix) == 2 * 4 + 2 + 4 + 3 + 4
    assert counts.smem_share(mix, 84.0) == pytest.approx(16 * 21 / (4 * 84.0))


@pytest.mark.skipif(nvidia.find_cuda_tool("nvcc") is None or nvidia.find_cuda_tool("cuobjdump") is None,
                    reason="no nvcc / cuobjdump")
def test_sm90_counts_of_the_mxfp4_kernel(tmp_path):
    """The real tile loop: per warp and 32-token tile 36 mma (16 + 4 for Q.K, 16 for P.V)
    and 32 movmatrix on the straight path, and the three blocks a steady tile skips."""
    counts = _script("sm90_counts")
    symbol, sass = counts.compile_sass("mxfp4", None, tmp_path)
    c = counts.count(sass, symbol)
    assert c.mix["HMMA.16816.F32.BF16"] == 32 and c.mix["HMMA.1688.F32.BF16"] == 4 and c.mix["MOVM.16.MT88"] == 32
    assert set(c.skipped) == {"O rescale", "max chain", "page-table read"} and c.skipped["O rescale"] >= 32
    assert c.straight < c.loop and c.per_token == c.straight * 8 / 32


@pytest.mark.skipif(nvidia.find_cuda_tool("nvcc") is None or nvidia.find_cuda_tool("cuobjdump") is None,
                    reason="no nvcc / cuobjdump")
def test_sm90_counts_of_the_fp8_kernel(tmp_path):
    """The fp8 cache's tile loop converts its e4m3 codes with the hardware (one F2FP a word:
    32 latent + 4 rope) into f16 tensor-core products; no bf16 product and no hand-placed
    bits (the bf16 path took 359 instructions a warp and tile, 2026-12-03)."""
    counts = _script("sm90_counts")
    symbol, sass = counts.compile_sass("fp8", None, tmp_path)
    c = counts.count(sass, symbol)
    assert c.mix["F2FP.F16.E4M3.UNPACK_B"] == 36
    assert c.mix["HMMA.16816.F32"] == 32 and c.mix["HMMA.1688.F32"] == 4 and c.mix["MOVM.16.MT88"] == 32
    assert not any(op.startswith(("HMMA.16816.F32.BF16", "HMUL2", "HFMA2")) for op in c.mix)
    assert c.straight <= 260, c.straight


@pytest.mark.skipif(nvidia.find_cuda_tool("nvcc") is None or nvidia.find_cuda_tool("cuobjdump") is None,
                    reason="no nvcc / cuobjdump")
@pytest.mark.parametrize("kv_format", ["bf16", "mxfp4"])
def test_partial_slots_leave_in_16_byte_stores(kv_format, tmp_path):
    """The item's partial (16 heads x 512 f32) leaves in 8 16-byte stores a thread, the bf16
    output in 8-byte ones: written through reinterpret_cast pointers NVVM had split them
    into 4-byte stores (4x the instructions, each writing part of every sector)."""
    counts = _script("sm90_counts")
    _, sass = counts.compile_sass(kv_format, None, tmp_path)
    stores = re.findall(r"\b(STG\.E(?:\.\d+)?)(?:\.STRONG\.GPU)?\s+desc", sass)
    assert stores.count("STG.E.128") >= 8, stores
    assert stores.count("STG.E") <= 8, stores  # the scalars: (m, l), the LSE, the merge's LSE


# The SASS opcode each extra-instruction kind of scripts/sm90_mma_rate.cu must become.
RATE_OPCODES = {"lop3": "LOP3", "hfma2": "HFMA2", "shr": "SHF", "imad": "IMAD", "movmatrix": "MOVM", "ffma": "FFMA",
                "prmt": "PRMT", "fadd": "FADD", "lds.128": "LDS.128", "ldsm.x4.t+lop3": "LDSM.16.MT88.4",
                "sts.128": "STS.128", "ex2": "MUFU.EX2", "lds.64": "LDS.64", "lds.32": "LDS", "sts.64": "STS.64",
                "shfl": "SHFL"}


@pytest.mark.skipif(nvidia.find_cuda_tool("nvcc") is None or nvidia.find_cuda_tool("cuobjdump") is None,
                    reason="no nvcc / cuobjdump")
def test_mma_rate_probe_issues_what_it_times(tmp_path):
    """ptxas keeps every instruction the rate probe times: with 8 extra instructions of a
    kind after each of 4 chains, the loop holds at least 32 of that kind's opcode (an
    idempotent lop3 or a dead load it could drop would make the probe time nothing)."""
    rate, counts = _script("sm90_mma_rate"), _script("sm90_counts")
    tu = tmp_path / "rate.cu"
    tu.write_text(rate.source())
    nvcc, cuobjdump = nvidia.find_cuda_tool("nvcc"), nvidia.find_cuda_tool("cuobjdump")
    assert set(RATE_OPCODES) == set(rate.KINDS)
    for kind, name in enumerate(rate.KINDS):
        cubin = tmp_path / f"k{kind}.cubin"
        subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-O3", "-DRATE_OP=4", "-DRATE_CHAINS=4", "-DRATE_ALU=8",
                        f"-DRATE_ALU_KIND={kind}", "-x", "cu", str(tu), "-o", str(cubin)], check=True, capture_output=True)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
        ops = [ins.opcode for ins in counts.parse(sass, rate.SYMBOL)]
        want = RATE_OPCODES[name]
        n = sum(op == want or op.startswith(want + ".") for op in ops)
        assert n >= 32, f"{name}: {n} {want} in the probe"


def test_every_ablation_variant_still_applies(tmp_path):
    """scripts/sm90_ablation.py edits copies of hip_src by exact text; an edit that no
    longer matches exactly once would only show on the H200. Every variant applies here."""
    ablation = _script("sm90_ablation")
    for k, (name, parts) in enumerate(ablation.VARIANTS.items()):
        root = tmp_path / f"v{k}"
        shutil.copytree(kernels.hip_src_dir(), root)
        ablation.edited_source(root, parts)
        changed = [f for f in root.rglob("*") if f.is_file() and
                   f.read_bytes() != (kernels.hip_src_dir() / f.relative_to(root)).read_bytes()]
        assert bool(changed) == bool(parts), name


def test_ablation_refuses_variants_for_the_64_row_kernel():
    """The variants edit decode/split_sm90.hip, which --heads 64 with an fp8 / MXFP4 cache
    does not run: asking for them there is an error before any device is touched, not a
    table of unedited builds."""
    ablation = _script("sm90_ablation")
    with pytest.raises(SystemExit, match="--heads 64: the 64-row kernel has no variants"):
        ablation.main(["--heads", "64", "--formats", "mxfp4"])
    with pytest.raises(SystemExit, match="--heads 128"):
        ablation.main(["--heads", "128", "--formats", "bf16,fp8", "--variants", "full,-merge"])


def test_timeline_edits_apply_and_its_summary_reads_the_stamps(tmp_path):
    """scripts/sm90_timeline.py inserts time stamps by exact text, like the ablations: each
    insertion applies once here, and its summary turns block records into phase times."""
    import numpy as np

    timeline = _script("sm90_timeline")
    root = tmp_path / "t"
    timeline.edited_tree(kernels.hip_src_dir(), root)
    kernel = (root / timeline.KERNEL).read_text()
    assert kernel.count("HIPMLA_STAMP(") == 1 + 7  # the macro, then stamps 0..6
    assert (root / timeline.SCHEDULE_FILE).read_text().count("HIPMLA_SCHED_STAMP(") == 1 + len(timeline.SCHEDULE)
    assert (root / timeline.MERGE_FILE).read_text().count("HIPMLA_MERGE_STAMP(") == 1 + 2
    # Two blocks with an item (the second merges), one empty block; ns since some epoch.
    rec = np.zeros((3, timeline.WORDS), np.uint64)
    t0 = 10_000
    rec[0, :7] = [t0, t0 + 3000, t0 + 4000, t0 + 9000, t0 + 10000, t0 + 11000, t0 + 11000]
    rec[1, :7] = [t0 + 100, t0 + 3100, t0 + 4100, t0 + 9100, t0 + 10100, t0 + 11100, t0 + 15100]
    rec[:2, 7], rec[:2, 8], rec[:2, 9], rec[1, 10] = 0, 128, 2, 1
    rec[2, 7] = np.uint64(2**64 - 1)  # seq -1
    rec[2, :2] = [t0 + 50, t0 + 2550]
    # scan 1, counts, scan 2, found, search, pages: after each block's own start
    rec[0, timeline.SCHED:] = [t0 + 1000, t0 + 1500, t0 + 2000, t0 + 2300, t0 + 2800, t0 + 3000]
    rec[1, timeline.SCHED:] = [t0 + 1100, t0 + 1600, t0 + 2100, t0 + 2400, t0 + 2900, t0 + 3100]
    text = timeline.summarize(rec, 20.0)
    assert "blocks 3 (2 with an item, 1 merged)" in text
    assert "schedule +3.00" in text and "tiles +5.00" in text
    assert "merge +4.00" in text and "end 15.1 us" in text
    assert "empty blocks: schedule done at median 2.5 us" in text
    assert "scan 1 1.00, counts 1.50, scan 2 2.00, found 2.30, search 2.80, pages 3.00" in text
    # a split row of 2: one block merged a share of it, the other nothing; 0.1 us apart
    assert "split rows: 1 blocks merged a share, 0 a whole row, 1 none" in text and "median 0.10 us" in text


# ----------------------------------------------------------------------------- on the GPU


def _gpu_ragged_paged_batches(kv_format: str, q_precision: str, configs: list, seed: int) -> None:
    """The kernel alone on each batch of lengths in ``configs`` (page sizes 1, 16, 64, 128
    in turn), against the emulator and within the reference tolerance."""
    from test_decode_gpu import assert_close_to_reference

    from hipmla import runtime

    if not runtime.available() or runtime.device_info(0).arch != "sm_90":
        pytest.skip("needs an sm_90 GPU")
    trial = _script("sm90_trial")
    sm_scale = 1 / 24
    rng = np.random.default_rng(seed)
    for i, lens in enumerate(configs):
        page_size = (1, 16, 64, 128)[i % 4]
        layout = random_page_table(lens, page_size, rng, spare_pages=17, shared=3)
        pool_rows = (int(layout.kv_indices.max(initial=0)) + 1) * page_size
        pool = random_cache(pool_rows, kv_format, rng, scale_stride=24 if i % 2 else 18)
        q = rng.standard_normal((lens.shape[0], 16, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
        kernel = trial.Sm90Kernel(kv_format, sm_scale, lens.shape[0], q_precision=q_precision)
        try:
            out, lse = trial.run_once(kernel, q, pool, layout)
            seqs = spread_sample(lens)
            r = trial.compare(out, lse, q, pool, layout, sm_scale, kernel.policy, seqs, q_precision)
        finally:
            kernel.close()
        what = f"{kv_format}/q{q_precision} config {i} (bs {lens.shape[0]}, {int(lens.sum())} tokens, page {page_size})"
        assert np.isfinite(out.astype(np.float32)).all(), f"{what}: unwritten or non-finite output"
        assert r["ok"], f"{what}: {r}"
        if q_precision != "bf16":
            continue  # quantized Q: the emulator is the check (on these caches' peaked softmax
            # the quantization of Q alone moves outputs past REFERENCE_TOL: mxfp4 Q by up to 10)
        # Relative to sum p|v| / l, not |ref|: on the H200 (2026-12-06) mxfp4 config 2 came
        # 6.4e-2 off exact attention where two heavy tokens' V cancel (|ref| 0.16), as the
        # emulator does (6.398e-2 as well): P's bf16 rounding, not the kernel.
        ref = mla_decode_reference(q, pool, layout, sm_scale, seqs=seqs, magnitude=True)
        assert_close_to_reference(out[seqs], lse[seqs], *ref, what)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_gpu_ragged_paged_batches_match_the_emulator(kv_format):
    configs = [np.array([1, 0, 31, 32, 33, 127, 128, 129, 16383, 64, 65]), np.zeros(3, np.int64)]
    rng = np.random.default_rng(90)
    configs += [rng.integers(0, 9000, size=int(rng.integers(1, 150))) for _ in range(4)]
    _gpu_ragged_paged_batches(kv_format, "bf16", configs, seed=91)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("q_precision", ["fp8", "mxfp4"])
def test_gpu_quantized_q_matches_the_emulator(kv_format, q_precision):
    """fp8 / mxfp4 Q on the tensor-core kernel: the block quantizes Q as the emulator does."""
    rng = np.random.default_rng(93)
    configs = [np.array([1, 0, 31, 33, 129, 5000, 64]), rng.integers(0, 3000, size=40)]
    _gpu_ragged_paged_batches(kv_format, q_precision, configs, seed=94)


@pytest.mark.gpu
def test_gpu_fp8_f16_products_of_extreme_q():
    """The fp8 kernel's f16 products on the H200: heads near both ends of the bf16 range
    (each its own power of two, q_exponent), a head of zeros and a head whose values span
    2^40 come out as the emulator's f16_q says."""
    from hipmla import runtime

    if not runtime.available() or runtime.device_info(0).arch != "sm_90":
        pytest.skip("needs an sm_90 GPU")
    trial = _script("sm90_trial")
    rng = np.random.default_rng(91)
    lens = np.array([1, 33, 300, 2000, 0, 129])
    layout = random_page_table(lens, 16, rng, spare_pages=3)
    pool = random_cache((int(layout.kv_indices.max(initial=0)) + 1) * 16, "fp8", rng)
    q = extreme_q(rng, lens.shape[0])
    kernel = trial.Sm90Kernel("fp8", 1 / 24, lens.shape[0])
    try:
        out, lse = trial.run_once(kernel, q, pool, layout)
    finally:
        kernel.close()
    emu_out, emu_lse = emulate_decode(q, pool, layout, 1 / 24, kernel.policy, tile_tokens=SM90_TILE_TOKENS,
                                      products="f16")
    o, e = out.astype(np.float32), emu_out.astype(np.float32)
    assert np.isfinite(o).all()
    err = np.abs(o - e)
    assert (err <= 2.0 ** -7 * np.abs(e) + 1e-3 * np.abs(e).max()).all(), f"worst {err.max():.3e}"
    # Heads scaled by 2^100 have LSEs near 1e30: relative bounds, and wider than for N(0,1)
    # Q: the scores of these heads cancel terms many times their size, and the f32 sums
    # in the tensor cores' order differ from the emulator's f64 by 2e-5 of the score
    # (the H200, 2026-12-04: one head at 2^40, LSE -8.854e9).
    fin = np.isfinite(emu_lse)
    assert (np.isfinite(lse) == fin).all()
    np.testing.assert_allclose(lse[fin], emu_lse[fin], rtol=2e-4, atol=1e-3)


def extreme_q(rng, batch: int) -> np.ndarray:
    """bf16 Q whose heads test f16 products: scales 2^-120 .. 2^100, a head of zeros, a head
    with half its values 2^-40 below the rest (rounded to f16's subnormals)."""
    qf = rng.standard_normal((batch, 16, 576), dtype=np.float32)
    qf *= np.exp2([-120, -100, -40, -14, 0, 15, 16, 17, 40, 100, 0, 0, 3, -3, 0, 0])[None, :, None]
    qf[:, 10, ::2] *= 2.0 ** -40
    qf[:, 11] = 0.0
    return qf.astype(ml_dtypes.bfloat16)
