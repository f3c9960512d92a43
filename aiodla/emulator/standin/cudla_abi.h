/* The cuDLA C ABI as aiodla's GPU stand-in implements it, declared by aiodla itself.
 *
 * The stand-in is a test double: it must be called exactly as cuda.bindings.cudla calls
 * the real libcudla.so.1, so the types below reproduce the layouts that the bindings'
 * Cython declarations (cuda/bindings/cycudla.pxd) give them: natural alignment, no
 * packing. The static assertions pin the one layout tests depend on byte for byte,
 * cudlaModuleTensorDescriptor (168 bytes, also written out in aiodla/emulator/_format.py).
 *
 * Below the 13 cuDLA entry points are the stand-in's own exports, prefixed aiodlaStandin:
 * fault injection and accounting for tests, and two host-only helpers that run the
 * loadable parser and the task arithmetic on the CPU so CI can check them without a GPU.
 */
#ifndef AIODLA_STANDIN_CUDLA_ABI_H
#define AIODLA_STANDIN_CUDLA_ABI_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define AIODLA_EXPORT __attribute__((visibility("default")))
#else
#define AIODLA_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudlaStatus {
    cudlaSuccess = 0,
    cudlaErrorInvalidParam = 1,
    cudlaErrorOutOfResources = 2,
    cudlaErrorCreationFailed = 3,
    cudlaErrorInvalidAddress = 4,
    cudlaErrorOs = 5,
    cudlaErrorCuda = 6,
    cudlaErrorUmd = 7,
    cudlaErrorInvalidDevice = 8,
    cudlaErrorInvalidAttribute = 9,
    cudlaErrorIncompatibleDlaSWVersion = 10,
    cudlaErrorMemoryRegistered = 11,
    cudlaErrorInvalidModule = 12,
    cudlaErrorUnsupportedOperation = 13,
    cudlaErrorNvSci = 14,
    cudlaErrorDriverNotFound = 15,
    cudlaErrorDlaErrInvalidInput = 0x40000001,
    cudlaErrorDlaErrInvalidPreAction = 0x40000002,
    cudlaErrorDlaErrNoMem = 0x40000003,
    cudlaErrorDlaErrProcessorBusy = 0x40000004,
    cudlaErrorDlaErrTaskStatusMismatch = 0x40000005,
    cudlaErrorDlaErrEngineTimeout = 0x40000006,
    cudlaErrorDlaErrDataMismatch = 0x40000007,
    cudlaErrorUnknown = 0x7fffffff
} cudlaStatus;

typedef enum cudlaMode { CUDLA_CUDA_DLA = 0, CUDLA_STANDALONE = 1 } cudlaMode;

typedef enum cudlaModuleAttributeType {
    CUDLA_NUM_INPUT_TENSORS = 0,
    CUDLA_NUM_OUTPUT_TENSORS = 1,
    CUDLA_INPUT_TENSOR_DESCRIPTORS = 2,
    CUDLA_OUTPUT_TENSOR_DESCRIPTORS = 3,
    CUDLA_NUM_OUTPUT_TASK_STATISTICS = 4,
    CUDLA_OUTPUT_TASK_STATISTICS_DESCRIPTORS = 5
} cudlaModuleAttributeType;

typedef enum cudlaFenceType {
    CUDLA_NVSCISYNC_FENCE = 1,
    CUDLA_NVSCISYNC_FENCE_SOF = 2
} cudlaFenceType;

typedef enum cudlaModuleLoadFlags {
    CUDLA_MODULE_DEFAULT = 0,
    CUDLA_MODULE_ENABLE_FAULT_DIAGNOSTICS = 1
} cudlaModuleLoadFlags;

typedef enum cudlaSubmissionFlags {
    CUDLA_SUBMIT_NOOP = 1,
    CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE = 1 << 1,
    CUDLA_SUBMIT_DIAGNOSTICS_TASK = 1 << 2
} cudlaSubmissionFlags;

