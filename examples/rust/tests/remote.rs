//! The remote tier (kvtier/remote.h) through the safe wrapper, without a
//! Redis server: options errors naming their field, and a tier whose one
//! node does not exist: the pool is created, a sequence's remote prefix is a
//! miss landed by `seq_prefix_wait`, the writes are given up, the faults are
//! counted and logged through the closure (which outlives the options), and
//! the local tiers are untouched. A library built without hiredis answers
//! `KVT_ENOTSUP`, which is checked instead. Where `redis-server` is
//! installed, one is started on a Unix socket for a round trip: pages one
//! pool writes are landed in another's sequence and read back.
use kvtier::{sys, Geometry, Pool, PoolOpts, RemoteOpts, SeqId, SeqOpts};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const L: u32 = 2; // layers
const HKV: u32 = 2; // KV heads
const HQ: u32 = 4; // query heads
const D: u32 = 32; // head_dim
const P: u32 = 16; // page_tokens
const SALT: u64 = 0x7e57;
/// Physical pages (one per layer and KV head) of one logical page.
const LH: u64 = (L * HKV) as u64;
/// A socket nobody listens on: connecting fails at once.
const NOWHERE: &str = "unix:/nonexistent/kvtier-rust-test.sock";

fn opts<'a>() -> PoolOpts<'a> {
    let geom = Geometry::new(L, HKV, HQ, D, P, sys::KVT_DTYPE_F32);
    let block = geom.block_bytes().unwrap();
    PoolOpts::new(geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(2)
        .max_seqs(8)
        .max_seq_tokens(256)
        .device_bytes(block * (LH * 24 + 1))
        .prefix_cache([0; sys::KVT_NUM_TIERS])
}

fn remote() -> RemoteOpts {
    RemoteOpts::new(NOWHERE, "rust-test-model")
        .unwrap()
        .connect_timeout_ms(500)
        .io_timeout_ms(500)
        .retry_ms(5000)
}

/// A build without hiredis: no pool with a remote tier, and no flush.
fn check_not_supported(e: &kvtier::Error) {
    assert_eq!(e.code, sys::KVT_ENOTSUP, "{e}");
    assert!(e.message.contains("hiredis"), "message: {:?}", e.message);
    let mut pool = Pool::new(&opts()).expect("pool without the remote tier");
    let e = pool.remote_flush(10).unwrap_err();
    assert_eq!(e.code, sys::KVT_ENOTSUP, "{e}");
}

fn expect_einval(o: &PoolOpts, field: &str) {
    let e = Pool::new(o).map(|_| ()).unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{field}: {e}");
    assert!(e.message.contains(field), "{field}: message {:?}", e.message);
}

#[test]
fn remote_options_errors_name_their_field() {
    // Strings with a NUL are refused by the wrapper.
    let e = RemoteOpts::new("unix:/x\0y", "fp").unwrap_err();
    assert_eq!(e.code, sys::KVT_EINVAL, "{e}");
    assert!(e.message.contains("remote->endpoints"), "message: {:?}", e.message);
    let e = remote().key_prefix("a\0").unwrap_err();
    assert!(e.message.contains("remote->key_prefix"), "message: {:?}", e.message);
    let e = remote().auth(Some("u"), "p\0").unwrap_err();
    assert!(e.message.contains("remote->password"), "message: {:?}", e.message);

    // The defaults of kvt_remote_opts_init; the setters; no pointer kept.
    let r = remote().read_only().write_only().n_connections(3).pipeline(7).ttl_s(60);
    let raw = r.raw();
    assert_eq!(raw.struct_size as usize, std::mem::size_of::<sys::kvt_remote_opts>());
    assert_eq!(raw.flags, sys::KVT_REMOTE_NO_PUT | sys::KVT_REMOTE_NO_GET);
    assert_eq!((raw.n_connections, raw.pipeline, raw.ttl_s, raw.queue_bytes), (3, 7, 60, 0));
    assert!(raw.endpoints.is_null() && raw.fingerprint.is_null() && raw.log.is_none());
    let r = r.auth(None, "secret").unwrap();
    assert!(!format!("{r:?}").contains("secret"), "the password is not printed");
    let o = opts().remote(&r);
    assert!(o.raw().remote.is_null(), "filled in for Pool::new only");

    // The library's checks, each naming its field (before the build's
    // support for the tier is asked).
    let o = opts();
    let block = o.raw().geom.block_bytes().unwrap();
    let without_cache = PoolOpts::new(o.raw().geom)
        .backend(sys::KVT_BACKEND_CPU)
        .n_threads(1)
        .device_bytes(block * (LH * 8 + 1))
        .remote(&remote());
    assert_eq!(without_cache.raw().flags & sys::KVT_POOL_PREFIX_CACHE, 0);
    expect_einval(&without_cache, "KVT_POOL_PREFIX_CACHE");
    expect_einval(
        &o.clone().remote(&RemoteOpts::new(NOWHERE, "").unwrap()),
        "opts->remote->fingerprint",
    );
    expect_einval(&o.clone().remote(&remote().flags(1 << 7)), "opts->remote->flags");
    expect_einval(&o.clone().remote(&remote().n_connections(65)), "opts->remote->n_connections");
    expect_einval(&o.clone().remote(&remote().pipeline(5000)), "opts->remote->pipeline");
    expect_einval(&o.clone().remote(&remote().key_prefix("a b").unwrap()), "remote->key_prefix");
}

#[test]
fn unreachable_node_is_a_miss_and_logged() {
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = Arc::clone(&log);
    // The options (their strings, the PoolOpts holding a copy) are dropped
    // as soon as the pool is created: kvt_pool_create copied them; the log
    // closure stays alive with the pool.
    let created = {
        let r = remote().log(move |line| sink.lock().unwrap().push(line.to_string()));
        let o = opts().remote(&r);
        Pool::new(&o)
    };
    let mut pool = match created {
        Ok(p) => p,
        Err(e) => return check_not_supported(&e),
    };

    // Three whole pages and 5 tokens: nothing local, the pages are asked
    // of the remote tier, and the sequence is loading until they land.
    let ids: Vec<u32> = (0..3 * P + 5).map(|t| 500 + 3 * t).collect();
    let seq = pool.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&ids)).expect("seq");
    let info = pool.seq_info(seq).unwrap();
    assert_eq!((info.remote_loading, info.remote_tokens, info.n_tokens), (1, 0, 0), "{info:?}");
    let k = vec![0.5f32; (HKV * D) as usize];
    let e = pool.seq_append(seq, 0, &k, &k, 1).unwrap_err();
    assert_eq!(e.code, sys::KVT_EAGAIN, "append while loading: {e}");
    assert_eq!(pool.seq_prefix_wait(seq, u32::MAX).expect("prefix_wait"), 0, "a miss");
    let info = pool.seq_info(seq).unwrap();
    assert_eq!((info.remote_loading, info.remote_tokens, info.prefix_tokens), (0, 0, 0));
    assert_eq!(pool.seq_prefix_wait(seq, 0).unwrap(), 0, "not loading: at once");
    let st = pool.stats().unwrap();
    assert_eq!(st.remote_fetches, 1, "{st:?}");
    assert_eq!(st.remote_hit_values, 0, "{st:?}");
    assert_eq!(st.remote_miss_values, 3, "{st:?}");
    assert!(st.remote_errors >= 1, "{st:?}");

    // The engine prefills: the full pages are keyed and queued for the
    // remote tier, whose node is still down: given up, never an error.
    for l in 0..L {
        let rows: Vec<f32> =
            (0..(3 * P + 5) * HKV * D).map(|i| (i % 97) as f32 / 97.0 - l as f32).collect();
        pool.seq_append(seq, l, &rows, &rows, 3 * P + 5).expect("prefill");
    }
    pool.remote_flush(10_000).expect("flush");
    let st = pool.stats().unwrap();
    assert_eq!(st.prefix_keyed_pages, 3 * LH, "{st:?}");
    assert_eq!(st.remote_put_values, 0, "{st:?}");
    assert_eq!(st.remote_put_dropped, 3, "{st:?}");
    assert_eq!(st.remote_queue_bytes, 0, "flushed: {st:?}");
    assert_eq!(pool.seq_info(seq).unwrap().n_tokens, 3 * P + 5);
    pool.check().expect("check");

    let lines = log.lock().unwrap().clone();
    assert!(!lines.is_empty(), "the fault is logged");
    assert!(
        lines.iter().any(|l| l.contains("/nonexistent/kvtier-rust-test.sock")),
        "the node named from the library's copy of the endpoints: {lines:?}"
    );
    pool.seq_release(seq).unwrap();
    drop(pool);
    assert_eq!(Arc::strong_count(&log), 1, "the pool let its log closure go");
}

