/*
 * test_plugin.c - C-level tests of the profiler, built with the plugin's
 * sources under AddressSanitizer + UndefinedBehaviorSanitizer (make check).
 * Drives the exported tables exactly as NCCL does and reads the raw logs
 * and ring back from a temporary home. Each test prints one line.
 */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ci_internal.h" /* white-box tests call the hang scan directly */
#include "comminsight_ring.h"
#include "nccl_profiler_abi.h"

extern ncclProfiler_v5_t ncclProfiler_v5;
extern ncclProfiler_v4_t ncclProfiler_v4;

static int failures;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
        }                                                                  \
    } while (0)

static char g_home[128];

static void fresh_home(const char* name) {
    snprintf(g_home, sizeof(g_home), "/tmp/ci-check-%d-%s", (int)getpid(), name);
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir -p %s", g_home, g_home);
    if (system(cmd) != 0) abort();
    setenv("COMMINSIGHT_HOME", g_home, 1);
    setenv("COMMINSIGHT_AGENT_AUTOSTART", "0", 1);
    unsetenv("COMMINSIGHT_POOL_SIZE");
    unsetenv("COMMINSIGHT_RING_CAPACITY");
    unsetenv("COMMINSIGHT_HANG_TIMEOUT_S");
}

static uint32_t fnv(const ci_op_record* r) {
    uint32_t w[64];
    memcpy(w, r, sizeof(w));
    w[1] = 0;
    uint32_t h = 2166136261u;
    for (int i = 0; i < 64; i++) h = (h ^ w[i]) * 16777619u;
    return h;
}

typedef struct tally {
    long valid, invalid, by_state[5], segments, bad_headers;
    long null_names, p2p, coll, gpu_times;
    long from_gpu, complete_out_of_order; /* completion times derived from the GPU timer; before enqueue end or > 1 s after */
    uint64_t max_seq;
} tally;

/* Reads every segment of <home>/inspector_logs; returns the tally. */
static tally read_logs(void) {
    tally t;
    memset(&t, 0, sizeof(t));
    char dir[320];
    snprintf(dir, sizeof(dir), "%s/inspector_logs", g_home);
    DIR* d = opendir(dir);
    if (d == NULL) return t;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (strstr(e->d_name, ".cilog") == NULL) continue;
        char path[640];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        FILE* f = fopen(path, "rb");
        if (f == NULL) continue;
        ci_log_header h;
        t.segments++;
        if (fread(&h, sizeof(h), 1, f) != 1 || h.magic != CI_LOG_MAGIC || h.version != CI_FORMAT_VERSION) {
            t.bad_headers++;
            fclose(f);
            continue;
        }
        ci_op_record r;
        while (fread(&r, sizeof(r), 1, f) == 1) {
            if (r.magic != CI_RECORD_MAGIC || r.checksum != fnv(&r)) {
                t.invalid++;
                continue;
            }
            t.valid++;
            if (r.state < 5) t.by_state[r.state]++;
            if (r.comm_name[0] == '\0') t.null_names++;
            if (r.kind == CI_KIND_P2P) t.p2p++;
            if (r.kind == CI_KIND_COLL) t.coll++;
            if (r.flags & CI_FLAG_GPU_TIMES) t.gpu_times++;
            if (r.flags & CI_FLAG_COMPLETE_FROM_GPU) t.from_gpu++;
            if (r.state == CI_STATE_COMPLETED &&
                (r.complete_ns < r.enqueue_end_ns || r.complete_ns > r.enqueue_end_ns + 1000000000ull))
                t.complete_out_of_order++;
            if (r.seq > t.max_seq) t.max_seq = r.seq;
        }
        fclose(f);
    }
    closedir(d);
    return t;
}

static int count_files(const char* sub, const char* needle) {
    char dir[320];
    snprintf(dir, sizeof(dir), "%s/%s", g_home, sub);
    DIR* d = opendir(dir);
    if (d == NULL) return 0;
    int n = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, needle) != NULL) n++;
    closedir(d);
    return n;
}

