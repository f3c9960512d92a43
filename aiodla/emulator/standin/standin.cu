/* aiodla's GPU stand-in for libcudla.so.1: cuDLA hybrid mode over the CUDA runtime.
 *
 * THIS IS A TEST DOUBLE, NOT A DLA DRIVER. It reads aiodla's emulator loadables (the
 * format in aiodla/emulator/_format.py), never NVIDIA's, and runs each DLA task as a
 * CUDA kernel so the real CUDA path of aiodla (cuda.bindings.cudla + .runtime) can run
 * end to end on any NVIDIA GPU. What it reproduces of cuDLA:
 *
 * - the 13 entry points, C ABI, SONAME libcudla.so.1, callable from any thread;
 * - hybrid mode: a task is a kernel launched on the stream given to cudlaSubmitTask,
 *   so it orders itself with the caller's copies and events on that stream;
 * - DLA cores (2, or AIODLA_STANDIN_CORES in 1..16) that run one task at a time: the
 *   tasks of one core are serialized across streams and threads in submission order:
 *   under a per-core host mutex each task takes the core's next ticket, and its kernel,
 *   once its stream has reached it, waits on the GPU for the core's turn word to reach
 *   that ticket, runs, and passes the turn on. A CUDA event chain between the tasks
 *   (the first design) cost each task about 14 us of the core's time in cross-stream
 *   hand-over, which a DLA running its queue back to back does not spend;
 * - each core keeps a timeline, as the emulated runtime's cores do: a task starts when
 *   its stream reached it or when the core's previous task ended, whichever is later,
 *   and ends exactly its service time after that start, however late its kernel saw
 *   the turn; so the hand-over's own latency is hidden behind a queued task's service
 *   time, as it is on a DLA, and the stand-in's cores reach `cores / service time`;
 * - the service time (the loadable's latency) is spent on the GPU, spinning on
 *   %globaltimer, never on the host;
 * - the validation rules of cudla.h, as aiodla's emulated runtime applies them;
 * - cudlaGetLastError: a failed task writes its status into mapped pinned memory, so it
 *   reaches the host without any synchronization, and it stays latched until read;
 * - the two ways a DLA task fault surfaces in hybrid mode: through cudlaGetLastError
 *   alone, or also as a sticky CUDA error on the task's stream (NVIDIA's
 *   cuDLAErrorReporting sample: cudaErrorExternalDevice), which loses the process's CUDA
 *   context. A GPU cannot raise cudaErrorExternalDevice, so the faulting task traps
 *   (__trap) once its status is published: the engine then sees the trap's sticky error
 *   (cudaErrorLaunchFailure, 719, or cudaErrorIllegalInstruction, 715, by driver and
 *   GPU) from every later CUDA call, and cudlaGetLastError still says what the DLA
 *   reported. Work queued behind the fault is lost with the context, so handles whose
 *   tasks never ran can still be released.
 *
 * Test controls (aiodlaStandin* exports, wrapped by aiodla.emulator._standin): fail the
 * next task started on a core, through cudlaGetLastError alone or also on its stream;
 * hang a core (its tasks run until the device's task timeout, then fail with
 * cudlaErrorDlaErrEngineTimeout); hold a core's tasks at a gate on the GPU; inject a
 * status into the next call of an entry point; count live handles; report the sticky
 * error that lost the CUDA context.
 *
 * Built with -DAIODLA_STANDIN_HOST_FAKE, the same code runs each task on the calling
 * host thread at submit time over host memory from aiodlaStandinFakeAlloc: a CPU-only
 * build that lets CI drive the entry points and the bindings without a GPU. There a
 * fault on the stream marks the (fake) context lost with cudaErrorLaunchFailure, which
 * the Python fake of the CUDA runtime (tests/gpu/_host_fake.py) then reports from every
 * call, as a real context would.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#ifndef AIODLA_STANDIN_HOST_FAKE
#include <cuda_runtime.h>
#endif

#include "cudla_abi.h"
#include "loadable.h"
#include "task_math.h"

namespace aiodla_standin {

constexpr uint32_t kMaxCores = 16;
constexpr uint32_t kDefaultCores = 2;
constexpr uint32_t kHandlesPerCore = 16;        /* cudla.h: at most 16 handles per DLA */
constexpr uint32_t kSlots = kMaxCores * kHandlesPerCore;
constexpr uint32_t kFailRing = 64;
constexpr uint32_t kDefaultTimeoutMs = 30000;   /* cuDLA's default task timeout */
constexpr uint32_t kMaxTimeoutMs = 1000000;     /* 1000 s */
constexpr uint64_t kRegisteredTag = 1ull << 56; /* as the emulated runtime: never a raw address */
constexpr uint64_t kRegistrationAlignment = 32;
constexpr uint32_t kThreads = 512;
/* 2: aiodlaStandinLiveResources, ...ReleasedByDestroy; 3: aiodlaStandinFailNextTask's
 * on_stream argument, aiodlaStandinContextError */
constexpr uint32_t kAbiVersion = 3;
constexpr uint64_t kCudlaVersion = 1002001;     /* what the emulated runtime reports */
constexpr uint32_t kDeviceVersion = 2;
constexpr uint32_t kEngineTimeout = cudlaErrorDlaErrEngineTimeout;
/* What the host-fake build's lost context reports (cudaErrorLaunchFailure): the error a
 * trapping kernel gives on most drivers. The host fake has no cuda_runtime.h to name it. */
constexpr int kHostFakeTrapError = 719;

/* Shared with the GPU through mapped pinned memory. Each word has one writer: the host
 * writes the flags and the failure ring's head; the task running on a core writes the
 * rest, and a core runs one task at a time, so plain volatile read-modify-writes are
 * enough (system-scope atomics on host memory are not available over PCIe). */
struct CoreControl {
    uint32_t hold;        /* host: tasks wait at the gate while set */
    uint32_t held;        /* GPU: 1 while a task waits at the gate */
    uint32_t hung;        /* host: tasks run until the timeout, then fail */
    uint32_t fail_head;   /* host: failures pushed */
    uint32_t fail_tail;   /* GPU: failures consumed */
    uint32_t reserved[3];
    uint32_t fail_ring[kFailRing];       /* host: the statuses of the failures pushed */
    uint32_t fail_on_stream[kFailRing];  /* host: beside each, 1 for a fault on the stream */
    unsigned long long tasks_completed;
    unsigned long long busy_ns;
    /* The turn: the ticket of the task that may run on the core now. Written by the task
     * holding the turn only (it passes the turn on), so one writer at a time. */
    unsigned long long turn;
    /* When the core's last task ended on its timeline (%globaltimer ns): the next task
     * starts no earlier. Written with the turn, before it, by the same task. */
    unsigned long long free_at;
};

struct SlotControl {      /* one per live device handle */
    uint32_t error_status;
    uint32_t error_seq;   /* bumped after error_status is written */
    unsigned long long completed;
};

struct Control {
    uint32_t shutdown;    /* host: every waiting task ends now */
    uint32_t reserved;
    CoreControl cores[kMaxCores];
    SlotControl slots[kSlots];
};

template <class T>
AIODLA_HD inline T vload(const T* p) {
    return *static_cast<const volatile T*>(p);
}

template <class T>
AIODLA_HD inline void vstore(T* p, T value) {
    *static_cast<volatile T*>(p) = value;
}

