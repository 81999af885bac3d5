"""hipmla.nvidia and the HIP-on-CUDA library it builds from hip_src/nvidia.

CPU tests build the library, check its exports and its copies of HIP's enums and structs
against the installed hip-python, and drive hiprtc through hip-python with NVRTC alone.
Everything that needs libcuda and a GPU is marked ``gpu``. Each use of the library runs in
a child process: it looks up libcuda and NVRTC once per process, and hip-python binds its
libraries once per process.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hipmla import nvidia, runtime

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIR = nvidia.shim_source_dir()
RUNTIME_PACKAGE = REPO / "hipmla" / "runtime"
MISSING_LIBCUDA = "/nonexistent/libcuda.so.1"

#: What hipmla's runtime calls (keep in sync with the brief of issue 4).
HIP_API = [
    "hipInit", "hipGetDeviceCount", "hipSetDevice", "hipGetDevice", "hipGetDeviceProperties",
    "hipDeviceGetAttribute", "hipDriverGetVersion", "hipRuntimeGetVersion", "hipMalloc",
    "hipFree", "hipMemcpy", "hipMemcpyAsync", "hipMemsetAsync", "hipMemGetInfo",
    "hipStreamCreate", "hipStreamDestroy", "hipStreamSynchronize", "hipDeviceSynchronize",
    "hipEventCreate", "hipEventDestroy", "hipEventRecord", "hipEventSynchronize",
    "hipEventElapsedTime", "hipModuleLoadData", "hipModuleUnload", "hipModuleGetFunction",
    "hipModuleLaunchKernel", "hipGetErrorName", "hipGetErrorString", "hipGetLastError",
    "hipPeekAtLastError",
]
HIPRTC_API = [
    "hiprtcVersion", "hiprtcCreateProgram", "hiprtcCompileProgram", "hiprtcGetProgramLogSize",
    "hiprtcGetProgramLog", "hiprtcGetCodeSize", "hiprtcGetCode", "hiprtcDestroyProgram",
    "hiprtcGetErrorString",
]
#: hip-python names whose C symbol differs.
C_SYMBOL = {"hipGetDeviceProperties": "hipGetDevicePropertiesR0600"}

PROBE_KERNEL = r"""
struct ProbeArgs { int *out; unsigned n; };
extern "C" __global__ void hipmla_probe(ProbeArgs args) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < args.n) args.out[i] = (int)i;
}
extern "C" __global__ void hipmla_probe_shared(ProbeArgs args) {
    extern __shared__ int staged[];
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    staged[threadIdx.x * 128] = (int)i;  // spans 64 KiB for 128 threads
    __syncthreads();
    if (i < args.n) args.out[i] = staged[threadIdx.x * 128] + 1;
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    return nvidia.build_shim(tmp_path_factory.mktemp("shim"))


def run_child(script: str, env: dict[str, str]) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON object as its last line."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


#: The names the library itself falls back to after $HIPMLA_NVRTC.
NVRTC_FALLBACKS = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def nvrtc_available() -> bool:
    return nvidia.find_nvrtc() is not None or any(map(_loads, NVRTC_FALLBACKS))


needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="no NVRTC library found")


def runtime_sources(package: Path = RUNTIME_PACKAGE) -> list[str]:
    """The text of each module of the runtime package (none where it is missing)."""
    return [path.read_text() for path in sorted(package.glob("*.py"))]


