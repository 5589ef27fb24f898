/*
 * writer.c - the background writer: drains completed operations into the
 * shared-memory ring and the raw-log segments.
 *
 * The event path only tells this thread which ops closed their channel side
 * (completion rings, pool.c); this thread (started at the first init, joined
 * at the last finalize) wakes every writer_interval_ms, decides which of
 * those ops are complete (their enqueue's stopEvent came too; the others
 * wait on a private list), converts each completed slot into a sealed
 * ci_op_record (tick -> CLOCK_REALTIME ns, checksum), hands it to the sinks,
 * frees the slot and runs the hang scan. out_lock serialises it with
 * finalize, which drains and abandons a communicator's operations itself.
 */
#include <string.h>
#include <unistd.h>

#include "ci_internal.h"

size_t ci_dtype_size(const char* d) {
    /* NCCL's names: ncclInt8 ... ncclFloat64, ncclBfloat16, ncclFloat8e4m3; ncclUint8 arrives as "Unknown" */
    size_t n = strlen(d);
    if (n == 0) return 1;
    if (strcmp(d, "Unknown") == 0) return 1;
    if (n >= 2 && strcmp(d + n - 2, "16") == 0) return 2;
    if (n >= 2 && strcmp(d + n - 2, "32") == 0) return 4;
    if (n >= 2 && strcmp(d + n - 2, "64") == 0) return 8;
    if (strstr(d, "8") != NULL) return 1;
    if (strcmp(d, "ncclHalf") == 0) return 2;
    if (strcmp(d, "ncclDouble") == 0) return 8;
    if (strcmp(d, "ncclFloat") == 0 || strcmp(d, "ncclInt") == 0) return 4;
    return 1;
}

static uint32_t fnv_words(const ci_op_record* r) {
    uint32_t words[CI_RECORD_SIZE / 4];
    memcpy(words, r, sizeof(words));
    words[1] = 0; /* the checksum field counts as zero */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < CI_RECORD_SIZE / 4; i++) h = (h ^ words[i]) * 16777619u;
    return h;
}

#define CI_GPU_OFFSET_WINDOW_NS 5000000000ull

/* One (host completion - GPU end) sample from an op whose completion was read on the host. */
static void gpu_offset_sample(ci_runtime* rt, const ci_op* op) {
    ci_children c;
    ci_op_children(op, CI_SG_GEN(atomic_load_explicit(&op->sg, memory_order_relaxed)), &c);
    uint64_t ge = c.gpu_end, tc = c.t_complete;
    if (ge == 0 || tc == 0 || c.from_gpu) return;
    int64_t d = (int64_t)(ci_clock_to_ns(&rt->clock, tc) - ge);
    if (rt->gpu_offset_cur_n++ == 0 || d < rt->gpu_offset_cur) rt->gpu_offset_cur = d;
}

/* Rotates the offset windows: the estimate is the min over the current and the previous one. */
static void gpu_offset_rotate(ci_runtime* rt, uint64_t now_ns) {
    if (now_ns - rt->gpu_offset_window_ns < CI_GPU_OFFSET_WINDOW_NS || rt->gpu_offset_cur_n == 0) return;
    rt->gpu_offset_prev = rt->gpu_offset_cur;
    rt->gpu_offset_prev_n = rt->gpu_offset_cur_n;
    rt->gpu_offset_cur_n = 0;
    rt->gpu_offset_window_ns = now_ns;
}

static uint64_t complete_ns(ci_runtime* rt, const ci_op* op, const ci_children* c, ci_op_record* r) {
    if (!(r->flags & CI_FLAG_COMPLETE_FROM_GPU)) {
        /* the later of the two sides' closes: the enqueue's stop may come after the last channel's */
        uint64_t tc = c->t_complete;
        uint64_t ts = atomic_load_explicit(&op->t_stop, memory_order_relaxed);
        return ci_clock_to_ns(&rt->clock, (int64_t)(ts - tc) > 0 ? ts : tc);
    }
    int64_t off;
    if (rt->gpu_offset_cur_n && rt->gpu_offset_prev_n)
        off = rt->gpu_offset_cur < rt->gpu_offset_prev ? rt->gpu_offset_cur : rt->gpu_offset_prev;
    else if (rt->gpu_offset_cur_n || rt->gpu_offset_prev_n)
        off = rt->gpu_offset_cur_n ? rt->gpu_offset_cur : rt->gpu_offset_prev;
    else {
        /* no host-read sample yet (cannot happen for a thread's first GPU-timed op): the writer's now */
        r->flags &= (uint8_t)~CI_FLAG_COMPLETE_FROM_GPU;
        return ci_realtime_ns();
    }
    uint64_t t = (uint64_t)((int64_t)r->gpu_end_ns + off);
    /* an op never completes before its enqueue ended */
    return t < r->enqueue_end_ns ? r->enqueue_end_ns : t;
}

