/* The disk tier: one preallocated file per pool, page slots grouped into
 * extents and layer-head segments, a CRC32C per slot kept in memory. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tier.h"

#define KVT__NONE UINT32_MAX

/* Test builds can pretend the filesystem refuses O_DIRECT. */
static bool kvt__direct_refused(void)
{
#ifdef KVT_FAULT_INJECTION
    const char *e = getenv("KVT_FAULT_NO_DIRECT");
    return e && *e == '1';
#else
    return false;
#endif
}

int kvt__disk_open(kvt_pool *p, const char *dir, uint64_t bytes, const kvt_mover_opts *mo,
                   kvt__disk **out)
{
    *out = NULL;
    char bp[KVT__BRIEF_MAX]; /* paths in messages */
    kvt__disk *d = calloc(1, sizeof *d);
    if (!d)
        return kvt__err(KVT_ENOMEM, "disk tier: cannot allocate its state");
    d->fd = -1;
    d->block_bytes = p->block_bytes;
    d->slot_bytes = (p->block_bytes + KVT__DIO_ALIGN - 1) / KVT__DIO_ALIGN * KVT__DIO_ALIGN;
    d->E = mo->extent_pages;
    d->S = mo->segment_extents;
    d->keep = (mo->flags & KVT_MOVER_KEEP_DISK_FILE) != 0;
    d->n_lh = p->g.n_layers * p->g.n_kv_heads;
    int rc;

    const uint64_t seg_bytes = d->slot_bytes * d->E * d->S; /* E, S <= 65536: no overflow */
    const uint64_t n_seg = bytes / seg_bytes;
    if (n_seg == 0) {
        rc = kvt__err(KVT_EINVAL, "opts->disk_bytes: %llu bytes hold no whole segment of %llu "
                      "bytes (%u extents x %u pages x %llu-byte slots)",
                      (unsigned long long)bytes, (unsigned long long)seg_bytes, d->S, d->E,
                      (unsigned long long)d->slot_bytes);
        goto fail;
    }
    if (n_seg * d->S > UINT32_MAX - 1u || n_seg * d->S * d->E > (uint64_t)UINT32_MAX * 64u) {
        rc = kvt__err(KVT_EOVERFLOW, "opts->disk_bytes: %llu bytes are too many extents",
                      (unsigned long long)bytes);
        goto fail;
    }
    d->n_seg = (uint32_t)n_seg;
    d->n_ext = d->n_seg * d->S;
    d->file_bytes = n_seg * seg_bytes;

    size_t plen = strlen(dir) + 64;
    d->path = malloc(plen);
    d->ext_next = malloc((size_t)d->n_ext * sizeof *d->ext_next);
    d->ext_lh = malloc((size_t)d->n_ext * sizeof *d->ext_lh);
    d->lh_head = malloc((size_t)d->n_lh * sizeof *d->lh_head);
    d->spill = calloc(d->n_lh, sizeof *d->spill);
    d->seg_stack = malloc((size_t)d->n_seg * sizeof *d->seg_stack);
    d->crc = calloc((size_t)d->n_ext * d->E, sizeof *d->crc);
    if (!d->path || !d->ext_next || !d->ext_lh || !d->lh_head || !d->seg_stack || !d->crc ||
        !d->spill) {
        rc = kvt__err(KVT_ENOMEM, "disk tier: cannot allocate the extent tables for %u "
                      "extents", d->n_ext);
        goto fail;
    }
    for (uint32_t i = 0; i < d->n_ext; i++) {
        d->ext_next[i] = KVT__NONE;
        d->ext_lh[i] = KVT__NONE;
    }
    for (uint32_t i = 0; i < d->n_lh; i++)
        d->lh_head[i] = KVT__NONE;
    for (uint32_t i = d->n_seg; i-- > 0;) /* segment 0 on top: the file fills from the start */
        d->seg_stack[d->n_seg_free++] = i;
    d->n_ext_free = d->n_ext;

    /* A unique name, so pools (and processes) can share the directory. */
    snprintf(d->path, plen, "%s/kvtier-%ld-%u-XXXXXX", dir, (long)getpid(), p->tag);
    int fd0 = mkostemp(d->path, O_CLOEXEC);
    if (fd0 < 0) {
        int e = errno;
        rc = kvt__err(e == ENOSPC ? KVT_ENOSPC : KVT_EINVAL,
                      "opts->disk_dir: cannot create the disk file in '%s': %s",
                      kvt__brief(dir, bp), strerror(e));
        goto fail;
    }
    int fd = kvt__direct_refused() ? (errno = EINVAL, -1)
                                    : open(d->path, O_RDWR | O_DIRECT | O_CLOEXEC);
    if (fd >= 0) {
        close(fd0);
        d->direct = true;
    } else if (errno == EINVAL && !(mo->flags & KVT_MOVER_REQUIRE_DIRECT)) {
        fd = fd0; /* the filesystem refuses O_DIRECT: buffered I/O (documented) */
    } else {
        int e = errno;
        close(fd0);
        unlink(d->path);
        rc = kvt__err(e == EINVAL ? KVT_ENOTSUP : KVT_EIO,
                      "opts->disk_dir: cannot open '%s' with O_DIRECT: %s%s",
                      kvt__brief(d->path, bp), strerror(e),
                      e == EINVAL ? " (KVT_MOVER_REQUIRE_DIRECT is set; the filesystem "
                                    "does not support direct I/O)" : "");
        goto fail;
    }
    d->fd = fd;
    if (!d->keep)
        unlink(d->path); /* nothing is left behind, even if the process dies */

    /* Preallocate so that a full disk shows at creation, not mid-decode. */
    int e = fallocate(fd, 0, 0, (off_t)d->file_bytes) ? errno : 0;
    if (e == EOPNOTSUPP || e == ENOSYS)
        e = ftruncate(fd, (off_t)d->file_bytes) ? errno : 0;
    if (e) {
        rc = kvt__err(e == ENOSPC ? KVT_ENOSPC : KVT_EIO,
                      "opts->disk_bytes: cannot preallocate %llu bytes in '%s': %s",
                      (unsigned long long)d->file_bytes, kvt__brief(dir, bp), strerror(e));
        goto fail;
    }
    *out = d;
    return 0;
fail:
    kvt__disk_close(d);
    return rc;
}

