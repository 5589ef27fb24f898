/*
 * names.c - the name-set table (ci_names, see ci_internal.h): the four
 * descriptor names of an op as one id, so the enqueue side of a slot fits
 * one cache line. The event path matches an entry by its pointers without a
 * lock (plugin.c); this file matches by content and inserts, off the common
 * path, under a mutex taken with trylock so the event path never waits: a
 * busy lock or a full probe run makes the caller copy the names into the
 * slot instead, which loses nothing. At start it remembers the read-only
 * segments of the loaded objects, which decide whether an entry may be
 * matched by pointer.
 */
#include <link.h>
#include <stdlib.h>
#include <string.h>

#include "ci_internal.h"

static const size_t k_caps[4] = {24, 16, 16, 16};
static const unsigned k_word[4] = {0, 3, 5, 7};

static int collect_ro(struct dl_phdr_info* info, size_t size, void* arg) {
    (void)size;
    ci_names* n = arg;
    for (int i = 0; i < info->dlpi_phnum && n->n_ro < CI_NAMES_RO_RANGES; i++) {
        const ElfW(Phdr)* ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD || (ph->p_flags & PF_W) || ph->p_memsz == 0) continue;
        uintptr_t start = (uintptr_t)info->dlpi_addr + ph->p_vaddr;
        n->ro[n->n_ro][0] = start;
        n->ro[n->n_ro][1] = start + ph->p_memsz;
        n->n_ro++;
    }
    return 0;
}

int ci_names_init(ci_names* n) {
    n->set = calloc((size_t)1 << CI_NAMES_BITS, sizeof(ci_nameset));
    if (n->set == NULL) return -1;
    pthread_mutex_init(&n->lock, NULL);
    n->n_ro = 0;
    dl_iterate_phdr(collect_ro, n); /* at runtime start, under the init lock: not on the event path */
    return 0;
}

void ci_names_free(ci_names* n) {
    if (n->set == NULL) return;
    free(n->set);
    n->set = NULL;
    pthread_mutex_destroy(&n->lock);
}

/* The `cap`-byte window at p lies in one read-only segment remembered at start (NULL counts: no bytes). */
static int window_readonly(const ci_names* n, const char* p, size_t cap) {
    if (p == NULL) return 1;
    uintptr_t a = (uintptr_t)p;
    for (uint32_t i = 0; i < n->n_ro; i++)
        if (a >= n->ro[i][0] && a + cap <= n->ro[i][1]) return 1;
    return 0;
}

static int pointers_equal(const ci_nameset* e, const char* const* p) {
    return e->p[0] == p[0] && e->p[1] == p[1] && e->p[2] == p[2] && e->p[3] == p[3];
}

uint32_t ci_names_find(ci_names* n, const char* const* p, uint64_t* w, uint64_t hash) {
    for (int k = 0; k < 4; k++) ci_name_window(w + k_word[k], k_caps[k], p[k]);
    uint32_t mask = (1u << CI_NAMES_BITS) - 1;
    /* without the lock first: entries never change once ready */
    int room = 0;
    for (uint32_t k = 0; k < CI_NAMES_PROBE; k++) {
        uint32_t i = (uint32_t)(hash + k) & mask;
        ci_nameset* e = &n->set[i];
        /* acquire: pairs with the insert's release, so a ready entry's fields are the final ones */
        uint32_t r = atomic_load_explicit(&e->ready, memory_order_acquire);
        if (r == CI_NAMES_EMPTY) {
            room = 1;
            break;
        }
        if (r == CI_NAMES_BY_POINTER ? pointers_equal(e, p) : memcmp(e->w, w, sizeof(e->w)) == 0) return i;
    }
    /* a full probe run stays full: copy the names without touching the shared lock */
    if (!room || pthread_mutex_trylock(&n->lock) != 0) return CI_NAMES_INLINE;
    int ro = 1;
    for (int k = 0; k < 4; k++) ro &= window_readonly(n, p[k], k_caps[k]);
    uint32_t id = CI_NAMES_INLINE;
    for (uint32_t k = 0; k < CI_NAMES_PROBE; k++) {
        uint32_t i = (uint32_t)(hash + k) & mask;
        ci_nameset* e = &n->set[i];
        /* only inserts (under this lock) write entries, so a ready one is final and an empty one is ours */
        uint32_t r = atomic_load_explicit(&e->ready, memory_order_relaxed);
        if (r != CI_NAMES_EMPTY) {
            if (r == CI_NAMES_BY_POINTER ? pointers_equal(e, p) : memcmp(e->w, w, sizeof(e->w)) == 0) {
                id = i;
                break;
            }
            continue;
        }
        for (int j = 0; j < 4; j++) e->p[j] = p[j];
        memcpy(e->w, w, sizeof(e->w));
        /* release: the fields are visible to every reader that sees ready */
        atomic_store_explicit(&e->ready, ro ? CI_NAMES_BY_POINTER : CI_NAMES_BY_CONTENT, memory_order_release);
        id = i;
        break;
    }
    pthread_mutex_unlock(&n->lock);
    return id;
}
