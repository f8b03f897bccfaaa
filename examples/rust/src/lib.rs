//! Rust bindings for libkvtier.
//!
//! [`sys`] holds the raw FFI, written by hand from include/kvtier/*.h. The
//! rest of this crate is a safe wrapper over it:
//!
//! * every call that can fail returns [`Result`], whose [`Error`] carries the
//!   library's code (`sys::KVT_E*`) and the message of `kvt_last_error()`;
//! * handles free themselves: [`Pool`], [`Policy`] and [`Selector`] on drop,
//!   and a [`Step`] finishes itself when dropped;
//! * lifetimes encode the header's ownership rules: a [`Pool`] borrows the
//!   [`Policy`] and [`Selector`] it was created with, and a [`Step`] borrows
//!   its pool mutably, so the pool cannot be touched while a step is open;
//! * slices are checked against the geometry before any pointer crosses the
//!   boundary (a short buffer is an `EINVAL` error, never a wild read);
//! * token ids (the prefix cache, kvtier/prefix.h) go in as slices that the
//!   options borrow ([`SeqOpts::prefix`], [`StepOpts::token_ids`]);
//! * the remote tier (kvtier/remote.h): [`RemoteOpts`] owns its strings, which
//!   `kvt_pool_create` copies, so the pool borrows nothing from them; its log
//!   closure is shared with the pool ([`Arc`]) and lives as long as it;
//! * the selection cache: `rerank_similarity` of [`SelectorOpts`] and
//!   [`PolicyOpts`], [`Selector::set_rerank_similarity`], and the
//!   `head_selections` / `similarity_reranks` counters of [`Stats`].
//!
//! Buffers passed to the kernels are f32 (`KVT_DTYPE_F32` as the source type);
//! the pool itself may store f16, bf16 or f32.

pub mod sys;

use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::Arc;

pub use sys::kvt_geometry as Geometry;
pub use sys::kvt_pool_sizing as PoolSizing;
pub use sys::kvt_seq_info as SeqInfo;
pub use sys::kvt_stats as Stats;
pub use sys::{kvt_backend as Backend, kvt_dtype as Dtype, kvt_head_class as HeadClass};

/// A sequence of a [`Pool`]. Ids of released sequences are detected by the
/// library (`KVT_ENOENT`), so a plain copyable id is safe to hand around.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(pub sys::kvt_seq_id);

// ---- errors ----------------------------------------------------------------

/// A failed libkvtier call: the negative code and the detail message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// One of `sys::KVT_E*`.
    pub code: i32,
    /// `kvt_last_error()` of the failed call: names the argument and value.
    pub message: String,
}

impl Error {
    /// The error of the call that just returned `code` on this thread.
    fn last(code: c_int) -> Error {
        Error { code, message: cstr(unsafe { sys::kvt_last_error() }) }
    }
    /// An error detected by the wrapper before calling the library.
    fn invalid(message: String) -> Error {
        Error { code: sys::KVT_EINVAL, message }
    }
    /// The code's symbolic name, e.g. "KVT_EINVAL".
    pub fn name(&self) -> &'static str {
        static_cstr(unsafe { sys::kvt_err_name(self.code) })
    }
    /// The code's description, e.g. "invalid argument".
    pub fn description(&self) -> &'static str {
        static_cstr(unsafe { sys::kvt_strerror(self.code) })
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.description())?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn check(rc: c_int) -> Result<()> {
    if rc == sys::KVT_OK {
        Ok(())
    } else {
        Err(Error::last(rc))
    }
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// For the library's static strings (kvt_strerror, kvt_version_string, ...).
fn static_cstr(p: *const c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("?")
}

fn need(what: &str, len: usize, want: usize) -> Result<()> {
    if len < want {
        Err(Error::invalid(format!("{what}: {len} elements, at least {want} needed")))
    } else {
        Ok(())
    }
}

fn to_u32(what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::invalid(format!("{what}: {n} does not fit in 32 bits")))
}

// ---- library ---------------------------------------------------------------

/// "MAJOR.MINOR.PATCH" of the loaded library.
pub fn version_string() -> &'static str {
    static_cstr(unsafe { sys::kvt_version_string() })
}

/// MAJOR*10000 + MINOR*100 + PATCH of the loaded library.
pub fn version() -> u32 {
    unsafe { sys::kvt_version() }
}

/// `sys::KVT_FEATURE_*` bits of the loaded library.
pub fn build_features() -> u32 {
    unsafe { sys::kvt_build_features() }
}

/// Bytes per element of a dtype (0 for an unknown one).
pub fn dtype_size(dtype: Dtype) -> usize {
    unsafe { sys::kvt_dtype_size(dtype) }
}

impl sys::kvt_geometry {
    /// A geometry; page_tokens 0 means 16, dtype `KVT_DTYPE_DEFAULT` f16.
    pub fn new(
        n_layers: u32,
        n_kv_heads: u32,
        n_q_heads: u32,
        head_dim: u32,
        page_tokens: u32,
        dtype: Dtype,
    ) -> Geometry {
        Geometry { n_layers, n_kv_heads, n_q_heads, head_dim, page_tokens, dtype, reserved: [0; 2] }
    }
    pub fn validate(&self) -> Result<()> {
        check(unsafe { sys::kvt_geometry_validate(self) })
    }
    /// Bytes of one physical block (one page of one layer and KV head, K and V).
    pub fn block_bytes(&self) -> Result<u64> {
        let mut out = 0u64;
        check(unsafe { sys::kvt_geometry_block_bytes(self, &mut out) })?;
        Ok(out)
    }
    /// n_q_heads with 0 resolved to n_kv_heads.
    pub fn q_heads(&self) -> u32 {
        if self.n_q_heads == 0 {
            self.n_kv_heads
        } else {
            self.n_q_heads
        }
    }
    /// page_tokens with 0 resolved to 16.
    pub fn page_size(&self) -> u32 {
        if self.page_tokens == 0 {
            16
        } else {
            self.page_tokens
        }
    }
}

// ---- policy ----------------------------------------------------------------

/// Options of [`Policy::new`]: `kvt_policy_opts` filled with the defaults.
pub type PolicyOpts = sys::kvt_policy_opts;