void kvt__disk_close(kvt__disk *d)
{
    if (!d)
        return;
    if (d->fd >= 0) {
        close(d->fd);
        if (d->keep && !d->kept)
            unlink(d->path); /* the pool was never created: leave nothing */
    }
    free(d->path);
    free(d->ext_next);
    free(d->ext_lh);
    free(d->lh_head);
    free(d->seg_stack);
    free(d->crc);
    free(d->pslot);
    free(d->slot_used);
    free(d->ext_ref);
    free(d->spill);
    free(d);
}

int kvt__disk_pages_init(kvt__disk *d, uint32_t n)
{
    d->pslot = malloc((size_t)n * sizeof *d->pslot);
    d->slot_used = calloc((size_t)d->n_ext * d->E, 1);
    d->ext_ref = calloc(d->n_ext, sizeof *d->ext_ref);
    if (!d->pslot || !d->slot_used || !d->ext_ref)
        return kvt__err(KVT_ENOMEM, "disk tier: cannot allocate the slot tables of %u pages", n);
    for (uint32_t i = 0; i < n; i++)
        d->pslot[i] = UINT64_MAX;
    d->n_pslot = n;
    return 0;
}

/* Drops one reference to extent x; the last returns it to its layer-head. */
static void kvt__ext_unref(kvt__disk *d, uint32_t x)
{
    if (--d->ext_ref[x])
        return;
    uint32_t owner = d->ext_lh[x];
    d->ext_next[x] = d->lh_head[owner];
    d->lh_head[owner] = x;
    d->n_ext_free++;
}

void kvt__disk_page_free(kvt_pool *p, uint32_t meta)
{
    kvt__disk *d = p->disk;
    if (!d || d->pslot[meta] == UINT64_MAX)
        return;
    const uint64_t slot = d->pslot[meta];
    d->pslot[meta] = UINT64_MAX;
    d->slot_used[slot] = 0;
    kvt__ext_unref(d, (uint32_t)(slot / d->E));
}

