/* Kiln's thread pool for parallel loops, linked into every kernel library.

   A parallel loop is outlined into a task that claims chunks of iterations until none are
   left (compiler_core/codegen/llvm.py; kiln_claim below). The caller publishes the task,
   wakes the workers and runs the task itself; it then waits only for the workers that
   joined the task while it was open. A worker the OS has not scheduled yet
   (a busy 2-core machine) is not waited for: the caller has done its share of the work, and
   the worker finds the task closed when it wakes. OpenMP's GOMP_parallel, which this
   replaces, ends with a barrier that waits for every thread of the team, so a descheduled
   worker cost the whole call a time slice.

   Workers spin for KILN_SPIN_NS after a task (the kernels of one run, and runs served back
   to back, follow each other within that), then sleep on a condition variable. Spinning is
   measured in time, not iterations: PAUSE costs 10 to 140 cycles depending on the CPU. The
   one wait for a worker that has not joined: a call that wakes sleeping workers waits until
   they are up (as OpenMP's barrier did), so that the calls after it find them spinning; else
   a wake-up (0.06 to 7 ms on these VMs, measured) would leave them all to the caller alone.

   One pool per process: every library links this file, and the runtime points each library
   loaded after the first at the first one's pool (kiln_pool_share), so two modules in one
   process do not keep two sets of workers spinning against each other. One task runs at a
   time; a caller that finds the pool busy (another Python thread running a module) runs its
   task alone, which the self-scheduling task allows. After fork() the child starts with no
   workers and creates its own on its first parallel loop. */

#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define KILN_MAX_THREADS 256
#define KILN_SPIN_NS 10000000L /* about what libgomp's default spin count lasts on x86 */
#define KILN_SPIN_CHECK 64     /* pauses between two looks at the clock */

/* A task runs as `fn(data, index)`: index is the thread's slot, 0 for the caller and 1 ..
   wanted - 1 for the workers. The index only steers which chunks a thread claims first
   (kiln_claim): correctness never depends on it. */
typedef void (*kiln_task)(void *, int64_t);
typedef void (*kiln_runner)(kiln_task, void *);

#ifndef HIDDEN /* tests/runtime/test_thread_pool.py builds with HIDDEN= to call them */
#define HIDDEN __attribute__((visibility("hidden")))
#endif

static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t grow = PTHREAD_MUTEX_INITIALIZER;

static atomic_ulong generation;   /* bumped to publish a task */
static atomic_ulong open_task;    /* the generation that workers may still join; 0: none */
static atomic_int active;         /* workers inside the current task */
static atomic_int sleeping;       /* workers waiting on `wake` */
static atomic_int arrived;        /* workers that saw the current task published */
static atomic_int caller_cpu = -1; /* where the caller that woke sleeping workers runs */
static atomic_int wanted = 1;     /* threads per parallel loop, the caller included */
static int started;               /* workers created (guarded by `grow`) */
static kiln_task task_fn;
static void *task_data;
static _Atomic(kiln_runner) shared_pool; /* another library's pool that runs our tasks */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* A worker woken from sleep is often placed on the CPU of the thread that woke it (the other
   vCPU of a VM looks busy to the guest while the host has it parked). There it waits until
   the caller's time slice ends (about 7 ms, measured) and then competes with the caller for
   that CPU while the other one idles. So a woken worker on the caller's CPU moves itself to
   the others (its affinity stays so until it sleeps again, when it gets all of them back). */
static __thread cpu_set_t allowed;
static __thread int allowed_known;

static void leave_callers_cpu(void) {
    int cpu = atomic_load(&caller_cpu);
    if (cpu < 0 || sched_getcpu() != cpu)
        return;
    if (!allowed_known) {
        if (pthread_getaffinity_np(pthread_self(), sizeof allowed, &allowed) != 0)
            return;
        allowed_known = 1;
    }
    cpu_set_t others = allowed;
    CPU_CLR(cpu, &others);
    if (CPU_COUNT(&others) > 0)
        pthread_setaffinity_np(pthread_self(), sizeof others, &others);
}

static void restore_affinity(void) {
    if (allowed_known)
        pthread_setaffinity_np(pthread_self(), sizeof allowed, &allowed);
}

static unsigned long wait_for_task(unsigned long seen) {
    unsigned long now;
    long until = now_ns() + KILN_SPIN_NS;
    for (int spin = 1;; ++spin) {
        now = atomic_load(&generation);
        if (now != seen)
            return now;
        relax();
        if (spin % KILN_SPIN_CHECK == 0 && now_ns() > until)
            break;
    }
    restore_affinity();
    pthread_mutex_lock(&sleep_lock);
    atomic_fetch_add(&sleeping, 1);
    while ((now = atomic_load(&generation)) == seen)
        pthread_cond_wait(&wake, &sleep_lock);
    atomic_fetch_sub(&sleeping, 1);
    pthread_mutex_unlock(&sleep_lock);
    leave_callers_cpu();
    return now;
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;  /* 1 .. started; the caller is 0 */
    unsigned long seen = atomic_load(&generation);
    pthread_setname_np(pthread_self(), "kiln-pool"); /* what top -H and the tests see */
    leave_callers_cpu(); /* a new thread starts beside its creator, as a woken one does */
    for (;;) {
        seen = wait_for_task(seen);
        atomic_fetch_add(&arrived, 1);
        if (index >= atomic_load(&wanted))
            continue;  /* fewer threads wanted than exist */
        /* Join, then check the task is still open: the caller closes it, then waits for
           `active` to drain, so either it sees this worker or this worker sees it closed. */
        atomic_fetch_add(&active, 1);
        if (atomic_load(&open_task) == seen)
            task_fn(task_data, index);
        atomic_fetch_sub(&active, 1);
    }
    return 0;
}

