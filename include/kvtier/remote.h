/* libkvtier - the remote tier: the prefix cache shared by engine processes
 * on many machines through Redis (a single node or a Redis Cluster).
 *
 * A pool created with KVT_POOL_PREFIX_CACHE and kvt_pool_opts.remote
 * pointing at these options adds a fourth tier behind device, host and
 * disk. What goes there: every page position the prefix cache keys (the
 * P token ids of a full page, in every layer and KV head) becomes one
 * value, written once, when the position is first keyed in this pool
 * (write-behind: the caller's thread copies the page's blocks into a
 * bounded queue; the remote tier's own threads send them), and again when
 * kvt_seq_remote_push asks (with KVT_REMOTE_NO_PUT, only then). A value is
 * self-describing and CRC32C-checked (kvtier-remote(5)); its key names the
 * namespace (key_prefix, a hash of the model fingerprint, the geometry and
 * the dtype) and a 128-bit chained hash of the salt and every token id up
 * to the page's end, so a value only ever serves the same tokens of the
 * same model under the same salt.
 *
 * What comes back: kvt_seq_create with a prefix first attaches what the
 * local tiers have; if the prefix has more whole pages, the remote tier is
 * asked for them (pipelined GETs, several connections) and the call
 * returns. The sequence is *loading* until kvt_seq_prefix_wait has landed
 * the answers: a step, append, fork, truncate, save, warm-up, push or
 * kvt_seq_tokens_set on it is KVT_EAGAIN (its length is not known yet).
 * kvt_seq_prefix_wait lands what arrived - the longest run of valid values
 * that continues the local match, appended as the engine's prefill would
 * be and keyed in the local prefix cache - and reports the sequence's
 * prefix_tokens, local and remote; the engine prefills the rest.
 *
 * Faults: a node down, a timeout, a refused AUTH, an evicted key or a value
 * that fails its checks is a miss, never an error for the request and
 * never wrong data. It is counted (kvt_stats.remote_*) and reported
 * through the log callback; a node that failed is left alone for retry_ms,
 * doubling with every further failure up to 64 x, not tried on every
 * call. The local tiers never lose anything because the remote one failed.
 *
 * Built when hiredis is found at build time; a build without it returns
 * KVT_ENOTSUP from kvt_pool_create for a pool with remote options (and
 * kvt_remote_flush says the same).
 *
 * Thread safety: as the pool's. The log callback is called from the remote
 * tier's threads and from the caller's, one call at a time.
 */
#ifndef KVTIER_REMOTE_H
#define KVTIER_REMOTE_H

#include "kvtier/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* kvt_remote_opts.flags */
#define KVT_REMOTE_NO_PUT (1u << 0) /* no write-behind: this pool writes only what
                                       kvt_seq_remote_push asks for */
#define KVT_REMOTE_NO_GET (1u << 1) /* write only: kvt_seq_create asks nothing */

/* One line about a remote fault or state change (no trailing newline). */
typedef void (*kvt_remote_log_fn)(void *ctx, const char *msg);

typedef struct kvt_remote_opts {
    uint32_t struct_size;       /* sizeof(kvt_remote_opts) */
    uint32_t flags;             /* KVT_REMOTE_* */
    const char *endpoints;      /* required: comma-separated
                                   redis://host:port or unix:/path/to/socket;
                                   a cluster's seed nodes (any of them will
                                   do: the slot map is read from the first
                                   that answers) or the one server */
    const char *user;           /* ACL user for AUTH; NULL = the default user */
    const char *password;       /* NULL = no AUTH */
    const char *fingerprint;    /* required, non-empty: the model's identity
                                   (a weights hash, a revision); pools of
                                   different fingerprints never share values */
    const char *key_prefix;     /* NULL = "kvt": keys are
                                   PREFIX:NAMESPACE:CHAINHASH */
    uint32_t connect_timeout_ms; /* 0 = 1000 */
    uint32_t io_timeout_ms;     /* a reply later than this is a fault; 0 = 1000 */
    uint32_t retry_ms;          /* first back-off after a node's fault; 0 = 500 */
    uint32_t n_connections;     /* threads, each with one connection to each
                                   node; 1..64, 0 = 2 */
    uint32_t pipeline;          /* commands in flight per connection;
                                   1..4096, 0 = about 4 MiB of values
                                   (4 MiB / a value's bytes, 1..32) */
    uint32_t ttl_s;             /* values expire after this; 0 = never (the
                                   server's eviction policy decides) */
    uint64_t queue_bytes;       /* values waiting to be written, at most; a
                                   value that does not fit is not written
                                   (kvt_stats.remote_put_dropped); 0 = 256 MiB */
    kvt_remote_log_fn log;      /* NULL = silent */
    void *log_ctx;
} kvt_remote_opts;

#define KVT_REMOTE_OPTS_INIT { (uint32_t)sizeof(kvt_remote_opts), 0, NULL, NULL, NULL, NULL, \
                               NULL, 0, 0, 0, 0, 0, 0, 0, NULL, NULL }
/* Fills *opts with the defaults (the zeros above, written out). */
KVT_API int kvt_remote_opts_init(kvt_remote_opts *opts);

/* Lands the remote pages of a loading sequence. timeout_ms: how long to
 * wait for the answers (0 = do not wait: KVT_EAGAIN while they are not all
 * in; UINT32_MAX = until they are: each reply is bounded by the io
 * timeout, a server answering slowly but steadily is waited for). On 0,
 * *prefix_tokens (may be NULL) = the sequence's prefix_tokens: the tokens
 * attached from the local tiers and landed from the remote one; the
 * sequence is no longer loading. A sequence that is not loading returns 0
 * at once. A value that cannot be landed (the device tier is full) ends
 * the landing there: what landed stays, the rest is a miss. */
KVT_API int kvt_seq_prefix_wait(kvt_pool *pool, kvt_seq_id seq, uint32_t timeout_ms,
                                uint32_t *prefix_tokens);

/* Writes every keyed page position of the sequence to the remote tier
 * again, whoever wrote it before (queued like the write-behind;
 * kvt_remote_flush waits for them); also in a pool with KVT_REMOTE_NO_PUT,
 * whose engine writes only the sequences it chooses - a finished
 * conversation, at release. *n_values (may be NULL) = the values queued (a
 * full queue drops the rest: kvt_stats.remote_put_dropped). KVT_ENOTSUP
 * without a remote tier; KVT_EAGAIN while the sequence is loading;
 * KVT_ESTATE while an open step includes it. */
KVT_API int kvt_seq_remote_push(kvt_pool *pool, kvt_seq_id seq, uint32_t *n_values);

/* Waits until every value queued for writing has been written or given up
 * (a fault), at most timeout_ms (KVT_ETIMEDOUT). KVT_ENOTSUP for a pool
 * without a remote tier. */
KVT_API int kvt_remote_flush(kvt_pool *pool, uint32_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_REMOTE_H */
