/*
 * plugin.c - event handling and the exported NCCL profiler ABI tables.
 *
 * The process-wide runtime (pool, completion lists, writer) is created at the first
 * init and torn down at the last finalize, so NCCL may unload and reload
 * the library in one process. Event path: a Coll/P2p start takes a slot
 * from the pool (per-thread shard), children (KernelCh, ProxyOp) get the
 * parent's address with a tag in the low bits as handle, CollApi/P2pApi get
 * the stream itself (tagged in the top bits) as handle, every other type a
 * NULL handle. Handles carry 6 bits of the slot's generation, so a handle
 * kept past its op's end (a late child, a stale stop) is rejected once the
 * op left flight or the slot serves another op. A start writes one cache line
 * of its slot (the enqueue side; the four names become one name-set id,
 * names.c), the thread reporting the children another (the channel side, set
 * up at its first child). Completion needs no locked operation: an op is
 * complete when its channel side closed (every kernel channel announced in
 * the descriptor's nChannels, as NVIDIA's inspector plugin decides, and every
 * other child that started, stopped) and its enqueue's stopEvent came. The
 * thread that reports the children (NCCL's proxy thread) counts them in
 * fields only it writes, and when it closes the channel side it tells the
 * writer with one entry on its own completion ring (pool.c); the enqueuing
 * thread's stopEvent only stores its tick. The writer, which reads both,
 * completes the op, or waits for the stopEvent when the kernel finished
 * first. Ops that announce no channel keep the older protocol (a `refs`
 * count, one fetch_sub per closed part). No lock, syscall, allocation or
 * wait on that path; an empty pool drops and counts.
 * The exported tables (v5, v4) are the last thing in this file.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ci_internal.h"

#define CI_EXPORT __attribute__((visibility("default")))

#define TAG_MASK   ((uintptr_t)3)
#define TAG_KCH    ((uintptr_t)1)
#define TAG_PROXY  ((uintptr_t)2)
#define API_TAG    ((uintptr_t)0xAull << 60)
#define API_MASK   ((uintptr_t)0xFull << 60)

#define MASK_V5 (ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh | ncclProfileCollApi | ncclProfileP2pApi)
#define MASK_V4 (ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh)

/*
 * This thread's state, one initial-exec thread-local: an access is one %fs-relative load from one address
 * the function computes once, where the default model of a shared library calls __tls_get_addr (2-3 calls per
 * event before) and separate variables each load their own offset. About 100 bytes of the static TLS space
 * glibc reserves for libraries loaded later (dlopen), far below its surplus.
 *
 * Slot cache: a thread takes a batch of free slots (up to CI_BATCH) with one CAS and uses them without any
 * shared write, so allocation costs a locked operation once per batch, not once per operation. The cache
 * belongs to one runtime (generation); a thread that exits gives its unused slots back (key destructor),
 * so threads that come and go with communicators do not drain the pool.
 * Completion ring (see ci_done_ring): claimed at its first close in a runtime, with its position in it; NULL
 * with ring_gen current: none was free, this thread uses the shared ring.
 */
#define CI_TLS __thread __attribute__((tls_model("initial-exec")))
#define CI_TLS_SLOTS CI_BATCH
typedef struct ci_thread {
    uint32_t gen;                 /* runtime generation of the slot cache */
    uint32_t n;                   /* cached slots */
    uint32_t slots[CI_TLS_SLOTS]; /* popped from the end */
    int32_t shard;                /* -1 until this thread's first event */
    int32_t tid;
    uint32_t ring_gen, ring_pos;
    _Atomic uint32_t* ring_slots; /* ring->slots, kept here: the ring's own line is the writer's */
    ci_done_ring* ring;
    uint32_t gpu_completions;
    uint32_t registered;          /* generation whose key holds this thread's destructor */
} ci_thread;
static CI_TLS ci_thread T = {.shard = -1};

ci_runtime* ci_rt;
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_live_comms;
static ci_comm* g_comms;
static _Atomic unsigned g_next_shard;
/* created at runtime start and deleted at its stop (under g_init_lock), so no destructor of ours runs
   after NCCL unloads the library */
static pthread_key_t g_tls_key;
static int g_tls_key_ok;
static uint32_t g_generation;

/* ---------------- event path ---------------- */

static inline unsigned my_shard(void) {
    if (__builtin_expect(T.shard < 0, 0)) {
        /* first event of this thread: one counter bump and one gettid, never again */
        T.shard = (int)(atomic_fetch_add_explicit(&g_next_shard, 1, memory_order_relaxed) % CI_SHARDS);
        T.tid = (int32_t)ci_gettid();
    }
    return (unsigned)T.shard;
}

