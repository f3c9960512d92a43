/* aiodla's submitter thread: a request's three enqueue calls, made without the GIL.
 *
 * The event loop hands a slot's calls (launch the graph before the task, cudlaSubmitTask,
 * launch the graph after it) to this thread with one cheap call that keeps the GIL, and
 * goes on to the next request while the thread makes them. The thread is plain C: it
 * never takes the GIL, so the loop's Python and the calls overlap, which a Python thread
 * could not do (see benchmarks/bench_submitter_thread.py).
 *
 * Each slot has a state the poller reads before it queries the slot's event: an event
 * not yet recorded again reads as complete, so a slot is only "in flight" once its
 * calls were made (SUBMITTED). A failed call ends the slot's calls there; the thread
 * then records the slot's event on its stream, as the loop would have (RETIRED), so the
 * slot returns to the pool only after what reached the stream ran; a slot whose event
 * cannot be recorded either is LOST. The failing call and its status stay with the
 * slot for the poller to report.
 *
 * When the thread sleeps and the loop has handed it nothing for `quiet_ns`, a push is
 * declined (returns 0) and the caller makes the calls itself: on a lightly loaded
 * engine a wake-up would add its latency to every request and save nothing.
 *
 * The entry points are plain function pointers: the driver's and cuDLA's on a GPU, or
 * ctypes callbacks into a Python runtime (the emulated one, tests), which take the GIL
 * themselves.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define AIODLA_HANDOFF_ABI 2

typedef int (*launch_fn)(uint64_t graph, uint64_t stream);
typedef int (*submit_fn)(uint64_t device, uint64_t task, uint32_t count, uint64_t stream,
                         uint32_t flags);
typedef int (*record_fn)(uint64_t event, uint64_t stream);
typedef int (*bind_fn)(uint64_t argument);

enum { NEVER = 0, QUEUED = 1, SUBMITTED = 2, RETIRED = 3, LOST = 4 };
enum { CALL_NONE = 0, CALL_LAUNCH_BEFORE = 1, CALL_SUBMIT = 2, CALL_LAUNCH_AFTER = 3 };

typedef struct {
    uint64_t graph_before, device, task, stream, graph_after, event;
    _Atomic uint32_t state;
    int32_t failed_call, failed_code; /* written before state turns RETIRED or LOST */
} slot_t;

typedef struct {
    launch_fn launch;
    submit_fn submit;
    record_fn record;
    bind_fn bind;
    uint64_t bind_argument;
    uint64_t quiet_ns, linger_ns;
    uint32_t slots;
    slot_t* slot;
    uint32_t* queue; /* slot indices; each slot is queued at most once at a time */
    uint32_t head, count;
    _Atomic uint32_t pending; /* == count, read without the mutex while lingering */
    int sleeping, stopping, started;
    int bind_status, bound;
    uint64_t last_push_ns;
    uint64_t handed, declined, wakeups; /* under the mutex */
    pthread_mutex_t mutex;
    pthread_cond_t work, ready;
    pthread_t thread;
} submitter_t;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void run_slot(submitter_t* s, slot_t* e) {
    int call = CALL_NONE, code = 0;
    if (e->graph_before && (code = s->launch(e->graph_before, e->stream)) != 0) {
        call = CALL_LAUNCH_BEFORE;
    } else if ((code = s->submit(e->device, e->task, 1, e->stream, 0)) != 0) {
        call = CALL_SUBMIT;
    } else if (e->graph_after && (code = s->launch(e->graph_after, e->stream)) != 0) {
        call = CALL_LAUNCH_AFTER;
    }
    uint32_t state = SUBMITTED;
    if (call != CALL_NONE) {
        e->failed_call = call;
        e->failed_code = code;
        state = s->record(e->event, e->stream) == 0 ? RETIRED : LOST;
    }
    atomic_store_explicit(&e->state, state, memory_order_release);
}

/* Waits for work: first lingering `linger_ns` without the mutex (a loaded loop hands
 * the next request within microseconds), then asleep on the condition. Returns with the
 * mutex held; false when stopping with nothing queued. */
static int wait_for_work(submitter_t* s) {
    if (s->linger_ns) {
        uint64_t until = now_ns() + s->linger_ns;
        while (!atomic_load_explicit(&s->pending, memory_order_acquire) && now_ns() < until) {
        }
    }
    pthread_mutex_lock(&s->mutex);
    while (s->count == 0 && !s->stopping) {
        s->sleeping = 1;
        pthread_cond_wait(&s->work, &s->mutex);
        s->sleeping = 0;
    }
    return s->count != 0;
}

static void* run(void* argument) {
    submitter_t* s = (submitter_t*)argument;
    pthread_setname_np(pthread_self(), "aiodla-submit"); /* what top and profilers show */
    int status = s->bind ? s->bind(s->bind_argument) : 0;
    pthread_mutex_lock(&s->mutex);
    s->bind_status = status;
    s->bound = 1;
    pthread_cond_broadcast(&s->ready);
    pthread_mutex_unlock(&s->mutex);
    if (status != 0) return NULL;
    for (;;) {
        if (!wait_for_work(s)) {
            pthread_mutex_unlock(&s->mutex);
            return NULL;
        }
        /* Take one at a time: the loop may push while the calls are made. */
        uint32_t index = s->queue[s->head];
        s->head = (s->head + 1) % s->slots;
        s->count -= 1;
        atomic_store_explicit(&s->pending, s->count, memory_order_release);
        pthread_mutex_unlock(&s->mutex);
        run_slot(s, &s->slot[index]);
    }
}

