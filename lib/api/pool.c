/* The KV pool: options, tier arenas, the metadata store and stats. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/store.h"
#include "../attn/kernels.h"
#include "../select/select_int.h"
#include "../backend/backend.h"
#include "../step/step.h"
#include "../policy/policy_int.h"
#include "../tier/tier.h"
#include "api_int.h"

/* Sizes of the first released layouts (0.1): smaller struct_size values are
 * rejected. Pinned, never sizeof of the current struct, so that appending a
 * field keeps old callers working. */
#define KVT__POOL_OPTS_V1 136u
#define KVT__POOL_STATS_V1 328u
_Static_assert(offsetof(kvt_pool_opts, target_tokens) + 8 == KVT__POOL_OPTS_V1 &&
               offsetof(kvt_pool_opts, prefix_cache_bytes) == KVT__POOL_OPTS_V1,
               "pool opts v1, then the prefix cache's caps");
_Static_assert(offsetof(kvt_pool_opts, remote) == 160 && offsetof(kvt_stats, remote_fetches) == 408,
               "the second layouts end where the remote tier's fields begin");
_Static_assert(offsetof(kvt_stats, paused_seqs) + 8 == KVT__POOL_STATS_V1 &&
               offsetof(kvt_stats, prefix_lookups) == KVT__POOL_STATS_V1,
               "stats v1, then the prefix cache's");

/* Pool tags for sequence ids; a counter so that pools created one after
 * another never share a tag until 2047 pools later. */
static _Atomic uint32_t kvt__next_tag = 0;
#define KVT__KNOWN_POOL_FLAGS (KVT_POOL_HUGEPAGES | KVT_POOL_PREFIX_CACHE)

KVT_API int kvt_pool_opts_init(kvt_pool_opts *opts)
{
    KVT__CHECK_NULL(opts);
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
    opts->backend = KVT_BACKEND_AUTO;
    opts->geom.page_tokens = 16;
    opts->geom.dtype = KVT_DTYPE_F16;
    opts->host_numa = KVT_NUMA_LOCAL;
    opts->max_seqs = KVT_MAX_SEQS_DEFAULT;
    opts->max_seq_tokens = KVT_MAX_SEQ_TOKENS_DEFAULT;
    return 0;
}

/* Turns a byte capacity into a block count that fits the 32-bit block ids. */
static int kvt__blocks_for(uint64_t bytes, uint64_t block_bytes, const char *field,
                           uint32_t *out)
{
    uint64_t n = bytes / block_bytes;
    if (n > UINT32_MAX - 1u)
        return kvt__err(KVT_EOVERFLOW,
                        "%s: %llu bytes are %llu blocks of %llu bytes; at most %u fit "
                        "32-bit block ids",
                        field, (unsigned long long)bytes, (unsigned long long)n,
                        (unsigned long long)block_bytes, UINT32_MAX - 1u);
    if (n < 2)
        return kvt__err(KVT_EINVAL,
                        "%s: %llu bytes hold %llu blocks of %llu bytes; at least 2 are "
                        "needed (block 0 is the null block)",
                        field, (unsigned long long)bytes, (unsigned long long)n,
                        (unsigned long long)block_bytes);
    *out = (uint32_t)n;
    return 0;
}