/* One collective the way NCCL reports it: Coll start/stop, n KernelCh children with pTimer. */
static void* coll_op(void* ctx, uint64_t seq, int nch, int complete) {
    ncclProfilerEventDescr_v5_t d;
    memset(&d, 0, sizeof(d));
    d.type = ncclProfileColl;
    d.coll.seqNumber = seq;
    d.coll.func = "AllReduce";
    d.coll.datatype = "ncclFloat32";
    d.coll.count = 256;
    d.coll.root = 0;
    d.coll.nChannels = (uint8_t)nch;
    d.coll.algo = "Ring";
    d.coll.proto = "Simple";
    void* h = NULL;
    ncclProfiler_v5.startEvent(ctx, &h, &d);
    ncclProfiler_v5.stopEvent(h);
    if (!complete || h == NULL) return h;
    for (int c = 0; c < nch; c++) {
        ncclProfilerEventDescr_v5_t k;
        memset(&k, 0, sizeof(k));
        k.type = ncclProfileKernelCh;
        k.parentObj = h;
        k.kernelCh.channelId = (uint8_t)c;
        k.kernelCh.pTimer = 1000 + seq;
        void* kh = NULL;
        ncclProfiler_v5.startEvent(ctx, &kh, &k);
        ncclProfilerEventStateArgs_v5_t a = {.kernelCh = {2000 + seq}};
        ncclProfiler_v5.recordEventState(kh, ncclProfilerKernelChStop, &a);
        ncclProfiler_v5.stopEvent(kh);
    }
    return h;
}

/* The slot behind an op's handle (handles carry the op's generation in their low bits). */
static ci_op* slot_of(void* handle) { return (ci_op*)((uintptr_t)handle & ~(uintptr_t)(sizeof(ci_op) - 1)); }

static void* init5(const char* name, int nranks, int rank) {
    void* ctx = NULL;
    int mask = 0;
    ncclProfiler_v5.init(&ctx, 0xC0FFEEull, &mask, name, 1, nranks, rank, NULL);
    CHECK(ctx != NULL, "init gave no context");
    CHECK((mask & (ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh)) ==
              (ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh),
          "mask %d", mask);
    return ctx;
}

static void test_every_v5_event_type(void) {
    fresh_home("v5types");
    void* ctx = init5("types", 4, 1);
    static const uint64_t types[] = {ncclProfileGroup,  ncclProfileColl,      ncclProfileP2p,       ncclProfileProxyOp,
                                     ncclProfileProxyStep, ncclProfileProxyCtrl, ncclProfileKernelCh, ncclProfileNetPlugin,
                                     ncclProfileGroupApi, ncclProfileCollApi,  ncclProfileP2pApi,    ncclProfileKernelLaunch};
    void* handles[12] = {0};
    void* op = NULL;
    void* api = NULL;
    for (int i = 0; i < 12; i++) {
        ncclProfilerEventDescr_v5_t d;
        memset(&d, 0, sizeof(d));
        d.type = types[i];
        if (types[i] == ncclProfileColl) {
            d.parentObj = api;
            d.coll.func = "Broadcast";
            d.coll.datatype = "Unknown";
            d.coll.count = 100;
            d.coll.root = 2;
            d.coll.nChannels = 1;
        } else if (types[i] == ncclProfileP2p) {
            d.p2p.func = "Send";
            d.p2p.datatype = "ncclInt32";
            d.p2p.count = 10;
            d.p2p.peer = 3;
            d.p2p.nChannels = 1;
        } else if (types[i] == ncclProfileKernelCh || types[i] == ncclProfileProxyOp ||
                   types[i] == ncclProfileProxyStep) {
            d.parentObj = op;
            d.kernelCh.pTimer = 5;
        } else if (types[i] == ncclProfileCollApi) {
            d.collApi.stream = (void*)0x1234560;
        }
        ncclProfiler_v5.startEvent(ctx, &handles[i], &d);
        if (types[i] == ncclProfileColl) op = handles[i];
        if (types[i] == ncclProfileGroupApi) {
            /* API handle for the next Coll: start it now so the Coll sees it as parent */
            ncclProfilerEventDescr_v5_t a;
            memset(&a, 0, sizeof(a));
            a.type = ncclProfileCollApi;
            a.collApi.stream = (void*)0xabc0;
            ncclProfiler_v5.startEvent(ctx, &api, &a);
        }
    }
    CHECK(handles[0] == NULL && handles[4] == NULL && handles[5] == NULL && handles[7] == NULL && handles[8] == NULL &&
              handles[11] == NULL,
          "unneeded types must get NULL handles");
    CHECK(handles[1] != NULL && handles[2] != NULL && handles[3] != NULL && handles[6] != NULL && handles[9] != NULL &&
              handles[10] != NULL,
          "Coll/P2p/ProxyOp/KernelCh/API need handles");
    ncclProfilerEventStateArgs_v5_t a = {.kernelCh = {9}};
    for (int s = 8; s <= 24; s++)
        for (int i = 0; i < 12; i++) ncclProfiler_v5.recordEventState(handles[i], s, &a);
    for (int i = 11; i >= 0; i--) ncclProfiler_v5.stopEvent(handles[i]);
    ncclProfiler_v5.stopEvent(api);
    /* the P2p had no child: it completes only with a KernelCh; give it one */
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(t.by_state[CI_STATE_COMPLETED] == 1, "the Coll completes (%ld)", t.by_state[CI_STATE_COMPLETED]);
    CHECK(t.by_state[CI_STATE_ENQUEUED] == 1, "the childless P2p is written as enqueued at finalize (%ld)",
          t.by_state[CI_STATE_ENQUEUED]);
    CHECK(count_files("hang_detection", "finalize") == 1, "finalize evidence written");
    CHECK(t.bad_headers == 0 && t.invalid == 0, "clean logs");
    printf("ok   every v5 event type\n");
}

