/*
 * autostart.c - start the node agent from local rank 0 when none runs.
 *
 * Single instance by flock on <home>/agent.lock: the profiler takes the lock
 * without waiting; if another process holds it an agent (or its starter)
 * is alive and nothing happens. Otherwise the agent is started fully
 * detached (fork, setsid, fork again, stdio on /dev/null, other fds closed)
 * and inherits the locked descriptor (COMMINSIGHT_AGENT_LOCK_FD), so the lock
 * lives exactly as long as the agent. COMMINSIGHT_LIFELINE_PID names this
 * process: the agent stops cleanly (final seal) once it has ended, however it
 * ended (comminsight.lifeline). Off with COMMINSIGHT_AGENT_AUTOSTART=0;
 * a missing binary is a warning. Runs at init, never on the event path.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ci_internal.h"

extern char** environ;

static int local_rank(void) {
    static const char* names[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        const char* v = getenv(names[i]);
        if (v != NULL && *v != '\0') return atoi(v);
    }
    return -1;
}

void ci_autostart_agent(const ci_config* cfg) {
    static atomic_int attempted;
    if (!cfg->agent_autostart || local_rank() != 0) return;
    if (atomic_exchange(&attempted, 1)) return; /* once per process */

    char bin[CI_PATH_MAX + 32], lock[CI_PATH_MAX + 32], fdvar[48], lifevar[48];
    snprintf(bin, sizeof(bin), "%s/bin/comminsight-agent", cfg->home);
    snprintf(lock, sizeof(lock), "%s/agent.lock", cfg->home);
    if (access(bin, X_OK) != 0) {
        ci_warn("agent autostart: %s not found or not executable (set COMMINSIGHT_AGENT_AUTOSTART=0 to silence)",
                bin);
        return;
    }
    int fd = open(lock, O_RDWR | O_CREAT, 0644); /* no O_CLOEXEC: the agent inherits it */
    if (fd < 0) {
        ci_warn("agent autostart: cannot open %s: %s", lock, strerror(errno));
        return;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        close(fd); /* an agent already holds it */
        return;
    }
    snprintf(fdvar, sizeof(fdvar), "COMMINSIGHT_AGENT_LOCK_FD=%d", fd);
    /* the agent's lifeline (comminsight.lifeline): it stops, with a final seal, once this process ends */
    snprintf(lifevar, sizeof(lifevar), "COMMINSIGHT_LIFELINE_PID=%d", (int)getpid());

    /* everything the child needs is prepared before fork: after it only async-signal-safe calls */
    size_t n = 0;
    while (environ[n] != NULL) n++;
    char** envp = calloc(n + 3, sizeof(char*));
    if (envp == NULL) {
        close(fd);
        return;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "COMMINSIGHT_AGENT_LOCK_FD=", 26) != 0 &&
            strncmp(environ[i], "COMMINSIGHT_LIFELINE_PID=", 25) != 0)
            envp[k++] = environ[i];
    envp[k++] = fdvar;
    envp[k++] = lifevar;
    envp[k] = NULL;
    char* argv[] = {bin, NULL};
    long maxfd = sysconf(_SC_OPEN_MAX);
    if (maxfd < 0 || maxfd > 65536) maxfd = 65536;

    pid_t child = fork();
    if (child == 0) {
        setsid();
        if (fork() != 0) _exit(0);
        int devnull = open("/dev/null", O_RDWR);
        if (devnull >= 0) {
            dup2(devnull, 0);
            dup2(devnull, 1);
            dup2(devnull, 2);
        }
        for (int i = 3; i < maxfd; i++)
            if (i != fd) close(i);
        if (chdir("/") != 0) _exit(127);
        execve(bin, argv, envp);
        _exit(127);
    }
    if (child > 0) {
        while (waitpid(child, NULL, 0) < 0 && errno == EINTR) {
        }
    } else {
        ci_warn("agent autostart: fork failed: %s", strerror(errno));
    }
    free(envp);
    close(fd); /* the agent keeps its own copy of the locked descriptor */
}
