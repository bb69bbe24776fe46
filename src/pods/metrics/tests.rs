//! The reader against real documents (vLLM and SGLang `/metrics` bodies kept in
//! `fuzz/seeds/metrics/`, which seed the fuzz target too) and against every way a body can be
//! malformed, truncated or implausible.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::aggregate::MAX_GROUPS;
use super::exposition::{MAX_LINES, MAX_LINE_BYTES};
use super::*;

const M: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A vLLM V1 (0.10-0.11 era) `/metrics` body, single engine, as prometheus_client writes it:
/// process and HTTP metrics around the engine's, `_created` samples beside counters,
/// histograms (one of them, `iteration_tokens_total`, named with `_total`), and the full
/// `cache_config_info` label set including Python `None`s and `kv_cache_size_tokens`.
const VLLM_DOC: &str = include_str!("../../../fuzz/seeds/metrics/vllm_v1_single_engine.prom");

/// A recent SGLang body: scheduler gauges labelled by engine type and parallel ranks,
/// tokenizer-manager counters labelled by model only, capacity as plain gauges.
const SGLANG_DOC: &str = include_str!("../../../fuzz/seeds/metrics/sglang_recent.prom");

fn ok(text: &str) -> PodMetrics {
    match parse(text) {
        Ok(m) => m,
        Err(e) => panic!("expected metrics, got {e}: {text:?}"),
    }
}

fn running_of(text: &str) -> Option<f64> {
    ok(text).running
}

#[test]
fn sums_that_overflow_are_unknown_not_infinite() {
    let m = parse_bytes(
        b"vllm:num_requests_running{engine=\"0\"} 1e308\nvllm:num_requests_running{engine=\"1\"} 1e308\nvllm:num_requests_waiting 1\n",
    )
    .unwrap();
    assert_eq!(m.running, None);
}

#[test]
fn full_vllm_v1_document() {
    let m = ok(VLLM_DOC);
    assert_eq!(
        m,
        PodMetrics {
            engine: Engine::Vllm,
            running: Some(3.0),
            waiting: Some(1.0),
            kv_usage: Some(0.41830065359477125),
            block_size: Some(16),
            num_gpu_blocks: Some(27_000),
            capacity_tokens: Some(432_000),
            prefix_cache_hits: Some(987_648.0),
            prefix_cache_queries: Some(1_234_567.0),
            preemptions: Some(0.0),
            no_prefix_caching: false,
            itl: None,
            answers: Some(AnswerTotals {
                model: crate::hash::fnv1a(M.as_bytes()),
                tokens: 210_061.0,
                count: 851.0,
            }),
        }
    );
}

#[test]
fn full_sglang_document() {
    let m = ok(SGLANG_DOC);
    assert_eq!(
        m,
        PodMetrics {
            engine: Engine::Sglang,
            running: Some(7.0),
            waiting: Some(2.0),
            kv_usage: Some(0.35),
            block_size: Some(1),
            num_gpu_blocks: Some(146_368),
            capacity_tokens: Some(146_368),
            // The device's and the host's cached tokens, each a hit.
            prefix_cache_hits: Some(21_870_000.0),
            prefix_cache_queries: Some(35_186_000.0),
            preemptions: Some(37.0),
            no_prefix_caching: false,
            itl: Some(ItlTotals {
                sum_s: 98_091.2,
                count: 7_545_478.0,
            }),
            // Its generated tokens without the requests they came from.
            answers: None,
        }
    );
}

#[test]
fn older_sglang_retractions_and_inter_token_latency() {
    // Before the retraction counter, a gauge carried the running total; before the inter-token
    // latency histogram, the time per output token. The per-step retraction gauge is no total.
    let doc = "sglang:token_usage{model_name=\"m\"} 0.5\n\
               sglang:num_retracted_reqs{model_name=\"m\"} 2\n\
               sglang:total_retracted_reqs{model_name=\"m\"} 9\n\
               sglang:time_per_output_token_seconds_sum{model_name=\"m\"} 1.5\n\
               sglang:time_per_output_token_seconds_count{model_name=\"m\"} 100\n";
    let m = ok(doc);
    assert_eq!(m.preemptions, Some(9.0));
    assert_eq!(
        m.itl,
        Some(ItlTotals {
            sum_s: 1.5,
            count: 100.0
        })
    );
    // Both names present: the counter is read, never added to the gauge's total.
    let both = format!("{doc}sglang:num_retracted_requests_total{{model_name=\"m\"}} 9\n");
    assert_eq!(ok(&both).preemptions, Some(9.0));
}