def attributes_of(source: str):
    """``(owner, name)`` for each ``owner.name`` in ``source``, where ``owner`` is a bare
    name (``hip.hipInit``) or the last part of a dotted one (``runtime.hip.hipMalloc``)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name):
                yield node.value.id, node.attr
            elif isinstance(node.value, ast.Attribute):
                yield node.value.attr, node.attr


def runtime_api_names() -> set[str]:
    """Functions hipmla/runtime/ calls as ``hip.<name>`` / ``hiprtc.<name>``."""
    sources = runtime_sources()
    if not sources:
        return set()
    from hip import hip, hiprtc

    modules = {"hip": hip, "hiprtc": hiprtc}
    called = set()
    for source in sources:
        for owner, name in attributes_of(source):
            module = modules.get(owner)
            target = getattr(module, name, None) if module else None
            if callable(target) and not isinstance(target, type):
                called.add(name)
    return called


# --- the build ---------------------------------------------------------------------------


def test_build_shim_writes_library_and_hiprtc_link(shim):
    library = shim / "lib" / nvidia.LIBRARY
    hiprtc = shim / "lib" / nvidia.HIPRTC_LIBRARY
    assert library.read_bytes()[:4] == b"\x7fELF"
    assert hiprtc.resolve() == library.resolve()
    assert os.access(library, os.X_OK)


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not installed")
def test_shim_exports_every_function_hipmla_calls(shim):
    done = subprocess.run(["nm", "-D", "--defined-only", str(shim / "lib" / nvidia.LIBRARY)],
                          capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in done.stdout.splitlines() if line.strip()}
    from_runtime = runtime_api_names()
    if RUNTIME_PACKAGE.is_dir():
        assert from_runtime, "found no hip./hiprtc. calls in hipmla/runtime/"
    expected = {C_SYMBOL.get(n, n) for n in (*HIP_API, *HIPRTC_API, *from_runtime)}
    assert expected - exported == set()
    assert {n for n in exported if n.startswith("cu") or n.startswith("nvrtc")} == set()


def test_find_compiler_names_a_missing_compiler():
    with pytest.raises(FileNotFoundError, match="nonexistent"):
        nvidia.find_compiler("/nonexistent/cc")


def test_build_shim_reports_compiler_errors(tmp_path):
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'no such luck' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="no such luck"):
        nvidia.build_shim(tmp_path / "out", cc=str(failing))
    assert not (tmp_path / "out" / "lib" / nvidia.LIBRARY).exists()
    assert list((tmp_path / "out" / "lib").iterdir()) == []  # no temporary left behind


def test_default_out_dir_follows_env_and_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("HIPMLA_NVIDIA_DIR", str(tmp_path / "chosen"))
    assert nvidia.default_out_dir() == tmp_path / "chosen"
    monkeypatch.delenv("HIPMLA_NVIDIA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert nvidia.default_out_dir() == tmp_path / "cache" / "hipmla" / "nvidia" / nvidia.source_hash()


def test_source_hash_changes_with_the_sources(monkeypatch, tmp_path):
    copy = tmp_path / "nvidia"
    shutil.copytree(SOURCE_DIR, copy)
    monkeypatch.setattr(nvidia, "shim_source_dir", lambda: copy)
    before = nvidia.source_hash()
    with open(copy / "hip_on_cuda.c", "a") as f:
        f.write("\n")
    assert nvidia.source_hash() != before


def test_shim_root_builds_only_when_allowed(monkeypatch, tmp_path):
    root = tmp_path / "root"
    monkeypatch.setenv("HIPMLA_NVIDIA_DIR", str(root))
    monkeypatch.delenv("HIPMLA_NVRTC", raising=False)
    assert nvidia.shim_root(build=False) == root
    assert not root.exists()
    assert nvidia.shim_root(build=True) == root
    assert (root / "lib" / nvidia.LIBRARY).is_file()
    pip_nvrtc = nvidia.find_nvrtc()
    assert os.environ.get("HIPMLA_NVRTC") == (str(pip_nvrtc) if pip_nvrtc else None)


def test_main_builds_and_prints_the_root(tmp_path, capsys):
    assert nvidia.main(["--", "--out", str(tmp_path / "cli")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "cli")
    assert f"ROCM_PATH={tmp_path / 'cli'}" in err and "HIPMLA_PLATFORM=nvidia" in err
    # a compiler that is not there is a bad argument (2, as the other commands answer one), named as an option
    assert nvidia.main(["--out", str(tmp_path / "bad"), "--cc", "/nonexistent/cc"]) == 2
    assert "hipmla nvidia-runtime: --cc: expected a C compiler on PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # '' would be the current folder
        nvidia.main(["--out", ""])
    assert "argument --out: expected a folder" in capsys.readouterr().err


def test_nvidia_gpu_present_is_false_without_libcuda(monkeypatch):
    monkeypatch.setenv("HIPMLA_LIBCUDA", MISSING_LIBCUDA)
    assert nvidia.nvidia_gpu_present() is False


# --- the library's copies of HIP and CUDA definitions ------------------------------------


def header_constants(name: str, pattern: str) -> dict[str, int]:
    text = (SOURCE_DIR / name).read_text()
    return {m[1]: int(m[2], 0) for m in re.finditer(rf"^\s*({pattern})\s*=\s*(\w+)", text, re.M)}


def test_hip_enum_values_match_hip_python():
    from hip import hip, hiprtc

    constants = header_constants("hip_types.h", r"hip\w+|HIPRTC_\w+")
    enums = {
        "hipDeviceAttribute": hip.hipDeviceAttribute_t,
        "hipMemcpy": hip.hipMemcpyKind,
        "hip": hip.hipError_t,  # hipSuccess, hipError*
        "HIPRTC_": hiprtc.hiprtcResult,
    }
    assert len(constants) > 100
    for name, value in constants.items():
        enum = next(e for prefix, e in enums.items() if name.startswith(prefix))
        assert int(enum[name]) == value, name


def find_cuda_header() -> Path | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             *sorted(map(str, Path("/usr/local").glob("cuda-*")), reverse=True)]
    for root in filter(None, roots):
        header = Path(root) / "include" / "cuda.h"
        if header.is_file():
            return header
    return None


@pytest.mark.skipif(find_cuda_header() is None, reason="no CUDA toolkit header to compare with")
def test_cuda_constants_match_cuda_h():
    ours = header_constants("cuda_driver.h", r"CU_\w+|CUDA_\w+")
    text = find_cuda_header().read_text()
    theirs = {m[1]: int(m[2], 0)
              for m in re.finditer(r"^\s*(CU_\w+|CUDA_\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+)", text, re.M)}
    theirs.update({m[1]: int(m[2], 0)
                   for m in re.finditer(r"#define\s+(CU_\w+_AS_INT)\s+(0x[0-9a-fA-F]+|\d+)", text)})
    assert len(ours) > 100
    assert {n: v for n, v in ours.items() if theirs.get(n) != v} == {}


def filled_fields() -> list[str]:
    """Props fields hip_on_cuda.c writes (its PROP table, those set by hand, the last one)."""
    source = (SOURCE_DIR / "hip_on_cuda.c").read_text()
    table = re.findall(r"^\s*PROP\(([\w\[\]]+),", source, re.M)
    assert len(table) > 30
    return ["name", "totalGlobalMem", "gcnArchName", "asicRevision", *table]


def test_device_props_layout_matches_hip_python(tmp_path):
    """Write a marker at each of our field offsets, read it back through hip-python."""
    from hip import hip

    fields = filled_fields()
    lines = "\n".join(
        f'    printf("%s %zu %zu\\n", "{f}", offsetof(hipDeviceProp_tR0600, {f}), '
        f"sizeof(((hipDeviceProp_tR0600 *)0)->{f}));" for f in fields
    )
    program = tmp_path / "offsets.c"
    program.write_text(f'#include <stdio.h>\n#include "hip_types.h"\nint main(void) {{\n{lines}\n'
                       f'    printf("size %zu 0\\n", sizeof(hipDeviceProp_tR0600));\n}}\n')
    subprocess.run([nvidia.find_compiler(), "-std=gnu11", "-I", str(SOURCE_DIR), str(program),
                    "-o", str(tmp_path / "offsets")], check=True)
    rows = subprocess.run([str(tmp_path / "offsets")], capture_output=True, text=True,
                          check=True).stdout.split("\n")
    layout = {name: (int(off), int(size)) for name, off, size in (r.split() for r in rows if r)}
    props = hip.hipDeviceProp_t()
    assert layout.pop("size")[0] == props.c_sizeof() == 1472
    base = props.as_c_void_p().value
    for marker, (field, (offset, size)) in enumerate(layout.items(), start=1000):
        name, _, index = field.partition("[")
        if size == 256:  # char arrays
            ctypes.memmove(base + offset, f"m{marker}\0".encode(), 6)
            assert getattr(props, name) == f"m{marker}", field
            continue
        ctype = {4: ctypes.c_int, 8: ctypes.c_size_t}[size]
        ctype.from_address(base + offset).value = marker
        value = getattr(props, name)
        assert (value[int(index[:-1])] if index else value) == marker, field


def test_error_names_match_hip_python(shim):
    result = run_child(f"""
        import ctypes, json, os
        lib = ctypes.CDLL({str(shim / "lib" / nvidia.LIBRARY)!r})
        lib.hipGetErrorName.restype = ctypes.c_char_p
        lib.hipGetErrorString.restype = ctypes.c_char_p
        names = {{c: lib.hipGetErrorName(c).decode() for c in range(1100)}}
        texts = {{c: lib.hipGetErrorString(c).decode() for c in range(1100)}}
        print(json.dumps({{"names": names, "texts": texts}}))
    """, {"HIPMLA_LIBCUDA": MISSING_LIBCUDA})
    from hip import hip

    named = {int(c): n for c, n in result["names"].items() if n != "hipErrorUnknown"}
    assert len(named) > 60 and named[0] == "hipSuccess"
    assert {c: n for c, n in named.items() if hip.hipError_t(c).name != n} == {}
    assert result["names"]["1000"] == "hipErrorUnknown"  # not a HIP code
    assert all(result["texts"][str(c)] for c in named)


# --- the library without a GPU -------------------------------------------------------------


def test_runtime_calls_fail_cleanly_without_libcuda(shim):
    result = run_child(f"""
        import ctypes, json, os
        lib = ctypes.CDLL({str(shim / "lib" / nvidia.LIBRARY)!r})
        count = ctypes.c_int(-1)
        pointer = ctypes.c_void_p(1)
        out = {{
            "init": lib.hipInit(0),
            "count": lib.hipGetDeviceCount(ctypes.byref(count)),
            "count_value": count.value,
            "malloc": lib.hipMalloc(ctypes.byref(pointer), 16),
            "pointer": pointer.value,
            "sync": lib.hipDeviceSynchronize(),
            "launch": lib.hipModuleLaunchKernel(ctypes.c_void_p(8), 1, 1, 1, 1, 1, 1, 0, None, None, None),
            "last": lib.hipGetLastError(),
            "last_after_reset": lib.hipGetLastError(),
        }}
        print(json.dumps(out))
    """, {"HIPMLA_LIBCUDA": MISSING_LIBCUDA})
    no_device = 100
    assert result == {"init": no_device, "count": no_device, "count_value": 0,
                      "malloc": no_device, "pointer": None, "sync": no_device,
                      "launch": no_device, "last": no_device, "last_after_reset": 0}


def test_hip_python_reports_errors_not_crashes_without_gpu(shim):
    result = run_child("""
        import json
        from hip import hip
        status, props = hip.hipGetDeviceProperties(0)
        print(json.dumps({
            "props": int(status),
            "count": [int(v) for v in hip.hipGetDeviceCount()],
            "attribute": int(hip.hipDeviceGetAttribute(
                hip.hipDeviceAttribute_t.hipDeviceAttributeMultiprocessorCount, 0)[0]),
            "malloc": int(hip.hipMalloc(64)[0]),
            "name": str(hip.hipGetErrorName(status)[1]),
        }))
    """, {**nvidia.shim_env(shim), "HIPMLA_LIBCUDA": MISSING_LIBCUDA})
    assert result == {"props": 100, "count": [100, 0], "attribute": 100, "malloc": 100,
                      "name": "hipErrorNoDevice"}


@pytest.mark.skipif(any(map(_loads, NVRTC_FALLBACKS)), reason="the loader finds an NVRTC here")
def test_hiprtc_without_nvrtc_returns_an_error(shim):
    result = run_child(f"""
        import ctypes, json, os
        lib = ctypes.CDLL({str(shim / "lib" / nvidia.LIBRARY)!r})
        major, minor, version = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        program = ctypes.c_void_p()
        print(json.dumps({{
            "version": lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)),
            "create": lib.hiprtcCreateProgram(ctypes.byref(program), b"", b"x", 0, None, None),
            "runtime_version": lib.hipRuntimeGetVersion(ctypes.byref(version)),
        }}))
    """, {"HIPMLA_NVRTC": "/nonexistent/libnvrtc.so", "HIPMLA_LIBCUDA": MISSING_LIBCUDA})
    internal_error, not_initialized = 11, 3
    assert result == {"version": internal_error, "create": internal_error,
                      "runtime_version": not_initialized}


HIPRTC_SCRIPT = """
    import json
    from hip import hiprtc

    def compile(source, options):
        status, prog = hiprtc.hiprtcCreateProgram(source.encode(), b"probe.hip", 0, [], [])
        assert int(status) == 0, status
        (status,) = hiprtc.hiprtcCompileProgram(prog, len(options), [o.encode() for o in options])
        _, log_size = hiprtc.hiprtcGetProgramLogSize(prog)
        log = bytearray(log_size)
        hiprtc.hiprtcGetProgramLog(prog, log)
        code = b""
        if int(status) == 0:
            _, size = hiprtc.hiprtcGetCodeSize(prog)
            buffer = bytearray(size)
            hiprtc.hiprtcGetCode(prog, buffer)
            code = bytes(buffer)
        (destroyed,) = hiprtc.hiprtcDestroyProgram(prog.createRef())
        return {"status": int(status), "log": log.rstrip(b"\\0").decode(), "code": code.hex(),
                "destroyed": int(destroyed)}

    version = hiprtc.hiprtcVersion()
    print(json.dumps({
        "version": [int(v) for v in version],
        "cubin": compile(KERNEL, ["--offload-arch=sm_90", "-O3", "-mcumode", "-DUNUSED=1"]),
        "ptx": compile(KERNEL, ["-std=c++17"]),
        "broken": compile("extern \\"C\\" __global__ void f() { undeclared_thing(); }",
                          ["--offload-arch=sm_90"]),
        "amd": compile(KERNEL, ["--offload-arch=gfx950"]),
        "error_string": str(hiprtc.hiprtcGetErrorString(hiprtc.hiprtcResult.HIPRTC_ERROR_COMPILATION)[1]),
    }))
