/* The HIP runtime and hiprtc C functions hipmla calls, implemented over the CUDA driver
 * API and NVRTC, so that hip-python (and with it hipmla) runs unchanged on NVIDIA GPUs.
 *
 * Built as libamdhip64.so with libhiprtc.so beside it (hipmla/nvidia.py), the pair is found
 * by hip-python through $ROCM_PATH/lib. Both CUDA libraries are opened with dlopen on first
 * use: libcuda.so.1 (or $HIPMLA_LIBCUDA) for the runtime half, NVRTC ($HIPMLA_NVRTC, then
 * libnvrtc.so.13, .12, unversioned) for hiprtc. Without libcuda every runtime call returns
 * hipErrorNoDevice instead of crashing, while hiprtc keeps working with NVRTC alone, so
 * kernels compile through hip-python on machines without a GPU.
 *
 * Handles (streams, events, modules, functions) are the CUDA handles themselves; device
 * pointers are CUdeviceptr values. Each thread has a current device (HIP semantics, 0 by
 * default) whose primary context is made current on entry to every call that needs one,
 * because hip-python may call from any thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_driver.h"
#include "hip_types.h"

#define EXPORT __attribute__((visibility("default")))
#define COUNT(array) (sizeof(array) / sizeof((array)[0]))
#define MAX_DEVICES 64
/* Above this much dynamic shared memory CUDA wants an explicit opt-in per function. */
#define DEFAULT_DYNAMIC_SHARED_LIMIT (48 * 1024)

/* ---------------------------------------------------------------- error codes */

/* CUDA errors with a HIP counterpart; anything else becomes hipErrorUnknown, because
 * hip-python raises ValueError on a status value its enum does not know. */
static const struct {
    CUresult cuda;
    hipError_t hip;
} cuda_to_hip[] = {
    {CUDA_SUCCESS, hipSuccess},
    {CUDA_ERROR_INVALID_VALUE, hipErrorInvalidValue},
    {CUDA_ERROR_OUT_OF_MEMORY, hipErrorOutOfMemory},
    {CUDA_ERROR_NOT_INITIALIZED, hipErrorNotInitialized},
    {CUDA_ERROR_DEINITIALIZED, hipErrorDeinitialized},
    {CUDA_ERROR_PROFILER_DISABLED, hipErrorProfilerDisabled},
    {CUDA_ERROR_PROFILER_NOT_INITIALIZED, hipErrorProfilerNotInitialized},
    {CUDA_ERROR_PROFILER_ALREADY_STARTED, hipErrorProfilerAlreadyStarted},
    {CUDA_ERROR_PROFILER_ALREADY_STOPPED, hipErrorProfilerAlreadyStopped},
    {CUDA_ERROR_STUB_LIBRARY, hipErrorInsufficientDriver},
    {CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER, hipErrorInsufficientDriver},
    {CUDA_ERROR_NO_DEVICE, hipErrorNoDevice},
    {CUDA_ERROR_INVALID_DEVICE, hipErrorInvalidDevice},
    {CUDA_ERROR_INVALID_IMAGE, hipErrorInvalidImage},
    {CUDA_ERROR_INVALID_CONTEXT, hipErrorInvalidContext},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, hipErrorContextAlreadyCurrent},
    {CUDA_ERROR_MAP_FAILED, hipErrorMapFailed},
    {CUDA_ERROR_UNMAP_FAILED, hipErrorUnmapFailed},
    {CUDA_ERROR_ARRAY_IS_MAPPED, hipErrorArrayIsMapped},
    {CUDA_ERROR_ALREADY_MAPPED, hipErrorAlreadyMapped},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, hipErrorNoBinaryForGpu},
    {CUDA_ERROR_ALREADY_ACQUIRED, hipErrorAlreadyAcquired},
    {CUDA_ERROR_NOT_MAPPED, hipErrorNotMapped},
    {CUDA_ERROR_NOT_MAPPED_AS_ARRAY, hipErrorNotMappedAsArray},
    {CUDA_ERROR_NOT_MAPPED_AS_POINTER, hipErrorNotMappedAsPointer},
    {CUDA_ERROR_ECC_UNCORRECTABLE, hipErrorECCNotCorrectable},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, hipErrorUnsupportedLimit},
    {CUDA_ERROR_CONTEXT_ALREADY_IN_USE, hipErrorContextAlreadyInUse},
    {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, hipErrorPeerAccessUnsupported},
    {CUDA_ERROR_INVALID_PTX, hipErrorInvalidKernelFile},
    {CUDA_ERROR_INVALID_GRAPHICS_CONTEXT, hipErrorInvalidGraphicsContext},
    {CUDA_ERROR_JIT_COMPILER_NOT_FOUND, hipErrorInvalidKernelFile},
    {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, hipErrorInvalidKernelFile},
    {CUDA_ERROR_INVALID_SOURCE, hipErrorInvalidSource},
    {CUDA_ERROR_FILE_NOT_FOUND, hipErrorFileNotFound},
    {CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, hipErrorSharedObjectSymbolNotFound},
    {CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, hipErrorSharedObjectInitFailed},
    {CUDA_ERROR_OPERATING_SYSTEM, hipErrorOperatingSystem},
    {CUDA_ERROR_INVALID_HANDLE, hipErrorInvalidHandle},
    {CUDA_ERROR_ILLEGAL_STATE, hipErrorIllegalState},
    {CUDA_ERROR_NOT_FOUND, hipErrorNotFound},
    {CUDA_ERROR_NOT_READY, hipErrorNotReady},
    {CUDA_ERROR_ILLEGAL_ADDRESS, hipErrorIllegalAddress},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, hipErrorLaunchOutOfResources},
    {CUDA_ERROR_LAUNCH_TIMEOUT, hipErrorLaunchTimeOut},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, hipErrorPeerAccessAlreadyEnabled},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, hipErrorPeerAccessNotEnabled},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, hipErrorSetOnActiveProcess},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, hipErrorContextIsDestroyed},
    {CUDA_ERROR_ASSERT, hipErrorAssert},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, hipErrorHostMemoryAlreadyRegistered},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, hipErrorHostMemoryNotRegistered},
    /* Kernel faults that HIP has no finer code for; all of them end the context. */
    {CUDA_ERROR_HARDWARE_STACK_ERROR, hipErrorLaunchFailure},
    {CUDA_ERROR_ILLEGAL_INSTRUCTION, hipErrorLaunchFailure},
    {CUDA_ERROR_MISALIGNED_ADDRESS, hipErrorLaunchFailure},
    {CUDA_ERROR_INVALID_ADDRESS_SPACE, hipErrorLaunchFailure},
    {CUDA_ERROR_INVALID_PC, hipErrorLaunchFailure},
    {CUDA_ERROR_LAUNCH_FAILED, hipErrorLaunchFailure},
    {CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, hipErrorCooperativeLaunchTooLarge},
    {CUDA_ERROR_NOT_SUPPORTED, hipErrorNotSupported},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, hipErrorStreamCaptureUnsupported},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, hipErrorStreamCaptureInvalidated},
    {CUDA_ERROR_STREAM_CAPTURE_MERGE, hipErrorStreamCaptureMerge},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, hipErrorStreamCaptureUnmatched},
    {CUDA_ERROR_STREAM_CAPTURE_UNJOINED, hipErrorStreamCaptureUnjoined},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, hipErrorStreamCaptureIsolation},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, hipErrorStreamCaptureImplicit},
    {CUDA_ERROR_CAPTURED_EVENT, hipErrorCapturedEvent},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, hipErrorStreamCaptureWrongThread},
    {CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, hipErrorGraphExecUpdateFailure},
    {CUDA_ERROR_INVALID_CLUSTER_SIZE, hipErrorInvalidClusterSize},
    {CUDA_ERROR_INVALID_RESOURCE_TYPE, hipErrorInvalidResourceType},
    {CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, hipErrorInvalidResourceConfiguration},
    {CUDA_ERROR_UNKNOWN, hipErrorUnknown},
};

