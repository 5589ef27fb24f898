/*
 * pool.c - ci_pool: operation slots pre-allocated at the first init.
 *
 * Slots are split into CI_SHARDS contiguous blocks, each with its own free
 * stack (Treiber, LIFO); a thread allocates from its shard and steals from
 * the others only when its own is empty, so concurrent producers do not
 * share a counter. LIFO hands back the slot freed last, whose cache lines
 * are most likely still near the producer. The head word carries a 32-bit
 * tag bumped by every change, so a CAS cannot succeed on a recycled head
 * (no ABA). The writer returns each slot to its home shard and only reads
 * the slot itself and pushes its frees as one chain per shard per cycle
 * (one CAS), so it rarely contends with producers on the stack heads.
 * Handles given to NCCL are slot addresses (256-byte aligned), with the low
 * bits tagging children.
 */
#include <stdlib.h>
#include <string.h>

#include "ci_internal.h"

static void stack_push(ci_pool* p, ci_free_stack* s, uint32_t idx) {
    uint64_t old = atomic_load_explicit(&s->head, memory_order_relaxed), next;
    do {
        atomic_store_explicit(&p->ops[idx].next_free, (uint32_t)old, memory_order_relaxed);
        next = (((old >> 32) + 1) << 32) | (uint64_t)(idx + 1);
        /* release: the slot's link (and the writer's reads of it) come before a producer can pop it */
    } while (!atomic_compare_exchange_weak_explicit(&s->head, &old, next, memory_order_release,
                                                    memory_order_relaxed));
}

/* Returns a slot index, or -1 when the stack is empty. */
static int64_t stack_pop(ci_pool* p, ci_free_stack* s) {
    /* acquire: pairs with the push's release, so the link read below is the pushed one */
    uint64_t old = atomic_load_explicit(&s->head, memory_order_acquire), next;
    do {
        uint32_t top = (uint32_t)old;
        if (top == 0) return -1;
        /* may be stale if another thread pops first: the tag then makes the CAS fail */
        uint32_t link = atomic_load_explicit(&p->ops[top - 1].next_free, memory_order_relaxed);
        next = (((old >> 32) + 1) << 32) | link;
    } while (!atomic_compare_exchange_weak_explicit(&s->head, &old, next, memory_order_acquire,
                                                    memory_order_acquire));
    return (int64_t)(uint32_t)old - 1;
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
    for (int s = 0; s < CI_SHARDS; s++) {
        atomic_init(&p->free_s[s].head, 0);
        /* pushed high to low so the first pops walk the block in address order */
        for (uint32_t i = p->per_shard; i-- > 0;) {
            uint32_t idx = (uint32_t)s * p->per_shard + i;
            p->ops[idx].index = idx;
            stack_push(p, &p->free_s[s], idx);
        }
    }
    return 0;
}

void ci_pool_free(ci_pool* p) {
    free(p->ops);
    p->ops = NULL;
}

ci_op* ci_pool_alloc(ci_pool* p, unsigned shard) {
    for (unsigned k = 0; k < CI_SHARDS; k++) {
        int64_t idx = stack_pop(p, &p->free_s[(shard + k) % CI_SHARDS]);
        if (idx >= 0) return &p->ops[idx];
    }
    return NULL;
}

void ci_pool_release(ci_pool* p, ci_op* op) {
    /* the state stays DONE (not in flight) until the next op_start; the slot joins a private chain and
       reaches the shared stack in ci_pool_flush_frees, so producers and the writer meet once per batch */
    uint32_t s = op->index / p->per_shard;
    atomic_store_explicit(&op->next_free, p->chain_top[s], memory_order_relaxed);
    if (p->chain_top[s] == 0) p->chain_bottom[s] = op->index + 1;
    p->chain_top[s] = op->index + 1;
}

void ci_pool_flush_frees(ci_pool* p) {
    for (int s = 0; s < CI_SHARDS; s++) {
        if (p->chain_top[s] == 0) continue;
        ci_op* bottom = &p->ops[p->chain_bottom[s] - 1];
        uint64_t old = atomic_load_explicit(&p->free_s[s].head, memory_order_relaxed), next;
        do {
            atomic_store_explicit(&bottom->next_free, (uint32_t)old, memory_order_relaxed);
            next = (((old >> 32) + 1) << 32) | p->chain_top[s];
            /* release: the chain's links come before a producer can pop its first slot */
        } while (!atomic_compare_exchange_weak_explicit(&p->free_s[s].head, &old, next, memory_order_release,
                                                        memory_order_relaxed));
        p->chain_top[s] = p->chain_bottom[s] = 0;
    }
}