AIODLA_HD inline void fence_system() {
#ifdef __CUDA_ARCH__
    __threadfence_system();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

AIODLA_HD inline unsigned long long now_ns() {
#ifdef __CUDA_ARCH__
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<unsigned long long>(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
#endif
}

/* Back off while spinning: the GPU thread sleeps briefly so a long hang or gate does not
 * hammer PCIe with reads of host memory. */
AIODLA_HD inline void back_off(unsigned long long remaining_ns) {
#ifdef __CUDA_ARCH__
#if __CUDA_ARCH__ >= 700
    __nanosleep(remaining_ns > 4000 ? 2000u : 200u);
#endif
#else
    (void)remaining_ns;
    std::this_thread::yield();
#endif
}

struct TaskArgs {
    const ModuleTable* table;  /* device memory */
    CoreControl* core;         /* device view of mapped memory */
    SlotControl* slot;
    const uint32_t* shutdown;
    unsigned long long latency_ns;
    unsigned long long timeout_ns;
    unsigned long long ticket;  /* the task's place in its core's submission order */
    const uint8_t* inputs[kMaxPairs];
    uint8_t* outputs[kMaxPairs];
};

struct TaskStart {
    uint32_t status;
    uint32_t on_stream;  /* the failure also surfaces on the stream: the context is lost */
    unsigned long long start;
    unsigned long long duration;
};

/* One thread of the task, as its kernel starts (`arrival`: its stream has reached it):
 * wait for the core's turn to come to this task's ticket, and return when the task
 * starts on the core's timeline: at its arrival, or at the end of the core's previous
 * task if that is later. The wait polls the mapped turn word; at shutdown every waiting
 * task goes on at once, as every other wait of the stand-in does. */
AIODLA_HD inline unsigned long long acquire_turn(const TaskArgs& a, unsigned long long arrival) {
    CoreControl* core = a.core;
    while (vload(&core->turn) != a.ticket) {
        if (vload(a.shutdown)) return now_ns();
        back_off(0);
    }
    fence_system();  /* read free_at only after seeing the turn that covers it */
    const unsigned long long free_at = vload(&core->free_at);
    return free_at > arrival ? free_at : arrival;
}

/* One thread of the task, holding the turn: the gate, the start time and the injected
 * faults. `earliest` is the start acquire_turn gave; a task held at the gate starts when
 * the gate opens. */
AIODLA_HD inline TaskStart begin_task(const TaskArgs& a, unsigned long long earliest) {
    CoreControl* core = a.core;
    TaskStart t;
    t.status = 0;
    t.on_stream = 0;
    t.start = earliest;
    t.duration = a.latency_ns;
    if (vload(&core->hold)) {
        vstore(&core->held, 1u);
        fence_system();
        const unsigned long long since = now_ns();
        /* The gate is bounded by the task timeout, as any DLA task is, so a test that
         * forgets to release a core cannot leave a kernel spinning forever. */
        while (vload(&core->hold) && !vload(a.shutdown)) {
            const unsigned long long waited = now_ns() - since;
            if (waited >= a.timeout_ns) {
                vstore(&core->held, 0u);
                fence_system();
                t.status = kEngineTimeout;
                t.start = now_ns();
                t.duration = 0;
                return t;
            }
            back_off(a.timeout_ns - waited);
        }
        vstore(&core->held, 0u);
        fence_system();
        t.start = now_ns();
    }
    const uint32_t head = vload(&core->fail_head);
    const uint32_t tail = vload(&core->fail_tail);
    if (head != tail) {
        fence_system();  /* read the ring entry only after seeing the head that covers it */
        t.status = vload(&core->fail_ring[tail % kFailRing]);
        t.on_stream = vload(&core->fail_on_stream[tail % kFailRing]);
        vstore(&core->fail_tail, tail + 1);
    }
    if (vload(&core->hung)) {
        /* A hung core's task ends by its timeout, as hang_core says, whatever it took. */
        t.status = kEngineTimeout;
        t.on_stream = 0;
        t.duration = a.timeout_ns;
    }
    return t;
}

/* One thread of the task: spend the rest of the service time, publish the end, then pass
 * the core's turn on (last: the counters above have one writer, the turn's holder). */
AIODLA_HD inline void finish_task(const TaskArgs& a, const TaskStart& t) {
    const unsigned long long end = t.start + t.duration;
    for (;;) {
        const unsigned long long now = now_ns();
        if (now >= end || vload(a.shutdown)) break;
        back_off(end - now);
    }
    CoreControl* core = a.core;
    SlotControl* slot = a.slot;
    if (t.status) {
        vstore(&slot->error_status, t.status);
        fence_system();
        vstore(&slot->error_seq, vload(&slot->error_seq) + 1);
    }
    vstore(&core->tasks_completed, vload(&core->tasks_completed) + 1);
    vstore(&core->busy_ns, vload(&core->busy_ns) + t.duration);
    fence_system();  /* the output and status words before the completion count */
    vstore(&slot->completed, vload(&slot->completed) + 1);
    vstore(&core->free_at, end);
    fence_system();  /* the task's words and free_at before the turn that publishes them */
    vstore(&core->turn, a.ticket + 1);
    fence_system();
}

/* The op mix in one block: zero the outputs, sum every input's part per thread into
 * shared counters (wrapping uint64 addition is associative and commutative, so the
 * threads' order does not matter), the digest on one thread, then the outputs. */
__device__ inline void run_mix(const ModuleTable& table, const TaskArgs& args) {
    __shared__ unsigned long long sums[kMaxPairs];
    __shared__ unsigned long long digest;
    for (uint32_t o = 0; o < table.num_outputs; ++o) {
        zero_buffer(args.outputs[o], table.outputs[o].size, threadIdx.x, blockDim.x);
    }
    for (uint32_t t = threadIdx.x; t < table.num_inputs; t += blockDim.x) sums[t] = 0;
    __syncthreads();
    for (uint32_t t = 0; t < table.num_inputs; ++t) {
        const uint64_t part =
            mix_partial_sum(table.inputs[t], t, args.inputs[t], digest_grid(table.op), threadIdx.x,
                            blockDim.x);
        atomicAdd(&sums[t], static_cast<unsigned long long>(part));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t copy[kMaxPairs];
        for (uint32_t t = 0; t < table.num_inputs; ++t) copy[t] = sums[t];
        digest = mix_digest(copy, table.num_inputs);
    }
    __syncthreads();
    for (uint32_t o = 0; o < table.num_outputs; ++o) {
        digest_store(table, o, digest, table.num_inputs ? args.inputs[0] : nullptr,
                     args.outputs[o], threadIdx.x, blockDim.x);
    }
}

/* One block: a task is one serial unit whose phases are separated by __syncthreads. Its
 * kThreads threads (512: 16 warps to hide the latency of the index arithmetic; 256 left a
 * 640x640 detector's heads 3 ms over their stated time on an H100) cover an emulator
 * tensor; a core's waiting tasks each hold a block, so more would leave fewer SMs for
 * the tasks queued on other streams. */
__global__ void __launch_bounds__(kThreads) task_kernel(const TaskArgs args) {
    __shared__ TaskStart started;
    if (threadIdx.x == 0) started = begin_task(args, acquire_turn(args, now_ns()));
    __syncthreads();
    if (started.status == 0) {
        const ModuleTable& table = *args.table;
        if (table.op == kOpMix || table.op == kOpDetect) {
            run_mix(table, args);
        } else {
            for (uint32_t p = 0; p < table.num_inputs; ++p) {
                zero_buffer(args.outputs[p], table.outputs[p].size, threadIdx.x, blockDim.x);
                __syncthreads();
                compute_pair(table, p, args.inputs[p], args.outputs[p], threadIdx.x, blockDim.x);
                __syncthreads();
            }
        }
    }
    if (threadIdx.x == 0) {
        finish_task(args, started);
        /* The fault on the stream: finish_task has published the status and the task's
         * end behind a system fence, so cudlaGetLastError reports them; only then does
         * the trap lose the context, killing the stream's later work and every other
         * kernel (the tasks queued behind this one on any core among them). */
        if (started.on_stream) __trap();
    }
}

/* The sticky CUDA error that lost the process's CUDA context, once the stand-in has met
 * one (0 until then). Kept beside the context's users so that releases can tell "a task
 * is still running" from "its work was lost with the context" (see in_flight). A context
 * is never found again, so the first error stays. */
inline std::atomic<int>& lost_context() {
    static std::atomic<int>* error = new std::atomic<int>(0);  /* never destroyed */
    return *error;
}

inline void record_lost_context(int error) {
    int none = 0;
    lost_context().compare_exchange_strong(none, error);
}

/* The same task, run to the end on the calling host thread (host-fake builds). A fault on
 * the stream loses the fake context, as the kernel's trap loses the real one. */
inline void run_task_on_host(const TaskArgs& args) {
    const TaskStart started = begin_task(args, acquire_turn(args, now_ns()));
    if (started.status == 0) run_task_serially(*args.table, args.inputs, args.outputs);
    finish_task(args, started);
    if (started.on_stream) record_lost_context(kHostFakeTrapError);
}

/* What the stand-in holds of the CUDA device right now: every allocation, event and
 * stream it made and has not released. Kept beside the CUDA calls themselves (in
 * Platform), so nothing the stand-in creates escapes the count; a test that opens and
 * closes an engine can then require all of it back at zero (aiodlaStandinLiveResources).
 * The mapped control block counts as one allocation: it lives while any device handle
 * does. */
struct Accounting {
    std::atomic<uint64_t> allocations{0};
    std::atomic<uint64_t> bytes{0};
    /* No event is made since the ticket turn replaced the event chain; the count stays
     * in the ABI (aiodlaStandinLiveResources) so that any event a later change makes is
     * counted, and tests require zero. */
    std::atomic<uint64_t> events{0};
    std::atomic<uint64_t> streams{0};
};

inline Accounting& accounting() {
    static Accounting* instance = new Accounting();  /* never destroyed, as library() */
    return *instance;
}

inline void count_allocation(size_t size) {
    accounting().allocations.fetch_add(1);
    accounting().bytes.fetch_add(size);
}

inline void count_free(size_t size) {
    accounting().allocations.fetch_sub(1);
    accounting().bytes.fetch_sub(size);
}

/* ------------------------------------------------------------------------------------
 * The few CUDA facilities the stand-in needs, and their host fakes.
 * ---------------------------------------------------------------------------------- */

enum class Launch { kFailed, kLaunched };

#ifndef AIODLA_STANDIN_HOST_FAKE

/* The errors after which every CUDA call in the process fails: the context is lost
 * (aiodla.runtime's STICKY_CUDA_ERRORS). */
inline bool sticky(cudaError_t error) {
    switch (error) {
        case cudaErrorECCUncorrectable:
        case cudaErrorIllegalAddress:
        case cudaErrorLaunchTimeout:
        case cudaErrorHardwareStackError:
        case cudaErrorIllegalInstruction:
        case cudaErrorMisalignedAddress:
        case cudaErrorInvalidAddressSpace:
        case cudaErrorInvalidPc:
        case cudaErrorLaunchFailure:
        case cudaErrorExternalDevice:
            return true;
        default:
            return false;
    }
}

/* The stand-in links the CUDA runtime statically: its handles are the driver's, so the
 * streams and events of cuda.bindings.runtime (another cudart in the same process) are
 * valid here as long as both run in the device's primary context, which the runtime
 * API always uses. A failed call's error is cleared so it never leaks into a later one;
 * a sticky one cannot be, and is remembered: the context is lost. */
inline bool cuda_ok(cudaError_t result) {
    if (result == cudaSuccess) return true;
    if (sticky(result)) record_lost_context(static_cast<int>(result));
    (void)cudaGetLastError();
    return false;
}

struct Platform {
    static bool current_device(int* device) { return cuda_ok(cudaGetDevice(device)); }

    /* True once the CUDA context is lost. `stream`, one of the stand-in's own (idle or
     * not), is asked when no call has met the sticky error yet: any work-related call
     * reports it from the moment the device raised it. */
    static bool context_lost(void* stream) {
        if (!lost_context().load() && stream) {
            cuda_ok(cudaStreamQuery(static_cast<cudaStream_t>(stream)));
        }
        return lost_context().load() != 0;
    }

    static bool use_device(int device) {
        int current = -1;
        if (cuda_ok(cudaGetDevice(&current)) && current == device) return true;
        return cuda_ok(cudaSetDevice(device));
    }

    using AddressRange = int (*)(unsigned long long*, size_t*, unsigned long long);

    static AddressRange address_range() {
        static const AddressRange resolved = [] {
            void* fn = nullptr;
            cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
            if (!cuda_ok(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                          cudaEnableDefault, &found)) ||
                found != cudaDriverEntryPointSuccess) {
                return static_cast<AddressRange>(nullptr);
            }
            return reinterpret_cast<AddressRange>(fn);
        }();
        return resolved;
    }

    /* True when [ptr, ptr + size) lies inside one device allocation (cudaMalloc). */
    static bool device_allocation(uint64_t ptr, uint64_t size) {
        cudaPointerAttributes attributes;
        if (!cuda_ok(cudaPointerGetAttributes(&attributes, reinterpret_cast<const void*>(ptr)))) {
            return false;
        }
        if (attributes.type != cudaMemoryTypeDevice) return false;
        const AddressRange range = address_range();
        if (!range) return true;  /* a driver without the entry point: trust the start */
        unsigned long long base = 0;
        size_t bytes = 0;
        if (range(&base, &bytes, ptr) != 0) return false;
        return ptr >= base && ptr + size <= base + bytes;
    }

    static bool mapped_host_alloc(size_t size, void** host, void** device) {
        if (!cuda_ok(cudaHostAlloc(host, size, cudaHostAllocMapped | cudaHostAllocPortable))) {
            return false;
        }
        memset(*host, 0, size);
        if (!cuda_ok(cudaHostGetDevicePointer(device, *host, 0))) {
            cudaFreeHost(*host);
            return false;
        }
        count_allocation(size);
        return true;
    }

    static void mapped_host_free(void* host, size_t size) {
        cuda_ok(cudaFreeHost(host));
        count_free(size);
    }

    /* Module tables come from the stream-ordered allocator on the core's private upload
     * stream: cudaFreeAsync returns a table without synchronizing the device, so an
     * unload never waits behind tasks held or hung on another core (plain cudaFree may
     * synchronize the whole device). A device without memory pools falls back to
     * cudaMalloc / cudaFree and accepts that wait. */
    static bool pools_supported() {
        int device = 0;
        int supported = 0;
        return current_device(&device) &&
               cuda_ok(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported,
                                              device)) &&
               supported;
    }

    /* *pooled says which allocator served it; device_free needs the same answer. */
    static bool device_alloc(void** memory, size_t size, void* stream, bool* pooled) {
        *pooled = pools_supported();
        const bool ok =
            *pooled ? cuda_ok(cudaMallocAsync(memory, size, static_cast<cudaStream_t>(stream)))
                    : cuda_ok(cudaMalloc(memory, size));
        if (!ok) {
            *memory = nullptr;
            return false;
        }
        count_allocation(size);
        return true;
    }

    static void device_free(void* memory, size_t size, void* stream, bool pooled) {
        if (!memory) return;
        /* Counted as released even if CUDA reports an error: the pointer is given up
         * either way, and a sticky context error fails every later call anyway. */
        if (pooled) {
            cuda_ok(cudaFreeAsync(memory, static_cast<cudaStream_t>(stream)));
        } else {
            cuda_ok(cudaFree(memory));
        }
        count_free(size);
    }

    /* Copy `size` bytes from `host` into the device memory at `memory`, on the core's
     * private non-blocking stream, so the copy never waits behind tasks held or hung on
     * a core; the stream is synchronized, so the bytes are in place on return. */
    static bool upload(void* memory, const void* host, size_t size, void* stream) {
        cudaStream_t on = static_cast<cudaStream_t>(stream);
        return cuda_ok(cudaMemcpyAsync(memory, host, size, cudaMemcpyHostToDevice, on)) &&
               cuda_ok(cudaStreamSynchronize(on));
    }

    static bool stream_create(void** stream) {
        cudaStream_t created = nullptr;
        if (!cuda_ok(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking))) return false;
        *stream = created;
        accounting().streams.fetch_add(1);
        return true;
    }

    /* Returns at once; CUDA releases the stream once its pending work (a table's
     * cudaFreeAsync) is done. */
    static void stream_destroy(void* stream) {
        cuda_ok(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
        accounting().streams.fetch_sub(1);
    }

    static Launch launch(void* stream, const TaskArgs& args) {
        task_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args);
        return cuda_ok(cudaGetLastError()) ? Launch::kLaunched : Launch::kFailed;
    }
};