/* Handle bits below the 256-byte slot address: 2 tag bits (the op itself, a KernelCh, a ProxyOp child), then
   6 bits of the op's generation. */
#define GEN_SHIFT 2
#define GEN_MASK  ((uintptr_t)63)
#define SLOT_LOW  ((uintptr_t)sizeof(ci_op) - 1)

static inline uintptr_t op_handle(const ci_op* op, uint32_t gen) {
    return (uintptr_t)op | (((uintptr_t)gen & GEN_MASK) << GEN_SHIFT);
}

/* The op a handle names while it is in flight, or NULL: only our own slots are dereferenced (NULL, API handles
   and foreign pointers are rejected), a handle of an earlier op of the slot (generation differs) is stale, and
   an op the writer completed or finalize took out of flight takes no more events. `*gen` gets its generation.
   acquire: pairs with the release that published the op, so its enqueue side is visible. */
static inline ci_op* handle_op(const ci_runtime* rt, uintptr_t v, uint32_t* gen) {
    uintptr_t off = v - rt->pool_base;
    if (off >= rt->pool_bytes) return NULL;
    ci_op* op = (ci_op*)(rt->pool_base + (off & ~SLOT_LOW));
    uint32_t sg = atomic_load_explicit(&op->sg, memory_order_acquire);
    if ((((v >> GEN_SHIFT) ^ CI_SG_GEN(sg)) & GEN_MASK) != 0 || CI_SG_STATE(sg) != CI_SLOT_INFLIGHT) return NULL;
    *gen = CI_SG_GEN(sg);
    return op;
}

/* Threads inside tls_give_back: the last finalize waits for them to leave before it returns, since NCCL
   may dlclose the library right after (a thread that began exiting before the key was deleted can be
   waiting for g_init_lock in here while finalize holds it; unmapping the code under it crashed the process). */
static _Atomic int g_exits_in_progress;

static void tls_give_back(void* unused) {
    (void)unused;
    atomic_fetch_add_explicit(&g_exits_in_progress, 1, memory_order_relaxed);
    pthread_mutex_lock(&g_init_lock);
    if (ci_rt != NULL && T.gen == ci_rt->generation) {
        /* the cache pops from its end: the next slot it would have used heads the batch */
        uint32_t back[CI_TLS_SLOTS];
        for (uint32_t i = 0; i < T.n; i++) back[i] = T.slots[T.n - 1 - i];
        ci_pool_give_back(&ci_rt->pool, back, T.n);
    }
    T.n = 0;
    if (ci_rt != NULL && T.ring_gen == ci_rt->generation && T.ring != NULL) ci_pool_ring_leave(T.ring);
    T.ring = NULL;
    pthread_mutex_unlock(&g_init_lock);
    /* release: this thread is done with the library's data; only the return below is left */
    atomic_fetch_sub_explicit(&g_exits_in_progress, 1, memory_order_release);
}


/* Makes sure this thread's exit runs tls_give_back for the current runtime. */
static inline void tls_register(const ci_runtime* rt) {
    if (T.registered != rt->generation) {
        T.registered = rt->generation;
        if (g_tls_key_ok) pthread_setspecific(g_tls_key, &T.registered);
    }
}

/*
 * How many operations ahead a slot's lines are prefetched for writing (a slot last touched by the writer, or
 * by nobody for a while, comes back from another core's cache or from memory). Tunable at build time for
 * measurements: 4 ahead was tried on the H200 host and was no better than 1 (docs/profiler.md).
 */
#ifndef CI_PREFETCH_AHEAD
#define CI_PREFETCH_AHEAD 1
#endif

/* Refills this thread's cache; returns a slot, or NULL when the pool is empty. Off the common path. */
static __attribute__((noinline)) ci_op* slot_refill(ci_runtime* rt, unsigned shard) {
    if (T.gen != rt->generation) {
        T.n = 0; /* slots of an earlier runtime's pool: that pool is gone */
        T.gen = rt->generation;
    }
    tls_register(rt);
    uint32_t got[CI_TLS_SLOTS];
    uint32_t n = ci_pool_alloc_batch(&rt->pool, shard, got);
    if (n == 0) return NULL;
    /* the cache pops from its end: store reversed so slots are used in the order the stack gave them */
    for (uint32_t i = 1; i < n; i++) T.slots[n - 1 - i] = got[i];
    T.n = n - 1;
    /* the next CI_PREFETCH_AHEAD slots now; slot_take keeps the same lead from here on (0: none) */
    for (uint32_t i = 1; i < n && i <= CI_PREFETCH_AHEAD; i++) ci_pool_prefetch(&rt->pool, got[i]);
    return &rt->pool.ops[got[0]];
}

