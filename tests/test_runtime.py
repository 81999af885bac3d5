"""hipmla.runtime: platform selection, error mapping, compile cache and launch checks
against a fake hip-python; real-device tests are marked ``gpu``."""

from __future__ import annotations

import ctypes
import gc
import enum
import hashlib
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from hipmla import runtime

REPO = Path(__file__).resolve().parents[1]


# --- a fake hip-python -------------------------------------------------------------


class hipError_t(enum.IntEnum):  # noqa: N801 - named like hip-python's enum
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorNoDevice = 100
    hipErrorLaunchFailure = 719


class hiprtcResult(enum.IntEnum):  # noqa: N801
    HIPRTC_SUCCESS = 0
    HIPRTC_ERROR_INVALID_OPTION = 5
    HIPRTC_ERROR_COMPILATION = 6


class hipDeviceAttribute_t(enum.IntEnum):  # noqa: N801
    hipDeviceAttributeComputeCapabilityMajor = 23
    hipDeviceAttributeComputeCapabilityMinor = 24
    hipDeviceAttributeL2CacheSize = 36
    hipDeviceAttributeMaxSharedMemoryPerBlock = 52
    hipDeviceAttributeMemoryBusWidth = 53
    hipDeviceAttributeMemoryClockRate = 54
    hipDeviceAttributeMultiprocessorCount = 63
    hipDeviceAttributeSharedMemPerBlockOptin = 74
    hipDeviceAttributeWarpSize = 87


class hipMemcpyKind(enum.IntEnum):  # noqa: N801
    hipMemcpyHostToDevice = 1
    hipMemcpyDeviceToHost = 2


OK = hipError_t.hipSuccess
RTC_OK = hiprtcResult.HIPRTC_SUCCESS


class FakeHip:
    hipError_t = hipError_t
    hipDeviceAttribute_t = hipDeviceAttribute_t
    hipMemcpyKind = hipMemcpyKind

    def __init__(self):
        self.calls: list[tuple] = []
        self.runtime_version = 60443484
        self.device_count = 1
        self.arch_name = "gfx950:sramecc+:xnack-"
        self.attrs = {
            hipDeviceAttribute_t.hipDeviceAttributeMultiprocessorCount: 256,
            hipDeviceAttribute_t.hipDeviceAttributeWarpSize: 64,
            hipDeviceAttribute_t.hipDeviceAttributeMaxSharedMemoryPerBlock: 65536,
            hipDeviceAttribute_t.hipDeviceAttributeSharedMemPerBlockOptin: 0,
            hipDeviceAttribute_t.hipDeviceAttributeL2CacheSize: 4 << 20,
            hipDeviceAttribute_t.hipDeviceAttributeMemoryClockRate: 2_000_000,
            hipDeviceAttribute_t.hipDeviceAttributeMemoryBusWidth: 8192,
            hipDeviceAttribute_t.hipDeviceAttributeComputeCapabilityMajor: 9,
            hipDeviceAttribute_t.hipDeviceAttributeComputeCapabilityMinor: 0,
        }
        self.next_ptr = 0x10000

    def _log(self, *call):
        self.calls.append(call)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def hipGetErrorName(self, e):
        return (OK, e.name)

    def hipGetErrorString(self, e):
        return (OK, f"description of {e.name}")

    def hipRuntimeGetVersion(self):
        return (OK, self.runtime_version)

    def hipGetDeviceCount(self):
        self._log("hipGetDeviceCount")
        return (OK, self.device_count)

    def hipSetDevice(self, index):
        self._log("hipSetDevice", index)
        return (OK,)

    def hipGetDevice(self):
        return (OK, 0)

    def hipGetDeviceProperties(self, index):
        self._log("hipGetDeviceProperties", index)
        props = types.SimpleNamespace(
            name="AMD Instinct MI355X", gcnArchName=self.arch_name,
            totalGlobalMem=288 << 30, pciBusID=0x75,
        )
        return (OK, props)

    def hipDeviceGetAttribute(self, attr, index):
        return (OK, self.attrs[attr])

    def hipMalloc(self, size):
        self._log("hipMalloc", size)
        self.next_ptr += 0x1000
        return (OK, self.next_ptr)

    def hipFree(self, ptr):
        self._log("hipFree", ptr)
        return (OK,)

    def hipMemcpy(self, dst, src, size, kind):
        self._log("hipMemcpy", dst, src, size, kind)
        return (OK,)

    def hipMemcpyAsync(self, dst, src, size, kind, stream):
        self._log("hipMemcpyAsync", dst, src, size, kind, stream)
        return (OK,)

    def hipMemsetAsync(self, dst, value, size, stream):
        self._log("hipMemsetAsync", dst, value, size, stream)
        return (OK,)

    def hipModuleLoadData(self, code):
        self._log("hipModuleLoadData", code)
        return (OK, object())

    def hipModuleGetFunction(self, module, name):
        self._log("hipModuleGetFunction", name)
        return (OK, object())

    def hipModuleUnload(self, module):
        self._log("hipModuleUnload")
        return (OK,)

    def hipModuleLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self._log("hipModuleLaunchKernel", (gx, gy, gz), (bx, by, bz), shared, stream, params, extra)
        return (OK,)