#else  /* AIODLA_STANDIN_HOST_FAKE */

struct Platform {
    static std::mutex& allocations_mutex() {
        static std::mutex mutex;
        return mutex;
    }
    static std::map<uint64_t, uint64_t>& allocations() {  /* start -> size */
        static std::map<uint64_t, uint64_t> live;
        return live;
    }

    static bool current_device(int* device) {
        *device = 0;
        return true;
    }
    static bool use_device(int) { return true; }

    /* The fake context is lost by a fault on the stream (run_task_on_host); from then on
     * what would make or queue work on the device fails, as on a real lost context. */
    static bool context_lost(void*) { return lost_context().load() != 0; }

    static bool device_allocation(uint64_t ptr, uint64_t size) {
        std::lock_guard<std::mutex> lock(allocations_mutex());
        auto it = allocations().upper_bound(ptr);
        if (it == allocations().begin()) return false;
        --it;
        return ptr >= it->first && ptr + size <= it->first + it->second;
    }

    static bool mapped_host_alloc(size_t size, void** host, void** device) {
        if (context_lost(nullptr)) return false;
        *host = calloc(1, size);
        *device = *host;
        if (*host) count_allocation(size);
        return *host != nullptr;
    }

    static void mapped_host_free(void* host, size_t size) {
        free(host);
        count_free(size);
    }

