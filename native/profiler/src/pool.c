/*
 * pool.c - ci_pool: operation slots pre-allocated at the first init, their
 * free stacks and their completion lists.
 *
 * Slots are split into CI_SHARDS contiguous blocks, each with its own free
 * stack (Treiber, LIFO) of batches: a batch is a head slot whose free-list
 * line lists up to CI_BATCH - 1 more slots, so a pop reads one line and
 * takes a whole batch with one CAS (a stack of single slots made a pop walk
 * a chain of links, one dependent cache miss per slot). A thread allocates
 * from its shard and steals from the others only when its own is empty, so
 * concurrent producers do not share a counter. The head word carries a
 * 32-bit tag bumped by every change, so a CAS cannot succeed on a recycled
 * head (no ABA). The writer gathers the slots it frees into batches of their
 * home shard and pushes them as one chain per shard per cycle (one CAS), so
 * it rarely contends with producers on the stack heads.
 *
 * Completion: the thread that closes an op's channel side tells the writer
 * with one entry on its own completion ring (ci_done_ring: no shared head,
 * the producer checks and fills the entry it writes anyway, the writer
 * zeroes what it takes), so no locked operation; threads without a ring
 * share one more ring through a fetch_add. The writer, not the event path,
 * decides that an op is complete (plugin.c).
 *
 * Cross-core cost: the writer reads a completed slot's lines, and LIFO hands
 * that slot to a producer again soon after. So when a producer takes a slot
 * it prefetches the next slot of its cache for writing: those lines come
 * back with ownership while the current operation runs, not when the next
 * one starts. Handles given to NCCL are slot addresses (256-byte aligned),
 * with the low bits tagging children.
 */
#include <stdlib.h>
#include <string.h>

#include "ci_internal.h"

/* The free word of a batch's head: how many slots it lists besides itself, and the next batch's head + 1. */
#define FREE_WORD(extra, next) (((uint32_t)(extra) << 24) | (next))
#define FREE_NEXT(w) ((w) & 0xffffffu)
#define FREE_EXTRA(w) ((w) >> 24)

/* Pushes a chain of batches (top .. bottom, linked through their free words) with one CAS. */
static void stack_push_chain(ci_pool* p, ci_shard_lists* s, uint32_t top, uint32_t bottom) {
    ci_op* b = &p->ops[bottom - 1];
    uint32_t extra = FREE_EXTRA(atomic_load_explicit(&b->free_word, memory_order_relaxed));
    uint64_t old = atomic_load_explicit(&s->free_head, memory_order_relaxed), next;
    do {
        atomic_store_explicit(&b->free_word, FREE_WORD(extra, (uint32_t)old), memory_order_relaxed);
        next = (((old >> 32) + 1) << 32) | (uint64_t)top;
        /* release: the batches' free words and lists come before a producer can pop them */
    } while (!atomic_compare_exchange_weak_explicit(&s->free_head, &old, next, memory_order_release,
                                                    memory_order_relaxed));
}

