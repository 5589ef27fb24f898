/*
 * ring.c - ci_ring: the shared-memory ring the agent consumes (SPSC).
 *
 * File <dir>/comminsight-<pid>-<start_ns>.ring, mapped shared: the header
 * (comminsight_ring.h) then `capacity` records. Only the writer thread
 * produces; a full ring (no or slow consumer) drops the record and counts it
 * in `dropped`, never waits.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ci_internal.h"

int ci_ring_open(ci_ring* r, const char* dir, uint32_t capacity, const char* host, uint64_t start_ns) {
    memset(r, 0, sizeof(*r));
    int fd = -1;
    snprintf(r->path, sizeof(r->path), "%s/comminsight-%d-%llu.ring", dir, (int)getpid(),
             (unsigned long long)start_ns);
    size_t bytes = CI_RING_HEADER_SIZE + (size_t)capacity * CI_RECORD_SIZE;
    fd = open(r->path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) goto fail;
    if (ftruncate(fd, (off_t)bytes) != 0) goto fail;
    /* posix_fallocate so a full disk fails here rather than with SIGBUS on a later store */
    int err = posix_fallocate(fd, 0, (off_t)bytes);
    if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
        errno = err;
        goto fail;
    }
    void* map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) goto fail;
    close(fd);
    r->hdr = map;
    r->slots = (ci_op_record*)((char*)map + CI_RING_HEADER_SIZE);
    r->map_bytes = bytes;
    ci_ring_header* h = r->hdr;
    h->version = CI_FORMAT_VERSION;
    h->header_size = CI_RING_HEADER_SIZE;
    h->record_size = CI_RECORD_SIZE;
    h->capacity = capacity;
    h->writer_pid = (int32_t)getpid();
    h->writer_start_ns = start_ns;
    ci_copy_str(h->host, sizeof(h->host), host);
    /* release: a consumer that sees the magic sees a complete header */
    __atomic_store_n(&h->magic, CI_RING_MAGIC, __ATOMIC_RELEASE);
    return 0;
fail: {
    int saved = errno;
    if (fd >= 0) {
        close(fd);
        unlink(r->path);
    }
    errno = saved;
    r->hdr = NULL;
    return -1;
}
}

void ci_ring_push(ci_ring* r, const ci_op_record* rec) {
    ci_ring_header* h = r->hdr;
    if (h == NULL) return;
    uint64_t head = h->head; /* only this thread writes head */
    /* acquire: pairs with the consumer's release of tail; the slot is free to overwrite */
    uint64_t tail = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
    if (head - tail >= h->capacity) {
        __atomic_store_n(&h->dropped, h->dropped + 1, __ATOMIC_RELAXED);
        return;
    }
    memcpy(&r->slots[head & (h->capacity - 1)], rec, sizeof(*rec));
    /* release: the record is complete before the consumer sees the new head */
    __atomic_store_n(&h->head, head + 1, __ATOMIC_RELEASE);
}

void ci_ring_set_lost(ci_ring* r, uint64_t lost) {
    if (r->hdr != NULL) __atomic_store_n(&r->hdr->lost, lost, __ATOMIC_RELAXED);
}

uint64_t ci_ring_seal_requested(const ci_ring* r) {
    if (r->hdr == NULL) return 0;
    /* relaxed: a plain request counter; nothing else is published with it */
    uint64_t want = __atomic_load_n(&r->hdr->seal_request, __ATOMIC_RELAXED);
    return want != r->hdr->seal_done ? want : 0;
}

void ci_ring_seal_done(ci_ring* r, uint64_t request) {
    /* release: the segment's rename happened before the consumer sees the acknowledgement */
    if (r->hdr != NULL) __atomic_store_n(&r->hdr->seal_done, request, __ATOMIC_RELEASE);
}

uint64_t ci_ring_inflight_report_ns(const ci_ring* r) {
    return r->hdr == NULL ? 0 : __atomic_load_n(&r->hdr->inflight_report_ns, __ATOMIC_RELAXED);
}

void ci_ring_close(ci_ring* r) {
    if (r->hdr == NULL) return;
    ci_ring_header* h = r->hdr;
    /* a ring the consumer has read to the end is of no further use */
    int consumed = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE) == h->head;
    __atomic_store_n(&h->writer_closed, 1, __ATOMIC_RELEASE);
    munmap(r->hdr, r->map_bytes);
    r->hdr = NULL;
    if (consumed) unlink(r->path);
}
