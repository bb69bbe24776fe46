//! What one scrape says about a pod, and why a body said nothing.

use core::fmt;

/// Which model server produced the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    Vllm,
    Sglang,
    /// Never returned by [`super::parse`]; the state of a pod not yet scraped successfully.
    #[default]
    Unknown,
}

/// What kvgate knows about one pod after a scrape. `None` means unknown, never zero.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodMetrics {
    pub engine: Engine,
    /// Requests in the running batch, summed over the pod's engines.
    pub running: Option<f64>,
    /// Requests queued, summed over the pod's engines.
    pub waiting: Option<f64>,
    /// KV-cache usage, 0..=1, of the fullest engine.
    pub kv_usage: Option<f64>,
    /// Tokens per KV block (vLLM `block_size`, SGLang `page_size`); `None` if engines disagree.
    pub block_size: Option<u64>,
    /// KV blocks (vLLM `num_gpu_blocks`, SGLang `num_pages`), summed over the pod's engines.
    pub num_gpu_blocks: Option<u64>,
    /// KV capacity in tokens, summed over the pod's engines.
    pub capacity_tokens: Option<u64>,
    /// Prefix-cache hits in tokens since start (vLLM's hits, SGLang's cached tokens: counters),
    /// summed over engines.
    pub prefix_cache_hits: Option<f64>,
    /// Prefix-cache queries in tokens since start (vLLM's queries, SGLang's prompt tokens:
    /// counters), summed over engines.
    pub prefix_cache_queries: Option<f64>,
    /// Preemptions since start (vLLM's preemptions, SGLang's retractions: counters), summed over
    /// engines.
    pub preemptions: Option<f64>,
    /// vLLM's `cache_config_info` says `enable_prefix_caching="False"` for one of the pod's
    /// engines: a prompt it served once is not cached there, and sequences share no blocks.
    pub no_prefix_caching: bool,
    /// The engine's inter-token latency histogram since start, summed over engines.
    pub itl: Option<ItlTotals>,
    /// The answers the engine has finished since start, summed over engines.
    pub answers: Option<AnswerTotals>,
}

/// A latency histogram's running totals: seconds summed and samples counted since the engine
/// started. Two scrapes' difference is the mean over the interval (`pods::pace`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ItlTotals {
    pub sum_s: f64,
    pub count: f64,
}

/// What the engine's finished answers ran to since it started: vLLM's `request_generation_tokens`
/// histogram (`_sum`, `_count`), SGLang's generated tokens and requests (counted as each ends).
/// Their mean is how long the model's answers run on this fleet (`estimate::engine_lengths`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AnswerTotals {
    /// The model the series are labelled with, by its name's hash (`hash::fnv1a`).
    pub model: u64,
    pub tokens: f64,
    pub count: f64,
}

/// vLLM's `vllm:lora_requests_info` as last set: adapter slots and the adapters (names joined by
/// commas, as vLLM labels them) running and waiting for a slot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraInfo {
    pub max_lora: u32,
    pub running: String,
    pub waiting: String,
}

/// Why a body yielded no metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsError {
    /// The body is not UTF-8, which the exposition format requires.
    InvalidUtf8,
    /// No line carried a metric kvgate reads: not a vLLM or SGLang endpoint, metrics disabled
    /// (`--disable-log-stats`, SGLang without `--enable-metrics`), or an error page.
    NoKnownMetrics,
    /// Both vLLM and SGLang metrics appeared; which engine's numbers describe the pod is unknown.
    MixedEngines,
    /// More than [`super::exposition::MAX_LINES`] lines.
    TooManyLines,
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidUtf8 => "metrics body is not valid UTF-8",
            Self::NoKnownMetrics => "metrics body has no vLLM or SGLang metric kvgate reads",
            Self::MixedEngines => "metrics body mixes vLLM and SGLang metrics",
            Self::TooManyLines => "metrics body exceeds the line limit",
        })
    }
}

impl std::error::Error for MetricsError {}
