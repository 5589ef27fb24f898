/*
 * comminsight_ring.h - the on-disk and shared-memory contract between the
 * CommInsight NCCL profiler plugin (writer) and the node agent (reader).
 *
 * This header is the single source of truth for three formats:
 *   - ci_op_record:   one fixed-size record per Coll/P2P operation;
 *   - ci_ring_header: the shared-memory ring under <home>/shms/ (SPSC:
 *                     the plugin's writer thread produces, the agent consumes);
 *   - ci_log_header:  the header of each raw-log segment under
 *                     <home>/inspector_logs/, followed by ci_op_record's.
 * The agent feeds the declarations between the CI_CDEF markers to cffi's
 * ffi.cdef(), so keep that region free of preprocessor logic and of
 * expressions cffi cannot parse (plain integer array sizes only).
 * Specs: docs/formats/ring.md, docs/formats/rawlog.md.
 * All integers are little-endian (x86-64 / aarch64 hosts).
 */
#ifndef COMMINSIGHT_RING_H
#define COMMINSIGHT_RING_H

#include <stdint.h>

#define CI_RING_MAGIC      0x474E49524D4D4F43ULL /* "COMMRING" little-endian */
#define CI_LOG_MAGIC       0x474F4C4D4D4F4343ULL /* "CCOMMLOG" little-endian */
#define CI_RECORD_MAGIC    0x43524943u           /* "CIRC" */
#define CI_FORMAT_VERSION  1
#define CI_RECORD_SIZE     256
#define CI_RING_HEADER_SIZE 512
#define CI_LOG_HEADER_SIZE  512

/* ci_op_record.kind */
#define CI_KIND_COLL 1
#define CI_KIND_P2P  2

/* ci_op_record.state */
#define CI_STATE_COMPLETED 1 /* last child (KernelCh/ProxyOp) stopped */
#define CI_STATE_ENQUEUED  2 /* enqueued, no child seen before finalize/flush */
#define CI_STATE_ABANDONED 3 /* still in flight when the communicator finalized */
#define CI_STATE_TIMEOUT   4 /* snapshot of an op in flight past the threshold */
#define CI_STATE_INFLIGHT  5 /* ring only: snapshot of an op in flight past the agent's inflight_report_ns */

/* ci_op_record.flags */
#define CI_FLAG_GPU_TIMES  0x1 /* gpu_start_ns/gpu_end_ns are valid */
#define CI_FLAG_API_STREAM 0x2 /* stream came from the CollApi/P2pApi parent */
#define CI_FLAG_COMPLETE_FROM_GPU 0x4 /* complete_ns = gpu_end_ns on the host clock (offset from sampled ops), not a host read */

/* CI_CDEF_BEGIN */
/*
 * One operation, 256 bytes. CPU times are nanoseconds since the Unix epoch
 * (CLOCK_REALTIME domain, so records of different nodes line up); GPU times
 * are the device globaltimer in ns as NCCL reports them in pTimer.
 * checksum: 32-bit FNV-1a over the record's 64 little-endian u32 words,
 * taken with the checksum field set to 0 (offset-basis 2166136261, prime
 * 16777619, one xor-multiply per word). A reader rejects a record whose
 * magic or checksum does not match (a torn write).
 */
typedef struct ci_op_record {
    uint32_t magic;          /* CI_RECORD_MAGIC */
    uint32_t checksum;       /* see above */
    uint8_t  kind;           /* CI_KIND_* */
    uint8_t  state;          /* CI_STATE_* */
    uint8_t  n_channels;     /* channels that reported KernelCh (or descr nChannels) */
    uint8_t  flags;          /* CI_FLAG_* */
    int32_t  rank;           /* rank in the communicator (from init) */
    int32_t  nranks;
    int32_t  nnodes;
    int32_t  peer;           /* P2P peer, collective root, -1 when none */
    int32_t  pid;
    int32_t  tid;
    int32_t  cuda_device;    /* -1 when unknown */
    uint64_t comm_hash;      /* identical on every rank of a communicator */
    uint64_t seq;            /* Coll: NCCL seqNumber (per func per comm); P2P: plugin counter per (comm, func, peer) */
    uint64_t count;          /* elements as the API call gave them when known */
    uint64_t bytes;          /* payload bytes */
    uint64_t stream;         /* cudaStream_t value, 0 when unknown */
    uint64_t enqueue_start_ns; /* Coll/P2p startEvent, CPU */
    uint64_t enqueue_end_ns;   /* Coll/P2p stopEvent (= enqueued), CPU */
    uint64_t complete_ns;      /* CPU time the last child stopped; 0 if not completed */
    uint64_t gpu_start_ns;     /* min KernelCh start pTimer; 0 when unknown */
    uint64_t gpu_end_ns;       /* max KernelCh stop pTimer; 0 when unknown */
    uint64_t record_seq;     /* per-process monotonically increasing record number */
    char     func[24];       /* "AllReduce", "Send", ... NUL-terminated */
    char     dtype[16];      /* "ncclFloat32", ... */
    char     algo[16];       /* "Ring", "Tree", ... empty for P2P */
    char     proto[16];      /* "Simple", "LL", "LL128" */
    char     comm_name[56];  /* copied commName (truncated), empty when NCCL gave none */
} ci_op_record;

