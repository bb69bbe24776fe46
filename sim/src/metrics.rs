//! Prometheus text exposition with vLLM's (V1) metric names, types, labels and
//! histogram buckets.

use std::fmt::Write;

use crate::engine::Counters;

/// vLLM V1 `time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM V1 request latency buckets (`e2e_request_latency_seconds`).
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM V1 `request_generation_tokens` buckets: its `build_1_2_5_buckets` up to the model's
/// context (the simulator's longest answer is the output cap's 2^16 at most).
pub const GENERATION_TOKENS_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];
/// vLLM V1 `inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }
}

/// Python-style float text (`1.0`, `0.25`, `+Inf`) as prometheus_client prints.
pub fn fmt_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Most `vllm:lora_requests_info` series kept; the oldest goes first. vLLM
/// keeps every label set it ever set (unbounded); the cap keeps a long
/// benchmark's scrape small.
const LORA_INFO_MAX_SERIES: usize = 256;

/// `vllm:lora_requests_info`: after every step vLLM sets the gauge of the
/// current (running, waiting) label set to the current Unix time
/// (`set_to_current_time` in `vllm/v1/metrics/loggers.py`), and
/// prometheus_client keeps the label sets set before, so the current state is
/// the series with the largest value.
#[derive(Debug, Clone)]
pub struct LoraInfo {
    /// (running_lora_adapters, waiting_lora_adapters, time set), first set first.
    series: Vec<(String, String, f64)>,
}

impl LoraInfo {
    /// Starts with the idle series set at `start_unix`.
    pub fn new(start_unix: f64) -> Self {
        LoraInfo {
            series: vec![(String::new(), String::new(), start_unix)],
        }
    }

    pub fn set(&mut self, running: String, waiting: String, now_unix: f64) {
        if let Some(s) = self
            .series
            .iter_mut()
            .find(|s| s.0 == running && s.1 == waiting)
        {
            s.2 = now_unix;
            return;
        }
        if self.series.len() >= LORA_INFO_MAX_SERIES {
            let oldest = self
                .series
                .iter()
                .enumerate()
                .min_by(|a, b| a.1 .2.total_cmp(&b.1 .2))
                .map_or(0, |(i, _)| i);
            self.series.remove(oldest);
        }
        self.series.push((running, waiting, now_unix));
    }
}

pub struct MetricsInput<'a> {
    pub model_name: &'a str,
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub enable_prefix_caching: bool,
    pub counters: &'a Counters,
    pub ttft: &'a Histogram,
    pub e2e: &'a Histogram,
    pub itl: &'a Histogram,
    /// Each finished answer's generated tokens (vLLM's `request_generation_tokens`).
    pub generation: &'a Histogram,
    /// `--max-loras` (0 without LoRA).
    pub max_lora: usize,
    pub lora_info: &'a LoraInfo,
    /// `--metrics-flavor sglang`: SGLang's names instead of vLLM's (`render_sglang`).
    pub sglang: bool,
}

struct Out {
    s: String,
    labels: String,
}

impl Out {
    fn header(&mut self, name: &str, help: &str, ty: &str) {
        let _ = writeln!(self.s, "# HELP {name} {help}");
        let _ = writeln!(self.s, "# TYPE {name} {ty}");
    }
    fn sample(&mut self, name: &str, extra: &str, v: f64) {
        let sep = if extra.is_empty() { "" } else { "," };
        let _ = writeln!(
            self.s,
            "{name}{{{}{sep}{extra}}} {}",
            self.labels,
            fmt_f64(v)
        );
    }
    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.header(name, help, "gauge");
        self.sample(name, "", v);
    }
    fn counter(&mut self, name: &str, help: &str, v: f64) {
        self.header(name, help, "counter");
        self.sample(name, "", v);
    }
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        for (i, b) in h.bounds.iter().enumerate() {
            self.sample(
                &bucket,
                &format!("le=\"{}\"", fmt_f64(*b)),
                h.counts[i] as f64,
            );
        }
        self.sample(&bucket, "le=\"+Inf\"", h.count as f64);
        self.sample(&format!("{name}_count"), "", h.count as f64);
        self.sample(&format!("{name}_sum"), "", h.sum);
    }
}

