//! A small tiered decode loop through the safe wrapper, checked against a
//! double-precision reference attention computed here, plus error handling.
use kvtier::{sys, Geometry, Policy, PolicyOpts, Pool, PoolOpts, Selector, Step, StepOpts};

const L: u32 = 2; // layers
const HKV: u32 = 2; // KV heads
const HQ: u32 = 4; // query heads (GQA groups of 2)
const D: u32 = 32; // head_dim
const P: u32 = 16; // page_tokens
const PREFILL: u32 = 200; // 12.5 pages per (layer, head)
const STEPS: u32 = 20;
const N_OBS: u32 = 4;

/// Deterministic values in [-1, 1) from a few integers (splitmix64).
fn val(a: u64, b: u64, c: u64, d: u64) -> f32 {
    let mut z = a
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(b.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(c.wrapping_mul(0x94d0_49bb_1331_11eb))
        .wrapping_add(d)
        .wrapping_add(0x2545_f491_4f6c_dd1d);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
}

/// K (kind 0) or V (kind 1) rows of token t of one layer: [HKV][D]. Keys
/// carry a per-page offset so that pages score differently.
fn kv_rows(kind: u64, layer: u32, t: u32) -> Vec<f32> {
    let mut out = Vec::with_capacity((HKV * D) as usize);
    for h in 0..HKV {
        for d in 0..D {
            let mut x = val(kind, layer as u64, t as u64, (h * D + d) as u64);
            if kind == 0 {
                x += 0.5 * val(7, layer as u64, (t / P) as u64, (h * D + d) as u64);
            }
            out.push(x);
        }
    }
    out
}

/// Queries of decode position `pos` in one layer: [HQ][D].
fn queries(layer: u32, pos: u32) -> Vec<f32> {
    (0..HQ * D).map(|i| 2.0 * val(2, layer as u64, pos as u64, i as u64)).collect()
}

fn geometry() -> Geometry {
    Geometry::new(L, HKV, HQ, D, P, sys::KVT_DTYPE_F32)
}

/// One unstable head (head 0) per layer, the others stable.
fn make_policy(geom: &Geometry) -> Policy {
    let mut o = PolicyOpts::defaults();
    o.top_k_pages = 3;
    o.sink_pages = 1;
    o.local_pages = 1;
    o.stable_interval = 4;
    let classes: Vec<u32> = (0..L * HKV)
        .map(|i| if i % HKV == 0 { sys::KVT_HEAD_UNSTABLE } else { sys::KVT_HEAD_STABLE })
        .collect();
    let pol = Policy::with_classes(geom, Some(&o), &classes).expect("policy");
    assert_eq!(pol.count(sys::KVT_HEAD_UNSTABLE).unwrap(), L);
    assert_eq!(pol.count(sys::KVT_HEAD_STABLE).unwrap(), L * (HKV - 1));
    assert_eq!(pol.head(1, 0).unwrap().head_class, sys::KVT_HEAD_UNSTABLE);
    assert_eq!(pol.head(1, 1).unwrap().top_k_pages, 3);
    pol
}

fn tiered_opts<'a>(geom: Geometry, pol: &'a Policy, sel: &'a Selector) -> PoolOpts<'a> {
    let base = PoolOpts::new(geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(2)
        .max_seqs(4)
        .max_seq_tokens(1024)
        .policy(pol)
        .selector(sel)
        .target((PREFILL + STEPS + 1) as u64, 1);
    let sz = base.sizing().expect("kvt_pool_sizing_get");
    assert!(sz.device_bytes > 0 && sz.device_bytes < sz.dense_bytes, "{sz:?}");
    let block = geom.block_bytes().unwrap();
    // Room for the prefill's new pages before warm-up moves them out (as
    // examples/decode/engine.c does), and a host tier for every page.
    base.device_bytes(sz.device_bytes + (HKV * (PREFILL / P + 1)) as u64 * block)
        .host_bytes(sz.dense_bytes + sz.host_bytes)
}

/// Attention of one query head over the tokens of `pages`, in f64:
/// (output [D], log-sum-exp of scale * q.k).
fn reference(
    step: &Step,
    layer: u32,
    kv_head: u32,
    len: u32,
    pages: &[u32],
    q: &[f32],
) -> (Vec<f64>, f64) {
    let scale = 1.0 / (D as f64).sqrt();
    let mut logits = Vec::new();
    let mut values = Vec::new();
    for &p in pages {
        let first = p * P;
        assert!(first < len, "page {p} beyond {len} tokens");
        let n = P.min(len - first);
        let (k, v) = step.read_kv(0, layer, kv_head, first, n).expect("read_kv");
        for t in 0..n as usize {
            let kr = &k[t * D as usize..][..D as usize];
            let dot: f64 = kr.iter().zip(q).map(|(&a, &b)| a as f64 * b as f64).sum();
            logits.push(dot * scale);
            values.push(v[t * D as usize..][..D as usize].to_vec());
        }
    }
    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    let mut out = vec![0.0f64; D as usize];
    for (s, v) in logits.iter().zip(&values) {
        let w = (s - m).exp();
        sum += w;
        for d in 0..D as usize {
            out[d] += w * v[d] as f64;
        }
    }
    for o in &mut out {
        *o /= sum;
    }
    (out, m + sum.ln())
}

#[test]
fn tiered_decode_loop_matches_reference() {
    let geom = geometry();
    let pol = make_policy(&geom);
    let sel = Selector::new(&geom, None).expect("selector");
    let opts = tiered_opts(geom, &pol, &sel);
    let mut pool = Pool::new(&opts).expect("pool");
    assert_eq!(pool.geometry().unwrap().page_tokens, P);
    let isa = pool.kernel_isa().unwrap();
    assert!(["avx512", "avx2", "portable"].contains(&isa), "{isa}");
    let seq = pool.seq_create(0, 42).expect("seq");

    // Prefill: every layer at once, deterministic K/V.
    for l in 0..L {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for t in 0..PREFILL {
            k.extend(kv_rows(0, l, t));
            v.extend(kv_rows(1, l, t));
        }
        pool.seq_append(seq, l, &k, &v, PREFILL).expect("prefill append");
    }
    assert_eq!(pool.seq_length(seq, 1).unwrap(), PREFILL);
    pool.check().expect("check after prefill");

    // Warm-up with the last N_OBS prompt positions' queries.
    let mut obs = Vec::new();
    for l in 0..L {
        for j in 0..N_OBS {
            obs.extend(queries(l, PREFILL - N_OBS + j));
        }
    }
    pool.seq_warmup(seq, &obs, N_OBS).expect("warmup");
    pool.check().expect("check after warm-up");
    let info = pool.seq_info(seq).unwrap();
    assert_eq!(info.user_data, 42);
    assert_eq!(info.n_tokens, PREFILL);
    assert!(info.pages_in_tier[sys::KVT_TIER_HOST as usize] > 0, "{info:?}");
    assert!(info.pages_in_tier[sys::KVT_TIER_DEVICE as usize] < info.pages, "{info:?}");

    let nq = (HQ * D) as usize;
    let group = HQ / HKV;
    let (mut out, mut lse) = (vec![0f32; nq], vec![0f32; HQ as usize]);
    let (mut max_err, mut checked, mut sparse_seen, mut not_ready) = (0f64, 0, false, 0);
    for s in 0..STEPS {
        let pos = PREFILL + s;
        let mut step = pool.step(&[seq], &StepOpts::new()).expect("plan");
        if !step.ready(0).expect("ready") {
            not_ready += 1; // decode waits for the promoted pages
        }
        for l in 0..L {
            let q = queries(l, pos);
            step.append(l, &kv_rows(0, l, pos), &kv_rows(1, l, pos)).expect("append");
            step.select(l, &q).expect("select");
            step.decode(l, &q, &mut out, Some(&mut lse)).expect("decode");
            // Reference over the selected pages, K/V read back from the pool.
            let len = pos + 1;
            assert_eq!(step.seq_length(0, l).unwrap(), len);
            for h in 0..HKV {
                let (pages, _reranked) = step.selection(l, 0, h).expect("selection");
                let total = len.div_ceil(P);
                assert!(!pages.is_empty() && pages.len() as u32 <= total);
                assert!(pages.windows(2).all(|w| w[0] < w[1]), "{pages:?}");
                assert_eq!(*pages.last().unwrap(), total - 1, "the last page is always selected");
                if h != 0 && (pages.len() as u32) < total {
                    sparse_seen = true;
                }
                for j in h * group..(h + 1) * group {
                    let qj = &q[(j * D) as usize..][..D as usize];
                    let (r, rl) = reference(&step, l, h, len, &pages, qj);
                    for d in 0..D as usize {
                        let e = (out[(j * D) as usize + d] as f64 - r[d]).abs();
                        max_err = max_err.max(e);
                        assert!(
                            e < 1e-4,
                            "step {s} layer {l} q head {j} dim {d}: {} vs {}",
                            out[(j * D) as usize + d],
                            r[d]
                        );
                    }
                    let el = (lse[j as usize] as f64 - rl).abs();
                    assert!(
                        el < 1e-4,
                        "step {s} layer {l} q head {j}: lse {} vs {rl}",
                        lse[j as usize]
                    );
                    checked += 1;
                }
            }
        }
        step.finish().expect("finish");
        pool.check().unwrap_or_else(|e| panic!("check after step {s}: {e}"));
    }
    assert_eq!(checked, STEPS * L * HQ);
    assert!(sparse_seen, "no stable head selected a strict subset of its pages");
    assert_eq!(pool.seq_length(seq, 0).unwrap(), PREFILL + STEPS);
    let st = pool.stats().unwrap();
    assert!(st.sel_pages > 0 && st.sel_resident <= st.sel_pages, "{st:?}");
    assert!(st.reranked_heads > 0);
    assert_eq!(st.n_seqs, 1);
    eprintln!(
        "decode: {STEPS} steps x {L} layers, max |err| {max_err:.2e}, sel {} resident {} \
         promoted {} evicted {}, not ready {not_ready}, isa {isa}",
        st.sel_pages, st.sel_resident, st.promoted_pages, st.evicted_pages
    );
    pool.seq_release(seq).expect("release");
    assert_eq!(pool.stats().unwrap().n_seqs, 0);
    pool.check().expect("check after release");
}

#[test]
fn errors_carry_code_and_message() {
    let geom = geometry();
    let pol = make_policy(&geom);
    let sel = Selector::new(&geom, None).expect("selector");
    let mut pool = Pool::new(&tiered_opts(geom, &pol, &sel)).expect("pool");
    let seq = pool.seq_create(0, 0).expect("seq");
    let k = kv_rows(0, 0, 0);
    let v = kv_rows(1, 0, 0);

    // A bad layer index: KVT_EINVAL, and the message names the argument.
    let e = pool.seq_append(seq, L, &k, &v, 1).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    assert_eq!(e.name(), "KVT_EINVAL");
    assert!(e.message.contains("layer"), "message: {:?}", e.message);
    assert!(e.to_string().contains("KVT_EINVAL") && e.to_string().contains("layer"), "{e}");
    let boxed: Box<dyn std::error::Error> = Box::new(e.clone());
    assert_eq!(boxed.to_string(), e.to_string());
    assert_eq!(pool.seq_length(seq, 0).unwrap(), 0, "a failed append stores nothing");

    // Short buffers are refused by the wrapper before any pointer is passed.
    let e = pool.seq_append(seq, 0, &k[..5], &v, 1).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL);
    assert!(e.message.starts_with("k:"), "{e}");

    // Step errors; a step dropped without finish() is finished by Drop.
    for t in 0..3 * P {
        for l in 0..L {
            pool.seq_append(seq, l, &kv_rows(0, l, t), &kv_rows(1, l, t), 1).unwrap();
        }
    }
    {
        let mut step = pool.step(&[seq], &StepOpts::new()).expect("plan");
        let e = step.append(L, &k, &v).unwrap_err();
        assert_eq!(e.code, sys::KVT_EINVAL);
        assert!(e.message.contains("layer"), "{e}");
        let q = queries(0, 0);
        let mut out = vec![0f32; (HQ * D) as usize];
        step.append(0, &k, &v).unwrap();
        let e = step.decode(0, &q, &mut out, None).unwrap_err();
        assert_eq!(e.code, sys::KVT_ESTATE, "decode before select: {e}");
        let e = step.selection(0, 1, 0).unwrap_err();
        assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
        assert!(e.message.contains("seq_index"), "{e}");
        let e = step.select(0, &q[..3]).unwrap_err();
        assert!(e.message.starts_with("q:"), "{e}");
    } // dropped: kvt_step_finish
    let step = pool.step(&[seq], &StepOpts::new()).expect("plan after a dropped step");
    step.finish().unwrap();
    pool.check().unwrap();

    // A released sequence is detected, not touched.
    pool.seq_release(seq).unwrap();
    let e = pool.seq_length(seq, 0).unwrap_err();
    assert_eq!(e.code, sys::KVT_ENOENT, "{e}");
    assert_eq!(pool.seq_release(seq).unwrap_err().code, sys::KVT_ENOENT);

    // Constructors report errors too.
    let e = Policy::with_classes(&geom, None, &[sys::KVT_HEAD_STABLE]).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    let bad = Geometry::new(L, HKV, HQ, 33, P, sys::KVT_DTYPE_F32);
    let e = bad.validate().unwrap_err();
    assert!(e.message.contains("head_dim"), "{e}");
    assert!(Selector::new(&bad, None).is_err());
}

#[test]
fn library_version_matches_headers() {
    assert_eq!(kvtier::version(), sys::KVT_VERSION_NUMBER);
    let want =
        format!("{}.{}.{}", sys::KVT_VERSION_MAJOR, sys::KVT_VERSION_MINOR, sys::KVT_VERSION_PATCH);
    assert_eq!(kvtier::version_string(), want);
    assert_eq!(kvtier::dtype_size(sys::KVT_DTYPE_F32), 4);
    assert_eq!(kvtier::dtype_size(sys::KVT_DTYPE_F16), 2);
    assert_eq!(kvtier::dtype_size(99), 0);
}

/// A dense step of 5 tokens (a speculative verification,
/// `StepOpts::new_tokens`): every row is the causal attention of its token
/// over the prefix and the new tokens up to its own, against the f64
/// reference; short buffers are refused for the step's rows.
#[test]
fn multi_token_step_is_causal() {
    let geom = geometry();
    let block = geom.block_bytes().unwrap();
    let opts = PoolOpts::new(geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(2)
        .max_seqs(2)
        .max_seq_tokens(256)
        .device_bytes(block * (L * HKV * 16) as u64);
    let mut pool = Pool::new(&opts).expect("pool");
    let seq = pool.seq_create(0, 0).expect("seq");
    const T0: u32 = 37;
    for t in 0..T0 {
        for l in 0..L {
            pool.seq_append(seq, l, &kv_rows(0, l, t), &kv_rows(1, l, t), 1).unwrap();
        }
    }
    let n_new = [5u32];
    let so = StepOpts::new().dense().new_tokens(&n_new);
    let mut step = pool.step(&[seq], &so).expect("plan");
    assert_eq!(step.rows(), 5);
    let (hd, kvd) = ((HQ * D) as usize, (HKV * D) as usize);
    let short = kv_rows(0, 0, T0);
    let e = step.append(0, &short, &short).unwrap_err();
    assert!(e.message.starts_with("k:"), "{e}");
    for l in 0..L {
        let k: Vec<f32> = (0..5).flat_map(|j| kv_rows(0, l, T0 + j)).collect();
        let v: Vec<f32> = (0..5).flat_map(|j| kv_rows(1, l, T0 + j)).collect();
        let q: Vec<f32> = (0..5).flat_map(|j| queries(l, T0 + j)).collect();
        let mut out = vec![0f32; 5 * hd];
        let mut lse = vec![0f32; 5 * HQ as usize];
        step.append(l, &k, &v).unwrap();
        step.attend(l, &q, &mut out, Some(&mut lse)).unwrap();
        assert_eq!(k.len(), 5 * kvd);
        for j in 0..5u32 {
            let len = T0 + j + 1; // the tokens row j sees
            let pages: Vec<u32> = (0..len.div_ceil(P)).collect();
            for h in 0..HQ {
                let r = (j * HQ + h) as usize;
                let (want, wl) = reference(
                    &step,
                    l,
                    h / (HQ / HKV),
                    len,
                    &pages,
                    &q[r * D as usize..][..D as usize],
                );
                for d in 0..D as usize {
                    let got = out[r * D as usize + d] as f64;
                    assert!(
                        (got - want[d]).abs() < 1e-4,
                        "layer {l} row {j} head {h}: {got} vs {}",
                        want[d]
                    );
                }
                assert!((lse[r] as f64 - wl).abs() < 1e-4 * (1.0 + wl.abs()), "lse row {j}");
            }
        }
    }
    step.finish().unwrap();
    assert_eq!(pool.seq_length(seq, 0).unwrap(), T0 + 5);
    pool.check().unwrap();
}