static void test_every_v4_event_type(void) {
    fresh_home("v4types");
    void* ctx = NULL;
    int mask = 0;
    ncclProfiler_v4.init(&ctx, &mask, NULL, 0x44ull, 1, 2, 0, NULL);
    CHECK(ctx != NULL && (mask & ncclProfileCollApi) == 0, "v4 init");
    void* op = NULL;
    for (int type = 0; type < 8; type++) {
        ncclProfilerEventDescr_v4_t d;
        memset(&d, 0, sizeof(d));
        d.type = (uint8_t)(1 << type);
        if (d.type == ncclProfileColl) {
            d.coll.func = "AllGather";
            d.coll.datatype = "ncclInt8";
            d.coll.count = 64;
            d.coll.nChannels = 1;
        } else if (d.type == ncclProfileP2p) {
            d.p2p.func = "Recv";
            d.p2p.datatype = "ncclFloat16";
            d.p2p.peer = 1;
        } else {
            d.parentObj = op;
            d.kernelCh.pTimer = 77;
        }
        void* h = NULL;
        ncclProfiler_v4.startEvent(ctx, &h, &d);
        if (d.type == ncclProfileColl) {
            op = h;
            ncclProfiler_v4.stopEvent(h);
            continue;
        }
        ncclProfilerEventStateArgs_v4_t a = {.kernelCh = {88}};
        ncclProfiler_v4.recordEventState(h, ncclProfilerKernelChStop, &a);
        ncclProfiler_v4.stopEvent(h);
    }
    ncclProfiler_v4.finalize(ctx);
    tally t = read_logs();
    /* the Coll completes with its KernelCh times; the P2p announced no channel, so its stop completes it */
    CHECK(t.by_state[CI_STATE_COMPLETED] == 2 && t.gpu_times == 1, "completed %ld gpu %ld", t.by_state[1], t.gpu_times);
    CHECK(t.null_names == t.valid, "NULL commName gives empty names");
    printf("ok   every v4 event type, NULL commName\n");
}

typedef struct storm_arg {
    void* ctx;
    int thread, ops;
    long dropped;
} storm_arg;

static void* storm(void* p) {
    storm_arg* a = p;
    for (int i = 0; i < a->ops; i++)
        if (coll_op(a->ctx, (uint64_t)a->thread * 1000000 + (uint64_t)i, 2, 1) == NULL) a->dropped++;
    return NULL;
}

static void test_eight_thread_storm_reads_back_exactly(void) {
    fresh_home("storm");
    setenv("COMMINSIGHT_POOL_SIZE", "65536", 1); /* holds the whole storm: nothing may be dropped */
    void* ctx = init5("storm", 8, 0);
    pthread_t th[8];
    storm_arg args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (storm_arg){ctx, i, 5000, 0};
        pthread_create(&th[i], NULL, storm, &args[i]);
    }
    long dropped = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        dropped += args[i].dropped;
    }
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(dropped == 0 && t.valid == 40000, "records %ld dropped %ld", t.valid, dropped);
    CHECK(t.by_state[CI_STATE_COMPLETED] == t.valid && t.gpu_times == t.valid, "all completed with GPU times");
    printf("ok   8-thread storm: %ld records + %ld dropped = 40000\n", t.valid, dropped);
}

static void test_ring_without_consumer_drops_and_counts(void) {
    fresh_home("ring");
    setenv("COMMINSIGHT_RING_CAPACITY", "64", 1);
    void* ctx = init5("ring", 2, 0);
    for (int i = 0; i < 1000; i++) coll_op(ctx, (uint64_t)i, 1, 1);
    ncclProfiler_v5.finalize(ctx);
    char dir[320];
    snprintf(dir, sizeof(dir), "%s/shms", g_home);
    DIR* d = opendir(dir);
    struct dirent* e;
    int found = 0;
    while (d != NULL && (e = readdir(d)) != NULL) {
        if (strstr(e->d_name, ".ring") == NULL) continue;
        char path[640];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        int fd = open(path, O_RDONLY);
        ci_ring_header h;
        CHECK(read(fd, &h, sizeof(h)) == (ssize_t)sizeof(h), "ring header");
        close(fd);
        CHECK(h.magic == CI_RING_MAGIC && h.capacity == 64 && h.writer_closed == 1, "ring header fields");
        CHECK(h.head == 64 && h.dropped == 936 && h.tail == 0, "head %llu dropped %llu", (unsigned long long)h.head,
              (unsigned long long)h.dropped);
        found++;
    }
    if (d) closedir(d);
    CHECK(found == 1, "one ring file (%d)", found);
    tally t = read_logs();
    CHECK(t.valid == 1000, "raw logs keep everything the ring dropped (%ld)", t.valid);
    printf("ok   ring without consumer drops and counts\n");
}