impl sys::kvt_policy_opts {
    pub fn defaults() -> PolicyOpts {
        let mut o = PolicyOpts::default();
        let rc = unsafe { sys::kvt_policy_opts_init(&mut o) };
        debug_assert_eq!(rc, 0);
        o
    }
}

/// An immutable head-stability policy (`kvt_policy`); shareable across
/// threads and pools.
#[derive(Debug)]
pub struct Policy {
    raw: NonNull<sys::kvt_policy>,
}

unsafe impl Send for Policy {}
unsafe impl Sync for Policy {}

impl Policy {
    /// Every head with the options' values (`None`: the defaults).
    pub fn new(geom: &Geometry, opts: Option<&PolicyOpts>) -> Result<Policy> {
        let mut raw = ptr::null_mut();
        let o = opts.map_or(ptr::null(), |o| o as *const _);
        check(unsafe { sys::kvt_policy_create(geom, o, &mut raw) })?;
        Ok(Policy { raw: NonNull::new(raw).expect("kvt_policy_create returned NULL") })
    }

    /// One class per (layer, KV head), index layer * n_kv_heads + kv_head;
    /// budgets and intervals from `opts`.
    pub fn with_classes(
        geom: &Geometry,
        opts: Option<&PolicyOpts>,
        classes: &[HeadClass],
    ) -> Result<Policy> {
        let heads = sys::kvt_policy_heads {
            struct_size: std::mem::size_of::<sys::kvt_policy_heads>() as u32,
            n_heads: to_u32("classes", classes.len())?,
            head_class: classes.as_ptr(),
            top_k_pages: ptr::null(),
            window: ptr::null(),
            sink_pages: ptr::null(),
            local_pages: ptr::null(),
            rerank_interval: ptr::null(),
            rerank_similarity: ptr::null(),
        };
        let mut raw = ptr::null_mut();
        let o = opts.map_or(ptr::null(), |o| o as *const _);
        check(unsafe { sys::kvt_policy_create_heads(geom, o, &heads, &mut raw) })?;
        Ok(Policy { raw: NonNull::new(raw).expect("kvt_policy_create_heads returned NULL") })
    }

    /// Heads of class `class`.
    pub fn count(&self, class: HeadClass) -> Result<u32> {
        let mut n = 0;
        check(unsafe { sys::kvt_policy_count_get(self.raw.as_ptr(), class, &mut n) })?;
        Ok(n)
    }

    /// The record of one head.
    pub fn head(&self, layer: u32, kv_head: u32) -> Result<sys::kvt_policy_head_info> {
        let mut info = sys::kvt_policy_head_info {
            struct_size: std::mem::size_of::<sys::kvt_policy_head_info>() as u32,
            ..Default::default()
        };
        check(unsafe { sys::kvt_policy_head_get(self.raw.as_ptr(), layer, kv_head, &mut info) })?;
        Ok(info)
    }

    /// A readable summary (memory at `ctx_tokens` tokens per sequence when > 0).
    pub fn describe(&self, ctx_tokens: u64) -> Result<String> {
        let mut needed = 0usize;
        check(unsafe {
            sys::kvt_policy_describe(self.raw.as_ptr(), ctx_tokens, ptr::null_mut(), 0, &mut needed)
        })?;
        let mut buf = vec![0u8; needed + 1];
        check(unsafe {
            sys::kvt_policy_describe(
                self.raw.as_ptr(),
                ctx_tokens,
                buf.as_mut_ptr() as *mut c_char,
                buf.len(),
                &mut needed,
            )
        })?;
        Ok(cstr(buf.as_ptr() as *const c_char))
    }

    pub fn as_ptr(&self) -> *const sys::kvt_policy {
        self.raw.as_ptr()
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        unsafe { sys::kvt_policy_destroy(self.raw.as_ptr()) }
    }
}

// ---- selector --------------------------------------------------------------

/// Options of [`Selector::new`]: `kvt_selector_opts` filled with the defaults.
pub type SelectorOpts = sys::kvt_selector_opts;

impl sys::kvt_selector_opts {
    pub fn defaults() -> SelectorOpts {
        let mut o = SelectorOpts::default();
        let rc = unsafe { sys::kvt_selector_opts_init(&mut o) };
        debug_assert_eq!(rc, 0);
        o
    }
}

/// A page selector (`kvt_selector`). Its setters take `&mut self`, so a
/// selector shared by reference is only read, as the header requires.
#[derive(Debug)]
pub struct Selector {
    raw: NonNull<sys::kvt_selector>,
}

unsafe impl Send for Selector {}
unsafe impl Sync for Selector {}

impl Selector {
    pub fn new(geom: &Geometry, opts: Option<&SelectorOpts>) -> Result<Selector> {
        let mut raw = ptr::null_mut();
        let o = opts.map_or(ptr::null(), |o| o as *const _);
        check(unsafe { sys::kvt_selector_create(geom, o, &mut raw) })?;
        Ok(Selector { raw: NonNull::new(raw).expect("kvt_selector_create returned NULL") })
    }

    /// Budget of one (layer, kv_head); `sys::KVT_ALL` for every one.
    pub fn set_budget(
        &mut self,
        layer: u32,
        kv_head: u32,
        top_k: u32,
        sink: u32,
        local: u32,
    ) -> Result<()> {
        check(unsafe {
            sys::kvt_selector_budget_set(self.raw.as_ptr(), layer, kv_head, top_k, sink, local)
        })
    }

    /// (top_k_pages, sink_pages, local_pages) of one (layer, kv_head).
    pub fn budget(&self, layer: u32, kv_head: u32) -> Result<(u32, u32, u32)> {
        let (mut k, mut s, mut l) = (0, 0, 0);
        check(unsafe {
            sys::kvt_selector_budget_get(self.raw.as_ptr(), layer, kv_head, &mut k, &mut s, &mut l)
        })?;
        Ok((k, s, l))
    }

    pub fn set_rerank_interval(&mut self, layer: u32, kv_head: u32, interval: u32) -> Result<()> {
        check(unsafe {
            sys::kvt_selector_rerank_interval_set(self.raw.as_ptr(), layer, kv_head, interval)
        })
    }

