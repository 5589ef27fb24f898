/*
 * hang.c - the in-flight table and timeout evidence.
 *
 * The pool is the in-flight table: a slot in state INFLIGHT is an operation
 * enqueued and not yet completed. Once a second the writer scans it; an
 * operation in flight longer than hang_timeout_s is written once as a
 * CI_STATE_TIMEOUT snapshot record and into a JSON evidence file under
 * <home>/hang_detection/. At finalize (the abort after a watchdog timeout
 * lands here) every operation still in flight is taken out of the table
 * (the writer decides completion under the same lock, after draining the
 * completion rings, so nothing races it; an op without announced channels
 * is taken by setting CI_REFS_DONE in refs: exactly one of it and the
 * closing thread wins), written as ABANDONED (ENQUEUED when no kernel channel ever started),
 * and listed in an evidence file. When the agent sets inflight_report_ns in
 * the ring header, the same scan puts each op in flight longer than that into
 * the ring once (CI_STATE_INFLIGHT; the raw log is not touched), so the agent
 * sees stuck operations at its own adaptive threshold, not the global one. Runs under out_lock: no slot is freed
 * meanwhile, so a slot read as INFLIGHT stays the same operation.
 * Evidence format: docs/formats/hang_detection.md.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ci_internal.h"

typedef struct evidence {
    FILE* f;
    char tmp[CI_FILE_MAX + 8], path[CI_FILE_MAX];
    int n;
} evidence;

static const char* state_name(uint8_t s) {
    switch (s) {
    case CI_STATE_COMPLETED: return "completed";
    case CI_STATE_ENQUEUED: return "enqueued";
    case CI_STATE_ABANDONED: return "abandoned";
    case CI_STATE_TIMEOUT: return "timeout";
    default: return "unknown";
    }
}

static void json_str(FILE* f, const char* s, size_t cap) {
    fputc('"', f);
    for (size_t i = 0; i < cap && s[i] != '\0'; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20 || c >= 0x7f) fprintf(f, "\\u%04x", c); /* bytes, not UTF-8: keep the file ASCII */
        else fputc(c, f);
    }
    fputc('"', f);
}

static int evidence_open(ci_runtime* rt, evidence* e, const char* reason, uint64_t now_ns) {
    static atomic_int warned;
    memset(e, 0, sizeof(*e));
    snprintf(e->path, sizeof(e->path), "%s/hang_detection/%s-%d-%s-%llu.json", rt->cfg.home, rt->host, (int)rt->pid,
             reason, (unsigned long long)now_ns);
    snprintf(e->tmp, sizeof(e->tmp), "%s.tmp", e->path);
    e->f = fopen(e->tmp, "w");
    if (e->f == NULL) {
        ci_warn_once(&warned, "cannot write hang evidence %s: %s", e->tmp, strerror(errno));
        return -1;
    }
    fprintf(e->f, "{\"schema\": \"comminsight.hang_evidence/1\", \"reason\": \"%s\", \"host\": ", reason);
    json_str(e->f, rt->host, sizeof(rt->host));
    fprintf(e->f, ", \"pid\": %d, \"detected_ns\": %llu, \"threshold_s\": %llu, \"workload_id\": ", (int)rt->pid,
            (unsigned long long)now_ns, (unsigned long long)rt->cfg.hang_timeout_s);
    json_str(e->f, rt->cfg.workload_id, sizeof(rt->cfg.workload_id));
    fprintf(e->f, ", \"operations\": [");
    return 0;
}

/* Parts of an op still open: the enqueue until its stop, announced channels not started, children not stopped. */
static unsigned parts_open(const ci_op* op, const ci_children* c) {
    if (op->n_channels == 0) return (unsigned)(atomic_load_explicit(&op->refs, memory_order_relaxed) & 0xffffffffu);
    unsigned kch = c->kch_started;
    return (atomic_load_explicit(&op->t_stop, memory_order_relaxed) == 0) +
           (kch < op->n_channels ? op->n_channels - kch : 0) + (uint16_t)(c->started - c->stopped);
}

static void children_of(const ci_op* op, ci_children* c) {
    ci_op_children(op, CI_SG_GEN(atomic_load_explicit(&op->sg, memory_order_relaxed)), c);
}

