//! Command-line flags.

use clap::Parser;

use crate::engine::{EngineConfig, TimingModel};
use crate::lora::LoraConfig;

/// One `--lora-modules` entry (vLLM's `LoRAModulePath`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
    #[serde(default)]
    pub base_model_name: Option<String>,
}

impl LoraModule {
    /// Parse one value as vLLM's `LoRAParserAction` does: `name=path`, or a
    /// JSON object `{"name", "path", "base_model_name"}` (anything with a comma
    /// or without `=` is taken as JSON).
    pub fn parse(item: &str) -> Result<Self, String> {
        if item.contains('=') && !item.contains(',') {
            return match item.split_once('=') {
                Some((name, path))
                    if !name.is_empty() && !path.is_empty() && !path.contains('=') =>
                {
                    Ok(LoraModule {
                        name: name.to_string(),
                        path: path.to_string(),
                        base_model_name: None,
                    })
                }
                _ => Err(format!("Invalid format for --lora-modules: {item}")),
            };
        }
        let m: LoraModule = serde_json::from_str(item)
            .map_err(|e| format!("Invalid JSON format for --lora-modules: {item} - {e}"))?;
        if m.name.is_empty() || m.path.is_empty() {
            return Err(format!("Invalid fields for --lora-modules: {item}"));
        }
        Ok(m)
    }
}

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
    /// Names accepted in the request's `model` field (`a b` as in vLLM, or
    /// comma-separated, or repeated); defaults to --model. Others get vLLM's 404.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Serve LoRA adapters (--lora-modules, /v1/load_lora_adapter).
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters registered at start: `name=path` or JSON
    /// `{"name": .., "path": .., "base_model_name": ..}`, several per flag.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Most distinct adapters in one batch (GPU adapter slots).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Adapters kept loaded in host memory; defaults to --max-loras.
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Cost of loading an adapter from disk into host memory, milliseconds
    /// (simulated; paid by the step that first needs it).
    #[arg(long, default_value_t = 40.0)]
    pub lora_load_ms: f64,
    /// Cost of copying a host-resident adapter into a GPU slot, milliseconds.
    #[arg(long, default_value_t = 3.0)]
    pub lora_activate_ms: f64,
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
    /// Each pod's KV blocks, one per pod, comma-separated (`2048,2048,512,512`: pods 2 and 3 hold
    /// a quarter of the others' KV, as a smaller GPU or a lower `--gpu-memory-utilization`
    /// would). Default: every pod `--num-gpu-blocks`.
    #[arg(long, value_delimiter = ',')]
    pub pod_blocks: Vec<usize>,
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
    /// Each pod's GPU speed against the step-time model's, one per pod, comma-separated
    /// (`1,1,0.5,0.5`: pods 2 and 3 take twice as long for every step, their prefill and decode
    /// alike, as a slower GPU would). Adapter loads are from disk and host memory and keep
    /// their cost. Default: every pod at 1.
    #[arg(long, value_delimiter = ',')]
    pub pod_speed: Vec<f64>,
    /// Output length distribution when max_tokens is not given: lognormal, uniform, fixed.
    #[arg(long, default_value = "lognormal")]
    pub output_len_dist: String,
    /// Mean output length (tokens) of that distribution.
    #[arg(long, default_value_t = 256.0)]
    pub output_len_mean: f64,
    /// Sigma of the underlying normal for the lognormal distribution.
    #[arg(long, default_value_t = 0.8)]
    pub output_len_sigma: f64,
    /// Tokens per streamed chunk: a stream sends its text N tokens at a time (the last chunk
    /// what is left), as SGLang does with its `--stream-interval` and an engine running
    /// speculative decoding does with the tokens a step accepts; `usage` counts every token.
    #[arg(long, default_value_t = 1)]
    pub stream_interval: usize,
    /// The share of each chat answer that is reasoning, as a reasoning model's behind vLLM's
    /// `--reasoning-parser`: its first tokens stream as `delta.reasoning` (vLLM's name since its
    /// PR 27752) and come back as `message.reasoning`, the rest as content; `usage` counts both.
    #[arg(long, default_value_t = 0.0)]
    pub reasoning_share: f64,
    /// A request with max_tokens also stops at EOS (its length drawn from --output-len-dist,
    /// capped at max_tokens), as real vLLM does unless ignore_eos is set; off, max_tokens is
    /// generated in full (benchmark-style).
    #[arg(long)]
    pub eos_before_max_tokens: bool,
    /// RNG seed (pod i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens counted for each non-text content part (image, audio, ...).
    #[arg(long, default_value_t = 576)]
    pub media_part_tokens: usize,
    /// Length of the vector `/v1/embeddings` answers for a prompt: the model's hidden size
    /// (4096 for an 8B model such as Llama-3.1-8B); a request's `dimensions` may ask for fewer.
    #[arg(long, default_value_t = 4096)]
    pub embedding_size: usize,
    /// Number of classes `/classify` (and `/pooling`'s classify tasks) answers probabilities
    /// for, labelled `LABEL_0` .. `LABEL_<n-1>` as a Hugging Face config without names labels
    /// them; 1 is a one-label model (a sigmoid's score).
    #[arg(long, default_value_t = 2)]
    pub num_classes: usize,
    /// Shape of GET /get_load: "list" (current SGLang: per-DP-rank objects with
    /// num_tokens) or "legacy" ({"load": N}, older SGLang / sglang-router).
    #[arg(long, default_value = "list")]
    pub get_load_format: String,
    /// Which engine's `/metrics` the pods expose: "vllm" (`vllm:*`) or "sglang" (`sglang:*`, as
    /// SGLang's scheduler and tokenizer collectors name them: usage in tokens, retractions,
    /// prompt and cached tokens counted when a request ends).
    #[arg(long, default_value = "vllm")]
    pub metrics_flavor: String,
}