"""


@pytest.fixture(scope="module")
def hiprtc_results(shim) -> dict:
    """hip-python's hiprtc driven against the shim with NVRTC and without libcuda."""
    script = f"KERNEL = {PROBE_KERNEL!r}\n" + textwrap.dedent(HIPRTC_SCRIPT)
    return run_child(script, {**nvidia.shim_env(shim), "HIPMLA_LIBCUDA": MISSING_LIBCUDA})


@needs_nvrtc
def test_hiprtc_compiles_a_cubin_for_sm_90(hiprtc_results):
    assert hiprtc_results["version"][0] == 0 and hiprtc_results["version"][1] >= 12
    cubin = hiprtc_results["cubin"]
    assert cubin["status"] == 0, cubin["log"]
    code = bytes.fromhex(cubin["code"])
    assert code[:4] == b"\x7fELF"
    assert b"hipmla_probe" in code and b"hipmla_probe_shared" in code
    assert cubin["destroyed"] == 0


@needs_nvrtc
def test_hiprtc_without_an_arch_and_gpu_yields_ptx(hiprtc_results):
    ptx = hiprtc_results["ptx"]
    assert ptx["status"] == 0, ptx["log"]
    assert b".entry hipmla_probe" in bytes.fromhex(ptx["code"])


@needs_nvrtc
def test_hiprtc_compile_error_returns_compilation_and_log(hiprtc_results):
    broken = hiprtc_results["broken"]
    assert broken["status"] == 6  # HIPRTC_ERROR_COMPILATION
    assert "undeclared_thing" in broken["log"] and "error" in broken["log"]
    assert hiprtc_results["error_string"] == "HIPRTC_ERROR_COMPILATION"