static void test_reload_cycles(void) {
    fresh_home("reload");
    for (int cycle = 0; cycle < 3; cycle++) {
        void* a = init5("a", 2, 0);
        void* b = init5(NULL, 2, 1);
        for (int i = 0; i < 10; i++) {
            coll_op(a, (uint64_t)i, 1, 1);
            coll_op(b, (uint64_t)i, 1, 1);
        }
        ncclProfiler_v5.finalize(a);
        ncclProfiler_v5.finalize(b);
    }
    tally t = read_logs();
    CHECK(t.valid == 60 && t.segments == 3, "records %ld segments %ld", t.valid, t.segments);
    printf("ok   init/finalize cycles restart the writer\n");
}

static void test_inflight_at_finalize_is_abandoned(void) {
    fresh_home("abandon");
    void* ctx = init5("abandon", 2, 0);
    coll_op(ctx, 1, 2, 1);
    void* stuck = coll_op(ctx, 2, 2, 0); /* enqueued, kernel never reported */
    ncclProfilerEventDescr_v5_t k;
    memset(&k, 0, sizeof(k));
    k.type = ncclProfileKernelCh;
    k.parentObj = coll_op(ctx, 3, 2, 0);
    void* kh = NULL;
    ncclProfiler_v5.startEvent(ctx, &kh, &k); /* one channel started, never stops */
    (void)stuck;
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(t.by_state[CI_STATE_COMPLETED] == 1 && t.by_state[CI_STATE_ENQUEUED] == 1 &&
              t.by_state[CI_STATE_ABANDONED] == 1,
          "completed %ld enqueued %ld abandoned %ld", t.by_state[1], t.by_state[2], t.by_state[3]);
    CHECK(count_files("hang_detection", "-finalize-") == 1, "finalize evidence");
    printf("ok   in flight at finalize: abandoned/enqueued records and evidence\n");
}

static void test_hang_timeout_writes_evidence(void) {
    fresh_home("timeout");
    setenv("COMMINSIGHT_HANG_TIMEOUT_S", "1", 1);
    void* ctx = init5("timeout", 2, 0);
    coll_op(ctx, 7, 1, 0);
    int files = 0;
    for (int i = 0; i < 100 && files == 0; i++) { /* the writer scans once a second: wait up to 10 s */
        usleep(100000);
        files = count_files("hang_detection", "-timeout-");
    }
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(files == 1, "timeout evidence files %d", files);
    CHECK(t.by_state[CI_STATE_TIMEOUT] == 1 && t.by_state[CI_STATE_ENQUEUED] == 1, "timeout %ld enqueued %ld",
          t.by_state[4], t.by_state[2]);
    printf("ok   hang timeout snapshot and evidence\n");
}

/* The agent's requests in the ring header: a segment seal on demand, in-flight ops at the agent's threshold. */
static void test_agent_requests_seal_and_inflight_reports(void) {
    fresh_home("requests");
    void* ctx = init5("req", 2, 0);
    coll_op(ctx, 1, 1, 1);
    ci_op* stuck = slot_of(coll_op(ctx, 2, 1, 0));
    pthread_mutex_lock(&ci_rt->out_lock);
    ci_ring_header* h = ci_rt->ring.hdr;
    __atomic_store_n(&h->seal_request, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&h->inflight_report_ns, 500000000ull, __ATOMIC_RELAXED); /* 0.5 s */
    double per_s = 1e9 / ci_rt->clock.ns_per_tick;
    atomic_store(&stuck->t_start, ci_ticks() - (uint64_t)(2 * per_s)); /* in flight for 2 s */
    pthread_mutex_unlock(&ci_rt->out_lock);
    uint64_t done = 0;
    for (int i = 0; i < 100 && done != 1; i++) { /* the writer honours requests each cycle: wait up to 10 s */
        usleep(100000);
        done = __atomic_load_n(&h->seal_done, __ATOMIC_ACQUIRE);
    }
    CHECK(done == 1, "seal request acknowledged (%llu)", (unsigned long long)done);
    CHECK(count_files("inspector_logs", ".sealed") == 1, "the open segment was sealed on request");
    int inflight = 0;
    for (int i = 0; i < 30 && inflight == 0; i++) {
        usleep(100000);
        uint64_t head = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
        for (uint64_t k = 0; k < head; k++)
            if (ci_rt->ring.slots[k & (h->capacity - 1)].state == CI_STATE_INFLIGHT) inflight++;
    }
    CHECK(inflight == 1, "one INFLIGHT snapshot in the ring (%d)", inflight);
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(t.valid == 2 && t.by_state[CI_STATE_COMPLETED] == 1 && t.by_state[CI_STATE_ENQUEUED] == 1,
          "the raw log holds no INFLIGHT snapshot (%ld records)", t.valid);
    printf("ok   agent requests: seal on demand, in-flight snapshots into the ring only\n");
}