#[test]
fn sglang_cached_tokens_add_up_over_sources_and_dp_ranks_not_tp_copies() {
    let doc = "sglang:cached_tokens_total{cache_source=\"device\",dp_rank=\"0\",tp_rank=\"0\"} 100\n\
               sglang:cached_tokens_total{cache_source=\"device\",dp_rank=\"0\",tp_rank=\"1\"} 100\n\
               sglang:cached_tokens_total{cache_source=\"host\",dp_rank=\"0\",tp_rank=\"0\"} 20\n\
               sglang:cached_tokens_total{cache_source=\"storage\",dp_rank=\"0\",tp_rank=\"0\"} 3\n\
               sglang:cached_tokens_total{cache_source=\"device\",dp_rank=\"1\",tp_rank=\"0\"} 50\n\
               sglang:prompt_tokens_total{dp_rank=\"0\",tp_rank=\"0\"} 400\n\
               sglang:prompt_tokens_total{dp_rank=\"0\",tp_rank=\"1\"} 400\n\
               sglang:prompt_tokens_total{dp_rank=\"1\",tp_rank=\"0\"} 300\n";
    let m = ok(doc);
    assert_eq!(m.prefix_cache_hits, Some(173.0));
    assert_eq!(m.prefix_cache_queries, Some(700.0));
}

#[test]
fn crlf_bom_blank_lines_and_indentation_change_nothing() {
    let crlf = VLLM_DOC.replace('\n', "\r\n");
    assert_eq!(ok(&crlf), ok(VLLM_DOC));
    let bom = format!("\u{feff}{VLLM_DOC}");
    assert_eq!(ok(&bom), ok(VLLM_DOC));
    let spaced = VLLM_DOC.replace('\n', "\n\n  \t\n\t ");
    assert_eq!(ok(&spaced), ok(VLLM_DOC));
}

#[test]
fn older_vllm_without_engine_label_or_token_capacity() {
    // vLLM V0 / early V1: no `engine` label, the deprecated usage gauge only, and capacity
    // only as blocks.
    let doc = format!(
        "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"False\",\
         num_cpu_blocks=\"9362\",num_gpu_blocks=\"81767\",num_gpu_blocks_override=\"None\",\
         sliding_window=\"None\",swap_space_bytes=\"4294967296\"}} 1.0\n\
         vllm:num_requests_running{{model_name=\"{M}\"}} 0.0\n\
         vllm:num_requests_swapped{{model_name=\"{M}\"}} 0.0\n\
         vllm:num_requests_waiting{{model_name=\"{M}\"}} 4.0\n\
         vllm:gpu_cache_usage_perc{{model_name=\"{M}\"}} 0.97\n\
         vllm:gpu_prefix_cache_hit_rate{{model_name=\"{M}\"}} 0.5\n"
    );
    let m = ok(&doc);
    assert_eq!(m.engine, Engine::Vllm);
    assert_eq!((m.running, m.waiting), (Some(0.0), Some(4.0)));
    assert_eq!(m.kv_usage, Some(0.97));
    assert_eq!(m.block_size, Some(16));
    assert_eq!(m.num_gpu_blocks, Some(81_767));
    assert_eq!(m.capacity_tokens, Some(81_767 * 16));
    assert_eq!((m.prefix_cache_hits, m.prefix_cache_queries), (None, None));
    assert!(m.no_prefix_caching);
}

#[test]
fn current_usage_gauge_wins_over_deprecated_one() {
    let doc = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.2\n";
    assert_eq!(ok(doc).kv_usage, Some(0.2));
    // Even when the current one is unusable: it was published, so the engine's value is
    // unknown rather than whatever the old name says.
    let doc = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc NaN\n";
    assert_eq!(ok(doc).kv_usage, None);
}

#[test]
fn hybrid_model_capacity_comes_from_the_engines_own_token_count() {
    // A hybrid attention/Mamba model: 320 blocks of 8 would claim 2,560 tokens.
    let doc =
        "vllm:cache_config_info{block_size=\"8\",engine=\"0\",kv_cache_size_tokens=\"463459\",\
               mamba_block_size=\"16\",mamba_cache_mode=\"align\",num_gpu_blocks=\"320\"} 1.0\n";
    let m = ok(doc);
    assert_eq!(m.capacity_tokens, Some(463_459));
    assert_eq!((m.block_size, m.num_gpu_blocks), (Some(8), Some(320)));
}

#[test]
fn unset_cache_settings_are_unknown_not_zero() {
    // Before profiling, or for attention-free models, vLLM writes the string "None".
    let doc = "vllm:cache_config_info{block_size=\"16\",kv_cache_size_tokens=\"None\",num_gpu_blocks=\"None\"} 1.0\n\
               vllm:num_requests_running 0\n";
    let m = ok(doc);
    assert_eq!(m.block_size, Some(16));
    assert_eq!((m.num_gpu_blocks, m.capacity_tokens), (None, None));
    let doc = "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"-4\"} 1.0\n";
    let m = ok(doc);
    assert_eq!(
        (m.block_size, m.num_gpu_blocks, m.capacity_tokens),
        (None, None, None)
    );
    // A token count that falls back to blocks when one engine lacks it.
    let doc = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",kv_cache_size_tokens=\"1600\",num_gpu_blocks=\"100\"} 1.0\n\
               vllm:cache_config_info{block_size=\"16\",engine=\"1\",kv_cache_size_tokens=\"None\",num_gpu_blocks=\"100\"} 1.0\n";
    assert_eq!(ok(doc).capacity_tokens, Some(3_200));
}