static inline ci_op* slot_take(ci_runtime* rt, unsigned shard) {
    if (__builtin_expect(T.n == 0 || T.gen != rt->generation, 0)) return slot_refill(rt, shard);
    ci_op* op = &rt->pool.ops[T.slots[--T.n]];
    /* the slot CI_PREFETCH_AHEAD operations from now comes back while these operations run */
#if CI_PREFETCH_AHEAD > 0
    if (T.n >= CI_PREFETCH_AHEAD) ci_pool_prefetch(&rt->pool, T.slots[T.n - CI_PREFETCH_AHEAD]);
#endif
    return op;
}

/* The bucket the four names' pointers choose in the name-set table. */
static inline uint64_t names_hash(const char* func, const char* dtype, const char* algo, const char* proto) {
    uint64_t h = ((uintptr_t)func ^ ((uintptr_t)dtype << 7) ^ ((uintptr_t)algo << 14) ^ ((uintptr_t)proto << 21)) *
                 0x9E3779B97F4A7C15ull;
    return h >> (64 - CI_NAMES_BITS);
}

/* Off the common path: names matched by content, inserted, or copied into the slot (ci_names_find). */
static __attribute__((noinline)) void op_names_slow(ci_runtime* rt, ci_op* op, const char* func, const char* dtype,
                                                    const char* algo, const char* proto, uint64_t h) {
    const char* p[4] = {func, dtype, algo, proto};
    uint64_t w[CI_NAME_WORDS];
    uint32_t id = ci_names_find(&rt->names, p, w, h);
    op->names = (uint16_t)id;
    if (id == CI_NAMES_INLINE) {
        memcpy(op->func, w, 24);
        memcpy(op->dtype, w + 3, 16);
        memcpy(op->algo, w + 5, 16);
        memcpy(op->proto, w + 7, 16);
    }
}

/* The op's names: the id of the name set holding exactly their windows, else copied into the slot. Common case
   (NCCL's names are string literals): the entry their pointers choose, matched by those pointers. */
static inline void op_names(ci_runtime* rt, ci_op* op, const char* func, const char* dtype, const char* algo,
                            const char* proto) {
    uint64_t h = names_hash(func, dtype, algo, proto);
    const ci_nameset* e = &rt->names_set[h];
    /* acquire: pairs with the insert's release, so a ready entry's pointers are the final ones */
    if (__builtin_expect(atomic_load_explicit(&e->ready, memory_order_acquire) == CI_NAMES_BY_POINTER &&
                             ((e->p[0] == func) & (e->p[1] == dtype) & (e->p[2] == algo) & (e->p[3] == proto)),
                         1)) {
        op->names = (uint16_t)h;
        return;
    }
    op_names_slow(rt, op, func, dtype, algo, proto, h);
}

/* The channel side's fields for op generation `gen` with its first child (`tag`, KernelCh start `ptimer`)
   counted, or none (tag 0). Ops with announced channels: written by the reporting thread at that child; ops
   without: by their start, since several threads may then count parts. */
static inline void channel_side_init(ci_op* op, uint32_t gen, uintptr_t tag, uint64_t ptimer) {
    atomic_store_explicit(&op->kch_started, tag == TAG_KCH, memory_order_relaxed);
    atomic_store_explicit(&op->children_started, tag != 0, memory_order_relaxed);
    atomic_store_explicit(&op->children_stopped, 0, memory_order_relaxed);
    atomic_store_explicit(&op->c_closed, 0, memory_order_relaxed);
    atomic_store_explicit(&op->from_gpu, 0, memory_order_relaxed);
    atomic_store_explicit(&op->gpu_start, tag == TAG_KCH && ptimer != 0 ? ptimer : UINT64_MAX, memory_order_relaxed);
    atomic_store_explicit(&op->gpu_end, 0, memory_order_relaxed);
    /* t_complete is written when the side closes, and read only then */
    /* release: readers that see c_gen see the fields above set up */
    atomic_store_explicit(&op->c_gen, gen, memory_order_release);
}