    static bool device_alloc(void** memory, size_t size, void*, bool* pooled) {
        *pooled = false;
        *memory = context_lost(nullptr) ? nullptr : malloc(size);
        if (!*memory) return false;
        count_allocation(size);
        return true;
    }

    static void device_free(void* memory, size_t size, void*, bool) {
        if (!memory) return;
        free(memory);
        count_free(size);
    }

    static bool upload(void* memory, const void* host, size_t size, void*) {
        if (context_lost(nullptr)) return false;
        memcpy(memory, host, size);
        return true;
    }

    static bool stream_create(void** stream) {
        if (context_lost(nullptr)) return false;
        *stream = new int(0);
        accounting().streams.fetch_add(1);
        return true;
    }
    static void stream_destroy(void* stream) {
        delete static_cast<int*>(stream);
        accounting().streams.fetch_sub(1);
    }

    static Launch launch(void*, const TaskArgs& args) {
        if (context_lost(nullptr)) return Launch::kFailed;
        run_task_on_host(args);
        return Launch::kLaunched;
    }
};

#endif  /* AIODLA_STANDIN_HOST_FAKE */

/* ------------------------------------------------------------------------------------
 * Library state. One mutex guards the handle tables; a per-core mutex orders launches.
 * ---------------------------------------------------------------------------------- */

struct Registration {
    uint64_t raw;
    uint64_t size;
};

struct DeviceState {
    uint32_t core = 0;
    int cuda_device = 0;
    uint32_t slot = 0;
    uint64_t module = 0;
    std::unordered_map<uint64_t, Registration> registrations;  /* by registered address */
    uint64_t submitted = 0;
    uint32_t seen_error_seq = 0;
    uint32_t timeout_ms = kDefaultTimeoutMs;
};

struct ModuleState {
    uint64_t device = 0;
    ParsedModule parsed;
    ModuleTable* table = nullptr;  /* device memory */
    bool pooled = false;           /* table from the stream-ordered allocator */
};

/* What a core holds on the CUDA device lives exactly as long as the core has device
 * handles: created with the first, destroyed with the last (cudlaDestroyDevice). */
struct CoreLane {
    std::mutex launch;
    /* The ticket the core's next launched task takes (under `launch`). Never reset: the
     * turn word it is matched against lives in the control words, which outlive every
     * device handle (see Library::saved). */
    uint64_t next_ticket = 0;
    void* upload = nullptr;  /* private stream: module tables' copies, allocations, frees */
    int cuda_device = -1;
    uint32_t handles = 0;
};

struct Library {
    std::mutex mutex;
    uint32_t cores = kDefaultCores;
    CoreLane core[kMaxCores];
    std::unordered_map<uint64_t, DeviceState> devices;
    std::unordered_map<uint64_t, ModuleState> modules;
    /* Modules whose device handle was destroyed under them (cudlaDestroyDevice releases
     * them): their handles answer cudlaErrorInvalidDevice from then on, as cudla.h says
     * of a module "not loaded into a valid device". A few bytes a handle, misuse only. */
    std::unordered_set<uint64_t> orphaned_modules;
    uint64_t released_modules = 0;        /* modules and registrations that */
    uint64_t released_registrations = 0;  /* cudlaDestroyDevice had to release */
    uint64_t next_handle = 0xd1a00010;
    bool slot_used[kSlots] = {};
    /* The control words live in mapped pinned memory while any device handle does (the
     * tasks read and write them there), and in `saved`, plain host memory, while none
     * does: the test controls' state (holds, hangs, queued failures, counters) carries
     * across, and nothing stays pinned once the last handle is destroyed. */
    Control* control = nullptr;         /* host view of the mapped block, or null */
    Control* control_device = nullptr;  /* device view */
    Control saved = {};
    std::mutex control_mutex;           /* switching blocks; every test control's access */
    std::mutex injected_mutex;
    std::unordered_map<std::string, uint32_t> injected;
    std::atomic<bool> any_injected{false};

    Library() {
        const char* text = getenv("AIODLA_STANDIN_CORES");
        if (text && *text) {
            char* end = nullptr;
            const unsigned long value = strtoul(text, &end, 10);
            if (end && *end == '\0' && value >= 1 && value <= kMaxCores) {
                cores = static_cast<uint32_t>(value);
            }
        }
    }
};

/* Never destroyed: entry points may run from other libraries' exit paths. */
inline Library& library() {
    static Library* instance = new Library();
    return *instance;
}

/* Map the control words for the tasks (the first device handle). Call with lib.mutex. */
inline bool ensure_control(Library& lib) {
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    if (lib.control) return true;
    void* host = nullptr;
    void* device = nullptr;
    if (!Platform::mapped_host_alloc(sizeof(Control), &host, &device)) return false;
    memcpy(host, &lib.saved, sizeof(Control));
    lib.control_device = static_cast<Control*>(device);
    __atomic_store_n(&lib.control, static_cast<Control*>(host), __ATOMIC_RELEASE);
    return true;
}

/* Unmap them again (the last device handle is gone, so no task can touch them): the
 * words go back to `saved` and the pinned block is freed. Call with lib.mutex. */
inline void release_control(Library& lib) {
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    Control* host = lib.control;
    if (!host) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    memcpy(&lib.saved, host, sizeof(Control));
    __atomic_store_n(&lib.control, static_cast<Control*>(nullptr), __ATOMIC_RELEASE);
    lib.control_device = nullptr;
    Platform::mapped_host_free(host, sizeof(Control));
}

