/*
 * noop_plugin.c - the baseline for bench/profiler_hotpath.c: a profiler that
 * implements the v5 ABI and does nothing, so the benchmark can subtract the
 * cost of NCCL's indirect calls and of the driving loop itself.
 */
#include "nccl_profiler_abi.h"

static int dummy;

static ncclResult_t noop_init(void** ctx, uint64_t id, int* mask, const char* name, int nnodes, int nranks, int rank,
                              ncclDebugLogger_t logfn) {
    (void)id, (void)name, (void)nnodes, (void)nranks, (void)rank, (void)logfn;
    *ctx = &dummy;
    *mask = ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh;
    return 0;
}

static ncclResult_t noop_start(void* ctx, void** handle, ncclProfilerEventDescr_v5_t* d) {
    (void)ctx;
    *handle = (d->type == ncclProfileColl || d->type == ncclProfileKernelCh) ? (void*)&dummy : (void*)0;
    return 0;
}

static ncclResult_t noop_stop(void* handle) {
    (void)handle;
    return 0;
}

static ncclResult_t noop_record(void* handle, int state, ncclProfilerEventStateArgs_v5_t* args) {
    (void)handle, (void)state, (void)args;
    return 0;
}

static ncclResult_t noop_finalize(void* ctx) {
    (void)ctx;
    return 0;
}

__attribute__((visibility("default"))) ncclProfiler_v5_t ncclProfiler_v5 = {"noop", noop_init, noop_start, noop_stop,
                                                                            noop_record, noop_finalize};