#define HIP_ERROR(code, text) {code, #code, text}
static const struct {
    hipError_t code;
    const char *name;
    const char *text;
} hip_errors[] = {
    HIP_ERROR(hipSuccess, "no error"),
    HIP_ERROR(hipErrorInvalidValue, "invalid argument"),
    HIP_ERROR(hipErrorOutOfMemory, "out of memory"),
    HIP_ERROR(hipErrorNotInitialized, "initialization error"),
    HIP_ERROR(hipErrorDeinitialized, "driver shutting down"),
    HIP_ERROR(hipErrorProfilerDisabled, "profiler disabled"),
    HIP_ERROR(hipErrorProfilerNotInitialized, "profiler not initialized"),
    HIP_ERROR(hipErrorProfilerAlreadyStarted, "profiler already started"),
    HIP_ERROR(hipErrorProfilerAlreadyStopped, "profiler already stopped"),
    HIP_ERROR(hipErrorInvalidMemcpyDirection, "invalid copy direction for memcpy"),
    HIP_ERROR(hipErrorInsufficientDriver, "CUDA driver is too old or a stub"),
    HIP_ERROR(hipErrorNoDevice, "no CUDA-capable device or no loadable libcuda.so.1"),
    HIP_ERROR(hipErrorInvalidDevice, "invalid device ordinal"),
    HIP_ERROR(hipErrorInvalidImage, "device kernel image is invalid"),
    HIP_ERROR(hipErrorInvalidContext, "invalid device context"),
    HIP_ERROR(hipErrorContextAlreadyCurrent, "context already current"),
    HIP_ERROR(hipErrorMapFailed, "mapping of buffer object failed"),
    HIP_ERROR(hipErrorUnmapFailed, "unmapping of buffer object failed"),
    HIP_ERROR(hipErrorArrayIsMapped, "array is mapped"),
    HIP_ERROR(hipErrorAlreadyMapped, "resource already mapped"),
    HIP_ERROR(hipErrorNoBinaryForGpu, "no kernel image is available for execution on the device"),
    HIP_ERROR(hipErrorAlreadyAcquired, "resource already acquired"),
    HIP_ERROR(hipErrorNotMapped, "resource not mapped"),
    HIP_ERROR(hipErrorNotMappedAsArray, "resource not mapped as array"),
    HIP_ERROR(hipErrorNotMappedAsPointer, "resource not mapped as pointer"),
    HIP_ERROR(hipErrorECCNotCorrectable, "uncorrectable ECC error encountered"),
    HIP_ERROR(hipErrorUnsupportedLimit, "limit is not supported on this architecture"),
    HIP_ERROR(hipErrorContextAlreadyInUse, "exclusive-thread device already in use"),
    HIP_ERROR(hipErrorPeerAccessUnsupported, "peer access is not supported between these devices"),
    HIP_ERROR(hipErrorInvalidKernelFile, "a PTX JIT compilation failed"),
    HIP_ERROR(hipErrorInvalidGraphicsContext, "invalid OpenGL or DirectX context"),
    HIP_ERROR(hipErrorInvalidSource, "device kernel source is invalid"),
    HIP_ERROR(hipErrorFileNotFound, "file not found"),
    HIP_ERROR(hipErrorSharedObjectSymbolNotFound, "shared object symbol not found"),
    HIP_ERROR(hipErrorSharedObjectInitFailed, "shared object initialization failed"),
    HIP_ERROR(hipErrorOperatingSystem, "OS call failed or operation not supported on this OS"),
    HIP_ERROR(hipErrorInvalidHandle, "invalid resource handle"),
    HIP_ERROR(hipErrorIllegalState, "the operation is not valid in the current state"),
    HIP_ERROR(hipErrorNotFound, "named symbol not found"),
    HIP_ERROR(hipErrorNotReady, "device not ready"),
    HIP_ERROR(hipErrorIllegalAddress, "an illegal memory access was encountered"),
    HIP_ERROR(hipErrorLaunchOutOfResources, "too many resources requested for launch"),
    HIP_ERROR(hipErrorLaunchTimeOut, "the launch timed out and was terminated"),
    HIP_ERROR(hipErrorPeerAccessAlreadyEnabled, "peer access is already enabled"),
    HIP_ERROR(hipErrorPeerAccessNotEnabled, "peer access has not been enabled"),
    HIP_ERROR(hipErrorSetOnActiveProcess, "cannot set while device is active in this process"),
    HIP_ERROR(hipErrorContextIsDestroyed, "context is destroyed"),
    HIP_ERROR(hipErrorAssert, "device-side assert triggered"),
    HIP_ERROR(hipErrorHostMemoryAlreadyRegistered, "host memory already registered"),
    HIP_ERROR(hipErrorHostMemoryNotRegistered, "host memory not registered"),
    HIP_ERROR(hipErrorLaunchFailure, "unspecified launch failure"),
    HIP_ERROR(hipErrorCooperativeLaunchTooLarge, "too many blocks in cooperative launch"),
    HIP_ERROR(hipErrorNotSupported, "operation not supported"),
    HIP_ERROR(hipErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing"),
    HIP_ERROR(hipErrorStreamCaptureInvalidated, "operation failed due to a previous error during capture"),
    HIP_ERROR(hipErrorStreamCaptureMerge, "operation would result in a merge of separate capture sequences"),
    HIP_ERROR(hipErrorStreamCaptureUnmatched, "capture was not ended in the same stream as it began"),
    HIP_ERROR(hipErrorStreamCaptureUnjoined, "capturing stream has unjoined work"),
    HIP_ERROR(hipErrorStreamCaptureIsolation, "dependency created on uncaptured work in another stream"),
    HIP_ERROR(hipErrorStreamCaptureImplicit, "operation would make the legacy stream depend on a capturing stream"),
    HIP_ERROR(hipErrorCapturedEvent, "operation not permitted on an event last recorded in a capturing stream"),
    HIP_ERROR(hipErrorStreamCaptureWrongThread, "capture sequence was not initiated in this thread"),
    HIP_ERROR(hipErrorGraphExecUpdateFailure, "the graph update was not performed"),
    HIP_ERROR(hipErrorInvalidResourceType, "invalid resource type"),
    HIP_ERROR(hipErrorInvalidResourceConfiguration, "invalid resource configuration"),
    HIP_ERROR(hipErrorUnknown, "unknown error"),
    HIP_ERROR(hipErrorInvalidClusterSize, "invalid cluster size"),
};

static __thread hipError_t last_error = hipSuccess;

static hipError_t record(hipError_t status) {
    if (status != hipSuccess) last_error = status;
    return status;
}

static hipError_t from_cuda(CUresult result) {
    for (size_t i = 0; i < COUNT(cuda_to_hip); ++i)
        if (cuda_to_hip[i].cuda == result) return cuda_to_hip[i].hip;
    return hipErrorUnknown;
}

static hipError_t check(CUresult result) { return record(from_cuda(result)); }

/* ---------------------------------------------------------------- loading */

#define DECLARE_MEMBER(member, symbol, params) CUresult (*member) params;
static struct {
    HIPMLA_CUDA_FUNCTIONS(DECLARE_MEMBER)
} cu;
#undef DECLARE_MEMBER

#define DECLARE_MEMBER(member, symbol, params) nvrtcResult (*member) params;
static struct {
    HIPMLA_NVRTC_FUNCTIONS(DECLARE_MEMBER)
} nv;
#undef DECLARE_MEMBER

/* A versioned driver symbol, or its unversioned ancestor on drivers that predate it. */
static void *find_symbol(void *library, const char *symbol) {
    void *address = dlsym(library, symbol);
    size_t length = strlen(symbol);
    if (address == NULL && length > 3 && strcmp(symbol + length - 3, "_v2") == 0) {
        char base[64];
        snprintf(base, sizeof base, "%.*s", (int)(length - 3), symbol);
        address = dlsym(library, base);
    }
    return address;
}

/* POSIX guarantees that a dlsym result converts to a function pointer through void **. */
#define LOAD_MEMBER(table, member, symbol) \
    ((*(void **)&(table).member = find_symbol(library, symbol)) != NULL)

static hipError_t driver_status = hipErrorNotInitialized;
static pthread_once_t driver_once = PTHREAD_ONCE_INIT;

static void load_driver(void) {
    const char *path = getenv("HIPMLA_LIBCUDA");
    void *library = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) {
        driver_status = hipErrorNoDevice;
        return;
    }
    /* Expands to 1 && load(first) && load(second) ...: stops at the first missing one. */
#define LOAD(member, symbol, params) &&LOAD_MEMBER(cu, member, symbol)
    int complete = 1 HIPMLA_CUDA_FUNCTIONS(LOAD);
#undef LOAD
    driver_status = complete ? from_cuda(cu.cuInit(0)) : hipErrorInsufficientDriver;
}