/* Makes idx[0..n) one batch headed by idx[0] (not linked yet). */
static void batch_fill(ci_pool* p, const uint32_t* idx, uint32_t n) {
    ci_op* h = &p->ops[idx[0]];
    for (uint32_t i = 1; i < n; i++) atomic_store_explicit(&h->batch[i - 1], idx[i], memory_order_relaxed);
    atomic_store_explicit(&h->free_word, FREE_WORD(n - 1, 0), memory_order_relaxed);
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
        /* batches of consecutive slots, pushed high to low so the first pops walk the block in address order */
        uint32_t base = (uint32_t)s * p->per_shard, idx[CI_BATCH];
        for (uint32_t b = (p->per_shard + CI_BATCH - 1) / CI_BATCH; b-- > 0;) {
            uint32_t first = b * CI_BATCH, n = p->per_shard - first < CI_BATCH ? p->per_shard - first : CI_BATCH;
            for (uint32_t i = 0; i < n; i++) idx[i] = base + first + i;
            batch_fill(p, idx, n);
            stack_push_chain(p, &p->lists[s], idx[0] + 1, idx[0] + 1);
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

/* Pops one batch with one CAS; returns how many slots it gave (0 when the stack is empty). */
static uint32_t stack_pop_batch(ci_pool* p, ci_shard_lists* s, uint32_t* out) {
    /* acquire: pairs with the pushes' release, so the free word and list read below are the pushed ones */
    uint64_t old = atomic_load_explicit(&s->free_head, memory_order_acquire), next;
    uint32_t n;
    do {
        uint32_t top = (uint32_t)old;
        if (top == 0) return 0;
        /* the head may be popped by another thread meanwhile: what is read then is stale and the tag fails the
           CAS; `extra` is clamped so a stale word cannot overrun `out` */
        ci_op* h = &p->ops[top - 1];
        uint32_t w = atomic_load_explicit(&h->free_word, memory_order_relaxed);
        uint32_t extra = FREE_EXTRA(w) < CI_BATCH ? FREE_EXTRA(w) : CI_BATCH - 1;
        out[0] = top - 1;
        for (uint32_t i = 0; i < extra; i++) out[1 + i] = atomic_load_explicit(&h->batch[i], memory_order_relaxed);
        n = extra + 1;
        next = (((old >> 32) + 1) << 32) | FREE_NEXT(w);
    } while (!atomic_compare_exchange_weak_explicit(&s->free_head, &old, next, memory_order_acquire,
                                                    memory_order_acquire));
    return n;
}

uint32_t ci_pool_alloc_batch(ci_pool* p, unsigned shard, uint32_t* out) {
    for (unsigned k = 0; k < CI_SHARDS; k++) {
        uint32_t n = stack_pop_batch(p, &p->lists[(shard + k) % CI_SHARDS], out);
        if (n != 0) return n;
    }
    return 0;
}

void ci_pool_give_back(ci_pool* p, const uint32_t* idx, uint32_t n) {
    if (n == 0) return;
    batch_fill(p, idx, n);
    stack_push_chain(p, &p->lists[idx[0] / p->per_shard], idx[0] + 1, idx[0] + 1);
}

void ci_pool_prefetch(const ci_pool* p, uint32_t idx) {
    /* the enqueue side's line and the channel side's (the benchmark's one thread writes both; under NCCL the
       proxy thread writes the second) */
    const char* n = (const char*)&p->ops[idx];
    ci_prefetch_for_write(n);
    ci_prefetch_for_write(n + CI_CACHELINE);
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

/* Writer side: the batch being filled for shard `s` joins the shard's private chain. */
static void batch_close(ci_pool* p, unsigned s) {
    uint32_t head = p->filling[s];
    if (head == 0) return;
    ci_op* h = &p->ops[head - 1];
    atomic_store_explicit(&h->free_word, FREE_WORD(p->filling_n[s], p->chain_top[s]), memory_order_relaxed);
    if (p->chain_top[s] == 0) p->chain_bottom[s] = head;
    p->chain_top[s] = head;
    p->filling[s] = 0;
}

void ci_pool_release(ci_pool* p, ci_op* op) {
    /* the state stays DONE (not in flight) until the next op_start; the slot joins a batch of its home shard,
       and batches reach the shared stack in ci_pool_flush_frees, so producers and the writer meet once per
       cycle. The writer's flags are cleared here, and only when set, so the channel side's line is not
       written for every op */
    uint32_t idx = ci_op_index(p, op);
    unsigned s = idx / p->per_shard;
    if (op->reported | op->snapped) op->reported = op->snapped = 0;
    if (p->filling[s] == 0) {
        p->filling[s] = idx + 1;
        p->filling_n[s] = 0;
    } else {
        atomic_store_explicit(&p->ops[p->filling[s] - 1].batch[p->filling_n[s]++], idx, memory_order_relaxed);
    }
    if (p->filling_n[s] == CI_BATCH - 1) batch_close(p, s);
}

void ci_pool_flush_frees(ci_pool* p) {
    for (unsigned s = 0; s < CI_SHARDS; s++) {
        batch_close(p, s);
        if (p->chain_top[s] == 0) continue;
        stack_push_chain(p, &p->lists[s], p->chain_top[s], p->chain_bottom[s]);
        p->chain_top[s] = p->chain_bottom[s] = 0;
    }
}