void kvt__disk_trim_seq(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t first_page)
{
    kvt__disk *d = p->disk;
    if (!d || !s->tier.disk_ext)
        return;
    for (uint32_t i = (first_page + d->E - 1u) / d->E; i < s->tier.ext_cap; i++) {
        uint32_t *x = &s->tier.disk_ext[lh * s->tier.ext_cap + i];
        if (*x)
            kvt__ext_unref(d, *x - 1u);
        *x = 0;
    }
}

int kvt__disk_seq_reserve(kvt_pool *p, kvt__seq *s, uint32_t cap_pages)
{
    kvt__disk *d = p->disk;
    if (!d)
        return 0;
    uint32_t cap = (uint32_t)(((uint64_t)cap_pages + d->E - 1) / d->E);
    if (cap <= s->tier.ext_cap)
        return 0;
    size_t lh = d->n_lh;
    uint32_t *t = calloc(lh * (size_t)cap, sizeof *t);
    if (!t)
        return kvt__err(KVT_ENOMEM, "disk extent table: cannot grow to %u extents per head",
                        cap);
    for (size_t i = 0; i < lh && s->tier.ext_cap; i++)
        memcpy(t + i * cap, s->tier.disk_ext + i * s->tier.ext_cap, s->tier.ext_cap * sizeof *t);
    free(s->tier.disk_ext);
    s->tier.disk_ext = t;
    s->tier.ext_cap = cap;
    return 0;
}

uint64_t kvt__disk_slot(const kvt_pool *p, const kvt__seq *s, size_t lh, uint32_t page)
{
    return p->disk->pslot[s->meta_slot[lh * s->cap_pages + page]];
}

static uint32_t kvt__ext_pop(kvt__disk *d, uint32_t lh)
{
    uint32_t x = d->lh_head[lh];
    if (x != KVT__NONE) {
        d->lh_head[lh] = d->ext_next[x];
        d->ext_next[x] = KVT__NONE;
        d->n_ext_free--;
    }
    return x;
}

/* A free extent for layer-head lh: from its list, a fresh segment, another
 * layer-head's list, or (the file is full) the disk copies of cached pages
 * no sequence holds; KVT__NONE when none can be had. */
static uint32_t kvt__ext_take(kvt_pool *p, uint32_t lh)
{
    kvt__disk *d = p->disk;
    for (;;) {
        uint32_t x = kvt__ext_pop(d, lh);
        if (x == KVT__NONE && d->n_seg_free) {
            /* Claim a fresh segment for this layer-head; extents in address order. */
            uint32_t g = d->seg_stack[--d->n_seg_free];
            for (uint32_t j = d->S; j-- > 0;) {
                uint32_t e = g * d->S + j;
                d->ext_lh[e] = lh;
                d->ext_next[e] = d->lh_head[lh];
                d->lh_head[lh] = e;
            }
            x = kvt__ext_pop(d, lh);
        }
        /* Every segment is claimed: borrow a free extent of another layer-head
         * rather than fail while space is left. */
        for (uint32_t o = 0; x == KVT__NONE && o < d->n_lh; o++)
            x = kvt__ext_pop(d, o);
        if (x != KVT__NONE || !kvt__pfx_disk_room(p))
            return x;
    }
}

