/* The few CUDA driver API and NVRTC declarations hip_on_cuda.c needs.
 *
 * Declared here instead of including cuda.h / nvrtc.h so that the library builds with a
 * plain C compiler on machines without a CUDA toolkit; both libraries are opened with
 * dlopen at run time. Values are from the CUDA 13 driver API reference;
 * tests/test_nvidia.py compares them with cuda.h wherever a toolkit is installed.
 */
#ifndef HIPMLA_NVIDIA_CUDA_DRIVER_H
#define HIPMLA_NVIDIA_CUDA_DRIVER_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_PROFILER_DISABLED = 5,
    CUDA_ERROR_PROFILER_NOT_INITIALIZED = 6,
    CUDA_ERROR_PROFILER_ALREADY_STARTED = 7,
    CUDA_ERROR_PROFILER_ALREADY_STOPPED = 8,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER = 36,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202,
    CUDA_ERROR_MAP_FAILED = 205,
    CUDA_ERROR_UNMAP_FAILED = 206,
    CUDA_ERROR_ARRAY_IS_MAPPED = 207,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_ALREADY_ACQUIRED = 210,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_NOT_MAPPED_AS_ARRAY = 212,
    CUDA_ERROR_NOT_MAPPED_AS_POINTER = 213,
    CUDA_ERROR_ECC_UNCORRECTABLE = 214,
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215,
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE = 216,
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_INVALID_GRAPHICS_CONTEXT = 219,
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_SOURCE = 300,
    CUDA_ERROR_FILE_NOT_FOUND = 301,
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302,
    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED = 303,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_LAUNCH_TIMEOUT = 702,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_ASSERT = 710,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_HARDWARE_STACK_ERROR = 714,
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715,
    CUDA_ERROR_MISALIGNED_ADDRESS = 716,
    CUDA_ERROR_INVALID_ADDRESS_SPACE = 717,
    CUDA_ERROR_INVALID_PC = 718,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902,
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904,
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
    CUDA_ERROR_CAPTURED_EVENT = 907,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910,
    CUDA_ERROR_INVALID_CLUSTER_SIZE = 912,
    CUDA_ERROR_INVALID_RESOURCE_TYPE = 914,
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 915,
    CUDA_ERROR_UNKNOWN = 999,
};

typedef enum CUdevice_attribute {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8,
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9,
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
    CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12,
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13,
    CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT = 14,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT = 17,
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18,
    CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
    CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31,
    CU_DEVICE_ATTRIBUTE_ECC_ENABLED = 32,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
    CU_DEVICE_ATTRIBUTE_TCC_DRIVER = 35,
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36,
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
    CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78,
    CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED = 79,
    CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED = 80,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82,
    CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83,
    CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD = 84,
    CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID = 85,
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89,
    CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED = 90,
    CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR = 106,
    CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108,
    CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109,
    CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111,
} CUdevice_attribute;

enum { CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8 };

/* CUDA's markers in cuLaunchKernel's `extra`. */
enum {
    CU_LAUNCH_PARAM_END_AS_INT = 0,
    CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT = 1,
    CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT = 2,
};

/* Every driver entry point used, as (member, exported symbol, parameters). The symbol is
 * the versioned one that cuda.h's macros select; where a driver only has the unversioned
 * name (cuEventElapsedTime before CUDA 12.8), the loader falls back to it. */