static inline __attribute__((always_inline)) void* op_start(ci_comm* comm, const void* parent, uint8_t kind, uint64_t seq, const char* func,
                             uint64_t count, int32_t peer, const char* dtype, uint8_t nch, const char* algo,
                             const char* proto) {
    ci_runtime* rt = ci_rt;
    unsigned shard = my_shard();
    ci_op* op = slot_take(rt, shard);
    if (__builtin_expect(op == NULL, 0)) {
        atomic_fetch_add_explicit(&rt->shards[shard].lost, 1, memory_order_relaxed);
        return NULL;
    }
    /* the slot is this thread's alone until `sg` below publishes it; only its enqueue side (one line) is
       written here */
    uint32_t gen = CI_SG_GEN(atomic_load_explicit(&op->sg, memory_order_relaxed)) + 1;
    atomic_store_explicit(&op->t_start, ci_ticks(), memory_order_relaxed);
    atomic_store_explicit(&op->t_stop, 0, memory_order_relaxed);
    op->comm = comm;
    op->seq = seq;
    op->count = count;
    op->peer = peer;
    op->n_channels = nch;
    op->tid = T.tid;
    uintptr_t pv = (uintptr_t)parent;
    if ((pv & API_MASK) == API_TAG) {
        op->stream = pv & ~API_MASK;
        op->kind = kind | CI_OPK_API_STREAM;
    } else {
        op->stream = 0;
        op->kind = kind;
    }
    op_names(rt, op, func, dtype, algo, proto);
    if (__builtin_expect(nch == 0, 0)) {
        /* only ops without announced channels count parts in refs: the op itself until its stopEvent */
        atomic_store_explicit(&op->refs, 1, memory_order_relaxed);
        channel_side_init(op, gen, 0, 0);
    }
    /* release: the slot's fields are visible to the hang scan and the child reporter before they read INFLIGHT */
    atomic_store_explicit(&op->sg, CI_SG(gen, CI_SLOT_INFLIGHT), memory_order_release);
    return (void*)op_handle(op, gen);
}

/*
 * Completion time without a host clock read where the GPU already said when the op ended: one GPU-timed
 * close in CI_GPU_SAMPLE per thread reads the host clock, which gives the writer the GPU -> host
 * offset; the others are marked from_gpu and converted by the writer. When the enqueue's stopEvent
 * closes the op, its own stop tick is the completion time (the writer takes the later of the two).
 */
#define CI_GPU_SAMPLE 16

/* First close of this thread in this runtime: claim a completion ring. Off the common path. */
static __attribute__((noinline)) void ring_claim(ci_runtime* rt) {
    T.ring_gen = rt->generation;
    T.ring_pos = 0;
    T.ring = ci_pool_ring_claim(&rt->pool);
    T.ring_slots = T.ring != NULL ? T.ring->slots : NULL;
    if (T.ring != NULL) tls_register(rt); /* the ring is handed back when this thread exits */
}

/* notify_writer off the common path: this thread's first close in this runtime, or no ring of its own. */
static __attribute__((noinline)) void notify_writer_slow(ci_runtime* rt, uint32_t entry) {
    if (T.ring_gen != rt->generation) ring_claim(rt);
    if (T.ring != NULL && ci_done_ring_push(T.ring_slots, T.ring_pos, rt->pool.ring_mask, entry)) {
        T.ring_pos++;
        return;
    }
    ci_pool_push_shared(&rt->pool, entry); /* no ring of its own (or it is full): one fetch_add */
}

/* Tells the writer that this thread closed `op` (its channel side, or its last part). */
static inline void notify_writer(ci_runtime* rt, ci_op* op, uint32_t gen) {
    uint32_t entry = ci_done_entry(ci_op_index(&rt->pool, op), gen);
    if (__builtin_expect(T.ring_gen == rt->generation && T.ring_slots != NULL, 1) &&
        ci_done_ring_push(T.ring_slots, T.ring_pos, rt->pool.ring_mask, entry)) {
        /* entering a new line of entries (16 a line): ask for the next one, which the writer last zeroed */
        if ((++T.ring_pos & 15) == 0) ci_prefetch_for_write(&T.ring_slots[(T.ring_pos + 16) & rt->pool.ring_mask]);
        return;
    }
    notify_writer_slow(rt, entry);
}

/* The closing thread's completion time: `closing_tick` when it just read one, else from the GPU or the host. */
static inline void close_time(ci_op* op, uint64_t closing_tick) {
    if (closing_tick == 0 && atomic_load_explicit(&op->gpu_end, memory_order_relaxed) != 0 &&
        T.gpu_completions++ % CI_GPU_SAMPLE != 0) {
        atomic_store_explicit(&op->from_gpu, 1, memory_order_relaxed);
    } else {
        atomic_store_explicit(&op->from_gpu, 0, memory_order_relaxed);
        atomic_store_explicit(&op->t_complete, closing_tick != 0 ? closing_tick : ci_ticks(), memory_order_relaxed);
    }
}