int kvt__disk_slot_alloc(kvt_pool *p, kvt__seq *s, size_t lh, uint32_t page, uint64_t *slot)
{
    kvt__disk *d = p->disk;
    const uint32_t meta = s->meta_slot[lh * s->cap_pages + page];
    *slot = d->pslot[meta];
    if (*slot != UINT64_MAX)
        return 0;
    uint32_t i = page / d->E;
    if (i >= s->tier.ext_cap)
        return kvt__err(KVT_EINTERNAL, "disk extent table too small (%u < %u)", s->tier.ext_cap,
                        i + 1);
    uint32_t *te = &s->tier.disk_ext[lh * s->tier.ext_cap + i];
    if (*te && !d->slot_used[(uint64_t)(*te - 1u) * d->E + page % d->E]) {
        *slot = (uint64_t)(*te - 1u) * d->E + page % d->E;
    } else {
        /* No extent yet, or the page's place in it is held by a page this
         * sequence let go and another still holds: a fresh extent. */
        uint32_t x = kvt__ext_take(p, (uint32_t)lh);
        if (x == KVT__NONE)
            return kvt__err(KVT_ENOSPC, "disk tier: all %u extents of %u pages are in use "
                            "(%llu bytes)", d->n_ext, d->E, (unsigned long long)d->file_bytes);
        if (*te)
            kvt__ext_unref(d, *te - 1u);
        d->ext_ref[x] = 1; /* the table's reference */
        *te = x + 1u;
        *slot = (uint64_t)x * d->E + page % d->E;
    }
    d->slot_used[*slot] = 1;
    d->ext_ref[*slot / d->E]++;
    d->pslot[meta] = *slot;
    return 0;
}

int kvt__disk_spill_slot(kvt_pool *p, size_t lh, uint32_t meta, uint64_t *slot)
{
    kvt__disk *d = p->disk;
    uint32_t *cur = &d->spill[lh];
    *slot = UINT64_MAX;
    for (uint32_t j = 0; *cur && j < d->E && *slot == UINT64_MAX; j++)
        if (!d->slot_used[(uint64_t)(*cur - 1u) * d->E + j])
            *slot = (uint64_t)(*cur - 1u) * d->E + j;
    if (*slot == UINT64_MAX) { /* none, or full: a fresh extent */
        const uint32_t x = kvt__ext_take(p, (uint32_t)lh);
        if (x == KVT__NONE)
            return kvt__err(KVT_ENOSPC, "disk tier: all %u extents are in use", d->n_ext);
        if (*cur)
            kvt__ext_unref(d, *cur - 1u);
        d->ext_ref[x] = 1; /* the cursor's reference */
        *cur = x + 1u;
        *slot = (uint64_t)x * d->E;
    }
    d->slot_used[*slot] = 1;
    d->ext_ref[*slot / d->E]++;
    d->pslot[meta] = *slot;
    return 0;
}

int kvt__disk_write_page(const kvt_pool *p, uint64_t slot, const void *buf)
{
    const kvt__disk *d = p->disk;
    void *tmp = NULL;
    if (posix_memalign(&tmp, KVT__DIO_ALIGN, d->slot_bytes))
        return kvt__err(KVT_ENOMEM, "disk write: cannot allocate a %llu-byte buffer",
                        (unsigned long long)d->slot_bytes);
    memcpy(tmp, buf, d->block_bytes);
    memset((uint8_t *)tmp + d->block_bytes, 0, d->slot_bytes - d->block_bytes);
    const uint64_t off = slot * d->slot_bytes;
    uint64_t put = 0;
    while (put < d->slot_bytes) {
        ssize_t r = pwrite(d->fd, (uint8_t *)tmp + put, d->slot_bytes - put, (off_t)(off + put));
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (r <= 0) {
            const int e = errno;
            free(tmp);
            return kvt__err(KVT_EIO, "disk write: slot %llu: %s", (unsigned long long)slot,
                            r < 0 ? strerror(e) : "no progress");
        }
        put += (uint64_t)r;
    }
    d->crc[slot] = kvt__crc32c(0, tmp, d->block_bytes);
    free(tmp);
    return 0;
}

void kvt__disk_free_seq(kvt_pool *p, kvt__seq *s)
{
    kvt__disk *d = p->disk;
    if (!d || !s->tier.disk_ext)
        return;
    for (size_t i = 0; i < (size_t)d->n_lh * s->tier.ext_cap; i++) {
        if (s->tier.disk_ext[i])
            kvt__ext_unref(d, s->tier.disk_ext[i] - 1u);
        s->tier.disk_ext[i] = 0;
    }
}

