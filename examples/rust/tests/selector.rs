//! The selector's scoring methods and its selection cache through the safe
//! wrapper: a KVT_SCORE_TOKEN (and ORACLE) selector picks the page holding
//! the one key aligned with the query; the cache's threshold
//! (`Selector::set_rerank_similarity`, `rerank_similarity` of the options)
//! rejects values outside -1 ..= 1 and NaN, and a query that turns around
//! between the interval's reranks is rescored (`Stats::similarity_reranks`).
use kvtier::{
    sys, Geometry, Policy, PolicyOpts, Pool, PoolOpts, Selector, SelectorOpts, SeqId, StepOpts,
};

const L: u32 = 2; // layers
const HKV: u32 = 2; // KV heads
const HQ: u32 = 4; // query heads (GQA groups of 2)
const D: u32 = 32; // head_dim
const P: u32 = 16; // page_tokens
const PREFILL: u32 = 10 * P; // 10 full pages per (layer, head)
const HOT_PAGE: u32 = 5; // the page whose token 3 is aligned with the query
const HEADS: u64 = (L * HKV) as u64;

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

/// The direction every query head looks in.
fn u(d: u32) -> f32 {
    if d % 2 == 0 {
        1.0
    } else {
        -0.5
    }
}

/// K (kind 0) or V (kind 1) rows of tokens `from .. to` of one layer,
/// `[to - from][HKV][D]`: small random values, but the keys of token
/// HOT_PAGE * P + 3 are 10 u in every head.
fn rows(kind: u64, layer: u32, from: u32, to: u32) -> Vec<f32> {
    (from..to)
        .flat_map(|t| {
            (0..HKV * D).map(move |x| {
                if kind == 0 && t == HOT_PAGE * P + 3 {
                    10.0 * u(x % D)
                } else {
                    val(kind, layer, t, x)
                }
            })
        })
        .collect()
}

/// The queries of one step, `[1][HQ][D]`: `sign` u in every head.
fn queries(sign: f32) -> Vec<f32> {
    (0..HQ * D).map(|i| sign * u(i % D)).collect()
}

fn geometry() -> Geometry {
    Geometry::new(L, HKV, HQ, D, P, sys::KVT_DTYPE_F32)
}

fn pool<'a>(geom: Geometry) -> Pool<'a> {
    let block = geom.block_bytes().unwrap();
    let opts = PoolOpts::new(geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(2)
        .max_seqs(2)
        .max_seq_tokens(256)
        .device_bytes(block * (HEADS * 16 + 1));
    Pool::new(&opts).expect("pool")
}

fn prefill(pool: &mut Pool, seq: SeqId) {
    for l in 0..L {
        let (k, v) = (rows(0, l, 0, PREFILL), rows(1, l, 0, PREFILL));
        pool.seq_append(seq, l, &k, &v, PREFILL).expect("append");
    }
}

/// One decode step of `seq` with `sel` and queries `sign` u; returns the
/// selection of every (layer, KV head) and whether it was rescored.
fn step(pool: &mut Pool, sel: &Selector, seq: SeqId, t: u32, sign: f32) -> Vec<(Vec<u32>, bool)> {
    let q = queries(sign);
    let mut out = vec![0f32; (HQ * D) as usize];
    let mut step = pool.step(&[seq], &StepOpts::new().selector(sel)).expect("plan");
    let mut got = Vec::new();
    for l in 0..L {
        step.append(l, &rows(0, l, t, t + 1), &rows(1, l, t, t + 1)).expect("step append");
        step.attend(l, &q, &mut out, None).expect("attend");
        assert!(out.iter().all(|x| x.is_finite()), "layer {l}: {out:?}");
        for h in 0..HKV {
            got.push(step.selection(l, 0, h).expect("selection"));
        }
    }
    step.finish().expect("finish");
    got
}

#[test]
fn rerank_similarity_rejects_bad_thresholds() {
    let geom = geometry();
    let mut sel = Selector::new(&geom, None).expect("selector");
    for bad in [1.5f32, -1.01, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = sel.set_rerank_similarity(sys::KVT_ALL, sys::KVT_ALL, bad).unwrap_err();
        assert_eq!(e.code, sys::KVT_EINVAL, "{bad}: {e}");
        assert_eq!(e.name(), "KVT_EINVAL");
        assert!(e.message.contains("threshold"), "{bad}: {e}");
        let e = sel.set_rerank_similarity(0, 1, bad).unwrap_err();
        assert_eq!(e.code, sys::KVT_EINVAL, "{bad}: {e}");
    }
    for good in [-1.0f32, 0.0, 0.5, 1.0] {
        sel.set_rerank_similarity(sys::KVT_ALL, sys::KVT_ALL, good).expect("a valid threshold");
        sel.set_rerank_similarity(L - 1, HKV - 1, good).expect("one head");
    }
    let e = sel.set_rerank_similarity(L, 0, 0.5).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "a layer past the geometry: {e}");
    assert!(e.message.contains("layer"), "{e}");

    // The options: the default, and the same check at creation.
    let o = SelectorOpts::defaults();
    assert_eq!(o.rerank_similarity, sys::KVT_RERANK_SIMILARITY_DEFAULT);
    assert_eq!(o.reserved, 0);
    assert_eq!(o.struct_size as usize, std::mem::size_of::<SelectorOpts>());
    for bad in [2.0f32, f32::NAN] {
        let o = SelectorOpts { rerank_similarity: bad, ..SelectorOpts::defaults() };
        let e = Selector::new(&geom, Some(&o)).unwrap_err();
        assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
        assert!(e.message.contains("rerank_similarity"), "{e}");
    }
    let o = SelectorOpts { reserved: 1, ..SelectorOpts::defaults() };
    let e = Selector::new(&geom, Some(&o)).unwrap_err();
    assert!(e.message.contains("reserved"), "{e}");
    let o = SelectorOpts { method: sys::KVT_SCORE_ORACLE + 1, ..SelectorOpts::defaults() };
    let e = Selector::new(&geom, Some(&o)).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    assert!(e.message.contains("method"), "{e}");

    // A policy carries a threshold per head.
    let po = PolicyOpts::defaults();
    assert_eq!(po.rerank_similarity, sys::KVT_RERANK_SIMILARITY_DEFAULT);
    let pol = Policy::new(&geom, Some(&po)).expect("policy");
    assert_eq!(pol.head(1, 1).unwrap().rerank_similarity, sys::KVT_RERANK_SIMILARITY_DEFAULT);
    let pol = Policy::new(&geom, Some(&PolicyOpts { rerank_similarity: -0.25, ..po }))
        .expect("policy with a threshold");
    assert_eq!(pol.head(0, 1).unwrap().rerank_similarity, -0.25);
    let e =
        Policy::new(&geom, Some(&PolicyOpts { rerank_similarity: f32::NAN, ..po })).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    assert!(e.message.contains("rerank_similarity"), "{e}");
}

