/*
 * ci_internal.h - shared declarations of the CommInsight profiler's modules.
 *
 * Modules (one structure each): pool.c (pre-allocated operation slots, sharded
 * free stacks of batches and completion rings), names.c (name sets: an op's
 * four descriptor names as one id),
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
#include <string.h>
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
/* `sg`: the slot's generation and state in one word, so one release store publishes a new op */
#define CI_SG_STATE(sg) ((sg) & 3u)
#define CI_SG_GEN(sg)   ((sg) >> 2)
#define CI_SG(gen, state) (((gen) << 2) | (state))
/* ci_op.kind: CI_KIND_* in the low bits, and this bit when the stream came from the CollApi/P2pApi parent */
#define CI_OPK_API_STREAM 0x80u
/* ci_op.names: an id in the name-set table (ci_names), or this when the names are copied into the slot */
#define CI_NAMES_INLINE 0xffffu
/* A batch on a free stack: its head slot and up to CI_BATCH - 1 more, listed in the head's free-list line */
#define CI_BATCH 12

/*
 * One operation slot (256 bytes, so a handle's low 8 bits are free: 2 tag bits and 6 bits of the generation).
 * Each line has one writer per phase, so that a thread touches as few lines as it can and no field needs a
 * locked operation on the event path:
 *   - line 0, the enqueue side: written by the enqueuing thread only, at Coll/P2p start (everything, published
 *     by the release store of `sg`) and at its stopEvent (t_stop); the writer marks it DONE in `sg`;
 *   - line 1, the channel side: written by the thread that reports the op's children (NCCL's proxy thread),
 *     which sets it up for the op at its first child (`c_gen`, so the enqueuing thread never writes it), counts
 *     children, keeps gpu_start/gpu_end, closes the channel side and tells the writer;
 *   - lines 2-3: the free-list word and batch while the slot is free (writer, allocator); the names copied
 *     into the slot when the name-set table cannot give them an id (rare); `refs`.
 * The writer decides completion (channel side closed, told through a completion ring, and t_stop set) and
 * frees the slot. Ops that announce no channel (n_channels == 0) keep the older protocol: `refs` counts their
 * open parts and whoever closes the last one (one fetch_sub) tells the writer; their start sets up line 1.
 */
typedef struct __attribute__((aligned(256))) ci_op {
    /* line 0: enqueue side */
    _Atomic uint32_t sg;         /* CI_SG(generation, CI_SLOT_*): bumped by each op start */
    uint16_t names;              /* id in the name-set table, or CI_NAMES_INLINE (func..proto below) */
    uint8_t n_channels;          /* the descriptor's nChannels */
    uint8_t kind;                /* CI_KIND_* | CI_OPK_API_STREAM */
    _Atomic uint64_t t_start;    /* ticks */
    _Atomic uint64_t t_stop;     /* ticks, 0 until stopEvent (the enqueue side closed) */
    ci_comm* comm;
    uint64_t seq, count, stream;
    int32_t peer, tid;
    /* line 1: channel side (children: KernelCh, ProxyOp), relaxed loads and stores by their one reporter */
    _Alignas(CI_CACHELINE) _Atomic uint32_t c_gen; /* the generation these fields belong to; else none seen yet */
    _Atomic uint16_t kch_started;      /* KernelCh children started, announced or not */
    _Atomic uint16_t children_started; /* every child started */
    _Atomic uint16_t children_stopped;
    _Atomic uint8_t c_closed;          /* channel side closed: later children are ignored */
    _Atomic uint8_t from_gpu;          /* completion time = gpu_end on the host clock (CI_FLAG_COMPLETE_FROM_GPU) */
    uint8_t reported;                  /* writer: already written as a timeout snapshot */
    uint8_t snapped;                   /* writer: already put in the ring as CI_STATE_INFLIGHT for the agent */
    _Atomic uint64_t gpu_start;  /* min KernelCh start pTimer, UINT64_MAX unknown */
    _Atomic uint64_t gpu_end;    /* max KernelCh stop pTimer */
    _Atomic uint64_t t_complete; /* ticks, host read when the channel side (or last part) closed, unless from_gpu */
    /* lines 2-3 */
    _Alignas(CI_CACHELINE) _Atomic uint32_t free_word; /* free: (extra slots << 24) | (next batch's head + 1) */
    _Atomic uint32_t batch[CI_BATCH - 1];              /* free: the batch's other slots */
    /* CI_NAMES_INLINE only: the descriptor's names as copied on the event path (8-byte aligned): up to the field's
       size, NOT necessarily NUL-terminated and possibly followed by bytes of whatever followed the source string
       (see ci_name_window); readers copy them with ci_copy_str, which stops at the NUL or the field's end */
    char func[24], dtype[16], algo[16], proto[16];
    _Atomic uint64_t refs;       /* n_channels == 0 only: open parts (low 32 bits), CI_REFS_DONE */
} ci_op;
_Static_assert(sizeof(ci_op) == 256, "handles keep 8 low bits of a slot's address for tags and generation");
_Static_assert(__builtin_offsetof(ci_op, c_gen) == CI_CACHELINE, "the enqueue side fills line 0 exactly");
_Static_assert(__builtin_offsetof(ci_op, free_word) == 2 * CI_CACHELINE, "the channel side within line 1");