    /// The selection cache's threshold of one (layer, kv_head)
    /// (`kvt_selector_rerank_similarity_set`; `sys::KVT_ALL` for every one):
    /// between the interval's reranks a head is rescored once the cosine
    /// similarity of its query to the query of its last rerank falls below
    /// `threshold`, -1 ..= 1 (-1 = the interval alone); anything else,
    /// NaN included, is `KVT_EINVAL`.
    pub fn set_rerank_similarity(
        &mut self,
        layer: u32,
        kv_head: u32,
        threshold: f32,
    ) -> Result<()> {
        check(unsafe {
            sys::kvt_selector_rerank_similarity_set(self.raw.as_ptr(), layer, kv_head, threshold)
        })
    }

    pub fn as_ptr(&self) -> *const sys::kvt_selector {
        self.raw.as_ptr()
    }
}

impl Drop for Selector {
    fn drop(&mut self) {
        unsafe { sys::kvt_selector_destroy(self.raw.as_ptr()) }
    }
}

// ---- pool ------------------------------------------------------------------

/// Options of [`Pool::new`]: `kvt_pool_opts` plus the borrows that must
/// outlive the pool (policy, selector), the disk directory's string and the
/// remote tier's options.
///
/// The pointers into owned data (`disk_dir`, `remote`) are not kept in the
/// raw struct: they are filled in for the length of each call that reads
/// them, so a moved or cloned `PoolOpts` never holds a stale one.
#[derive(Debug, Clone)]
pub struct PoolOpts<'a> {
    raw: sys::kvt_pool_opts,
    disk_dir: Option<CString>,
    remote: Option<RemoteOpts>,
    _borrows: PhantomData<&'a ()>,
}

impl<'a> PoolOpts<'a> {
    /// The library's defaults (`kvt_pool_opts_init`) with this geometry.
    pub fn new(geom: Geometry) -> PoolOpts<'a> {
        let mut raw = std::mem::MaybeUninit::<sys::kvt_pool_opts>::zeroed();
        let rc = unsafe { sys::kvt_pool_opts_init(raw.as_mut_ptr()) };
        debug_assert_eq!(rc, 0);
        // Zeroed and then filled by the library: every field is initialised
        // (null pointers and zeros are valid values of every field).
        let mut raw = unsafe { raw.assume_init() };
        raw.geom = geom;
        PoolOpts { raw, disk_dir: None, remote: None, _borrows: PhantomData }
    }
    pub fn backend(mut self, backend: Backend) -> Self {
        self.raw.backend = backend;
        self
    }
    pub fn device_bytes(mut self, n: u64) -> Self {
        self.raw.device_bytes = n;
        self
    }
    pub fn host_bytes(mut self, n: u64) -> Self {
        self.raw.host_bytes = n;
        self
    }
    /// A disk tier of `bytes` in the existing directory `dir`.
    pub fn disk(mut self, dir: &str, bytes: u64) -> Result<Self> {
        let c = CString::new(dir).map_err(|_| Error::invalid("disk_dir: contains a NUL".into()))?;
        self.disk_dir = Some(c);
        self.raw.disk_bytes = bytes;
        Ok(self)
    }
    pub fn max_seqs(mut self, n: u32) -> Self {
        self.raw.max_seqs = n;
        self
    }
    pub fn max_seq_tokens(mut self, n: u32) -> Self {
        self.raw.max_seq_tokens = n;
        self
    }
    pub fn n_threads(mut self, n: u32) -> Self {
        self.raw.n_threads = n;
        self
    }
    /// Tiered placement by head class; the policy outlives the pool.
    pub fn policy(mut self, policy: &'a Policy) -> Self {
        self.raw.policy = policy.as_ptr();
        self
    }
    /// The selector of warm-up and of steps that name none.
    pub fn selector(mut self, selector: &'a Selector) -> Self {
        self.raw.selector = selector.as_ptr();
        self
    }
    /// The sizing targets (kvt_pool_sizing_get; device_bytes 0 sizes by them).
    pub fn target(mut self, tokens: u64, seqs: u32) -> Self {
        self.raw.target_tokens = tokens;
        self.raw.target_seqs = seqs;
        self
    }
    /// The prefix cache (`KVT_POOL_PREFIX_CACHE`): full pages whose token ids
    /// are known outlive their sequences until reclaimed. `cap_bytes` per tier
    /// (device, host, disk) bounds the bytes cached pages no sequence holds
    /// may keep there; 0 = no cap but the tier's size.
    pub fn prefix_cache(mut self, cap_bytes: [u64; sys::KVT_NUM_TIERS]) -> Self {
        self.raw.flags |= sys::KVT_POOL_PREFIX_CACHE;
        self.raw.prefix_cache_bytes = cap_bytes;
        self
    }
    /// The remote tier (kvtier/remote.h) behind the prefix cache, which it
    /// requires ([`PoolOpts::prefix_cache`]). The options are copied here and
    /// again by `kvt_pool_create`: the pool keeps nothing of them but their
    /// log closure. A library built without hiredis fails [`Pool::new`] with
    /// `KVT_ENOTSUP`.
    pub fn remote(mut self, remote: &RemoteOpts) -> Self {
        self.remote = Some(remote.clone());
        self
    }
    /// The raw options, for fields without a setter. Its `disk_dir` and
    /// `remote` are null: [`PoolOpts::disk`] and [`PoolOpts::remote`] are
    /// pointed at for the length of each call only.
    pub fn raw(&self) -> &sys::kvt_pool_opts {
        &self.raw
    }
    /// What a pool needs for the targets under the policy.
    pub fn sizing(&self) -> Result<PoolSizing> {
        let mut out = PoolSizing {
            struct_size: std::mem::size_of::<PoolSizing>() as u32,
            ..Default::default()
        };
        check(self.with_raw(|o| unsafe { sys::kvt_pool_sizing_get(o, &mut out) }))?;
        Ok(out)
    }
    /// Calls `f` with the raw options whose `disk_dir` and `remote` point
    /// into `self` (and the remote options' strings into theirs): valid for
    /// the call, which is as long as the library reads them.
    fn with_raw<R>(&self, f: impl FnOnce(&sys::kvt_pool_opts) -> R) -> R {
        let mut raw = self.raw;
        raw.disk_dir = self.disk_dir.as_ref().map_or(ptr::null(), |c| c.as_ptr());
        let remote = self.remote.as_ref().map(RemoteOpts::to_raw);
        raw.remote = remote.as_ref().map_or(ptr::null(), |r| r as *const sys::kvt_remote_opts);
        f(&raw)
    }
}