/* hipSuccess once libcuda is loaded and initialized; otherwise why not, on every call. */
static hipError_t driver(void) {
    pthread_once(&driver_once, load_driver);
    return driver_status;
}

static int nvrtc_loaded = 0;
static pthread_once_t nvrtc_once = PTHREAD_ONCE_INIT;

static void load_nvrtc(void) {
    const char *candidates[] = {getenv("HIPMLA_NVRTC"), "libnvrtc.so.13", "libnvrtc.so.12",
                                "libnvrtc.so"};
    for (size_t i = 0; i < COUNT(candidates) && !nvrtc_loaded; ++i) {
        if (candidates[i] == NULL || *candidates[i] == '\0') continue;
        void *library = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
        if (library == NULL) continue;
#define LOAD(member, symbol, params) &&LOAD_MEMBER(nv, member, symbol)
        nvrtc_loaded = 1 HIPMLA_NVRTC_FUNCTIONS(LOAD);
#undef LOAD
        if (!nvrtc_loaded) dlclose(library);
    }
}

static hiprtcResult nvrtc(void) {
    pthread_once(&nvrtc_once, load_nvrtc);
    return nvrtc_loaded ? HIPRTC_SUCCESS : HIPRTC_ERROR_INTERNAL_ERROR;
}

/* ---------------------------------------------------------------- devices and contexts */