typedef enum cudlaAccessPermissionFlags {
    CUDLA_READ_WRITE_PERM = 0,
    CUDLA_READ_ONLY_PERM = 1,
    CUDLA_TASK_STATISTICS = 1 << 1
} cudlaAccessPermissionFlags;

typedef enum cudlaDevAttributeType {
    CUDLA_UNIFIED_ADDRESSING = 0,
    CUDLA_DEVICE_VERSION = 1
} cudlaDevAttributeType;

typedef void* cudlaDevHandle;
typedef void* cudlaModule;

typedef struct cudlaModuleTensorDescriptor {
    char name[80 + 1];
    uint64_t size;
    uint64_t n;
    uint64_t c;
    uint64_t h;
    uint64_t w;
    uint8_t dataFormat;
    uint8_t dataType;
    uint8_t dataCategory;
    uint8_t pixelFormat;
    uint8_t pixelMapping;
    uint32_t stride[8];
} cudlaModuleTensorDescriptor;

typedef struct CudlaFence {
    void* fence;
    cudlaFenceType type;
} CudlaFence;

typedef union cudlaDevAttribute {
    uint8_t unifiedAddressingSupported;
    uint32_t deviceVersion;
} cudlaDevAttribute;

typedef union cudlaModuleAttribute {
    uint32_t numInputTensors;
    uint32_t numOutputTensors;
    cudlaModuleTensorDescriptor* inputTensorDesc;
    cudlaModuleTensorDescriptor* outputTensorDesc;
} cudlaModuleAttribute;

typedef struct cudlaWaitEvents {
    CudlaFence* preFences;
    uint32_t numEvents;
} cudlaWaitEvents;

typedef struct cudlaSignalEvents {
    uint64_t** devPtrs;
    CudlaFence* eofFences;
    uint32_t numEvents;
} cudlaSignalEvents;

typedef struct cudlaTask {
    cudlaModule moduleHandle;
    uint64_t** outputTensor;
    uint32_t numOutputTensors;
    uint32_t numInputTensors;
    uint64_t** inputTensor;
    cudlaWaitEvents* waitEvents;
    cudlaSignalEvents* signalEvents;
} cudlaTask;

/* The 13 entry points of libcudla.so.1. */
AIODLA_EXPORT cudlaStatus cudlaGetVersion(uint64_t* const version);
AIODLA_EXPORT cudlaStatus cudlaDeviceGetCount(uint64_t* const pNumDevices);
AIODLA_EXPORT cudlaStatus cudlaCreateDevice(const uint64_t device, cudlaDevHandle* const devHandle,
                                            const uint32_t flags);
AIODLA_EXPORT cudlaStatus cudlaMemRegister(const cudlaDevHandle devHandle, const uint64_t* const ptr,
                                           const size_t size, uint64_t** const devPtr,
                                           const uint32_t flags);
AIODLA_EXPORT cudlaStatus cudlaModuleLoadFromMemory(const cudlaDevHandle devHandle,
                                                    const uint8_t* const pModule,
                                                    const size_t moduleSize,
                                                    cudlaModule* const hModule,
                                                    const uint32_t flags);
AIODLA_EXPORT cudlaStatus cudlaModuleGetAttributes(const cudlaModule hModule,
                                                   const cudlaModuleAttributeType attrType,
                                                   cudlaModuleAttribute* const attribute);
AIODLA_EXPORT cudlaStatus cudlaModuleUnload(const cudlaModule hModule, const uint32_t flags);
AIODLA_EXPORT cudlaStatus cudlaSubmitTask(const cudlaDevHandle devHandle,
                                          const cudlaTask* const ptrToTasks,
                                          const uint32_t numTasks, void* const stream,
                                          const uint32_t flags);
AIODLA_EXPORT cudlaStatus cudlaDeviceGetAttribute(const cudlaDevHandle devHandle,
                                                  const cudlaDevAttributeType attrib,
                                                  cudlaDevAttribute* const pAttribute);