/* Writer side: takes an op out of flight (it keeps its generation; the next op start bumps it). */
static inline void ci_op_set_done(ci_op* op) {
    uint32_t sg = atomic_load_explicit(&op->sg, memory_order_relaxed);
    atomic_store_explicit(&op->sg, CI_SG(CI_SG_GEN(sg), CI_SLOT_DONE), memory_order_relaxed);
}
static inline int ci_op_inflight(const ci_op* op) {
    return CI_SG_STATE(atomic_load_explicit(&op->sg, memory_order_acquire)) == CI_SLOT_INFLIGHT;
}

/* A child side's fields as the writer reads them: zeros (and gpu_start unknown) until its first child came. */
typedef struct ci_children {
    uint32_t kch_started, started, stopped;
    uint8_t closed, from_gpu;
    uint64_t gpu_start, gpu_end, t_complete;
} ci_children;
static inline void ci_op_children(const ci_op* op, uint32_t gen, ci_children* c) {
    /* acquire: pairs with the reporter's release of c_gen after it set the fields up for this op. (A slot would
       have to serve 2^30 ops with no child in between for a stale c_gen to match; not a practical concern.) */
    if (atomic_load_explicit(&op->c_gen, memory_order_acquire) != gen) {
        *c = (ci_children){0, 0, 0, 0, 0, UINT64_MAX, 0, 0};
        return;
    }
    c->kch_started = atomic_load_explicit(&op->kch_started, memory_order_relaxed);
    c->started = atomic_load_explicit(&op->children_started, memory_order_relaxed);
    c->stopped = atomic_load_explicit(&op->children_stopped, memory_order_relaxed);
    c->closed = atomic_load_explicit(&op->c_closed, memory_order_relaxed);
    c->from_gpu = atomic_load_explicit(&op->from_gpu, memory_order_relaxed);
    c->gpu_start = atomic_load_explicit(&op->gpu_start, memory_order_relaxed);
    c->gpu_end = atomic_load_explicit(&op->gpu_end, memory_order_relaxed);
    c->t_complete = atomic_load_explicit(&op->t_complete, memory_order_relaxed);
}