@needs_nvrtc
def test_hiprtc_refuses_an_amd_target_with_a_reason(hiprtc_results):
    amd = hiprtc_results["amd"]
    assert amd["status"] == 5  # HIPRTC_ERROR_INVALID_OPTION
    assert "gfx950" in amd["log"] and "NVIDIA" in amd["log"]


# --- against a fake libcuda ------------------------------------------------------------------

#: A libcuda.so.1 stand-in: "device" memory is host memory, kernels are C functions picked by
#: name, attributes are 1000 + the CUDA attribute number (compute capability 9.0). Launches
#: accept only CUDA's `extra` layout, and a launch over 48 KiB of dynamic shared memory
#: fails unless the function was opted in first, as on a real driver.
FAKE_LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { int *out; unsigned n; } Args;
static __thread void *current;
static int optin;
int cuInit(unsigned f) { return f ? 1 : 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int o) { if (o != 0) return 101; *d = o; return 0; }
int cuDeviceGetName(char *s, int n, int d) { strncpy(s, "NVIDIA Fake H200", n); return d; }
int cuDeviceTotalMem_v2(size_t *b, int d) { *b = 150000000000ull; return d; }
int cuDeviceGetAttribute(int *v, int a, int d) { *v = a == 75 ? 9 : a == 76 ? 0 : 1000 + a; return d; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)0x1234; return d; }
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSetCurrent(void *c) { current = c; return 0; }
int cuCtxSynchronize(void) { return current ? 0 : 201; }
int cuMemAlloc_v2(void **p, size_t n) { *p = malloc(n); return 0; }
int cuMemFree_v2(void *p) { free(p); return 0; }
int cuMemGetInfo_v2(size_t *f, size_t *t) { *f = 1; *t = 2; return 0; }
int cuMemcpy(void *d, const void *s, size_t n) { memcpy(d, s, n); return 0; }
int cuMemcpyHtoD_v2(void *d, const void *s, size_t n) { memcpy(d, s, n); return 0; }
int cuMemcpyDtoH_v2(void *d, const void *s, size_t n) { memcpy(d, s, n); return 0; }
int cuMemcpyDtoD_v2(void *d, const void *s, size_t n) { memcpy(d, s, n); return 0; }
int cuMemcpyAsync(void *d, const void *s, size_t n, void *q) { memcpy(d, s, n); return 0; }
int cuMemcpyHtoDAsync_v2(void *d, const void *s, size_t n, void *q) { memcpy(d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void *d, const void *s, size_t n, void *q) { memcpy(d, s, n); return 0; }
int cuMemcpyDtoDAsync_v2(void *d, const void *s, size_t n, void *q) { memcpy(d, s, n); return 0; }
int cuMemsetD8Async(void *d, unsigned char v, size_t n, void *q) { memset(d, v, n); return 0; }
int cuStreamCreate(void **q, unsigned f) { *q = malloc(1); return f; }
int cuStreamDestroy_v2(void *q) { free(q); return 0; }
int cuStreamSynchronize(void *q) { return 0; }
int cuEventCreate(void **e, unsigned f) { *e = malloc(1); return f; }
int cuEventDestroy_v2(void *e) { free(e); return 0; }
int cuEventRecord(void *e, void *q) { return 0; }
int cuEventSynchronize(void *e) { return 0; }
int cuEventElapsedTime_v2(float *ms, void *a, void *b) { *ms = 1.5f; return 0; }
int cuModuleLoadData(void **m, const void *image) { *m = (void *)image; return 0; }
int cuModuleUnload(void *m) { return 0; }
static const char *kernels[] = {"fill", "misaligned", "mystery"};
int cuModuleGetFunction(void **f, void *m, const char *name) {
    for (int i = 0; i < 3; ++i) if (!strcmp(name, kernels[i])) { *f = (void *)kernels[i]; return 0; }
    return 500;
}
static int attribute_calls;
int fake_attribute_calls(void) { return attribute_calls; }
int cuFuncSetAttribute(void *f, int attribute, int value) {
    ++attribute_calls;
    if (attribute == 8) optin = value;
    return 0;
}
int cuLaunchKernel(const char *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *q, void **params, void **extra) {
    if (!current || params || !extra || extra[0] != (void *)1 || extra[2] != (void *)2 ||
        extra[4] != (void *)0 || *(size_t *)extra[3] != sizeof(Args))
        return 1;
    if (shared > 48 * 1024 && (unsigned)optin < shared) return 1;
    if (f == kernels[1]) return 716;
    if (f == kernels[2]) return 4242;
    Args *args = extra[1];
    for (unsigned i = 0; i < args->n && i < gx * bx; ++i) args->out[i] = (int)i + (shared ? 1 : 0);
    return 0;
}
"""

FAKE_SCRIPT = """
    import ctypes, json, os
    import numpy as np
    from hip import hip, hiprtc

    class Args(ctypes.Structure):
        _fields_ = [("out", ctypes.c_void_p), ("n", ctypes.c_uint)]

    def status(result):
        return int(result[0] if isinstance(result, tuple) else result)

    A = hip.hipDeviceAttribute_t
    K = hip.hipMemcpyKind
    out = {"init": status(hip.hipInit(0)), "bad_device": status(hip.hipSetDevice(1))}
    err, props = hip.hipGetDeviceProperties(0)
    out["props"] = {f: getattr(props, f) for f in (
        "name", "gcnArchName", "totalGlobalMem", "multiProcessorCount", "warpSize", "major",
        "minor", "l2CacheSize", "memoryClockRate", "memoryBusWidth", "pciBusID",
        "sharedMemPerBlock", "sharedMemPerBlockOptin", "maxThreadsDim")}
    out["attributes"] = {a: hip.hipDeviceGetAttribute(getattr(A, a), 0)[1] for a in ATTRIBUTES}
    module = hip.hipModuleLoadData(b"image")[1]
    functions = {k: hip.hipModuleGetFunction(module, k.encode()) for k in ("fill", "misaligned", "mystery", "missing")}
    out["missing"] = status(functions.pop("missing"))
    n = 300
    host = np.arange(n, dtype=np.int32) * 5
    a, b = hip.hipMalloc(4 * n)[1], hip.hipMalloc(4 * n)[1]
    stream = hip.hipStreamCreate()[1]
    copies = [
        status(hip.hipMemcpy(a, host, 4 * n, K.hipMemcpyHostToDevice)),
        status(hip.hipMemcpyAsync(b, a, 4 * n, K.hipMemcpyDeviceToDevice, stream)),
    ]
    back = np.zeros(n, np.int32)
    copies.append(status(hip.hipMemcpy(back, b, 4 * n, K.hipMemcpyDefault)))
    out["copies"] = copies
    out["copied"] = back.tolist() == host.tolist()
    out["memset"] = status(hip.hipMemsetAsync(b, 0, 4 * n, stream))
    args = Args(int(b), n)
    launches = {}
    for name, shared in (("fill", 0), ("fill", 64 * 1024), ("misaligned", 0), ("mystery", 0)):
        result = hip.hipModuleLaunchKernel(functions[name][1], 3, 1, 1, 128, 1, 1, shared, stream, None, (args,))
        hip.hipMemcpyAsync(back, b, 4 * n, K.hipMemcpyDeviceToHost, stream)
        launches[f"{name}/{shared}"] = [status(result), back[:3].tolist() + back[-1:].tolist()]
    out["launches"] = launches
    # Dynamic shared memory above 48 KiB is granted once per function and size: the driver
    # sees a call for a larger size, and again after a module unload, not every launch.
    fake = ctypes.CDLL(os.environ["HIPMLA_LIBCUDA"])
    grants = [fake.fake_attribute_calls()]
    for shared in (64 * 1024, 80 * 1024, 64 * 1024, 80 * 1024):
        hip.hipModuleLaunchKernel(functions["fill"][1], 3, 1, 1, 128, 1, 1, shared, stream, None, (args,))
        grants.append(fake.fake_attribute_calls())
    other = hip.hipModuleLoadData(b"image2")[1]
    hip.hipModuleUnload(other)
    fill = hip.hipModuleGetFunction(module, b"fill")[1]
    hip.hipModuleLaunchKernel(fill, 3, 1, 1, 128, 1, 1, 64 * 1024, stream, None, (args,))
    grants.append(fake.fake_attribute_calls())
    out["grants"] = grants
    e0, e1 = hip.hipEventCreate()[1], hip.hipEventCreate()[1]
    hip.hipEventRecord(e0, stream); hip.hipEventRecord(e1, stream)
    out["elapsed"] = hip.hipEventElapsedTime(e0, e1)[1]
    out["driver"] = hip.hipDriverGetVersion()[1]
    out["mem_info"] = [int(v) for v in hip.hipMemGetInfo()[1:]]
    out["cleanup"] = [status(r) for r in (
        hip.hipEventDestroy(e0), hip.hipEventDestroy(e1), hip.hipStreamSynchronize(stream),
        hip.hipStreamDestroy(stream), hip.hipFree(a), hip.hipFree(b), hip.hipModuleUnload(module),
        hip.hipDeviceSynchronize())]
    if WITH_NVRTC:
        prog = hiprtc.hiprtcCreateProgram(b'extern "C" __global__ void k() {}', b"k", 0, [], [])[1]
        out["default_arch_compile"] = status(hiprtc.hiprtcCompileProgram(prog, 0, []))
        code = bytearray(hiprtc.hiprtcGetCodeSize(prog)[1])
        hiprtc.hiprtcGetCode(prog, code)
        out["default_arch_code"] = bytes(code[:4]).hex()
    print(json.dumps(out))
"""

#: hipmla's attributes, with the value the fake reports through the right CUDA attribute.
FAKE_ATTRIBUTES = {
    "hipDeviceAttributeMultiprocessorCount": 1016,
    "hipDeviceAttributeMaxSharedMemoryPerBlock": 1008,
    "hipDeviceAttributeSharedMemPerBlockOptin": 1097,
    "hipDeviceAttributeWarpSize": 1010,
    "hipDeviceAttributeComputeCapabilityMajor": 9,
    "hipDeviceAttributeComputeCapabilityMinor": 0,
    "hipDeviceAttributeL2CacheSize": 1038,
    "hipDeviceAttributeMemoryClockRate": 1036,
    "hipDeviceAttributeMemoryBusWidth": 1037,
}


@pytest.fixture(scope="module")
def fake_results(shim, tmp_path_factory) -> dict:
    """hip-python driven against the shim on top of FAKE_LIBCUDA."""
    directory = tmp_path_factory.mktemp("fake_cuda")
    (directory / "fake_cuda.c").write_text(FAKE_LIBCUDA)
    library = directory / "libcuda.so.1"
    subprocess.run([nvidia.find_compiler(), "-shared", "-fPIC", "-w", "-o", str(library),
                    str(directory / "fake_cuda.c")], check=True)
    script = (f"ATTRIBUTES = {list(FAKE_ATTRIBUTES)!r}\nWITH_NVRTC = {nvrtc_available()!r}\n"
              + textwrap.dedent(FAKE_SCRIPT))
    return run_child(script, {**nvidia.shim_env(shim), "HIPMLA_LIBCUDA": str(library)})


def test_fake_device_properties_land_in_hip_python_fields(fake_results):
    assert fake_results["init"] == 0 and fake_results["bad_device"] == 101
    assert fake_results["props"] == {
        "name": "NVIDIA Fake H200", "gcnArchName": "sm_90", "totalGlobalMem": 150000000000,
        "multiProcessorCount": 1016, "warpSize": 1010, "major": 9, "minor": 0,
        "l2CacheSize": 1038, "memoryClockRate": 1036, "memoryBusWidth": 1037, "pciBusID": 1033,
        "sharedMemPerBlock": 1008, "sharedMemPerBlockOptin": 1097,
        "maxThreadsDim": [1002, 1003, 1004],
    }


def test_fake_attributes_are_translated_to_cuda_numbers(fake_results):
    assert fake_results["attributes"] == FAKE_ATTRIBUTES


def test_fake_memory_calls(fake_results):
    assert fake_results["copies"] == [0, 0, 0] and fake_results["copied"]
    assert fake_results["memset"] == 0
    assert fake_results["mem_info"] == [1, 2]
    assert fake_results["cleanup"] == [0] * 8


def test_fake_launch_translates_extra_and_opts_into_shared_memory(fake_results):
    launches = fake_results["launches"]
    assert launches["fill/0"] == [0, [0, 1, 2, 299]]
    assert launches["fill/65536"] == [0, [1, 2, 3, 300]]


def test_fake_launch_grants_dynamic_shared_memory_once_per_function_and_size(fake_results):
    # One grant for the 64 KiB launch before; then 64 KiB again: none; 80 KiB: one; both
    # again: none; after a module unload the grant is made anew.
    g = fake_results["grants"]
    assert [b - a for a, b in zip(g, g[1:])] == [0, 1, 0, 0, 1]


def test_fake_cuda_errors_map_to_hip_errors(fake_results):
    assert fake_results["launches"]["misaligned/0"][0] == 719  # hipErrorLaunchFailure
    assert fake_results["launches"]["mystery/0"][0] == 999  # unknown -> hipErrorUnknown
    assert fake_results["missing"] == 500  # hipErrorNotFound


def test_fake_events_and_versions(fake_results):
    assert fake_results["elapsed"] == 1.5
    assert fake_results["driver"] == 13000


@needs_nvrtc
def test_hiprtc_defaults_to_the_current_devices_arch(fake_results):
    assert fake_results["default_arch_compile"] == 0
    assert fake_results["default_arch_code"] == b"\x7fELF".hex()


# --- on an NVIDIA GPU ------------------------------------------------------------------------

GPU_SCRIPT = """
    import ctypes, json, os
    import numpy as np
    from hip import hip, hiprtc

    def ok(result):
        status = result[0] if isinstance(result, tuple) else result
        assert int(status) == 0, (status, result)
        return result[1] if isinstance(result, tuple) and len(result) == 2 else result

    class ProbeArgs(ctypes.Structure):
        _fields_ = [("out", ctypes.c_void_p), ("n", ctypes.c_uint)]

    ok(hip.hipInit(0))
    ok(hip.hipSetDevice(0))
    props = ok(hip.hipGetDeviceProperties(0))
    attr = lambda a: ok(hip.hipDeviceGetAttribute(getattr(hip.hipDeviceAttribute_t, a), 0))
    arch = str(props.gcnArchName)
    prog = ok(hiprtc.hiprtcCreateProgram(KERNEL.encode(), b"probe.hip", 0, [], []))
    ok(hiprtc.hiprtcCompileProgram(prog, 2, [f"--offload-arch={arch}".encode(), b"-O3"]))
    code = bytearray(ok(hiprtc.hiprtcGetCodeSize(prog)))
    ok(hiprtc.hiprtcGetCode(prog, code))
    module = ok(hip.hipModuleLoadData(code))
    n, block = 1000, 128
    grid = (n + block - 1) // block
    nbytes = n * 4
    out = ok(hip.hipMalloc(nbytes))
    stream = ok(hip.hipStreamCreate())
    start, stop = ok(hip.hipEventCreate()), ok(hip.hipEventCreate())
    args = ProbeArgs(int(out), n)
    results = {}
    for kernel, shared in (("hipmla_probe", 0), ("hipmla_probe_shared", 64 * 1024)):
        function = ok(hip.hipModuleGetFunction(module, kernel.encode()))
        ok(hip.hipMemsetAsync(out, 0xFF, nbytes, stream))
        ok(hip.hipEventRecord(start, stream))
        ok(hip.hipModuleLaunchKernel(function, grid, 1, 1, block, 1, 1, shared, stream, None, (args,)))
        ok(hip.hipEventRecord(stop, stream))
        ok(hip.hipEventSynchronize(stop))
        host = np.empty(n, np.int32)
        ok(hip.hipMemcpyAsync(host, out, nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToHost, stream))
        ok(hip.hipStreamSynchronize(stream))
        results[kernel] = {"values": host.tolist(), "ms": float(ok(hip.hipEventElapsedTime(start, stop)))}
    source = np.arange(n, dtype=np.int32) * 3
    ok(hip.hipMemcpy(out, source, nbytes, hip.hipMemcpyKind.hipMemcpyHostToDevice))
    copy = ok(hip.hipMalloc(nbytes))
    ok(hip.hipMemcpy(copy, out, nbytes, hip.hipMemcpyKind.hipMemcpyDeviceToDevice))
    back = np.empty(n, np.int32)
    ok(hip.hipMemcpy(back, copy, nbytes, hip.hipMemcpyKind.hipMemcpyDefault))
    ok(hip.hipDeviceSynchronize())
    free, total = hip.hipMemGetInfo()[1:]
    for resource in (start, stop):
        ok(hip.hipEventDestroy(resource))
    ok(hip.hipStreamDestroy(stream))
    ok(hip.hipFree(out)); ok(hip.hipFree(copy))
    ok(hip.hipModuleUnload(module))
    print(json.dumps({
        "name": str(props.name), "arch": arch, "major": props.major, "minor": props.minor,
        "sm_count": props.multiProcessorCount, "sm_attr": attr("hipDeviceAttributeMultiprocessorCount"),
        "warp": attr("hipDeviceAttributeWarpSize"), "optin": attr("hipDeviceAttributeSharedMemPerBlockOptin"),
        "total_mem": props.totalGlobalMem, "free": int(free), "total": int(total),
        "bus_width": attr("hipDeviceAttributeMemoryBusWidth"), "l2": props.l2CacheSize,
        "launches": results, "roundtrip": back.tolist() == source.tolist(),
        "driver": ok(hip.hipDriverGetVersion()),
    }))
"""


@pytest.fixture(scope="module")
def gpu_results(shim) -> dict:
    if not nvidia.nvidia_gpu_present():
        pytest.skip("needs an NVIDIA GPU")
    script = f"KERNEL = {PROBE_KERNEL!r}\n" + textwrap.dedent(GPU_SCRIPT)
    return run_child(script, nvidia.shim_env(shim))


@pytest.mark.gpu
def test_gpu_device_properties(gpu_results):
    assert "NVIDIA" in gpu_results["name"]
    assert gpu_results["arch"] == f"sm_{gpu_results['major']}{gpu_results['minor']}"
    assert gpu_results["sm_count"] == gpu_results["sm_attr"] > 0
    assert gpu_results["warp"] == 32
    assert gpu_results["optin"] > 48 * 1024
    assert 0 < gpu_results["free"] <= gpu_results["total"] == gpu_results["total_mem"]
    assert gpu_results["bus_width"] > 0 and gpu_results["l2"] > 0
    assert gpu_results["driver"] >= 12000


@pytest.mark.gpu
def test_gpu_launch_with_struct_argument_writes_global_ids(gpu_results):
    launch = gpu_results["launches"]["hipmla_probe"]
    assert launch["values"] == list(range(1000))
    assert launch["ms"] > 0


@pytest.mark.gpu
def test_gpu_launch_above_48k_dynamic_shared_memory(gpu_results):
    launch = gpu_results["launches"]["hipmla_probe_shared"]
    assert launch["values"] == [i + 1 for i in range(1000)]


@pytest.mark.gpu
def test_gpu_memcpy_kinds_roundtrip(gpu_results):
    assert gpu_results["roundtrip"] is True


# --- hip-python releases: the oldest and newest that match a ROCm we support ------------------

#: hip-python 6.4.0 is the first release for ROCm 6.4, 7.2.2 the newest for ROCm 7 on the
#: registry (2026-12-01); 10.x, the bindings package, is what the rest of the tests use.
HIP_PYTHON_RELEASES = ("6.4.0.549.36", "7.2.2.562.43")

VERSIONS_SCRIPT = """
    import json
    import hip.chip as chip
    from hip import hip, hiprtc
    from hipmla import runtime

    runtime.point_hip_python_at_rocm_path()  # what runtime does before hip-python's first call
    missing = [n for n in HIP_NAMES if not hasattr(hip, n)] + [n for n in RTC_NAMES if not hasattr(hiprtc, n)]
    missing += [n for n in ATTRS if not hasattr(hip.hipDeviceAttribute_t, n)]
    missing += [n for n in KINDS if not hasattr(hip.hipMemcpyKind, n)]
    status, prog = hiprtc.hiprtcCreateProgram(KERNEL.encode(), b"probe.hip", 0, [], [])
    (status,) = hiprtc.hiprtcCompileProgram(prog, 1, [b"--offload-arch=sm_90"])
    _, size = hiprtc.hiprtcGetCodeSize(prog)
    code = bytearray(size)
    hiprtc.hiprtcGetCode(prog, code)
    print(json.dumps({"missing": missing, "dll": chip.DLL.decode(), "status": int(status),
                      "elf": bytes(code[:4]) == b"\\x7fELF", "launcher": runtime.launch._hip_library_path()}))
"""


def _runtime_names() -> dict[str, list[str]]:
    """Every hip-python name hipmla/runtime/ uses: functions of hip and hiprtc, the device
    attributes and the memcpy kinds."""
    sources = runtime_sources(Path(runtime.__file__).parent)
    found: dict[str, set] = {"hip": set(), "hiprtc": set(), "names": set()}
    for source in sources:
        for owner, name in attributes_of(source):
            if owner in found:
                found[owner].add(name)
    kinds = sorted({k for source in sources for k in re.findall(r'"(hipMemcpy\w+To\w+)"', source)})
    # functions only (hip.chip / hip.chiprtc are the library-name modules)
    return {"HIP_NAMES": sorted(n for n in found["hip"] - {"hipDeviceAttribute_t", "hipMemcpyKind", "hipError_t"}
                                if n.startswith("hip")),
            "RTC_NAMES": sorted(found["hiprtc"]), "ATTRS": sorted(found["names"]), "KINDS": kinds}


@needs_nvrtc
@pytest.mark.parametrize("release", HIP_PYTHON_RELEASES)
def test_runtime_works_with_older_hip_python_releases(shim, release, tmp_path_factory):
    """pyproject admits hip-python >= 6.4: the releases of ROCm 6.4 and 7.x import without
    ROCm, have every name hipmla calls, and reach hipmla's HIP-on-CUDA hiprtc through
    ROCM_PATH once runtime points their bare library names at it."""
    cache = Path.home() / ".cache" / "hipmla-test-wheels"
    target = cache / f"hip-python-{release}-py{sys.version_info[0]}{sys.version_info[1]}"
    if not (target / "hip").is_dir():
        got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                              str(target), f"hip-python=={release}"], capture_output=True, text=True, timeout=600)
        if got.returncode != 0:
            pytest.skip(f"hip-python {release} could not be installed here (no registry?): {got.stderr[-300:]}")
    names = _runtime_names()
    assert "hipModuleLaunchKernel" in names["HIP_NAMES"] and names["ATTRS"] and len(names["KINDS"]) == 3
    prelude = "".join(f"{k} = {v!r}\n" for k, v in names.items()) + f"KERNEL = {PROBE_KERNEL!r}\n"
    env = {**nvidia.shim_env(shim), "HIPMLA_LIBCUDA": MISSING_LIBCUDA,
           "PYTHONPATH": os.pathsep.join([str(target), str(Path(__file__).resolve().parent.parent)])}
    result = run_child(prelude + textwrap.dedent(VERSIONS_SCRIPT), env)
    assert result["missing"] == [], result["missing"]
    assert result["dll"] == str(shim / "lib" / "libamdhip64.so")
    assert result["launcher"] == result["dll"]  # the ctypes launch binds what hip-python loaded
    assert result["status"] == 0 and result["elf"]