int kvt__disk_read_into(const kvt_pool *p, uint64_t slot, void *tmp)
{
    const kvt__disk *d = p->disk;
    uint64_t off = slot * d->slot_bytes, got = 0;
    while (got < d->slot_bytes) {
        ssize_t r = pread(d->fd, (uint8_t *)tmp + got, d->slot_bytes - got, (off_t)(off + got));
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (r <= 0)
            return r < 0 && errno == ENOMEM ? KVT_ENOMEM : KVT_EIO;
        got += (uint64_t)r;
    }
    return kvt__crc32c(0, tmp, d->block_bytes) != d->crc[slot] ? KVT_ECORRUPT : 0;
}

int kvt__disk_read_page(const kvt_pool *p, uint64_t slot, void *buf)
{
    const kvt__disk *d = p->disk;
    void *tmp = NULL;
    if (posix_memalign(&tmp, KVT__DIO_ALIGN, d->slot_bytes))
        return kvt__err(KVT_ENOMEM, "disk read: cannot allocate a %llu-byte buffer",
                        (unsigned long long)d->slot_bytes);
    errno = 0;
    int rc = kvt__disk_read_into(p, slot, tmp);
    if (rc == KVT_ECORRUPT)
        rc = kvt__err(KVT_ECORRUPT, "disk read of slot %llu: CRC32C mismatch (the data is "
                      "not used)", (unsigned long long)slot);
    else if (rc)
        rc = kvt__err(rc, "disk read of slot %llu: %s", (unsigned long long)slot,
                      errno ? strerror(errno) : "unexpected end of file");
    if (!rc)
        memcpy(buf, tmp, d->block_bytes);
    free(tmp);
    return rc;
}