/*
 * Name sets: the four descriptor names of an op (func, datatype, algo, proto) as one id, so the enqueue side
 * of a slot fits one line. An entry holds the bytes the event path reads (ci_name_window: each name's 24- or
 * 16-byte window, bytes past its NUL included), so an id always stands for exactly the bytes the slot would
 * have held, and the four pointers, which choose the bucket. Two kinds of entry:
 *   - CI_NAMES_BY_POINTER: every pointer is NULL or its window lies in a read-only segment of an object that
 *     was loaded when the runtime started (NCCL's own name tables: string literals in libnccl), so the bytes
 *     cannot change while the runtime lives (NCCL, which holds this library, stays loaded until its last
 *     finalize tears the runtime down); the event path matches it by the four pointers alone;
 *   - CI_NAMES_BY_CONTENT: any other memory; the event path matches it by the windows' bytes.
 * Entries are filled once (under `lock`, taken with trylock so the event path never waits) and never change;
 * an op whose names find no entry and no free bucket has them copied into its slot (CI_NAMES_INLINE). Nothing
 * is lost either way.
 */
#define CI_NAME_WORDS 9           /* 3 + 2 + 2 + 2 words */
#define CI_NAMES_BITS 10          /* buckets */
#define CI_NAMES_PROBE 8
#define CI_NAMES_RO_RANGES 256    /* read-only segments remembered at start; pointers elsewhere go by content */
enum { CI_NAMES_EMPTY = 0, CI_NAMES_BY_CONTENT = 1, CI_NAMES_BY_POINTER = 2 };
typedef struct __attribute__((aligned(128))) ci_nameset {
    _Atomic uint32_t ready;       /* CI_NAMES_*: set once the entry is filled (release) */
    uint32_t pad;
    const char* p[4];             /* the pointers as the descriptor gave them (NULL included) */
    uint64_t w[CI_NAME_WORDS];    /* the windows (NULL: zeros) */
} ci_nameset;
typedef struct ci_names {
    ci_nameset* set;              /* 1 << CI_NAMES_BITS entries */
    pthread_mutex_t lock;         /* inserts only */
    uint32_t n_ro;
    uintptr_t ro[CI_NAMES_RO_RANGES][2]; /* [start, end) of read-only segments loaded at start */
} ci_names;
int ci_names_init(ci_names* n);   /* 0, or -1 on allocation failure */
void ci_names_free(ci_names* n);
/* Event path, off the common case: the id of the names (an entry matched by content, or inserted), or
   CI_NAMES_INLINE with their windows in w. */
uint32_t ci_names_find(ci_names* n, const char* const* p, uint64_t* w, uint64_t hash);

/* Per shard, on a cache line of its own: the free stack of batches, (tag << 32 | head's index + 1) in one word,
   so a CAS never suffers ABA. A pop reads one line of the head slot (its free word and batch), not a chain. */
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
    /* writer side only: frees per shard gathered into batches (head's index + 1, and how many it lists), then
       pushed as one chain of batches per cycle */
    _Alignas(CI_CACHELINE) uint32_t chain_top[CI_SHARDS];
    uint32_t chain_bottom[CI_SHARDS];
    uint32_t filling[CI_SHARDS];      /* head + 1 of the batch being filled, 0 none */
    uint32_t filling_n[CI_SHARDS];
    /* writer side only: entries of ops whose channel side closed before their enqueue's stopEvent came */
    uint32_t* waiting;
    uint32_t n_waiting;
    uint32_t* drained;           /* index + 1 of the ops one drain completed, in order */
} ci_pool;
int ci_pool_init(ci_pool* p, uint32_t size);   /* 0, or -1 on allocation failure */
void ci_pool_free(ci_pool* p);
/* Takes one batch of free slot indices (at most CI_BATCH) for one thread's private cache, from `shard` first,
   with one CAS; returns how many (0 when every shard is empty). Order: the first index is the one to use first. */