pub fn render(m: &MetricsInput<'_>) -> String {
    if m.sglang {
        return render_sglang(m);
    }
    let mut o = Out {
        s: String::with_capacity(8192),
        labels: format!("model_name=\"{}\",engine=\"0\"", escape(m.model_name)),
    };
    let c = m.counters;

    o.header(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    let info = format!(
        "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",\
enable_prefix_caching=\"{}\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",\
num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",num_gpu_blocks_override=\"None\",\
prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space=\"4\",engine=\"0\"}} 1.0",
        m.block_size,
        if m.enable_prefix_caching { "True" } else { "False" },
        m.num_gpu_blocks
    );
    let _ = writeln!(o.s, "{info}");

    o.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        m.running as f64,
    );
    o.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        m.waiting as f64,
    );
    o.header(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        "gauge",
    );
    // Label order as vLLM declares them; no model_name/engine labels.
    for (running, waiting, at) in &m.lora_info.series {
        let _ = writeln!(
            o.s,
            "vllm:lora_requests_info{{max_lora=\"{}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {}",
            m.max_lora,
            escape(waiting),
            escape(running),
            fmt_f64(*at)
        );
    }
    o.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        m.kv_usage,
    );
    o.gauge(
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        m.kv_usage,
    );
    o.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        c.prefix_queries as f64,
    );
    o.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        c.prefix_hits as f64,
    );
    o.counter(
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        c.preemptions as f64,
    );
    o.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        c.prompt_tokens as f64,
    );
    o.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        c.generation_tokens as f64,
    );
    o.header(
        "vllm:request_success_total",
        "Count of successfully processed requests.",
        "counter",
    );
    for (reason, v) in [
        ("stop", c.finished_stop),
        ("length", c.finished_length),
        ("abort", c.finished_abort),
    ] {
        o.sample(
            "vllm:request_success_total",
            &format!("finished_reason=\"{reason}\""),
            v as f64,
        );
    }
    o.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        m.ttft,
    );
    o.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        m.itl,
    );
    o.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        m.e2e,
    );
    o.histogram(
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        m.generation,
    );
    o.s
}