// ---- remote tier -----------------------------------------------------------

/// The remote tier's log: one line per fault or state change, called from
/// the tier's threads (and the caller's), one call at a time per pool.
type RemoteLog = Box<dyn Fn(&str) + Send + Sync + 'static>;

/// The C side of [`RemoteOpts::log`]: `ctx` is the `RemoteLog` an `Arc` that
/// the pool holds keeps alive. A panic is caught here: it must not unwind
/// into the library's threads.
unsafe extern "C" fn remote_log_trampoline(ctx: *mut c_void, msg: *const c_char) {
    if ctx.is_null() || msg.is_null() {
        return;
    }
    let f = &*(ctx as *const RemoteLog);
    let line = CStr::from_ptr(msg).to_string_lossy();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&line)));
}

/// Options of the remote tier ([`PoolOpts::remote`]): `kvt_remote_opts`
/// with the library's defaults and owned strings. `kvt_pool_create` copies
/// the options and every string they name, so they need only live through
/// [`Pool::new`]; the log closure, which the library calls for the pool's
/// whole life, is kept by the pool.
#[derive(Clone)]
pub struct RemoteOpts {
    raw: sys::kvt_remote_opts, // strings and log filled in by to_raw
    endpoints: CString,
    fingerprint: CString,
    user: Option<CString>,
    password: Option<CString>,
    key_prefix: Option<CString>,
    log: Option<Arc<RemoteLog>>,
}

impl fmt::Debug for RemoteOpts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.raw;
        f.debug_struct("RemoteOpts")
            .field("endpoints", &self.endpoints)
            .field("fingerprint", &self.fingerprint)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<set>"))
            .field("key_prefix", &self.key_prefix)
            .field("flags", &r.flags)
            .field("connect_timeout_ms", &r.connect_timeout_ms)
            .field("io_timeout_ms", &r.io_timeout_ms)
            .field("retry_ms", &r.retry_ms)
            .field("n_connections", &r.n_connections)
            .field("pipeline", &r.pipeline)
            .field("ttl_s", &r.ttl_s)
            .field("queue_bytes", &r.queue_bytes)
            .field("log", &self.log.is_some())
            .finish()
    }
}

fn owned_cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what}: contains a NUL")))
}

impl RemoteOpts {
    /// The defaults (`kvt_remote_opts_init`) with the two required fields:
    /// `endpoints`, comma-separated `redis://host:port` or
    /// `unix:/path/to/socket` (a cluster's seed nodes or the one server),
    /// and `fingerprint`, the model's identity (a weights hash, a revision;
    /// non-empty): pools of other fingerprints never share values.
    pub fn new(endpoints: &str, fingerprint: &str) -> Result<RemoteOpts> {
        let mut raw = sys::kvt_remote_opts::default();
        let rc = unsafe { sys::kvt_remote_opts_init(&mut raw) };
        debug_assert_eq!(rc, 0);
        Ok(RemoteOpts {
            raw,
            endpoints: owned_cstring("remote->endpoints", endpoints)?,
            fingerprint: owned_cstring("remote->fingerprint", fingerprint)?,
            user: None,
            password: None,
            key_prefix: None,
            log: None,
        })
    }
    /// AUTH with a password, as `user` (an ACL user) or the default user.
    pub fn auth(mut self, user: Option<&str>, password: &str) -> Result<Self> {
        self.user = user.map(|u| owned_cstring("remote->user", u)).transpose()?;
        self.password = Some(owned_cstring("remote->password", password)?);
        Ok(self)
    }
    /// Keys are `PREFIX:NAMESPACE:CHAINHASH`; the default prefix is "kvt".
    pub fn key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.key_prefix = Some(owned_cstring("remote->key_prefix", prefix)?);
        Ok(self)
    }
    /// `sys::KVT_REMOTE_*` bits (replacing those set).
    pub fn flags(mut self, flags: u32) -> Self {
        self.raw.flags = flags;
        self
    }
    /// `KVT_REMOTE_NO_PUT`: this pool writes nothing.
    pub fn read_only(mut self) -> Self {
        self.raw.flags |= sys::KVT_REMOTE_NO_PUT;
        self
    }
    /// `KVT_REMOTE_NO_GET`: sequences created in this pool ask nothing.
    pub fn write_only(mut self) -> Self {
        self.raw.flags |= sys::KVT_REMOTE_NO_GET;
        self
    }
    /// 0 = 1000 ms.
    pub fn connect_timeout_ms(mut self, ms: u32) -> Self {
        self.raw.connect_timeout_ms = ms;
        self
    }
    /// A reply later than this is a fault; 0 = 1000 ms.
    pub fn io_timeout_ms(mut self, ms: u32) -> Self {
        self.raw.io_timeout_ms = ms;
        self
    }
    /// The first back-off after a node's fault (doubling up to 64 x); 0 = 500 ms.
    pub fn retry_ms(mut self, ms: u32) -> Self {
        self.raw.retry_ms = ms;
        self
    }
    /// Threads, each with one connection to each node; 1..64, 0 = 2.
    pub fn n_connections(mut self, n: u32) -> Self {
        self.raw.n_connections = n;
        self
    }
    /// Commands in flight per connection; 1..4096, 0 = about 4 MiB of values.
    pub fn pipeline(mut self, n: u32) -> Self {
        self.raw.pipeline = n;
        self
    }
    /// Values expire after this; 0 = never (the server's eviction decides).
    pub fn ttl_s(mut self, s: u32) -> Self {
        self.raw.ttl_s = s;
        self
    }
    /// The most bytes of values waiting to be written (more are dropped:
    /// [`Stats`]`::remote_put_dropped`); 0 = 256 MiB.
    pub fn queue_bytes(mut self, n: u64) -> Self {
        self.raw.queue_bytes = n;
        self
    }
    /// One line per remote fault or state change (no trailing newline),
    /// called from the tier's threads and the caller's, one call at a time
    /// per pool. Every pool created with these options shares the closure
    /// and keeps it until it is dropped. A panic in it is caught (and the
    /// line lost): it never unwinds into the library.
    pub fn log<F: Fn(&str) + Send + Sync + 'static>(mut self, f: F) -> Self {
        self.log = Some(Arc::new(Box::new(f)));
        self
    }
    /// The raw options: the numbers and flags. The string pointers, `log`
    /// and `log_ctx` are null: they are filled in, pointing into `self`, for
    /// the length of [`Pool::new`] only.
    pub fn raw(&self) -> &sys::kvt_remote_opts {
        &self.raw
    }
    /// The raw options with pointers into `self`: valid while `self` is
    /// borrowed, which the caller (PoolOpts::with_raw) makes the whole call.
    fn to_raw(&self) -> sys::kvt_remote_opts {
        fn p(c: &Option<CString>) -> *const c_char {
            c.as_ref().map_or(ptr::null(), |c| c.as_ptr())
        }
        let mut r = self.raw;
        r.endpoints = self.endpoints.as_ptr();
        r.fingerprint = self.fingerprint.as_ptr();
        r.user = p(&self.user);
        r.password = p(&self.password);
        r.key_prefix = p(&self.key_prefix);
        if let Some(log) = &self.log {
            r.log = Some(remote_log_trampoline);
            r.log_ctx = Arc::as_ptr(log) as *mut c_void;
        }
        r
    }
}