/* Ops without announced channels: `closing_tick`, the tick the caller just read (the enqueue's stop), 0 for a child. */
static __attribute__((noinline)) void refs_release(ci_runtime* rt, ci_op* op, uint32_t gen, uint64_t closing_tick) {
    /* acq_rel: the last part to close sees every other part's writes (t_stop, GPU times). Exactly one thread
       sees the count reach zero, and CI_REFS_DONE (set by finalize when it abandons the op first) vetoes it */
    uint64_t old = atomic_fetch_sub_explicit(&op->refs, 1, memory_order_acq_rel);
    if ((uint32_t)old == 1 && !(old & CI_REFS_DONE)) {
        close_time(op, closing_tick);
        notify_writer(rt, op, gen);
    }
}

static inline __attribute__((always_inline)) void* child_start(const void* parent, uintptr_t tag, uint64_t ptimer) {
    ci_runtime* rt = ci_rt;
    uintptr_t v = (uintptr_t)parent;
    if ((v & TAG_MASK) != 0) return NULL; /* only an op's own handle is a parent (API handles fail handle_op) */
    uint32_t gen;
    ci_op* op = handle_op(rt, v, &gen);
    if (op == NULL) return NULL;
    if (__builtin_expect(op->n_channels != 0, 1)) {
        /* the first child of this op sets its channel side up (this thread reports all of the op's children) */
        if (atomic_load_explicit(&op->c_gen, memory_order_relaxed) != gen) {
            channel_side_init(op, gen, tag, ptimer);
            return (void*)(v | tag);
        }
        /* the channel side already closed (a child NCCL did not announce, arriving late): ignore it */
        if (atomic_load_explicit(&op->c_closed, memory_order_relaxed)) return NULL;
    } else {
        uint64_t old = atomic_load_explicit(&op->refs, memory_order_relaxed);
        do {
            /* completed or abandoned already: ignore it */
            if ((uint32_t)old == 0 || (old & CI_REFS_DONE)) return NULL;
        } while (!atomic_compare_exchange_weak_explicit(&op->refs, &old, old + 1, memory_order_acq_rel,
                                                        memory_order_relaxed));
    }
    /* counters only this (the reporting) thread writes: a relaxed load and store, no locked operation */
    atomic_store_explicit(&op->children_started,
                          (uint16_t)(atomic_load_explicit(&op->children_started, memory_order_relaxed) + 1),
                          memory_order_relaxed);
    if (tag == TAG_KCH) {
        atomic_store_explicit(&op->kch_started,
                              (uint16_t)(atomic_load_explicit(&op->kch_started, memory_order_relaxed) + 1),
                              memory_order_relaxed);
        if (ptimer != 0 && ptimer < atomic_load_explicit(&op->gpu_start, memory_order_relaxed))
            atomic_store_explicit(&op->gpu_start, ptimer, memory_order_relaxed);
    }
    return (void*)(v | tag);
}

static inline void* api_handle(const void* stream) {
    /* the stream itself is the handle: its children read it back, nothing to allocate or free */
    return (void*)(((uintptr_t)stream & ~API_MASK) | API_TAG);
}

static ncclResult_t ci_stop(void* handle) {
    uintptr_t v = (uintptr_t)handle;
    ci_runtime* rt = ci_rt;
    uint32_t gen;
    ci_op* op;
    /* NULL and API handles lie outside the pool: handle_op rejects them */
    if (__builtin_expect(rt == NULL, 0) || (op = handle_op(rt, v, &gen)) == NULL) return 0;
    if ((v & TAG_MASK) == 0) {
        /* the enqueue ended: its tick is all it writes (release: the writer that sees it sees the op) */
        uint64_t t = ci_ticks();
        if (__builtin_expect(op->n_channels != 0, 1)) {
            atomic_store_explicit(&op->t_stop, t, memory_order_release);
        } else {
            atomic_store_explicit(&op->t_stop, t, memory_order_relaxed);
            refs_release(rt, op, gen, t);
        }
        return 0;
    }
    uint16_t stopped = (uint16_t)(atomic_load_explicit(&op->children_stopped, memory_order_relaxed) + 1);
    atomic_store_explicit(&op->children_stopped, stopped, memory_order_relaxed);
    if (__builtin_expect(op->n_channels == 0, 0)) {
        refs_release(rt, op, gen, 0);
        return 0;
    }
    /* the channel side closes when every announced channel started and every child that started stopped */
    if (stopped == atomic_load_explicit(&op->children_started, memory_order_relaxed) &&
        atomic_load_explicit(&op->kch_started, memory_order_relaxed) >= op->n_channels) {
        atomic_store_explicit(&op->c_closed, 1, memory_order_relaxed);
        close_time(op, 0);
        notify_writer(rt, op, gen);
    }
    return 0;
}

