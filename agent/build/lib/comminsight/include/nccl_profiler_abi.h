/*
 * nccl_profiler_abi.h - the NCCL profiler plugin ABI (v4 and v5), declared by this
 * project from the facts in NCCL's ext-profiler interface (no NCCL header needed).
 *
 * Used by the plugin (C) and by the simulator and tests (Python, through cffi: the
 * region between NCCL_ABI_CDEF markers is fed to ffi.cdef() as it stands, so keep it
 * plain declarations). Offsets are LP64 and checked by the static asserts below.
 */
#ifndef COMMINSIGHT_NCCL_PROFILER_ABI_H
#define COMMINSIGHT_NCCL_PROFILER_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

/* Event type bits (the activation mask). */
#define ncclProfileGroup        (1 << 0)
#define ncclProfileColl         (1 << 1)
#define ncclProfileP2p          (1 << 2)
#define ncclProfileProxyOp      (1 << 3)
#define ncclProfileProxyStep    (1 << 4)
#define ncclProfileProxyCtrl    (1 << 5)
#define ncclProfileKernelCh     (1 << 6)
#define ncclProfileNetPlugin    (1 << 7)
#define ncclProfileGroupApi     (1 << 8)
#define ncclProfileCollApi      (1 << 9)
#define ncclProfileP2pApi       (1 << 10)
#define ncclProfileKernelLaunch (1 << 11)

/* Event states passed to recordEventState. */
#define ncclProfilerProxyStepSendGPUWait    8
#define ncclProfilerProxyStepSendPeerWait   9
#define ncclProfilerProxyStepSendWait      10
#define ncclProfilerProxyStepRecvWait      11
#define ncclProfilerProxyStepRecvFlushWait 12
#define ncclProfilerProxyCtrlIdle          13
#define ncclProfilerProxyCtrlActive        14
#define ncclProfilerProxyCtrlSleep         15
#define ncclProfilerProxyCtrlWakeup        16
#define ncclProfilerProxyCtrlAppend        17
#define ncclProfilerProxyCtrlAppendEnd     18
#define ncclProfilerProxyOpInProgress      19
#define ncclProfilerProxyStepSendPeerWaitV5 20
#define ncclProfilerNetPluginUpdate        21
#define ncclProfilerKernelChStop           22
#define ncclProfilerGroupStartApiStop      23
#define ncclProfilerGroupEndApiStart       24

/* NCCL_ABI_CDEF_BEGIN */
typedef int ncclResult_t; /* 0 = ncclSuccess */
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

typedef struct {
    uint8_t type;
    void* parentObj;
    int rank;
    union {
        struct {
            uint64_t seqNumber;
            const char* func;
            void const* sendBuff;
            void* recvBuff;
            size_t count;
            int root;
            const char* datatype;
            uint8_t nChannels;
            uint8_t nWarps;
            const char* algo;
            const char* proto;
        } coll;
        struct {
            const char* func;
            void* buff;
            const char* datatype;
            size_t count;
            int peer;
            uint8_t nChannels;
        } p2p;
        struct {
            int pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
        struct {
            uint8_t channelId;
            uint64_t pTimer;
        } kernelCh;
        struct {
            int64_t id;
            void* data;
        } netPlugin;
    };
} ncclProfilerEventDescr_v4_t;

typedef struct {
    uint64_t type;
    void* parentObj;
    int rank;
    union {
        struct {
            uint64_t seqNumber;
            const char* func;
            void const* sendBuff;
            void* recvBuff;
            size_t count;
            int root;
            const char* datatype;
            uint8_t nChannels;
            uint8_t nWarps;
            const char* algo;
            const char* proto;
            void* parentGroup;
        } coll;
        struct {
            const char* func;
            void* buff;
            const char* datatype;
            size_t count;
            int peer;
            uint8_t nChannels;
            void* parentGroup;
        } p2p;
        struct {
            int pid;
            uint8_t channelId;
            int peer;
            int nSteps;
            int chunkSize;
            int isSend;
        } proxyOp;
        struct {
            int step;
        } proxyStep;
        struct {
            uint8_t channelId;
            uint64_t pTimer;
        } kernelCh;
        struct {
            int64_t id;
            void* data;
        } netPlugin;
        struct {
            const char* func;
            size_t count;
            const char* datatype;
            int root;
            void* stream;
            bool graphCaptured;
        } collApi;
        struct {
            const char* func;
            size_t count;
            const char* datatype;
            void* stream;
            bool graphCaptured;
        } p2pApi;
        struct {
            bool graphCaptured;
            int groupDepth;
        } groupApi;
        struct {
            void* stream;
        } kernelLaunch;
    };
} ncclProfilerEventDescr_v5_t;

typedef union {
    struct { size_t transSize; } proxyStep;
    struct { int appendedProxyOps; } proxyCtrl;
    struct { void* data; } netPlugin;
    struct { uint64_t pTimer; } kernelCh;
} ncclProfilerEventStateArgs_v4_t;

typedef ncclProfilerEventStateArgs_v4_t ncclProfilerEventStateArgs_v5_t;

typedef struct {
    const char* name;
    ncclResult_t (*init)(void** context, int* eActivationMask, const char* commName, uint64_t commHash,
                         int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
    ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_v4_t* eDescr);
    ncclResult_t (*stopEvent)(void* eHandle);
    ncclResult_t (*recordEventState)(void* eHandle, int eState, ncclProfilerEventStateArgs_v4_t* eStateArgs);
    ncclResult_t (*finalize)(void* context);
} ncclProfiler_v4_t;

typedef struct {
    const char* name;
    ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask, const char* commName,
                         int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);
    ncclResult_t (*startEvent)(void* context, void** eHandle, ncclProfilerEventDescr_v5_t* eDescr);
    ncclResult_t (*stopEvent)(void* eHandle);
    ncclResult_t (*recordEventState)(void* eHandle, int eState, ncclProfilerEventStateArgs_v5_t* eStateArgs);
    ncclResult_t (*finalize)(void* context);
} ncclProfiler_v5_t;
/* NCCL_ABI_CDEF_END */

_Static_assert(sizeof(ncclProfilerEventDescr_v4_t) == 104, "v4 descriptor is 104 bytes");
_Static_assert(sizeof(ncclProfilerEventDescr_v5_t) == 112, "v5 descriptor is 112 bytes");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, coll.datatype) == 72, "v5 coll.datatype @72");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, coll.parentGroup) == 104, "v5 coll.parentGroup @104");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, p2p.peer) == 56, "v5 p2p.peer @56");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, p2p.parentGroup) == 64, "v5 p2p.parentGroup @64");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, proxyOp.channelId) == 28, "v5 proxyOp.channelId @28");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, proxyOp.isSend) == 44, "v5 proxyOp.isSend @44");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, kernelCh.pTimer) == 32, "v5 kernelCh.pTimer @32");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, collApi.root) == 48, "v5 collApi.root @48");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, collApi.stream) == 56, "v5 collApi.stream @56");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, collApi.graphCaptured) == 64, "v5 collApi.graphCaptured @64");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, p2pApi.stream) == 48, "v5 p2pApi.stream @48");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, groupApi.groupDepth) == 28, "v5 groupApi.groupDepth @28");
_Static_assert(offsetof(ncclProfilerEventDescr_v4_t, coll.proto) == 96, "v4 coll.proto @96");
_Static_assert(sizeof(ncclProfilerEventStateArgs_v5_t) == 8, "state args are 8 bytes");
_Static_assert(sizeof(ncclProfiler_v5_t) == 48, "plugin table is 48 bytes");

#endif /* COMMINSIGHT_NCCL_PROFILER_ABI_H */