#[test]
fn vllm_data_parallel_engines_add_up() {
    let doc = format!(
        "vllm:num_requests_running{{engine=\"0\",model_name=\"{M}\"}} 3.0\n\
         vllm:num_requests_running{{engine=\"1\",model_name=\"{M}\"}} 5.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"{M}\"}} 0.0\n\
         vllm:num_requests_waiting{{engine=\"1\",model_name=\"{M}\"}} 2.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{M}\"}} 0.25\n\
         vllm:kv_cache_usage_perc{{engine=\"1\",model_name=\"{M}\"}} 0.75\n\
         vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"{M}\"}} 10.0\n\
         vllm:prefix_cache_hits_total{{engine=\"1\",model_name=\"{M}\"}} 30.0\n\
         vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"{M}\"}} 100.0\n\
         vllm:prefix_cache_queries_total{{engine=\"1\",model_name=\"{M}\"}} 300.0\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",kv_cache_size_tokens=\"16000\",num_gpu_blocks=\"1000\"}} 1.0\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"1\",kv_cache_size_tokens=\"16000\",num_gpu_blocks=\"1000\"}} 1.0\n"
    );
    let m = ok(&doc);
    assert_eq!((m.running, m.waiting), (Some(8.0), Some(2.0)));
    assert_eq!(m.kv_usage, Some(0.75));
    assert_eq!(m.num_gpu_blocks, Some(2_000));
    assert_eq!(m.capacity_tokens, Some(32_000));
    assert_eq!(m.block_size, Some(16));
    assert_eq!(
        (m.prefix_cache_hits, m.prefix_cache_queries),
        (Some(40.0), Some(400.0))
    );
}

#[test]
fn several_models_add_up_and_repeated_series_do_not() {
    let doc = "vllm:num_requests_running{model_name=\"a\"} 1\n\
               vllm:num_requests_running{model_name=\"b\"} 2\n\
               vllm:num_requests_running{model_name=\"b\"} 2\n";
    assert_eq!(running_of(doc), Some(3.0));
    // Label order does not make a new engine.
    let doc = "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 4\n\
               vllm:num_requests_running{model_name=\"a\",engine=\"0\"} 4\n";
    assert_eq!(running_of(doc), Some(4.0));
    // An empty label is not the same as no label.
    let doc = "vllm:num_requests_running{engine=\"\"} 4\nvllm:num_requests_running 1\n";
    assert_eq!(running_of(doc), Some(5.0));
}

#[test]
fn vllm_multiprocess_pid_copies_are_not_summed() {
    let doc = "vllm:kv_cache_usage_perc{engine=\"0\",pid=\"101\"} 0.5\n\
               vllm:kv_cache_usage_perc{engine=\"0\",pid=\"102\"} 0.6\n\
               vllm:num_requests_running{engine=\"0\",pid=\"101\"} 2\n\
               vllm:num_requests_running{engine=\"0\",pid=\"102\"} 3\n";
    let m = ok(doc);
    assert_eq!((m.kv_usage, m.running), (Some(0.6), Some(3.0)));
}

#[test]
fn sglang_priority_breakdown_is_not_counted_twice() {
    let l =
        "engine_type=\"unified\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"";
    let doc = format!(
        "sglang:num_running_reqs{{{l},priority=\"\"}} 6.0\n\
         sglang:num_running_reqs{{{l},priority=\"0\"}} 4.0\n\
         sglang:num_running_reqs{{{l},priority=\"10\"}} 2.0\n\
         sglang:num_queue_reqs{{{l},priority=\"\"}} 3.0\n\
         sglang:num_queue_reqs{{{l},priority=\"10\"}} 3.0\n"
    );
    let m = ok(&doc);
    assert_eq!((m.running, m.waiting), (Some(6.0), Some(3.0)));
}

#[test]
fn sglang_tensor_parallel_copies_take_the_max_and_dp_ranks_add_up() {
    // --enable-metrics-for-all-schedulers: every TP rank reports the same scheduler.
    let doc = "sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 5\n\
               sglang:num_running_reqs{model_name=\"m\",tp_rank=\"1\"} 5\n\
               sglang:max_total_num_tokens{model_name=\"m\",tp_rank=\"0\"} 1000\n\
               sglang:max_total_num_tokens{model_name=\"m\",tp_rank=\"1\"} 1000\n";
    let m = ok(doc);
    assert_eq!((m.running, m.capacity_tokens), (Some(5.0), Some(1_000)));
    // DP attention: each rank has its own scheduler and pool.
    let doc = "sglang:num_running_reqs{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 5\n\
               sglang:num_running_reqs{dp_rank=\"1\",model_name=\"m\",tp_rank=\"4\"} 7\n\
               sglang:token_usage{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 0.1\n\
               sglang:token_usage{dp_rank=\"1\",model_name=\"m\",tp_rank=\"4\"} 0.9\n\
               sglang:max_total_num_tokens{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 1000\n\
               sglang:max_total_num_tokens{dp_rank=\"1\",model_name=\"m\",tp_rank=\"4\"} 1000\n";
    let m = ok(doc);
    assert_eq!(m.running, Some(12.0));
    assert_eq!(m.kv_usage, Some(0.9));
    assert_eq!(m.capacity_tokens, Some(2_000));
}