static ncclResult_t ci_record_state(void* handle, int state, const ncclProfilerEventStateArgs_v5_t* args) {
    uintptr_t v = (uintptr_t)handle;
    ci_runtime* rt = ci_rt;
    if ((v & TAG_MASK) != TAG_KCH || state != ncclProfilerKernelChStop || args == NULL || rt == NULL) return 0;
    uint32_t gen;
    ci_op* op = handle_op(rt, v, &gen); /* API handles lie outside the pool */
    if (op == NULL) return 0;
    uint64_t t = args->kernelCh.pTimer;
    /* max without a locked CAS: only the reporting thread writes it */
    if (t > atomic_load_explicit(&op->gpu_end, memory_order_relaxed))
        atomic_store_explicit(&op->gpu_end, t, memory_order_relaxed);
    return 0;
}

static inline uint64_t p2p_seq(ci_comm* c, const char* func, int peer) {
    int dir = (func != NULL && func[0] == 'R') ? 1 : 0; /* "Recv" vs "Send" */
    _Atomic uint64_t* ctr =
        (c->p2p_seq != NULL && peer >= 0 && peer < c->nranks) ? &c->p2p_seq[dir * c->nranks + peer] : &c->p2p_seq_other[dir];
    return atomic_fetch_add_explicit(ctr, 1, memory_order_relaxed);
}

/* ---------------- init / finalize ---------------- */

static int cuda_device_guess(void) {
    const char* lr = getenv("LOCAL_RANK");
    const char* cvd = getenv("CUDA_VISIBLE_DEVICES");
    int local = (lr != NULL && *lr != '\0') ? atoi(lr) : -1;
    if (cvd != NULL && *cvd != '\0') {
        /* the device this process uses is entry LOCAL_RANK of the list (or the only entry) */
        int entries = 1;
        for (const char* p = cvd; *p; p++) entries += (*p == ',');
        int want = entries == 1 ? 0 : local;
        if (want < 0 || want >= entries) return -1;
        const char* p = cvd;
        for (int i = 0; i < want; i++) p = strchr(p, ',') + 1;
        char* end = NULL;
        long v = strtol(p, &end, 10);
        return (end != p && (*end == ',' || *end == '\0')) ? (int)v : -1;
    }
    return local;
}

static void fill_log_header(ci_runtime* rt, ci_log_header* h) {
    memset(h, 0, sizeof(*h));
    h->pid = rt->pid;
    const char* v;
    h->local_rank = (v = getenv("LOCAL_RANK")) != NULL && *v ? atoi(v) : -1;
    h->global_rank = (v = getenv("RANK")) != NULL && *v ? atoi(v) : -1;
    h->world_size = (v = getenv("WORLD_SIZE")) != NULL && *v ? atoi(v) : -1;
    ci_copy_str(h->host, sizeof(h->host), rt->host);
    ci_copy_str(h->workload_id, sizeof(h->workload_id), rt->cfg.workload_id);
    v = getenv("NODE_IP");
    if (v == NULL || *v == '\0') v = getenv("HOST_IP");
    ci_copy_str(h->node_ip, sizeof(h->node_ip), v);
}