static int kvt__validate_opts(const kvt_pool_opts *o, kvt_pool *p)
{
    int rc = kvt__geometry_resolve(&o->geom, &p->g);
    if (rc)
        return rc;
    if (o->backend > KVT_BACKEND_CUDA)
        return kvt__err(KVT_EINVAL, "opts->backend: %u is not a backend (auto, cpu or cuda)",
                        o->backend);
    if (o->flags & ~KVT__KNOWN_POOL_FLAGS)
        return kvt__err(KVT_EINVAL, "opts->flags: unknown bits 0x%x",
                        o->flags & ~KVT__KNOWN_POOL_FLAGS);
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        if (o->prefix_cache_bytes[t] && !(o->flags & KVT_POOL_PREFIX_CACHE))
            return kvt__err(KVT_EINVAL, "opts->prefix_cache_bytes[%u]: %llu without "
                            "KVT_POOL_PREFIX_CACHE in opts->flags", t,
                            (unsigned long long)o->prefix_cache_bytes[t]);
    if (o->host_numa > KVT_NUMA_INTERLEAVE)
        return kvt__err(KVT_EINVAL, "opts->host_numa: %u is not a NUMA policy (local, node or "
                        "interleave)", o->host_numa);
    if (o->host_numa == KVT_NUMA_NODE && !kvt__numa_node_ok(o->host_numa_node))
        return kvt__err(KVT_EINVAL, "opts->host_numa_node: node %d does not exist or has no "
                        "memory this process may use (highest node %d)",
                        o->host_numa_node, kvt__numa_max_node());
    p->max_seqs = o->max_seqs ? o->max_seqs : KVT_MAX_SEQS_DEFAULT;
    if (p->max_seqs > KVT_MAX_SEQS_LIMIT)
        return kvt__err(KVT_EINVAL, "opts->max_seqs: %u is above the limit %u", o->max_seqs,
                        KVT_MAX_SEQS_LIMIT);
    p->max_seq_tokens = o->max_seq_tokens ? o->max_seq_tokens : KVT_MAX_SEQ_TOKENS_DEFAULT;
    if (p->max_seq_tokens > KVT_MAX_SEQ_TOKENS_LIMIT)
        return kvt__err(KVT_EINVAL, "opts->max_seq_tokens: %u is above the limit %u",
                        o->max_seq_tokens, KVT_MAX_SEQ_TOKENS_LIMIT);
    if (o->n_threads > 1024)
        return kvt__err(KVT_EINVAL, "opts->n_threads: %u is above the limit 1024",
                        o->n_threads);
    if (o->policy) {
        int rc2 = kvt__geometry_same(&o->policy->g, &p->g, "opts->policy", "the policy",
                                     "the pool");
        if (rc2)
            return rc2;
        if (o->host_bytes == 0)
            return kvt__err(KVT_EINVAL, "opts->policy: tiered placement needs a host tier "
                            "(host_bytes), where stable heads' pages go");
    }
    if (o->selector) {
        int rc2 = kvt__selector_match(o->selector, p);
        if (rc2)
            return rc2;
    }
    if (o->device_bytes == 0 && o->target_tokens == 0)
        return kvt__err(KVT_EINVAL, "opts->device_bytes: must be set (the device tier size), "
                        "or target_tokens to size it");
    if ((o->disk_bytes != 0) != (o->disk_dir != NULL))
        return kvt__err(KVT_EINVAL, "%s", o->disk_dir ? "opts->disk_bytes: 0 with disk_dir set"
                                                      : "opts->disk_dir: NULL with disk_bytes set");
    if (o->disk_dir) {
        struct stat st;
        char b[KVT__BRIEF_MAX];
        if (stat(o->disk_dir, &st) != 0 || !S_ISDIR(st.st_mode))
            return kvt__err(KVT_EINVAL, "opts->disk_dir: '%s' is not an existing directory",
                            kvt__brief(o->disk_dir, b));
        if (o->host_bytes == 0)
            return kvt__err(KVT_EINVAL, "opts->host_bytes: the disk tier needs a host tier "
                            "(the host tier is the cache over the disk)");
    }
    return 0;
}