#[test]
fn sglang_cache_config_info_labels() {
    // Releases before the page gauges carried the pool as labels of an info gauge.
    let doc =
        "sglang:cache_config_info{model_name=\"m\",num_pages=\"2787\",page_size=\"64\"} 1.0\n\
               sglang:num_running_reqs{model_name=\"m\"} 1.0\n";
    let m = ok(doc);
    assert_eq!(m.engine, Engine::Sglang);
    assert_eq!((m.block_size, m.num_gpu_blocks), (Some(64), Some(2_787)));
    assert_eq!(m.capacity_tokens, Some(2_787 * 64));
    // The label carrying the token count directly wins over the product and the gauge.
    let doc = "sglang:cache_config_info{max_total_num_tokens=\"178000\",num_pages=\"2787\",page_size=\"64\"} 1.0\n\
               sglang:max_total_num_tokens 170000\n";
    assert_eq!(ok(doc).capacity_tokens, Some(178_000));
    // And the gauge wins over the product.
    let doc = "sglang:page_size 64\nsglang:num_pages 2787\nsglang:max_total_num_tokens 178000\n";
    let m = ok(doc);
    assert_eq!(m.capacity_tokens, Some(178_000));
    assert_eq!((m.block_size, m.num_gpu_blocks), (Some(64), Some(2_787)));
}

#[test]
fn old_sglang_name_label() {
    let doc = "sglang:max_total_num_tokens{name=\"google/gemma-2-9b-it\"} 161721.0\n\
               sglang:num_running_reqs{name=\"google/gemma-2-9b-it\"} 3.0\n\
               sglang:num_queue_reqs{name=\"google/gemma-2-9b-it\"} 0.0\n\
               sglang:token_usage{name=\"google/gemma-2-9b-it\"} 0.05\n";
    let m = ok(doc);
    assert_eq!(m.capacity_tokens, Some(161_721));
    assert_eq!(
        (m.running, m.waiting, m.kv_usage),
        (Some(3.0), Some(0.0), Some(0.05))
    );
    assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));
}

#[test]
fn engines_disagreeing_on_block_size_leave_it_unknown() {
    let doc = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10\"} 1\n\
               vllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"10\"} 1\n";
    let m = ok(doc);
    assert_eq!(m.block_size, None);
    assert_eq!(m.num_gpu_blocks, Some(20));
    assert_eq!(m.capacity_tokens, None);
}

#[test]
fn escaped_label_values() {
    let doc = concat!(
        r#"vllm:num_requests_running{model_name="we\"ird\\model\nname},x=\"y\"",engine="0"} 2"#,
        "\n",
        r#"vllm:num_requests_running{model_name="ends with backslash\\",engine="0"} 3"#,
        "\n",
        r#"vllm:num_requests_running{model_name="ünïcødé ✓ \\\"",engine="0"} 4"#,
        "\n",
        r#"vllm:cache_config_info{kv_cache_dtype_skip_layers="['0', '2']",note="a \"quoted\" \\ path",block_size="16",num_gpu_blocks="10",} 1.0"#,
        "\n",
    );
    let m = ok(doc);
    assert_eq!(m.running, Some(9.0));
    assert_eq!(m.capacity_tokens, Some(160));
    // Different escaped values are different models; the same bytes are the same model.
    let doc = concat!(
        r#"vllm:num_requests_running{model_name="a\"b"} 1"#,
        "\n",
        r#"vllm:num_requests_running{model_name="a\\b"} 2"#,
        "\n",
        r#"vllm:num_requests_running{model_name="a\\b"} 2"#,
        "\n",
    );
    assert_eq!(running_of(doc), Some(3.0));
}

#[test]
fn label_set_whitespace_and_trailing_comma() {
    let doc = "vllm:num_requests_running { engine = \"0\" , model_name=\"m\" , } 5\n";
    assert_eq!(running_of(doc), Some(5.0));
    assert_eq!(running_of("vllm:num_requests_running{} 6\n"), Some(6.0));
    assert_eq!(
        running_of("vllm:num_requests_running{engine=\"0\"}7\n"),
        Some(7.0)
    );
    assert_eq!(running_of("vllm:num_requests_running\t8\t\n"), Some(8.0));
}

#[test]
fn number_formats() {
    for (text, want) in [
        ("3", 3.0),
        ("3.0", 3.0),
        ("3.5e+01", 35.0),
        ("3.5E1", 35.0),
        ("+2", 2.0),
        ("1e0", 1.0),
        ("0.0", 0.0),
        ("-0.0", 0.0),
        ("-0", 0.0),
    ] {
        let doc = format!("vllm:num_requests_running {text}\n");
        let got = running_of(&doc);
        assert_eq!(got, Some(want), "{text}");
        assert!(got.is_some_and(|v| v.is_sign_positive()), "{text}");
    }
    let doc = "vllm:kv_cache_usage_perc 4.2e-1\n";
    assert_eq!(ok(doc).kv_usage, Some(0.42));
}