#[test]
fn flush_without_a_remote_tier_is_not_supported() {
    let mut pool = Pool::new(&opts()).expect("pool");
    let e = pool.remote_flush(10).unwrap_err();
    assert_eq!(e.code, sys::KVT_ENOTSUP, "{e}");
    // prefix_wait on a sequence that is not loading returns at once.
    let ids: Vec<u32> = (0..2 * P).collect();
    let seq = pool.seq_create_with(&SeqOpts::new().prefix(&ids)).unwrap();
    let e = pool.seq_remote_push(seq).unwrap_err();
    assert_eq!(e.code, sys::KVT_ENOTSUP, "{e}");
    let info = pool.seq_info(seq).unwrap();
    assert_eq!((info.remote_loading, info.remote_tokens), (0, 0), "{info:?}");
    assert_eq!(pool.seq_prefix_wait(seq, 0).unwrap(), 0);
    pool.seq_release(seq).unwrap();
    let e = pool.seq_prefix_wait(seq, 0).unwrap_err();
    assert_eq!(e.code, sys::KVT_ENOENT, "{e}");
    let st = pool.stats().unwrap();
    assert_eq!((st.remote_fetches, st.remote_errors, st.remote_put_values), (0, 0, 0));
}

/// A deterministic value in [-1, 1) (splitmix64 of the arguments).
fn val(kind: u64, layer: u32, t: u32, x: u32) -> f32 {
    let mut z = kind
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((layer as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add((t as u64).wrapping_mul(0x94d0_49bb_1331_11eb))
        .wrapping_add(x as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
}

/// K (kind 0) or V (kind 1) rows of tokens `from .. to` of one layer,
/// `[to - from][HKV][D]`.
fn rows(kind: u64, layer: u32, from: u32, to: u32) -> Vec<f32> {
    (from..to).flat_map(|t| (0..HKV * D).map(move |x| val(kind, layer, t, x))).collect()
}

/// A redis-server of this test's own on a Unix socket in a fresh
/// directory; killed (this child only) and the directory removed on drop.
struct Server {
    child: Child,
    dir: PathBuf,
    endpoint: String,
}

impl Server {
    /// None where redis-server is not installed or does not come up.
    fn start() -> Option<Server> {
        let dir = std::env::temp_dir().join(format!("kvtier-rust-redis.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).ok()?;
        let sock = dir.join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--save", "", "--appendonly", "no", "--unixsocket"])
            .arg(&sock)
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut server = match child {
            Ok(child) => Server { child, dir, endpoint: format!("unix:{}", sock.display()) },
            Err(_) => {
                let _ = std::fs::remove_dir_all(&dir);
                return None;
            }
        };
        let t0 = Instant::now();
        while !sock.exists() {
            if t0.elapsed() > Duration::from_secs(10) || server.child.try_wait().ok()?.is_some() {
                return None; // (dropped: killed, directory removed)
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn server_pool<'a>(endpoint: &str, fingerprint: &str) -> kvtier::Result<Pool<'a>> {
    let r = RemoteOpts::new(endpoint, fingerprint)?.connect_timeout_ms(2000).io_timeout_ms(2000);
    Pool::new(&opts().remote(&r))
}

fn assert_rows(pool: &Pool, seq: SeqId, n: u32, what: &str) {
    for l in 0..L {
        for h in 0..HKV {
            let (k, v) = pool.seq_read_kv(seq, l, h, 0, n).expect("read_kv");
            let want = |kind| -> Vec<f32> {
                (0..n).flat_map(|t| (0..D).map(move |d| val(kind, l, t, h * D + d))).collect()
            };
            assert!(k == want(0), "{what}: K of layer {l} head {h}");
            assert!(v == want(1), "{what}: V of layer {l} head {h}");
        }
    }
}

#[test]
fn round_trip_through_a_redis_server() {
    let Some(server) = Server::start() else {
        eprintln!("round_trip_through_a_redis_server: no redis-server; skipped");
        return;
    };
    let mut writer = match server_pool(&server.endpoint, "model-a") {
        Ok(p) => p,
        Err(e) => return check_not_supported(&e),
    };
    // The writer prefills three pages and 5 tokens: its three full pages
    // are written behind.
    let n = 3 * P + 5;
    let ids: Vec<u32> = (0..n).map(|t| 7000 + 11 * t).collect();
    let a = writer.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&ids)).unwrap();
    assert_eq!(writer.seq_prefix_wait(a, u32::MAX).unwrap(), 0, "nothing there yet");
    for l in 0..L {
        writer.seq_append(a, l, &rows(0, l, 0, n), &rows(1, l, 0, n), n).expect("prefill");
    }
    writer.remote_flush(20_000).expect("flush");
    let st = writer.stats().unwrap();
    assert_eq!((st.remote_put_values, st.remote_put_dropped), (3, 0), "{st:?}");
    assert_eq!(st.remote_errors, 0, "{st:?}");

    // Another pool of the same model lands them; the 5 tokens past the
    // last whole page are the engine's to prefill.
    let mut reader = server_pool(&server.endpoint, "model-a").unwrap();
    let b = reader.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&ids)).unwrap();
    assert_eq!(reader.seq_info(b).unwrap().remote_loading, 1);
    assert_eq!(reader.seq_prefix_wait(b, u32::MAX).expect("prefix_wait"), 3 * P);
    let info = reader.seq_info(b).unwrap();
    assert_eq!((info.remote_loading, info.remote_tokens), (0, 3 * P), "{info:?}");
    assert_eq!((info.prefix_tokens, info.n_tokens), (3 * P, 3 * P), "{info:?}");
    assert_rows(&reader, b, 3 * P, "landed");
    let st = reader.stats().unwrap();
    assert_eq!((st.remote_fetches, st.remote_hit_values, st.remote_miss_values), (1, 3, 0));
    for l in 0..L {
        reader.seq_append(b, l, &rows(0, l, 3 * P, n), &rows(1, l, 3 * P, n), 5).unwrap();
    }
    assert_rows(&reader, b, n, "prefilled");
    reader.check().expect("check");

    // Another salt, or another model, matches nothing.
    let c = reader.seq_create_with(&SeqOpts::new().salt(SALT + 1).prefix(&ids)).unwrap();
    assert_eq!(reader.seq_prefix_wait(c, u32::MAX).unwrap(), 0);
    let mut other = server_pool(&server.endpoint, "model-b").unwrap();
    let d = other.seq_create_with(&SeqOpts::new().salt(SALT).prefix(&ids)).unwrap();
    assert_eq!(other.seq_prefix_wait(d, u32::MAX).unwrap(), 0);
    assert_eq!(other.stats().unwrap().remote_hit_values, 0);
    drop((writer, reader, other));
    drop(server);
}