static void evidence_add(evidence* e, const ci_op_record* r, const ci_op* op, uint64_t now_ns) {
    if (e->f == NULL) return;
    ci_children c;
    children_of(op, &c);
    fprintf(e->f, "%s\n  {\"comm_hash\": %llu, \"comm_name\": ", e->n ? "," : "", (unsigned long long)r->comm_hash);
    json_str(e->f, r->comm_name, sizeof(r->comm_name));
    fprintf(e->f, ", \"rank\": %d, \"nranks\": %d, \"func\": ", r->rank, r->nranks);
    json_str(e->f, r->func, sizeof(r->func));
    fprintf(e->f,
            ", \"seq\": %llu, \"count\": %llu, \"bytes\": %llu, \"peer\": %d, \"state\": \"%s\", "
            "\"enqueue_start_ns\": %llu, \"enqueue_end_ns\": %llu, \"age_ns\": %llu, \"gpu_start_ns\": %llu, "
            "\"kernel_channels_started\": %u, \"kernel_channels_announced\": %u, \"parts_open\": %u, \"record_seq\": %llu}",
            (unsigned long long)r->seq, (unsigned long long)r->count, (unsigned long long)r->bytes, r->peer,
            state_name(r->state), (unsigned long long)r->enqueue_start_ns, (unsigned long long)r->enqueue_end_ns,
            (unsigned long long)(now_ns > r->enqueue_start_ns ? now_ns - r->enqueue_start_ns : 0),
            (unsigned long long)r->gpu_start_ns,
            (unsigned)c.kch_started, (unsigned)op->n_channels, parts_open(op, &c), (unsigned long long)r->record_seq);
    e->n++;
}

static void evidence_close(evidence* e) {
    if (e->f == NULL) return;
    fprintf(e->f, "\n]}\n");
    int bad = ferror(e->f);
    if (fclose(e->f) != 0) bad = 1;
    if (bad || e->n == 0) unlink(e->tmp);
    else if (rename(e->tmp, e->path) != 0) unlink(e->tmp);
}

void ci_hang_scan_locked(ci_runtime* rt, uint64_t now_ns) {
    uint64_t now_ticks = ci_ticks();
    double limit_ticks = (double)rt->cfg.hang_timeout_s * 1e9 / rt->clock.ns_per_tick;
    evidence e = {0};
    for (uint32_t i = 0; i < rt->pool.size; i++) {
        ci_op* op = &rt->pool.ops[i];
        /* acquire: pairs with the release that published the slot as INFLIGHT */
        if (!ci_op_inflight(op) || op->reported) continue;
        uint64_t t0 = atomic_load_explicit(&op->t_start, memory_order_relaxed);
        /* signed: an op started on another core after now_ticks was read has a negative age, not a huge one */
        if ((double)(int64_t)(now_ticks - t0) < limit_ticks) continue;
        op->reported = 1;
        ci_op_record rec;
        ci_writer_emit_locked(rt, op, CI_STATE_TIMEOUT, &rec);
        if (e.f == NULL && e.n == 0 && evidence_open(rt, &e, "timeout", now_ns) != 0) e.n = -1;
        if (e.n >= 0) evidence_add(&e, &rec, op, now_ns);
    }
    ci_writer_flush_locked(rt);
    evidence_close(&e);
}

void ci_hang_report_inflight_locked(ci_runtime* rt, uint64_t report_ns) {
    uint64_t now_ticks = ci_ticks();
    double limit_ticks = (double)report_ns / rt->clock.ns_per_tick;
    for (uint32_t i = 0; i < rt->pool.size; i++) {
        ci_op* op = &rt->pool.ops[i];
        /* acquire: pairs with the release that published the slot as INFLIGHT */
        if (!ci_op_inflight(op) || op->snapped) continue;
        uint64_t t0 = atomic_load_explicit(&op->t_start, memory_order_relaxed);
        if ((double)(int64_t)(now_ticks - t0) < limit_ticks) continue;
        op->snapped = 1;
        ci_writer_emit_ring_locked(rt, op, CI_STATE_INFLIGHT);
    }
}

void ci_hang_abandon_locked(ci_runtime* rt, const ci_comm* comm) {
    uint64_t now_ns = ci_realtime_ns();
    evidence e = {0};
    for (uint32_t i = 0; i < rt->pool.size; i++) {
        ci_op* op = &rt->pool.ops[i];
        if (!ci_op_inflight(op)) continue;
        if (comm != NULL && op->comm != comm) continue;
        if (op->n_channels == 0) {
            /* take the op out of flight unless its last part already closed: exactly one side wins (plugin.c) */
            uint64_t refs = atomic_fetch_or_explicit(&op->refs, CI_REFS_DONE, memory_order_acq_rel);
            if ((uint32_t)refs == 0 || (refs & CI_REFS_DONE)) continue;
        }
        /* with announced channels only this thread (under out_lock) completes ops; a close entry that comes
           after this is stale (the slot is no longer in flight, or serves a later generation) */
        ci_op_set_done(op);
        ci_children c;
        children_of(op, &c);
        int enqueued_only = atomic_load_explicit(&op->t_stop, memory_order_relaxed) != 0 && c.started == 0;
        ci_op_record rec;
        ci_writer_emit_locked(rt, op, enqueued_only ? CI_STATE_ENQUEUED : CI_STATE_ABANDONED, &rec);
        if (e.f == NULL && e.n == 0 && evidence_open(rt, &e, "finalize", now_ns) != 0) e.n = -1;
        if (e.n >= 0) evidence_add(&e, &rec, op, now_ns);
        ci_pool_release(&rt->pool, op);
    }
    ci_pool_flush_frees(&rt->pool);
    ci_writer_flush_locked(rt);
    evidence_close(&e);
}