/* The control words in force now. Call with lib.control_mutex. */
inline Control* active_control(Library& lib) { return lib.control ? lib.control : &lib.saved; }

inline bool take_injected(const char* call, cudlaStatus* status) {
    Library& lib = library();
    if (!lib.any_injected.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> lock(lib.injected_mutex);
    auto it = lib.injected.find(call);
    if (it == lib.injected.end()) return false;
    *status = static_cast<cudlaStatus>(it->second);
    lib.injected.erase(it);
    lib.any_injected.store(!lib.injected.empty(), std::memory_order_release);
    return true;
}

#define AIODLA_INJECTION_POINT(call)                   \
    do {                                               \
        cudlaStatus injected_status_;                  \
        if (aiodla_standin::take_injected(call, &injected_status_)) { \
            return injected_status_;                   \
        }                                              \
    } while (0)

inline uint64_t handle_value(const void* handle) {
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(handle));
}

/* Tasks of the handle submitted and not yet ended. Once the CUDA context is lost, none:
 * the tasks queued behind the fault never run and never will (as the emulated runtime's
 * poison drops the device's queued work), so the caller may release the handle's
 * module, memory and the handle itself instead of being refused forever. */
inline uint64_t in_flight(Library& lib, const DeviceState& device) {
    const uint64_t count = device.submitted - vload(&lib.control->slots[device.slot].completed);
    if (count && Platform::context_lost(lib.core[device.core].upload)) return 0;
    return count;
}

/* Give back what a loaded module holds on the device (its table), on its core's upload
 * stream. Called with lib.mutex held, once no task of the module's device is in flight. */
inline void release_module(Library& lib, ModuleState& module, const DeviceState& device) {
    Platform::device_free(module.table, sizeof(ModuleTable), lib.core[device.core].upload,
                          module.pooled);
    module.table = nullptr;
}

}  // namespace aiodla_standin

using namespace aiodla_standin;

/* ------------------------------------------------------------------------------------
 * The 13 entry points.
 * ---------------------------------------------------------------------------------- */