/* Creates the runtime; returns 0, or -1 when memory is short (then every communicator opts out). */
static int runtime_start(void) {
    ci_runtime* rt = NULL;
    if (posix_memalign((void**)&rt, CI_CACHELINE, sizeof(*rt)) != 0) return -1;
    memset(rt, 0, sizeof(*rt));
    ci_config_load(&rt->cfg);
    if (ci_pool_init(&rt->pool, rt->cfg.pool_size) != 0 || ci_names_init(&rt->names) != 0) goto fail;
    rt->names_set = rt->names.set;
    rt->generation = ++g_generation; /* under g_init_lock */
    g_tls_key_ok = pthread_key_create(&g_tls_key, tls_give_back) == 0;
    rt->pool_base = (uintptr_t)rt->pool.ops;
    rt->pool_bytes = (uintptr_t)rt->pool.size * sizeof(ci_op);
    rt->pid = (int32_t)getpid();
    rt->cuda_device = cuda_device_guess();
    if (gethostname(rt->host, sizeof(rt->host) - 1) != 0) ci_copy_str(rt->host, sizeof(rt->host), "unknown");
    rt->start_ns = ci_realtime_ns();
    pthread_mutex_init(&rt->out_lock, NULL);
    ci_clock_select(rt->cfg.clock);
    ci_clock_calibrate(&rt->clock);

    char dir[CI_PATH_MAX + 32];
    snprintf(dir, sizeof(dir), "%s/hang_detection", rt->cfg.home);
    if (ci_mkdirs(dir) != 0) ci_warn("cannot create %s: hang evidence is not written", dir);
    if (rt->cfg.ring_enable) {
        snprintf(dir, sizeof(dir), "%s/shms", rt->cfg.home);
        if (ci_mkdirs(dir) != 0 || ci_ring_open(&rt->ring, dir, rt->cfg.ring_capacity, rt->host, rt->start_ns) != 0)
            ci_warn("cannot create the shared-memory ring under %s: the agent sees nothing live (raw logs go on)", dir);
        else
            rt->ring_ok = 1;
    }
    snprintf(dir, sizeof(dir), "%s/inspector_logs", rt->cfg.home);
    ci_log_header proto;
    fill_log_header(rt, &proto);
    ci_segment_init(&rt->seg, dir, rt->cfg.log_segment_bytes, rt->cfg.log_segment_age_s, rt->start_ns, &proto);
    if (rt->cfg.log_enable && ci_mkdirs(dir) != 0) {
        ci_warn("cannot create %s: raw logs are not written (records are counted as lost)", dir);
        rt->seg.failed = 1;
    }
    ci_rt = rt;
    ci_writer_start(rt);
    return 0;
fail:
    ci_pool_free(&rt->pool);
    ci_names_free(&rt->names);
    free(rt);
    ci_warn("cannot allocate the event pool: profiling is off for this process");
    return -1;
}

static void runtime_stop(void) {
    ci_runtime* rt = ci_rt;
    if (rt == NULL) return;
    ci_writer_stop(rt);
    if (g_tls_key_ok) pthread_key_delete(g_tls_key); /* threads' cached slots die with the pool below */
    g_tls_key_ok = 0;
    ci_rt = NULL;
    ci_pool_free(&rt->pool);
    ci_names_free(&rt->names);
    pthread_mutex_destroy(&rt->out_lock);
    free(rt);
    while (g_comms != NULL) {
        ci_comm* c = g_comms;
        g_comms = c->next;
        free(c->p2p_seq);
        free(c);
    }
}

static ncclResult_t ci_init(void** ctx, int abi, uint64_t comm_hash, int* mask, const char* name, int nnodes,
                            int nranks, int rank, ncclDebugLogger_t logfn) {
    if (ctx == NULL) return 0;
    *ctx = NULL;
    if (logfn != NULL) ci_log_set_logger(logfn);
    pthread_mutex_lock(&g_init_lock);
    if (g_live_comms == 0 && ci_rt == NULL && runtime_start() != 0) goto out;
    ci_comm* c = calloc(1, sizeof(*c));
    if (c == NULL) goto out;
    c->comm_hash = comm_hash;
    ci_copy_str(c->name, sizeof(c->name), name); /* NCCL keeps the caller's pointer: copy it */
    c->rank = rank;
    c->nranks = nranks;
    c->nnodes = nnodes;
    c->abi = abi;
    if (nranks > 0 && nranks <= (1 << 20)) c->p2p_seq = calloc(2 * (size_t)nranks, sizeof(uint64_t));
    c->next = g_comms;
    g_comms = c;
    g_live_comms++;
    if (mask != NULL) *mask = abi == 5 ? MASK_V5 : MASK_V4;
    ci_autostart_agent(&ci_rt->cfg);
    *ctx = c;
out:
    pthread_mutex_unlock(&g_init_lock);
    return 0;
}

static ncclResult_t ci_finalize(void* ctx) {
    if (ctx == NULL) return 0;
    pthread_mutex_lock(&g_init_lock);
    if (ci_rt != NULL) ci_writer_finalize_comm(ci_rt, (ci_comm*)ctx);
    int last = 0;
    if (--g_live_comms <= 0) {
        g_live_comms = 0;
        runtime_stop(); /* joins the writer: NCCL may dlclose us next */
        last = 1;
    }
    pthread_mutex_unlock(&g_init_lock);
    /* the key is deleted, so no thread starts tls_give_back any more; let those already in it leave
       (they only wait for the lock released above) before NCCL can unload the library */
    struct timespec pause = {0, 100000};
    while (last && atomic_load_explicit(&g_exits_in_progress, memory_order_acquire) != 0) nanosleep(&pause, NULL);
    return 0;
}