class FakeProgram:
    def __init__(self, source: bytes):
        self.source = source
        self.log = b""
        self.code = b""

    def createRef(self):  # noqa: N802 - hip-python's name
        return ("ref", self)


class FakeHiprtc:
    hiprtcResult = hiprtcResult

    def __init__(self):
        self.compiled: list[list[bytes]] = []
        self.destroyed: list[FakeProgram] = []
        self.version = (7, 0)

    def hiprtcVersion(self):
        return (RTC_OK, *self.version)

    def hiprtcGetErrorString(self, e):
        return (RTC_OK, f"hiprtc says {e.name}")

    def hiprtcCreateProgram(self, src, name, n_headers, headers, include_names):
        return (RTC_OK, FakeProgram(src))

    def hiprtcCompileProgram(self, prog, n, options):
        assert n == len(options)
        self.compiled.append(list(options))
        if b"#error" in prog.source:
            prog.log = b"kernel.hip:1:2: error: boom\n\0"
            return (hiprtcResult.HIPRTC_ERROR_COMPILATION,)
        prog.code = b"CO" + hashlib.sha256(prog.source + b"|".join(options)).digest()
        return (RTC_OK,)

    def hiprtcGetProgramLogSize(self, prog):
        return (RTC_OK, len(prog.log))

    def hiprtcGetProgramLog(self, prog, buf):
        buf[:] = prog.log
        return (RTC_OK,)

    def hiprtcGetCodeSize(self, prog):
        return (RTC_OK, len(prog.code))

    def hiprtcGetCode(self, prog, buf):
        buf[:] = prog.code
        return (RTC_OK,)

    def hiprtcDestroyProgram(self, ref):
        assert ref[0] == "ref", "hiprtcDestroyProgram wants prog.createRef()"
        self.destroyed.append(ref[1])
        return (RTC_OK,)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The runtime bound to fakes, with a private compile cache directory."""
    # Handles of earlier tests (Module <-> Function cycles) are released now, into the
    # fakes they came from, not later into this test's.
    gc.collect()
    fake_hip, fake_rtc = FakeHip(), FakeHiprtc()
    monkeypatch.setattr(runtime, "hip", fake_hip)
    monkeypatch.setattr(runtime, "hiprtc", fake_rtc)
    monkeypatch.setattr(runtime, "_platform", "amd")
    monkeypatch.setattr(runtime, "_compiler_version", None)
    monkeypatch.setattr(runtime, "_device_infos", {})
    monkeypatch.setattr(runtime, "_kernels", {})
    monkeypatch.setattr(runtime, "_c_launch", False)  # launches go through the fake hip
    monkeypatch.setenv("HIPMLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HIPMLA_CACHE", raising=False)
    return types.SimpleNamespace(hip=fake_hip, rtc=fake_rtc, cache=tmp_path / "cache")


# --- import and first use without ROCm ---------------------------------------------


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=60
    )


def test_import_does_not_load_hip_python():
    result = _run_python(
        "import sys, hipmla.runtime; "
        "print(sorted(m for m in sys.modules if m == 'hip' or m.startswith('rocm')))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_first_use_without_rocm_raises_runtime_unavailable(tmp_path):
    try:
        ctypes.CDLL("libamdhip64.so")
    except OSError:
        pass
    else:
        pytest.skip("a HIP runtime is installed on this machine")
    code = (
        "import hipmla.runtime as rt\n"
        "assert rt.available() is False\n"
        "try:\n"
        "    rt.device_count()\n"
        "except rt.RuntimeUnavailable as e:\n"
        "    print('MESSAGE', e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "try:\n"
        "    rt.alloc(16)\n"
        "except rt.RuntimeUnavailable:\n"
        "    print('AGAIN')\n"
    )
    result = _run_python(code, HIPMLA_PLATFORM="amd", ROCM_PATH=str(tmp_path))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "no HIP runtime found" in result.stdout
    assert "HIPMLA_PLATFORM=nvidia" in result.stdout
    assert "ROCm" in result.stdout
    assert "AGAIN" in result.stdout


# --- platform selection ------------------------------------------------------------


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """Unselected platform with scripted probes; records what was asked."""
    state = types.SimpleNamespace(rocm=False, nvidia=False, builds=0, asked=[],
                                  shim=tmp_path / "shim", build_error=None)

    def rocm_found():
        state.asked.append("rocm")
        return state.rocm

    def nvidia_present():
        state.asked.append("nvidia")
        return state.nvidia

    def shim_root(build):
        if build:
            if state.build_error:
                raise state.build_error
            state.builds += 1
        return state.shim

    monkeypatch.setattr(runtime, "_platform", None)
    monkeypatch.setattr(runtime.library, "_rocm_library_found", rocm_found)
    monkeypatch.setattr(runtime.library, "_nvidia_gpu_present", nvidia_present)
    monkeypatch.setattr(runtime.library, "_shim_root", shim_root)
    monkeypatch.delenv("HIPMLA_PLATFORM", raising=False)
    monkeypatch.delenv("ROCM_PATH", raising=False)
    return state


def test_auto_prefers_rocm(probes):
    probes.rocm = probes.nvidia = True
    assert runtime.platform() == "amd"
    assert "ROCM_PATH" not in os.environ
    assert probes.builds == 0


def test_auto_falls_back_to_shim_on_nvidia(probes):
    probes.nvidia = True
    assert runtime.platform() == "nvidia"
    assert os.environ["ROCM_PATH"] == str(probes.shim)
    assert probes.builds == 1


def test_auto_without_any_gpu_runtime_explains(probes):
    with pytest.raises(runtime.RuntimeUnavailable, match="no HIP runtime found.*HIPMLA_PLATFORM=nvidia"):
        runtime.platform()


def test_forced_nvidia_uses_shim_even_with_rocm(probes, monkeypatch):
    probes.rocm = True
    monkeypatch.setenv("HIPMLA_PLATFORM", "nvidia")
    assert runtime.platform() == "nvidia"
    assert os.environ["ROCM_PATH"] == str(probes.shim)
    assert "rocm" not in probes.asked


def test_forced_amd_probes_nothing(probes, monkeypatch):
    probes.nvidia = True
    monkeypatch.setenv("HIPMLA_PLATFORM", "AMD")
    assert runtime.platform() == "amd"
    assert probes.asked == [] and probes.builds == 0


def test_inherited_shim_rocm_path_is_nvidia(probes, monkeypatch):
    # A child process of one that selected the shim inherits its ROCM_PATH.
    probes.shim.mkdir()
    probes.rocm = True
    monkeypatch.setenv("ROCM_PATH", str(probes.shim))
    assert runtime.platform() == "nvidia"
    assert probes.builds == 0


def test_selection_happens_once(probes):
    probes.nvidia = True
    assert runtime.platform() == "nvidia"
    probes.rocm = True
    assert runtime.platform() == "nvidia"
    assert probes.builds == 1


def test_bad_platform_value_names_the_variable(probes, monkeypatch):
    monkeypatch.setenv("HIPMLA_PLATFORM", "cuda")
    with pytest.raises(ValueError, match="HIPMLA_PLATFORM.*'cuda'"):
        runtime.platform()


def test_shim_build_failure_is_runtime_unavailable(probes, monkeypatch):
    probes.nvidia = True
    probes.build_error = OSError("nvcc exploded")
    with pytest.raises(runtime.RuntimeUnavailable, match="nvcc exploded"):
        runtime.platform()


def test_rocm_probe_finds_library_under_rocm_path(monkeypatch, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libamdhip64.so").write_bytes(b"")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    assert runtime.library._rocm_library_found()


# --- check() -----------------------------------------------------------------------


def test_check_returns_values(fake):
    assert runtime.check((OK,)) is None
    assert runtime.check((OK, 7)) == 7
    assert runtime.check((OK, 3, 4)) == (3, 4)


def test_check_raises_hip_error_with_name(fake):
    with pytest.raises(runtime.HipError) as info:
        runtime.check((hipError_t.hipErrorLaunchFailure, None))
    err = info.value
    assert err.code == 719 and err.name == "hipErrorLaunchFailure"
    assert "hipErrorLaunchFailure (719): description of hipErrorLaunchFailure" == str(err)


def test_check_raises_hiprtc_error_with_name(fake):
    with pytest.raises(runtime.HipError) as info:
        runtime.check((hiprtcResult.HIPRTC_ERROR_INVALID_OPTION,))
    assert info.value.code == 5 and info.value.name == "HIPRTC_ERROR_INVALID_OPTION"
    assert "hiprtc says" in str(info.value)


# --- device properties -------------------------------------------------------------


def test_split_arch():
    assert runtime.split_arch("gfx950:sramecc+:xnack-") == "gfx950"
    assert runtime.split_arch("gfx942") == "gfx942"
    assert runtime.split_arch("sm_90") == "sm_90"


def test_device_info_parses_and_caches(fake):
    info = runtime.device_info(0)
    assert info.arch == "gfx950" and info.arch_full == "gfx950:sramecc+:xnack-"
    assert info.platform == "amd" and info.num_cus == 256 and info.warp_size == 64
    assert info.shared_optin == 65536  # the runtime reported 0: fall back to the default
    assert info.total_mem == 288 << 30 and info.pci_bus_id == 0x75
    assert info.peak_bandwidth_gbs == pytest.approx(2 * 2e9 * 8192 / 8 / 1e9)
    assert runtime.device_info(0) is info
    assert fake.hip.names().count("hipGetDeviceProperties") == 1
    assert fake.hip.names().count("hipSetDevice") == 2  # still made current every time


def test_use_device_calls_hip_only_when_this_threads_device_changes(fake, monkeypatch):
    import threading

    monkeypatch.setattr(runtime, "_thread", runtime._ThreadState())  # no device made current yet
    fake.hip.device_count = 2
    for index in (0, 0, 1, 1, 0):
        runtime.use_device(index)
    assert [c[1] for c in fake.hip.calls if c[0] == "hipSetDevice"] == [0, 1, 0]
    other = threading.Thread(target=runtime.use_device, args=(0,))  # its own current device
    other.start()
    other.join()
    assert [c[1] for c in fake.hip.calls if c[0] == "hipSetDevice"] == [0, 1, 0, 0]


def test_device_info_nvidia_arch_from_compute_capability(fake, monkeypatch):
    monkeypatch.setattr(runtime, "_platform", "nvidia")
    fake.hip.arch_name = ""
    assert runtime.device_info(0).arch == "sm_90"


def test_device_info_rejects_bad_index(fake):
    with pytest.raises(ValueError, match=r"index: expected a device index in \[0, 1\), got 1"):
        runtime.device_info(1)
    with pytest.raises(TypeError, match="index"):
        runtime.device_info("0")


# --- memory ------------------------------------------------------------------------


def test_alloc_zero_gets_a_real_address(fake):
    buf = runtime.alloc(0)
    assert buf.nbytes == 0 and buf.ptr != 0
    assert ("hipMalloc", 1) in fake.hip.calls


def test_alloc_rejects_bad_sizes(fake):
    with pytest.raises(ValueError, match="nbytes"):
        runtime.alloc(-1)
    with pytest.raises(TypeError, match="nbytes"):
        runtime.alloc(1.5)


def test_buffer_frees_once(fake):
    with runtime.alloc(64) as buf:
        ptr = buf.ptr
    buf.free()
    del buf
    assert fake.hip.names().count("hipFree") == 1
    assert ("hipFree", ptr) in fake.hip.calls


def test_buffer_not_freed_by_another_process(fake):
    buf = runtime.alloc(64)
    buf._owner_pid = -1  # as if inherited through fork
    del buf
    assert "hipFree" not in fake.hip.names()


def test_copies_validate_and_pick_sync_or_async(fake):
    host = np.arange(8, dtype=np.float32)
    runtime.copy_htod(0x2000, host)
    name, dst, src, size, kind = fake.hip.calls[-1]
    assert (name, dst, src, size, kind) == ("hipMemcpy", 0x2000, host.ctypes.data, 32,
                                            hipMemcpyKind.hipMemcpyHostToDevice)
    stream = runtime.Stream.null()
    runtime.copy_dtoh(host, 0x2000, stream=stream)
    assert fake.hip.calls[-1][0] == "hipMemcpyAsync" and fake.hip.calls[-1][-1] == 0
    with pytest.raises(ValueError, match="src: expected a C-contiguous"):
        runtime.copy_htod(0x2000, host[::2])
    with pytest.raises(ValueError, match="dst_ptr"):
        runtime.copy_htod(0, host)
    host.flags.writeable = False
    with pytest.raises(ValueError, match="dst: expected a writeable"):
        runtime.copy_dtoh(host, 0x2000)


def test_memset_checks_value(fake):
    runtime.memset(0x2000, 0, 16)
    assert fake.hip.calls[-1] == ("hipMemsetAsync", 0x2000, 0, 16, None)
    with pytest.raises(ValueError, match="value"):
        runtime.memset(0x2000, 256, 16)


# --- compile cache -----------------------------------------------------------------

SRC = 'extern "C" __global__ void k(int* p) { p[0] = 1; }'


def test_compile_passes_flags_and_caches(fake):
    code = runtime.compile_source(SRC, "k", "gfx950", ["-DX=1"])
    assert fake.rtc.compiled == [[b"--offload-arch=gfx950", b"-O3", b"-DX=1"]]
    assert len(fake.rtc.destroyed) == 1
    again = runtime.compile_source(SRC, "k", "gfx950", ["-DX=1"])
    assert again == code and len(fake.rtc.compiled) == 1
    files = list(fake.cache.iterdir())
    assert len(files) == 1 and files[0].read_bytes() == code
    assert files[0].name.startswith("k-gfx950-")


@pytest.mark.parametrize("change", ["source", "options", "arch", "compiler", "platform"])
def test_cache_invalidation(fake, monkeypatch, change):
    runtime.compile_source(SRC, "k", "gfx950", ["-DX=1"])
    source, options, arch = SRC, ["-DX=1"], "gfx950"
    if change == "source":
        source = SRC + " "
    elif change == "options":
        options = ["-DX=2"]
    elif change == "arch":
        arch = "gfx942"
    elif change == "compiler":
        fake.rtc.version = (7, 1)
        monkeypatch.setattr(runtime, "_compiler_version", None)
    else:
        monkeypatch.setattr(runtime, "_platform", "nvidia")
    runtime.compile_source(source, "k", arch, options)
    assert len(fake.rtc.compiled) == 2
    assert len(list(fake.cache.iterdir())) == 2


def test_cache_runtime_version_is_part_of_the_key(fake, monkeypatch):
    before = runtime.cache_key(SRC, [], "gfx950")
    fake.hip.runtime_version += 1
    monkeypatch.setattr(runtime, "_compiler_version", None)
    assert runtime.cache_key(SRC, [], "gfx950") != before


def test_cache_disabled(fake, monkeypatch):
    monkeypatch.setenv("HIPMLA_CACHE", "0")
    runtime.compile_source(SRC, "k", "gfx950", [])
    runtime.compile_source(SRC, "k", "gfx950", [])
    assert len(fake.rtc.compiled) == 2
    assert not fake.cache.exists()


def test_cache_default_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("HIPMLA_CACHE_DIR", raising=False)
    monkeypatch.delenv("HIPMLA_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert runtime.cache_dir() == tmp_path / ".cache" / "hipmla" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.cache_dir() == tmp_path / "xdg" / "hipmla" / "kernels"


def test_empty_cache_file_is_a_miss(fake):
    code = runtime.compile_source(SRC, "k", "gfx950", [])
    (entry,) = fake.cache.iterdir()
    entry.write_bytes(b"")
    assert runtime.compile_source(SRC, "k", "gfx950", []) == code
    assert len(fake.rtc.compiled) == 2 and entry.read_bytes() == code


def test_cache_write_is_atomic(fake, monkeypatch):
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((Path(src), Path(dst)))
        assert Path(src).read_bytes().startswith(b"CO"), "temporary file fully written first"
        assert not Path(dst).exists()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    runtime.compile_source(SRC, "k", "gfx950", [])
    ((tmp, final),) = renames
    assert tmp.parent == final.parent and tmp != final
    assert [p.name for p in fake.cache.iterdir()] == [final.name]


def test_failed_cache_write_leaves_nothing_and_warns(fake, monkeypatch):
    def replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.warns(UserWarning, match="disk full"):
        code = runtime.compile_source(SRC, "k", "gfx950", [])
    assert code.startswith(b"CO")
    assert list(fake.cache.iterdir()) == []


def test_compile_error_carries_log(fake):
    with pytest.raises(runtime.CompileError) as info:
        runtime.compile_source("#error nope\n" + SRC, "bad_kernel", "gfx942", [])
    assert "error: boom" in info.value.log
    assert "bad_kernel" in str(info.value) and "gfx942" in str(info.value)
    assert "HIPRTC_ERROR_COMPILATION" in str(info.value)
    assert len(fake.rtc.destroyed) == 1
    assert not fake.cache.exists() or list(fake.cache.iterdir()) == []


def test_compile_rejects_bad_arguments(fake):
    with pytest.raises(TypeError, match="options"):
        runtime.compile_source(SRC, "k", "gfx950", "-O2")
    with pytest.raises(TypeError, match="arch"):
        runtime.compile_source(SRC, "k", "", [])


# --- launches ----------------------------------------------------------------------


class Args(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("scale", ctypes.c_float), ("n", ctypes.c_int32)]


def _function(fake) -> runtime.Function:
    return runtime.Module(b"\x7fELF fake").function("k")


@pytest.mark.parametrize("grid", [(0, 1, 1), (1, 0, 1), (4, 1, 0)])
def test_launch_rejects_zero_grid(fake, grid):
    fn = _function(fake)
    with pytest.raises(ValueError, match="grid"):
        fn.launch(grid, (64, 1, 1), Args())
    assert "hipModuleLaunchKernel" not in fake.hip.names()


@pytest.mark.parametrize("block", [(1025, 1, 1), (32, 32, 2), (0, 1, 1)])
def test_launch_rejects_bad_block(fake, block):
    fn = _function(fake)
    with pytest.raises(ValueError, match="block"):
        fn.launch((1, 1, 1), block, Args())
    assert "hipModuleLaunchKernel" not in fake.hip.names()


def test_launch_rejects_non_struct_args(fake):
    with pytest.raises(TypeError, match="args: expected a ctypes.Structure"):
        _function(fake).launch((1, 1, 1), (64, 1, 1), (1, 2))


def _extra_entries(address: int) -> list[int]:
    return [v or 0 for v in (ctypes.c_void_p * 5).from_address(address)]


def test_launch_passes_struct_through_extra(fake):
    fn = _function(fake)
    args = Args(out=0x1234, scale=0.5, n=7)
    fn.launch((3, 2, 1), (256, 1, 1), args, shared_bytes=1024, stream=runtime.Stream.null())
    name, grid, block, shared, stream, params, extra = fake.hip.calls[-1]
    assert (grid, block, shared, stream, params) == ((3, 2, 1), (256, 1, 1), 1024, 0, None)
    kind_ptr, buf, kind_size, size_ptr, end = _extra_entries(extra)
    assert (kind_ptr, kind_size, end) == (1, 2, 3)
    assert buf == ctypes.addressof(args)
    assert ctypes.c_size_t.from_address(size_ptr).value == ctypes.sizeof(Args) == 16

    args.n = 9  # same struct again: nothing rebuilt, the new field is what is read
    fn.launch((1, 1, 1), (64, 1, 1), args)
    assert fake.hip.calls[-1][-1] == extra
    assert Args.from_address(_extra_entries(extra)[1]).n == 9

    other = Args(n=11)  # another struct gets its own extra array; the first is untouched
    fn.launch((1, 1, 1), (64, 1, 1), other)
    other_extra = fake.hip.calls[-1][-1]
    assert other_extra != extra
    assert Args.from_address(_extra_entries(other_extra)[1]).n == 11


def test_bound_launches_do_not_share_arguments(fake):
    # Two decoders on two threads bind the same kernel to their own structs.
    fn = _function(fake)
    a, b = Args(n=1), Args(n=2)
    launch_a, launch_b = fn.bind(a), fn.bind(b)
    launch_b((1, 1, 1), (64, 1, 1))
    launch_a((1, 1, 1), (64, 1, 1))
    extras = [call[-1] for call in fake.hip.calls[-2:]]
    assert [Args.from_address(_extra_entries(e)[1]).n for e in extras] == [2, 1]


def test_module_functions_are_cached_and_closed(fake):
    module = runtime.Module(b"\x7fELF fake")
    assert module.function("k") is module.function("k")
    module.close()
    module.close()
    assert fake.hip.names().count("hipModuleUnload") == 1
    with pytest.raises(RuntimeError, match="closed"):
        module.function("k")


# --- load_kernel ---------------------------------------------------------------------


class Spec:
    symbol = "hipmla_test_kernel"
    source = "decode/test.hip"

    def options(self, arch):
        return [f"-DARCH_{arch}"]

    def compile_arch(self, arch):
        return arch


class SuffixSpec(Spec):
    """A kernel of arch-specific instructions (as the sm_90a one): compiled for arch + "a"."""

    def compile_arch(self, arch):
        return arch + "a"


@pytest.fixture
def kernel_modules(monkeypatch):
    kernels = types.ModuleType("hipmla.kernels")
    kernels.translation_unit = lambda source: f"// {source}\n{SRC}"
    aot = types.ModuleType("hipmla.aot")
    aot.requests = []

    def find_prebuilt(spec, arch, source_text, options):
        aot.requests.append((spec, arch, source_text, options))
        return aot.prebuilt

    aot.find_prebuilt = find_prebuilt
    aot.prebuilt = None
    monkeypatch.setitem(sys.modules, "hipmla.kernels", kernels)
    monkeypatch.setitem(sys.modules, "hipmla.aot", aot)
    return aot


def test_load_kernel_compiles_and_caches(fake, kernel_modules):
    spec = Spec()
    fn = runtime.load_kernel(spec, "gfx950")
    assert fn.symbol == "hipmla_test_kernel"
    assert runtime.load_kernel(spec, "gfx950") is fn
    assert fake.rtc.compiled == [[b"--offload-arch=gfx950", b"-O3", b"-DARCH_gfx950"]]
    ((_, arch, source_text, options),) = kernel_modules.requests
    assert source_text.startswith("// decode/test.hip") and options == ["-DARCH_gfx950"]
    assert runtime.load_kernel(spec, "gfx942") is not fn


def test_load_kernel_prefers_prebuilt(fake, kernel_modules):
    kernel_modules.prebuilt = b"\x7fELF prebuilt"
    runtime.load_kernel(Spec(), "gfx950")
    assert fake.rtc.compiled == []
    assert ("hipModuleLoadData", b"\x7fELF prebuilt") in fake.hip.calls


def test_load_kernel_compiles_for_the_specs_target(fake, kernel_modules):
    runtime.load_kernel(SuffixSpec(), "sm_90")
    assert fake.rtc.compiled == [[b"--offload-arch=sm_90a", b"-O3", b"-DARCH_sm_90"]]


def test_load_kernel_without_aot_module(fake, kernel_modules, monkeypatch):
    monkeypatch.setitem(sys.modules, "hipmla.aot", None)
    runtime.load_kernel(Spec(), "gfx950")
    assert len(fake.rtc.compiled) == 1


# --- on a device ---------------------------------------------------------------------

FILL_SOURCE = r"""
struct FillArgs {
    float* out;
    float scale;
    int n;
};

