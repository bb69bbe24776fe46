//! Owns the reading of one model-server pod's Prometheus `/metrics` body (text exposition 0.0.4,
//! and the OpenMetrics variant) into the few load and KV-cache figures kvgate routes on. It is
//! host-agnostic and allocation-free: the shell fetches the body on a scrape tick and hands it here.
//!
//! Decisions a reader needs, because the exposition alone does not settle them:
//!
//! * **Several series of one metric.** A pod can run several engines: vLLM data-parallel ranks
//!   (`engine="0"`, `engine="1"`), SGLang DP-attention ranks (`dp_rank`). Those hold different
//!   requests and different KV pools, so requests, KV capacity and counters are **summed** across
//!   them. Series that differ only in other labels are copies of one scheduler's view (SGLang's
//!   `--enable-metrics-for-all-schedulers` repeats it per `tp_rank`/`pp_rank`; vLLM's multi-process
//!   gauges may carry a `pid`), so the **max** is taken within such a group, never the sum. The
//!   labels that name a distinct engine are `model_name`, `name` (old SGLang), `engine` and
//!   `dp_rank`. KV usage is the **max** over every series: the fullest engine is the one that
//!   preempts first, and a router that underestimates fullness overloads the pod.
//! * **SGLang priority breakdowns.** With priority scheduling SGLang exports the total under
//!   `priority=""` and a per-priority split beside it; series with a non-empty `priority` label
//!   are skipped so requests are not counted twice.
//! * **Implausible values** are not repaired. Counts and counters must be finite and >= 0. KV usage
//!   must lie in 0..=1 (an overshoot of up to 0.01 is rounding and is clamped to 1); anything else,
//!   including values that look like percentages (e.g. `85`), is dropped, since `1.5` could mean
//!   1.5 % or 150 % and a guess would be a made-up number. One bad series makes the whole figure
//!   `None`: the sum of the remaining engines would understate the pod.
//! * **Truncation.** The format requires every line, the last included, to end in `\n`, so a
//!   final line without one is treated as cut off in transit and skipped (`...running 1` may have
//!   been `...running 12`). Truncation exactly at a line boundary cannot be told apart in 0.0.4.
//! * **Bounded work.** Lines longer than [`exposition::MAX_LINE_BYTES`] are skipped; a body of more than
//!   [`exposition::MAX_LINES`] lines is refused with [`MetricsError::TooManyLines`] rather than half-read.
//! * **KV capacity.** vLLM's own `kv_cache_size_tokens` label (newer releases) wins over
//!   `num_gpu_blocks * block_size`, which is wrong for hybrid attention/Mamba models; SGLang's
//!   `max_total_num_tokens` wins over `num_pages * page_size`. Timestamps are accepted and ignored.

//!
//! The files, in the order a body passes through them: `exposition` reads the text format line by
//! line and sample by sample, `series` says which samples kvgate reads and which labels tell one
//! engine from another, `aggregate` folds the samples into per-pod figures under the rules above,
//! and `figures` is what comes out. `lora_info` reads the one series that is text rather than a
//! number, the adapters a vLLM pod is running (`vllm:lora_requests_info`), for adapter affinity. Nothing here holds state between scrapes: the result is
//! written to the pod's shared record (`pods::record`) by `pods::scrape`.

mod aggregate;
pub mod exposition;
pub mod figures;
mod series;

pub use exposition::{lora_info, parse, parse_bytes};
pub use figures::{AnswerTotals, Engine, ItlTotals, LoraInfo, MetricsError, PodMetrics};

#[cfg(test)]
mod tests;