/// Options of [`Pool::seq_create_with`]: `kvt_seq_opts` with the defaults;
/// `'a` borrows the prefix's token ids.
#[derive(Debug, Clone, Copy)]
pub struct SeqOpts<'a> {
    raw: sys::kvt_seq_opts,
    _borrows: PhantomData<&'a [u32]>,
}

impl Default for SeqOpts<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> SeqOpts<'a> {
    /// The defaults (`kvt_seq_opts_init`): the pool's token limit, no prefix.
    pub fn new() -> SeqOpts<'a> {
        let mut raw = sys::kvt_seq_opts::default();
        let rc = unsafe { sys::kvt_seq_opts_init(&mut raw) };
        debug_assert_eq!(rc, 0);
        SeqOpts { raw, _borrows: PhantomData }
    }
    /// Token limit; 0 = the pool's max_seq_tokens.
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.raw.max_tokens = n;
        self
    }
    /// Opaque, reported by [`Pool::seq_info`].
    pub fn user_data(mut self, x: u64) -> Self {
        self.raw.user_data = x;
        self
    }
    /// Separates models, adapters and tenants in the prefix cache: pages
    /// are matched only under the salt they were keyed with (0 = default).
    pub fn salt(mut self, salt: u64) -> Self {
        self.raw.salt = salt;
        self
    }
    /// The token ids the sequence starts with (they become its ids); a
    /// pool with the prefix cache attaches the longest cached prefix.
    pub fn prefix(mut self, ids: &'a [u32]) -> Self {
        self.raw.prefix = ids.as_ptr();
        // Past 32 bits the count is above any max_tokens (the library names
        // opts->n_prefix), and u32::MAX ids lie within the slice.
        self.raw.n_prefix = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        self
    }
    pub fn raw(&self) -> &sys::kvt_seq_opts {
        &self.raw
    }
}

/// A KV pool (`kvt_pool`), destroyed on drop. `'a` is the borrow of the
/// policy and selector given in its options.
pub struct Pool<'a> {
    raw: NonNull<sys::kvt_pool>,
    geom: Geometry,
    // The remote tier's log closure: the library calls it until the pool is
    // destroyed (Drop destroys it before the fields are dropped).
    remote_log: Option<Arc<RemoteLog>>,
    _borrows: PhantomData<&'a ()>,
}

impl fmt::Debug for Pool<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("raw", &self.raw)
            .field("geom", &self.geom)
            .field("remote_log", &self.remote_log.is_some())
            .finish()
    }
}

// A pool is used by one thread at a time: it may move between threads
// (its policy and selector are Sync), but is not Sync.
unsafe impl Send for Pool<'_> {}

impl<'a> Pool<'a> {
    pub fn new(opts: &PoolOpts<'a>) -> Result<Pool<'a>> {
        let mut raw = ptr::null_mut();
        // The disk directory, the remote options and their strings are
        // copied by kvt_pool_create: they need only live through the call.
        check(opts.with_raw(|o| unsafe { sys::kvt_pool_create(o, &mut raw) }))?;
        let raw = NonNull::new(raw).expect("kvt_pool_create returned NULL");
        let remote_log = opts.remote.as_ref().and_then(|r| r.log.clone());
        let mut pool = Pool { raw, geom: Geometry::default(), remote_log, _borrows: PhantomData };
        pool.geom = pool.geometry()?;
        Ok(pool)
    }

    /// The geometry with defaults resolved.
    pub fn geometry(&self) -> Result<Geometry> {
        let mut g = Geometry::default();
        check(unsafe { sys::kvt_pool_geometry_get(self.raw.as_ptr(), &mut g) })?;
        Ok(g)
    }

    pub fn stats(&self) -> Result<Stats> {
        let mut s =
            Stats { struct_size: std::mem::size_of::<Stats>() as u32, ..Default::default() };
        check(unsafe { sys::kvt_pool_stats_get(self.raw.as_ptr(), &mut s) })?;
        Ok(s)
    }

    /// Verifies every internal invariant (`KVT_EINTERNAL` says what is wrong).
    pub fn check(&self) -> Result<()> {
        check(unsafe { sys::kvt_pool_check(self.raw.as_ptr()) })
    }

    /// "avx512", "avx2" or "portable".
    pub fn kernel_isa(&self) -> Result<&'static str> {
        let mut isa: *const c_char = std::ptr::null();
        check(unsafe { sys::kvt_pool_kernel_isa_get(self.raw.as_ptr(), &mut isa) })?;
        Ok(static_cstr(isa))
    }

