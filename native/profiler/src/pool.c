/*
 * pool.c - ci_pool: operation slots pre-allocated at the first init, their
 * free stacks and their completion lists.
 *
 * Slots are split into CI_SHARDS contiguous blocks, each with its own free
 * stack (Treiber, LIFO); a thread allocates from its shard and steals from
 * the others only when its own is empty, so concurrent producers do not
 * share a counter. The head word carries a 32-bit tag bumped by every
 * change, so a CAS cannot succeed on a recycled head (no ABA). The writer
 * returns each slot to its home shard as one chain per shard per cycle (one
 * CAS), so it rarely contends with producers on the stack heads.
 *
 * Completion: the thread that closes an op's channel side tells the writer
 * with one entry on its own completion ring (ci_done_ring: no shared head,
 * the producer checks and fills the entry it writes anyway, the writer
 * zeroes what it takes), so no locked operation; threads without a ring
 * share one more ring through a fetch_add. The writer, not the event path,
 * decides that an op is complete (plugin.c).
 *
 * Cross-core cost: the writer reads a completed slot's lines, and LIFO hands
 * that slot to a producer again soon after. So when a producer pops a slot
 * it prefetches the next slot of its stack for writing: those lines come
 * back with ownership while the current operation runs, not when the next
 * one starts. Handles given to NCCL are slot addresses (256-byte aligned),
 * with the low bits tagging children.
 */
#include <stdlib.h>
#include <string.h>

#include "ci_internal.h"

static void stack_push(ci_pool* p, ci_shard_lists* s, uint32_t idx) {
    uint64_t old = atomic_load_explicit(&s->free_head, memory_order_relaxed), next;
    do {
        atomic_store_explicit(&p->ops[idx].link, (uint32_t)old, memory_order_relaxed);
        next = (((old >> 32) + 1) << 32) | (uint64_t)(idx + 1);
        /* release: the slot's link (and the writer's reads of it) come before a producer can pop it */
    } while (!atomic_compare_exchange_weak_explicit(&s->free_head, &old, next, memory_order_release,
                                                    memory_order_relaxed));
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
    p->ring_mask = 1;
    while (p->ring_mask < size) p->ring_mask <<= 1;
    p->ring_mask -= 1; /* capacity: the pool's size, rounded up to a power of two */
    for (int r = 0; r <= CI_DONE_RINGS; r++) {
        /* a ring that cannot be allocated stays "taken": its threads use the shared one */
        p->rings[r].slots = malloc(((size_t)p->ring_mask + 1) * sizeof(uint32_t));
        /* empty entries, and every page touched now rather than by the event path's first lap */
        if (p->rings[r].slots != NULL) memset((void*)p->rings[r].slots, 0, ((size_t)p->ring_mask + 1) * sizeof(uint32_t));
        p->rings[r].tail = 0;
        atomic_init(&p->rings[r].next, 0);
        atomic_init(&p->rings[r].state, p->rings[r].slots != NULL ? 0u : 1u);
    }
    p->waiting = malloc((size_t)size * sizeof(uint32_t));
    p->drained = malloc((size_t)size * sizeof(uint32_t));
    if (p->rings[CI_DONE_RINGS].slots == NULL || p->waiting == NULL || p->drained == NULL) {
        ci_pool_free(p);
        return -1;
    }
    atomic_store_explicit(&p->rings[CI_DONE_RINGS].state, 1u, memory_order_relaxed); /* shared: never claimed */
    for (int s = 0; s < CI_SHARDS; s++) {
        atomic_init(&p->lists[s].free_head, 0);
        /* pushed high to low so the first pops walk the block in address order */
        for (uint32_t i = p->per_shard; i-- > 0;) {
            uint32_t idx = (uint32_t)s * p->per_shard + i;
            p->ops[idx].index = idx;
            stack_push(p, &p->lists[s], idx);
        }
    }
    return 0;
}

void ci_pool_free(ci_pool* p) {
    free(p->waiting);
    free(p->drained);
    p->waiting = NULL;
    p->drained = NULL;
    for (int r = 0; r <= CI_DONE_RINGS; r++) {
        free(p->rings[r].slots);
        p->rings[r].slots = NULL;
    }
    free(p->ops);
    p->ops = NULL;
}

/* Pops up to `max` slots of one stack with one CAS; returns how many (0 when the stack is empty). */
static uint32_t stack_pop_chain(ci_pool* p, ci_shard_lists* s, uint32_t* out, uint32_t max) {
    /* acquire: pairs with the pushes' release, so the links walked below are the pushed ones */
    uint64_t old = atomic_load_explicit(&s->free_head, memory_order_acquire), next;
    uint32_t n;
    do {
        n = 0;
        uint32_t top = (uint32_t)old;
        /* the walk may read stale links if another thread pops first: the tag then fails the CAS */
        while (top != 0 && n < max) {
            out[n++] = top - 1;
            top = atomic_load_explicit(&p->ops[top - 1].link, memory_order_relaxed);
        }
        if (n == 0) return 0;
        next = (((old >> 32) + 1) << 32) | top;
    } while (!atomic_compare_exchange_weak_explicit(&s->free_head, &old, next, memory_order_acquire,
                                                    memory_order_acquire));
    return n;
}