#[test]
fn nan_and_infinities_are_unknown() {
    for v in ["NaN", "nan", "+Inf", "-Inf", "Inf", "1e400"] {
        let doc = format!(
            "vllm:num_requests_running {v}\nvllm:num_requests_waiting {v}\n\
             vllm:kv_cache_usage_perc {v}\nvllm:prefix_cache_hits_total {v}\n\
             vllm:prefix_cache_queries_total {v}\n"
        );
        let m = ok(&doc);
        assert_eq!(m.engine, Engine::Vllm, "{v}");
        assert_eq!(
            (m.running, m.waiting, m.kv_usage),
            (None, None, None),
            "{v}"
        );
        assert_eq!(
            (m.prefix_cache_hits, m.prefix_cache_queries),
            (None, None),
            "{v}"
        );
    }
    let doc = "sglang:max_total_num_tokens +Inf\nsglang:page_size NaN\nsglang:num_pages 12\n";
    let m = ok(doc);
    assert_eq!(
        (m.capacity_tokens, m.block_size, m.num_gpu_blocks),
        (None, None, Some(12))
    );
}

#[test]
fn one_bad_engine_makes_the_sum_unknown() {
    let doc =
        "vllm:num_requests_running{engine=\"0\"} 3\nvllm:num_requests_running{engine=\"1\"} NaN\n";
    assert_eq!(running_of(doc), None);
    let doc =
        "vllm:kv_cache_usage_perc{engine=\"0\"} 0.3\nvllm:kv_cache_usage_perc{engine=\"1\"} -1\n";
    assert_eq!(ok(doc).kv_usage, None);
}

#[test]
fn implausible_values_are_dropped() {
    assert_eq!(running_of("vllm:num_requests_running -1\n"), None);
    assert_eq!(ok("vllm:num_requests_waiting -0.5\n").waiting, None);
    assert_eq!(
        ok("vllm:prefix_cache_hits_total -3\n").prefix_cache_hits,
        None
    );
    for (v, want) in [
        ("0", Some(0.0)),
        ("1", Some(1.0)),
        ("1.004", Some(1.0)),
        ("1.01", Some(1.0)),
        ("1.02", None),
        ("1.5", None),
        ("85", None),
        ("100", None),
        ("-0.1", None),
    ] {
        let doc = format!("sglang:token_usage {v}\n");
        assert_eq!(ok(&doc).kv_usage, want, "{v}");
    }
    // Fractional and huge token counts are not counts.
    let doc = "sglang:max_total_num_tokens 1000.5\nsglang:num_pages 1e300\nsglang:page_size 0\n";
    let m = ok(doc);
    assert_eq!(
        (m.capacity_tokens, m.num_gpu_blocks, m.block_size),
        (None, None, None)
    );
}

#[test]
fn timestamps_and_exemplars() {
    assert_eq!(
        running_of("vllm:num_requests_running 3 1712345678000\n"),
        Some(3.0)
    );
    assert_eq!(
        running_of("vllm:num_requests_running 3 -1712345678000\n"),
        Some(3.0)
    );
    assert_eq!(
        running_of("vllm:num_requests_running{engine=\"0\"} 3 1712345678.123\n"),
        Some(3.0)
    );
    let doc =
        "vllm:prefix_cache_hits_total{engine=\"0\"} 17 # {trace_id=\"abc\"} 1.0 1712345678.1\n";
    assert_eq!(ok(doc).prefix_cache_hits, Some(17.0));
    let doc = "vllm:prefix_cache_hits_total 17 1712345678 # {trace_id=\"abc\"} 1.0\n";
    assert_eq!(ok(doc).prefix_cache_hits, Some(17.0));
    // A timestamp that is not a number, or anything more after it, spoils the line.
    for bad in [
        "vllm:num_requests_running 3 yesterday\n",
        "vllm:num_requests_running 3 NaN\n",
        "vllm:num_requests_running 3 1712345678000 9\n",
    ] {
        assert_eq!(parse(bad), Err(MetricsError::NoKnownMetrics), "{bad:?}");
    }
}

#[test]
fn counter_name_variants() {
    assert_eq!(
        ok("vllm:prefix_cache_hits 5\nvllm:prefix_cache_queries 9\n").prefix_cache_hits,
        Some(5.0)
    );
    // Both spellings present: `_total` alone counts.
    let doc = "vllm:prefix_cache_hits 5\nvllm:prefix_cache_hits_total 7\n\
               vllm:prefix_cache_queries_total 20\nvllm:prefix_cache_queries 9\n";
    let m = ok(doc);
    assert_eq!(
        (m.prefix_cache_hits, m.prefix_cache_queries),
        (Some(7.0), Some(20.0))
    );
    // vLLM 0.8's names, read only when the current ones are absent.
    let doc = "vllm:gpu_prefix_cache_hits_total 4\nvllm:gpu_prefix_cache_queries_total 8\n";
    let m = ok(doc);
    assert_eq!(
        (m.prefix_cache_hits, m.prefix_cache_queries),
        (Some(4.0), Some(8.0))
    );
    let doc = "vllm:gpu_prefix_cache_hits_total 4\nvllm:prefix_cache_hits_total 6\n";
    assert_eq!(ok(doc).prefix_cache_hits, Some(6.0));
    // `_created` is a timestamp, not the counter.
    let doc = "vllm:prefix_cache_hits_created 1.7e9\nvllm:num_requests_running 1\n";
    assert_eq!(ok(doc).prefix_cache_hits, None);
}