    /// A new empty sequence; max_tokens 0 = the pool's limit.
    pub fn seq_create(&mut self, max_tokens: u32, user_data: u64) -> Result<SeqId> {
        self.seq_create_with(&SeqOpts::new().max_tokens(max_tokens).user_data(user_data))
    }

    /// A new sequence with the options: with [`SeqOpts::prefix`], a pool with
    /// the prefix cache attaches the longest cached run of whole pages that
    /// matches it ([`SeqInfo`]`::prefix_tokens`, also its starting length).
    pub fn seq_create_with(&mut self, opts: &SeqOpts<'_>) -> Result<SeqId> {
        let mut id = 0;
        check(unsafe { sys::kvt_seq_create(self.raw.as_ptr(), &opts.raw, &mut id) })?;
        Ok(SeqId(id))
    }

    /// Records the token ids of positions `first .. first + ids.len()`
    /// (contiguous from 0; known positions must keep their ids). With the
    /// prefix cache, full pages whose ids become known are indexed.
    pub fn seq_tokens_set(&mut self, seq: SeqId, first: u32, ids: &[u32]) -> Result<()> {
        let n = to_u32("ids", ids.len())?;
        check(unsafe { sys::kvt_seq_tokens_set(self.raw.as_ptr(), seq.0, first, ids.as_ptr(), n) })
    }

    /// Drops the prefix-cache entries keyed with `salt`; returns the
    /// physical pages dropped from the index.
    pub fn prefix_drop(&mut self, salt: u64) -> Result<u64> {
        let mut n = 0u64;
        check(unsafe { sys::kvt_prefix_drop(self.raw.as_ptr(), salt, &mut n) })?;
        Ok(n)
    }

