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

/* Asks for the cache line holding `p` in exclusive state (a hint: never faults, never blocks). */
static inline void ci_prefetch_for_write(const void* p) {
#if defined(__x86_64__)
    /* PREFETCHW; executes as a NOP on x86 cores that lack it */
    __asm__ volatile("prefetchw %0" : : "m"(*(const char*)p));
#else
    __builtin_prefetch(p, 1, 3);
#endif
}

/* ---- pool.c: operation slots ---- */
enum { CI_SLOT_FREE = 0, CI_SLOT_INFLIGHT = 1, CI_SLOT_DONE = 2 };
#define CI_REFS_DONE  (1ull << 63) /* ops without announced channels: taken out of flight by finalize */

/*
 * One operation slot (256 bytes, so a handle's low 8 bits are free: 2 tag bits and 6 bits of `gen`).
 * Who writes what, so that no field needs a locked operation on the event path:
 *   - the enqueuing thread (Coll/P2p start): everything up to `state`, then t_stop at its stopEvent;
 *   - the thread that reports the op's children (NCCL's proxy thread): the children counters, c_closed,
 *     gpu_start/gpu_end, t_complete and from_gpu; it closes the channel side and tells the writer;
 *   - the writer: decides completion (channel side closed, told through a completion ring, and t_stop set),
 *     and frees the slot.
 * Ops that announce no channel (n_channels == 0) keep the older protocol: `refs` counts their open parts and
 * whoever closes the last one (one fetch_sub) tells the writer.
 */
typedef struct __attribute__((aligned(256))) ci_op {
    _Atomic uint64_t refs;       /* n_channels == 0 only: open parts (low 32 bits), CI_REFS_DONE */
    _Atomic uint32_t state;      /* CI_SLOT_* */
    uint32_t index;
    _Atomic uint32_t link;       /* index + 1 of the next slot while on a free stack or chain, 0 = none */
    _Atomic uint32_t gen;        /* bumped by each op start: handles and completion entries carry it */
    ci_comm* comm;
    _Atomic uint64_t t_start;    /* ticks */
    _Atomic uint64_t t_stop;     /* ticks, 0 until stopEvent (the enqueue side closed) */
    _Atomic uint64_t t_complete; /* ticks, host read when the last part closed (0 with from_gpu) */
    _Atomic uint64_t gpu_start;  /* min KernelCh start pTimer, UINT64_MAX unknown */
    _Atomic uint64_t gpu_end;    /* max KernelCh stop pTimer */
    uint64_t seq, count, stream;
    int32_t peer, tid;
    /* the descriptor's names as copied on the event path (8-byte aligned, no store splits a line): up to the
       field's size, NOT necessarily NUL-terminated and possibly followed by bytes of whatever followed the
       source string (see ci_name_copy); readers copy them with ci_copy_str, which stops at the NUL or the
       field's end */
    char func[24], dtype[16], algo[16], proto[16];
    uint8_t kind, n_channels, flags, reported;
    /* children (KernelCh, ProxyOp): written only by the thread reporting them, relaxed loads and stores */
    _Atomic uint16_t kch_started;      /* KernelCh children started, announced or not */
    _Atomic uint16_t children_started; /* every child started */
    _Atomic uint16_t children_stopped;
    _Atomic uint8_t c_closed;          /* channel side closed: later children are ignored */
    _Atomic uint8_t from_gpu;          /* completion time = gpu_end on the host clock (CI_FLAG_COMPLETE_FROM_GPU) */
    uint8_t snapped;             /* already put in the ring as CI_STATE_INFLIGHT for the agent */
} ci_op;
_Static_assert(sizeof(ci_op) == 256, "handles keep 8 low bits of a slot's address for tags and generation");
/* the event path writes the first three lines only; slot_take prefetches exactly those (pool.c) */
_Static_assert(__builtin_offsetof(ci_op, snapped) < 3 * CI_CACHELINE, "event-path fields within three lines");

/* Per shard, on a cache line of its own: the free stack, (tag << 32 | index + 1) in one word, so a CAS
   never suffers ABA. */
typedef struct __attribute__((aligned(CI_CACHELINE))) ci_shard_lists {
    _Atomic uint64_t free_head;
} ci_shard_lists;

/*
 * Completion rings: a thread that closes ops (in practice NCCL's proxy thread) claims one of CI_DONE_RINGS
 * at its first close and tells the writer of each op it closed with one 32-bit entry (ci_done_entry: the
 * slot's index + 1 and 13 bits of its generation; 0 is an empty entry). Its position is thread-local and there
 * is no shared head: the producer checks that the entry it is about to write is empty (the line it writes
 * anyway), stores it with release, and the writer takes entries from its own tail until it meets an empty
 * one, zeroing each. So a close costs two plain stores and no locked operation. Ring CI_DONE_RINGS is shared
 * by threads that found no free ring (and by a full ring's thread): they take positions with one fetch_add.
 * Capacity: the pool's size (rounded up to a power of two). An op gets one entry per generation and the
 * writer frees a slot only after taking its entry, so a ring holds at most one live entry per slot; only an
 * op taken out of flight by finalize while its channels were still being reported can leave a stale one.
 * If a ring were ever full, the close goes to the shared ring, and if that is full it is counted
 * (`lost_closes`, added to the ring header's `lost`) and the op stays in flight until finalize writes it as
 * abandoned: nothing is overwritten. The rings are written once at start, so no page is first touched on
 * the event path.
 * `state`: 0 free, 1 owned by a live thread, 2 its thread exited (the writer drains it, then frees it).
 */