/* Regression: the scan reads its clock once; an op started later (on another core) must not look ancient. */
static void test_hang_scan_ages_are_signed(void) {
    fresh_home("scanage");
    void* ctx = init5("scan", 2, 0);
    ci_op* young = slot_of(coll_op(ctx, 1, 1, 0));
    ci_op* old = slot_of(coll_op(ctx, 2, 1, 0));
    pthread_mutex_lock(&ci_rt->out_lock);
    uint64_t now = ci_ticks();
    double per_s = 1e9 / ci_rt->clock.ns_per_tick;
    atomic_store(&young->t_start, now + (uint64_t)(10 * per_s)); /* "started after the scan's clock read" */
    atomic_store(&old->t_start, now - (uint64_t)(400 * per_s));  /* past the 300 s default threshold */
    ci_hang_scan_locked(ci_rt, ci_realtime_ns());
    pthread_mutex_unlock(&ci_rt->out_lock);
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(t.by_state[CI_STATE_TIMEOUT] == 1, "only the old op times out (%ld)", t.by_state[CI_STATE_TIMEOUT]);
    CHECK(t.by_state[CI_STATE_ENQUEUED] == 2, "both are enqueued at finalize (%ld)", t.by_state[CI_STATE_ENQUEUED]);
    printf("ok   hang scan: an op younger than the scan's clock is not timed out\n");
}

/* A kernel channel NCCL did not announce, arriving after the op completed, must not complete it twice. */
static void test_late_unannounced_child_is_ignored(void) {
    fresh_home("latechild");
    void* ctx = init5("late", 2, 0);
    void* h = coll_op(ctx, 1, 1, 1); /* completes: its one announced channel stopped */
    ncclProfilerEventDescr_v5_t k;
    memset(&k, 0, sizeof(k));
    k.type = ncclProfileKernelCh;
    k.parentObj = h;
    void* kh = (void*)1;
    /* the writer may already have recycled the slot; either way no second completion may follow */
    ncclProfiler_v5.startEvent(ctx, &kh, &k);
    ncclProfiler_v5.stopEvent(kh);
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(t.valid == 1 && t.by_state[CI_STATE_COMPLETED] == 1, "records %ld", t.valid);
    printf("ok   late unannounced child is ignored\n");
}

/* The kernel can finish (its channels stop, on the proxy thread) before the enqueuing thread's stopEvent: the
   op completes when that stop comes, at that stop's time, not before and not never. */
static void test_channels_closing_before_the_enqueue_stop_wait_for_it(void) {
    fresh_home("stoplast");
    void* ctx = init5("stoplast", 2, 0);
    ncclProfilerEventDescr_v5_t d;
    memset(&d, 0, sizeof(d));
    d.type = ncclProfileColl;
    d.coll.func = "AllReduce";
    d.coll.datatype = "ncclFloat32";
    d.coll.nChannels = 2;
    void* h = NULL;
    ncclProfiler_v5.startEvent(ctx, &h, &d);
    for (int c = 0; c < 2; c++) {
        ncclProfilerEventDescr_v5_t k;
        memset(&k, 0, sizeof(k));
        k.type = ncclProfileKernelCh;
        k.parentObj = h;
        k.kernelCh.pTimer = 1000;
        void* kh = NULL;
        ncclProfiler_v5.startEvent(ctx, &kh, &k);
        ncclProfilerEventStateArgs_v5_t a = {.kernelCh = {2000}};
        ncclProfiler_v5.recordEventState(kh, ncclProfilerKernelChStop, &a);
        ncclProfiler_v5.stopEvent(kh);
    }
    /* a few writer cycles see the channel side closed and the enqueue still open */
    for (int i = 0; i < 3; i++) {
        pthread_mutex_lock(&ci_rt->out_lock);
        ci_writer_cycle_locked(ci_rt);
        pthread_mutex_unlock(&ci_rt->out_lock);
    }
    CHECK(ci_op_inflight(slot_of(h)), "not complete before the enqueue's stop");
    usleep(20000);
    ncclProfiler_v5.stopEvent(h);
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(t.valid == 1 && t.by_state[CI_STATE_COMPLETED] == 1 && t.gpu_times == 1 && t.complete_out_of_order == 0,
          "records %ld completed %ld gpu %ld out of order %ld", t.valid, t.by_state[1], t.gpu_times,
          t.complete_out_of_order);
    printf("ok   channels that close before the enqueue's stop: completed at that stop\n");
}