extern "C" __global__ void hipmla_test_fill(FillArgs a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.n) a.out[i] = a.scale * (float)i;
}
"""


@pytest.fixture
def device():
    return runtime.device_info(0)


@pytest.mark.gpu
def test_gpu_device_info(device):
    assert device.num_cus > 0 and device.warp_size in (32, 64)
    assert device.arch.startswith(("gfx", "sm_"))
    assert device.platform == runtime.platform()
    free, total = runtime.memory_info()
    assert 0 < free <= total


@pytest.mark.gpu
def test_gpu_copy_round_trip_and_memset(device):
    host = np.random.default_rng(0).integers(0, 255, size=4099, dtype=np.uint8)
    back = np.zeros_like(host)
    with runtime.alloc(host.nbytes) as buf:
        runtime.copy_htod(buf.ptr, host)
        runtime.copy_dtoh(back, buf.ptr)
        np.testing.assert_array_equal(back, host)
        with runtime.Stream() as stream:
            runtime.memset(buf.ptr + 7, 0xAB, 100, stream=stream)
            runtime.copy_dtoh(back, buf.ptr, stream=stream)
            stream.synchronize()
    expected = host.copy()
    expected[7:107] = 0xAB
    np.testing.assert_array_equal(back, expected)


@pytest.mark.gpu
def test_gpu_kernel_launch_with_struct_and_events(device, monkeypatch, tmp_path):
    monkeypatch.setenv("HIPMLA_CACHE_DIR", str(tmp_path))
    code = runtime.compile_source(FILL_SOURCE, "hipmla_test_fill", device.arch, [])
    fn = runtime.Module(code).function("hipmla_test_fill")
    n = 1000
    out = np.zeros(n, dtype=np.float32)
    with runtime.alloc(out.nbytes) as buf, runtime.Stream() as stream:
        args = Args(out=buf.ptr, scale=0.5, n=n)
        start, end = runtime.Event(), runtime.Event()
        start.record(stream)
        fn.launch((-(-n // 256), 1, 1), (256, 1, 1), args, stream=stream)
        end.record(stream)
        end.synchronize()
        assert start.elapsed_ms(end) >= 0.0
        runtime.copy_dtoh(out, buf.ptr, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(out, 0.5 * np.arange(n, dtype=np.float32))

        args.scale = 3.0  # the same struct, changed after launch: the new value is used
        args.n = 10
        fn.launch((1, 1, 1), (64, 1, 1), args, stream=stream)
        runtime.copy_dtoh(out, buf.ptr, stream=stream)
        stream.synchronize()
    expected = 0.5 * np.arange(n, dtype=np.float32)
    expected[:10] = 3.0 * np.arange(10)
    np.testing.assert_array_equal(out, expected)
    start.close()
    end.close()


@pytest.mark.gpu
def test_gpu_compile_error_has_log(device, monkeypatch):
    monkeypatch.setenv("HIPMLA_CACHE", "0")
    with pytest.raises(runtime.CompileError) as info:
        runtime.compile_source('extern "C" __global__ void k() { undeclared(); }', "k", device.arch, [])
    assert "undeclared" in info.value.log


@pytest.mark.parametrize("first_call", ["set_device", "device_info"])
def test_device_calls_initialise_the_runtime_first(fake, monkeypatch, first_call):
    # A program whose first hipmla call is set_device/device_info (the decoder's
    # constructor) must bind hip-python before touching it.
    fake_hip = fake.hip
    monkeypatch.setattr(runtime, "hip", None)
    monkeypatch.setattr(runtime.library, "_load_hip_python", lambda selected: (fake_hip, fake.rtc))
    getattr(runtime, first_call)(0)
    assert runtime.hip is fake_hip


FAKE_LAUNCH_LIB = r"""
#include <stdint.h>
static uintptr_t last[11];
static int status;
int hipModuleLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
    uintptr_t v[11] = {(uintptr_t)f, gx, gy, gz, bx, by, bz, shared, (uintptr_t)stream,
                       (uintptr_t)params, (uintptr_t)extra};
    for (int i = 0; i < 11; ++i) last[i] = v[i];
    return status;
}
uintptr_t fake_last(int i) { return last[i]; }
void fake_set_status(int s) { status = s; }
"""


def test_launch_goes_through_the_loaded_library(fake, monkeypatch, tmp_path):
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "fake.c"
    src.write_text(FAKE_LAUNCH_LIB)
    lib_path = tmp_path / "libamdhip64.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", str(src), "-o", str(lib_path)], check=True)
    lib = ctypes.CDLL(str(lib_path))  # the library hip-python would have loaded
    lib.fake_last.restype = ctypes.c_size_t
    monkeypatch.setattr(runtime, "_c_launch", None)
    monkeypatch.setattr(runtime.launch, "_hip_library_path", lambda: str(lib_path))

    class Args(ctypes.Structure):
        _fields_ = [("x", ctypes.c_int)]

    fn = runtime.Function(0xF00D, module=None, symbol="k")
    args = Args(7)
    fn.launch((3, 2, 1), (256, 1, 1), args, shared_bytes=64, stream=0x5000)
    got = [lib.fake_last(i) for i in range(11)]
    assert got[:9] == [0xF00D, 3, 2, 1, 256, 1, 1, 64, 0x5000]
    assert got[9] == 0 and got[10] == fn._last.extra_address
    assert fake.hip.calls == [], "the hot path must not go through hip-python"
    # the extra array points at the struct and its size, with HIP's end marker
    extra = (ctypes.c_void_p * 5).from_address(got[10])
    assert extra[1] == ctypes.addressof(args) and extra[4] == 3
    lib.fake_set_status(int(hipError_t.hipErrorLaunchFailure))
    with pytest.raises(runtime.HipError, match="hipErrorLaunchFailure"):
        fn.launch((1, 1, 1), (1, 1, 1), args)


def test_a_prepared_launch_keeps_its_arguments_alive(monkeypatch):
    """The hot path keeps only the prepared callable: the extra array and the argument
    struct it points into must live as long as that callable (a dangling extra array
    made every launch fail with hipErrorInvalidValue on the H200)."""
    import ctypes
    import gc

    class Args(ctypes.Structure):
        _fields_ = [("x", ctypes.c_int64)]

    seen = []

    def fake_launch(*args):
        fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra = (getattr(a, "value", a) for a in args)
        arr = (ctypes.c_void_p * 5).from_address(extra)
        size = ctypes.c_size_t.from_address(arr[3]).value
        seen.append((arr[0], Args.from_address(arr[1]).x, size, fn, gx, stream))
        return 0

    monkeypatch.setattr(runtime.launch, "_c_launcher", lambda: fake_launch)
    fn = runtime.Function(0x1234, module=None, symbol="k")
    run = fn.bind(Args(x=77)).prepare((5, 1, 1), (256, 1, 1), 0, 0x99)
    gc.collect()
    junk = [Args(x=-1) for _ in range(1000)]  # reuse freed memory if the binding died
    run()
    assert seen == [(runtime.launch._LAUNCH_PARAM_BUFFER_POINTER, 77, 8, 0x1234, 5, 0x99)]
    del junk