#define HIPMLA_CUDA_FUNCTIONS(X)                                                          \
    X(cuInit, "cuInit", (unsigned int flags))                                             \
    X(cuDriverGetVersion, "cuDriverGetVersion", (int *version))                           \
    X(cuDeviceGetCount, "cuDeviceGetCount", (int *count))                                 \
    X(cuDeviceGet, "cuDeviceGet", (CUdevice *device, int ordinal))                        \
    X(cuDeviceGetName, "cuDeviceGetName", (char *name, int len, CUdevice device))         \
    X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t *bytes, CUdevice device))          \
    X(cuDeviceGetAttribute, "cuDeviceGetAttribute",                                       \
      (int *value, CUdevice_attribute attribute, CUdevice device))                        \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                               \
      (CUcontext *context, CUdevice device))                                              \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext *context))                           \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext context))                            \
    X(cuCtxSynchronize, "cuCtxSynchronize", (void))                                       \
    X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *dptr, size_t bytes))                     \
    X(cuMemFree, "cuMemFree_v2", (CUdeviceptr dptr))                                      \
    X(cuMemGetInfo, "cuMemGetInfo_v2", (size_t *free_bytes, size_t *total_bytes))         \
    X(cuMemcpy, "cuMemcpy", (CUdeviceptr dst, CUdeviceptr src, size_t bytes))             \
    X(cuMemcpyHtoD, "cuMemcpyHtoD_v2", (CUdeviceptr dst, const void *src, size_t bytes))  \
    X(cuMemcpyDtoH, "cuMemcpyDtoH_v2", (void *dst, CUdeviceptr src, size_t bytes))        \
    X(cuMemcpyDtoD, "cuMemcpyDtoD_v2", (CUdeviceptr dst, CUdeviceptr src, size_t bytes))  \
    X(cuMemcpyAsync, "cuMemcpyAsync",                                                     \
      (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                  \
    X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2",                                          \
      (CUdeviceptr dst, const void *src, size_t bytes, CUstream stream))                  \
    X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2",                                          \
      (void *dst, CUdeviceptr src, size_t bytes, CUstream stream))                        \
    X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2",                                          \
      (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                  \
    X(cuMemsetD8Async, "cuMemsetD8Async",                                                 \
      (CUdeviceptr dst, unsigned char value, size_t count, CUstream stream))              \
    X(cuStreamCreate, "cuStreamCreate", (CUstream *stream, unsigned int flags))           \
    X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream stream))                           \
    X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream stream))                      \
    X(cuEventCreate, "cuEventCreate", (CUevent *event, unsigned int flags))               \
    X(cuEventDestroy, "cuEventDestroy_v2", (CUevent event))                               \
    X(cuEventRecord, "cuEventRecord", (CUevent event, CUstream stream))                   \
    X(cuEventSynchronize, "cuEventSynchronize", (CUevent event))                          \
    X(cuEventElapsedTime, "cuEventElapsedTime_v2", (float *ms, CUevent start, CUevent end)) \
    X(cuModuleLoadData, "cuModuleLoadData", (CUmodule *module, const void *image))        \
    X(cuModuleUnload, "cuModuleUnload", (CUmodule module))                                \
    X(cuModuleGetFunction, "cuModuleGetFunction",                                         \
      (CUfunction *function, CUmodule module, const char *name))                          \
    X(cuFuncSetAttribute, "cuFuncSetAttribute",                                           \
      (CUfunction function, int attribute, int value))                                    \
    X(cuLaunchKernel, "cuLaunchKernel",                                                   \
      (CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,       \
       unsigned int block_x, unsigned int block_y, unsigned int block_z,                  \
       unsigned int shared_bytes, CUstream stream, void **params, void **extra))

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

#define HIPMLA_NVRTC_FUNCTIONS(X)                                                         \
    X(nvrtcVersion, "nvrtcVersion", (int *major, int *minor))                             \
    X(nvrtcCreateProgram, "nvrtcCreateProgram",                                           \
      (nvrtcProgram *prog, const char *src, const char *name, int num_headers,            \
       const char *const *headers, const char *const *include_names))                     \
    X(nvrtcCompileProgram, "nvrtcCompileProgram",                                         \
      (nvrtcProgram prog, int num_options, const char *const *options))                   \
    X(nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize", (nvrtcProgram prog, size_t *size)) \
    X(nvrtcGetProgramLog, "nvrtcGetProgramLog", (nvrtcProgram prog, char *log))           \
    X(nvrtcGetCUBINSize, "nvrtcGetCUBINSize", (nvrtcProgram prog, size_t *size))          \
    X(nvrtcGetCUBIN, "nvrtcGetCUBIN", (nvrtcProgram prog, char *cubin))                   \
    X(nvrtcGetPTXSize, "nvrtcGetPTXSize", (nvrtcProgram prog, size_t *size))              \
    X(nvrtcGetPTX, "nvrtcGetPTX", (nvrtcProgram prog, char *ptx))                         \
    X(nvrtcDestroyProgram, "nvrtcDestroyProgram", (nvrtcProgram *prog))

#endif