/* A handle kept past its op (the slot now serves another op) must not touch the new op. */
static void test_stale_handles_do_not_touch_the_next_op_of_the_slot(void) {
    fresh_home("stale");
    setenv("COMMINSIGHT_POOL_SIZE", "64", 1);
    void* ctx = init5("stale", 2, 0);
    void* first = coll_op(ctx, 1, 1, 1); /* completes */
    ci_op* slot = slot_of(first);
    /* let the writer free it, then use the pool until the slot serves a new op */
    void* again = NULL;
    for (int i = 0; i < 200 && again == NULL; i++) {
        pthread_mutex_lock(&ci_rt->out_lock);
        ci_writer_cycle_locked(ci_rt);
        pthread_mutex_unlock(&ci_rt->out_lock);
        void* h = coll_op(ctx, (uint64_t)(100 + i), 1, 0); /* enqueued, channel never reported */
        if (h != NULL && slot_of(h) == slot) again = h;
    }
    CHECK(again != NULL && again != first, "the slot was reused with another handle");
    ncclProfilerEventDescr_v5_t k;
    memset(&k, 0, sizeof(k));
    k.type = ncclProfileKernelCh;
    k.parentObj = first;
    void* kh = (void*)1;
    ncclProfiler_v5.startEvent(ctx, &kh, &k);
    CHECK(kh == NULL, "a child of a stale parent gets no handle");
    ci_children c;
    ci_op_children(slot, CI_SG_GEN(atomic_load(&slot->sg)), &c);
    CHECK(c.kch_started == 0 && c.started == 0 && ci_op_inflight(slot), "the new op is untouched");
    ncclProfiler_v5.finalize(ctx);
    unsetenv("COMMINSIGHT_POOL_SIZE");
    tally t = read_logs();
    CHECK(t.by_state[CI_STATE_COMPLETED] == 1, "only the first op completed (%ld)", t.by_state[CI_STATE_COMPLETED]);
    printf("ok   stale handles do not touch the slot's next op\n");
}

static void test_pool_exhaustion_drops_without_blocking(void) {
    fresh_home("pool");
    setenv("COMMINSIGHT_POOL_SIZE", "64", 1);
    void* ctx = init5("pool", 2, 0);
    int nulls = 0;
    for (int i = 0; i < 100; i++)
        if (coll_op(ctx, (uint64_t)i, 1, 0) == NULL) nulls++;
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    CHECK(nulls == 36 && t.valid == 64, "nulls %d records %ld", nulls, t.valid);
    printf("ok   empty pool drops and counts\n");
}

static void* two_ops(void* ctx) {
    for (int i = 0; i < 2; i++)
        if (coll_op(ctx, (uint64_t)i, 1, 1) == NULL) return (void*)1;
    return NULL;
}

static void test_threads_that_come_and_go_do_not_drain_the_pool(void) {
    /* each thread caches slots; one that exits must give the unused ones back, or a few threads that
       come and go with communicators would empty a small pool long before the writer frees anything */
    fresh_home("threads");
    setenv("COMMINSIGHT_POOL_SIZE", "64", 1);
    void* ctx = init5("threads", 2, 0);
    int dropped = 0;
    /* 64 slots are 4 per shard, so a thread caches up to 4 and leaves 2 unused: 40 threads strand 80 */
    for (int i = 0; i < 40; i++) {
        pthread_t th;
        void* ret = NULL;
        pthread_create(&th, NULL, two_ops, ctx);
        pthread_join(th, &ret);
        dropped += ret != NULL;
        /* one writer cycle here, as the writer thread would do: on a busy machine that thread may not
           have run yet, and the test is about stranded cached slots, not about writer lag */
        pthread_mutex_lock(&ci_rt->out_lock);
        ci_writer_cycle_locked(ci_rt);
        pthread_mutex_unlock(&ci_rt->out_lock);
    }
    ncclProfiler_v5.finalize(ctx);
    unsetenv("COMMINSIGHT_POOL_SIZE");
    tally t = read_logs();
    CHECK(dropped == 0 && t.valid == 80, "threads that dropped %d, records %ld", dropped, t.valid);
    printf("ok   threads that come and go give their cached slots back\n");
}

typedef struct {
    void* ctx;
    int thread;
    pthread_barrier_t* all_alive;
    long dropped;
} crowd_arg;

static void* crowd(void* p) {
    crowd_arg* a = p;
    if (coll_op(a->ctx, (uint64_t)a->thread * 1000, 1, 1) == NULL) a->dropped++;
    /* every thread holds its completion ring (or found none) before any thread leaves */
    pthread_barrier_wait(a->all_alive);
    for (int i = 1; i < 200; i++)
        if (coll_op(a->ctx, (uint64_t)a->thread * 1000 + (uint64_t)i, 1, 1) == NULL) a->dropped++;
    return NULL;
}