static void start_workers(int threads) {
    pthread_mutex_lock(&grow);
    while (started < threads - 1 && started < KILN_MAX_THREADS - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, worker_main,
                                    (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attributes);
        if (failed)
            break;  /* run with the workers there are */
        ++started;
    }
    pthread_mutex_unlock(&grow);
}

static void forget_workers(void) {
    /* In a fork's child: the workers did not come along. */
    started = 0;
    atomic_store(&active, 0);
    atomic_store(&sleeping, 0);
    atomic_store(&open_task, 0);
    pthread_mutex_init(&sleep_lock, 0);
    pthread_cond_init(&wake, 0);
    pthread_mutex_init(&busy, 0);
    pthread_mutex_init(&grow, 0);
}

static void register_fork_handler(void) { pthread_atfork(0, 0, forget_workers); }

/* Run `fn(data, index)` on this library's pool: the caller (index 0) and up to `wanted - 1`
   workers (1 ..). */
void kiln_pool_run(kiln_task fn, void *data) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    int threads = atomic_load(&wanted);
    if (threads <= 1 || pthread_mutex_trylock(&busy) != 0) {
        fn(data, 0);
        return;
    }
    pthread_once(&once, register_fork_handler);
    if (started < threads - 1) {
        atomic_store(&caller_cpu, sched_getcpu());
        start_workers(threads);
    }
    task_fn = fn;
    task_data = data;
    unsigned long next = atomic_load(&generation) + 1;
    atomic_store(&arrived, 0);
    atomic_store(&open_task, next);
    atomic_store(&generation, next);
    int woken = atomic_load(&sleeping);
    if (woken > 0) {
        atomic_store(&caller_cpu, sched_getcpu());
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    fn(data, 0);
    /* Workers that were asleep: wait until they are up (as OpenMP's barrier would), so that
       they spin for the calls that follow instead of waking after them (0.06 to 6.5 ms on
       these VMs, measured), which would leave the next calls to the caller alone. Workers
       that were spinning are never waited for unless they joined. */
    while (atomic_load(&arrived) < woken)
        sched_yield(); /* the woken worker may be waiting for this CPU */
    atomic_store(&open_task, 0);
    while (atomic_load(&active) > 0)
        relax();
    pthread_mutex_unlock(&busy);
}

/* The entry of every parallel loop in this library's kernels. */
HIDDEN void kiln_parallel(kiln_task fn, void *data) {
    kiln_runner pool = atomic_load(&shared_pool);
    if (pool)
        pool(fn, data);
    else
        kiln_pool_run(fn, data);
}

/* Run this library's parallel loops on another library's pool (its kiln_pool_run). */
void kiln_pool_share(kiln_runner pool) { atomic_store(&shared_pool, pool); }

/* Threads per parallel loop, the caller included (at least 1). */
void kiln_pool_set_threads(int threads) {
    if (threads < 1)
        threads = 1;
    if (threads > KILN_MAX_THREADS)
        threads = KILN_MAX_THREADS;
    atomic_store(&wanted, threads);
}

/* --- claiming a parallel loop's chunks ------------------------------------------------

   A parallel loop's iterations are split into one contiguous home range per thread, each
   claimed in KILN_CHUNKS_PER_HOME chunks from its own counter. A thread claims its own
   home's chunks first, then the other homes' that are left. So consecutive parallel loops
   over the same rows give each thread the rows it wrote in the loop before, which are still
   in its core's L2 (a consumer fed from the other core's L2 ran its kernel up to half again
   slower in a model than alone, measured on a Xeon), while a thread the OS runs late still
   holds up only the chunk it is in: the others take over its home. */

#define KILN_HOMES 8 /* counters in a loop's closure: compiler_core/codegen/llvm.py POOL_HOMES */
#define KILN_CHUNKS_PER_HOME 4

typedef struct {
    int64_t extent;                /* the loop's iterations */
    int64_t homes;                 /* home ranges in use, 1 .. KILN_HOMES */
    _Atomic int64_t next[KILN_HOMES]; /* each home's next unclaimed iteration */
} kiln_claims;

static int64_t home_start(const kiln_claims *c, int64_t home) {
    return home * c->extent / c->homes;
}

/* Called by the loop's caller before it runs the task: one home per thread. */
HIDDEN void kiln_claims_init(kiln_claims *c, int64_t extent) {
    int64_t homes = atomic_load(&wanted);
    if (homes > KILN_HOMES)
        homes = KILN_HOMES;
    if (homes > extent)
        homes = extent > 0 ? extent : 1;
    c->extent = extent;
    c->homes = homes;
    for (int64_t h = 0; h < homes; ++h)
        atomic_store_explicit(&c->next[h], home_start(c, h), memory_order_relaxed);
}

/* The next chunk for the thread whose claim state is `cursor` ({home, homes visited},
   {index, 0} at first): its first iteration, with the end in *stop, or -1 when the whole
   loop is claimed. */
HIDDEN int64_t kiln_claim(kiln_claims *c, int64_t *cursor, int64_t *stop) {
    while (cursor[1] < c->homes) {
        int64_t home = (int64_t)((uint64_t)cursor[0] % (uint64_t)c->homes);
        int64_t end = home_start(c, home + 1);
        int64_t chunk = (end - home_start(c, home) + KILN_CHUNKS_PER_HOME - 1)
                        / KILN_CHUNKS_PER_HOME;
        if (chunk < 1)
            chunk = 1;
        int64_t start = atomic_fetch_add_explicit(&c->next[home], chunk, memory_order_relaxed);
        if (start < end) {
            *stop = start + chunk < end ? start + chunk : end;
            return start;
        }
        cursor[0] = home + 1;  /* this home is claimed: help the next one */
        cursor[1] += 1;
    }
    return -1;
}