int aiodla_handoff_abi(void) { return AIODLA_HANDOFF_ABI; }

void* aiodla_handoff_create(uint32_t slots, void* launch, void* submit, void* record,
                            void* bind, uint64_t bind_argument, uint64_t quiet_ns,
                            uint64_t linger_ns) {
    if (slots == 0 || !launch || !submit || !record) return NULL;
    submitter_t* s = (submitter_t*)calloc(1, sizeof(submitter_t));
    if (!s) return NULL;
    s->slot = (slot_t*)calloc(slots, sizeof(slot_t));
    s->queue = (uint32_t*)calloc(slots, sizeof(uint32_t));
    if (!s->slot || !s->queue) {
        free(s->slot);
        free(s->queue);
        free(s);
        return NULL;
    }
    s->launch = (launch_fn)launch;
    s->submit = (submit_fn)submit;
    s->record = (record_fn)record;
    s->bind = (bind_fn)bind;
    s->bind_argument = bind_argument;
    s->quiet_ns = quiet_ns;
    s->linger_ns = linger_ns;
    s->slots = slots;
    pthread_mutex_init(&s->mutex, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->ready, NULL);
    return s;
}

/* Starts the thread and waits until it ran `bind`, whose status goes to *bind_status
 * (0 when bound). Returns pthread_create's error, 0 when the thread runs. */
int aiodla_handoff_start(void* handle, int* bind_status) {
    submitter_t* s = (submitter_t*)handle;
    int error = pthread_create(&s->thread, NULL, run, s);
    if (error != 0) return error;
    pthread_mutex_lock(&s->mutex);
    s->started = 1;
    while (!s->bound) pthread_cond_wait(&s->ready, &s->mutex);
    *bind_status = s->bind_status;
    pthread_mutex_unlock(&s->mutex);
    return 0;
}

/* The loop: hand slot `index`'s calls to the thread. 1 when queued; 0 when declined (the
 * thread sleeps and the engine was quiet: make the calls yourself); -1 when the slot is
 * queued already or out of range, -2 when the thread is not running. */
int aiodla_handoff_push(void* handle, uint32_t index, uint64_t graph_before, uint64_t device,
                        uint64_t task, uint64_t stream, uint64_t graph_after, uint64_t event) {
    submitter_t* s = (submitter_t*)handle;
    if (index >= s->slots) return -1;
    slot_t* e = &s->slot[index];
    uint64_t now = s->quiet_ns ? now_ns() : 0;
    pthread_mutex_lock(&s->mutex);
    if (!s->started || s->stopping || s->bind_status != 0) {
        pthread_mutex_unlock(&s->mutex);
        return -2;
    }
    if (atomic_load_explicit(&e->state, memory_order_relaxed) == QUEUED) {
        pthread_mutex_unlock(&s->mutex);
        return -1;
    }
    uint64_t last = s->last_push_ns;
    s->last_push_ns = now;
    if (s->quiet_ns && s->sleeping && now - last > s->quiet_ns) {
        s->declined += 1;
        pthread_mutex_unlock(&s->mutex);
        return 0;
    }
    e->graph_before = graph_before;
    e->device = device;
    e->task = task;
    e->stream = stream;
    e->graph_after = graph_after;
    e->event = event;
    e->failed_call = CALL_NONE;
    e->failed_code = 0;
    atomic_store_explicit(&e->state, QUEUED, memory_order_relaxed);
    s->queue[(s->head + s->count) % s->slots] = index;
    s->count += 1;
    s->handed += 1;
    atomic_store_explicit(&s->pending, s->count, memory_order_release);
    if (s->sleeping) {
        s->wakeups += 1;
        pthread_cond_signal(&s->work);
    }
    pthread_mutex_unlock(&s->mutex);
    return 1;
}

/* The poller: slot `index`'s state (QUEUED until its calls were made). */
int aiodla_handoff_state(void* handle, uint32_t index) {
    submitter_t* s = (submitter_t*)handle;
    if (index >= s->slots) return -1;
    return (int)atomic_load_explicit(&s->slot[index].state, memory_order_acquire);
}

/* The call that failed for slot `index` (CALL_*) and its status, once RETIRED or LOST. */
int aiodla_handoff_failure(void* handle, uint32_t index, int32_t* code) {
    submitter_t* s = (submitter_t*)handle;
    if (index >= s->slots) return -1;
    slot_t* e = &s->slot[index];
    uint32_t state = atomic_load_explicit(&e->state, memory_order_acquire);
    if (state != RETIRED && state != LOST) return CALL_NONE;
    *code = e->failed_code;
    return e->failed_call;
}

/* Hand-offs made, pushes declined, and wake-ups of a sleeping thread. */
void aiodla_handoff_counts(void* handle, uint64_t* out) {
    submitter_t* s = (submitter_t*)handle;
    pthread_mutex_lock(&s->mutex);
    out[0] = s->handed;
    out[1] = s->declined;
    out[2] = s->wakeups;
    pthread_mutex_unlock(&s->mutex);
}

/* Stops the thread once it made the calls already queued; frees everything. */
void aiodla_handoff_destroy(void* handle) {
    submitter_t* s = (submitter_t*)handle;
    if (!s) return;
    pthread_mutex_lock(&s->mutex);
    int started = s->started;
    s->stopping = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mutex);
    if (started) pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->ready);
    pthread_mutex_destroy(&s->mutex);
    free(s->slot);
    free(s->queue);
    free(s);
}
