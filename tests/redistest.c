/* Redis servers for the remote tier's tests (tests/redistest.h). */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "redistest.h"

static char rs_dir[128];

static void rs_cleanup(void)
{
    if (rs_dir[0]) {
        char cmd[160];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", rs_dir);
        if (system(cmd)) {
        }
    }
}

bool rsrv_installed(void)
{
    return system("command -v redis-server >/dev/null 2>&1 && "
                  "command -v redis-cli >/dev/null 2>&1") == 0;
}

const char *rsrv_dir(void)
{
    if (!rs_dir[0]) {
        snprintf(rs_dir, sizeof rs_dir, "/tmp/kvt-redis-XXXXXX");
        if (!mkdtemp(rs_dir))
            fail_msg("mkdtemp failed");
        atexit(rs_cleanup);
    }
    return rs_dir;
}

static void rs_nap(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

void rsrv_start(rsrv *s, const char *name, int port, bool cluster, const char *const *extra)
{
    memset(s, 0, sizeof *s);
    const char *dir = rsrv_dir();
    char portb[16], conf[200], log[200];
    s->port = port;
    snprintf(s->sock, sizeof s->sock, "%s/%s.sock", dir, name);
    snprintf(portb, sizeof portb, "%d", port);
    snprintf(conf, sizeof conf, "%s/%s.nodes.conf", dir, name);
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    if (port) {
        snprintf(s->endpoint, sizeof s->endpoint, "redis://127.0.0.1:%d", port);
        snprintf(s->addr, sizeof s->addr, "127.0.0.1:%d", port);
    } else {
        snprintf(s->endpoint, sizeof s->endpoint, "unix:%s", s->sock);
    }
    const char *argv[64] = {"redis-server", "--port", portb, "--bind", "127.0.0.1",
                            "--unixsocket", s->sock, "--unixsocketperm", "700",
                            "--dir", dir, "--save", "", "--appendonly", "no",
                            "--logfile", log, "--daemonize", "no"};
    int argc = 19;
    if (cluster) {
        const char *c[] = {"--cluster-enabled", "yes", "--cluster-config-file", conf,
                           "--cluster-node-timeout", "2000"};
        for (int i = 0; i < 6; i++)
            argv[argc++] = c[i];
    }
    for (int i = 0; extra && extra[i] && argc < 62; i++)
        argv[argc++] = extra[i];
    argv[argc] = NULL;
    unlink(conf);
    s->pid = fork();
    if (s->pid == 0) {
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    if (s->pid < 0)
        fail_msg("fork failed");
    for (int i = 0; i < 200; i++) {
        redisContext *c = redisConnectUnix(s->sock);
        if (c && !c->err) {
            redisReply *r = redisCommand(c, "PING");
            bool up = r && (r->type == REDIS_REPLY_STATUS ||
                            (r->type == REDIS_REPLY_ERROR && strstr(r->str, "NOAUTH")));
            if (r)
                freeReplyObject(r);
            redisFree(c);
            if (up)
                return;
        } else if (c) {
            redisFree(c);
        }
        rs_nap(25);
    }
    fail_msg("redis-server %s did not start (see %s)", name, log);
}

void rsrv_stop(rsrv *s, bool kill_it)
{
    if (s->pid <= 0)
        return;
    if (!kill_it) {
        redisContext *c = redisConnectUnix(s->sock);
        if (c && !c->err) {
            redisReply *r = redisCommand(c, "SHUTDOWN NOSAVE");
            if (r)
                freeReplyObject(r);
        }
        if (c)
            redisFree(c);
    }
    for (int i = 0; i < 100; i++) { /* give SHUTDOWN 2.5 s, then SIGKILL */
        if (kill_it || i == 99)
            kill(s->pid, SIGKILL);
        if (waitpid(s->pid, NULL, WNOHANG) == s->pid)
            break;
        if (!kill_it)
            rs_nap(25);
    }
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

redisContext *rsrv_conn(const rsrv *s, const char *password)
{
    redisContext *c = redisConnectUnix(s->sock);
    if (!c || c->err)
        fail_msg("cannot connect to %s", s->sock);
    if (password) {
        redisReply *r = redisCommand(c, "AUTH %s", password);
        if (!r || r->type == REDIS_REPLY_ERROR)
            fail_msg("AUTH failed");
        freeReplyObject(r);
    }
    return c;
}

void rsrv_cmd(const rsrv *s, const char *password, const char *fmt, ...)
{
    redisContext *c = rsrv_conn(s, password);
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    if (!r || r->type == REDIS_REPLY_ERROR)
        fail_msg("'%s': %s", fmt, r ? r->str : c->errstr);
    freeReplyObject(r);
    redisFree(c);
}

void rsrv_cluster(rsrv s[3], int base)
{
    char name[16];
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "node%d", i);
        rsrv_start(&s[i], name, base + i, true, NULL);
    }
    char cmd[512];
    snprintf(cmd, sizeof cmd, "redis-cli --cluster create %s %s %s --cluster-yes "
             ">'%s/cluster-create.log' 2>&1", s[0].addr, s[1].addr, s[2].addr, rsrv_dir());
    if (system(cmd))
        fail_msg("redis-cli --cluster create failed (see %s/cluster-create.log)", rsrv_dir());
    for (int i = 0; i < 3; i++) {
        int ok = 0;
        for (int t = 0; t < 400 && !ok; t++) {
            redisContext *c = rsrv_conn(&s[i], NULL);
            redisReply *r = redisCommand(c, "CLUSTER INFO");
            ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
            if (r)
                freeReplyObject(r);
            redisFree(c);
            if (!ok)
                rs_nap(25);
        }
        if (!ok)
            fail_msg("cluster node %s never reached cluster_state:ok", s[i].addr);
    }
}