/* The op's four name windows, 72 bytes (func 24, dtype 16, algo 16, proto 16): its name set's, or the slot's. */
static const char* name_windows(const ci_runtime* rt, const ci_op* op) {
    _Static_assert(__builtin_offsetof(ci_op, proto) - __builtin_offsetof(ci_op, func) == 56, "names back to back");
    return op->names == CI_NAMES_INLINE ? op->func : (const char*)rt->names_set[op->names].w;
}

static void fill_record(ci_runtime* rt, const ci_op* op, uint8_t state, ci_op_record* r) {
    memset(r, 0, sizeof(*r));
    const ci_comm* c = op->comm;
    ci_children ch;
    ci_op_children(op, CI_SG_GEN(atomic_load_explicit(&op->sg, memory_order_relaxed)), &ch);
    uint32_t kch = ch.kch_started;
    r->magic = CI_RECORD_MAGIC;
    r->kind = op->kind & (uint8_t)~CI_OPK_API_STREAM;
    r->state = state;
    r->n_channels = (uint8_t)(kch ? (kch > 255 ? 255 : kch) : op->n_channels);
    r->flags = (op->kind & CI_OPK_API_STREAM) ? CI_FLAG_API_STREAM : 0;
    if (ch.from_gpu) r->flags |= CI_FLAG_COMPLETE_FROM_GPU;
    /* up to the NUL or the field's end only (the windows may hold bytes past the name, see ci_name_window), and
       the record (memset above) carries zeros after it, so equal operations give equal bytes */
    const char* names = name_windows(rt, op);
    ci_copy_str(r->func, sizeof(r->func), names);
    ci_copy_str(r->dtype, sizeof(r->dtype), names + 24);
    ci_copy_str(r->algo, sizeof(r->algo), names + 40);
    ci_copy_str(r->proto, sizeof(r->proto), names + 56);
    r->rank = c->rank;
    r->nranks = c->nranks;
    r->nnodes = c->nnodes;
    /* NCCL passes root 0 to unrooted collectives: only Broadcast/Reduce keep it */
    r->peer = (r->kind == CI_KIND_COLL && strcmp(r->func, "Broadcast") != 0 && strcmp(r->func, "Reduce") != 0)
                  ? -1
                  : op->peer;
    r->pid = rt->pid;
    r->tid = op->tid;
    r->cuda_device = rt->cuda_device;
    r->comm_hash = c->comm_hash;
    r->seq = op->seq;
    r->count = op->count;
    r->bytes = op->count * ci_dtype_size(r->dtype);
    r->stream = op->stream;
    r->enqueue_start_ns = ci_clock_to_ns(&rt->clock, atomic_load_explicit(&op->t_start, memory_order_relaxed));
    r->enqueue_end_ns = ci_clock_to_ns(&rt->clock, atomic_load_explicit(&op->t_stop, memory_order_relaxed));
    r->gpu_start_ns = ch.gpu_start == UINT64_MAX ? 0 : ch.gpu_start;
    r->gpu_end_ns = ch.gpu_end;
    r->complete_ns = state == CI_STATE_COMPLETED ? complete_ns(rt, op, &ch, r) : 0;
    if (r->gpu_start_ns != 0 && r->gpu_end_ns != 0) r->flags |= CI_FLAG_GPU_TIMES;
    r->record_seq = rt->record_seq++;
    ci_copy_str(r->comm_name, sizeof(r->comm_name), c->name);
    r->checksum = fnv_words(r);
}