/// TOKEN and ORACLE selectors choose the page of the aligned key besides
/// the sink, local and last pages; the stats count the selections.
#[test]
fn token_and_oracle_selectors_find_the_aligned_key() {
    let geom = geometry();
    for method in [sys::KVT_SCORE_TOKEN, sys::KVT_SCORE_ORACLE] {
        let o = SelectorOpts {
            method,
            top_k_pages: 1,
            sink_pages: 1,
            local_pages: 1,
            ..SelectorOpts::defaults()
        };
        let sel = Selector::new(&geom, Some(&o)).expect("selector");
        assert_eq!(sel.budget(0, 0).unwrap(), (1, 1, 1));
        let mut pool = pool(geom);
        let seq = pool.seq_create(0, 0).expect("seq");
        prefill(&mut pool, seq);
        let before = pool.stats().unwrap();
        // After the step: pages 0 .. 10 full, page 10 holds one token.
        for (i, (pages, reranked)) in step(&mut pool, &sel, seq, PREFILL, 1.0).iter().enumerate() {
            assert_eq!(
                pages,
                &vec![0, HOT_PAGE, PREFILL / P - 1, PREFILL / P],
                "method {method}, head {i}"
            );
            assert!(*reranked, "method {method}, head {i}: the first step rescores");
        }
        let st = pool.stats().unwrap();
        assert_eq!(st.head_selections - before.head_selections, HEADS, "{st:?}");
        assert_eq!(st.reranked_heads - before.reranked_heads, HEADS, "{st:?}");
        assert_eq!(st.similarity_reranks, 0, "{st:?}");
        pool.check().expect("check");
    }
}

/// With an interval too long to rerank, a query that turns around is
/// rescored by the selection cache, the same query again is not, and a
/// threshold of -1 turns the cache off.
#[test]
fn drifted_queries_are_rescored() {
    let geom = geometry();
    let o = SelectorOpts {
        method: sys::KVT_SCORE_TOKEN,
        top_k_pages: 2,
        rerank_interval: 1000,
        ..SelectorOpts::defaults()
    };
    let mut sel = Selector::new(&geom, Some(&o)).expect("selector");
    let mut pool = pool(geom);
    let seq = pool.seq_create(0, 0).expect("seq");
    prefill(&mut pool, seq);
    let mut t = PREFILL;
    let mut run = |pool: &mut Pool, sel: &Selector, sign: f32| {
        let got = step(pool, sel, seq, t, sign);
        t += 1;
        got.iter().filter(|(_, r)| *r).count() as u64
    };
    assert_eq!(run(&mut pool, &sel, 1.0), HEADS, "the first step rescores every head");
    assert_eq!(run(&mut pool, &sel, 1.0), 0, "the same query: the cached selection");
    assert_eq!(pool.stats().unwrap().similarity_reranks, 0);
    assert_eq!(run(&mut pool, &sel, -1.0), HEADS, "a reversed query (cosine -1 < 0.8)");
    let st = pool.stats().unwrap();
    assert_eq!(st.similarity_reranks, HEADS, "{st:?}");
    assert_eq!(st.reranked_heads, 2 * HEADS, "{st:?}");
    assert_eq!(st.head_selections, 3 * HEADS, "{st:?}");

    sel.set_rerank_similarity(sys::KVT_ALL, sys::KVT_ALL, -1.0).expect("cache off");
    assert_eq!(run(&mut pool, &sel, 1.0), 0, "threshold -1: the interval alone");
    let st = pool.stats().unwrap();
    assert_eq!(st.similarity_reranks, HEADS, "{st:?}");
    assert_eq!(st.head_selections, 4 * HEADS, "{st:?}");
    pool.check().expect("check");
}