/// The same pod as SGLang exposes it (`--enable-metrics`): its scheduler's gauges, labelled by
/// engine type and parallel ranks, KV in tokens (`max_total_num_tokens`, pages of `page_size`),
/// retractions (SGLang's preemptions) as a counter; its tokenizer's counters and histograms,
/// labelled by model only, prompt and cached tokens counted when a request ends.
fn render_sglang(m: &MetricsInput<'_>) -> String {
    let model = escape(m.model_name);
    let mut o = Out {
        s: String::with_capacity(8192),
        labels: format!(
            "engine_type=\"unified\",model_name=\"{model}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\""
        ),
    };
    let c = m.counters;
    let capacity = (m.num_gpu_blocks * m.block_size) as f64;
    o.gauge(
        "sglang:num_running_reqs",
        "The number of running requests.",
        m.running as f64,
    );
    o.gauge(
        "sglang:num_used_tokens",
        "The number of used tokens.",
        (m.kv_usage * capacity).round(),
    );
    o.gauge("sglang:token_usage", "The token usage.", m.kv_usage);
    o.gauge(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        m.waiting as f64,
    );
    let hit_rate = if c.finished_prompt_tokens == 0 {
        0.0
    } else {
        c.finished_cached_tokens as f64 / c.finished_prompt_tokens as f64
    };
    o.gauge(
        "sglang:cache_hit_rate",
        "The prefix cache hit rate.",
        hit_rate,
    );
    o.gauge(
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        capacity,
    );
    o.gauge(
        "sglang:page_size",
        "KV cache page size in tokens.",
        m.block_size as f64,
    );
    o.gauge(
        "sglang:num_pages",
        "Number of KV cache pages.",
        m.num_gpu_blocks as f64,
    );
    o.counter(
        "sglang:num_retracted_requests_total",
        "Total number of retracted requests.",
        c.preemptions as f64,
    );
    o.labels = format!("model_name=\"{model}\"");
    o.counter(
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        c.finished_prompt_tokens as f64,
    );
    // SGLang's tokenizer counts a request's generated tokens when it ends, as it does its
    // prompt tokens: the total over its finished requests.
    o.counter(
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        m.generation.sum(),
    );
    o.header(
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens by source (device/host/storage).",
        "counter",
    );
    o.sample(
        "sglang:cached_tokens_total",
        "cache_source=\"device\"",
        c.finished_cached_tokens as f64,
    );
    o.counter(
        "sglang:num_requests_total",
        "Number of requests processed.",
        (c.finished_stop + c.finished_length) as f64,
    );
    o.histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        m.ttft,
    );
    o.histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        m.itl,
    );
    o.histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        m.e2e,
    );
    o.s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(TTFT_BUCKETS);
        h.observe(0.003);
        h.observe(0.5);
        h.observe(5000.0);
        assert_eq!(h.counts[0], 0);
        assert_eq!(h.counts[1], 1); // <= 0.005
        assert_eq!(h.counts[9], 2); // <= 0.5
        assert_eq!(*h.counts.last().unwrap(), 2);
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn lora_info_keeps_each_label_set_with_the_time_it_was_last_set() {
        let mut l = LoraInfo::new(1.0);
        l.set("a".into(), "b".into(), 2.0);
        l.set(String::new(), String::new(), 3.0);
        l.set("a".into(), "b".into(), 4.0);
        assert_eq!(
            l.series,
            vec![
                (String::new(), String::new(), 3.0),
                ("a".into(), "b".into(), 4.0)
            ]
        );
        for i in 0..LORA_INFO_MAX_SERIES {
            l.set(format!("x{i}"), String::new(), 10.0 + i as f64);
        }
        assert_eq!(l.series.len(), LORA_INFO_MAX_SERIES);
        assert!(
            !l.series.iter().any(|s| s.2 < 10.0),
            "the oldest series go first"
        );
    }

    /// `/metrics` of a pod of 2,048 blocks of 16 tokens, half used, 2 requests running and 3
    /// waiting, with `c`'s counters and empty histograms.
    fn page(c: &Counters, sglang: bool) -> String {
        render(&MetricsInput {
            model_name: "m/x",
            running: 2,
            waiting: 3,
            kv_usage: 0.5,
            block_size: 16,
            num_gpu_blocks: 2048,
            enable_prefix_caching: true,
            counters: c,
            ttft: &Histogram::new(TTFT_BUCKETS),
            e2e: &Histogram::new(E2E_BUCKETS),
            itl: &Histogram::new(ITL_BUCKETS),
            generation: &Histogram::new(GENERATION_TOKENS_BUCKETS),
            max_lora: 0,
            lora_info: &LoraInfo::new(1.0),
            sglang,
        })
    }

    #[test]
    fn text_has_names_types_and_labels() {
        let text = page(&Counters::default(), false);
        assert!(text.contains("# TYPE vllm:num_requests_waiting gauge"));
        assert!(text.contains("vllm:num_requests_waiting{model_name=\"m/x\",engine=\"0\"} 3.0"));
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
        assert!(text.contains("# TYPE vllm:request_generation_tokens histogram"));
        assert!(text
            .contains("vllm:request_generation_tokens_count{model_name=\"m/x\",engine=\"0\"} 0.0"));
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"2048\""));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m/x\",engine=\"0\",le=\"+Inf\"} 0.0"
        ));
        assert!(text.contains(
            "vllm:lora_requests_info{max_lora=\"0\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 1.0"
        ));
        assert_eq!(fmt_f64(0.25), "0.25");
        assert_eq!(fmt_f64(2560.0), "2560.0");
    }

    #[test]
    fn sglang_flavor_names_capacity_in_tokens_and_counts_prompts_at_their_end() {
        let c = Counters {
            preemptions: 3,
            finished_prompt_tokens: 1000,
            finished_cached_tokens: 250,
            prefix_queries: 9999,
            ..Counters::default()
        };
        let text = page(&c, true);
        assert!(!text.contains("vllm:"));
        let sched = "engine_type=\"unified\",model_name=\"m/x\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"";
        for line in [
            format!("sglang:num_queue_reqs{{{sched}}} 3.0"),
            format!("sglang:max_total_num_tokens{{{sched}}} 32768.0"),
            format!("sglang:num_used_tokens{{{sched}}} 16384.0"),
            format!("sglang:num_retracted_requests_total{{{sched}}} 3.0"),
            format!("sglang:cache_hit_rate{{{sched}}} 0.25"),
            "sglang:prompt_tokens_total{model_name=\"m/x\"} 1000.0".to_string(),
            "sglang:cached_tokens_total{model_name=\"m/x\",cache_source=\"device\"} 250.0"
                .to_string(),
            "sglang:inter_token_latency_seconds_count{model_name=\"m/x\"} 0.0".to_string(),
        ] {
            assert!(text.contains(&line), "{line} in\n{text}");
        }
    }
}