static uint64_t total_lost(ci_runtime* rt) {
    uint64_t lost = rt->seg.lost;
    for (int s = 0; s < CI_SHARDS; s++) lost += atomic_load_explicit(&rt->shards[s].lost, memory_order_relaxed);
    return lost + atomic_load_explicit(&rt->pool.lost_closes, memory_order_relaxed);
}

void ci_writer_flush_locked(ci_runtime* rt) {
    if (rt->batch_n == 0) return;
    if (rt->cfg.log_enable) ci_segment_append(&rt->seg, rt->batch, rt->batch_n, ci_realtime_ns());
    rt->batch_n = 0;
}

void ci_writer_emit_ring_locked(ci_runtime* rt, const ci_op* op, uint8_t state) {
    ci_op_record r;
    fill_record(rt, op, state, &r);
    if (rt->ring_ok) ci_ring_push(&rt->ring, &r);
}

void ci_writer_emit_locked(ci_runtime* rt, const ci_op* op, uint8_t state, ci_op_record* copy) {
    ci_op_record* r = &rt->batch[rt->batch_n];
    fill_record(rt, op, state, r);
    if (copy != NULL) *copy = *r;
    if (rt->ring_ok) ci_ring_push(&rt->ring, r);
    if (++rt->batch_n == sizeof(rt->batch) / sizeof(rt->batch[0])) ci_writer_flush_locked(rt);
}

/* Completed ops of one drain, in the order they completed (writer side only). */
typedef struct drain_batch {
    ci_runtime* rt;
    uint32_t* done; /* index + 1, at most the pool's size (each a distinct in-flight op) */
    uint32_t n;
} drain_batch;

static int entry_live(const ci_pool* p, uint32_t entry, ci_op** out) {
    uint32_t idx = ci_entry_index(entry);
    if (idx >= p->size) return 0;
    ci_op* op = &p->ops[idx];
    /* acquire: pairs with op start's release; an entry of an earlier op of the slot (taken out of flight by
       finalize, then reused) names another generation and is stale */
    uint32_t sg = atomic_load_explicit(&op->sg, memory_order_acquire);
    if (CI_SG_STATE(sg) != CI_SLOT_INFLIGHT || !ci_entry_gen_matches(entry, CI_SG_GEN(sg))) return 0;
    *out = op;
    return 1;
}

static void take_done(drain_batch* b, ci_op* op) {
    ci_op_set_done(op);
    b->done[b->n++] = ci_op_index(&b->rt->pool, op) + 1;
}

/* One completion-ring entry: the op's channel side closed (or, without announced channels, its last part). */
static void on_entry(void* arg, uint32_t entry) {
    drain_batch* b = arg;
    ci_pool* p = &b->rt->pool;
    ci_op* op;
    if (!entry_live(p, entry, &op)) return;
    /* acquire: pairs with the enqueue's release store of its stop tick */
    if (op->n_channels == 0 || atomic_load_explicit(&op->t_stop, memory_order_acquire) != 0) take_done(b, op);
    else p->waiting[p->n_waiting++] = entry; /* the kernel finished before the enqueue's stopEvent came */
}

static void drain_locked(ci_runtime* rt) {
    ci_pool* p = &rt->pool;
    drain_batch b = {rt, p->drained, 0};
    /* ops that were waiting for their enqueue's stopEvent first, so records keep completion order */
    uint32_t keep = 0;
    for (uint32_t i = 0; i < p->n_waiting; i++) {
        ci_op* op;
        if (!entry_live(p, p->waiting[i], &op)) continue;
        if (atomic_load_explicit(&op->t_stop, memory_order_acquire) != 0) take_done(&b, op);
        else p->waiting[keep++] = p->waiting[i];
    }
    p->n_waiting = keep;
    for (unsigned r = 0; r <= CI_DONE_RINGS; r++) ci_pool_drain_ring(p, r, on_entry, &b);
    /* first pass: the GPU -> host offset samples of everything completed, before any op is converted */
    for (uint32_t i = 0; i < b.n; i++) gpu_offset_sample(rt, &p->ops[b.done[i] - 1]);
    gpu_offset_rotate(rt, ci_realtime_ns());
    for (uint32_t i = 0; i < b.n; i++) {
        ci_op* op = &p->ops[b.done[i] - 1];
        ci_writer_emit_locked(rt, op, CI_STATE_COMPLETED, NULL);
        ci_pool_release(p, op);
    }
    ci_pool_flush_frees(p);
    ci_writer_flush_locked(rt);
}

