/*
 * log.c - warnings (NCCL's logger and stderr), clocks and small helpers.
 *
 * Warnings go to stderr (NCCL prints nothing unless NCCL_DEBUG is set, and a
 * degraded profiler must say so) and to NCCL's logger when init gave one.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ci_internal.h"

#define NCCL_LOG_WARN 2
static _Atomic(ncclDebugLogger_t) g_logger;

void ci_log_set_logger(ncclDebugLogger_t fn) { atomic_store(&g_logger, fn); }

void ci_warn(const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    fprintf(stderr, "comminsight: warning: %s\n", buf);
    ncclDebugLogger_t fn = atomic_load(&g_logger);
    if (fn != NULL) fn(NCCL_LOG_WARN, ~0ul, "comminsight", 0, "CommInsight profiler: %s", buf);
}

uint64_t ci_realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t ci_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int ci_tick_source;

static double cost_ns(int source) {
    int saved = ci_tick_source;
    ci_tick_source = source;
    uint64_t sink = 0;
    for (int i = 0; i < 200; i++) sink += ci_ticks(); /* warm */
    uint64_t t0 = ci_monotonic_ns();
    for (int i = 0; i < 2000; i++) sink += ci_ticks();
    uint64_t t1 = ci_monotonic_ns();
    ci_tick_source = saved;
    __asm__ volatile("" : : "r"(sink));
    return (double)(t1 - t0) / 2000.0;
}

int ci_clock_select(const char* mode) {
    if (strcmp(mode, "tsc") == 0) ci_tick_source = 0;
    else if (strcmp(mode, "monotonic") == 0) ci_tick_source = 1;
    else if (strcmp(mode, "coarse") == 0) ci_tick_source = 2;
    else ci_tick_source = cost_ns(1) < cost_ns(0) ? 1 : 0; /* auto */
    return ci_tick_source;
}

/* A first slope from a 2 ms sample; the writer refines it over an ever longer baseline. */
void ci_clock_calibrate(ci_clock* c) {
    uint64_t t0 = ci_ticks(), r0 = ci_realtime_ns(), m0 = ci_monotonic_ns();
    struct timespec nap = {0, 2000000};
    nanosleep(&nap, NULL);
    uint64_t t1 = ci_ticks(), m1 = ci_monotonic_ns();
    c->ns_per_tick = (t1 > t0) ? (double)(m1 - m0) / (double)(t1 - t0) : 1.0;
    c->tick0 = c->tick_anchor = t0;
    c->rt0 = c->rt_anchor = r0;
}

void ci_clock_anchor(ci_clock* c) {
    uint64_t t = ci_ticks(), r = ci_realtime_ns();
    /* refine the slope once the baseline is long enough for jitter not to matter (> 1 s) */
    if (t > c->tick0 && r > c->rt0 + 1000000000ull) c->ns_per_tick = (double)(r - c->rt0) / (double)(t - c->tick0);
    c->tick_anchor = t;
    c->rt_anchor = r;
}

uint64_t ci_clock_to_ns(const ci_clock* c, uint64_t ticks) {
    if (ticks == 0) return 0;
    double delta = (double)(int64_t)(ticks - c->tick_anchor) * c->ns_per_tick;
    return (uint64_t)((int64_t)c->rt_anchor + (int64_t)delta);
}

void ci_copy_str(char* dst, size_t cap, const char* src) {
    size_t n = src != NULL ? strnlen(src, cap - 1) : 0;
    if (n != 0) memcpy(dst, src, n);
    dst[n] = '\0';
}

int ci_mkdirs(const char* path) {
    char tmp[CI_PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof(tmp)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(tmp, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (tmp[i] == '/' || tmp[i] == '\0') {
            char saved = tmp[i];
            tmp[i] = '\0';
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
            tmp[i] = saved;
        }
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode) || access(path, W_OK) != 0) {
        if (errno == 0) errno = ENOTDIR;
        return -1;
    }
    return 0;
}

pid_t ci_gettid(void) { return (pid_t)syscall(SYS_gettid); }