/* ---------------- event start: one mapping for both ABIs ---------------- */

/* Coll and P2p starts, one pair per ABI (their descriptor types differ, the members read keep the same names):
   functions of their own, so the child events' path in startEvent stays short. */
#define CI_DEFINE_OP_STARTS(V, DESCR)                                                                              \
    static __attribute__((noinline)) void* coll_start_##V(ci_comm* c, const DESCR* d) {                            \
        return op_start(c, d->parentObj, CI_KIND_COLL, d->coll.seqNumber, d->coll.func, d->coll.count,            \
                        d->coll.root, d->coll.datatype, d->coll.nChannels, d->coll.algo, d->coll.proto);           \
    }                                                                                                              \
    static __attribute__((noinline)) void* p2p_start_##V(ci_comm* c, const DESCR* d) {                             \
        return op_start(c, d->parentObj, CI_KIND_P2P, p2p_seq(c, d->p2p.func, d->p2p.peer), d->p2p.func,          \
                        d->p2p.count, d->p2p.peer, d->p2p.datatype, d->p2p.nChannels, NULL, NULL);                 \
    }
CI_DEFINE_OP_STARTS(v5, ncclProfilerEventDescr_v5_t)
CI_DEFINE_OP_STARTS(v4, ncclProfilerEventDescr_v4_t)

/* The events v4 and v5 both deliver, one case list for both startEvent entry points. */
#define CI_START_SHARED_EVENTS(V, c, d, handle)                                                                    \
    case ncclProfileColl: *(handle) = coll_start_##V((c), (d)); break;                                             \
    case ncclProfileP2p: *(handle) = p2p_start_##V((c), (d)); break;                                               \
    case ncclProfileKernelCh: *(handle) = child_start((d)->parentObj, TAG_KCH, (d)->kernelCh.pTimer); break;       \
    case ncclProfileProxyOp: *(handle) = child_start((d)->parentObj, TAG_PROXY, 0); break

/* ---------------- ABI v5 ---------------- */

static ncclResult_t v5_init(void** ctx, uint64_t comm_id, int* mask, const char* name, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t logfn) {
    return ci_init(ctx, 5, comm_id, mask, name, nnodes, nranks, rank, logfn);
}

static ncclResult_t v5_start(void* ctx, void** handle, ncclProfilerEventDescr_v5_t* d) {
    if (handle == NULL) return 0;
    *handle = NULL;
    if (ctx == NULL || d == NULL || ci_rt == NULL) return 0;
    ci_comm* c = ctx;
    switch (d->type) {
    CI_START_SHARED_EVENTS(v5, c, d, handle);
    case ncclProfileCollApi: *handle = api_handle(d->collApi.stream); break;
    case ncclProfileP2pApi: *handle = api_handle(d->p2pApi.stream); break;
    default: break; /* Group, GroupApi, KernelLaunch, ProxyStep, ProxyCtrl, NetPlugin: not needed */
    }
    return 0;
}

static ncclResult_t v5_record(void* handle, int state, ncclProfilerEventStateArgs_v5_t* args) {
    return ci_record_state(handle, state, args);
}

/* ---------------- ABI v4: a shim over the same implementation ---------------- */

static ncclResult_t v4_init(void** ctx, int* mask, const char* name, uint64_t comm_hash, int nnodes, int nranks,
                            int rank, ncclDebugLogger_t logfn) {
    return ci_init(ctx, 4, comm_hash, mask, name, nnodes, nranks, rank, logfn);
}

static ncclResult_t v4_start(void* ctx, void** handle, ncclProfilerEventDescr_v4_t* d) {
    if (handle == NULL) return 0;
    *handle = NULL;
    if (ctx == NULL || d == NULL || ci_rt == NULL) return 0;
    ci_comm* c = ctx;
    switch (d->type) {
    CI_START_SHARED_EVENTS(v4, c, d, handle);
    default: break;
    }
    return 0;
}

static ncclResult_t v4_record(void* handle, int state, ncclProfilerEventStateArgs_v4_t* args) {
    return ci_record_state(handle, state, args);
}

/* ---------------- exported tables: the only visible symbols ---------------- */

CI_EXPORT ncclProfiler_v5_t ncclProfiler_v5 = {"CommInsight", v5_init, v5_start, ci_stop, v5_record, ci_finalize};
CI_EXPORT ncclProfiler_v4_t ncclProfiler_v4 = {"CommInsight", v4_init, v4_start, ci_stop, v4_record, ci_finalize};
