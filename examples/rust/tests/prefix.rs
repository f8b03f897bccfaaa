//! The prefix cache (kvtier/prefix.h) through the safe wrapper: a sequence
//! whose token ids are known keys its full pages; after it is released a
//! second sequence created with the same prefix attaches them, and the rows
//! it reads back equal the rows the first one appended (computed here, a
//! pure function of position, layer and head). Salts, a diverging id,
//! kvt_seq_tokens_set, the drops, and errors naming their field.
use kvtier::{sys, Geometry, Pool, PoolOpts, SeqId, SeqOpts, StepOpts};

const L: u32 = 2; // layers
const HKV: u32 = 2; // KV heads
const HQ: u32 = 4; // query heads
const D: u32 = 32; // head_dim
const P: u32 = 16; // page_tokens
const SALT: u64 = 0x5a17;
const OTHER_SALT: u64 = 0xb0b0;
/// Physical pages (one per layer and KV head) of one logical page.
const LH: u64 = (L * HKV) as u64;

/// A deterministic value in [-1, 1) (splitmix64 of the arguments).
fn val(kind: u64, layer: u32, t: u32, x: u32) -> f32 {
    let mut z = kind
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((layer as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add((t as u64).wrapping_mul(0x94d0_49bb_1331_11eb))
        .wrapping_add(x as u64)
        .wrapping_add(0x2545_f491_4f6c_dd1d);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
}

/// K (kind 0) or V (kind 1) rows of tokens `from .. to` of one layer,
/// `[to - from][HKV][D]`, as appended.
fn rows(kind: u64, layer: u32, from: u32, to: u32) -> Vec<f32> {
    (from..to).flat_map(|t| (0..HKV * D).map(move |x| val(kind, layer, t, x))).collect()
}

/// The reference rows of one KV head, `[to - from][D]`.
fn head_rows(kind: u64, layer: u32, kv_head: u32, from: u32, to: u32) -> Vec<f32> {
    (from..to).flat_map(|t| (0..D).map(move |d| val(kind, layer, t, kv_head * D + d))).collect()
}

fn token_ids(n: u32) -> Vec<u32> {
    (0..n).map(|t| 1000 + 7 * t).collect()
}

fn pool<'a>() -> Pool<'a> {
    let geom = Geometry::new(L, HKV, HQ, D, P, sys::KVT_DTYPE_F32);
    let block = geom.block_bytes().unwrap();
    let opts = PoolOpts::new(geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(2)
        .max_seqs(8)
        .max_seq_tokens(256)
        .device_bytes(block * (LH * 24 + 1))
        .prefix_cache([0; sys::KVT_NUM_TIERS]);
    assert_ne!(opts.raw().flags & sys::KVT_POOL_PREFIX_CACHE, 0);
    Pool::new(&opts).expect("pool with the prefix cache")
}

fn append(pool: &mut Pool, seq: SeqId, from: u32, to: u32) {
    for l in 0..L {
        let (k, v) = (rows(0, l, from, to), rows(1, l, from, to));
        pool.seq_append(seq, l, &k, &v, to - from).expect("append");
    }
}

/// Every (layer, KV head) of tokens `0 .. n` reads back as the reference.
fn assert_rows(pool: &Pool, seq: SeqId, n: u32, what: &str) {
    for l in 0..L {
        for h in 0..HKV {
            let (k, v) = pool.seq_read_kv(seq, l, h, 0, n).expect("read_kv");
            assert!(k == head_rows(0, l, h, 0, n), "{what}: K of layer {l} head {h}");
            assert!(v == head_rows(1, l, h, 0, n), "{what}: V of layer {l} head {h}");
        }
    }
}

#[test]
fn second_sequence_attaches_the_cached_prefix() {
    let mut pool = pool();
    let ids = token_ids(2 * P + 5);

    // A: the ids of all but the last token of two pages at creation, the
    // rows appended, then the last row by a step carrying its token id.
    let a = pool
        .seq_create_with(&SeqOpts::new().salt(SALT).user_data(7).prefix(&ids[..2 * P as usize - 1]))
        .expect("seq a");
    let info = pool.seq_info(a).unwrap();
    assert_eq!((info.prefix_tokens, info.n_tokens, info.token_ids), (0, 0, 2 * P - 1), "{info:?}");
    assert_eq!((info.salt, info.user_data), (SALT, 7));
    append(&mut pool, a, 0, 2 * P - 1);
    let st = pool.stats().unwrap();
    assert_eq!(st.prefix_lookups, 1, "{st:?}");
    assert_eq!(st.prefix_keyed_pages, LH, "page 0 is full and its ids known: {st:?}");
    let last = &ids[2 * P as usize - 1..2 * P as usize];
    let so = StepOpts::new().dense().token_ids(last);
    let mut step = pool.step(&[a], &so).expect("plan");
    for l in 0..L {
        step.append(l, &rows(0, l, 2 * P - 1, 2 * P), &rows(1, l, 2 * P - 1, 2 * P)).unwrap();
    }
    step.finish().expect("finish");
    assert_eq!(pool.seq_info(a).unwrap().token_ids, 2 * P);
    assert_eq!(pool.stats().unwrap().prefix_keyed_pages, 2 * LH, "page 1 keyed by the step");
    assert_rows(&pool, a, 2 * P, "a");
    pool.check().expect("check after a");

    // Released, its pages stay cached on device.
    pool.seq_release(a).unwrap();
    let st = pool.stats().unwrap();
    assert_eq!(st.n_seqs, 0);
    assert_eq!(st.prefix_cached_pages, [2 * LH, 0, 0], "{st:?}");
    pool.check().expect("check after releasing a");

    // B: the same prefix and 5 more ids attaches both pages.
    let b = pool.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&ids)).expect("seq b");
    let info = pool.seq_info(b).unwrap();
    assert_eq!(info.prefix_tokens, 2 * P, "{info:?}");
    assert_eq!(info.n_tokens, 2 * P, "{info:?}");
    assert_eq!(info.token_ids, 2 * P + 5, "{info:?}");
    assert_eq!(pool.seq_length(b, L - 1).unwrap(), 2 * P);
    assert_rows(&pool, b, 2 * P, "b, attached");
    let st = pool.stats().unwrap();
    assert_eq!(st.prefix_lookups, 2);
    assert_eq!(st.prefix_hit_tokens, 2 * P as u64);
    assert_eq!(st.prefix_hit_pages, 2 * LH);
    assert_eq!(st.prefix_miss_tokens, (2 * P - 1 + 5) as u64, "{st:?}");
    assert_eq!(st.prefix_cached_pages, [0; 3], "held again: {st:?}");
    // The engine prefills the rest.
    append(&mut pool, b, 2 * P, 2 * P + 5);
    assert_rows(&pool, b, 2 * P + 5, "b, prefilled");
    pool.check().expect("check after b");

    // Another salt matches nothing; an id differing in page 1 matches page 0.
    let c = pool.seq_create_with(&SeqOpts::new().salt(OTHER_SALT).prefix(&ids)).unwrap();
    assert_eq!(pool.seq_info(c).unwrap().prefix_tokens, 0);
    let mut diverged = ids.clone();
    diverged[P as usize + 3] += 1;
    let d = pool.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&diverged)).unwrap();
    assert_eq!(pool.seq_info(d).unwrap().prefix_tokens, P);
    assert_rows(&pool, d, P, "d");
    pool.seq_release(c).unwrap();
    pool.seq_release(d).unwrap();

    // kvt_seq_tokens_set: known ids must match, no gaps, new ones extend.
    let e = pool.seq_tokens_set(b, 0, &[ids[0] + 1]).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    let e = pool.seq_tokens_set(b, 2 * P + 6, &[1]).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    pool.seq_tokens_set(b, 2 * P + 3, &[ids[2 * P as usize + 3], ids[2 * P as usize + 4], 9, 9])
        .expect("tokens_set");
    assert_eq!(pool.seq_info(b).unwrap().token_ids, 2 * P + 7);

    // Dropping a salt unindexes its pages; b keeps (and reads) its own.
    assert_eq!(pool.prefix_drop(OTHER_SALT).unwrap(), 0);
    assert_eq!(pool.prefix_drop(SALT).unwrap(), 2 * LH);
    assert_eq!(pool.stats().unwrap().prefix_keyed_pages, 0);
    assert_rows(&pool, b, 2 * P + 5, "b after the drop");
    let f = pool.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&ids)).unwrap();
    assert_eq!(pool.seq_info(f).unwrap().prefix_tokens, 0, "nothing indexed");
    append(&mut pool, f, 0, 2 * P);
    pool.seq_release(f).unwrap();
    pool.seq_release(b).unwrap();
    pool.check().expect("check after the drop");

    // f's pages are cached now; dropping every salt frees them.
    let st = pool.stats().unwrap();
    assert_eq!(st.prefix_cached_pages[sys::KVT_TIER_DEVICE as usize], 2 * LH, "{st:?}");
    assert_eq!(pool.prefix_drop_all().unwrap(), 2 * LH);
    let st = pool.stats().unwrap();
    assert_eq!((st.prefix_keyed_pages, st.prefix_cached_pages), (0, [0; 3]), "{st:?}");
    assert!(st.prefix_dropped_pages >= 2 * LH, "{st:?}");
    assert_eq!(st.tier[sys::KVT_TIER_DEVICE as usize].blocks_used, 0, "{st:?}");
    pool.check().expect("check after drop_all");
}

