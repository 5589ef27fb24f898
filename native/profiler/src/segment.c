/*
 * segment.c - ci_segment_writer: durable raw-log segments.
 *
 * <dir>/<host>-<pid>-<start_ns>-<n>.cilog: a ci_log_header, then records back
 * to back. Records are written with pwrite at whole-record offsets, so a
 * short write (disk full) is overwritten by the next attempt and a crash
 * leaves at most one torn record at the tail. A segment is sealed by renaming
 * it to <name>.sealed when it exceeds its size or age, and at close.
 * Errors are logged once per episode and the records counted as lost.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ci_internal.h"

void ci_segment_init(ci_segment_writer* w, const char* dir, uint64_t max_bytes, uint64_t max_age_s,
                     uint64_t start_ns, const ci_log_header* proto) {
    memset(w, 0, sizeof(*w));
    ci_copy_str(w->dir, sizeof(w->dir), dir);
    w->fd = -1;
    w->max_bytes = max_bytes;
    w->max_age_ns = max_age_s * 1000000000ull;
    w->start_ns = start_ns;
    w->proto = *proto;
}

static void seal(ci_segment_writer* w) {
    if (w->fd < 0) return;
    fsync(w->fd); /* sealed segments are what gets archived: make them durable first */
    close(w->fd);
    w->fd = -1;
    char sealed[CI_FILE_MAX + 16];
    snprintf(sealed, sizeof(sealed), "%s.sealed", w->path);
    if (rename(w->path, sealed) != 0) ci_warn("cannot seal %s: %s", w->path, strerror(errno));
}

/* Opens segment number w->index; returns 0 or -1 (logged once per episode). */
static int open_segment(ci_segment_writer* w, uint64_t now_ns) {
    snprintf(w->path, sizeof(w->path), "%s/%s-%d-%llu-%u.cilog", w->dir, w->proto.host, (int)w->proto.pid,
             (unsigned long long)w->start_ns, w->index);
    int fd = open(w->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) goto fail;
    ci_log_header h = w->proto;
    h.magic = CI_LOG_MAGIC;
    h.version = CI_FORMAT_VERSION;
    h.header_size = CI_LOG_HEADER_SIZE;
    h.record_size = CI_RECORD_SIZE;
    h.start_ns = now_ns;
    h.segment_index = w->index;
    if (pwrite(fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h)) {
        if (errno == 0) errno = ENOSPC;
        close(fd);
        unlink(w->path);
        goto fail;
    }
    w->fd = fd;
    w->off = CI_LOG_HEADER_SIZE;
    w->opened_ns = now_ns;
    w->index++;
    return 0;
fail:
    if (!w->failed) ci_warn("cannot open raw log %s: %s (records are counted as lost)", w->path, strerror(errno));
    w->failed = 1;
    return -1;
}

void ci_segment_append(ci_segment_writer* w, const ci_op_record* recs, size_t n, uint64_t now_ns) {
    if (n == 0) return;
    size_t bytes = n * sizeof(ci_op_record);
    if (w->fd >= 0 && (w->off + bytes > w->max_bytes || now_ns - w->opened_ns > w->max_age_ns)) seal(w);
    if (w->fd < 0 && open_segment(w, now_ns) != 0) {
        w->lost += n;
        return;
    }
    size_t done = 0;
    while (done < bytes) {
        ssize_t k = pwrite(w->fd, (const char*)recs + done, bytes - done, (off_t)(w->off + done));
        if (k <= 0) {
            if (k < 0 && errno == EINTR) continue;
            if (!w->failed) ci_warn("cannot write raw log %s: %s (records are counted as lost)", w->path,
                                    k < 0 ? strerror(errno) : "no space");
            w->failed = 1;
            break;
        }
        done += (size_t)k;
    }
    size_t whole = done / sizeof(ci_op_record);
    /* a partial record stays beyond w->off and is overwritten by the next write */
    w->off += whole * sizeof(ci_op_record);
    w->lost += n - whole;
    if (whole == n) w->failed = 0;
}

void ci_segment_tick(ci_segment_writer* w, uint64_t now_ns) {
    if (w->fd >= 0 && now_ns - w->opened_ns > w->max_age_ns) seal(w);
}

void ci_segment_close(ci_segment_writer* w) { seal(w); }

void ci_segment_seal_now(ci_segment_writer* w) {
    if (w->fd >= 0 && w->off > CI_LOG_HEADER_SIZE) seal(w);
}