static void test_more_completing_threads_than_rings_lose_nothing(void) {
    /* CI_DONE_RINGS threads get a completion ring of their own; the others complete through the shard
       lists; every record arrives, in both cases */
    enum { THREADS = CI_DONE_RINGS + 8 };
    fresh_home("crowd");
    setenv("COMMINSIGHT_POOL_SIZE", "65536", 1);
    void* ctx = init5("crowd", THREADS, 0);
    pthread_t th[THREADS];
    crowd_arg args[THREADS];
    pthread_barrier_t all_alive;
    pthread_barrier_init(&all_alive, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) {
        args[i] = (crowd_arg){ctx, i, &all_alive, 0};
        pthread_create(&th[i], NULL, crowd, &args[i]);
    }
    long dropped = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        dropped += args[i].dropped;
    }
    pthread_barrier_destroy(&all_alive);
    int rings_taken = 0;
    for (int r = 0; r < CI_DONE_RINGS; r++)
        rings_taken += atomic_load_explicit(&ci_rt->pool.rings[r].state, memory_order_relaxed) == 1;
    ncclProfiler_v5.finalize(ctx);
    unsetenv("COMMINSIGHT_POOL_SIZE");
    tally t = read_logs();
    CHECK(dropped == 0 && t.valid == THREADS * 200, "records %ld dropped %ld", t.valid, dropped);
    CHECK(rings_taken == 0, "%d completion rings still taken after their threads exited", rings_taken);
    printf("ok   %d completing threads, %d rings: %ld records, rings handed back\n", THREADS, CI_DONE_RINGS, t.valid);
}

static void test_completion_times_from_the_gpu_timer_follow_the_host_clock(void) {
    fresh_home("gputime");
    void* ctx = init5("gputime", 2, 0);
    for (int i = 0; i < 64; i++) coll_op(ctx, (uint64_t)i, 1, 1);
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    /* one completion in 16 is read on the host (the offset sample), the rest derive from gpu_end */
    CHECK(t.valid == 64 && t.from_gpu == 60 && t.complete_out_of_order == 0, "records %ld from gpu %ld out of order %ld",
          t.valid, t.from_gpu, t.complete_out_of_order);
    printf("ok   completion times derived from the GPU timer lie on the host clock\n");
}

static void test_unwritable_home_degrades(void) {
    fresh_home("unwritable");
    setenv("COMMINSIGHT_HOME", "/proc/comminsight-nowhere", 1);
    void* ctx = init5("nohome", 2, 0);
    for (int i = 0; i < 100; i++) coll_op(ctx, (uint64_t)i, 1, 1);
    ncclProfiler_v5.finalize(ctx);
    printf("ok   unwritable home: no crash\n");
}

static void test_p2p_sequence_per_peer(void) {
    fresh_home("p2p");
    void* ctx = init5("p2p", 4, 0);
    for (int i = 0; i < 30; i++) {
        ncclProfilerEventDescr_v5_t d;
        memset(&d, 0, sizeof(d));
        d.type = ncclProfileP2p;
        d.p2p.func = (i % 2) ? "Recv" : "Send";
        d.p2p.datatype = "ncclFloat64";
        d.p2p.count = 4;
        d.p2p.peer = i % 3;
        d.p2p.nChannels = 1;
        void *h = NULL, *kh = NULL;
        ncclProfiler_v5.startEvent(ctx, &h, &d);
        ncclProfiler_v5.stopEvent(h);
        ncclProfilerEventDescr_v5_t k;
        memset(&k, 0, sizeof(k));
        k.type = ncclProfileKernelCh;
        k.parentObj = h;
        ncclProfiler_v5.startEvent(ctx, &kh, &k);
        ncclProfiler_v5.stopEvent(kh);
    }
    ncclProfiler_v5.finalize(ctx);
    tally t = read_logs();
    /* 6 (func, peer) pairs, 5 ops each: seq 0..4 */
    CHECK(t.p2p == 30 && t.max_seq == 4, "p2p %ld max seq %llu", t.p2p, (unsigned long long)t.max_seq);
    printf("ok   P2P sequence numbers per (comm, func, peer)\n");
}

