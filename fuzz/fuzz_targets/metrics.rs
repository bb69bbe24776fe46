//! The Prometheus `/metrics` parser on arbitrary bytes.
//!
//! Invariants: no panic; a parse that succeeds names vLLM or SGLang; every figure it returns is
//! what the module promises: kv_usage in [0, 1]; running, waiting and the prefix-cache counters
//! finite and >= 0; block size, block count and capacity whole numbers in [1, 2^53].
#![no_main]

use kvgate::pods::metrics::{parse_bytes, Engine};
use libfuzzer_sys::fuzz_target;

const MAX_EXACT: u64 = 1 << 53;

fuzz_target!(|data: &[u8]| {
    let Ok(m) = parse_bytes(data) else {
        return;
    };
    assert_ne!(m.engine, Engine::Unknown, "{m:?}");
    if let Some(kv) = m.kv_usage {
        assert!(
            (0.0..=1.0).contains(&kv),
            "kv_usage {kv} outside [0, 1]: {m:?}"
        );
    }
    for (name, v) in [
        ("running", m.running),
        ("waiting", m.waiting),
        ("prefix_cache_hits", m.prefix_cache_hits),
        ("prefix_cache_queries", m.prefix_cache_queries),
    ] {
        if let Some(v) = v {
            assert!(v.is_finite() && v >= 0.0, "{name} = {v}: {m:?}");
        }
    }
    for (name, v) in [
        ("block_size", m.block_size),
        ("num_gpu_blocks", m.num_gpu_blocks),
        ("capacity_tokens", m.capacity_tokens),
    ] {
        if let Some(v) = v {
            assert!((1..=MAX_EXACT).contains(&v), "{name} = {v}: {m:?}");
        }
    }
});