uint32_t ci_pool_alloc_batch(ci_pool* p, unsigned shard, uint32_t* out, uint32_t max) {
    for (unsigned k = 0; k < CI_SHARDS; k++) {
        uint32_t n = stack_pop_chain(p, &p->lists[(shard + k) % CI_SHARDS], out, max);
        if (n != 0) return n;
    }
    return 0;
}

void ci_pool_give_back(ci_pool* p, uint32_t idx) {
    stack_push(p, &p->lists[idx / p->per_shard], idx);
}

void ci_pool_prefetch(const ci_pool* p, uint32_t idx) {
    const char* n = (const char*)&p->ops[idx];
    ci_prefetch_for_write(n);
    ci_prefetch_for_write(n + CI_CACHELINE);
    ci_prefetch_for_write(n + 2 * CI_CACHELINE);
}

ci_done_ring* ci_pool_ring_claim(ci_pool* p) {
    for (int r = 0; r < CI_DONE_RINGS; r++) {
        uint32_t free_state = 0;
        /* acquire: the writer's drain of the previous owner's entries (all zero again) comes before our pushes */
        if (atomic_compare_exchange_strong_explicit(&p->rings[r].state, &free_state, 1, memory_order_acquire,
                                                    memory_order_relaxed))
            return &p->rings[r];
    }
    return NULL;
}

void ci_pool_ring_leave(ci_done_ring* r) {
    /* release: every entry this thread wrote is visible to the writer that sees the ring left */
    atomic_store_explicit(&r->state, 2, memory_order_release);
}

void ci_pool_push_shared(ci_pool* p, uint32_t entry) {
    ci_done_ring* r = &p->rings[CI_DONE_RINGS];
    uint64_t pos = atomic_fetch_add_explicit(&r->next, 1, memory_order_relaxed);
    _Atomic uint32_t* e = &r->slots[pos & p->ring_mask];
    uint32_t empty = 0;
    /* a CAS, not a store: a position a lap ahead of a stalled producer must not overwrite its entry */
    if (!atomic_compare_exchange_strong_explicit(e, &empty, entry, memory_order_release, memory_order_relaxed))
        atomic_fetch_add_explicit(&p->lost_closes, 1, memory_order_relaxed);
}

void ci_pool_drain_ring(ci_pool* p, unsigned ring, void (*fn)(void* arg, uint32_t entry), void* arg) {
    ci_done_ring* r = &p->rings[ring];
    /* state before entries (acquire): a ring seen left holds every entry its thread will ever write */
    uint32_t state = atomic_load_explicit(&r->state, memory_order_acquire);
    if (state == 0 || r->slots == NULL) return;
    for (;;) {
        _Atomic uint32_t* e = &r->slots[r->tail & p->ring_mask];
        /* acquire: pairs with the producer's release, so the op's fields it wrote are visible */
        uint32_t v = atomic_load_explicit(e, memory_order_acquire);
        if (v == 0) break;
        atomic_store_explicit(e, 0, memory_order_relaxed);
        r->tail++;
        fn(arg, v);
    }
    if (state == 2) {
        /* every entry is zero again: the next owner starts at position 0, as does the writer */
        r->tail = 0;
        atomic_store_explicit(&r->state, 0, memory_order_release);
    }
}

void ci_pool_release(ci_pool* p, ci_op* op) {
    /* the state stays DONE (not in flight) until the next op_start; the slot joins a private chain and
       reaches the shared stack in ci_pool_flush_frees, so producers and the writer meet once per batch */
    uint32_t s = op->index / p->per_shard;
    atomic_store_explicit(&op->link, p->chain_top[s], memory_order_relaxed);
    if (p->chain_top[s] == 0) p->chain_bottom[s] = op->index + 1;
    p->chain_top[s] = op->index + 1;
}

void ci_pool_flush_frees(ci_pool* p) {
    for (int s = 0; s < CI_SHARDS; s++) {
        if (p->chain_top[s] == 0) continue;
        ci_op* bottom = &p->ops[p->chain_bottom[s] - 1];
        uint64_t old = atomic_load_explicit(&p->lists[s].free_head, memory_order_relaxed), next;
        do {
            atomic_store_explicit(&bottom->link, (uint32_t)old, memory_order_relaxed);
            next = (((old >> 32) + 1) << 32) | p->chain_top[s];
            /* release: the chain's links come before a producer can pop its first slot */
        } while (!atomic_compare_exchange_weak_explicit(&p->lists[s].free_head, &old, next, memory_order_release,
                                                        memory_order_relaxed));
        p->chain_top[s] = p->chain_bottom[s] = 0;
    }
}
