//! Every struct of kvtier::sys against the C compiler's layout of the
//! installed headers (printed by layout.c at build time): size, alignment,
//! and each field's offset and size. A field the C struct has and the list
//! below lacks, or the reverse, is a failure too.
use kvtier::sys;
use std::mem::{align_of, offset_of, size_of};

mod c {
    include!(concat!(env!("OUT_DIR"), "/layout.rs"));
}

struct RField {
    name: &'static str,
    offset: usize,
    size: usize,
}
struct RStruct {
    name: &'static str,
    size: usize,
    align: usize,
    fields: Vec<RField>,
}

fn field_size<T, F>(_: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! rust_layout {
    ($t:ident { $($f:ident),* $(,)? }) => {
        RStruct {
            name: stringify!($t),
            size: size_of::<sys::$t>(),
            align: align_of::<sys::$t>(),
            fields: vec![$(RField {
                name: stringify!($f),
                offset: offset_of!(sys::$t, $f),
                size: field_size(|s: &sys::$t| &s.$f),
            }),*],
        }
    };
}

fn rust_structs() -> Vec<RStruct> {
    vec![
        rust_layout!(kvt_geometry {
            n_layers,
            n_kv_heads,
            n_q_heads,
            head_dim,
            page_tokens,
            dtype,
            reserved
        }),
        rust_layout!(kvt_pool_opts {
            struct_size,
            backend,
            geom,
            device_bytes,
            host_bytes,
            disk_bytes,
            disk_dir,
            host_numa,
            host_numa_node,
            max_seqs,
            max_seq_tokens,
            n_threads,
            flags,
            cuda_device,
            target_seqs,
            mover,
            policy,
            selector,
            target_tokens,
            prefix_cache_bytes,
            remote,
        }),
        rust_layout!(kvt_pool_sizing {
            struct_size,
            reserved,
            device_bytes,
            dense_bytes,
            host_bytes,
            meta_bytes,
            device_pages,
            dense_pages,
        }),
        rust_layout!(kvt_tier_stats {
            blocks_total,
            blocks_used,
            blocks_free,
            bytes_total,
            bytes_used,
            pages
        }),
        rust_layout!(kvt_stats {
            struct_size,
            backend,
            block_bytes,
            meta_bytes_total,
            meta_pages_total,
            meta_pages_used,
            n_seqs,
            n_tokens,
            tier,
            moved_bytes,
            moved_requests,
            sel_pages,
            sel_resident,
            promoted_pages,
            recycled_blocks,
            evicted_pages,
            offloaded_pages,
            reranked_heads,
            paused_seqs,
            prefix_lookups,
            prefix_hit_tokens,
            prefix_miss_tokens,
            prefix_hit_pages,
            prefix_keyed_pages,
            prefix_cached_pages,
            prefix_reclaimed_pages,
            prefix_dropped_pages,
            remote_fetches,
            remote_fetch_ns,
            remote_hit_values,
            remote_miss_values,
            remote_get_bytes,
            remote_put_values,
            remote_put_bytes,
            remote_put_dropped,
            remote_errors,
            remote_corrupt,
            remote_redirects,
            remote_queue_bytes,
            head_selections,
            similarity_reranks,
        }),
        rust_layout!(kvt_seq_opts {
            struct_size,
            max_tokens,
            user_data,
            salt,
            prefix,
            n_prefix,
            reserved,
        }),
        rust_layout!(kvt_seq_info {
            struct_size,
            max_tokens,
            n_tokens,
            n_tokens_max,
            user_data,
            pages,
            pages_in_tier,
            prefix_tokens,
            token_ids,
            salt,
            remote_tokens,
            remote_loading,
        }),
        rust_layout!(kvt_selector_opts {
            struct_size,
            method,
            vote,
            top_k_pages,
            sink_pages,
            local_pages,
            rerank_interval,
            vote_scale,
            rerank_similarity,
            reserved,
        }),
        rust_layout!(kvt_policy_opts {
            struct_size,
            default_class,
            top_k_pages,
            window,
            sink_pages,
            local_pages,
            stable_interval,
            unstable_interval,
            rerank_similarity,
            reserved,
        }),
        rust_layout!(kvt_policy_heads {
            struct_size,
            n_heads,
            head_class,
            top_k_pages,
            window,
            sink_pages,
            local_pages,
            rerank_interval,
            rerank_similarity,
        }),
        rust_layout!(kvt_policy_head_info {
            struct_size,
            head_class,
            top_k_pages,
            window,
            sink_pages,
            local_pages,
            rerank_interval,
            rerank_similarity,
        }),
        rust_layout!(kvt_profiler_opts {
            struct_size,
            window_steps,
            unstable_fraction,
            bottom_fraction,
            max_streams,
            reserved,
        }),
        rust_layout!(kvt_profiler_head_stats {
            struct_size,
            k_max,
            records,
            windows,
            ranked_windows,
            bottom,
            mean_ts,
            instability,
            demand,
            benefit,
        }),
        rust_layout!(kvt_step_opts {
            struct_size,
            flags,
            selector,
            policy,
            profiler,
            stream,
            scale,
            reserved,
            n_new,
            n_rows,
            max_new,
            token_ids,
            n_token_ids,
            reserved2,
        }),
        rust_layout!(kvt_mover_opts {
            struct_size,
            flags,
            copy_threads,
            queue_depth,
            max_io_bytes,
            extent_pages,
            segment_extents,
            chunk_pages,
        }),
        rust_layout!(kvt_move { seq, layer, kv_head, page, from, to, flags }),
        rust_layout!(kvt_mover_stats {
            struct_size,
            disk_direct,
            registered,
            queue_depth,
            disk_file_bytes,
            batches_in_flight,
            moves_in_flight,
            moved_bytes,
            moved_requests,
            disk_reads,
            disk_writes,
            disk_read_bytes,
            disk_write_bytes,
            retries,
            short_io,
            io_errors,
            checksum_errors,
            evictions,
        }),
        rust_layout!(kvt_remote_opts {
            struct_size,
            flags,
            endpoints,
            user,
            password,
            fingerprint,
            key_prefix,
            connect_timeout_ms,
            io_timeout_ms,
            retry_ms,
            n_connections,
            pipeline,
            ttl_s,
            queue_bytes,
            log,
            log_ctx,
        }),
    ]
}

#[test]
fn structs_match_c_layout() {
    let rust = rust_structs();
    let mut errors = Vec::new();
    for cs in c::ALL {
        let Some(rs) = rust.iter().find(|r| r.name == cs.name) else {
            errors.push(format!("{}: not checked on the Rust side", cs.name));
            continue;
        };
        if rs.size != cs.size {
            errors.push(format!("{}: size {} in Rust, {} in C", cs.name, rs.size, cs.size));
        }
        if rs.align != cs.align {
            errors.push(format!("{}: align {} in Rust, {} in C", cs.name, rs.align, cs.align));
        }
        for cf in cs.fields {
            match rs.fields.iter().find(|f| f.name == cf.name) {
                None => errors.push(format!("{}.{}: missing in Rust", cs.name, cf.name)),
                Some(rf) => {
                    if (rf.offset, rf.size) != (cf.offset, cf.size) {
                        errors.push(format!(
                            "{}.{}: offset {} size {} in Rust, offset {} size {} in C",
                            cs.name, cf.name, rf.offset, rf.size, cf.offset, cf.size
                        ));
                    }
                }
            }
        }
        for rf in &rs.fields {
            if !cs.fields.iter().any(|f| f.name == rf.name) {
                errors.push(format!("{}.{}: not in the C struct", cs.name, rf.name));
            }
        }
    }
    for rs in &rust {
        if !c::ALL.iter().any(|c| c.name == rs.name) {
            errors.push(format!("{}: not printed by layout.c", rs.name));
        }
    }
    assert!(errors.is_empty(), "layout mismatches:\n  {}", errors.join("\n  "));
    assert_eq!(c::ALL.len(), 18);
}

#[test]
fn struct_size_fields_are_first() {
    // The library reads struct_size to tell versions apart: it must lead.
    assert_eq!(offset_of!(sys::kvt_pool_opts, struct_size), 0);
    assert_eq!(c::KVT_POOL_OPTS.fields[0].name, "struct_size");
    assert_eq!(c::KVT_STATS.size, size_of::<sys::kvt_stats>());
}

/// The layouts the library tells apart by struct_size (LP64): each appended
/// group of fields starts where the previous layout ended, at the offset the
/// header names, in C and in Rust alike, and the sizes are the current ones.
#[test]
#[cfg(target_pointer_width = "64")]
fn appended_fields_start_at_the_documented_sizes() {
    fn c_offset(cs: &c::CStruct, field: &str) -> usize {
        match cs.fields.iter().find(|f| f.name == field) {
            Some(f) => f.offset,
            None => panic!("{}.{field}: not printed by layout.c", cs.name),
        }
    }
    macro_rules! at {
        ($t:ident, $c:expr, $f:ident, $want:expr) => {
            let what = concat!(stringify!($t), ".", stringify!($f));
            assert_eq!(offset_of!(sys::$t, $f), $want, "Rust {what}");
            assert_eq!(c_offset(&$c, stringify!($f)), $want, "C {what}");
        };
    }
    // kvt_pool_opts: 136 (first layout), 160 (+ prefix cache), 168 (+ remote).
    at!(kvt_pool_opts, c::KVT_POOL_OPTS, prefix_cache_bytes, 136);
    at!(kvt_pool_opts, c::KVT_POOL_OPTS, remote, 160);
    // kvt_stats: 328, 408 (+ prefix cache), 504 (+ remote: 12 counters),
    // 520 (+ selection: 2 counters).
    at!(kvt_stats, c::KVT_STATS, prefix_lookups, 328);
    at!(kvt_stats, c::KVT_STATS, remote_fetches, 408);
    at!(kvt_stats, c::KVT_STATS, remote_queue_bytes, 408 + 11 * 8);
    at!(kvt_stats, c::KVT_STATS, head_selections, 504);
    at!(kvt_stats, c::KVT_STATS, similarity_reranks, 512);
    // kvt_selector_opts and kvt_policy_opts: 32, 40 (+ the selection cache).
    at!(kvt_selector_opts, c::KVT_SELECTOR_OPTS, rerank_similarity, 32);
    at!(kvt_selector_opts, c::KVT_SELECTOR_OPTS, reserved, 36);
    at!(kvt_policy_opts, c::KVT_POLICY_OPTS, rerank_similarity, 32);
    at!(kvt_policy_opts, c::KVT_POLICY_OPTS, reserved, 36);
    // kvt_policy_heads: 56, 64 (+ the selection cache's per-head thresholds;
    // the library's first layout ends after rerank_interval).
    at!(kvt_policy_heads, c::KVT_POLICY_HEADS, rerank_similarity, 56);
    // kvt_policy_head_info: rerank_similarity took the place of reserved.
    at!(kvt_policy_head_info, c::KVT_POLICY_HEAD_INFO, rerank_similarity, 28);
    // kvt_seq_info: 56, 72 (+ prefix cache), 80 (+ remote).
    at!(kvt_seq_info, c::KVT_SEQ_INFO, prefix_tokens, 56);
    at!(kvt_seq_info, c::KVT_SEQ_INFO, remote_tokens, 72);
    at!(kvt_seq_info, c::KVT_SEQ_INFO, remote_loading, 76);
    // kvt_remote_opts: the first layout (KVT__REMOTE_OPTS_V1).
    at!(kvt_remote_opts, c::KVT_REMOTE_OPTS, queue_bytes, 72);
    at!(kvt_remote_opts, c::KVT_REMOTE_OPTS, log, 80);
    at!(kvt_remote_opts, c::KVT_REMOTE_OPTS, log_ctx, 88);
    for (name, rust, c, want) in [
        ("kvt_pool_opts", size_of::<sys::kvt_pool_opts>(), c::KVT_POOL_OPTS.size, 168),
        ("kvt_stats", size_of::<sys::kvt_stats>(), c::KVT_STATS.size, 520),
        ("kvt_selector_opts", size_of::<sys::kvt_selector_opts>(), c::KVT_SELECTOR_OPTS.size, 40),
        ("kvt_policy_opts", size_of::<sys::kvt_policy_opts>(), c::KVT_POLICY_OPTS.size, 40),
        ("kvt_policy_heads", size_of::<sys::kvt_policy_heads>(), c::KVT_POLICY_HEADS.size, 64),
        (
            "kvt_policy_head_info",
            size_of::<sys::kvt_policy_head_info>(),
            c::KVT_POLICY_HEAD_INFO.size,
            32,
        ),
        ("kvt_seq_info", size_of::<sys::kvt_seq_info>(), c::KVT_SEQ_INFO.size, 80),
        ("kvt_remote_opts", size_of::<sys::kvt_remote_opts>(), c::KVT_REMOTE_OPTS.size, 96),
    ] {
        assert_eq!((rust, c), (want, want), "{name}: size (Rust, C)");
    }
}

/// Each `kvt_*_opts_init` writes sizeof(the header's struct) and sets
/// struct_size to it: into a buffer with a sentinel past the Rust struct, a
/// Rust struct that is too small shows as a struct_size above its size or
/// as overwritten sentinel bytes.
#[test]
fn opts_init_writes_the_rust_size() {
    unsafe fn probe<T>(name: &str, init: unsafe extern "C" fn(*mut T) -> std::os::raw::c_int) {
        const PAD: usize = 64;
        let n = size_of::<T>();
        let mut buf = vec![0u64; (n + PAD).div_ceil(8)];
        let bytes = buf.as_mut_ptr() as *mut u8;
        std::ptr::write_bytes(bytes, 0xa5, buf.len() * 8);
        assert_eq!(init(bytes as *mut T), 0, "{name}");
        let struct_size = (bytes as *const u32).read();
        assert_eq!(struct_size as usize, n, "{name}: struct_size set by the library");
        let tail = std::slice::from_raw_parts(bytes.add(n), buf.len() * 8 - n);
        assert!(tail.iter().all(|&b| b == 0xa5), "{name}: written past the Rust struct");
    }
    unsafe {
        probe("kvt_pool_opts", sys::kvt_pool_opts_init);
        probe("kvt_seq_opts", sys::kvt_seq_opts_init);
        probe("kvt_step_opts", sys::kvt_step_opts_init);
        probe("kvt_selector_opts", sys::kvt_selector_opts_init);
        probe("kvt_policy_opts", sys::kvt_policy_opts_init);
        probe("kvt_profiler_opts", sys::kvt_profiler_opts_init);
        probe("kvt_mover_opts", sys::kvt_mover_opts_init);
        probe("kvt_remote_opts", sys::kvt_remote_opts_init);
    }
}