#[test]
fn openmetrics_eof_ends_the_document() {
    let doc = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n# EOF\n\
               vllm:num_requests_running{engine=\"9\"} 50\n";
    assert_eq!(running_of(doc), Some(2.0));
    // The newline after `# EOF` is optional in OpenMetrics.
    let doc = "vllm:num_requests_running 2\n# EOF";
    assert_eq!(running_of(doc), Some(2.0));
    let doc = "vllm:num_requests_running 2\r\n  # EOF \r\nvllm:num_requests_waiting 3\n";
    assert_eq!(ok(doc).waiting, None);
    // Only the exact marker ends it.
    let doc = "# EOFX\n# HELP # EOF\nvllm:num_requests_running 2\n";
    assert_eq!(running_of(doc), Some(2.0));
}

#[test]
fn unterminated_last_line_is_treated_as_cut_off() {
    assert_eq!(
        parse("vllm:num_requests_running 1"),
        Err(MetricsError::NoKnownMetrics)
    );
    let doc = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1";
    let m = ok(doc);
    assert_eq!((m.waiting, m.running), (Some(0.0), None));
}

#[test]
fn any_truncation_of_a_real_document_only_loses_figures() {
    let full = ok(VLLM_DOC);
    let mut successes = 0;
    for (cut, _) in VLLM_DOC.char_indices() {
        let Some(prefix) = VLLM_DOC.get(..cut) else {
            continue;
        };
        let Ok(m) = parse(prefix) else {
            continue;
        };
        successes += 1;
        assert_eq!(m.engine, full.engine, "cut at {cut}");
        for (got, want) in [
            (m.running, full.running),
            (m.waiting, full.waiting),
            (m.kv_usage, full.kv_usage),
            (m.prefix_cache_hits, full.prefix_cache_hits),
            (m.prefix_cache_queries, full.prefix_cache_queries),
        ] {
            assert!(got.is_none() || got == want, "cut at {cut}: {got:?}");
        }
        for (got, want) in [
            (m.block_size, full.block_size),
            (m.num_gpu_blocks, full.num_gpu_blocks),
            (m.capacity_tokens, full.capacity_tokens),
        ] {
            assert!(got.is_none() || got == want, "cut at {cut}: {got:?}");
        }
    }
    assert!(successes > 100);
    for (cut, _) in SGLANG_DOC.char_indices() {
        if let Some(Ok(m)) = SGLANG_DOC.get(..cut).map(parse) {
            assert!(m.running.is_none() || m.running == Some(7.0));
            assert!(m.capacity_tokens.is_none() || m.capacity_tokens == Some(146_368));
        }
    }
}

#[test]
fn malformed_lines_are_skipped_one_by_one() {
    for bad in [
        "vllm:num_requests_running\n",
        "vllm:num_requests_running \n",
        "vllm:num_requests_running{engine=\"0\"}\n",
        "vllm:num_requests_running{engine=\"0\" 3\n",
        "vllm:num_requests_running{engine=\"0} 3\n",
        "vllm:num_requests_running{engine=0} 3\n",
        "vllm:num_requests_running{engine=\"0\"\"} 3\n",
        "vllm:num_requests_running{engine=\"0\" model_name=\"m\"} 3\n",
        "vllm:num_requests_running{=\"0\"} 3\n",
        "vllm:num_requests_running{0engine=\"0\"} 3\n",
        "vllm:num_requests_running{\"vllm.name\"} 3\n",
        "vllm:num_requests_running{engine=\"\\\"} 3\n",
        "vllm:num_requests_running{engine=\"0\\",
        "vllm:num_requests_running-3\n",
        "vllm:num_requests_running3 3\n",
        "vllm:num_requests_running three\n",
        "vllm:num_requests_running 3 4 5\n",
        "vllm:num_requests_running 0x10\n",
        "vllm:num_requests_running 1_000\n",
        "vllm:num_requests_running{engine=\"0\"}} 3\n",
        "vllm:num_requests_running}{ 3\n",
        "{__name__=\"vllm:num_requests_running\"} 3\n",
        "VLLM:NUM_REQUESTS_RUNNING 3\n",
    ] {
        assert_eq!(parse(bad), Err(MetricsError::NoKnownMetrics), "{bad:?}");
        let doc = format!("vllm:num_requests_waiting 1\n{bad}\nvllm:num_requests_running 4\n");
        let m = ok(&doc);
        assert_eq!((m.waiting, m.running), (Some(1.0), Some(4.0)), "{bad:?}");
    }
}

#[test]
fn garbage_is_refused_without_panicking() {
    for junk in [
        "",
        "\n",
        "\r\n\r\n",
        "# HELP vllm:num_requests_running only metadata\n# TYPE vllm:num_requests_running gauge\n",
        "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
        "{\"detail\":\"Not Found\"}\n",
        "vllm:prompt_tokens_total{engine=\"0\"} 12\nprocess_cpu_seconds_total 4.5\n",
        "\u{0}\u{1}\u{2}vllm:\u{7f}\n",
        "{{{{}}}}\"\"\"\\\\\\\n",
        "vllm:\nsglang:\n:\n{\n}\n=\n\"\n",
    ] {
        assert_eq!(parse(junk), Err(MetricsError::NoKnownMetrics), "{junk:?}");
    }
}

#[test]
fn pseudo_random_input_never_panics_or_invents_values() {
    const PIECES: &[&str] = &[
        "vllm:num_requests_running",
        "sglang:num_queue_reqs",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "sglang:max_total_num_tokens",
        "{",
        "}",
        "engine=",
        "\"",
        "\\",
        ",",
        " ",
        "\t",
        "\n",
        "\r",
        "#",
        " EOF",
        "1",
        "-2",
        "0.5",
        "NaN",
        "+Inf",
        "e",
        "block_size=\"16\"",
        "num_gpu_blocks=\"9\"",
        "ü",
        "✓",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut doc = String::new();
    for _ in 0..3_000 {
        doc.clear();
        let len = next() % 60;
        for _ in 0..len {
            doc.push_str(PIECES[(next() % PIECES.len() as u64) as usize]);
        }
        if let Ok(m) = parse(&doc) {
            assert_ne!(m.engine, Engine::Unknown);
            for v in [
                m.running,
                m.waiting,
                m.prefix_cache_hits,
                m.prefix_cache_queries,
            ]
            .into_iter()
            .flatten()
            {
                assert!(v.is_finite() && v >= 0.0, "{doc:?}");
            }
            if let Some(kv) = m.kv_usage {
                assert!((0.0..=1.0).contains(&kv), "{doc:?}");
            }
            for v in [m.block_size, m.num_gpu_blocks, m.capacity_tokens]
                .into_iter()
                .flatten()
            {
                assert!(v >= 1, "{doc:?}");
            }
        }
        let _ = parse_bytes(doc.as_bytes());
    }
}

#[test]
fn mixed_engines_are_refused() {
    let doc = "vllm:num_requests_running 1\nsglang:num_running_reqs 2\n";
    assert_eq!(parse(doc), Err(MetricsError::MixedEngines));
}

#[test]
fn bytes_must_be_utf8() {
    assert_eq!(parse_bytes(VLLM_DOC.as_bytes()), parse(VLLM_DOC));
    let mut body = VLLM_DOC.as_bytes().to_vec();
    body.extend_from_slice(b"vllm:num_requests_running{model_name=\"\xff\xfe\"} 1\n");
    assert_eq!(parse_bytes(&body), Err(MetricsError::InvalidUtf8));
    assert_eq!(parse_bytes(b"\xc3"), Err(MetricsError::InvalidUtf8));
    assert_eq!(parse_bytes(b""), Err(MetricsError::NoKnownMetrics));
}

#[test]
fn overlong_lines_are_skipped() {
    let long = format!(
        "vllm:num_requests_running{{model_name=\"{}\"}} 9\n",
        "x".repeat(MAX_LINE_BYTES)
    );
    assert_eq!(parse(&long), Err(MetricsError::NoKnownMetrics));
    let doc = format!("{long}vllm:num_requests_running 2\n");
    assert_eq!(running_of(&doc), Some(2.0));
    // A line right at the limit is still read.
    let head = "vllm:num_requests_running{model_name=\"";
    let tail = "\"} 5";
    let fill = MAX_LINE_BYTES - head.len() - tail.len();
    let doc = format!("{head}{}{tail}\n", "y".repeat(fill));
    assert_eq!(running_of(&doc), Some(5.0));
}

#[test]
fn line_limit() {
    let filler = "process_cpu_seconds_total 1\n".repeat(MAX_LINES - 1);
    let doc = format!("{filler}vllm:num_requests_running 3\n");
    assert_eq!(running_of(&doc), Some(3.0));
    let doc = format!("{filler}\nvllm:num_requests_running 3\n");
    assert_eq!(parse(&doc), Err(MetricsError::TooManyLines));
    let blank = "\n".repeat(MAX_LINES + 1);
    assert_eq!(parse(&blank), Err(MetricsError::TooManyLines));
}

#[test]
fn too_many_engines_is_unknown() {
    let mut doc = String::new();
    for e in 0..=MAX_GROUPS {
        doc.push_str(&format!("vllm:num_requests_running{{engine=\"{e}\"}} 1\n"));
    }
    doc.push_str("vllm:num_requests_waiting 0\n");
    let m = ok(&doc);
    assert_eq!((m.running, m.waiting), (None, Some(0.0)));
    let mut doc = String::new();
    for e in 0..MAX_GROUPS {
        doc.push_str(&format!("vllm:num_requests_running{{engine=\"{e}\"}} 1\n"));
    }
    assert_eq!(running_of(&doc), Some(MAX_GROUPS as f64));
}

#[test]
fn errors_read_as_sentences() {
    assert_eq!(
        MetricsError::InvalidUtf8.to_string(),
        "metrics body is not valid UTF-8"
    );
    assert_eq!(PodMetrics::default().engine, Engine::Unknown);
}

#[test]
fn the_adapter_state_is_the_newest_lora_series_with_its_names_unescaped() {
    let body = concat!(
        "# TYPE vllm:lora_requests_info gauge\n",
        "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 1.7e9\n",
        "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"b\",running_lora_adapters=\"a\\\"q\\\\,c d\"} 1.8e9\n",
        "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"x\",running_lora_adapters=\"y\"} 1.75e9\n",
    );
    let info = super::lora_info(body.as_bytes()).unwrap();
    assert_eq!(
        (info.max_lora, info.running.as_str(), info.waiting.as_str()),
        (4, "a\"q\\,c d", "b")
    );
    assert_eq!(super::lora_info(b"vllm:num_requests_running 1\n"), None);
    assert_eq!(super::lora_info(b"\xff\xfe"), None);
}

#[test]
fn inter_token_latency_totals_prefer_the_current_name_and_sum_engines() {
    let itl = |text: &str| ok(text).itl;
    let current = concat!(
        "vllm:inter_token_latency_seconds_bucket{engine=\"0\",le=\"0.01\"} 90\n",
        "vllm:inter_token_latency_seconds_sum{engine=\"0\"} 1.5\n",
        "vllm:inter_token_latency_seconds_count{engine=\"0\"} 100\n",
        "vllm:inter_token_latency_seconds_sum{engine=\"1\"} 0.5\n",
        "vllm:inter_token_latency_seconds_count{engine=\"1\"} 50\n",
    );
    assert_eq!(
        itl(current),
        Some(ItlTotals {
            sum_s: 2.0,
            count: 150.0
        })
    );
    let old = concat!(
        "vllm:time_per_output_token_seconds_sum 3\n",
        "vllm:time_per_output_token_seconds_count 60\n",
    );
    assert_eq!(
        itl(old),
        Some(ItlTotals {
            sum_s: 3.0,
            count: 60.0
        })
    );
    // Both names: the current one, never a sum of one with the other's count.
    let both = format!("{old}vllm:inter_token_latency_seconds_count 10\nvllm:inter_token_latency_seconds_sum 0.1\n");
    assert_eq!(
        itl(&both),
        Some(ItlTotals {
            sum_s: 0.1,
            count: 10.0
        })
    );
    // A count without its sum, or a negative total, is unknown.
    assert_eq!(itl("vllm:inter_token_latency_seconds_count 10\n"), None);
    assert_eq!(
        itl("vllm:inter_token_latency_seconds_sum -1\nvllm:inter_token_latency_seconds_count 10\n"),
        None
    );
}

#[test]
fn finished_answers_are_summed_over_engines_under_their_one_model() {
    let answers = |text: &str| ok(text).answers;
    let model = crate::hash::fnv1a(b"m");
    let vllm = concat!(
        "vllm:request_generation_tokens_bucket{model_name=\"m\",engine=\"0\",le=\"500.0\"} 9\n",
        "vllm:request_generation_tokens_sum{model_name=\"m\",engine=\"0\"} 5000\n",
        "vllm:request_generation_tokens_count{model_name=\"m\",engine=\"0\"} 10\n",
        "vllm:request_generation_tokens_sum{model_name=\"m\",engine=\"1\"} 1000\n",
        "vllm:request_generation_tokens_count{model_name=\"m\",engine=\"1\"} 2\n",
    );
    assert_eq!(
        answers(vllm),
        Some(AnswerTotals {
            model,
            tokens: 6000.0,
            count: 12.0
        })
    );
    // SGLang's counters, which its tokenizer adds to as each request ends.
    let sglang = "sglang:token_usage{model_name=\"m\"} 0.5\n\
                  sglang:generation_tokens_total{model_name=\"m\"} 900\n\
                  sglang:num_requests_total{model_name=\"m\"} 3\n";
    assert_eq!(
        answers(sglang),
        Some(AnswerTotals {
            model,
            tokens: 900.0,
            count: 3.0
        })
    );
    // Two models' answers on one pod, a series without its model, a count without its sum, or
    // a negative total: whose answers, or how long, is unknown.
    let two = format!(
        "{vllm}vllm:request_generation_tokens_sum{{model_name=\"n\",engine=\"0\"}} 1\n\
         vllm:request_generation_tokens_count{{model_name=\"n\",engine=\"0\"}} 1\n"
    );
    assert_eq!(answers(&two), None);
    let unnamed = "vllm:request_generation_tokens_sum 10\nvllm:request_generation_tokens_count 1\n";
    assert_eq!(answers(unnamed), None);
    assert_eq!(
        answers("vllm:request_generation_tokens_count{model_name=\"m\"} 10\n"),
        None
    );
    assert_eq!(
        answers(
            "vllm:request_generation_tokens_sum{model_name=\"m\"} -1\n\
             vllm:request_generation_tokens_count{model_name=\"m\"} 10\n"
        ),
        None
    );
}