#[test]
fn prefix_errors_name_their_field() {
    let mut pool = pool();
    let ids = token_ids(2 * P + 5);

    // More prefix ids than the sequence's limit.
    let so = SeqOpts::new().max_tokens(2 * P).prefix(&ids);
    assert_eq!(so.raw().n_prefix, 2 * P + 5);
    let e = pool.seq_create_with(&so).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    assert!(e.message.contains("n_prefix"), "message: {:?}", e.message);
    assert_eq!(pool.stats().unwrap().n_seqs, 0, "nothing created");

    // A step's token ids must match its rows (one here).
    let seq = pool.seq_create_with(&SeqOpts::new().prefix(&ids[..3])).unwrap();
    append(&mut pool, seq, 0, 3);
    let two = [5u32, 6];
    let e = pool.step(&[seq], &StepOpts::new().dense().token_ids(&two)).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    assert!(e.message.contains("token_ids"), "message: {:?}", e.message);

    // A released sequence is detected.
    pool.seq_release(seq).unwrap();
    let e = pool.seq_tokens_set(seq, 0, &ids[..1]).unwrap_err();
    assert_eq!(e.code, sys::KVT_ENOENT, "{e}");
    pool.check().unwrap();
}

/// Without KVT_POOL_PREFIX_CACHE the ids are recorded and nothing attached.
#[test]
fn without_the_cache_nothing_is_attached() {
    let geom = Geometry::new(L, HKV, HQ, D, P, sys::KVT_DTYPE_F32);
    let block = geom.block_bytes().unwrap();
    let opts = PoolOpts::new(geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(1)
        .device_bytes(block * (LH * 8 + 1));
    assert_eq!(opts.raw().prefix_cache_bytes, [0; 3]);
    let mut pool = Pool::new(&opts).unwrap();
    let ids = token_ids(2 * P);
    for _ in 0..2 {
        let s = pool.seq_create_with(&SeqOpts::new().prefix(&ids)).unwrap();
        let info = pool.seq_info(s).unwrap();
        assert_eq!((info.prefix_tokens, info.token_ids), (0, 2 * P), "{info:?}");
        append(&mut pool, s, 0, 2 * P);
        pool.seq_release(s).unwrap();
    }
    let st = pool.stats().unwrap();
    assert_eq!((st.prefix_lookups, st.prefix_keyed_pages), (0, 0), "{st:?}");
    pool.check().unwrap();
}