uint32_t ci_pool_alloc_batch(ci_pool* p, unsigned shard, uint32_t* out);
/* A thread's cached, unused slots (one batch's, so of one home shard) back to their shard as one batch. */
void ci_pool_give_back(ci_pool* p, const uint32_t* idx, uint32_t n);
void ci_pool_prefetch(const ci_pool* p, uint32_t idx); /* the lines the event path writes, for writing */
/* A free completion ring for the calling thread, or NULL when all are taken (then it uses the shared one). */
ci_done_ring* ci_pool_ring_claim(ci_pool* p);
void ci_pool_ring_leave(ci_done_ring* r); /* the owning thread exits: the writer frees the ring once drained */
void ci_pool_push_shared(ci_pool* p, uint32_t entry); /* the shared ring: one fetch_add */
/* Writer: every entry of ring `ring` written so far, in order, to fn; frees a ring whose thread left. */
void ci_pool_drain_ring(ci_pool* p, unsigned ring, void (*fn)(void* arg, uint32_t entry), void* arg);

static inline uint32_t ci_op_index(const ci_pool* p, const ci_op* op) { return (uint32_t)(op - p->ops); }
static inline uint32_t ci_done_entry(uint32_t index, uint32_t gen) { return (gen << CI_ENTRY_INDEX_BITS) | (index + 1); }
static inline uint32_t ci_entry_index(uint32_t entry) { return (entry & ((1u << CI_ENTRY_INDEX_BITS) - 1)) - 1; }
static inline int ci_entry_gen_matches(uint32_t entry, uint32_t gen) {
    return (entry >> CI_ENTRY_INDEX_BITS) == (gen & ((1u << (32 - CI_ENTRY_INDEX_BITS)) - 1));
}

/* Event path: the owning thread's entry at its position `pos` of its ring's `slots`; 0 when that entry is still
   taken (full). */
static inline int ci_done_ring_push(_Atomic uint32_t* slots, uint32_t pos, uint32_t mask, uint32_t entry) {
    _Atomic uint32_t* e = &slots[pos & mask];
    if (__builtin_expect(atomic_load_explicit(e, memory_order_relaxed) != 0, 0)) return 0;
    /* release: the op's fields written by this thread are visible to the writer that reads the entry */
    atomic_store_explicit(e, entry, memory_order_release);
    return 1;
}
void ci_pool_release(ci_pool* p, ci_op* op);      /* writer side: queued for its home shard */
void ci_pool_flush_frees(ci_pool* p);             /* writer side: one CAS per shard for all queued frees */

/*
 * Reads a descriptor name as the event path keeps it: the `cap`-byte window (16 or 24) at `src`, into `w`. On
 * x86-64 a window that lies inside one page is read as whole 8-byte words without looking for the name's end
 * (the same page-confined over-read libc's string functions do, so it never faults): it holds the name, its
 * NUL when the name is shorter, and possibly bytes that followed it in the caller's memory, which every reader
 * ignores (they stop at the NUL or the field's end). Otherwise, and on other architectures, it is ci_copy_str
 * (NULL gives an empty name). A few loads instead of two libc calls.
 */
void ci_copy_str(char* dst, size_t cap, const char* src);
typedef uint64_t ci_word_u __attribute__((may_alias, aligned(1)));
/* the over-read is deliberate and page-confined (above): the sanitizers are told not to check it */
static inline __attribute__((no_sanitize_address, no_sanitize_thread)) void ci_name_read_words(uint64_t* w,
                                                                                                 const char* src,
                                                                                                 size_t cap) {
    for (size_t i = 0; i < cap; i += 8) w[i / 8] = *(const ci_word_u*)(src + i);
}
static inline void ci_name_window(uint64_t* w, size_t cap, const char* src) {
#if defined(__x86_64__)
    if (__builtin_expect(src != NULL && ((uintptr_t)src & 4095u) <= 4096u - cap, 1)) {
        ci_name_read_words(w, src, cap);
        return;
    }
#endif
    char buf[24] = {0};
    ci_copy_str(buf, cap, src);
    memcpy(w, buf, cap);
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
    ci_nameset* names_set;       /* names.set: read on every op start */
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
    ci_names names;              /* inserts (event path, off the common case) take its own lock, not out_lock */
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
