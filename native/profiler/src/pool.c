/*
 * pool.c - ci_pool: operation slots pre-allocated at the first init.
 *
 * Slots are split into CI_SHARDS contiguous blocks, each with its own free
 * queue; a thread allocates from its shard and steals from the others only
 * when its own is empty, so concurrent producers do not share a counter.
 * The writer returns each slot to its home shard. Handles given to NCCL are
 * slot addresses (256-byte aligned), with the low bits tagging children.
 */
#include <stdlib.h>
#include <string.h>

#include "ci_internal.h"

static uint32_t next_pow2(uint32_t v) {
    uint32_t p = 2;
    while (p < v) p <<= 1;
    return p;
}

int ci_pool_init(ci_pool* p, uint32_t size) {
    memset(p, 0, sizeof(*p));
    if (size < CI_SHARDS) size = CI_SHARDS;
    size = (size + CI_SHARDS - 1) / CI_SHARDS * CI_SHARDS;
    void* mem = NULL;
    if (posix_memalign(&mem, 256, (size_t)size * sizeof(ci_op)) != 0) return -1;
    memset(mem, 0, (size_t)size * sizeof(ci_op));
    p->ops = mem;
    p->size = size;
    p->per_shard = size / CI_SHARDS;
    int s = 0;
    for (; s < CI_SHARDS; s++) {
        if (ci_queue_init(&p->free_q[s], next_pow2(p->per_shard)) != 0) goto fail;
        for (uint32_t i = 0; i < p->per_shard; i++) {
            uint32_t idx = (uint32_t)s * p->per_shard + i;
            p->ops[idx].index = idx;
            ci_queue_push(&p->free_q[s], idx);
        }
    }
    return 0;
fail:
    while (--s >= 0) ci_queue_free(&p->free_q[s]);
    free(p->ops);
    p->ops = NULL;
    return -1;
}

void ci_pool_free(ci_pool* p) {
    for (int s = 0; s < CI_SHARDS; s++) ci_queue_free(&p->free_q[s]);
    free(p->ops);
    p->ops = NULL;
}

ci_op* ci_pool_alloc(ci_pool* p, unsigned shard) {
    uint32_t idx;
    for (unsigned k = 0; k < CI_SHARDS; k++) {
        if (ci_queue_pop(&p->free_q[(shard + k) % CI_SHARDS], &idx) == 0) return &p->ops[idx];
    }
    return NULL;
}

void ci_pool_release(ci_pool* p, ci_op* op) {
    atomic_store_explicit(&op->state, CI_SLOT_FREE, memory_order_relaxed);
    /* cannot fail: a home queue holds at most its own slots */
    ci_queue_push(&p->free_q[op->index / p->per_shard], op->index);
}