KVT_API int kvt_pool_create(const kvt_pool_opts *opts, kvt_pool **out)
{
    kvt_pool_opts o;
    uint32_t n_dev = 0, n_host = 0;
    kvt_mover_opts mo;
    int rc;

    KVT__CHECK_NULL(out);
    *out = NULL;
    KVT__CHECK_NULL(opts);
    rc = kvt__opts_copy(&o, sizeof o, opts, KVT__POOL_OPTS_V1, "opts");
    if (rc)
        return rc;

    kvt_pool *p = calloc(1, sizeof *p);
    if (!p)
        return kvt__err(KVT_ENOMEM, "kvt_pool_create: cannot allocate the pool");
    rc = kvt__validate_opts(&o, p);
    if (rc)
        goto fail;
    rc = kvt__mover_opts_resolve(o.mover, &mo);
    if (rc)
        goto fail;

    p->tag = (kvt__next_tag++ % ((1u << KVT__ID_TAG_BITS) - 1u)) + 1u;
    p->elem = kvt_dtype_size(p->g.dtype);
    p->block_bytes = 2ull * p->g.page_tokens * p->g.head_dim * p->elem;
    p->meta_bytes = 3ull * p->g.head_dim * p->elem;
    p->n_q_heads = p->g.n_q_heads;
    p->flags = o.flags;
    p->n_threads = o.n_threads;
    if (p->n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        p->n_threads = n > 0 ? (uint32_t)n : 1u;
    }

    if (o.device_bytes == 0) { /* sized from the targets */
        kvt_pool_sizing sz = {.struct_size = sizeof sz};
        rc = kvt_pool_sizing_get(&o, &sz);
        if (rc)
            goto fail;
        o.device_bytes = sz.device_bytes;
    }
    p->pol = o.policy;
    p->sel = o.selector;
    rc = kvt__blocks_for(o.device_bytes, p->block_bytes, "opts->device_bytes", &n_dev);
    if (rc)
        goto fail;
    if (o.host_bytes) {
        rc = kvt__blocks_for(o.host_bytes, p->block_bytes, "opts->host_bytes", &n_host);
        if (rc)
            goto fail;
    }
    if (o.disk_dir) {
        rc = kvt__disk_open(p, o.disk_dir, o.disk_bytes, &mo, &p->disk);
        if (rc)
            goto fail;
        p->on_table_grow = kvt__disk_seq_reserve; /* its extent table follows */
    }
    /* Every page has a copy in some tier, so the usable blocks of all tiers
     * bound the number of pages the metadata store must describe. */
    uint64_t meta_slots = 1ull + (n_dev - 1u) + (n_host ? n_host - 1u : 0u);
    if (p->disk)
        meta_slots += (uint64_t)p->disk->n_ext * p->disk->E;
    if (meta_slots > UINT32_MAX) {
        rc = kvt__err(KVT_EOVERFLOW, "opts->disk_bytes: the tiers together exceed 2^32 pages "
                      "(the metadata store's slot ids)");
        goto fail;
    }

    /* AUTO resolves to the CPU until the CUDA backend has run on a GPU. */
    const bool cuda = o.backend == KVT_BACKEND_CUDA;
    p->backend = cuda ? KVT_BACKEND_CUDA : KVT_BACKEND_CPU;

    /* The CPU backend's device tier is what sparse decode reads at random
     * across gigabytes: huge pages spare the TLB and the page-fault cost.
     * The CUDA backend's lives in GPU memory (the backend's pool_init). */
    kvt__arena_place dev_place = {.hugepages = true, .no_base = cuda};
    rc = kvt__arena_init(&p->tier[KVT_TIER_DEVICE], p->block_bytes, n_dev, &dev_place,
                         "opts->device_bytes");
    if (rc)
        goto fail;
    if (n_host) {
        kvt__arena_place host_place = {.numa = o.host_numa,
                                       .node = o.host_numa_node,
                                       .hugepages = (o.flags & KVT_POOL_HUGEPAGES) != 0,
                                       .use_numa = true};
        rc = kvt__arena_init(&p->tier[KVT_TIER_HOST], p->block_bytes, n_host, &host_place,
                             "opts->host_bytes");
        if (rc)
            goto fail;
        /* Which page holds each host block: eviction scans it. */
        p->host_owner = malloc((size_t)n_host * sizeof *p->host_owner);
        if (!p->host_owner) {
            rc = kvt__err(KVT_ENOMEM, "opts->host_bytes: cannot allocate the owner map of %u "
                          "blocks", n_host);
            goto fail;
        }
        for (uint32_t i = 0; i < n_host; i++)
            p->host_owner[i].slot = UINT32_MAX;
    }
    rc = kvt__arena_init(&p->meta, p->meta_bytes, (uint32_t)meta_slots, &dev_place,
                         "metadata store");
    if (rc)
        goto fail;
    /* Physical pages are named by their metadata slot: their reference
     * counts, and their disk slots. */
    p->pg_ref = calloc((size_t)meta_slots, sizeof *p->pg_ref);
    p->pg_mark = calloc((size_t)meta_slots, sizeof *p->pg_mark);
    p->pg_hold = calloc((size_t)meta_slots, sizeof *p->pg_hold);
    if (!p->pg_ref || !p->pg_mark || !p->pg_hold) {
        rc = kvt__err(KVT_ENOMEM, "kvt_pool_create: cannot allocate the reference counts of "
                      "%llu pages", (unsigned long long)meta_slots);
        goto fail;
    }
    if (p->disk && (rc = kvt__disk_pages_init(p->disk, (uint32_t)meta_slots)))
        goto fail;
    if ((o.flags & KVT_POOL_PREFIX_CACHE) && (rc = kvt__pfx_create(p, o.prefix_cache_bytes)))
        goto fail;
    if ((rc = kvt__remote_open(p, &o)))
        goto fail;

    p->be = cuda ? &kvt__backend_cuda : &kvt__backend_cpu;
    p->be_caps = p->be->caps;
    if (p->be->pool_init && (rc = p->be->pool_init(p, &o)))
        goto fail;

    p->seqs = calloc(p->max_seqs, sizeof *p->seqs);
    p->free_seq = malloc((size_t)p->max_seqs * sizeof *p->free_seq);
    p->scratch = malloc((size_t)(p->g.page_tokens + 1) * p->g.head_dim * sizeof(float));
    if (!p->seqs || !p->free_seq || !p->scratch) {
        rc = kvt__err(KVT_ENOMEM, "kvt_pool_create: cannot allocate %u sequence slots",
                      p->max_seqs);
        goto fail;
    }
    for (uint32_t i = p->max_seqs; i-- > 0;)
        p->free_seq[p->n_free_seq++] = i;
    p->kern = kvt__kernels_select();
    rc = kvt__mover_create(p, &mo);
    if (rc)
        goto fail;
    if (p->disk)
        p->disk->kept = p->disk->keep;
    *out = p;
    return 0;

fail:
    kvt_pool_destroy(p);
    return rc;
}