/*
 * Shared-memory ring: a file <home>/shms/comminsight-<pid>-<start_ns>.ring
 * mapped by both sides: CI_RING_HEADER_SIZE bytes of header, then
 * `capacity` records. Single producer (the plugin's writer thread), single
 * consumer (the agent). head and tail are free-running counters; slot =
 * index & (capacity - 1). The producer writes the record, then publishes
 * head with a release store; the consumer reads head with an acquire load,
 * copies records, then advances tail with a release store. When the ring is
 * full the producer drops the record and increments `dropped`.
 * Requests from the consumer (on its own cache line, next to tail):
 *   seal_request       - the consumer increments it to ask the writer to seal
 *                        its open raw-log segment; the writer seals (when the
 *                        segment holds records) within one writer interval and
 *                        then stores the value it honoured in seal_done.
 *   inflight_report_ns - when non-zero, the writer's once-a-second scan puts
 *                        every operation in flight longer than this into the
 *                        ring, once, as a CI_STATE_INFLIGHT record (not into
 *                        the raw log): the agent's view of what is in flight,
 *                        at the agent's own threshold.
 */
typedef struct ci_ring_header {
    uint64_t magic;          /* CI_RING_MAGIC */
    uint32_t version;        /* CI_FORMAT_VERSION */
    uint32_t header_size;    /* CI_RING_HEADER_SIZE */
    uint32_t record_size;    /* CI_RECORD_SIZE */
    uint32_t capacity;       /* records, power of two */
    int32_t  writer_pid;
    uint32_t writer_closed;  /* 1 once the writer detached cleanly */
    uint64_t writer_start_ns; /* identifies this writer incarnation */
    uint64_t dropped;        /* records dropped because the ring was full */
    uint64_t lost;           /* records lost before the ring (pool empty, failed raw-log writes), plus completions that found every completion ring full */
    char     host[64];
    uint64_t seal_done;      /* producer: the last seal_request honoured */
    uint8_t  _pad0[64];      /* header block fills the first 192 bytes */
    uint64_t head;           /* written by the producer only; own cache line */
    uint8_t  _pad1[120];
    uint64_t tail;           /* written by the consumer only; own cache line */
    uint64_t seal_request;   /* consumer: increment to ask for a segment seal */
    uint64_t inflight_report_ns; /* consumer: report ops in flight longer than this (0: off) */
    uint8_t  _pad2[168];
} ci_ring_header;

/*
 * Raw-log segment: <home>/inspector_logs/<host>-<pid>-<start_ns>-<n>.cilog,
 * CI_LOG_HEADER_SIZE bytes of header then records back to back, append-only.
 * A segment being written has sealed == 0; the writer renames it to add the
 * suffix ".sealed" when it rotates (size or age) or at finalize. A reader
 * takes every whole record whose magic and checksum verify and ignores a
 * torn tail.
 */
typedef struct ci_log_header {
    uint64_t magic;          /* CI_LOG_MAGIC */
    uint32_t version;        /* CI_FORMAT_VERSION */
    uint32_t header_size;    /* CI_LOG_HEADER_SIZE */
    uint32_t record_size;    /* CI_RECORD_SIZE */
    int32_t  pid;
    uint64_t start_ns;       /* segment creation, CPU ns since epoch */
    uint32_t segment_index;  /* 0, 1, 2 ... per process */
    int32_t  local_rank;     /* LOCAL_RANK, -1 when unset */
    int32_t  global_rank;    /* RANK, -1 when unset */
    int32_t  world_size;     /* WORLD_SIZE, -1 when unset */
    char     host[64];
    char     workload_id[64];
    char     node_ip[64];
    uint8_t  _pad[272];
} ci_log_header;
/* CI_CDEF_END */

_Static_assert(sizeof(ci_op_record) == CI_RECORD_SIZE, "ci_op_record must be 256 bytes");
_Static_assert(sizeof(ci_ring_header) == CI_RING_HEADER_SIZE, "ci_ring_header must be 512 bytes");
_Static_assert(sizeof(ci_log_header) == CI_LOG_HEADER_SIZE, "ci_log_header must be 512 bytes");

#endif /* COMMINSIGHT_RING_H */
