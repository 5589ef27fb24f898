/*
 * ci_internal.h - shared declarations of the CommInsight profiler's modules.
 *
 * Modules (one structure each): pool.c (pre-allocated operation slots, sharded
 * free stacks and completion lists),
 * config.c (env > conf file > defaults), log.c (warnings), ring.c (shared
 * memory ring), segment.c (raw-log segments), hang.c (in-flight scans and
 * evidence), writer.c (background thread), autostart.c (agent start),
 * plugin.c (event handling and the exported ABI tables, at its end).
 * Nothing here is exported: the library is built with -fvisibility=hidden.
 */
#ifndef CI_INTERNAL_H
#define CI_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "comminsight_ring.h"
#include "nccl_profiler_abi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#define CI_SHARDS 16       /* producer shards: threads map round-robin onto them */
#define CI_CACHELINE 64
#define CI_PATH_MAX 512   /* home and directories (home is capped shorter) */
#define CI_FILE_MAX 1024  /* file paths: a directory plus a generated name */

/* ---- clock: cheap ticks on the hot path, converted to CLOCK_REALTIME ns by the writer ---- */

/*
 * Tick source, chosen once per runtime start (config key `clock`): 0 = the CPU's
 * counter (rdtsc / cntvct_el0), 1 = clock_gettime(CLOCK_MONOTONIC) through the
 * vDSO, 2 = CLOCK_MONOTONIC_COARSE (cheapest, ~1-4 ms resolution). `auto` times
 * 0 and 1 and keeps the cheaper: some hypervisors make the counter read slow.
 */
extern int ci_tick_source;

