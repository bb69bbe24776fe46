//! Command-line flags.

use clap::Parser;

use crate::engine::{EngineConfig, TimingModel};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvgate-sim",
    version,
    about = "vLLM-compatible model-server simulator: V1 scheduler, paged KV cache with \
             prefix caching, calibrated step-time model; one process serves several pods"
)]
pub struct Args {
    /// Number of pods (each a separate engine: own KV cache, queue, metrics).
    #[arg(long, default_value_t = 1)]
    pub pods: usize,
    /// Port of pod 0; pod i listens on base-port + i.
    #[arg(long, default_value_t = 8000)]
    pub base_port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Model path reported by /v1/models, /server_info, /model_info.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    pub model: String,
    /// Names accepted in the request's `model` field (repeatable or
    /// comma-separated); defaults to --model. Others get vLLM's 404.
    #[arg(long, value_delimiter = ',')]
    pub served_model_name: Vec<String>,
    /// Accept any `model` name (echoed back) instead of vLLM's 404.
    #[arg(long)]
    pub any_model: bool,
    /// BPE encoding used to count tokens: o200k_base or cl100k_base.
    #[arg(long, default_value = "o200k_base")]
    pub tokenizer: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per pod.
    #[arg(long, default_value_t = 2048)]
    pub num_gpu_blocks: usize,
    /// Maximum number of running (scheduled) sequences per pod.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step (chunked prefill splits longer prompts).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Maximum prompt + output length.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: usize,
    /// Disable automatic prefix caching.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Fixed cost of every engine step, milliseconds.
    #[arg(long, default_value_t = 6.0)]
    pub step_overhead_ms: f64,
    /// Cost per prefill token computed in a step, microseconds.
    #[arg(long, default_value_t = 30.0)]
    pub prefill_us_per_token: f64,
    /// Cost per decoding sequence in a step, microseconds.
    #[arg(long, default_value_t = 30.0)]
    pub decode_us_per_seq: f64,
    /// Cost per context token read by a decoding sequence, nanoseconds.
    #[arg(long, default_value_t = 50.0)]
    pub decode_ns_per_ctx_token: f64,
    /// Prefill attention cost per (new token x attended token) pair, nanoseconds.
    #[arg(long, default_value_t = 1.3)]
    pub prefill_ns_per_attn_pair: f64,
    /// Run the simulated clock this many times faster than wall time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Output length distribution when max_tokens is not given: lognormal, uniform, fixed.
    #[arg(long, default_value = "lognormal")]
    pub output_len_dist: String,
    /// Mean output length (tokens) of that distribution.
    #[arg(long, default_value_t = 256.0)]
    pub output_len_mean: f64,
    /// Sigma of the underlying normal for the lognormal distribution.
    #[arg(long, default_value_t = 0.8)]
    pub output_len_sigma: f64,
    /// RNG seed (pod i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens counted for each non-text content part (image, audio, ...).
    #[arg(long, default_value_t = 576)]
    pub media_part_tokens: usize,
    /// Shape of GET /get_load: "list" (current SGLang: per-DP-rank objects with
    /// num_tokens) or "legacy" ({"load": N}, older SGLang / sglang-router).
    #[arg(long, default_value = "list")]
    pub get_load_format: String,
}

impl Args {
    pub fn validate(&self) -> Result<(), String> {
        if self.pods == 0 {
            return Err("--pods must be at least 1".into());
        }
        if usize::from(self.base_port) + self.pods > 65536 {
            return Err("--base-port + --pods exceeds the port range".into());
        }
        if self.block_size == 0 || self.num_gpu_blocks == 0 {
            return Err("--block-size and --num-gpu-blocks must be positive".into());
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 || self.max_model_len < 2 {
            return Err("--max-num-seqs, --max-num-batched-tokens must be positive and --max-model-len >= 2".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err("--time-scale must be a positive number".into());
        }
        for (name, v) in [
            ("--step-overhead-ms", self.step_overhead_ms),
            ("--prefill-us-per-token", self.prefill_us_per_token),
            ("--decode-us-per-seq", self.decode_us_per_seq),
            ("--decode-ns-per-ctx-token", self.decode_ns_per_ctx_token),
            ("--prefill-ns-per-attn-pair", self.prefill_ns_per_attn_pair),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a non-negative number"));
            }
        }
        if !matches!(
            self.output_len_dist.as_str(),
            "lognormal" | "uniform" | "fixed"
        ) {
            return Err("--output-len-dist must be lognormal, uniform or fixed".into());
        }
        if !(self.output_len_mean.is_finite() && self.output_len_mean >= 1.0) {
            return Err("--output-len-mean must be >= 1".into());
        }
        if !(self.output_len_sigma.is_finite() && self.output_len_sigma >= 0.0) {
            return Err("--output-len-sigma must be >= 0".into());
        }
        if !matches!(self.get_load_format.as_str(), "list" | "legacy") {
            return Err("--get-load-format must be list or legacy".into());
        }
        Ok(())
    }

    pub fn served_names(&self) -> Vec<String> {
        let names: Vec<String> = self
            .served_model_name
            .iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if names.is_empty() {
            vec![self.model.clone()]
        } else {
            names
        }
    }

    pub fn timing(&self) -> TimingModel {
        TimingModel {
            step_overhead: self.step_overhead_ms * 1e-3,
            prefill_token: self.prefill_us_per_token * 1e-6,
            decode_seq: self.decode_us_per_seq * 1e-6,
            decode_ctx_token: self.decode_ns_per_ctx_token * 1e-9,
            prefill_attn_pair: self.prefill_ns_per_attn_pair * 1e-9,
        }
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            timing: self.timing(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_documented_values() {
        let a = Args::parse_from(["kvgate-sim"]);
        a.validate().unwrap();
        let (t, d) = (a.timing(), TimingModel::default());
        for (x, y) in [
            (t.step_overhead, d.step_overhead),
            (t.prefill_token, d.prefill_token),
            (t.decode_seq, d.decode_seq),
            (t.decode_ctx_token, d.decode_ctx_token),
            (t.prefill_attn_pair, d.prefill_attn_pair),
        ] {
            assert!((x - y).abs() <= 1e-12 * y.abs().max(1e-12), "{x} vs {y}");
        }
        let e = a.engine_config();
        assert_eq!(
            (e.block_size, e.num_gpu_blocks, e.max_num_seqs),
            (16, 2048, 256)
        );
        assert_eq!((e.max_num_batched_tokens, e.max_model_len), (8192, 32768));
        assert!(e.enable_prefix_caching);
        assert_eq!(
            a.served_names(),
            vec!["meta-llama/Llama-3.1-8B-Instruct".to_string()]
        );
    }

    #[test]
    fn served_names_split_on_commas() {
        let a = Args::parse_from([
            "kvgate-sim",
            "--served-model-name",
            "a,b",
            "--served-model-name",
            "c",
        ]);
        assert_eq!(a.served_names(), vec!["a", "b", "c"]);
        let bad = Args::parse_from(["kvgate-sim", "--time-scale", "0"]);
        assert!(bad.validate().is_err());
    }
}
