/*
 * profiler_hotpath.c - nanoseconds per start/stop pair on the profiler's
 * event path, for 1, 2, 4 and 8 producer threads, against a no-op plugin
 * measured in the same run.
 *
 * One operation is what NCCL does for a one-channel collective: Coll start,
 * Coll stop (enqueued), KernelCh start (with pTimer), recordEventState
 * (KernelChStop), KernelCh stop (completes it) = two start/stop pairs. Each
 * thread times batches of operations with CLOCK_MONOTONIC; the figure is the
 * median batch over all threads, divided by the pairs in a batch. The total
 * per run stays below the pool size (COMMINSIGHT_POOL_SIZE) and runs are
 * spaced so the writer drains, so the measured path is the normal one, not
 * the drop path; the `dropped` column says if that failed.
 * Usage: profiler_hotpath PLUGIN.so NOOP.so [batches] [ops_per_batch]
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl_profiler_abi.h"

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

static int BATCHES = 40, OPS = 500;

typedef struct worker {
    ncclProfiler_v5_t* p;
    void* ctx;
    double* samples; /* ns per pair, one per batch */
    long dropped;
    pthread_barrier_t* go;
} worker;

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void* run(void* arg) {
    worker* w = arg;
    ncclProfilerEventDescr_v5_t coll, kch;
    memset(&coll, 0, sizeof(coll));
    memset(&kch, 0, sizeof(kch));
    coll.type = ncclProfileColl;
    coll.coll.func = "AllReduce";
    coll.coll.datatype = "ncclFloat32";
    coll.coll.algo = "Ring";
    coll.coll.proto = "Simple";
    coll.coll.count = 1 << 20;
    coll.coll.root = -1;
    coll.coll.nChannels = 1;
    kch.type = ncclProfileKernelCh;
    ncclProfilerEventStateArgs_v5_t st;
    pthread_barrier_wait(w->go);
    for (int b = 0; b < BATCHES; b++) {
        double t0 = now_ns();
        for (int i = 0; i < OPS; i++) {
            void *h = NULL, *k = NULL;
            coll.coll.seqNumber = (uint64_t)(b * OPS + i);
            w->p->startEvent(w->ctx, &h, &coll);
            w->p->stopEvent(h);
            kch.parentObj = h;
            kch.kernelCh.pTimer = 1000 + (uint64_t)i;
            w->p->startEvent(w->ctx, &k, &kch);
            st.kernelCh.pTimer = 2000 + (uint64_t)i;
            w->p->recordEventState(k, ncclProfilerKernelChStop, &st);
            w->p->stopEvent(k);
            if (h == NULL) w->dropped++;
        }
        w->samples[b] = (now_ns() - t0) / (2.0 * OPS);
    }
    return NULL;
}

static int cmp(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

/* Median ns per pair over all batches of all threads; *dropped gets the operations without a handle. */
static double measure(ncclProfiler_v5_t* p, void* ctx, int threads, long* dropped) {
    pthread_t tid[8];
    worker w[8];
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)threads);
    double* all = calloc((size_t)threads * BATCHES, sizeof(double));
    for (int t = 0; t < threads; t++) {
        w[t] = (worker){p, ctx, all + (size_t)t * BATCHES, 0, &go};
        pthread_create(&tid[t], NULL, run, &w[t]);
    }
    *dropped = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        *dropped += w[t].dropped;
    }
    qsort(all, (size_t)threads * BATCHES, sizeof(double), cmp);
    double median = all[(size_t)threads * BATCHES / 2];
    free(all);
    pthread_barrier_destroy(&go);
    return median;
}