#define CI_DONE_RINGS 16
#define CI_ENTRY_INDEX_BITS 19 /* index + 1 of a slot: pools hold at most 262144 = 2^18 slots */
typedef struct ci_done_ring {
    _Alignas(CI_CACHELINE) _Atomic uint32_t state;
    uint32_t tail;                                /* writer only: entries drained */
    _Atomic uint32_t* slots;
    _Atomic uint64_t next;                        /* the shared ring only: next position to claim */
} ci_done_ring;

typedef struct ci_pool {
    /* read by every producer, written only at init: a line of its own */
    _Alignas(CI_CACHELINE) ci_op* ops;
    uint32_t size, per_shard, ring_mask;
    _Atomic uint64_t lost_closes; /* closes that found every ring full (see ci_done_ring) */
    ci_done_ring rings[CI_DONE_RINGS + 1];
    ci_shard_lists lists[CI_SHARDS];
    /* writer side only: batch of frees per shard (index + 1), pushed as one chain per cycle */
    _Alignas(CI_CACHELINE) uint32_t chain_top[CI_SHARDS];
    uint32_t chain_bottom[CI_SHARDS];
    /* writer side only: entries of ops whose channel side closed before their enqueue's stopEvent came */
    uint32_t* waiting;
    uint32_t n_waiting;
    uint32_t* drained;           /* index + 1 of the ops one drain completed, in order */
} ci_pool;
int ci_pool_init(ci_pool* p, uint32_t size);   /* 0, or -1 on allocation failure */
void ci_pool_free(ci_pool* p);
/* Takes up to `max` free slot indices for one thread's private cache, from `shard` first, with one CAS;
   returns how many (0 when every shard is empty). Order: the first index is the one to use first. */
uint32_t ci_pool_alloc_batch(ci_pool* p, unsigned shard, uint32_t* out, uint32_t max);
void ci_pool_give_back(ci_pool* p, uint32_t idx); /* a cached, unused slot back to its home shard */
void ci_pool_prefetch(const ci_pool* p, uint32_t idx); /* the lines the event path writes, for writing */
/* A free completion ring for the calling thread, or NULL when all are taken (then it uses the shared one). */
ci_done_ring* ci_pool_ring_claim(ci_pool* p);
void ci_pool_ring_leave(ci_done_ring* r); /* the owning thread exits: the writer frees the ring once drained */
void ci_pool_push_shared(ci_pool* p, uint32_t entry); /* the shared ring: one fetch_add */
/* Writer: every entry of ring `ring` written so far, in order, to fn; frees a ring whose thread left. */
void ci_pool_drain_ring(ci_pool* p, unsigned ring, void (*fn)(void* arg, uint32_t entry), void* arg);

static inline uint32_t ci_done_entry(const ci_op* op, uint32_t gen) {
    return (gen << CI_ENTRY_INDEX_BITS) | (op->index + 1);
}
static inline uint32_t ci_entry_index(uint32_t entry) { return (entry & ((1u << CI_ENTRY_INDEX_BITS) - 1)) - 1; }
static inline int ci_entry_gen_matches(uint32_t entry, uint32_t gen) {
    return (entry >> CI_ENTRY_INDEX_BITS) == (gen & ((1u << (32 - CI_ENTRY_INDEX_BITS)) - 1));
}

/* Event path: the owning thread's entry at its position `pos`; 0 when that entry is still taken (full). */
static inline int ci_done_ring_push(ci_done_ring* r, uint32_t pos, uint32_t mask, uint32_t entry) {
    _Atomic uint32_t* e = &r->slots[pos & mask];
    if (__builtin_expect(atomic_load_explicit(e, memory_order_relaxed) != 0, 0)) return 0;
    /* release: the op's fields written by this thread are visible to the writer that reads the entry */
    atomic_store_explicit(e, entry, memory_order_release);
    return 1;
}
void ci_pool_release(ci_pool* p, ci_op* op);      /* writer side: queued for its home shard */
void ci_pool_flush_frees(ci_pool* p);             /* writer side: one CAS per shard for all queued frees */

/*
 * Copies a descriptor name into a slot's field of `cap` bytes (16 or 24) on the event path. On x86-64 a
 * name whose `cap`-byte window lies inside one page is copied as whole 8-byte words without looking for
 * its end (the same page-confined over-read libc's string functions do, so it never faults): the field
 * then holds the name, its NUL when the name is shorter, and possibly bytes that followed it in the
 * caller's memory, which every reader ignores (they stop at the NUL or the field's end). Otherwise, and on
 * other architectures, it is ci_copy_str. About 8 instructions instead of two libc calls.
 */
void ci_copy_str(char* dst, size_t cap, const char* src);
typedef uint64_t ci_word_u __attribute__((may_alias, aligned(1)));
/* the over-read is deliberate and page-confined (above): the sanitizers are told not to check it */
static inline __attribute__((no_sanitize_address, no_sanitize_thread)) void ci_name_copy_words(char* dst,
                                                                                                 const char* src,
                                                                                                 size_t cap) {
    for (size_t i = 0; i < cap; i += 8) *(ci_word_u*)(dst + i) = *(const ci_word_u*)(src + i);
}
static inline void ci_name_copy(char* dst, size_t cap, const char* src) {
#if defined(__x86_64__)
    if (__builtin_expect(src != NULL && ((uintptr_t)src & 4095u) <= 4096u - cap, 1)) {
        ci_name_copy_words(dst, src, cap);
        return;
    }
#endif
    ci_copy_str(dst, cap, src);
}

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
