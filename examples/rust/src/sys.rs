//! Raw FFI declarations of libkvtier (include/kvtier/*.h), written by hand.
//!
//! Every struct is `#[repr(C)]` with the exact field types of the header;
//! `tests/layout.rs` checks each size and field offset against values a C
//! program prints at build time. Opaque handles are zero-sized
//! `#[repr(C)]` structs used only behind pointers. `typedef uint32_t` enums
//! are `u32` aliases with `pub const` values.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

// ---- opaque handles -------------------------------------------------------
#[repr(C)]
pub struct kvt_pool {
    _p: [u8; 0],
}
#[repr(C)]
pub struct kvt_step {
    _p: [u8; 0],
}
#[repr(C)]
pub struct kvt_selector {
    _p: [u8; 0],
}
#[repr(C)]
pub struct kvt_policy {
    _p: [u8; 0],
}
#[repr(C)]
pub struct kvt_profiler {
    _p: [u8; 0],
}
#[repr(C)]
pub struct kvt_mover {
    _p: [u8; 0],
}

// ---- common.h ---------------------------------------------------------------
pub const KVT_OK: c_int = 0;
pub const KVT_EINVAL: c_int = -1;
pub const KVT_ENOMEM: c_int = -2;
pub const KVT_ENOSPC: c_int = -3;
pub const KVT_ENOTSUP: c_int = -4;
pub const KVT_EIO: c_int = -5;
pub const KVT_ECORRUPT: c_int = -6;
pub const KVT_ENOENT: c_int = -7;
pub const KVT_ERANGE: c_int = -8;
pub const KVT_EOVERFLOW: c_int = -9;
pub const KVT_ESTATE: c_int = -10;
pub const KVT_EBUSY: c_int = -11;
pub const KVT_ETIMEDOUT: c_int = -12;
pub const KVT_EAGAIN: c_int = -13;
pub const KVT_EINTERNAL: c_int = -14;

pub type kvt_dtype = u32;
pub const KVT_DTYPE_DEFAULT: kvt_dtype = 0;
pub const KVT_DTYPE_F16: kvt_dtype = 1;
pub const KVT_DTYPE_BF16: kvt_dtype = 2;
pub const KVT_DTYPE_F32: kvt_dtype = 3;

pub type kvt_backend = u32;
pub const KVT_BACKEND_AUTO: kvt_backend = 0;
pub const KVT_BACKEND_CPU: kvt_backend = 1;
pub const KVT_BACKEND_CUDA: kvt_backend = 2;

pub const KVT_FEATURE_CUDA: u32 = 1 << 0;
pub const KVT_FEATURE_NUMA: u32 = 1 << 1;
pub const KVT_FEATURE_URING: u32 = 1 << 2;
pub const KVT_FEATURE_REMOTE: u32 = 1 << 3;

pub type kvt_tier = u32;
pub const KVT_TIER_DEVICE: kvt_tier = 0;
pub const KVT_TIER_HOST: kvt_tier = 1;
pub const KVT_TIER_DISK: kvt_tier = 2;
pub const KVT_NUM_TIERS: usize = 3;

pub const KVT_RES_DEVICE: u8 = 1 << KVT_TIER_DEVICE;
pub const KVT_RES_HOST: u8 = 1 << KVT_TIER_HOST;
pub const KVT_RES_DISK: u8 = 1 << KVT_TIER_DISK;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvt_geometry {
    pub n_layers: u32,
    pub n_kv_heads: u32,
    pub n_q_heads: u32,
    pub head_dim: u32,
    pub page_tokens: u32,
    pub dtype: kvt_dtype,
    pub reserved: [u32; 2],
}

// ---- version.h --------------------------------------------------------------
pub const KVT_VERSION_MAJOR: u32 = 0;
pub const KVT_VERSION_MINOR: u32 = 1;
pub const KVT_VERSION_PATCH: u32 = 0;
pub const KVT_VERSION_NUMBER: u32 =
    KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH;

// ---- pool.h -----------------------------------------------------------------
pub type kvt_seq_id = u64;
pub const KVT_SEQ_NONE: kvt_seq_id = 0;

pub type kvt_numa_policy = u32;
pub const KVT_NUMA_LOCAL: kvt_numa_policy = 0;
pub const KVT_NUMA_NODE: kvt_numa_policy = 1;
pub const KVT_NUMA_INTERLEAVE: kvt_numa_policy = 2;

