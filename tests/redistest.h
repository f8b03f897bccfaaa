/* Redis servers for the remote tier's tests: started as child processes of
 * the test on unix sockets (or loopback ports, for a cluster) in a temp
 * dir, stopped (or killed, for the fault tests) by the test. Built only
 * where hiredis is (KVT_TEST_EXPECT_REDIS). */
#ifndef KVT_REDISTEST_H
#define KVT_REDISTEST_H

#include <stdbool.h>
#include <sys/types.h>

#include <hiredis.h>

typedef struct {
    pid_t pid;
    int port;                /* 0: the unix socket */
    char sock[160];          /* unix socket path */
    char endpoint[192];      /* unix:/... or redis://127.0.0.1:port */
    char addr[64];           /* 127.0.0.1:port (cluster nodes) */
} rsrv;

/* Whether redis-server and redis-cli are installed. */
bool rsrv_installed(void);
/* The temp dir every server of this process lives in (created once). */
const char *rsrv_dir(void);
/* Starts redis-server named `name` (its socket and files in rsrv_dir()):
 * port 0 = unix socket only; cluster = cluster-enabled; extra: more
 * "--option value" pairs (NULL-terminated argv tail, may be NULL). Waits
 * until it answers PING. */
void rsrv_start(rsrv *s, const char *name, int port, bool cluster, const char *const *extra);
/* SHUTDOWN NOSAVE (kill: SIGKILL at once), then reaps it. */
void rsrv_stop(rsrv *s, bool kill);
/* A connection (AUTH with password when not NULL). */
redisContext *rsrv_conn(const rsrv *s, const char *password);
/* One command; the reply is checked not to be an error and freed. */
void rsrv_cmd(const rsrv *s, const char *password, const char *fmt, ...);
/* Three masters on loopback ports from base; creates the cluster
 * (redis-cli --cluster create) and waits for cluster_state:ok on all. */
void rsrv_cluster(rsrv s[3], int base);

#endif /* KVT_REDISTEST_H */