AIODLA_EXPORT cudlaStatus cudlaMemUnregister(const cudlaDevHandle devHandle,
                                             const uint64_t* const devPtr);
AIODLA_EXPORT cudlaStatus cudlaGetLastError(const cudlaDevHandle devHandle);
AIODLA_EXPORT cudlaStatus cudlaDestroyDevice(const cudlaDevHandle devHandle);
AIODLA_EXPORT cudlaStatus cudlaSetTaskTimeoutInMs(const cudlaDevHandle devHandle,
                                                  const uint32_t timeout);

/* The stand-in's own controls (see standin.cu for their semantics). Core indexes are
 * DLA cores; statuses are cudlaStatus values; 0 means success. */
AIODLA_EXPORT uint32_t aiodlaStandinAbiVersion(void);
AIODLA_EXPORT uint32_t aiodlaStandinIsHostFake(void);
AIODLA_EXPORT uint64_t aiodlaStandinCores(void);
/* on_stream 1: the failure also surfaces as a sticky CUDA error on the task's stream. */
AIODLA_EXPORT int aiodlaStandinFailNextTask(uint64_t core, uint32_t status,
                                            uint32_t on_stream);
AIODLA_EXPORT int aiodlaStandinFailNextCall(const char* function, uint32_t status);
AIODLA_EXPORT int aiodlaStandinHangCore(uint64_t core, int hung);
AIODLA_EXPORT int aiodlaStandinHoldCore(uint64_t core, int hold);
AIODLA_EXPORT int aiodlaStandinHeldTasks(uint64_t core);
AIODLA_EXPORT uint64_t aiodlaStandinCoreTasks(uint64_t core);
AIODLA_EXPORT uint64_t aiodlaStandinCoreBusyNs(uint64_t core);
AIODLA_EXPORT void aiodlaStandinLiveHandles(uint64_t* devices, uint64_t* modules,
                                            uint64_t* registrations);
AIODLA_EXPORT void aiodlaStandinLiveResources(uint64_t* allocations, uint64_t* bytes,
                                              uint64_t* events, uint64_t* streams);
AIODLA_EXPORT void aiodlaStandinReleasedByDestroy(uint64_t* modules, uint64_t* registrations);
/* The sticky cudaError_t that lost the CUDA context, 0 while it is whole. */
AIODLA_EXPORT int aiodlaStandinContextError(void);
AIODLA_EXPORT void aiodlaStandinShutdown(void);
AIODLA_EXPORT int aiodlaStandinCheckLoadable(const void* data, size_t size, char* message,
                                             size_t messageSize);
AIODLA_EXPORT int aiodlaStandinRunOnHost(const void* data, size_t size,
                                         const void* const* inputs, void* const* outputs);
/* Host-fake builds only: "device memory" that cudlaMemRegister accepts. */
AIODLA_EXPORT void* aiodlaStandinFakeAlloc(size_t size);
AIODLA_EXPORT int aiodlaStandinFakeFree(void* ptr);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#ifdef __cplusplus
static_assert(sizeof(cudlaModuleTensorDescriptor) == 168, "descriptor must be 168 bytes");
static_assert(offsetof(cudlaModuleTensorDescriptor, size) == 88, "size at 88");
static_assert(offsetof(cudlaModuleTensorDescriptor, dataFormat) == 128, "dataFormat at 128");
static_assert(offsetof(cudlaModuleTensorDescriptor, pixelMapping) == 132, "pixelMapping at 132");
static_assert(offsetof(cudlaModuleTensorDescriptor, stride) == 136, "stride at 136");
static_assert(sizeof(cudlaTask) == 48, "cudlaTask as the bindings lay it out");
static_assert(offsetof(cudlaTask, numOutputTensors) == 16, "numOutputTensors at 16");
static_assert(offsetof(cudlaTask, inputTensor) == 24, "inputTensor at 24");
static_assert(sizeof(cudlaModuleAttribute) == 8, "attribute union is one pointer");
#endif

#endif /* AIODLA_STANDIN_CUDLA_ABI_H */