static inline uint64_t ci_hw_ticks(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ volatile("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
#endif
}

/* Returns a monotonic tick count; never a syscall where the vDSO serves clock_gettime. */
static inline uint64_t ci_ticks(void) {
    if (__builtin_expect(ci_tick_source == 0, 1)) return ci_hw_ticks();
    struct timespec ts;
    clock_gettime(ci_tick_source == 1 ? CLOCK_MONOTONIC : CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Picks ci_tick_source for `mode` ("auto", "tsc", "monotonic", "coarse"); returns the source chosen. */
int ci_clock_select(const char* mode);

uint64_t ci_realtime_ns(void);
uint64_t ci_monotonic_ns(void);

/* Tick -> realtime conversion, owned by the writer (re-anchored every cycle). */
typedef struct ci_clock {
    uint64_t tick0, rt0;         /* first anchor: long baseline for the slope */
    uint64_t tick_anchor, rt_anchor;
    double ns_per_tick;
} ci_clock;
void ci_clock_calibrate(ci_clock* c);
void ci_clock_anchor(ci_clock* c);
uint64_t ci_clock_to_ns(const ci_clock* c, uint64_t ticks); /* 0 stays 0 */

/* ---- log.c ---- */
void ci_log_set_logger(ncclDebugLogger_t fn);
void ci_warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/* Warns once per `flag` (a static int the caller owns). */
#define ci_warn_once(flag, ...)                                                  \
    do {                                                                         \
        if (!atomic_exchange_explicit((flag), 1, memory_order_relaxed)) ci_warn(__VA_ARGS__); \
    } while (0)

/* ---- config.c ---- */
typedef struct ci_config {
    char home[CI_PATH_MAX];
    uint32_t pool_size;          /* operation slots, power of two */
    uint32_t ring_capacity;      /* records, power of two */
    uint64_t log_segment_bytes;
    uint64_t log_segment_age_s;
    uint64_t hang_timeout_s;     /* 0 disables timeout evidence */
    uint32_t writer_interval_ms;
    int agent_autostart;
    int ring_enable;
    int log_enable;
    char workload_id[64];
    char clock[16];              /* auto | tsc | monotonic | coarse */
} ci_config;
/* Fills *cfg from env > <home>/etc/comminsight.conf > defaults; warns once per bad value. Returns 0. */
int ci_config_load(ci_config* cfg);

/* ---- communicators ---- */
typedef struct ci_comm {
    uint64_t comm_hash;
    char name[56];
    int32_t rank, nranks, nnodes;
    int abi;                      /* 4 or 5 */
    _Atomic uint64_t* p2p_seq;    /* [2][nranks]: Send, Recv counters per peer */
    _Atomic uint64_t p2p_seq_other[2]; /* peers outside [0, nranks) */
    struct ci_comm* next;         /* all communicators, freed at the last finalize */
} ci_comm;

/* ---- pool.c: operation slots ---- */
enum { CI_SLOT_FREE = 0, CI_SLOT_INFLIGHT = 1, CI_SLOT_DONE = 2 };
#define CI_REFS_KCH   (1ull << 32) /* one KernelCh child started beyond the announced channels (16 bits) */
#define CI_REFS_PROXY (1ull << 48) /* one ProxyOp child started (15 bits) */
#define CI_REFS_DONE  (1ull << 63) /* taken out of flight by finalize: the last part must not complete it */

/*
 * One operation slot. Every field the event path writes lies in the first three cache lines, and the
 * event path prefetches those lines for writing one operation ahead (see pool.c), so the slot's lines,
 * last read by the writer thread, are back in the producer's cache before it needs them.
 */
typedef struct __attribute__((aligned(256))) ci_op {
    _Atomic uint64_t refs;       /* low 32: outstanding (the op + open children); high: children started */
    _Atomic uint32_t state;      /* CI_SLOT_* */
    uint32_t index;
    /* index + 1 of the next slot, 0 = none: the free-stack link while free, the shard's completion-list
       link once completed (the two uses never overlap in time) */
    _Atomic uint32_t link;
    ci_comm* comm;
    _Atomic uint64_t t_start;    /* ticks */
    _Atomic uint64_t t_stop;     /* ticks, 0 until stopEvent */
    uint64_t t_complete;         /* ticks, set by the completing thread */
    _Atomic uint64_t gpu_start;  /* min KernelCh start pTimer, UINT64_MAX unknown */
    _Atomic uint64_t gpu_end;    /* max KernelCh stop pTimer */
    uint64_t seq, count, stream;
    int32_t peer, tid;
    uint8_t kind, n_channels, flags, reported;
    /* announced kernel channels started so far: written only by the thread reporting the op's channels
       (NCCL's proxy thread), so a relaxed load and store, no locked operation; extra children beyond
       n_channels go through `refs` */
    _Atomic uint16_t kch_started;
    uint8_t snapped;             /* already put in the ring as CI_STATE_INFLIGHT for the agent */
    char func[24], dtype[16], algo[16], proto[16];
} ci_op;

/*
 * Per shard, on a cache line of its own (so one shard's traffic never invalidates another's, nor the
 * read-mostly pool fields every producer reads): the free stack, (tag << 32 | index + 1) in one word so
 * a CAS never suffers ABA, and the completion list (index + 1 of the last completed slot; producers push
 * with one CAS, the writer takes the whole list with one exchange, so it needs no tag).
 */
typedef struct __attribute__((aligned(CI_CACHELINE))) ci_shard_lists {
    _Atomic uint64_t free_head;
    _Atomic uint32_t done_head;
} ci_shard_lists;

/*
 * A completing thread's own completion ring: single producer (the thread that claimed it), single consumer
 * (the writer), so a completion is a plain store and a release store, no locked operation. Its capacity is
 * at least the pool's size, so it can never be full (every entry is a distinct completed slot not yet drained).
 * `state`: 0 free, 1 owned by a live thread, 2 its thread exited (the writer drains it, then frees it).
 */
#define CI_DONE_RINGS 16
typedef struct ci_done_ring {
    _Alignas(CI_CACHELINE) _Atomic uint32_t head; /* producer: entries pushed (free-running) */
    _Alignas(CI_CACHELINE) uint32_t tail;         /* writer only: entries drained */
    _Atomic uint32_t state;
    uint32_t* slots;                              /* [pool size] slot indices */
} ci_done_ring;

typedef struct ci_pool {
    /* read by every producer, written only at init: a line of its own */
    _Alignas(CI_CACHELINE) ci_op* ops;
    uint32_t size, per_shard, ring_mask;
    ci_done_ring rings[CI_DONE_RINGS];
    ci_shard_lists lists[CI_SHARDS];
    /* writer side only: batch of frees per shard (index + 1), pushed as one chain per cycle */
    _Alignas(CI_CACHELINE) uint32_t chain_top[CI_SHARDS];
    uint32_t chain_bottom[CI_SHARDS];
} ci_pool;
int ci_pool_init(ci_pool* p, uint32_t size);   /* 0, or -1 on allocation failure */
void ci_pool_free(ci_pool* p);
/* Takes up to `max` free slot indices for one thread's private cache, from `shard` first, with one CAS;
   returns how many (0 when every shard is empty). Order: the first index is the one to use first. */
uint32_t ci_pool_alloc_batch(ci_pool* p, unsigned shard, uint32_t* out, uint32_t max);
void ci_pool_give_back(ci_pool* p, uint32_t idx); /* a cached, unused slot back to its home shard */
void ci_pool_prefetch(const ci_pool* p, uint32_t idx); /* the lines the event path writes, for writing */
void ci_pool_complete(ci_pool* p, unsigned shard, ci_op* op); /* event path: onto `shard`'s completion list */
ci_op* ci_pool_take_done(ci_pool* p, unsigned shard); /* writer: the shard's completed slots, oldest first, via link */
/* A free completion ring for the calling thread, or NULL when all are taken (then it uses the shard lists). */
ci_done_ring* ci_pool_ring_claim(ci_pool* p);
void ci_pool_ring_leave(ci_done_ring* r); /* the owning thread exits: the writer frees the ring once drained */
ci_op* ci_pool_take_ring(ci_pool* p, unsigned ring); /* writer: the ring's completed slots, oldest first, via link */

/* Event path: the owning thread publishes a completed slot on its ring (never full, see above). */
static inline void ci_done_ring_push(ci_done_ring* r, uint32_t idx, uint32_t mask) {
    uint32_t h = atomic_load_explicit(&r->head, memory_order_relaxed); /* only this thread writes it */
    r->slots[h & mask] = idx;
    /* release: the slot's fields and this entry are visible to the writer that acquires head */
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
}
void ci_pool_release(ci_pool* p, ci_op* op);      /* writer side: queued for its home shard */
void ci_pool_flush_frees(ci_pool* p);             /* writer side: one CAS per shard for all queued frees */

/* ---- ring.c: SPSC shared-memory ring (layout in comminsight_ring.h) ---- */
typedef struct ci_ring {
    ci_ring_header* hdr;
    ci_op_record* slots;
    size_t map_bytes;
    char path[CI_FILE_MAX];
} ci_ring;
int ci_ring_open(ci_ring* r, const char* dir, uint32_t capacity, const char* host, uint64_t start_ns); /* 0 / -1 */
void ci_ring_push(ci_ring* r, const ci_op_record* rec);
void ci_ring_set_lost(ci_ring* r, uint64_t lost);
/* The consumer's requests (see comminsight_ring.h): seal_request is returned when it differs from the
   last one honoured (0 when none is pending); inflight_report_ns as set (0: off). */
uint64_t ci_ring_seal_requested(const ci_ring* r);
void ci_ring_seal_done(ci_ring* r, uint64_t request);
uint64_t ci_ring_inflight_report_ns(const ci_ring* r);
void ci_ring_close(ci_ring* r);

/* ---- segment.c: raw-log segments ---- */
typedef struct ci_segment_writer {
    char dir[CI_PATH_MAX];
    char path[CI_FILE_MAX];
    int fd;
    int failed;                  /* 1 after an error, until a write succeeds again */
    uint64_t off;                /* next record offset (whole records only) */
    uint64_t opened_ns;
    uint32_t index;
    uint64_t max_bytes, max_age_ns;
    uint64_t start_ns;           /* process incarnation, part of the file names */
    uint64_t lost;               /* records that could not be written */
    ci_log_header proto;         /* header template */
} ci_segment_writer;
void ci_segment_init(ci_segment_writer* w, const char* dir, uint64_t max_bytes, uint64_t max_age_s,
                     uint64_t start_ns, const ci_log_header* proto);
void ci_segment_append(ci_segment_writer* w, const ci_op_record* recs, size_t n, uint64_t now_ns);
void ci_segment_tick(ci_segment_writer* w, uint64_t now_ns); /* seals a segment past its age */
void ci_segment_close(ci_segment_writer* w);                 /* seals the open segment */
void ci_segment_seal_now(ci_segment_writer* w);              /* seals the open segment if it holds records */

/* ---- the process-wide runtime (plugin.c owns it) ---- */
typedef struct __attribute__((aligned(CI_CACHELINE))) ci_shard {
    _Atomic uint64_t lost;       /* events lost on this shard (pool empty) */
} ci_shard;

typedef struct ci_runtime {
    ci_config cfg;
    uint32_t generation;         /* distinguishes runtimes across unload/reload: per-thread caches check it */
    ci_pool pool;
    ci_shard shards[CI_SHARDS];
    /* read on every child/stop event, written at start only: kept off the writer's lines below */
    _Alignas(CI_CACHELINE) uintptr_t pool_base;
    uintptr_t pool_bytes;
    _Alignas(CI_CACHELINE) int32_t pid;
    int32_t cuda_device;
    char host[64];
    uint64_t start_ns;
    /* writer side, guarded by out_lock */
    pthread_mutex_t out_lock;
    ci_clock clock;
    ci_ring ring;
    int ring_ok;
    ci_segment_writer seg;
    uint64_t record_seq;
    uint64_t last_hang_scan_ns;
    ci_op_record batch[64];
    /* GPU timer -> host clock: min of (host completion - gpu_end) over ops whose completion was read on
       the host, over the current and the previous window (tracks drift, ignores completion lag) */
    int64_t gpu_offset_cur, gpu_offset_prev;
    int gpu_offset_cur_n, gpu_offset_prev_n;
    uint64_t gpu_offset_window_ns;
    size_t batch_n;
    /* writer thread */
    pthread_t thread;
    int thread_running;
    _Atomic int stop;
    pthread_mutex_t wake_lock;   /* with wake: lets finalize interrupt the writer's sleep */
    pthread_cond_t wake;
} ci_runtime;

extern ci_runtime* ci_rt;

/* writer.c */
int ci_writer_start(ci_runtime* rt);   /* 0, or -1 (thread not started: events are kept until the pool fills) */
void ci_writer_stop(ci_runtime* rt);   /* joins the thread, drains, closes sinks */
void ci_writer_cycle_locked(ci_runtime* rt);
void ci_writer_emit_locked(ci_runtime* rt, const ci_op* op, uint8_t state, ci_op_record* copy);
void ci_writer_flush_locked(ci_runtime* rt);
void ci_writer_emit_ring_locked(ci_runtime* rt, const ci_op* op, uint8_t state); /* ring only, not the raw log */
void ci_writer_finalize_comm(ci_runtime* rt, const ci_comm* comm);
size_t ci_dtype_size(const char* dtype);

/* hang.c */
void ci_hang_scan_locked(ci_runtime* rt, uint64_t now_ns);
/* Puts ops in flight longer than report_ns into the ring once each, as CI_STATE_INFLIGHT (not the raw log). */
void ci_hang_report_inflight_locked(ci_runtime* rt, uint64_t report_ns);
/* Writes every in-flight op of `comm` (all comms if NULL) as ABANDONED/ENQUEUED, frees them, writes evidence. */
void ci_hang_abandon_locked(ci_runtime* rt, const ci_comm* comm);

/* autostart.c */
void ci_autostart_agent(const ci_config* cfg);

/* misc helpers (log.c) */
void ci_copy_str(char* dst, size_t cap, const char* src);
int ci_mkdirs(const char* path);  /* 0, or -1 with errno */
pid_t ci_gettid(void);

#endif /* CI_INTERNAL_H */