impl Args {
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.reasoning_share) {
            return Err("--reasoning-share must be within 0 and 1".into());
        }
        if self.pods == 0 {
            return Err("--pods must be at least 1".into());
        }
        if !matches!(self.metrics_flavor.as_str(), "vllm" | "sglang") {
            return Err("--metrics-flavor must be vllm or sglang".into());
        }
        if usize::from(self.base_port) + self.pods > 65536 {
            return Err("--base-port + --pods exceeds the port range".into());
        }
        if self.embedding_size == 0 {
            return Err("--embedding-size must be at least 1".into());
        }
        if self.num_classes == 0 {
            return Err("--num-classes must be at least 1".into());
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
        if !self.pod_speed.is_empty() && self.pod_speed.len() != self.pods {
            return Err(format!(
                "--pod-speed lists {} speeds for {} pods: one per pod",
                self.pod_speed.len(),
                self.pods
            ));
        }
        if !self.pod_blocks.is_empty() && self.pod_blocks.len() != self.pods {
            return Err(format!(
                "--pod-blocks lists {} sizes for {} pods: one per pod",
                self.pod_blocks.len(),
                self.pods
            ));
        }
        if self.pod_blocks.contains(&0) {
            return Err("--pod-blocks values must be positive".into());
        }
        if !self
            .pod_speed
            .iter()
            .all(|v| v.is_finite() && (0.01..=100.0).contains(v))
        {
            return Err("--pod-speed values must be numbers in [0.01, 100]".into());
        }
        for (name, v) in [
            ("--step-overhead-ms", self.step_overhead_ms),
            ("--prefill-us-per-token", self.prefill_us_per_token),
            ("--decode-us-per-seq", self.decode_us_per_seq),
            ("--decode-ns-per-ctx-token", self.decode_ns_per_ctx_token),
            ("--prefill-ns-per-attn-pair", self.prefill_ns_per_attn_pair),
            ("--lora-load-ms", self.lora_load_ms),
            ("--lora-activate-ms", self.lora_activate_ms),
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
        if self.max_loras == 0 {
            return Err("--max-loras must be at least 1".into());
        }
        if self.max_cpu_loras.is_some_and(|c| c < self.max_loras) {
            return Err(format!(
                "max_cpu_loras ({}) must be >= max_loras ({})",
                self.max_cpu_loras.unwrap_or(0),
                self.max_loras
            ));
        }
        let modules = self.lora_modules()?;
        if !modules.is_empty() && !self.enable_lora {
            return Err("--lora-modules needs --enable-lora".into());
        }
        for (i, m) in modules.iter().enumerate() {
            if modules[..i].iter().any(|o| o.name == m.name) {
                return Err(format!(
                    "The lora adapter '{}' has already been loaded.",
                    m.name
                ));
            }
        }
        Ok(())
    }

    pub fn lora_modules(&self) -> Result<Vec<LoraModule>, String> {
        self.lora_modules
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| LoraModule::parse(s.trim()))
            .collect()
    }

    pub fn lora_config(&self) -> Option<LoraConfig> {
        self.enable_lora.then(|| LoraConfig {
            max_loras: self.max_loras,
            max_cpu_loras: self.max_cpu_loras.unwrap_or(self.max_loras),
        })
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

    /// Pod `pod`'s step-time model: the flags' GPU terms divided by its `--pod-speed`.
    pub fn timing(&self, pod: usize) -> TimingModel {
        let slow = 1.0 / self.pod_speed.get(pod).copied().unwrap_or(1.0);
        TimingModel {
            step_overhead: self.step_overhead_ms * 1e-3 * slow,
            prefill_token: self.prefill_us_per_token * 1e-6 * slow,
            decode_seq: self.decode_us_per_seq * 1e-6 * slow,
            decode_ctx_token: self.decode_ns_per_ctx_token * 1e-9 * slow,
            prefill_attn_pair: self.prefill_ns_per_attn_pair * 1e-9 * slow,
            lora_load: self.lora_load_ms * 1e-3,
            lora_activate: self.lora_activate_ms * 1e-3,
        }
    }

    /// Pod `pod`'s KV blocks: its `--pod-blocks`, else `--num-gpu-blocks`.
    pub fn blocks(&self, pod: usize) -> usize {
        self.pod_blocks
            .get(pod)
            .copied()
            .unwrap_or(self.num_gpu_blocks)
    }

    pub fn engine_config(&self, pod: usize) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_gpu_blocks: self.blocks(pod),
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            timing: self.timing(pod),
            lora: self.lora_config(),
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
        let (t, d) = (a.timing(0), TimingModel::default());
        for (x, y) in [
            (t.step_overhead, d.step_overhead),
            (t.prefill_token, d.prefill_token),
            (t.decode_seq, d.decode_seq),
            (t.decode_ctx_token, d.decode_ctx_token),
            (t.prefill_attn_pair, d.prefill_attn_pair),
            (t.lora_load, d.lora_load),
            (t.lora_activate, d.lora_activate),
        ] {
            assert!((x - y).abs() <= 1e-12 * y.abs().max(1e-12), "{x} vs {y}");
        }
        let e = a.engine_config(0);
        assert_eq!(
            (e.block_size, e.num_gpu_blocks, e.max_num_seqs),
            (16, 2048, 256)
        );
        assert_eq!((e.max_num_batched_tokens, e.max_model_len), (8192, 32768));
        assert!(e.enable_prefix_caching);
        assert_eq!(e.lora, None, "LoRA is off unless --enable-lora");
        assert_eq!(a.embedding_size, 4096);
        for zero in ["--embedding-size", "--num-classes"] {
            assert!(Args::parse_from(["kvgate-sim", zero, "0"])
                .validate()
                .is_err());
        }
        assert_eq!(a.num_classes, 2);
        assert_eq!(
            a.served_names(),
            vec!["meta-llama/Llama-3.1-8B-Instruct".to_string()]
        );
    }

    #[test]
    fn a_pod_at_half_speed_takes_twice_as_long_for_every_step() {
        let a = Args::parse_from(["kvgate-sim", "--pods", "3", "--pod-speed", "1,0.5,2"]);
        a.validate().unwrap();
        let work = crate::engine::StepWork {
            prefill_tokens: 100,
            prefill_attn_pairs: 5_000.0,
            decode_seqs: 8,
            decode_ctx_tokens: 4_000,
            ..Default::default()
        };
        let step = |pod| a.timing(pod).step_time(&work);
        assert!((step(1) / step(0) - 2.0).abs() < 1e-12);
        assert!((step(2) / step(0) - 0.5).abs() < 1e-12);
        assert_eq!(
            a.timing(1).lora_load,
            a.timing(0).lora_load,
            "a disk is a disk"
        );
        for argv in [
            &["kvgate-sim", "--pods", "4", "--pod-speed", "1,0.5"][..],
            &["kvgate-sim", "--pods", "2", "--pod-speed", "1,0"],
            &["kvgate-sim", "--pods", "2", "--pod-speed", "1,nan"],
        ] {
            assert!(Args::parse_from(argv).validate().is_err(), "{argv:?}");
        }
        let all_at_one = Args::parse_from(["kvgate-sim", "--pods", "2"]);
        assert_eq!(all_at_one.timing(1), all_at_one.timing(0));
    }

    #[test]
    fn each_pod_may_hold_its_own_kv() {
        let a = Args::parse_from(["kvgate-sim", "--pods", "3", "--pod-blocks", "1024,256,2048"]);
        a.validate().unwrap();
        let blocks: Vec<usize> = (0..3).map(|p| a.engine_config(p).num_gpu_blocks).collect();
        assert_eq!(blocks, [1024, 256, 2048]);
        for argv in [
            &["kvgate-sim", "--pods", "3", "--pod-blocks", "1024,256"][..],
            &["kvgate-sim", "--pods", "2", "--pod-blocks", "1024,0"],
        ] {
            assert!(Args::parse_from(argv).validate().is_err(), "{argv:?}");
        }
        let alike = Args::parse_from(["kvgate-sim", "--pods", "2", "--num-gpu-blocks", "512"]);
        assert_eq!(alike.engine_config(1).num_gpu_blocks, 512);
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

    #[test]
    fn served_model_names_take_several_values_as_in_vllm() {
        let a = Args::parse_from(["kvgate-sim", "--served-model-name", "a", "b", "--pods", "2"]);
        assert_eq!(a.served_names(), vec!["a", "b"]);
        assert_eq!(a.pods, 2);
    }

    #[test]
    fn lora_modules_accept_name_path_and_json_forms() {
        let a = Args::parse_from([
            "kvgate-sim",
            "--enable-lora",
            "--lora-modules",
            "sql=/adapters/sql",
            r#"{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}"#,
            "--max-loras",
            "2",
        ]);
        a.validate().unwrap();
        let m = a.lora_modules().unwrap();
        assert_eq!(m[0].name, "sql");
        assert_eq!(m[0].path, "/adapters/sql");
        assert_eq!(m[1].base_model_name.as_deref(), Some("base"));
        assert_eq!(
            a.lora_config(),
            Some(LoraConfig {
                max_loras: 2,
                max_cpu_loras: 2
            })
        );
    }

    #[test]
    fn bad_lora_settings_are_refused_at_start() {
        for argv in [
            &["kvgate-sim", "--lora-modules", "a=/p"][..],
            &["kvgate-sim", "--enable-lora", "--lora-modules", "a"],
            &["kvgate-sim", "--enable-lora", "--lora-modules", "=/p"],
            &[
                "kvgate-sim",
                "--enable-lora",
                "--lora-modules",
                r#"{"name": "a"}"#,
            ],
            &[
                "kvgate-sim",
                "--enable-lora",
                "--lora-modules",
                "a=/p",
                "a=/q",
            ],
            &["kvgate-sim", "--enable-lora", "--max-loras", "0"],
            &[
                "kvgate-sim",
                "--enable-lora",
                "--max-loras",
                "4",
                "--max-cpu-loras",
                "2",
            ],
        ] {
            assert!(Args::parse_from(argv).validate().is_err(), "{argv:?}");
        }
    }
}