    /// [`Pool::prefix_drop`] for every salt: the index is empty afterwards.
    pub fn prefix_drop_all(&mut self) -> Result<u64> {
        let mut n = 0u64;
        check(unsafe { sys::kvt_prefix_drop_all(self.raw.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// Lands the remote pages of a sequence created with a prefix in a pool
    /// with a remote tier, and returns its prefix_tokens: the tokens attached
    /// from the local tiers and landed from the remote one (the engine
    /// prefills the rest). Until then the sequence is loading
    /// ([`SeqInfo`]`::remote_loading`) and a step, append, fork, truncate or
    /// [`Pool::seq_tokens_set`] on it is `KVT_EAGAIN`. `timeout_ms`: how long
    /// to wait for the answers; 0 = not at all (`KVT_EAGAIN` while they are
    /// not all in), `u32::MAX` = until they are (the io timeout bounds it). A
    /// sequence that is not loading returns at once.
    pub fn seq_prefix_wait(&mut self, seq: SeqId, timeout_ms: u32) -> Result<u32> {
        let mut n = 0u32;
        check(unsafe { sys::kvt_seq_prefix_wait(self.raw.as_ptr(), seq.0, timeout_ms, &mut n) })?;
        Ok(n)
    }

    /// Waits until every value queued for the remote tier has been written
    /// or given up, at most `timeout_ms` (`KVT_ETIMEDOUT`); `KVT_ENOTSUP`
    /// for a pool without a remote tier.
    pub fn remote_flush(&mut self, timeout_ms: u32) -> Result<()> {
        check(unsafe { sys::kvt_remote_flush(self.raw.as_ptr(), timeout_ms) })
    }

    /// Queues every keyed page position of `seq` for the remote tier
    /// (`kvt_seq_remote_push`); returns the values queued.
    pub fn seq_remote_push(&mut self, seq: SeqId) -> Result<u32> {
        let mut n = 0u32;
        check(unsafe { sys::kvt_seq_remote_push(self.raw.as_ptr(), seq.0, &mut n) })?;
        Ok(n)
    }

    pub fn seq_release(&mut self, seq: SeqId) -> Result<()> {
        check(unsafe { sys::kvt_seq_release(self.raw.as_ptr(), seq.0) })
    }

    /// Appends `n_tokens` tokens of one layer, dense f32
    /// `[n_tokens][n_kv_heads][head_dim]` in `k` and `v`.
    pub fn seq_append(
        &mut self,
        seq: SeqId,
        layer: u32,
        k: &[f32],
        v: &[f32],
        n_tokens: u32,
    ) -> Result<()> {
        let want = n_tokens as usize * self.kv_row();
        need("k", k.len(), want)?;
        need("v", v.len(), want)?;
        check(unsafe {
            sys::kvt_seq_append(
                self.raw.as_ptr(),
                seq.0,
                layer,
                k.as_ptr() as *const c_void,
                v.as_ptr() as *const c_void,
                n_tokens,
                sys::KVT_DTYPE_F32,
                0,
            )
        })
    }

    pub fn seq_info(&self, seq: SeqId) -> Result<SeqInfo> {
        let mut i =
            SeqInfo { struct_size: std::mem::size_of::<SeqInfo>() as u32, ..Default::default() };
        check(unsafe { sys::kvt_seq_info_get(self.raw.as_ptr(), seq.0, &mut i) })?;
        Ok(i)
    }

    /// Tokens appended to one layer.
    pub fn seq_length(&self, seq: SeqId, layer: u32) -> Result<u32> {
        let mut n = 0;
        check(unsafe { sys::kvt_seq_length_get(self.raw.as_ptr(), seq.0, layer, &mut n) })?;
        Ok(n)
    }

    /// Importance-guided warm-up; `obs` is f32 `[n_layers][n_obs][n_q_heads][head_dim]`.
    pub fn seq_warmup(&mut self, seq: SeqId, obs: &[f32], n_obs: u32) -> Result<()> {
        let g = &self.geom;
        let want =
            g.n_layers as usize * n_obs as usize * g.q_heads() as usize * g.head_dim as usize;
        need("obs_queries", obs.len(), want)?;
        check(unsafe { sys::kvt_seq_warmup(self.raw.as_ptr(), seq.0, obs.as_ptr(), n_obs) })
    }

    /// (device block, host block, residency bits) of each page in
    /// `first_page .. first_page + n_pages` of (seq, layer, kv_head).
    pub fn seq_block_table(
        &self,
        seq: SeqId,
        layer: u32,
        kv_head: u32,
        first_page: u32,
        n_pages: u32,
    ) -> Result<Vec<(u32, u32, u8)>> {
        let n = n_pages as usize;
        let (mut d, mut h, mut r) = (vec![0u32; n], vec![0u32; n], vec![0u8; n]);
        check(unsafe {
            sys::kvt_seq_block_table_get(
                self.raw.as_ptr(),
                seq.0,
                layer,
                kv_head,
                first_page,
                n_pages,
                d.as_mut_ptr(),
                h.as_mut_ptr(),
                r.as_mut_ptr(),
            )
        })?;
        Ok((0..n).map(|i| (d[i], h[i], r[i])).collect())
    }

    /// The stored K and V rows of tokens `first .. first + n` of
    /// (seq, layer, kv_head), `[n][head_dim]` each. f32 pools only.
    pub fn seq_read_kv(
        &self,
        seq: SeqId,
        layer: u32,
        kv_head: u32,
        first: u32,
        n: u32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        read_kv(self.raw, &self.geom, seq.0, layer, kv_head, first, n)
    }

    /// Plans one decode step over `seqs`. The step borrows the pool
    /// mutably until it is finished or dropped.
    pub fn step<'s>(&'s mut self, seqs: &[SeqId], opts: &StepOpts<'s>) -> Result<Step<'s>> {
        let ids: Vec<sys::kvt_seq_id> = seqs.iter().map(|s| s.0).collect();
        let n = to_u32("n_seqs", ids.len())?;
        let mut raw = ptr::null_mut();
        check(unsafe {
            sys::kvt_step_plan(self.raw.as_ptr(), ids.as_ptr(), n, &opts.raw, &mut raw)
        })?;
        let rows = if opts.raw.n_new.is_null() { ids.len() } else { opts.raw.n_rows as usize };
        Ok(Step {
            raw: NonNull::new(raw).expect("kvt_step_plan returned NULL"),
            pool: self.raw,
            geom: self.geom,
            rows,
            seqs: ids,
            _pool: PhantomData,
        })
    }

    pub fn as_ptr(&self) -> *const sys::kvt_pool {
        self.raw.as_ptr()
    }

    fn kv_row(&self) -> usize {
        self.geom.n_kv_heads as usize * self.geom.head_dim as usize
    }
}

impl Drop for Pool<'_> {
    fn drop(&mut self) {
        unsafe { sys::kvt_pool_destroy(self.raw.as_ptr()) }
    }
}

fn read_kv(
    pool: NonNull<sys::kvt_pool>,
    geom: &Geometry,
    seq: sys::kvt_seq_id,
    layer: u32,
    kv_head: u32,
    first: u32,
    n: u32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    if geom.dtype != sys::KVT_DTYPE_F32 {
        return Err(Error::invalid(format!(
            "dtype: read_kv returns f32 rows, the pool stores dtype {}",
            geom.dtype
        )));
    }
    let len = n as usize * geom.head_dim as usize;
    let (mut k, mut v) = (vec![0f32; len], vec![0f32; len]);
    check(unsafe {
        sys::kvt_seq_read_kv(
            pool.as_ptr(),
            seq,
            layer,
            kv_head,
            first,
            n,
            k.as_mut_ptr() as *mut c_void,
            v.as_mut_ptr() as *mut c_void,
        )
    })?;
    Ok((k, v))
}

// ---- steps -----------------------------------------------------------------

/// Options of [`Pool::step`]; `'a` borrows the selector and policy named.
#[derive(Debug, Clone, Copy)]
pub struct StepOpts<'a> {
    raw: sys::kvt_step_opts,
    _borrows: PhantomData<&'a ()>,
}

impl Default for StepOpts<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> StepOpts<'a> {
    /// The defaults: the pool's selector and policy, scale 1/sqrt(head_dim).
    pub fn new() -> StepOpts<'a> {
        let mut raw = sys::kvt_step_opts {
            struct_size: 0,
            flags: 0,
            selector: ptr::null(),
            scale: 0.0,
            reserved: 0,
            policy: ptr::null(),
            profiler: ptr::null_mut(),
            stream: ptr::null_mut(),
            n_new: ptr::null(),
            n_rows: 0,
            max_new: 0,
            token_ids: ptr::null(),
            n_token_ids: 0,
            reserved2: 0,
        };
        let rc = unsafe { sys::kvt_step_opts_init(&mut raw) };
        debug_assert_eq!(rc, 0);
        StepOpts { raw, _borrows: PhantomData }
    }
    /// Select every page (dense attention through the same kernel).
    pub fn dense(mut self) -> Self {
        self.raw.flags |= sys::KVT_STEP_DENSE;
        self
    }
    pub fn selector(mut self, sel: &'a Selector) -> Self {
        self.raw.selector = sel.as_ptr();
        self
    }
    pub fn policy(mut self, pol: &'a Policy) -> Self {
        self.raw.policy = pol.as_ptr();
        self
    }
    pub fn scale(mut self, scale: f32) -> Self {
        self.raw.scale = scale;
        self
    }
    /// `n_new[i]` tokens for sequence i (a speculative verification, a
    /// chunk of prefill): the step's arrays then hold one row per token,
    /// sequence after sequence, each query causal among the new tokens.
    pub fn new_tokens(mut self, n_new: &'a [u32]) -> Self {
        let sum: u64 = n_new.iter().map(|&x| x as u64).sum();
        self.raw.n_new = n_new.as_ptr();
        // A sum past 32 bits cannot match: the library names opts->n_rows.
        self.raw.n_rows = u32::try_from(sum).unwrap_or(u32::MAX);
        self
    }
    /// The token id of every row of the step, in the rows' order (one per
    /// sequence, or the sum of [`StepOpts::new_tokens`]): recorded as the
    /// sequences' ids once every layer is appended, which keys the pages
    /// they fill for the prefix cache.
    pub fn token_ids(mut self, ids: &'a [u32]) -> Self {
        self.raw.token_ids = ids.as_ptr();
        // Past 32 bits the count cannot equal the rows: the library names it.
        self.raw.n_token_ids = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        self
    }
    pub fn raw(&self) -> &sys::kvt_step_opts {
        &self.raw
    }
}

