/*
 * config.c - ci_config: the profiler's settings, parsed once per runtime start.
 *
 * Precedence: environment COMMINSIGHT_<KEY> > <home>/etc/comminsight.conf
 * (`key = value` lines, '#' comments) > defaults. COMMINSIGHT_HOME comes from
 * the environment only (default /opt/comminsight). A bad value or an unknown
 * profiler key gets one warning and the default: never an error in training.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ci_internal.h"

#define CONF_MAX_BYTES (64 * 1024)

typedef enum { K_U32POW2, K_U32, K_U64, K_BOOL, K_STR, K_CHOICE } key_kind;

static const char* CLOCK_CHOICES[] = {"auto", "tsc", "monotonic", "coarse"};

typedef struct key_spec {
    const char* name;
    key_kind kind;
    uint64_t min, max, def;
    size_t offset;
} key_spec;

#define OFF(f) offsetof(ci_config, f)
static const key_spec KEYS[] = {
    {"pool_size", K_U32POW2, 64, 1u << 18, 16384, OFF(pool_size)},
    {"ring_capacity", K_U32POW2, 64, 1u << 22, 16384, OFF(ring_capacity)},
    {"log_segment_bytes", K_U64, 64 * 1024, 1ull << 40, 64ull << 20, OFF(log_segment_bytes)},
    {"log_segment_age_s", K_U64, 1, 86400 * 7, 300, OFF(log_segment_age_s)},
    {"hang_timeout_s", K_U64, 0, 86400 * 7, 300, OFF(hang_timeout_s)},
    {"writer_interval_ms", K_U32, 1, 10000, 5, OFF(writer_interval_ms)},
    {"agent_autostart", K_BOOL, 0, 1, 1, OFF(agent_autostart)},
    {"ring_enable", K_BOOL, 0, 1, 1, OFF(ring_enable)},
    {"log_enable", K_BOOL, 0, 1, 1, OFF(log_enable)},
    {"workload_id", K_STR, 0, 0, 0, OFF(workload_id)},
    {"clock", K_CHOICE, 0, 0, 0, OFF(clock)},
};
#define NKEYS (sizeof(KEYS) / sizeof(KEYS[0]))

/* Keys of the shared conf file that belong to the agent: not ours, not unknown. */
static int foreign_key(const char* key) {
    static const char* prefixes[] = {"agent_", "common_", "site_", "archive_", "node_", "host_", "server_"};
    for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++)
        if (strncmp(key, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

static char* trim(char* s) {
    while (isspace((unsigned char)*s)) s++;
    char* e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
    return s;
}

/* Returns 0 and sets *out when `text` is a valid value for `k`, else -1. */
static int parse_value(const key_spec* k, const char* text, uint64_t* out) {
    if (k->kind == K_BOOL) {
        static const char* yes[] = {"1", "true", "yes", "on"};
        static const char* no[] = {"0", "false", "no", "off"};
        for (int i = 0; i < 4; i++) {
            if (strcasecmp(text, yes[i]) == 0) return *out = 1, 0;
            if (strcasecmp(text, no[i]) == 0) return *out = 0, 0;
        }
        return -1;
    }
    if (k->kind == K_CHOICE) {
        for (uint64_t i = 0; i < sizeof(CLOCK_CHOICES) / sizeof(CLOCK_CHOICES[0]); i++)
            if (strcmp(text, CLOCK_CHOICES[i]) == 0) return *out = i, 0;
        return -1;
    }
    if (*text == '\0' || !isdigit((unsigned char)*text)) return -1;
    errno = 0;
    char* end = NULL;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0' || v < k->min || v > k->max) return -1;
    if (k->kind == K_U32POW2 && (v & (v - 1)) != 0) return -1;
    *out = v;
    return 0;
}

static void set_field(ci_config* cfg, const key_spec* k, uint64_t v) {
    char* base = (char*)cfg + k->offset;
    switch (k->kind) {
    case K_U32POW2:
    case K_U32: *(uint32_t*)base = (uint32_t)v; break;
    case K_U64: *(uint64_t*)base = v; break;
    case K_BOOL: *(int*)base = (int)v; break;
    case K_STR: break;
    case K_CHOICE: ci_copy_str(base, 16, CLOCK_CHOICES[v]); break;
    }
}

/* Applies one `key`/`value` pair from `source`; warns (once per call) when it is bad. */
static void apply(ci_config* cfg, const key_spec* k, const char* value, const char* source) {
    if (k->kind == K_STR) {
        if (strlen(value) >= sizeof(cfg->workload_id)) {
            ci_warn("%s: %s is too long, ignored", source, k->name);
            return;
        }
        ci_copy_str(cfg->workload_id, sizeof(cfg->workload_id), value);
        return;
    }
    uint64_t v;
    if (parse_value(k, value, &v) != 0) {
        char shown[48];
        ci_copy_str(shown, sizeof(shown), value);
        if (k->kind == K_CHOICE) ci_warn("%s: bad value '%s' for %s, using the default %s", source, shown, k->name,
                                         CLOCK_CHOICES[k->def]);
        else ci_warn("%s: bad value '%s' for %s, using the default %llu", source, shown, k->name,
                     (unsigned long long)k->def);
        set_field(cfg, k, k->def);
        return;
    }
    set_field(cfg, k, v);
}

static void env_name(const char* key, char* out, size_t cap) {
    size_t n = (size_t)snprintf(out, cap, "COMMINSIGHT_%s", key);
    for (size_t i = 12; i < n && i < cap; i++) out[i] = (char)toupper((unsigned char)out[i]);
}

static void load_file(ci_config* cfg, const char* path, uint8_t* seen_in_env) {
    FILE* f = fopen(path, "r");
    if (f == NULL) return; /* no conf file is normal */
    char line[1024];
    size_t total = 0;
    int lineno = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        lineno++;
        total += strlen(line);
        if (total > CONF_MAX_BYTES) {
            ci_warn("%s: larger than %d bytes, the rest is ignored", path, CONF_MAX_BYTES);
            break;
        }
        if (strchr(line, '\n') == NULL && !feof(f)) {
            ci_warn("%s:%d: line too long, ignored", path, lineno);
            int c;
            while ((c = fgetc(f)) != EOF && c != '\n') total++;
            continue;
        }
        char* s = trim(line);
        if (*s == '\0' || *s == '#') continue;
        char* eq = strchr(s, '=');
        if (eq == NULL) {
            ci_warn("%s:%d: expected 'key = value', ignored", path, lineno);
            continue;
        }
        *eq = '\0';
        char* key = trim(s);
        char* value = trim(eq + 1);
        const key_spec* k = NULL;
        size_t idx = 0;
        for (; idx < NKEYS; idx++)
            if (strcmp(KEYS[idx].name, key) == 0) {
                k = &KEYS[idx];
                break;
            }
        if (k == NULL) {
            if (!foreign_key(key) && strcmp(key, "home") != 0) ci_warn("%s:%d: unknown key '%.40s', ignored", path, lineno, key);
            continue;
        }
        if (!seen_in_env[idx]) apply(cfg, k, value, path);
    }
    fclose(f);
}

int ci_config_load(ci_config* cfg) {
    memset(cfg, 0, sizeof(*cfg));
    const char* home = getenv("COMMINSIGHT_HOME");
    if (home == NULL || *home == '\0') home = "/opt/comminsight";
    if (strlen(home) >= sizeof(cfg->home) - 64) {
        ci_warn("COMMINSIGHT_HOME is too long, using /opt/comminsight");
        home = "/opt/comminsight";
    }
    ci_copy_str(cfg->home, sizeof(cfg->home), home);
    for (size_t i = 0; i < NKEYS; i++) set_field(cfg, &KEYS[i], KEYS[i].def);

    uint8_t seen_in_env[NKEYS] = {0};
    for (size_t i = 0; i < NKEYS; i++) {
        char name[64];
        env_name(KEYS[i].name, name, sizeof(name));
        const char* v = getenv(name);
        if (v != NULL) {
            seen_in_env[i] = 1;
            apply(cfg, &KEYS[i], v, name);
        }
    }
    char path[CI_PATH_MAX + 32];
    snprintf(path, sizeof(path), "%s/etc/comminsight.conf", cfg->home);
    load_file(cfg, path, seen_in_env);

    if (cfg->workload_id[0] == '\0') {
        /* the launcher's job id, identical on every node of a job */
        static const char* launchers[] = {"SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID"};
        for (size_t i = 0; i < 4; i++) {
            const char* v = getenv(launchers[i]);
            if (v != NULL && *v != '\0') {
                ci_copy_str(cfg->workload_id, sizeof(cfg->workload_id), v);
                break;
            }
        }
    }
    return 0;
}