extern "C" cudlaStatus cudlaGetVersion(uint64_t* const version) {
    AIODLA_INJECTION_POINT("cudlaGetVersion");
    if (!version) return cudlaErrorInvalidParam;
    *version = kCudlaVersion;
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaDeviceGetCount(uint64_t* const pNumDevices) {
    AIODLA_INJECTION_POINT("cudlaDeviceGetCount");
    if (!pNumDevices) return cudlaErrorInvalidParam;
    *pNumDevices = library().cores;
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaCreateDevice(const uint64_t device, cudlaDevHandle* const devHandle,
                                         const uint32_t flags) {
    AIODLA_INJECTION_POINT("cudlaCreateDevice");
    Library& lib = library();
    if (!devHandle) return cudlaErrorInvalidParam;
    if (flags == CUDLA_STANDALONE) return cudlaErrorUnsupportedOperation;
    if (flags != CUDLA_CUDA_DLA) return cudlaErrorInvalidParam;
    if (device >= lib.cores) return cudlaErrorInvalidParam;
    int cuda_device = 0;
    if (!Platform::current_device(&cuda_device)) return cudlaErrorCuda;
    std::lock_guard<std::mutex> lock(lib.mutex);
    CoreLane& core = lib.core[device];
    if (core.handles >= kHandlesPerCore) return cudlaErrorOutOfResources;
    if (core.handles && core.cuda_device != cuda_device) return cudlaErrorInvalidDevice;
    uint32_t slot = 0;
    while (slot < kSlots && lib.slot_used[slot]) ++slot;
    if (slot == kSlots) return cudlaErrorOutOfResources;
    if (!ensure_control(lib)) return cudlaErrorCuda;
    if (!core.handles) {
        /* The upload stream lives in the CUDA context of the core's handles; a fresh one
         * after every last handle goes keeps it in the context now current. */
        if (!Platform::stream_create(&core.upload)) {
            if (lib.devices.empty()) release_control(lib);
            return cudlaErrorCuda;
        }
        core.cuda_device = cuda_device;
    }
    SlotControl& words = lib.control->slots[slot];
    vstore(&words.error_status, 0u);
    vstore(&words.error_seq, 0u);
    vstore(&words.completed, 0ull);
    lib.slot_used[slot] = true;
    core.handles += 1;
    const uint64_t handle = lib.next_handle;
    lib.next_handle += 0x10;
    DeviceState& state = lib.devices[handle];
    state.core = static_cast<uint32_t>(device);
    state.cuda_device = cuda_device;
    state.slot = slot;
    *devHandle = reinterpret_cast<cudlaDevHandle>(static_cast<uintptr_t>(handle));
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaDestroyDevice(const cudlaDevHandle devHandle) {
    AIODLA_INJECTION_POINT("cudlaDestroyDevice");
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto it = lib.devices.find(handle_value(devHandle));
    if (it == lib.devices.end()) return cudlaErrorInvalidDevice;
    DeviceState& device = it->second;
    /* cudla.h: "Before destroying the handle, it is important to ensure that all the
     * tasks submitted previously to the device are completed. Failure to do so can lead
     * to application crashes." Undefined there; the stand-in refuses, as the emulated
     * runtime does, so a test sees the misuse instead of a crash. */
    if (in_flight(lib, device)) return cudlaErrorInvalidParam;
    /* A module or registrations still attached: cudla.h lists only cudlaSuccess,
     * cudlaErrorInvalidDevice, cudlaErrorCuda and cudlaErrorUmd for cudlaDestroyDevice,
     * and says the handle's internal CUDA allocations must be gone before the primary
     * context is, so destroying the handle ends everything it owns: the module is
     * released (its handle then answers cudlaErrorInvalidDevice, cudla.h's status for a
     * module "not loaded into a valid device"), the registrations are dropped. Counted,
     * so tests can still require a caller to release in order itself. */
    if (device.module) {
        auto module = lib.modules.find(device.module);
        if (module != lib.modules.end()) {
            release_module(lib, module->second, device);
            lib.modules.erase(module);
        }
        lib.orphaned_modules.insert(device.module);
        lib.released_modules += 1;
        device.module = 0;
    }
    lib.released_registrations += device.registrations.size();
    device.registrations.clear();
    CoreLane& core = lib.core[device.core];
    lib.slot_used[device.slot] = false;
    core.handles -= 1;
    if (!core.handles) {
        Platform::stream_destroy(core.upload);
        core.upload = nullptr;
        core.cuda_device = -1;
    }
    lib.devices.erase(it);
    if (lib.devices.empty()) release_control(lib);
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaModuleLoadFromMemory(const cudlaDevHandle devHandle,
                                                 const uint8_t* const pModule,
                                                 const size_t moduleSize, cudlaModule* const hModule,
                                                 const uint32_t flags) {
    AIODLA_INJECTION_POINT("cudlaModuleLoadFromMemory");
    Library& lib = library();
    if (!hModule) return cudlaErrorInvalidParam;
    if (flags != CUDLA_MODULE_DEFAULT && flags != CUDLA_MODULE_ENABLE_FAULT_DIAGNOSTICS) {
        return cudlaErrorInvalidParam;
    }
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.devices.find(handle_value(devHandle));
    if (found == lib.devices.end()) return cudlaErrorInvalidDevice;
    ModuleState module;
    std::string why;
    if (!parse_loadable(pModule, moduleSize, &module.parsed, &why)) return cudlaErrorInvalidModule;
    DeviceState& device = found->second;
    if (device.module) return cudlaErrorUnsupportedOperation;  /* one loadable per handle */
    if (!Platform::use_device(device.cuda_device)) return cudlaErrorCuda;
    /* The table is the module's only device resource: cudlaModuleUnload or
     * cudlaDestroyDevice gives it back, and a failed copy gives it back here. */
    void* upload = lib.core[device.core].upload;
    void* table = nullptr;
    if (!Platform::device_alloc(&table, sizeof(ModuleTable), upload, &module.pooled)) {
        return cudlaErrorCuda;
    }
    if (!Platform::upload(table, &module.parsed.table, sizeof(ModuleTable), upload)) {
        Platform::device_free(table, sizeof(ModuleTable), upload, module.pooled);
        return cudlaErrorCuda;
    }
    module.table = static_cast<ModuleTable*>(table);
    module.device = found->first;
    const uint64_t handle = lib.next_handle;
    lib.next_handle += 0x10;
    device.module = handle;
    lib.modules.emplace(handle, std::move(module));
    *hModule = reinterpret_cast<cudlaModule>(static_cast<uintptr_t>(handle));
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaModuleGetAttributes(const cudlaModule hModule,
                                                const cudlaModuleAttributeType attrType,
                                                cudlaModuleAttribute* const attribute) {
    AIODLA_INJECTION_POINT("cudlaModuleGetAttributes");
    Library& lib = library();
    if (!attribute) return cudlaErrorInvalidParam;
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.modules.find(handle_value(hModule));
    if (found == lib.modules.end()) {
        /* cudla.h: "returns cudlaErrorInvalidDevice if the module is not loaded in any
         * device" (its device handle was destroyed under it). */
        if (lib.orphaned_modules.count(handle_value(hModule))) return cudlaErrorInvalidDevice;
        return cudlaErrorInvalidModule;
    }
    const ParsedModule& parsed = found->second.parsed;
    switch (attrType) {
        case CUDLA_NUM_INPUT_TENSORS:
            attribute->numInputTensors = static_cast<uint32_t>(parsed.inputs.size());
            return cudlaSuccess;
        case CUDLA_NUM_OUTPUT_TENSORS:
            attribute->numOutputTensors = static_cast<uint32_t>(parsed.outputs.size());
            return cudlaSuccess;
        case CUDLA_INPUT_TENSOR_DESCRIPTORS:
            /* As the real library: the caller owns the array, sized by the count query. */
            if (!attribute->inputTensorDesc) return cudlaErrorInvalidParam;
            memcpy(attribute->inputTensorDesc, parsed.inputs.data(),
                   parsed.inputs.size() * sizeof(cudlaModuleTensorDescriptor));
            return cudlaSuccess;
        case CUDLA_OUTPUT_TENSOR_DESCRIPTORS:
            if (!attribute->outputTensorDesc) return cudlaErrorInvalidParam;
            memcpy(attribute->outputTensorDesc, parsed.outputs.data(),
                   parsed.outputs.size() * sizeof(cudlaModuleTensorDescriptor));
            return cudlaSuccess;
        case CUDLA_NUM_OUTPUT_TASK_STATISTICS:
            attribute->numOutputTensors = 0;  /* the stand-in keeps no task statistics */
            return cudlaSuccess;
        case CUDLA_OUTPUT_TASK_STATISTICS_DESCRIPTORS:
            return cudlaSuccess;  /* zero descriptors to copy */
        default:
            return cudlaErrorInvalidAttribute;
    }
}

extern "C" cudlaStatus cudlaModuleUnload(const cudlaModule hModule, const uint32_t flags) {
    AIODLA_INJECTION_POINT("cudlaModuleUnload");
    Library& lib = library();
    (void)flags;
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.modules.find(handle_value(hModule));
    if (found == lib.modules.end()) {
        /* cudla.h lists cudlaSuccess, cudlaErrorInvalidParam, cudlaErrorInvalidDevice,
         * cudlaErrorInvalidModule and cudlaErrorUmd, and "returns cudlaErrorInvalidDevice
         * if the module is not loaded into a valid device": so a module whose device
         * handle was destroyed answers that; any other handle that names no loaded
         * module (a second unload, a made-up value) is an invalid module, as it is for
         * cudlaModuleGetAttributes and cudlaSubmitTask. Nothing is released twice. */
        if (lib.orphaned_modules.count(handle_value(hModule))) return cudlaErrorInvalidDevice;
        return cudlaErrorInvalidModule;
    }
    DeviceState& device = lib.devices.at(found->second.device);
    if (in_flight(lib, device)) return cudlaErrorInvalidParam;
    release_module(lib, found->second, device);
    device.module = 0;
    lib.modules.erase(found);
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaMemRegister(const cudlaDevHandle devHandle, const uint64_t* const ptr,
                                        const size_t size, uint64_t** const devPtr,
                                        const uint32_t flags) {
    AIODLA_INJECTION_POINT("cudlaMemRegister");
    Library& lib = library();
    if (!devPtr) return cudlaErrorInvalidParam;
    if (flags != CUDLA_READ_WRITE_PERM && flags != CUDLA_READ_ONLY_PERM) {
        return cudlaErrorInvalidParam;
    }
    const uint64_t raw = handle_value(ptr);
    int cuda_device = 0;
    {
        std::lock_guard<std::mutex> lock(lib.mutex);
        auto found = lib.devices.find(handle_value(devHandle));
        if (found == lib.devices.end()) return cudlaErrorInvalidDevice;
        cuda_device = found->second.cuda_device;
    }
    if (raw % kRegistrationAlignment || size == 0) return cudlaErrorInvalidAddress;
    if (!Platform::use_device(cuda_device)) return cudlaErrorCuda;
    if (!Platform::device_allocation(raw, size)) return cudlaErrorInvalidAddress;
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.devices.find(handle_value(devHandle));
    if (found == lib.devices.end()) return cudlaErrorInvalidDevice;  /* destroyed meanwhile */
    DeviceState& device = found->second;
    for (const auto& entry : device.registrations) {
        if (entry.second.raw == raw) return cudlaErrorMemoryRegistered;
    }
    const uint64_t registered = raw | kRegisteredTag;
    device.registrations[registered] = Registration{raw, size};
    *devPtr = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(registered));
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaMemUnregister(const cudlaDevHandle devHandle,
                                          const uint64_t* const devPtr) {
    AIODLA_INJECTION_POINT("cudlaMemUnregister");
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.devices.find(handle_value(devHandle));
    if (found == lib.devices.end()) return cudlaErrorInvalidDevice;
    DeviceState& device = found->second;
    auto registration = device.registrations.find(handle_value(devPtr));
    if (registration == device.registrations.end()) return cudlaErrorInvalidAddress;
    if (in_flight(lib, device)) return cudlaErrorInvalidParam;
    device.registrations.erase(registration);
    return cudlaSuccess;
}

extern "C" cudlaStatus cudlaSubmitTask(const cudlaDevHandle devHandle,
                                       const cudlaTask* const ptrToTasks, const uint32_t numTasks,
                                       void* const stream, const uint32_t flags) {
    AIODLA_INJECTION_POINT("cudlaSubmitTask");
    Library& lib = library();
    std::vector<TaskArgs> launches;
    uint32_t core_index = 0;
    uint64_t handle = handle_value(devHandle);
    int cuda_device = 0;
    {
        std::lock_guard<std::mutex> lock(lib.mutex);
        auto found = lib.devices.find(handle);
        if (found == lib.devices.end()) return cudlaErrorInvalidDevice;
        DeviceState& device = found->second;
        if (!ptrToTasks || numTasks == 0) return cudlaErrorInvalidParam;
        if (flags & (CUDLA_SUBMIT_NOOP | CUDLA_SUBMIT_DIAGNOSTICS_TASK)) {
            return cudlaErrorUnsupportedOperation;  /* standalone-mode features */
        }
        if (flags & ~static_cast<uint32_t>(CUDLA_SUBMIT_SKIP_LOCK_ACQUIRE)) {
            return cudlaErrorInvalidParam;
        }
        launches.reserve(numTasks);
        for (uint32_t i = 0; i < numTasks; ++i) {
            const cudlaTask& task = ptrToTasks[i];
            /* Hybrid mode: CUDA streams order the work, never NvSci fences. */
            if (task.waitEvents || task.signalEvents) return cudlaErrorUnsupportedOperation;
            if (!task.inputTensor || !task.outputTensor) return cudlaErrorUnsupportedOperation;
            auto module = lib.modules.find(handle_value(task.moduleHandle));
            if (module == lib.modules.end()) return cudlaErrorInvalidModule;
            if (module->second.device != handle) return cudlaErrorInvalidModule;
            const ParsedModule& parsed = module->second.parsed;
            if (task.numInputTensors != parsed.inputs.size() ||
                task.numOutputTensors != parsed.outputs.size()) {
                return cudlaErrorInvalidParam;
            }
            TaskArgs args;
            memset(&args, 0, sizeof args);
            const uint32_t num_inputs = parsed.table.num_inputs;
            for (uint32_t k = 0; k < num_inputs + parsed.table.num_outputs; ++k) {
                const bool is_input = k < num_inputs;
                const uint32_t index = is_input ? k : k - num_inputs;
                const uint64_t pointer =
                    handle_value(is_input ? task.inputTensor[index] : task.outputTensor[index]);
                const uint64_t needed = is_input ? parsed.table.inputs[index].size
                                                 : parsed.table.outputs[index].size;
                auto registration = device.registrations.find(pointer);
                if (registration == device.registrations.end()) return cudlaErrorInvalidAddress;
                if (registration->second.size < needed) return cudlaErrorInvalidParam;
                uint8_t* raw = reinterpret_cast<uint8_t*>(
                    static_cast<uintptr_t>(registration->second.raw));
                if (is_input) {
                    args.inputs[index] = raw;
                } else {
                    args.outputs[index] = raw;
                }
            }
            args.table = module->second.table;
            args.core = &lib.control_device->cores[device.core];
            args.slot = &lib.control_device->slots[device.slot];
            args.shutdown = &lib.control_device->shutdown;
            args.latency_ns = static_cast<unsigned long long>(llround(parsed.latency * 1e9));
            args.timeout_ns = static_cast<unsigned long long>(device.timeout_ms) * 1000000ull;
            launches.push_back(args);
        }
        /* Counted before the launch so destroy, unload and unregister see the tasks as in
         * flight from now on; taken back below for any that never launched. */
        device.submitted += numTasks;
        core_index = device.core;
        cuda_device = device.cuda_device;
    }
    CoreLane& core = lib.core[core_index];
    uint32_t launched = 0;
    {
        std::lock_guard<std::mutex> order(core.launch);
        if (Platform::use_device(cuda_device)) {
            for (TaskArgs& args : launches) {
                /* A ticket is spent only by a launched kernel: one that never launched
                 * must not leave the core's turn waiting for it forever. */
                args.ticket = core.next_ticket;
                if (Platform::launch(stream, args) == Launch::kFailed) break;
                core.next_ticket += 1;
                launched += 1;
            }
        }
    }
    if (launched < numTasks) {
        std::lock_guard<std::mutex> lock(lib.mutex);
        auto found = lib.devices.find(handle);
        if (found != lib.devices.end()) found->second.submitted -= numTasks - launched;
    }
    return launched == numTasks ? cudlaSuccess : cudlaErrorCuda;
}

extern "C" cudlaStatus cudlaDeviceGetAttribute(const cudlaDevHandle devHandle,
                                               const cudlaDevAttributeType attrib,
                                               cudlaDevAttribute* const pAttribute) {
    AIODLA_INJECTION_POINT("cudlaDeviceGetAttribute");
    Library& lib = library();
    if (!pAttribute) return cudlaErrorInvalidParam;
    std::lock_guard<std::mutex> lock(lib.mutex);
    if (lib.devices.find(handle_value(devHandle)) == lib.devices.end()) {
        return cudlaErrorInvalidDevice;
    }
    switch (attrib) {
        case CUDLA_UNIFIED_ADDRESSING:
            pAttribute->unifiedAddressingSupported = 1;
            return cudlaSuccess;
        case CUDLA_DEVICE_VERSION:
            pAttribute->deviceVersion = kDeviceVersion;
            return cudlaSuccess;
        default:
            return cudlaErrorInvalidAttribute;
    }
}

extern "C" cudlaStatus cudlaGetLastError(const cudlaDevHandle devHandle) {
    AIODLA_INJECTION_POINT("cudlaGetLastError");
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.devices.find(handle_value(devHandle));
    if (found == lib.devices.end()) return cudlaErrorInvalidDevice;
    DeviceState& device = found->second;
    SlotControl& words = lib.control->slots[device.slot];
    for (;;) {
        const uint32_t seq = vload(&words.error_seq);
        if (seq == device.seen_error_seq) return cudlaSuccess;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        const uint32_t status = vload(&words.error_status);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        /* A task that failed while we read would have bumped seq: read again, so the
         * status returned is the latest one and is latched exactly once. */
        if (vload(&words.error_seq) != seq) continue;
        device.seen_error_seq = seq;
        return static_cast<cudlaStatus>(status);
    }
}

extern "C" cudlaStatus cudlaSetTaskTimeoutInMs(const cudlaDevHandle devHandle,
                                               const uint32_t timeout) {
    AIODLA_INJECTION_POINT("cudlaSetTaskTimeoutInMs");
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.mutex);
    auto found = lib.devices.find(handle_value(devHandle));
    if (found == lib.devices.end()) return cudlaErrorInvalidDevice;
    if (timeout == 0 || timeout > kMaxTimeoutMs) return cudlaErrorInvalidParam;
    found->second.timeout_ms = timeout;
    return cudlaSuccess;
}

/* ------------------------------------------------------------------------------------
 * Test controls.
 * ---------------------------------------------------------------------------------- */

extern "C" uint32_t aiodlaStandinAbiVersion(void) { return kAbiVersion; }

extern "C" uint32_t aiodlaStandinIsHostFake(void) {
#ifdef AIODLA_STANDIN_HOST_FAKE
    return 1;
#else
    return 0;
#endif
}

extern "C" uint64_t aiodlaStandinCores(void) { return library().cores; }

/* The next task *started* on `core` fails with `status` and writes no output. The ring
 * is read by the task itself when it starts, so tasks already queued on the core take
 * the failure in the order they run, as on the emulated runtime. `on_stream` (0 or 1):
 * the failure also surfaces on the task's stream, as a sticky CUDA error that loses the
 * context once the status is published (see task_kernel). */
extern "C" int aiodlaStandinFailNextTask(uint64_t core, uint32_t status, uint32_t on_stream) {
    Library& lib = library();
    if (core >= lib.cores || status == 0 || on_stream > 1) return cudlaErrorInvalidParam;
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    CoreControl& words = active_control(lib)->cores[core];
    const uint32_t head = vload(&words.fail_head);
    if (head - vload(&words.fail_tail) >= kFailRing) return cudlaErrorOutOfResources;
    vstore(&words.fail_ring[head % kFailRing], status);
    vstore(&words.fail_on_stream[head % kFailRing], on_stream);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    vstore(&words.fail_head, head + 1);
    return cudlaSuccess;
}

/* The next call of entry point `function` (e.g. "cudlaMemRegister") returns `status`
 * without doing anything; any 32-bit value, so tests can return codes cudla.h lacks. */
extern "C" int aiodlaStandinFailNextCall(const char* function, uint32_t status) {
    static const char* const known[] = {
        "cudlaGetVersion", "cudlaDeviceGetCount", "cudlaCreateDevice", "cudlaMemRegister",
        "cudlaModuleLoadFromMemory", "cudlaModuleGetAttributes", "cudlaModuleUnload",
        "cudlaSubmitTask", "cudlaDeviceGetAttribute", "cudlaMemUnregister",
        "cudlaGetLastError", "cudlaDestroyDevice", "cudlaSetTaskTimeoutInMs",
    };
    if (!function) return cudlaErrorInvalidParam;
    bool found = false;
    for (const char* name : known) found = found || !strcmp(name, function);
    if (!found) return cudlaErrorInvalidParam;
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.injected_mutex);
    lib.injected[function] = status;
    lib.any_injected.store(true, std::memory_order_release);
    return cudlaSuccess;
}

extern "C" int aiodlaStandinHangCore(uint64_t core, int hung) {
    Library& lib = library();
    if (core >= lib.cores) return cudlaErrorInvalidParam;
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    vstore(&active_control(lib)->cores[core].hung, hung ? 1u : 0u);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return cudlaSuccess;
}

extern "C" int aiodlaStandinHoldCore(uint64_t core, int hold) {
    Library& lib = library();
    if (core >= lib.cores) return cudlaErrorInvalidParam;
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    vstore(&active_control(lib)->cores[core].hold, hold ? 1u : 0u);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return cudlaSuccess;
}

/* Tasks waiting at the core's gate now: 0 or 1, since a core starts one task at a time
 * and the others queue behind it on the GPU. -1 for a core that does not exist. */
extern "C" int aiodlaStandinHeldTasks(uint64_t core) {
    Library& lib = library();
    if (core >= lib.cores) return -1;
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    return static_cast<int>(vload(&active_control(lib)->cores[core].held));
}

extern "C" uint64_t aiodlaStandinCoreTasks(uint64_t core) {
    Library& lib = library();
    if (core >= lib.cores) return 0;
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    return vload(&active_control(lib)->cores[core].tasks_completed);
}

extern "C" uint64_t aiodlaStandinCoreBusyNs(uint64_t core) {
    Library& lib = library();
    if (core >= lib.cores) return 0;
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    return vload(&active_control(lib)->cores[core].busy_ns);
}

extern "C" void aiodlaStandinLiveHandles(uint64_t* devices, uint64_t* modules,
                                         uint64_t* registrations) {
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.mutex);
    uint64_t registered = 0;
    for (const auto& entry : lib.devices) registered += entry.second.registrations.size();
    if (devices) *devices = lib.devices.size();
    if (modules) *modules = lib.modules.size();
    if (registrations) *registrations = registered;
}

/* The device resources the stand-in holds now (see Accounting): allocations and their
 * bytes, CUDA events, CUDA streams. All four are zero once every handle is released. */
extern "C" void aiodlaStandinLiveResources(uint64_t* allocations, uint64_t* bytes,
                                           uint64_t* events, uint64_t* streams) {
    Accounting& counts = accounting();
    if (allocations) *allocations = counts.allocations.load();
    if (bytes) *bytes = counts.bytes.load();
    if (events) *events = counts.events.load();
    if (streams) *streams = counts.streams.load();
}

/* Modules and registrations that cudlaDestroyDevice had to release because the caller
 * had not (see cudlaDestroyDevice): zero for a caller that releases in order. */
extern "C" void aiodlaStandinReleasedByDestroy(uint64_t* modules, uint64_t* registrations) {
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.mutex);
    if (modules) *modules = lib.released_modules;
    if (registrations) *registrations = lib.released_registrations;
}

/* The sticky CUDA error that lost the process's CUDA context, or 0 while it is whole, as
 * far as the stand-in can tell: what its own calls have met, or else what its live
 * streams report now (they report a lost context at once, busy or idle). Host-fake
 * builds: cudaErrorLaunchFailure once a fault on the stream has run. */
extern "C" int aiodlaStandinContextError(void) {
    Library& lib = library();
    if (!lost_context().load()) {
        std::lock_guard<std::mutex> lock(lib.mutex);
        for (uint32_t core = 0; core < lib.cores && !lost_context().load(); ++core) {
            if (lib.core[core].upload) Platform::context_lost(lib.core[core].upload);
        }
    }
    return lost_context().load();
}

/* End every gate and hang now (called at interpreter exit, while memory is still mapped):
 * kernels still waiting finish at once instead of holding the process's exit. */
extern "C" void aiodlaStandinShutdown(void) {
    Library& lib = library();
    std::lock_guard<std::mutex> lock(lib.control_mutex);
    Control* control = active_control(lib);
    for (uint32_t core = 0; core < kMaxCores; ++core) {
        vstore(&control->cores[core].hold, 0u);
        vstore(&control->cores[core].hung, 0u);
    }
    vstore(&control->shutdown, 1u);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* The parser alone, on the host: cudlaSuccess or cudlaErrorInvalidModule and a sentence. */
extern "C" int aiodlaStandinCheckLoadable(const void* data, size_t size, char* message,
                                          size_t messageSize) {
    ParsedModule parsed;
    std::string why;
    const bool ok = parse_loadable(static_cast<const uint8_t*>(data), size, &parsed, &why);
    if (message && messageSize) {
        snprintf(message, messageSize, "%s", ok ? "" : why.c_str());
    }
    return ok ? cudlaSuccess : cudlaErrorInvalidModule;
}

/* One task of `data` on host buffers, with the kernel's own element code. */
extern "C" int aiodlaStandinRunOnHost(const void* data, size_t size, const void* const* inputs,
                                      void* const* outputs) {
    ParsedModule parsed;
    std::string why;
    if (!parse_loadable(static_cast<const uint8_t*>(data), size, &parsed, &why)) {
        return cudlaErrorInvalidModule;
    }
    if (!inputs || !outputs) return cudlaErrorInvalidParam;
    const ModuleTable& table = parsed.table;
    for (uint32_t t = 0; t < table.num_inputs; ++t) {
        if (!inputs[t]) return cudlaErrorInvalidParam;
    }
    for (uint32_t o = 0; o < table.num_outputs; ++o) {
        if (!outputs[o]) return cudlaErrorInvalidParam;
    }
    run_task_serially(table, reinterpret_cast<const uint8_t* const*>(inputs),
                      reinterpret_cast<uint8_t* const*>(outputs));
    return cudlaSuccess;
}

extern "C" void* aiodlaStandinFakeAlloc(size_t size) {
#ifdef AIODLA_STANDIN_HOST_FAKE
    /* 256-byte aligned and zeroed, as cudaMalloc memory is aligned */
    if (size == 0) return nullptr;
    void* memory = nullptr;
    if (posix_memalign(&memory, 256, size) != 0) return nullptr;
    memset(memory, 0, size);
    std::lock_guard<std::mutex> lock(Platform::allocations_mutex());
    Platform::allocations()[reinterpret_cast<uintptr_t>(memory)] = size;
    return memory;
#else
    (void)size;
    return nullptr;  /* real builds register real cudaMalloc memory */
#endif
}

extern "C" int aiodlaStandinFakeFree(void* ptr) {
#ifdef AIODLA_STANDIN_HOST_FAKE
    std::lock_guard<std::mutex> lock(Platform::allocations_mutex());
    auto found = Platform::allocations().find(reinterpret_cast<uintptr_t>(ptr));
    if (found == Platform::allocations().end()) return cudlaErrorInvalidAddress;
    Platform::allocations().erase(found);
    free(ptr);
    return cudlaSuccess;
#else
    (void)ptr;
    return cudlaErrorUnsupportedOperation;
#endif
}