void ci_writer_cycle_locked(ci_runtime* rt) {
    ci_clock_anchor(&rt->clock);
    drain_locked(rt);
    uint64_t now = ci_realtime_ns();
    if (rt->cfg.log_enable) ci_segment_tick(&rt->seg, now);
    if (rt->ring_ok) ci_ring_set_lost(&rt->ring, total_lost(rt));
    uint64_t report_ns = rt->ring_ok ? ci_ring_inflight_report_ns(&rt->ring) : 0;
    if ((rt->cfg.hang_timeout_s > 0 || report_ns > 0) && now - rt->last_hang_scan_ns > 1000000000ull) {
        rt->last_hang_scan_ns = now;
        if (rt->cfg.hang_timeout_s > 0) ci_hang_scan_locked(rt, now);
        if (report_ns > 0) ci_hang_report_inflight_locked(rt, report_ns);
    }
    /* the agent asks for a seal at each archive interval, so a running job's archive is never older */
    uint64_t seal = rt->ring_ok ? ci_ring_seal_requested(&rt->ring) : 0;
    if (seal != 0) {
        if (rt->cfg.log_enable) ci_segment_seal_now(&rt->seg);
        ci_ring_seal_done(&rt->ring, seal);
    }
}

static void* writer_main(void* arg) {
    ci_runtime* rt = arg;
    uint64_t interval_ns = (uint64_t)rt->cfg.writer_interval_ms * 1000000ull;
    while (!atomic_load_explicit(&rt->stop, memory_order_acquire)) {
        pthread_mutex_lock(&rt->out_lock);
        ci_writer_cycle_locked(rt);
        pthread_mutex_unlock(&rt->out_lock);
        /* sleep until the next cycle, or until ci_writer_stop signals */
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        uint64_t ns = (uint64_t)until.tv_nsec + interval_ns;
        until.tv_sec += (time_t)(ns / 1000000000ull);
        until.tv_nsec = (long)(ns % 1000000000ull);
        pthread_mutex_lock(&rt->wake_lock);
        if (!atomic_load_explicit(&rt->stop, memory_order_acquire))
            pthread_cond_timedwait(&rt->wake, &rt->wake_lock, &until);
        pthread_mutex_unlock(&rt->wake_lock);
    }
    return NULL;
}

int ci_writer_start(ci_runtime* rt) {
    atomic_store(&rt->stop, 0);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&rt->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&rt->wake_lock, NULL);
    if (pthread_create(&rt->thread, NULL, writer_main, rt) != 0) {
        ci_warn("cannot start the writer thread; events are kept until the pool fills, then counted as lost");
        return -1;
    }
    rt->thread_running = 1;
    return 0;
}

void ci_writer_stop(ci_runtime* rt) {
    if (rt->thread_running) {
        pthread_mutex_lock(&rt->wake_lock);
        atomic_store_explicit(&rt->stop, 1, memory_order_release);
        pthread_cond_signal(&rt->wake);
        pthread_mutex_unlock(&rt->wake_lock);
        pthread_join(rt->thread, NULL);
        rt->thread_running = 0;
    }
    pthread_cond_destroy(&rt->wake);
    pthread_mutex_destroy(&rt->wake_lock);
    pthread_mutex_lock(&rt->out_lock);
    ci_clock_anchor(&rt->clock);
    drain_locked(rt);
    ci_hang_abandon_locked(rt, NULL);
    ci_writer_flush_locked(rt);
    if (rt->ring_ok) {
        ci_ring_set_lost(&rt->ring, total_lost(rt));
        ci_ring_close(&rt->ring);
        rt->ring_ok = 0;
    }
    if (rt->cfg.log_enable) ci_segment_close(&rt->seg);
    pthread_mutex_unlock(&rt->out_lock);
}

void ci_writer_finalize_comm(ci_runtime* rt, const ci_comm* comm) {
    pthread_mutex_lock(&rt->out_lock);
    ci_clock_anchor(&rt->clock);
    drain_locked(rt);
    ci_hang_abandon_locked(rt, comm);
    ci_writer_flush_locked(rt);
    pthread_mutex_unlock(&rt->out_lock);
}
