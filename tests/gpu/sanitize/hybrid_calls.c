/* cuDLA hybrid mode, called from plain C exactly in NVIDIA's order, for compute-sanitizer.
 *
 *     hybrid_calls ROUNDS LOADABLE [LOADABLE...]
 *
 * Each round opens a device handle on every DLA core at once (both cores of the
 * stand-in), and on each: loads a loadable (the rounds cycle through those given),
 * reads its tensor descriptors, cudaMallocs and registers every tensor, copies an input
 * in, submits one task on its own stream, copies the output back, synchronizes, checks
 * cudlaGetLastError and compares the bytes with the stand-in's host copy of the task
 * arithmetic (aiodlaStandinRunOnHost); then unregisters, frees, unloads and destroys in
 * reverse order. One more round makes the unbalanced calls (unload twice, destroy with a
 * module and a registration still attached) and checks the statuses cudla.h gives.
 *
 * At the end the stand-in must hold nothing: no handles (aiodlaStandinLiveHandles) and
 * no device allocations, events or streams (aiodlaStandinLiveResources). Run under
 * compute-sanitizer (memcheck --leak-check full, racecheck, synccheck) by
 * tests/gpu/device_run.sh, any leak or hazard is then the stand-in's own. Exit status 0
 * when every check passed; each failure is printed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cudla_abi.h"

AIODLA_EXPORT void aiodlaStandinLiveHandles(uint64_t* devices, uint64_t* modules,
                                            uint64_t* registrations);

#define MAX_TENSORS 16

static int failures = 0;

static void fail(const char* what, long got, long want, int line) {
    fprintf(stderr, "hybrid_calls.c:%d: %s: got %ld, want %ld\n", line, what, got, want);
    failures += 1;
}

/* A cuDLA call that must return `want`. */
#define EXPECT(call, want)                                         \
    do {                                                           \
        long got_ = (long)(call);                                  \
        if (got_ != (long)(want)) fail(#call, got_, (long)(want), __LINE__); \
    } while (0)

#define CUDA(call) EXPECT(call, cudaSuccess)

typedef struct {
    const uint8_t* blob;
    size_t size;
} Loadable;

typedef struct {
    cudlaDevHandle device;
    cudlaModule module;
    uint32_t inputs, outputs;
    cudlaModuleTensorDescriptor in_desc[MAX_TENSORS], out_desc[MAX_TENSORS];
    void* memory[2 * MAX_TENSORS];     /* cudaMalloc: inputs, then outputs */
    uint64_t* registered[2 * MAX_TENSORS];
    void* host[2 * MAX_TENSORS];       /* pinned staging, same order */
    void* expected[MAX_TENSORS];       /* the outputs as the host computes them */
    cudaStream_t stream;
} Handle;

static Loadable read_loadable(const char* path) {
    Loadable result = {NULL, 0};
    FILE* file = fopen(path, "rb");
    if (!file) {
        perror(path);
        exit(2);
    }
    fseek(file, 0, SEEK_END);
    result.size = (size_t)ftell(file);
    fseek(file, 0, SEEK_SET);
    uint8_t* blob = malloc(result.size);
    if (!blob || fread(blob, 1, result.size, file) != result.size) {
        fprintf(stderr, "%s: cannot read\n", path);
        exit(2);
    }
    fclose(file);
    result.blob = blob;
    return result;
}

/* create, load, descriptors, malloc + register, stream: NVIDIA's cuDLAHybridMode order. */
static int open_handle(Handle* h, uint64_t core, const Loadable* loadable) {
    memset(h, 0, sizeof *h);
    EXPECT(cudlaCreateDevice(core, &h->device, CUDLA_CUDA_DLA), cudlaSuccess);
    EXPECT(cudlaModuleLoadFromMemory(h->device, loadable->blob, loadable->size, &h->module,
                                     CUDLA_MODULE_DEFAULT),
           cudlaSuccess);
    cudlaModuleAttribute attribute;
    EXPECT(cudlaModuleGetAttributes(h->module, CUDLA_NUM_INPUT_TENSORS, &attribute),
           cudlaSuccess);
    h->inputs = attribute.numInputTensors;
    EXPECT(cudlaModuleGetAttributes(h->module, CUDLA_NUM_OUTPUT_TENSORS, &attribute),
           cudlaSuccess);
    h->outputs = attribute.numOutputTensors;
    if (h->inputs == 0 || h->inputs > MAX_TENSORS || h->outputs == 0 ||
        h->outputs > MAX_TENSORS) {
        fail("tensor counts within MAX_TENSORS", h->inputs, h->outputs, __LINE__);
        return 0;
    }
    attribute.inputTensorDesc = h->in_desc;
    EXPECT(cudlaModuleGetAttributes(h->module, CUDLA_INPUT_TENSOR_DESCRIPTORS, &attribute),
           cudlaSuccess);
    attribute.outputTensorDesc = h->out_desc;
    EXPECT(cudlaModuleGetAttributes(h->module, CUDLA_OUTPUT_TENSOR_DESCRIPTORS, &attribute),
           cudlaSuccess);
    for (uint32_t k = 0; k < h->inputs + h->outputs; ++k) {
        const size_t size = k < h->inputs ? h->in_desc[k].size : h->out_desc[k - h->inputs].size;
        CUDA(cudaMalloc(&h->memory[k], size));
        CUDA(cudaMallocHost(&h->host[k], size));
        EXPECT(cudlaMemRegister(h->device, (const uint64_t*)h->memory[k], size, &h->registered[k],
                                CUDLA_READ_WRITE_PERM),
               cudlaSuccess);
    }
    CUDA(cudaStreamCreateWithFlags(&h->stream, cudaStreamNonBlocking));
    return 1;
}

/* Inputs in, one task, outputs out, all on the handle's stream (no wait yet). */
static void submit(Handle* h, const Loadable* loadable, unsigned seed) {
    const void* inputs[MAX_TENSORS];
    void* outputs[MAX_TENSORS];
    for (uint32_t i = 0; i < h->inputs; ++i) {
        uint8_t* bytes = h->host[i];
        /* Small bytes: every emulator data type reads them as finite, modest values. */
        for (size_t b = 0; b < h->in_desc[i].size; ++b) bytes[b] = (uint8_t)((b * 7 + seed) % 61);
        inputs[i] = bytes;
        CUDA(cudaMemcpyAsync(h->memory[i], bytes, h->in_desc[i].size, cudaMemcpyHostToDevice,
                             h->stream));
    }
    for (uint32_t o = 0; o < h->outputs; ++o) {
        h->expected[o] = malloc(h->out_desc[o].size);
        outputs[o] = h->expected[o];
    }
    EXPECT(aiodlaStandinRunOnHost(loadable->blob, loadable->size, inputs, outputs), cudlaSuccess);
    cudlaTask task;
    memset(&task, 0, sizeof task);
    task.moduleHandle = h->module;
    task.inputTensor = h->registered;
    task.numInputTensors = h->inputs;
    task.outputTensor = h->registered + h->inputs;
    task.numOutputTensors = h->outputs;
    task.waitEvents = NULL;   /* hybrid mode: the stream orders the work */
    task.signalEvents = NULL;
    EXPECT(cudlaSubmitTask(h->device, &task, 1, h->stream, 0), cudlaSuccess);
    for (uint32_t o = 0; o < h->outputs; ++o) {
        CUDA(cudaMemcpyAsync(h->host[h->inputs + o], h->memory[h->inputs + o], h->out_desc[o].size,
                             cudaMemcpyDeviceToHost, h->stream));
    }
}

/* Wait, then (cudla.h: only after the stream is synchronized) the task's status. */
static void finish(Handle* h) {
    CUDA(cudaStreamSynchronize(h->stream));
    EXPECT(cudlaGetLastError(h->device), cudlaSuccess);
    for (uint32_t o = 0; o < h->outputs; ++o) {
        if (memcmp(h->host[h->inputs + o], h->expected[o], h->out_desc[o].size) != 0) {
            fail("output bytes equal the host's arithmetic", 0, 1, __LINE__);
        }
        free(h->expected[o]);
        h->expected[o] = NULL;
    }
}

/* unregister, free, unload, destroy: the reverse of open_handle. */
static void close_handle(Handle* h) {
    CUDA(cudaStreamDestroy(h->stream));
    for (uint32_t k = h->inputs + h->outputs; k-- > 0;) {
        EXPECT(cudlaMemUnregister(h->device, h->registered[k]), cudlaSuccess);
        CUDA(cudaFree(h->memory[k]));
        CUDA(cudaFreeHost(h->host[k]));
    }
    EXPECT(cudlaModuleUnload(h->module, 0), cudlaSuccess);
    EXPECT(cudlaDestroyDevice(h->device), cudlaSuccess);
}

/* The calls that do not balance, with the statuses cudla.h gives them. */
static void unbalanced_calls(const Loadable* loadable) {
    cudlaDevHandle device = NULL;
    cudlaModule module = NULL;
    EXPECT(cudlaCreateDevice(0, &device, CUDLA_CUDA_DLA), cudlaSuccess);
    EXPECT(cudlaModuleLoadFromMemory(device, loadable->blob, loadable->size, &module, 0),
           cudlaSuccess);
    EXPECT(cudlaModuleUnload(module, 0), cudlaSuccess);
    EXPECT(cudlaModuleUnload(module, 0), cudlaErrorInvalidModule);  /* names no loaded module */
    EXPECT(cudlaDestroyDevice(device), cudlaSuccess);
    EXPECT(cudlaDestroyDevice(device), cudlaErrorInvalidDevice);

    /* Destroy with a module and a registration attached: cudla.h lists no error for it,
     * so the handle's destruction releases both; the module's device is then gone. */
    void* memory = NULL;
    uint64_t* registered = NULL;
    EXPECT(cudlaCreateDevice(1, &device, CUDLA_CUDA_DLA), cudlaSuccess);
    EXPECT(cudlaModuleLoadFromMemory(device, loadable->blob, loadable->size, &module, 0),
           cudlaSuccess);
    CUDA(cudaMalloc(&memory, 4096));
    EXPECT(cudlaMemRegister(device, (const uint64_t*)memory, 4096, &registered, 0), cudlaSuccess);
    EXPECT(cudlaDestroyDevice(device), cudlaSuccess);
    EXPECT(cudlaModuleUnload(module, 0), cudlaErrorInvalidDevice);
    EXPECT(cudlaMemUnregister(device, registered), cudlaErrorInvalidDevice);
    CUDA(cudaFree(memory));
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ROUNDS LOADABLE [LOADABLE...]\n", argv[0]);
        return 2;
    }
    const int rounds = atoi(argv[1]);
    const int count = argc - 2;
    Loadable* loadables = calloc((size_t)count, sizeof *loadables);
    for (int i = 0; i < count; ++i) loadables[i] = read_loadable(argv[2 + i]);

    uint64_t cores = 0;
    EXPECT(cudlaDeviceGetCount(&cores), cudlaSuccess);
    if (cores < 2 || cores > 16) {
        fail("DLA cores", (long)cores, 2, __LINE__);
        return 1;
    }
    Handle* handles = calloc(cores, sizeof *handles);
    for (int round = 0; round < rounds; ++round) {
        const Loadable* loadable = &loadables[round % count];
        int opened = 0;
        while ((uint64_t)opened < cores && open_handle(&handles[opened], opened, loadable)) {
            opened += 1;
        }
        if ((uint64_t)opened == cores) {
            for (int c = 0; c < opened; ++c) submit(&handles[c], loadable, (unsigned)(round + c));
            for (int c = 0; c < opened; ++c) finish(&handles[c]);
        }
        for (int c = opened; c-- > 0;) close_handle(&handles[c]);
    }
    unbalanced_calls(&loadables[0]);

    uint64_t devices = 9, modules = 9, registrations = 9;
    aiodlaStandinLiveHandles(&devices, &modules, &registrations);
    EXPECT(devices + modules + registrations, 0);
    uint64_t allocations = 9, bytes = 9, events = 9, streams = 9;
    aiodlaStandinLiveResources(&allocations, &bytes, &events, &streams);
    EXPECT(allocations, 0);
    EXPECT(bytes, 0);
    EXPECT(events, 0);
    EXPECT(streams, 0);
    uint64_t released_modules = 0, released_registrations = 0;
    aiodlaStandinReleasedByDestroy(&released_modules, &released_registrations);
    EXPECT(released_modules, 1);
    EXPECT(released_registrations, 1);

    for (int i = 0; i < count; ++i) free((void*)loadables[i].blob);
    free(loadables);
    free(handles);
    printf("hybrid_calls: %d rounds on %lu cores over %d loadables, %d failures\n", rounds,
           (unsigned long)cores, count, failures);
    return failures ? 1 : 0;
}