static __thread int current_device = 0;
static CUcontext primary_contexts[MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

static hipError_t cuda_device(int ordinal, CUdevice *device) {
    hipError_t status = driver();
    if (status != hipSuccess) return status;
    if (ordinal < 0 || ordinal >= MAX_DEVICES) return hipErrorInvalidDevice;
    return from_cuda(cu.cuDeviceGet(device, ordinal));
}

/* Makes the primary context of `ordinal` current on the calling thread. Runs before
 * every launch, so the common path is one atomic load and one cuCtxGetCurrent. */
static hipError_t activate(int ordinal) {
    hipError_t status = driver();
    if (status != hipSuccess) return record(status);
    if (ordinal < 0 || ordinal >= MAX_DEVICES) return record(hipErrorInvalidDevice);
    CUcontext context = __atomic_load_n(&primary_contexts[ordinal], __ATOMIC_ACQUIRE);
    if (context == NULL) {
        pthread_mutex_lock(&primary_lock);
        context = primary_contexts[ordinal];
        CUresult result = CUDA_SUCCESS;
        CUdevice device;
        if (context == NULL) result = cu.cuDeviceGet(&device, ordinal);
        if (context == NULL && result == CUDA_SUCCESS)
            result = cu.cuDevicePrimaryCtxRetain(&context, device);
        if (result == CUDA_SUCCESS)
            __atomic_store_n(&primary_contexts[ordinal], context, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&primary_lock);
        if (result != CUDA_SUCCESS) return check(result);
    }
    CUcontext current = NULL;
    if (cu.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == context) return hipSuccess;
    return check(cu.cuCtxSetCurrent(context));
}

static hipError_t ready(void) { return activate(current_device); }

static CUdeviceptr device_pointer(const void *pointer) { return (CUdeviceptr)(uintptr_t)pointer; }

/* HIP attributes hipDeviceGetAttribute answers, with the CUDA attribute that holds each. */
static const struct {
    hipDeviceAttribute_t hip;
    CUdevice_attribute cuda;
} attributes[] = {
    {hipDeviceAttributeEccEnabled, CU_DEVICE_ATTRIBUTE_ECC_ENABLED},
    {hipDeviceAttributeAsyncEngineCount, CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT},
    {hipDeviceAttributeCanMapHostMemory, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY},
    {hipDeviceAttributeClockRate, CU_DEVICE_ATTRIBUTE_CLOCK_RATE},
    {hipDeviceAttributeComputeMode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE},
    {hipDeviceAttributeConcurrentKernels, CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS},
    {hipDeviceAttributeCooperativeLaunch, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH},
    {hipDeviceAttributeIntegrated, CU_DEVICE_ATTRIBUTE_INTEGRATED},
    {hipDeviceAttributeKernelExecTimeout, CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT},
    {hipDeviceAttributeL2CacheSize, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE},
    {hipDeviceAttributeComputeCapabilityMajor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR},
    {hipDeviceAttributeManagedMemory, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY},
    {hipDeviceAttributeMaxBlocksPerMultiProcessor, CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR},
    {hipDeviceAttributeMaxBlockDimX, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X},
    {hipDeviceAttributeMaxBlockDimY, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y},
    {hipDeviceAttributeMaxBlockDimZ, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z},
    {hipDeviceAttributeMaxGridDimX, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X},
    {hipDeviceAttributeMaxGridDimY, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y},
    {hipDeviceAttributeMaxGridDimZ, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z},
    {hipDeviceAttributeMaxThreadsPerBlock, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK},
    {hipDeviceAttributeMaxThreadsPerMultiProcessor, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR},
    {hipDeviceAttributeMaxPitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH},
    {hipDeviceAttributeMemoryBusWidth, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH},
    {hipDeviceAttributeMemoryClockRate, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE},
    {hipDeviceAttributeComputeCapabilityMinor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR},
    {hipDeviceAttributeMultiprocessorCount, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT},
    {hipDeviceAttributePciBusId, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID},
    {hipDeviceAttributePciDeviceId, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID},
    {hipDeviceAttributePciDomainId, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID},
    {hipDeviceAttributeMaxRegistersPerBlock, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK},
    {hipDeviceAttributeMaxRegistersPerMultiprocessor, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR},
    {hipDeviceAttributeReservedSharedMemPerBlock, CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK},
    {hipDeviceAttributeMaxSharedMemoryPerBlock, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK},
    {hipDeviceAttributeSharedMemPerBlockOptin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN},
    {hipDeviceAttributeSharedMemPerMultiprocessor, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR},
    {hipDeviceAttributeStreamPrioritiesSupported, CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED},
    {hipDeviceAttributeTotalConstantMemory, CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY},
    {hipDeviceAttributeUnifiedAddressing, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING},
    {hipDeviceAttributeWarpSize, CU_DEVICE_ATTRIBUTE_WARP_SIZE},
    {hipDeviceAttributeMaxSharedMemoryPerMultiprocessor, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR},
};

/* hipDeviceProp_t fields that come straight from one CUDA attribute; the width of the
 * field (int or size_t) is taken from the struct. */
#define PROP(member, attribute) \
    {offsetof(hipDeviceProp_tR0600, member), sizeof(((hipDeviceProp_tR0600 *)0)->member), attribute}
static const struct {
    size_t offset;
    size_t size;
    CUdevice_attribute cuda;
} properties[] = {
    PROP(sharedMemPerBlock, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
    PROP(regsPerBlock, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK),
    PROP(warpSize, CU_DEVICE_ATTRIBUTE_WARP_SIZE),
    PROP(memPitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH),
    PROP(maxThreadsPerBlock, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
    PROP(maxThreadsDim[0], CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X),
    PROP(maxThreadsDim[1], CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y),
    PROP(maxThreadsDim[2], CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z),
    PROP(maxGridSize[0], CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X),
    PROP(maxGridSize[1], CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y),
    PROP(maxGridSize[2], CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z),
    PROP(clockRate, CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
    PROP(clockInstructionRate, CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
    PROP(totalConstMem, CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY),
    PROP(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
    PROP(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    PROP(textureAlignment, CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT),
    PROP(multiProcessorCount, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
    PROP(kernelExecTimeoutEnabled, CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT),
    PROP(integrated, CU_DEVICE_ATTRIBUTE_INTEGRATED),
    PROP(canMapHostMemory, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY),
    PROP(computeMode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE),
    PROP(concurrentKernels, CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS),
    PROP(ECCEnabled, CU_DEVICE_ATTRIBUTE_ECC_ENABLED),
    PROP(pciBusID, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
    PROP(pciDeviceID, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
    PROP(pciDomainID, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
    PROP(tccDriver, CU_DEVICE_ATTRIBUTE_TCC_DRIVER),
    PROP(asyncEngineCount, CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT),
    PROP(unifiedAddressing, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
    PROP(memoryClockRate, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
    PROP(memoryBusWidth, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
    PROP(l2CacheSize, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
    PROP(persistingL2CacheMaxSize, CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE),
    PROP(maxThreadsPerMultiProcessor, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
    PROP(streamPrioritiesSupported, CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED),
    PROP(globalL1CacheSupported, CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED),
    PROP(localL1CacheSupported, CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED),
    PROP(sharedMemPerMultiprocessor, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
    PROP(maxSharedMemoryPerMultiProcessor, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
    PROP(regsPerMultiprocessor, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
    PROP(managedMemory, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY),
    PROP(isMultiGpuBoard, CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD),
    PROP(multiGpuBoardGroupID, CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID),
    PROP(pageableMemoryAccess, CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS),
    PROP(concurrentManagedAccess, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS),
    PROP(computePreemptionSupported, CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED),
    PROP(cooperativeLaunch, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH),
    PROP(sharedMemPerBlockOptin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
    PROP(maxBlocksPerMultiProcessor, CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR),
    PROP(accessPolicyMaxWindowSize, CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE),
    PROP(reservedSharedMemPerBlock, CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK),
};
#undef PROP

/* ---------------------------------------------------------------- HIP: devices */

EXPORT hipError_t hipInit(unsigned int flags) {
    if (flags != 0) return record(hipErrorInvalidValue);
    return record(driver());
}

EXPORT hipError_t hipDriverGetVersion(int *version) {
    if (version == NULL) return record(hipErrorInvalidValue);
    hipError_t status = driver();
    if (status != hipSuccess) return record(status);
    return check(cu.cuDriverGetVersion(version));
}

/* The runtime that compiles and loads kernels here is NVRTC, so its CUDA version
 * (1000 * major + 10 * minor, CUDA's encoding) stands for the runtime version. */
EXPORT hipError_t hipRuntimeGetVersion(int *version) {
    if (version == NULL) return record(hipErrorInvalidValue);
    int major = 0, minor = 0;
    if (nvrtc() != HIPRTC_SUCCESS || nv.nvrtcVersion(&major, &minor) != 0)
        return record(hipErrorNotInitialized);
    *version = 1000 * major + 10 * minor;
    return hipSuccess;
}

EXPORT hipError_t hipGetDeviceCount(int *count) {
    if (count == NULL) return record(hipErrorInvalidValue);
    *count = 0;
    hipError_t status = driver();
    if (status != hipSuccess) return record(status);
    status = check(cu.cuDeviceGetCount(count));
    if (status == hipSuccess && *count == 0) return record(hipErrorNoDevice);
    return status;
}

EXPORT hipError_t hipSetDevice(int ordinal) {
    hipError_t status = activate(ordinal);
    if (status == hipSuccess) current_device = ordinal;
    return status;
}

EXPORT hipError_t hipGetDevice(int *ordinal) {
    if (ordinal == NULL) return record(hipErrorInvalidValue);
    hipError_t status = driver();
    if (status != hipSuccess) return record(status);
    *ordinal = current_device;
    return hipSuccess;
}

EXPORT hipError_t hipDeviceGetAttribute(int *value, hipDeviceAttribute_t attribute, int ordinal) {
    if (value == NULL) return record(hipErrorInvalidValue);
    for (size_t i = 0; i < COUNT(attributes); ++i) {
        if (attributes[i].hip != attribute) continue;
        CUdevice device;
        hipError_t status = cuda_device(ordinal, &device);
        if (status != hipSuccess) return record(status);
        return check(cu.cuDeviceGetAttribute(value, attributes[i].cuda, device));
    }
    return record(hipErrorInvalidValue);
}

EXPORT hipError_t hipGetDevicePropertiesR0600(hipDeviceProp_tR0600 *prop, int ordinal) {
    if (prop == NULL) return record(hipErrorInvalidValue);
    CUdevice device;
    hipError_t status = cuda_device(ordinal, &device);
    if (status != hipSuccess) return record(status);
    memset(prop, 0, sizeof *prop);
    status = check(cu.cuDeviceGetName(prop->name, (int)sizeof prop->name, device));
    if (status == hipSuccess) status = check(cu.cuDeviceTotalMem(&prop->totalGlobalMem, device));
    if (status != hipSuccess) return status;
    /* An attribute a future driver drops leaves its field 0 rather than failing the call:
     * the struct is informational and callers mostly want a few fields of it. */
    for (size_t i = 0; i < COUNT(properties); ++i) {
        int value = 0;
        if (cu.cuDeviceGetAttribute(&value, properties[i].cuda, device) != CUDA_SUCCESS) continue;
        char *field = (char *)prop + properties[i].offset;
        if (properties[i].size == sizeof(size_t)) {
            size_t wide = (size_t)(unsigned)value;
            memcpy(field, &wide, sizeof wide);
        } else {
            memcpy(field, &value, sizeof value);
        }
    }
    snprintf(prop->gcnArchName, sizeof prop->gcnArchName, "sm_%d%d", prop->major, prop->minor);
    return hipSuccess;
}

EXPORT hipError_t hipGetDeviceProperties(hipDeviceProp_tR0600 *prop, int ordinal)
    __attribute__((alias("hipGetDevicePropertiesR0600")));

EXPORT hipError_t hipDeviceSynchronize(void) {
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuCtxSynchronize());
}

/* ---------------------------------------------------------------- HIP: memory */

EXPORT hipError_t hipMalloc(void **pointer, size_t bytes) {
    if (pointer == NULL) return record(hipErrorInvalidValue);
    *pointer = NULL;
    hipError_t status = ready();
    if (status != hipSuccess || bytes == 0) return status;
    CUdeviceptr address = 0;
    status = check(cu.cuMemAlloc(&address, bytes));
    if (status == hipSuccess) *pointer = (void *)(uintptr_t)address;
    return status;
}

EXPORT hipError_t hipFree(void *pointer) {
    if (pointer == NULL) return hipSuccess;
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuMemFree(device_pointer(pointer)));
}

EXPORT hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    if (free_bytes == NULL || total_bytes == NULL) return record(hipErrorInvalidValue);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuMemGetInfo(free_bytes, total_bytes));
}

EXPORT hipError_t hipMemcpy(void *dst, const void *src, size_t bytes, hipMemcpyKind kind) {
    hipError_t status = ready();
    if (status != hipSuccess || bytes == 0) return status;
    switch (kind) {
    case hipMemcpyHostToDevice:
        return check(cu.cuMemcpyHtoD(device_pointer(dst), src, bytes));
    case hipMemcpyDeviceToHost:
        return check(cu.cuMemcpyDtoH(dst, device_pointer(src), bytes));
    case hipMemcpyDeviceToDevice:
        return check(cu.cuMemcpyDtoD(device_pointer(dst), device_pointer(src), bytes));
    case hipMemcpyHostToHost: /* unified addressing tells host from device pointers */
    case hipMemcpyDefault:
        return check(cu.cuMemcpy(device_pointer(dst), device_pointer(src), bytes));
    }
    return record(hipErrorInvalidMemcpyDirection);
}

EXPORT hipError_t hipMemcpyAsync(void *dst, const void *src, size_t bytes, hipMemcpyKind kind,
                                 hipStream_t stream) {
    hipError_t status = ready();
    if (status != hipSuccess || bytes == 0) return status;
    CUstream cuda_stream = (CUstream)stream;
    switch (kind) {
    case hipMemcpyHostToDevice:
        return check(cu.cuMemcpyHtoDAsync(device_pointer(dst), src, bytes, cuda_stream));
    case hipMemcpyDeviceToHost:
        return check(cu.cuMemcpyDtoHAsync(dst, device_pointer(src), bytes, cuda_stream));
    case hipMemcpyDeviceToDevice:
        return check(cu.cuMemcpyDtoDAsync(device_pointer(dst), device_pointer(src), bytes,
                                          cuda_stream));
    case hipMemcpyHostToHost:
    case hipMemcpyDefault:
        return check(cu.cuMemcpyAsync(device_pointer(dst), device_pointer(src), bytes,
                                      cuda_stream));
    }
    return record(hipErrorInvalidMemcpyDirection);
}

EXPORT hipError_t hipMemsetAsync(void *dst, int value, size_t bytes, hipStream_t stream) {
    hipError_t status = ready();
    if (status != hipSuccess || bytes == 0) return status;
    return check(cu.cuMemsetD8Async(device_pointer(dst), (unsigned char)value, bytes,
                                    (CUstream)stream));
}

/* ---------------------------------------------------------------- HIP: streams and events */

EXPORT hipError_t hipStreamCreate(hipStream_t *stream) {
    if (stream == NULL) return record(hipErrorInvalidValue);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuStreamCreate((CUstream *)stream, 0));
}

EXPORT hipError_t hipStreamDestroy(hipStream_t stream) {
    if (stream == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuStreamDestroy((CUstream)stream));
}

EXPORT hipError_t hipStreamSynchronize(hipStream_t stream) {
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuStreamSynchronize((CUstream)stream));
}

EXPORT hipError_t hipEventCreate(hipEvent_t *event) {
    if (event == NULL) return record(hipErrorInvalidValue);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuEventCreate((CUevent *)event, 0));
}

EXPORT hipError_t hipEventDestroy(hipEvent_t event) {
    if (event == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuEventDestroy((CUevent)event));
}

EXPORT hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) {
    if (event == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuEventRecord((CUevent)event, (CUstream)stream));
}

EXPORT hipError_t hipEventSynchronize(hipEvent_t event) {
    if (event == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuEventSynchronize((CUevent)event));
}

EXPORT hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop) {
    if (ms == NULL) return record(hipErrorInvalidValue);
    if (start == NULL || stop == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    return status != hipSuccess ? status
                                : check(cu.cuEventElapsedTime(ms, (CUevent)start, (CUevent)stop));
}

/* ---------------------------------------------------------------- HIP: modules and launches */

EXPORT hipError_t hipModuleLoadData(hipModule_t *module, const void *image) {
    if (module == NULL || image == NULL) return record(hipErrorInvalidValue);
    hipError_t status = ready();
    return status != hipSuccess ? status : check(cu.cuModuleLoadData((CUmodule *)module, image));
}

/* The dynamic shared memory each function may already take: CUDA wants a launch above
 * 48 KiB to be allowed by cuFuncSetAttribute first (HIP has no such step), and making that
 * driver call once per function instead of on every launch takes it off the decode hot
 * path. A function handle lives as long as its module, so unloading any module forgets
 * them all (a later function may reuse an address). A full table only costs the call. */
#define SHARED_GRANTS 64
static struct {
    CUfunction function;
    unsigned bytes;
} shared_grants[SHARED_GRANTS];
static pthread_mutex_t grants_lock = PTHREAD_MUTEX_INITIALIZER;

static hipError_t allow_dynamic_shared(CUfunction function, unsigned bytes) {
    pthread_mutex_lock(&grants_lock);
    size_t free_slot = SHARED_GRANTS;
    for (size_t i = 0; i < SHARED_GRANTS; ++i) {
        if (shared_grants[i].function == function) {
            if (shared_grants[i].bytes >= bytes) {
                pthread_mutex_unlock(&grants_lock);
                return hipSuccess;
            }
            free_slot = i;
            break;
        }
        if (shared_grants[i].function == NULL && free_slot == SHARED_GRANTS) free_slot = i;
    }
    hipError_t status = check(
        cu.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)bytes));
    if (status == hipSuccess && free_slot < SHARED_GRANTS) {
        shared_grants[free_slot].function = function;
        shared_grants[free_slot].bytes = bytes;
    }
    pthread_mutex_unlock(&grants_lock);
    return status;
}

EXPORT hipError_t hipModuleUnload(hipModule_t module) {
    if (module == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    if (status != hipSuccess) return status;
    /* Under the lock, so no launch records a grant between the unload and the reset. */
    pthread_mutex_lock(&grants_lock);
    status = check(cu.cuModuleUnload((CUmodule)module));
    memset(shared_grants, 0, sizeof(shared_grants));
    pthread_mutex_unlock(&grants_lock);
    return status;
}

EXPORT hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module,
                                       const char *name) {
    if (function == NULL || name == NULL) return record(hipErrorInvalidValue);
    if (module == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    return status != hipSuccess
               ? status
               : check(cu.cuModuleGetFunction((CUfunction *)function, (CUmodule)module, name));
}

/* Copies HIP's `extra` list into `out` with CUDA's end marker. The pointer and size
 * markers (1, 2) are the same in both APIs; the end marker is 3 in HIP and 0 in CUDA,
 * and a 0 is accepted too so that CUDA-style lists pass unchanged. */
static hipError_t translate_extra(void **extra, void **out, size_t capacity) {
    for (size_t i = 0; i < capacity; i += 2) {
        uintptr_t marker = (uintptr_t)extra[i];
        if (marker == (uintptr_t)HIP_LAUNCH_PARAM_END || marker == CU_LAUNCH_PARAM_END_AS_INT) {
            out[i] = (void *)(uintptr_t)CU_LAUNCH_PARAM_END_AS_INT;
            return hipSuccess;
        }
        if (marker != CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT &&
            marker != CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT)
            return hipErrorInvalidValue;
        if (i + 2 >= capacity) break;
        out[i] = extra[i];
        out[i + 1] = extra[i + 1];
    }
    return hipErrorInvalidValue;
}

EXPORT hipError_t hipModuleLaunchKernel(hipFunction_t function, unsigned int grid_x,
                                        unsigned int grid_y, unsigned int grid_z,
                                        unsigned int block_x, unsigned int block_y,
                                        unsigned int block_z, unsigned int shared_bytes,
                                        hipStream_t stream, void **params, void **extra) {
    if (function == NULL) return record(hipErrorInvalidHandle);
    hipError_t status = ready();
    if (status != hipSuccess) return status;
    void *cuda_extra[16];
    if (extra != NULL) {
        status = translate_extra(extra, cuda_extra, COUNT(cuda_extra));
        if (status != hipSuccess) return record(status);
    }
    if (shared_bytes > DEFAULT_DYNAMIC_SHARED_LIMIT) {
        status = allow_dynamic_shared((CUfunction)function, shared_bytes);
        if (status != hipSuccess) return status;
    }
    return check(cu.cuLaunchKernel((CUfunction)function, grid_x, grid_y, grid_z, block_x, block_y,
                                   block_z, shared_bytes, (CUstream)stream, params,
                                   extra != NULL ? cuda_extra : NULL));
}

/* ---------------------------------------------------------------- HIP: errors */

EXPORT const char *hipGetErrorName(hipError_t status) {
    for (size_t i = 0; i < COUNT(hip_errors); ++i)
        if (hip_errors[i].code == status) return hip_errors[i].name;
    return "hipErrorUnknown";
}

EXPORT const char *hipGetErrorString(hipError_t status) {
    for (size_t i = 0; i < COUNT(hip_errors); ++i)
        if (hip_errors[i].code == status) return hip_errors[i].text;
    return "unknown error";
}

EXPORT hipError_t hipGetLastError(void) {
    hipError_t status = last_error;
    last_error = hipSuccess;
    return status;
}

EXPORT hipError_t hipPeekAtLastError(void) { return last_error; }

/* ---------------------------------------------------------------- hiprtc over NVRTC */

struct hiprtc_program {
    nvrtcProgram nvrtc;
    int cubin;         /* a real architecture (sm_XX) was named: NVRTC made a CUBIN */
    char arch[64];     /* storage for a rewritten -arch option */
    char note[256];    /* our own diagnostics, shown ahead of NVRTC's log */
};

#define HIPRTC_RESULT(code) {code, #code}
static const struct {
    hiprtcResult code;
    const char *name;
} hiprtc_results[] = {
    HIPRTC_RESULT(HIPRTC_SUCCESS),
    HIPRTC_RESULT(HIPRTC_ERROR_OUT_OF_MEMORY),
    HIPRTC_RESULT(HIPRTC_ERROR_PROGRAM_CREATION_FAILURE),
    HIPRTC_RESULT(HIPRTC_ERROR_INVALID_INPUT),
    HIPRTC_RESULT(HIPRTC_ERROR_INVALID_PROGRAM),
    HIPRTC_RESULT(HIPRTC_ERROR_INVALID_OPTION),
    HIPRTC_RESULT(HIPRTC_ERROR_COMPILATION),
    HIPRTC_RESULT(HIPRTC_ERROR_BUILTIN_OPERATION_FAILURE),
    HIPRTC_RESULT(HIPRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION),
    HIPRTC_RESULT(HIPRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION),
    HIPRTC_RESULT(HIPRTC_ERROR_NAME_EXPRESSION_NOT_VALID),
    HIPRTC_RESULT(HIPRTC_ERROR_INTERNAL_ERROR),
    HIPRTC_RESULT(HIPRTC_ERROR_LINKING),
};

/* NVRTC's results 0..11 are hiprtc's; later NVRTC additions have no hiprtc name. */
static hiprtcResult from_nvrtc(nvrtcResult result) {
    return result >= 0 && result <= HIPRTC_ERROR_INTERNAL_ERROR ? (hiprtcResult)result
                                                               : HIPRTC_ERROR_INTERNAL_ERROR;
}

static int starts_with(const char *text, const char *prefix) {
    return strncmp(text, prefix, strlen(prefix)) == 0;
}

static const char *option_value(const char *option, const char *const *prefixes, size_t count) {
    for (size_t i = 0; i < count; ++i)
        if (starts_with(option, prefixes[i])) return option + strlen(prefixes[i]);
    return NULL;
}

/* Rewrites hiprtc (clang) options into NVRTC ones. --offload-arch=sm_XX becomes
 * -arch=sm_XX; an AMD target is refused; -O levels (NVRTC rejects them and always
 * optimizes), -f/-m/-W flags and -g are clang's and dropped, except -ffast-math, which
 * has an NVRTC spelling. Without any architecture the current GPU's is used when there is
 * one, as hiprtc does; otherwise NVRTC's default virtual architecture yields PTX. */
static hiprtcResult translate_options(struct hiprtc_program *program, int count,
                                      const char *const *options, const char **out,
                                      int *out_count) {
    static const char *const offload_arch[] = {"--offload-arch=", "-offload-arch="};
    static const char *const nvrtc_arch[] = {"-arch=", "--gpu-architecture="};
    int kept = 0, have_arch = 0;
    for (int i = 0; i < count; ++i) {
        const char *option = options[i];
        const char *arch = option_value(option, offload_arch, COUNT(offload_arch));
        if (arch != NULL) {
            if (!starts_with(arch, "sm_") && !starts_with(arch, "compute_")) {
                snprintf(program->note, sizeof program->note,
                         "hipmla nvidia hiprtc: '%s' is not an NVIDIA architecture (sm_XX or "
                         "compute_XX); this hiprtc compiles with NVRTC\n",
                         option);
                return HIPRTC_ERROR_INVALID_OPTION;
            }
            snprintf(program->arch, sizeof program->arch, "-arch=%s", arch);
            option = program->arch;
        } else {
            arch = option_value(option, nvrtc_arch, COUNT(nvrtc_arch));
        }
        if (arch != NULL) {
            have_arch = 1;
            program->cubin = starts_with(arch, "sm_");
        } else if (strcmp(option, "-ffast-math") == 0) {
            option = "--use_fast_math";
        } else if (starts_with(option, "-O") || starts_with(option, "-f") ||
                   starts_with(option, "-m") || starts_with(option, "-W") ||
                   strcmp(option, "-g") == 0) {
            continue;
        }
        out[kept++] = option;
    }
    CUdevice device;
    int major = 0, minor = 0;
    if (!have_arch && cuda_device(current_device, &device) == hipSuccess &&
        cu.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device) ==
            CUDA_SUCCESS &&
        cu.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device) ==
            CUDA_SUCCESS) {
        snprintf(program->arch, sizeof program->arch, "-arch=sm_%d%d", major, minor);
        out[kept++] = program->arch;
        program->cubin = 1;
    }
    *out_count = kept;
    return HIPRTC_SUCCESS;
}

EXPORT const char *hiprtcGetErrorString(hiprtcResult result) {
    for (size_t i = 0; i < COUNT(hiprtc_results); ++i)
        if (hiprtc_results[i].code == result) return hiprtc_results[i].name;
    return "Invalid HIPRTC error code";
}

EXPORT hiprtcResult hiprtcVersion(int *major, int *minor) {
    if (major == NULL || minor == NULL) return HIPRTC_ERROR_INVALID_INPUT;
    hiprtcResult status = nvrtc();
    return status != HIPRTC_SUCCESS ? status : from_nvrtc(nv.nvrtcVersion(major, minor));
}

EXPORT hiprtcResult hiprtcCreateProgram(hiprtcProgram *prog, const char *src, const char *name,
                                        int num_headers, const char *const *headers,
                                        const char *const *include_names) {
    if (prog == NULL || src == NULL || num_headers < 0) return HIPRTC_ERROR_INVALID_INPUT;
    hiprtcResult status = nvrtc();
    if (status != HIPRTC_SUCCESS) return status;
    struct hiprtc_program *program = calloc(1, sizeof *program);
    if (program == NULL) return HIPRTC_ERROR_OUT_OF_MEMORY;
    status = from_nvrtc(
        nv.nvrtcCreateProgram(&program->nvrtc, src, name, num_headers, headers, include_names));
    if (status != HIPRTC_SUCCESS) {
        free(program);
        return status;
    }
    *prog = program;
    return HIPRTC_SUCCESS;
}

EXPORT hiprtcResult hiprtcCompileProgram(hiprtcProgram prog, int num_options,
                                         const char *const *options) {
    if (prog == NULL) return HIPRTC_ERROR_INVALID_PROGRAM;
    if (num_options < 0 || (num_options > 0 && options == NULL)) return HIPRTC_ERROR_INVALID_INPUT;
    const char **translated = calloc((size_t)num_options + 1, sizeof *translated);
    if (translated == NULL) return HIPRTC_ERROR_OUT_OF_MEMORY;
    prog->note[0] = '\0';
    int count = 0;
    hiprtcResult status = translate_options(prog, num_options, options, translated, &count);
    if (status == HIPRTC_SUCCESS)
        status = from_nvrtc(nv.nvrtcCompileProgram(prog->nvrtc, count, translated));
    free(translated);
    return status;
}

EXPORT hiprtcResult hiprtcGetProgramLogSize(hiprtcProgram prog, size_t *size) {
    if (prog == NULL) return HIPRTC_ERROR_INVALID_PROGRAM;
    if (size == NULL) return HIPRTC_ERROR_INVALID_INPUT;
    hiprtcResult status = from_nvrtc(nv.nvrtcGetProgramLogSize(prog->nvrtc, size));
    if (status == HIPRTC_SUCCESS) *size += strlen(prog->note);
    return status;
}

EXPORT hiprtcResult hiprtcGetProgramLog(hiprtcProgram prog, char *log) {
    if (prog == NULL) return HIPRTC_ERROR_INVALID_PROGRAM;
    if (log == NULL) return HIPRTC_ERROR_INVALID_INPUT;
    size_t note_length = strlen(prog->note);
    memcpy(log, prog->note, note_length);
    return from_nvrtc(nv.nvrtcGetProgramLog(prog->nvrtc, log + note_length));
}

EXPORT hiprtcResult hiprtcGetCodeSize(hiprtcProgram prog, size_t *size) {
    if (prog == NULL) return HIPRTC_ERROR_INVALID_PROGRAM;
    if (size == NULL) return HIPRTC_ERROR_INVALID_INPUT;
    return from_nvrtc(prog->cubin ? nv.nvrtcGetCUBINSize(prog->nvrtc, size)
                                  : nv.nvrtcGetPTXSize(prog->nvrtc, size));
}

EXPORT hiprtcResult hiprtcGetCode(hiprtcProgram prog, char *code) {
    if (prog == NULL) return HIPRTC_ERROR_INVALID_PROGRAM;
    if (code == NULL) return HIPRTC_ERROR_INVALID_INPUT;
    return from_nvrtc(prog->cubin ? nv.nvrtcGetCUBIN(prog->nvrtc, code)
                                  : nv.nvrtcGetPTX(prog->nvrtc, code));
}

EXPORT hiprtcResult hiprtcDestroyProgram(hiprtcProgram *prog) {
    if (prog == NULL || *prog == NULL) return HIPRTC_ERROR_INVALID_PROGRAM;
    hiprtcResult status = from_nvrtc(nv.nvrtcDestroyProgram(&(*prog)->nvrtc));
    free(*prog);
    *prog = NULL;
    return status;
}