/* What one timestamp costs here: the floor under any hot path that takes one. */
static void print_clock_costs(void) {
    const int n = 200000;
    struct timespec ts;
    uint64_t sink = 0;
    clockid_t ids[] = {CLOCK_MONOTONIC, CLOCK_MONOTONIC_COARSE, CLOCK_REALTIME};
    const char* names[] = {"CLOCK_MONOTONIC", "CLOCK_MONOTONIC_COARSE", "CLOCK_REALTIME"};
    printf("costs here (ns each): timestamps");
#if defined(__x86_64__)
    double t0 = now_ns();
    for (int i = 0; i < n; i++) sink += __rdtsc();
    printf(" rdtsc %.1f;", (now_ns() - t0) / n);
#endif
    for (int k = 0; k < 3; k++) {
        double t1 = now_ns();
        for (int i = 0; i < n; i++) {
            clock_gettime(ids[k], &ts);
            sink += (uint64_t)ts.tv_nsec;
        }
        printf(" %s %.1f;", names[k], (now_ns() - t1) / n);
    }
    /* one uncontended locked read-modify-write, for comparison (the common event path does none since round 5) */
    static _Atomic uint64_t word;
    double t2 = now_ns();
    for (int i = 0; i < n; i++) atomic_fetch_add_explicit(&word, 1, memory_order_acq_rel);
    printf(" locked RMW %.1f;", (now_ns() - t2) / n);
    printf(" (sink %llu)\n", (unsigned long long)(sink & 1));
}

static ncclProfiler_v5_t* load(const char* path, void** dl) {
    *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (*dl == NULL) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    ncclProfiler_v5_t* p = dlsym(*dl, "ncclProfiler_v5");
    if (p == NULL) {
        fprintf(stderr, "%s has no ncclProfiler_v5\n", path);
        exit(2);
    }
    return p;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s PLUGIN.so NOOP.so [batches] [ops_per_batch]\n", argv[0]);
        return 2;
    }
    if (argc > 3) BATCHES = atoi(argv[3]);
    if (argc > 4) OPS = atoi(argv[4]);
    char home[] = "/tmp/comminsight-bench-XXXXXX";
    if (mkdtemp(home) == NULL) return 2;
    setenv("COMMINSIGHT_HOME", home, 1);
    setenv("COMMINSIGHT_AGENT_AUTOSTART", "0", 1);
    if (getenv("COMMINSIGHT_POOL_SIZE") == NULL) setenv("COMMINSIGHT_POOL_SIZE", "262144", 1);
    if (getenv("COMMINSIGHT_WRITER_INTERVAL_MS") == NULL) setenv("COMMINSIGHT_WRITER_INTERVAL_MS", "1", 1);

    void *dl_plugin, *dl_noop;
    ncclProfiler_v5_t* plugin = load(argv[1], &dl_plugin);
    ncclProfiler_v5_t* noop = load(argv[2], &dl_noop);
    void *ctx_plugin = NULL, *ctx_noop = NULL;
    int mask = 0;
    plugin->init(&ctx_plugin, 0x1234, &mask, "bench", 1, 8, 0, NULL);
    noop->init(&ctx_noop, 0x1234, &mask, "bench", 1, 8, 0, NULL);
    if (ctx_plugin == NULL) {
        fprintf(stderr, "plugin init gave no context\n");
        return 1;
    }
    long dropped_noop, dropped;
    measure(plugin, ctx_plugin, 1, &dropped); /* warm-up: page in the pool, start the writer */
    struct timespec drain = {0, 200000000};
    nanosleep(&drain, NULL);

    print_clock_costs();
    printf("tick source: COMMINSIGHT_CLOCK=%s\n", getenv("COMMINSIGHT_CLOCK") ? getenv("COMMINSIGHT_CLOCK") : "auto");
    printf("profiler hot path: ns per start/stop pair (median of %d batches x %d ops per thread; 2 pairs per op)\n",
           BATCHES, OPS);
    printf("%7s | %10s | %12s | %9s | %6s | %7s\n", "threads", "noop ns", "plugin ns", "added ns", "ratio", "dropped");
    printf("--------+------------+--------------+-----------+--------+--------\n");
    int counts[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) {
        int t = counts[i];
        double base = measure(noop, ctx_noop, t, &dropped_noop);
        double ns = measure(plugin, ctx_plugin, t, &dropped);
        nanosleep(&drain, NULL); /* let the writer free the slots before the next run */
        printf("%7d | %10.1f | %12.1f | %9.1f | %6.2f | %7ld\n", t, base, ns, ns - base, ns / base, dropped);
    }
    plugin->finalize(ctx_plugin);
    noop->finalize(ctx_noop);
    dlclose(dl_plugin);
    dlclose(dl_noop);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", home);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", home);
    return 0;
}