pub const KVT_POOL_HUGEPAGES: u32 = 1 << 0;
pub const KVT_POOL_PREFIX_CACHE: u32 = 1 << 1;

pub const KVT_MAX_SEQS_DEFAULT: u32 = 1024;
pub const KVT_MAX_SEQ_TOKENS_DEFAULT: u32 = 1 << 20;
pub const KVT_MAX_SEQS_LIMIT: u32 = 1 << 20;
pub const KVT_MAX_SEQ_TOKENS_LIMIT: u32 = 1 << 30;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvt_pool_opts {
    pub struct_size: u32,
    pub backend: kvt_backend,
    pub geom: kvt_geometry,
    pub device_bytes: u64,
    pub host_bytes: u64,
    pub disk_bytes: u64,
    pub disk_dir: *const c_char,
    pub host_numa: kvt_numa_policy,
    pub host_numa_node: i32,
    pub max_seqs: u32,
    pub max_seq_tokens: u32,
    pub n_threads: u32,
    pub flags: u32,
    pub cuda_device: i32,
    pub target_seqs: u32,
    pub mover: *const kvt_mover_opts,
    pub policy: *const kvt_policy,
    pub selector: *const kvt_selector,
    pub target_tokens: u64,
    // Appended by the prefix cache (prefix.h).
    pub prefix_cache_bytes: [u64; KVT_NUM_TIERS],
    // Appended by the remote tier (remote.h); copied by kvt_pool_create.
    pub remote: *const kvt_remote_opts,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_pool_sizing {
    pub struct_size: u32,
    pub reserved: u32,
    pub device_bytes: u64,
    pub dense_bytes: u64,
    pub host_bytes: u64,
    pub meta_bytes: u64,
    pub device_pages: u64,
    pub dense_pages: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_tier_stats {
    pub blocks_total: u64,
    pub blocks_used: u64,
    pub blocks_free: u64,
    pub bytes_total: u64,
    pub bytes_used: u64,
    pub pages: u64,
}

pub const KVT_DIR_DEVICE_TO_HOST: u32 = 0;
pub const KVT_DIR_HOST_TO_DEVICE: u32 = 1;
pub const KVT_DIR_HOST_TO_DISK: u32 = 2;
pub const KVT_DIR_DISK_TO_HOST: u32 = 3;
pub const KVT_NUM_DIRS: usize = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_stats {
    pub struct_size: u32,
    pub backend: kvt_backend,
    pub block_bytes: u64,
    pub meta_bytes_total: u64,
    pub meta_pages_total: u64,
    pub meta_pages_used: u64,
    pub n_seqs: u64,
    pub n_tokens: u64,
    pub tier: [kvt_tier_stats; KVT_NUM_TIERS],
    pub moved_bytes: [u64; KVT_NUM_DIRS],
    pub moved_requests: [u64; KVT_NUM_DIRS],
    pub sel_pages: u64,
    pub sel_resident: u64,
    pub promoted_pages: u64,
    pub recycled_blocks: u64,
    pub evicted_pages: u64,
    pub offloaded_pages: u64,
    pub reranked_heads: u64,
    pub paused_seqs: u64,
    // Appended by the prefix cache (prefix.h).
    pub prefix_lookups: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_miss_tokens: u64,
    pub prefix_hit_pages: u64,
    pub prefix_keyed_pages: u64,
    pub prefix_cached_pages: [u64; KVT_NUM_TIERS],
    pub prefix_reclaimed_pages: u64,
    pub prefix_dropped_pages: u64,
    // Appended by the remote tier (remote.h).
    pub remote_fetches: u64,
    pub remote_fetch_ns: u64,
    pub remote_hit_values: u64,
    pub remote_miss_values: u64,
    pub remote_get_bytes: u64,
    pub remote_put_values: u64,
    pub remote_put_bytes: u64,
    pub remote_put_dropped: u64,
    pub remote_errors: u64,
    pub remote_corrupt: u64,
    pub remote_redirects: u64,
    pub remote_queue_bytes: u64,
    // Appended by the selection cache (selector.h).
    pub head_selections: u64,
    pub similarity_reranks: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvt_seq_opts {
    pub struct_size: u32,
    pub max_tokens: u32,
    pub user_data: u64,
    // Appended by the prefix cache (prefix.h).
    pub salt: u64,
    pub prefix: *const u32,
    pub n_prefix: u32,
    pub reserved: u32,
}

/// All zeros and a null `prefix` (struct_size 0: `kvt_seq_opts_init` sets it).
impl Default for kvt_seq_opts {
    fn default() -> Self {
        kvt_seq_opts {
            struct_size: 0,
            max_tokens: 0,
            user_data: 0,
            salt: 0,
            prefix: std::ptr::null(),
            n_prefix: 0,
            reserved: 0,
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_seq_info {
    pub struct_size: u32,
    pub max_tokens: u32,
    pub n_tokens: u32,
    pub n_tokens_max: u32,
    pub user_data: u64,
    pub pages: u64,
    pub pages_in_tier: [u64; KVT_NUM_TIERS],
    // Appended by the prefix cache (prefix.h).
    pub prefix_tokens: u32,
    pub token_ids: u32,
    pub salt: u64,
    // Appended by the remote tier (remote.h).
    pub remote_tokens: u32,
    pub remote_loading: u32,
}

// ---- remote.h ---------------------------------------------------------------
pub const KVT_REMOTE_NO_PUT: u32 = 1 << 0;
pub const KVT_REMOTE_NO_GET: u32 = 1 << 1;

/// `kvt_remote_log_fn`: a nullable C function pointer (`None` = NULL).
pub type kvt_remote_log_fn = Option<unsafe extern "C" fn(ctx: *mut c_void, msg: *const c_char)>;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvt_remote_opts {
    pub struct_size: u32,
    pub flags: u32,
    pub endpoints: *const c_char,
    pub user: *const c_char,
    pub password: *const c_char,
    pub fingerprint: *const c_char,
    pub key_prefix: *const c_char,
    pub connect_timeout_ms: u32,
    pub io_timeout_ms: u32,
    pub retry_ms: u32,
    pub n_connections: u32,
    pub pipeline: u32,
    pub ttl_s: u32,
    pub queue_bytes: u64,
    pub log: kvt_remote_log_fn,
    pub log_ctx: *mut c_void,
}

/// All zeros, null strings and no log (struct_size 0: `kvt_remote_opts_init`
/// sets it).
impl Default for kvt_remote_opts {
    fn default() -> Self {
        kvt_remote_opts {
            struct_size: 0,
            flags: 0,
            endpoints: std::ptr::null(),
            user: std::ptr::null(),
            password: std::ptr::null(),
            fingerprint: std::ptr::null(),
            key_prefix: std::ptr::null(),
            connect_timeout_ms: 0,
            io_timeout_ms: 0,
            retry_ms: 0,
            n_connections: 0,
            pipeline: 0,
            ttl_s: 0,
            queue_bytes: 0,
            log: None,
            log_ctx: std::ptr::null_mut(),
        }
    }
}

// ---- selector.h -------------------------------------------------------------
pub type kvt_score_method = u32;
pub const KVT_SCORE_MINMAX: kvt_score_method = 0;
pub const KVT_SCORE_MEAN: kvt_score_method = 1;
pub const KVT_SCORE_TOKEN: kvt_score_method = 2;
pub const KVT_SCORE_ORACLE: kvt_score_method = 3;

pub type kvt_vote = u32;
pub const KVT_VOTE_SUM: kvt_vote = 0;
pub const KVT_VOTE_MAX: kvt_vote = 1;
pub const KVT_VOTE_SOFTVOTE: kvt_vote = 2;

pub const KVT_ALL: u32 = 0xffff_ffff;
pub const KVT_SELECT_MAX_PAGES: u32 = 1 << 26;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_selector_opts {
    pub struct_size: u32,
    pub method: kvt_score_method,
    pub vote: kvt_vote,
    pub top_k_pages: u32,
    pub sink_pages: u32,
    pub local_pages: u32,
    pub rerank_interval: u32,
    pub vote_scale: f32,
    // Appended by the selection cache (struct_size 32 reads it as
    // KVT_RERANK_SIMILARITY_DEFAULT).
    pub rerank_similarity: f32,
    pub reserved: u32,
}

/// The selection cache's default threshold (`kvt_selector_opts` and
/// `kvt_policy_opts.rerank_similarity`).
pub const KVT_RERANK_SIMILARITY_DEFAULT: f32 = 0.8;

// ---- policy.h ---------------------------------------------------------------
pub type kvt_head_class = u32;
pub const KVT_HEAD_STABLE: kvt_head_class = 0;
pub const KVT_HEAD_UNSTABLE: kvt_head_class = 1;

pub const KVT_POLICY_MAX_WINDOW: u32 = 64;
pub const KVT_PROFILER_WINDOWS: usize = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_policy_opts {
    pub struct_size: u32,
    pub default_class: kvt_head_class,
    pub top_k_pages: u32,
    pub window: u32,
    pub sink_pages: u32,
    pub local_pages: u32,
    pub stable_interval: u32,
    pub unstable_interval: u32,
    // Appended by the selection cache (struct_size 32 reads it as
    // KVT_RERANK_SIMILARITY_DEFAULT).
    pub rerank_similarity: f32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvt_policy_heads {
    pub struct_size: u32,
    pub n_heads: u32,
    pub head_class: *const kvt_head_class,
    pub top_k_pages: *const u32,
    pub window: *const u32,
    pub sink_pages: *const u32,
    pub local_pages: *const u32,
    pub rerank_interval: *const u32,
    // Appended by the selection cache (struct_size 56 reads it as NULL).
    pub rerank_similarity: *const f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_policy_head_info {
    pub struct_size: u32,
    pub head_class: kvt_head_class,
    pub top_k_pages: u32,
    pub window: u32,
    pub sink_pages: u32,
    pub local_pages: u32,
    pub rerank_interval: u32,
    pub rerank_similarity: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_profiler_opts {
    pub struct_size: u32,
    pub window_steps: u32,
    pub unstable_fraction: f64,
    pub bottom_fraction: f64,
    pub max_streams: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_profiler_head_stats {
    pub struct_size: u32,
    pub k_max: u32,
    pub records: u64,
    pub windows: u64,
    pub ranked_windows: u64,
    pub bottom: u64,
    pub mean_ts: f64,
    pub instability: f64,
    pub demand: u64,
    pub benefit: [u64; KVT_PROFILER_WINDOWS],
}

// ---- step.h -----------------------------------------------------------------
pub const KVT_STEP_DENSE: u32 = 1 << 0;
pub const KVT_STEP_MAX_NEW: u32 = 8192;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvt_step_opts {
    pub struct_size: u32,
    pub flags: u32,
    pub selector: *const kvt_selector,
    pub policy: *const kvt_policy,
    pub profiler: *mut kvt_profiler,
    pub stream: *mut std::ffi::c_void,
    pub scale: f32,
    pub reserved: u32,
    pub n_new: *const u32,
    pub n_rows: u32,
    pub max_new: u32,
    // Appended after n_new (the prefix cache's token ids).
    pub token_ids: *const u32,
    pub n_token_ids: u32,
    pub reserved2: u32,
}

// ---- mover.h ----------------------------------------------------------------
pub const KVT_MOVER_REQUIRE_DIRECT: u32 = 1 << 0;
pub const KVT_MOVER_KEEP_DISK_FILE: u32 = 1 << 1;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_mover_opts {
    pub struct_size: u32,
    pub flags: u32,
    pub copy_threads: u32,
    pub queue_depth: u32,
    pub max_io_bytes: u32,
    pub extent_pages: u32,
    pub segment_extents: u32,
    pub chunk_pages: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_move {
    pub seq: kvt_seq_id,
    pub layer: u32,
    pub kv_head: u32,
    pub page: u32,
    pub from: kvt_tier,
    pub to: kvt_tier,
    pub flags: u32,
}

pub const KVT_MOVE_DROP_SOURCE: u32 = 1 << 0;
pub const KVT_SUBMIT_URGENT: u32 = 1 << 0;

pub type kvt_fence = u64;
pub const KVT_FENCE_ALL: kvt_fence = u64::MAX;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct kvt_mover_stats {
    pub struct_size: u32,
    pub disk_direct: u32,
    pub registered: u32,
    pub queue_depth: u32,
    pub disk_file_bytes: u64,
    pub batches_in_flight: u64,
    pub moves_in_flight: u64,
    pub moved_bytes: [u64; KVT_NUM_DIRS],
    pub moved_requests: [u64; KVT_NUM_DIRS],
    pub disk_reads: u64,
    pub disk_writes: u64,
    pub disk_read_bytes: u64,
    pub disk_write_bytes: u64,
    pub retries: u64,
    pub short_io: u64,
    pub io_errors: u64,
    pub checksum_errors: u64,
    pub evictions: u64,
}

// ---- functions --------------------------------------------------------------
extern "C" {
    // common.h
    pub fn kvt_strerror(code: c_int) -> *const c_char;
    pub fn kvt_err_name(code: c_int) -> *const c_char;
    pub fn kvt_last_error() -> *const c_char;
    pub fn kvt_clear_error();
    pub fn kvt_dtype_size(dtype: kvt_dtype) -> usize;
    pub fn kvt_build_features() -> u32;
    pub fn kvt_geometry_validate(geom: *const kvt_geometry) -> c_int;
    pub fn kvt_geometry_block_bytes(geom: *const kvt_geometry, out: *mut u64) -> c_int;

    // version.h
    pub fn kvt_version() -> u32;
    pub fn kvt_version_string() -> *const c_char;

    // pool.h
    pub fn kvt_pool_opts_init(opts: *mut kvt_pool_opts) -> c_int;
    pub fn kvt_pool_sizing_get(opts: *const kvt_pool_opts, out: *mut kvt_pool_sizing) -> c_int;
    pub fn kvt_pool_create(opts: *const kvt_pool_opts, out: *mut *mut kvt_pool) -> c_int;
    pub fn kvt_pool_destroy(pool: *mut kvt_pool);
    pub fn kvt_pool_geometry_get(pool: *const kvt_pool, out: *mut kvt_geometry) -> c_int;
    pub fn kvt_pool_stats_get(pool: *const kvt_pool, stats: *mut kvt_stats) -> c_int;
    pub fn kvt_pool_check(pool: *const kvt_pool) -> c_int;
    pub fn kvt_seq_opts_init(opts: *mut kvt_seq_opts) -> c_int;
    pub fn kvt_seq_create(
        pool: *mut kvt_pool,
        opts: *const kvt_seq_opts,
        out: *mut kvt_seq_id,
    ) -> c_int;
    pub fn kvt_seq_release(pool: *mut kvt_pool, seq: kvt_seq_id) -> c_int;
    pub fn kvt_seq_append(
        pool: *mut kvt_pool,
        seq: kvt_seq_id,
        layer: u32,
        k: *const std::ffi::c_void,
        v: *const std::ffi::c_void,
        n_tokens: u32,
        src_dtype: kvt_dtype,
        token_stride: u64,
    ) -> c_int;
    pub fn kvt_seq_info_get(
        pool: *const kvt_pool,
        seq: kvt_seq_id,
        info: *mut kvt_seq_info,
    ) -> c_int;
    pub fn kvt_seq_length_get(
        pool: *const kvt_pool,
        seq: kvt_seq_id,
        layer: u32,
        n_tokens: *mut u32,
    ) -> c_int;
    pub fn kvt_seq_warmup(
        pool: *mut kvt_pool,
        seq: kvt_seq_id,
        obs_queries: *const f32,
        n_obs: u32,
    ) -> c_int;
    pub fn kvt_seq_block_table_get(
        pool: *const kvt_pool,
        seq: kvt_seq_id,
        layer: u32,
        kv_head: u32,
        first_page: u32,
        n_pages: u32,
        device_blocks: *mut u32,
        host_blocks: *mut u32,
        residency: *mut u8,
    ) -> c_int;
    pub fn kvt_seq_read_kv(
        pool: *const kvt_pool,
        seq: kvt_seq_id,
        layer: u32,
        kv_head: u32,
        first_token: u32,
        n_tokens: u32,
        k_out: *mut std::ffi::c_void,
        v_out: *mut std::ffi::c_void,
    ) -> c_int;
    pub fn kvt_seq_page_meta_get(
        pool: *const kvt_pool,
        seq: kvt_seq_id,
        layer: u32,
        kv_head: u32,
        page: u32,
        kmin: *mut f32,
        kmax: *mut f32,
        kmean: *mut f32,
    ) -> c_int;

    // selector.h
    pub fn kvt_selector_opts_init(opts: *mut kvt_selector_opts) -> c_int;
    pub fn kvt_selector_create(
        geom: *const kvt_geometry,
        opts: *const kvt_selector_opts,
        out: *mut *mut kvt_selector,
    ) -> c_int;
    pub fn kvt_selector_destroy(sel: *mut kvt_selector);
    pub fn kvt_selector_budget_set(
        sel: *mut kvt_selector,
        layer: u32,
        kv_head: u32,
        top_k_pages: u32,
        sink_pages: u32,
        local_pages: u32,
    ) -> c_int;
    pub fn kvt_selector_budget_get(
        sel: *const kvt_selector,
        layer: u32,
        kv_head: u32,
        top_k_pages: *mut u32,
        sink_pages: *mut u32,
        local_pages: *mut u32,
    ) -> c_int;
    pub fn kvt_selector_rerank_interval_set(
        sel: *mut kvt_selector,
        layer: u32,
        kv_head: u32,
        interval: u32,
    ) -> c_int;
    pub fn kvt_selector_rerank_similarity_set(
        sel: *mut kvt_selector,
        layer: u32,
        kv_head: u32,
        threshold: f32,
    ) -> c_int;
    pub fn kvt_selector_select(
        sel: *const kvt_selector,
        pool: *const kvt_pool,
        seq: kvt_seq_id,
        layer: u32,
        kv_head: u32,
        queries: *const f32,
        pages: *mut u32,
        capacity: u32,
        n_selected: *mut u32,
        scores: *mut f32,
    ) -> c_int;

    // policy.h
    pub fn kvt_policy_opts_init(opts: *mut kvt_policy_opts) -> c_int;
    pub fn kvt_policy_create(
        geom: *const kvt_geometry,
        opts: *const kvt_policy_opts,
        out: *mut *mut kvt_policy,
    ) -> c_int;
    pub fn kvt_policy_create_heads(
        geom: *const kvt_geometry,
        opts: *const kvt_policy_opts,
        heads: *const kvt_policy_heads,
        out: *mut *mut kvt_policy,
    ) -> c_int;
    pub fn kvt_policy_destroy(pol: *mut kvt_policy);
    pub fn kvt_policy_head_get(
        pol: *const kvt_policy,
        layer: u32,
        kv_head: u32,
        info: *mut kvt_policy_head_info,
    ) -> c_int;
    pub fn kvt_policy_geometry_get(pol: *const kvt_policy, out: *mut kvt_geometry) -> c_int;
    pub fn kvt_policy_count_get(
        pol: *const kvt_policy,
        head_class: kvt_head_class,
        n_heads: *mut u32,
    ) -> c_int;
    pub fn kvt_policy_device_pages_get(
        pol: *const kvt_policy,
        ctx_tokens: u64,
        device_pages: *mut u64,
        total_pages: *mut u64,
    ) -> c_int;
    pub fn kvt_policy_describe(
        pol: *const kvt_policy,
        ctx_tokens: u64,
        buf: *mut c_char,
        cap: usize,
        needed: *mut usize,
    ) -> c_int;
    pub fn kvt_policy_save_buffer(
        pol: *const kvt_policy,
        buf: *mut std::ffi::c_void,
        cap: usize,
        needed: *mut usize,
    ) -> c_int;
    pub fn kvt_policy_load_buffer(
        data: *const std::ffi::c_void,
        size: usize,
        expect: *const kvt_geometry,
        out: *mut *mut kvt_policy,
    ) -> c_int;
    pub fn kvt_policy_save(pol: *const kvt_policy, path: *const c_char) -> c_int;
    pub fn kvt_policy_load(
        path: *const c_char,
        expect: *const kvt_geometry,
        out: *mut *mut kvt_policy,
    ) -> c_int;
    pub fn kvt_profiler_opts_init(opts: *mut kvt_profiler_opts) -> c_int;
    pub fn kvt_profiler_create(
        geom: *const kvt_geometry,
        opts: *const kvt_profiler_opts,
        out: *mut *mut kvt_profiler,
    ) -> c_int;
    pub fn kvt_profiler_destroy(prof: *mut kvt_profiler);
    pub fn kvt_profiler_record(
        prof: *mut kvt_profiler,
        stream: u64,
        layer: u32,
        kv_head: u32,
        pages: *const u32,
        n_pages: u32,
        n_candidates: u32,
    ) -> c_int;
    pub fn kvt_profiler_head_get(
        prof: *const kvt_profiler,
        layer: u32,
        kv_head: u32,
        stats: *mut kvt_profiler_head_stats,
    ) -> c_int;
    pub fn kvt_profiler_build_policy(
        prof: *const kvt_profiler,
        base: *const kvt_policy_opts,
        device_page_budget: u64,
        out: *mut *mut kvt_policy,
    ) -> c_int;

    // step.h
    pub fn kvt_step_opts_init(opts: *mut kvt_step_opts) -> c_int;
    pub fn kvt_step_plan(
        pool: *mut kvt_pool,
        seqs: *const kvt_seq_id,
        n_seqs: u32,
        opts: *const kvt_step_opts,
        out: *mut *mut kvt_step,
    ) -> c_int;
    pub fn kvt_step_finish(step: *mut kvt_step) -> c_int;
    pub fn kvt_step_append(
        step: *mut kvt_step,
        layer: u32,
        k: *const std::ffi::c_void,
        v: *const std::ffi::c_void,
        src_dtype: kvt_dtype,
        seq_stride: u64,
    ) -> c_int;
    pub fn kvt_step_select(step: *mut kvt_step, layer: u32, q: *const f32) -> c_int;
    pub fn kvt_step_ready_get(step: *mut kvt_step, seq_index: u32, ready: *mut u32) -> c_int;
    pub fn kvt_step_dirty_get(
        step: *const kvt_step,
        layer: u32,
        seq_index: u32,
        kv_head: u32,
        first_page: *mut u32,
        n_pages: *mut u32,
    ) -> c_int;
    pub fn kvt_step_decode(
        step: *mut kvt_step,
        layer: u32,
        q: *const f32,
        out: *mut f32,
        lse: *mut f32,
    ) -> c_int;
    pub fn kvt_step_attend(
        step: *mut kvt_step,
        layer: u32,
        q: *const f32,
        out: *mut f32,
        lse: *mut f32,
    ) -> c_int;
    pub fn kvt_step_selection_get(
        step: *const kvt_step,
        layer: u32,
        seq_index: u32,
        kv_head: u32,
        pages: *mut u32,
        capacity: u32,
        n_pages: *mut u32,
        reranked: *mut u32,
    ) -> c_int;
    pub fn kvt_pool_kernel_isa_get(pool: *const kvt_pool, isa: *mut *const c_char) -> c_int;

    // mover.h
    pub fn kvt_mover_opts_init(opts: *mut kvt_mover_opts) -> c_int;
    pub fn kvt_pool_mover_get(pool: *mut kvt_pool, out: *mut *mut kvt_mover) -> c_int;
    pub fn kvt_mover_submit(
        mover: *mut kvt_mover,
        moves: *const kvt_move,
        n: u32,
        flags: u32,
        results: *mut i32,
        fence: *mut kvt_fence,
    ) -> c_int;
    pub fn kvt_mover_poll(mover: *mut kvt_mover, fence: kvt_fence) -> c_int;
    pub fn kvt_mover_wait(mover: *mut kvt_mover, fence: kvt_fence, timeout_ns: u64) -> c_int;
    pub fn kvt_mover_stats_get(mover: *const kvt_mover, stats: *mut kvt_mover_stats) -> c_int;
    pub fn kvt_pool_disk_path_get(
        pool: *const kvt_pool,
        buf: *mut c_char,
        cap: usize,
        len: *mut usize,
    ) -> c_int;

    // prefix.h
    pub fn kvt_seq_tokens_set(
        pool: *mut kvt_pool,
        seq: kvt_seq_id,
        first: u32,
        ids: *const u32,
        n: u32,
    ) -> c_int;
    pub fn kvt_prefix_drop(pool: *mut kvt_pool, salt: u64, n_pages: *mut u64) -> c_int;
    pub fn kvt_prefix_drop_all(pool: *mut kvt_pool, n_pages: *mut u64) -> c_int;

    // remote.h
    pub fn kvt_remote_opts_init(opts: *mut kvt_remote_opts) -> c_int;
    pub fn kvt_seq_prefix_wait(
        pool: *mut kvt_pool,
        seq: kvt_seq_id,
        timeout_ms: u32,
        prefix_tokens: *mut u32,
    ) -> c_int;
    pub fn kvt_remote_flush(pool: *mut kvt_pool, timeout_ms: u32) -> c_int;
    pub fn kvt_seq_remote_push(pool: *mut kvt_pool, seq: kvt_seq_id, n_values: *mut u32) -> c_int;
}