int kvt__disk_check(const kvt_pool *p)
{
    const kvt__disk *d = p->disk;
    if (!d)
        return 0;
    /* 1 = free in a layer-head list, 2 = in a free segment, 3 = used. */
    uint8_t *st = calloc(d->n_ext, 1);
    if (!st)
        return kvt__err(KVT_ENOMEM, "kvt_pool_check: cannot allocate a bitmap");
    int rc = 0;
    uint64_t n_free = 0;
    for (uint32_t i = 0; i < d->n_seg_free && !rc; i++) {
        uint32_t g = d->seg_stack[i];
        if (g >= d->n_seg) {
            rc = kvt__err(KVT_EINTERNAL, "disk tier: free segment %u out of range", g);
            break;
        }
        for (uint32_t j = 0; j < d->S && !rc; j++) {
            uint32_t e = g * d->S + j;
            if (st[e] || d->ext_lh[e] != KVT__NONE)
                rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u of free segment %u is "
                              "claimed", e, g);
            st[e] = 2;
            n_free++;
        }
    }
    for (uint32_t lh = 0; lh < d->n_lh && !rc; lh++)
        for (uint32_t x = d->lh_head[lh]; x != KVT__NONE && !rc; x = d->ext_next[x]) {
            if (x >= d->n_ext || st[x])
                rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u listed twice or out of "
                              "range", x);
            else if (d->ext_lh[x] != lh)
                rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u of layer-head %u sits in "
                              "the free list of %u", x, d->ext_lh[x], lh);
            else {
                st[x] = 1;
                n_free++;
            }
        }
    if (!rc && n_free != d->n_ext_free)
        rc = kvt__err(KVT_EINTERNAL, "disk tier: %u extents counted free, lists hold %llu",
                      d->n_ext_free, (unsigned long long)n_free);
    /* Every reference an extent should have: table entries and used slots. */
    uint32_t *want = calloc(d->n_ext, sizeof *want);
    if (!want) {
        free(st);
        return kvt__err(KVT_ENOMEM, "kvt_pool_check: cannot allocate the extent counts");
    }
    uint64_t used = 0;
    for (uint32_t m = 0; m < d->n_pslot && !rc; m++) {
        const uint64_t sl = d->pslot[m];
        if (sl == UINT64_MAX)
            continue;
        if (sl >= (uint64_t)d->n_ext * d->E || !d->slot_used[sl] ||
            (!p->pg_ref[m] && !kvt__pfx_indexed(p, m)))
            rc = kvt__err(KVT_EINTERNAL, "disk tier: page (metadata slot %u) holds slot %llu, "
                          "which is %s", m, (unsigned long long)sl,
                          !p->pg_ref[m] ? "kept for a freed page" : "out of range or unmarked");
        else
            want[sl / d->E]++;
        used++;
    }
    for (uint32_t lh = 0; lh < d->n_lh && !rc; lh++)
        if (d->spill[lh])
            want[d->spill[lh] - 1u]++;
    uint64_t marked = 0;
    for (uint64_t sl = 0; sl < (uint64_t)d->n_ext * d->E; sl++)
        marked += d->slot_used[sl];
    if (!rc && marked != used)
        rc = kvt__err(KVT_EINTERNAL, "disk tier: %llu slots marked used, pages hold %llu",
                      (unsigned long long)marked, (unsigned long long)used);
    for (uint32_t si = 0; si < p->max_seqs && !rc; si++) {
        const kvt__seq *s = &p->seqs[si];
        if (!s->live)
            continue;
        for (size_t lh = 0; lh < d->n_lh && !rc; lh++) {
            uint32_t l = (uint32_t)(lh / p->g.n_kv_heads);
            uint32_t np = kvt__pages_for(p, s->n_tokens[l]);
            for (uint32_t i = 0; i < s->tier.ext_cap && !rc; i++) {
                uint32_t x = s->tier.disk_ext[lh * s->tier.ext_cap + i];
                if (!x)
                    continue;
                x--;
                if (x >= d->n_ext || st[x] == 1 || st[x] == 2)
                    rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u of seq slot %u "
                                  "layer-head %zu is free", x, si, lh);
                else if ((uint64_t)i * d->E >= np)
                    rc = kvt__err(KVT_EINTERNAL, "disk tier: seq slot %u layer-head %zu holds "
                                  "extent %u past its %u pages", si, lh, x, np);
                else
                    want[x]++;
            }
            for (uint32_t pg = 0; pg < np && !rc; pg++) {
                uint8_t r = s->res[lh * s->cap_pages + pg];
                if ((r & KVT_RES_DISK) && kvt__disk_slot(p, s, lh, pg) == UINT64_MAX)
                    rc = kvt__err(KVT_EINTERNAL, "disk tier: seq slot %u layer-head %zu page "
                                  "%u is on disk without a slot", si, lh, pg);
            }
        }
    }
    for (uint32_t e = 0; e < d->n_ext && !rc; e++) {
        if (want[e] != d->ext_ref[e])
            rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u has %u references, tables and "
                          "pages hold %u", e, d->ext_ref[e], want[e]);
        else if (want[e] && st[e])
            rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u is free and in use", e);
        else if (want[e])
            st[e] = 3;
    }
    free(want);
    for (uint32_t e = 0; e < d->n_ext && !rc; e++)
        if (!st[e])
            rc = kvt__err(KVT_EINTERNAL, "disk tier: extent %u is neither free nor used "
                          "(leaked)", e);
    free(st);
    return rc;
}

int kvt__page_read(const kvt_pool *p, const kvt__seq *s, size_t lh, uint32_t page, uint8_t *buf)
{
    const size_t e = lh * s->cap_pages + page;
    const uint8_t r = s->res[e];
    if (r & KVT_RES_DEVICE) {
        const uint8_t *src = kvt__arena_block(&p->tier[KVT_TIER_DEVICE], s->dev_block[e]);
        if (p->be_caps & KVT__BE_DEVICE_REMOTE) /* GPU memory */
            return p->be->read(p, buf, src, p->block_bytes);
        memcpy(buf, src, p->block_bytes);
        return 0;
    }
    if (r & KVT_RES_HOST) {
        memcpy(buf, kvt__arena_block(&p->tier[KVT_TIER_HOST], s->host_block[e]), p->block_bytes);
        return 0;
    }
    if ((r & KVT_RES_DISK) && p->disk)
        return kvt__disk_read_page(p, kvt__disk_slot(p, s, lh, page), buf);
    return kvt__err(KVT_EINTERNAL, "page %u of layer-head %zu is in no tier", page, lh);
}