/* Every valid record of <home>/inspector_logs, into recs (at most cap); returns how many. */
static long read_records(ci_op_record* recs, long cap) {
    char dir[320];
    snprintf(dir, sizeof(dir), "%s/inspector_logs", g_home);
    DIR* d = opendir(dir);
    long n = 0;
    if (d == NULL) return 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (strstr(e->d_name, ".cilog") == NULL) continue;
        char path[640];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        FILE* f = fopen(path, "rb");
        if (f == NULL) continue;
        ci_log_header h;
        if (fread(&h, sizeof(h), 1, f) == 1)
            while (n < cap && fread(&recs[n], sizeof(recs[n]), 1, f) == 1)
                if (recs[n].magic == CI_RECORD_MAGIC && recs[n].checksum == fnv(&recs[n])) n++;
        fclose(f);
    }
    closedir(d);
    return n;
}

/* Names are kept as ids of name sets: names in memory that changes between ops, and more distinct names than
   the table holds, must still reach each record exactly as given. */
static void test_names_in_changing_memory_and_past_the_table_reach_records(void) {
    enum { DISTINCT = 3000 }; /* more than the table's buckets: the rest are copied into their slots */
    fresh_home("names");
    setenv("COMMINSIGHT_POOL_SIZE", "8192", 1);
    void* ctx = init5("names", 2, 0);
    char* func = malloc(32); /* writable memory, same pointers every op: matched by content */
    char* dtype = malloc(32);
    for (int i = 0; i < DISTINCT; i++) {
        memset(func, 'x', 32); /* bytes past the NUL change too, and must not show */
        memset(dtype, 'y', 32);
        snprintf(func, 24, "Func%d", i);
        snprintf(dtype, 16, "dt%d", i % 7);
        ncclProfilerEventDescr_v5_t d;
        memset(&d, 0, sizeof(d));
        d.type = ncclProfileColl;
        d.coll.seqNumber = (uint64_t)i;
        d.coll.func = func;
        d.coll.datatype = dtype;
        d.coll.nChannels = 1;
        d.coll.algo = (i % 2) ? "Tree" : NULL;
        d.coll.proto = "LL";
        void *h = NULL, *kh = NULL;
        ncclProfiler_v5.startEvent(ctx, &h, &d);
        ncclProfiler_v5.stopEvent(h);
        ncclProfilerEventDescr_v5_t k;
        memset(&k, 0, sizeof(k));
        k.type = ncclProfileKernelCh;
        k.parentObj = h;
        ncclProfiler_v5.startEvent(ctx, &kh, &k);
        ncclProfiler_v5.stopEvent(kh);
    }
    ncclProfiler_v5.finalize(ctx);
    unsetenv("COMMINSIGHT_POOL_SIZE");
    free(func);
    free(dtype);
    static ci_op_record recs[DISTINCT + 16];
    long n = read_records(recs, DISTINCT + 16);
    int wrong = 0;
    for (long i = 0; i < n; i++) {
        char want[24], want_dt[16];
        snprintf(want, sizeof(want), "Func%llu", (unsigned long long)recs[i].seq);
        snprintf(want_dt, sizeof(want_dt), "dt%llu", (unsigned long long)(recs[i].seq % 7));
        const char* want_algo = (recs[i].seq % 2) ? "Tree" : "";
        char zeros[24] = {0};
        size_t fl = strlen(want);
        if (strcmp(recs[i].func, want) != 0 || strcmp(recs[i].dtype, want_dt) != 0 ||
            strcmp(recs[i].algo, want_algo) != 0 || strcmp(recs[i].proto, "LL") != 0 ||
            memcmp(recs[i].func + fl, zeros, sizeof(recs[i].func) - fl) != 0)
            wrong++;
    }
    CHECK(n == DISTINCT && wrong == 0, "records %ld, %d with other names than given", n, wrong);
    printf("ok   %d distinct names from changing memory reach their records as given\n", DISTINCT);
}

int main(void) {
    test_every_v5_event_type();
    test_every_v4_event_type();
    test_eight_thread_storm_reads_back_exactly();
    test_ring_without_consumer_drops_and_counts();
    test_reload_cycles();
    test_inflight_at_finalize_is_abandoned();
    test_hang_timeout_writes_evidence();
    test_hang_scan_ages_are_signed();
    test_agent_requests_seal_and_inflight_reports();
    test_late_unannounced_child_is_ignored();
    test_channels_closing_before_the_enqueue_stop_wait_for_it();
    test_stale_handles_do_not_touch_the_next_op_of_the_slot();
    test_pool_exhaustion_drops_without_blocking();
    test_threads_that_come_and_go_do_not_drain_the_pool();
    test_more_completing_threads_than_rings_lose_nothing();
    test_completion_times_from_the_gpu_timer_follow_the_host_clock();
    test_unwritable_home_degrades();
    test_p2p_sequence_per_peer();
    test_names_in_changing_memory_and_past_the_table_reach_records();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf /tmp/ci-check-%d-*", (int)getpid());
    if (system(cmd) != 0) failures++;
    printf(failures ? "FAILED: %d check(s)\n" : "all C checks passed\n", failures);
    return failures ? 1 : 0;
}
