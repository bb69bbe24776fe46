//! Which series kvgate reads, by what they mean rather than by engine (`classify`), and the labels
//! of a sample that matter: those naming a distinct engine of the pod (`Labels::engine_key`) or a
//! part of its counter (`Labels::part_key`), the priority breakdown to skip, and the cache
//! settings an info gauge carries.

use super::figures::Engine;
use crate::hash::fnv1a_from;

/// The metrics kvgate reads, by what they mean rather than by engine.
#[derive(Clone, Copy)]
pub(super) enum Metric {
    Running,
    Waiting,
    KvUsage,
    /// vLLM's pre-0.9 name for the same gauge, read only when the current one is absent.
    KvUsageLegacy,
    CacheInfo,
    PageSize,
    NumPages,
    MaxTotalTokens,
    /// Name variant, in order of preference: `_total`, bare, legacy `_total`, legacy bare.
    PrefixHits(usize),
    PrefixQueries(usize),
    /// Name variant: `_total`, bare.
    Preemptions(usize),
    /// The inter-token latency histogram's `_sum` and `_count`; name variant: vLLM's
    /// `inter_token_latency_seconds`, then its older `time_per_output_token_seconds`.
    ItlSum(usize),
    ItlCount(usize),
    /// The tokens the engine's finished answers generated, and how many answers: vLLM's
    /// `request_generation_tokens` histogram's `_sum` and `_count`; SGLang's counters, which its
    /// tokenizer adds to as each request ends. Kept by model (`Labels::model_name`).
    AnswerTokens,
    Answers,
}

pub(super) fn classify(name: &str) -> Option<(Engine, Metric)> {
    use Engine::{Sglang, Vllm};
    use Metric::*;
    Some(match name {
        "vllm:num_requests_running" => (Vllm, Running),
        "vllm:num_requests_waiting" => (Vllm, Waiting),
        "vllm:kv_cache_usage_perc" => (Vllm, KvUsage),
        "vllm:gpu_cache_usage_perc" => (Vllm, KvUsageLegacy),
        "vllm:cache_config_info" => (Vllm, CacheInfo),
        // Counters are exposed with `_total`; a bare name comes only from non-Python exporters.
        // vLLM 0.8 called them `gpu_prefix_cache_*`.
        "vllm:prefix_cache_hits_total" => (Vllm, PrefixHits(0)),
        "vllm:prefix_cache_hits" => (Vllm, PrefixHits(1)),
        "vllm:gpu_prefix_cache_hits_total" => (Vllm, PrefixHits(2)),
        "vllm:gpu_prefix_cache_hits" => (Vllm, PrefixHits(3)),
        "vllm:prefix_cache_queries_total" => (Vllm, PrefixQueries(0)),
        "vllm:prefix_cache_queries" => (Vllm, PrefixQueries(1)),
        "vllm:gpu_prefix_cache_queries_total" => (Vllm, PrefixQueries(2)),
        "vllm:gpu_prefix_cache_queries" => (Vllm, PrefixQueries(3)),
        "vllm:num_preemptions_total" => (Vllm, Preemptions(0)),
        "vllm:num_preemptions" => (Vllm, Preemptions(1)),
        "vllm:inter_token_latency_seconds_sum" => (Vllm, ItlSum(0)),
        "vllm:inter_token_latency_seconds_count" => (Vllm, ItlCount(0)),
        "vllm:time_per_output_token_seconds_sum" => (Vllm, ItlSum(1)),
        "vllm:time_per_output_token_seconds_count" => (Vllm, ItlCount(1)),
        "vllm:request_generation_tokens_sum" => (Vllm, AnswerTokens),
        "vllm:request_generation_tokens_count" => (Vllm, Answers),
        "sglang:num_running_reqs" => (Sglang, Running),
        "sglang:num_queue_reqs" => (Sglang, Waiting),
        "sglang:token_usage" => (Sglang, KvUsage),
        "sglang:cache_config_info" => (Sglang, CacheInfo),
        "sglang:page_size" => (Sglang, PageSize),
        "sglang:num_pages" => (Sglang, NumPages),
        "sglang:max_total_num_tokens" => (Sglang, MaxTotalTokens),
        // SGLang counts each request's prompt tokens and those it found cached when the request
        // ends (its `TokenizerMetricsCollector`): over an interval, the same hit rate as vLLM's
        // hits over queries. The cached tokens are one series per `cache_source` (device, host,
        // storage), each a hit: they are added up (`Labels::part_key`).
        "sglang:cached_tokens_total" => (Sglang, PrefixHits(0)),
        "sglang:prompt_tokens_total" => (Sglang, PrefixQueries(0)),
        // A retraction is SGLang's preemption: a running request sent back to the queue when
        // the KV pool runs out mid-decode. The counter is recent; before it, a gauge carried
        // the running total.
        "sglang:num_retracted_requests_total" => (Sglang, Preemptions(0)),
        "sglang:total_retracted_reqs" => (Sglang, Preemptions(1)),
        "sglang:inter_token_latency_seconds_sum" => (Sglang, ItlSum(0)),
        "sglang:inter_token_latency_seconds_count" => (Sglang, ItlCount(0)),
        "sglang:time_per_output_token_seconds_sum" => (Sglang, ItlSum(1)),
        "sglang:time_per_output_token_seconds_count" => (Sglang, ItlCount(1)),
        "sglang:generation_tokens_total" => (Sglang, AnswerTokens),
        "sglang:num_requests_total" => (Sglang, Answers),
        _ => return None,
    })
}