KVT_API void kvt_pool_destroy(kvt_pool *p)
{
    if (!p)
        return;
    kvt__remote_close(p); /* what is queued is written first */
    kvt__mover_destroy(p->mover); /* waits for every move in flight first */
    p->mover = NULL;
    kvt__tp_fini(&p->tp);
    for (size_t i = 0; i < sizeof p->step_ring / sizeof p->step_ring[0]; i++)
        kvt__step_free(p->step_ring[i]);
    if (p->seqs)
        for (uint32_t i = 0; i < p->max_seqs; i++)
            kvt__seq_fini(&p->seqs[i]);
    if (p->be && p->be->pool_fini)
        p->be->pool_fini(p);
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++)
        kvt__arena_fini(&p->tier[t]);
    kvt__arena_fini(&p->meta);
    kvt__disk_close(p->disk);
    kvt__pfx_destroy(p);
    free(p->host_owner);
    free(p->pg_ref);
    free(p->pg_mark);
    free(p->pg_hold);
    free(p->seqs);
    free(p->free_seq);
    free(p->scratch);
    free(p);
}

KVT_API int kvt_pool_geometry_get(const kvt_pool *pool, kvt_geometry *out)
{
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(out);
    *out = pool->g;
    return 0;
}

KVT_API int kvt_pool_stats_get(const kvt_pool *pool, kvt_stats *stats)
{
    kvt_stats s;
    size_t fill;
    KVT__CHECK_NULL(pool);
    KVT__CHECK_NULL(stats);
    int rc = kvt__out_struct(stats, sizeof s, KVT__POOL_STATS_V1, "stats", &fill);
    if (rc)
        return rc;
    memset(&s, 0, sizeof s);
    s.struct_size = stats->struct_size;
    s.backend = pool->backend;
    s.block_bytes = pool->block_bytes;
    s.meta_bytes_total = (uint64_t)pool->meta.n_blocks * pool->meta_bytes;
    s.meta_pages_total = pool->meta.n_blocks - 1u;
    s.meta_pages_used = s.meta_pages_total - pool->meta.n_free;
    s.n_seqs = pool->n_live;
    for (uint32_t i = 0; i < pool->max_seqs; i++) {
        const kvt__seq *q = &pool->seqs[i];
        if (!q->live)
            continue;
        uint32_t m = q->n_tokens[0];
        for (uint32_t l = 1; l < pool->g.n_layers; l++)
            m = q->n_tokens[l] < m ? q->n_tokens[l] : m;
        s.n_tokens += m;
    }
    for (uint32_t t = 0; t < KVT_NUM_TIERS; t++) {
        const kvt__arena *a = &pool->tier[t];
        kvt_tier_stats *ts = &s.tier[t];
        if (t == KVT_TIER_DISK && pool->disk) {
            const kvt__disk *d = pool->disk;
            ts->blocks_total = (uint64_t)d->n_ext * d->E;
            ts->blocks_free = (uint64_t)d->n_ext_free * d->E;
            ts->blocks_used = ts->blocks_total - ts->blocks_free;
            ts->bytes_total = ts->blocks_total * d->slot_bytes;
            ts->bytes_used = ts->blocks_used * d->slot_bytes;
        } else if (kvt__has_tier(pool, t)) {
            ts->blocks_total = a->n_blocks - 1u;
            ts->blocks_free = a->n_free;
            ts->blocks_used = ts->blocks_total - ts->blocks_free;
            ts->bytes_total = ts->blocks_total * pool->block_bytes;
            ts->bytes_used = ts->blocks_used * pool->block_bytes;
        }
        ts->pages = pool->pages_in_tier[t];
    }
    memcpy(s.moved_bytes, pool->moved_bytes, sizeof s.moved_bytes);
    memcpy(s.moved_requests, pool->moved_requests, sizeof s.moved_requests);
    s.sel_pages = pool->pst.sel_pages;
    s.sel_resident = pool->pst.sel_resident;
    s.promoted_pages = pool->pst.promoted;
    s.recycled_blocks = pool->pst.recycled;
    s.evicted_pages = pool->pst.evicted;
    s.offloaded_pages = pool->pst.offloaded;
    s.reranked_heads = pool->pst.reranked;
    s.head_selections = pool->pst.sel_heads;
    s.similarity_reranks = pool->pst.sim_reranked;
    s.paused_seqs = pool->pst.paused;
    const kvt__pfx *x = pool->pfx;
    if (x) {
        s.prefix_lookups = x->lookups;
        s.prefix_hit_tokens = x->hit_tokens;
        s.prefix_miss_tokens = x->miss_tokens;
        s.prefix_hit_pages = x->hit_pages;
        s.prefix_keyed_pages = x->keyed;
        memcpy(s.prefix_cached_pages, x->cached, sizeof s.prefix_cached_pages);
        s.prefix_reclaimed_pages = x->reclaimed;
        s.prefix_dropped_pages = x->dropped;
    }
    if (pool->remote) {
        kvt__rstats r;
        kvt__rclient_stats(pool->remote, &r);
        s.remote_fetches = r.fetches;
        s.remote_fetch_ns = r.fetch_ns;
        s.remote_hit_values = r.hit_values;
        s.remote_miss_values = r.miss_values;
        s.remote_get_bytes = r.get_bytes;
        s.remote_put_values = r.put_values;
        s.remote_put_bytes = r.put_bytes;
        s.remote_put_dropped = r.put_dropped;
        s.remote_errors = r.errors;
        s.remote_corrupt = r.corrupt;
        s.remote_redirects = r.redirects;
        s.remote_queue_bytes = r.queue_bytes;
    }
    memcpy(stats, &s, fill);
    return 0;
}

/* The ISA of the CPU kernels the pool runs (lib/attn/dispatch.c chose them). */
KVT_API int kvt_pool_kernel_isa_get(const kvt_pool *pool, const char **isa)
{
    if (!pool)
        return kvt__err(KVT_EINVAL, "pool: must not be NULL");
    if (!isa)
        return kvt__err(KVT_EINVAL, "isa: must not be NULL");
    *isa = pool->kern->name;
    return 0;
}