/// One open decode step (`kvt_step`); finished by [`Step::finish`] or on drop.
///
/// Layouts are f32: `q` and `out` are `[rows][n_q_heads][head_dim]`, `lse`
/// `[rows][n_q_heads]`, appended `k`/`v` `[rows][n_kv_heads][head_dim]`, where
/// rows is n_seqs, or the sum of [`StepOpts::new_tokens`].
#[derive(Debug)]
pub struct Step<'p> {
    raw: NonNull<sys::kvt_step>,
    pool: NonNull<sys::kvt_pool>,
    geom: Geometry,
    seqs: Vec<sys::kvt_seq_id>,
    rows: usize,
    _pool: PhantomData<&'p mut ()>,
}

impl<'p> Step<'p> {
    pub fn n_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Rows of the step's arrays: one per new token.
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn q_len(&self) -> usize {
        self.rows * self.geom.q_heads() as usize * self.geom.head_dim as usize
    }

    /// The step's new tokens of `layer` (one row each).
    pub fn append(&mut self, layer: u32, k: &[f32], v: &[f32]) -> Result<()> {
        let want = self.rows * self.geom.n_kv_heads as usize * self.geom.head_dim as usize;
        need("k", k.len(), want)?;
        need("v", v.len(), want)?;
        check(unsafe {
            sys::kvt_step_append(
                self.raw.as_ptr(),
                layer,
                k.as_ptr() as *const c_void,
                v.as_ptr() as *const c_void,
                sys::KVT_DTYPE_F32,
                0,
            )
        })
    }

    /// Selects the pages of `layer` (kvt_step_select; in a tiered pool the
    /// fused rerank/recycle).
    pub fn select(&mut self, layer: u32, q: &[f32]) -> Result<()> {
        need("q", q.len(), self.q_len())?;
        check(unsafe { sys::kvt_step_select(self.raw.as_ptr(), layer, q.as_ptr()) })
    }

    /// Attention over the pages selected for `layer`.
    pub fn decode(
        &mut self,
        layer: u32,
        q: &[f32],
        out: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let n = self.q_len();
        need("q", q.len(), n)?;
        need("out", out.len(), n)?;
        let lse_ptr = match lse {
            Some(l) => {
                need("lse", l.len(), self.rows * self.geom.q_heads() as usize)?;
                l.as_mut_ptr()
            }
            None => ptr::null_mut(),
        };
        check(unsafe {
            sys::kvt_step_decode(self.raw.as_ptr(), layer, q.as_ptr(), out.as_mut_ptr(), lse_ptr)
        })
    }

    /// select followed by decode.
    pub fn attend(
        &mut self,
        layer: u32,
        q: &[f32],
        out: &mut [f32],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        self.select(layer, q)?;
        self.decode(layer, q, out, lse)
    }

    /// Whether no page of sequence `seq_index` is on its way to the device.
    pub fn ready(&mut self, seq_index: u32) -> Result<bool> {
        let mut r = 0u32;
        check(unsafe { sys::kvt_step_ready_get(self.raw.as_ptr(), seq_index, &mut r) })?;
        Ok(r != 0)
    }

    /// (first_page, n_pages) of the device block-table entries changed.
    pub fn dirty(&self, layer: u32, seq_index: u32, kv_head: u32) -> Result<(u32, u32)> {
        let (mut f, mut n) = (0, 0);
        check(unsafe {
            sys::kvt_step_dirty_get(self.raw.as_ptr(), layer, seq_index, kv_head, &mut f, &mut n)
        })?;
        Ok((f, n))
    }

    /// The pages selected for (layer, seq_index, kv_head), increasing, and
    /// whether the head was rescored this step.
    pub fn selection(&self, layer: u32, seq_index: u32, kv_head: u32) -> Result<(Vec<u32>, bool)> {
        // Capacity: every page of the layer (the selection is a subset).
        // (An invalid argument gives capacity 0; the library names it.)
        let cap = match self.seq_length(seq_index, layer) {
            Ok(len) => len.div_ceil(self.geom.page_size()),
            Err(_) => 0,
        };
        let mut pages = vec![0u32; cap as usize];
        let (mut n, mut rr) = (0u32, 0u32);
        let p = if cap == 0 { ptr::null_mut() } else { pages.as_mut_ptr() };
        check(unsafe {
            sys::kvt_step_selection_get(
                self.raw.as_ptr(),
                layer,
                seq_index,
                kv_head,
                p,
                cap,
                &mut n,
                &mut rr,
            )
        })?;
        pages.truncate(n as usize);
        Ok((pages, rr != 0))
    }

    /// The sequence at `seq_index` of the plan.
    pub fn seq(&self, seq_index: u32) -> Result<SeqId> {
        self.seqs.get(seq_index as usize).map(|&s| SeqId(s)).ok_or_else(|| {
            Error::invalid(format!(
                "seq_index: {seq_index} >= the plan's {} sequences",
                self.seqs.len()
            ))
        })
    }

    /// Tokens of sequence `seq_index` in `layer` (the pool is borrowed by
    /// the step, so its read-only queries are offered here too).
    pub fn seq_length(&self, seq_index: u32, layer: u32) -> Result<u32> {
        let seq = self.seq(seq_index)?;
        let mut n = 0;
        check(unsafe { sys::kvt_seq_length_get(self.pool.as_ptr(), seq.0, layer, &mut n) })?;
        Ok(n)
    }

    /// As [`Pool::seq_read_kv`] for sequence `seq_index` of the plan.
    pub fn read_kv(
        &self,
        seq_index: u32,
        layer: u32,
        kv_head: u32,
        first: u32,
        n: u32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let seq = self.seq(seq_index)?;
        read_kv(self.pool, &self.geom, seq.0, layer, kv_head, first, n)
    }

    /// Closes the step, reporting the library's result (drop ignores it).
    pub fn finish(self) -> Result<()> {
        let mut me = std::mem::ManuallyDrop::new(self);
        drop(std::mem::take(&mut me.seqs));
        check(unsafe { sys::kvt_step_finish(me.raw.as_ptr()) })
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        unsafe {
            sys::kvt_step_finish(self.raw.as_ptr());
        }
    }
}