/// The labels of one sample that matter here, as raw (still escaped) slices of the line: the
/// numbers kvgate reads never contain escapes, and identity only needs consistent bytes.
#[derive(Default)]
pub(super) struct Labels<'a> {
    pub(super) model_name: Option<&'a str>,
    pub(super) name: Option<&'a str>,
    pub(super) engine: Option<&'a str>,
    pub(super) dp_rank: Option<&'a str>,
    pub(super) priority: Option<&'a str>,
    pub(super) block_size: Option<&'a str>,
    pub(super) num_gpu_blocks: Option<&'a str>,
    pub(super) kv_cache_size_tokens: Option<&'a str>,
    pub(super) page_size: Option<&'a str>,
    pub(super) num_pages: Option<&'a str>,
    pub(super) max_total_num_tokens: Option<&'a str>,
    pub(super) enable_prefix_caching: Option<&'a str>,
    pub(super) max_lora: Option<&'a str>,
    pub(super) running_lora_adapters: Option<&'a str>,
    pub(super) waiting_lora_adapters: Option<&'a str>,
    pub(super) cache_source: Option<&'a str>,
}

impl<'a> Labels<'a> {
    pub(super) fn record(&mut self, key: &'a str, value: &'a str) {
        let slot = match key {
            "model_name" => &mut self.model_name,
            "name" => &mut self.name,
            "engine" => &mut self.engine,
            "dp_rank" => &mut self.dp_rank,
            "priority" => &mut self.priority,
            "block_size" => &mut self.block_size,
            "num_gpu_blocks" => &mut self.num_gpu_blocks,
            "kv_cache_size_tokens" => &mut self.kv_cache_size_tokens,
            "page_size" => &mut self.page_size,
            "num_pages" => &mut self.num_pages,
            "max_total_num_tokens" => &mut self.max_total_num_tokens,
            "enable_prefix_caching" => &mut self.enable_prefix_caching,
            "max_lora" => &mut self.max_lora,
            "running_lora_adapters" => &mut self.running_lora_adapters,
            "waiting_lora_adapters" => &mut self.waiting_lora_adapters,
            "cache_source" => &mut self.cache_source,
            _ => return,
        };
        *slot = Some(value);
    }

    /// Which engine of the pod a series belongs to. Presence is hashed apart from value so
    /// `engine=""` and no `engine` label stay distinct; 0xff never occurs in UTF-8, so it
    /// separates values unambiguously.
    pub(super) fn engine_key(&self) -> u64 {
        [self.model_name, self.name, self.engine, self.dp_rank]
            .iter()
            .fold(0xcbf2_9ce4_8422_2325, |h, v| match v {
                Some(v) => fnv1a_from(fnv1a_from(h, &[1]), v.as_bytes()),
                None => fnv1a_from(h, &[0, 0xff]),
            })
    }

    /// Which part of one engine's counter a series is: the engine, and the source of the hits
    /// SGLang counts apart (a part per source, added up where each engine's series would be
    /// taken at their largest).
    pub(super) fn part_key(&self) -> u64 {
        match self.cache_source {
            Some(source) => fnv1a_from(fnv1a_from(self.engine_key(), &[2]), source.as_bytes()),
            None => self.engine_key(),
        }
    }
}
