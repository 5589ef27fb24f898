/*
 * queue.c - ci_queue: bounded lock-free MPMC queue of uint32 values.
 *
 * Each cell carries a sequence number (Vyukov's bounded queue): a producer
 * claims position `pos` with one CAS on `enq` when cell.seq == pos, writes
 * the value and publishes it by storing seq = pos + 1; a consumer claims
 * `pos` when cell.seq == pos + 1 and hands the cell back with
 * seq = pos + capacity. Indices are free-running 64-bit counters; producers
 * and consumers touch separate cache lines. No lock, no syscall, no wait:
 * a full queue returns -1 at once.
 */
#include <stdlib.h>

#include "ci_internal.h"

int ci_queue_init(ci_queue* q, uint32_t capacity) {
    if (capacity < 2 || (capacity & (capacity - 1)) != 0) return -1;
    q->cells = calloc(capacity, sizeof(ci_cell));
    if (q->cells == NULL) return -1;
    q->mask = capacity - 1;
    for (uint64_t i = 0; i < capacity; i++) atomic_init(&q->cells[i].seq, i);
    atomic_init(&q->enq, 0);
    atomic_init(&q->deq, 0);
    return 0;
}

void ci_queue_free(ci_queue* q) {
    free(q->cells);
    q->cells = NULL;
}

int ci_queue_push(ci_queue* q, uint32_t value) {
    uint64_t pos = atomic_load_explicit(&q->enq, memory_order_relaxed);
    for (;;) {
        ci_cell* cell = &q->cells[pos & q->mask];
        /* acquire: pairs with the consumer's release that handed this cell back */
        uint64_t seq = atomic_load_explicit(&cell->seq, memory_order_acquire);
        int64_t dif = (int64_t)seq - (int64_t)pos;
        if (dif == 0) {
            if (atomic_compare_exchange_weak_explicit(&q->enq, &pos, pos + 1, memory_order_relaxed,
                                                      memory_order_relaxed)) {
                cell->value = value;
                /* release: the value is visible before the cell reads as full */
                atomic_store_explicit(&cell->seq, pos + 1, memory_order_release);
                return 0;
            }
        } else if (dif < 0) {
            return -1; /* full */
        } else {
            pos = atomic_load_explicit(&q->enq, memory_order_relaxed);
        }
    }
}

int ci_queue_pop(ci_queue* q, uint32_t* value) {
    uint64_t pos = atomic_load_explicit(&q->deq, memory_order_relaxed);
    for (;;) {
        ci_cell* cell = &q->cells[pos & q->mask];
        /* acquire: pairs with the producer's release publishing the value */
        uint64_t seq = atomic_load_explicit(&cell->seq, memory_order_acquire);
        int64_t dif = (int64_t)seq - (int64_t)(pos + 1);
        if (dif == 0) {
            if (atomic_compare_exchange_weak_explicit(&q->deq, &pos, pos + 1, memory_order_relaxed,
                                                      memory_order_relaxed)) {
                *value = (uint32_t)cell->value;
                /* release: the value was read before producers may reuse the cell */
                atomic_store_explicit(&cell->seq, pos + q->mask + 1, memory_order_release);
                return 0;
            }
        } else if (dif < 0) {
            return -1; /* empty */
        } else {
            pos = atomic_load_explicit(&q->deq, memory_order_relaxed);
        }
    }
}
