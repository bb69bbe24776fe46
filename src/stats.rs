//! What kvgate counts, as the core reports it: named counters and gauges buffered in the VM and
//! flushed to Envoy's stats by the shell (they appear under the `wasmcustom.` prefix in Envoy's
//! admin `/stats`). Names are bounded: fixed ones plus one set per pod and one per configured
//! priority band.
//!
//! This module is the catalog: every `kvgate.*` stat name is a constant here (or, for the per-pod
//! and per-band names, built by [`pod_stat`] and [`queue_band_length`]), so a name is spelt once and
//! docs/operations.md's stats table is checked against this list by a test.

// Routing (`flow`, `routing::router`).
/// Requests kvgate sent to a pod it picked.
pub const ROUTED: &str = "kvgate.routed";
/// Decisions that failed on shared data (the request went to Envoy's fallback balancing).
pub const ROUTE_ERRORS: &str = "kvgate.route.errors";
/// Picks Envoy could not use; its retry served the request elsewhere.
pub const ROUTE_REROUTED: &str = "kvgate.route.rerouted";
/// Prompt blocks of routed requests.
pub const PREFIX_BLOCKS_TOTAL: &str = "kvgate.prefix.blocks_total";
/// Of those, blocks the chosen pod was believed to cache.
pub const PREFIX_BLOCKS_MATCHED: &str = "kvgate.prefix.blocks_matched";

// The safe rollout, `routing.mode` / `admission.mode` `observe` (`observe`).
/// Requests admission would have parked in the line (no pod had room), sent past the budget.
pub const OBSERVE_WOULD_WAIT: &str = "kvgate.observe.would_wait";
/// Sheddable requests admission would have refused with 429, sent past the budget.
pub const OBSERVE_WOULD_SHED: &str = "kvgate.observe.would_shed";
/// Responses from the host kvgate picked, while Envoy's load balancer chooses.
pub const OBSERVE_ROUTING_SAME: &str = "kvgate.observe.routing_same";
/// Responses from another host than kvgate's pick, while Envoy's load balancer chooses.
pub const OBSERVE_ROUTING_OTHER: &str = "kvgate.observe.routing_other";

// Pods (`pods::scrape`, `gate`).
pub const SCRAPE_OK: &str = "kvgate.scrape.ok";
pub const SCRAPE_ERRORS: &str = "kvgate.scrape.errors";
pub const DISCOVERY_ERRORS: &str = "kvgate.discovery.errors";
pub const PODS_TOTAL: &str = "kvgate.pods.total";
pub const PODS_STALE: &str = "kvgate.pods.stale";
pub const PODS_UNHEALTHY: &str = "kvgate.pods.unhealthy";

// The line (`gate`).
pub const QUEUE_LENGTH: &str = "kvgate.queue.length";
/// Tickets whose priority is no configured band, so the per-band names stay bounded.
pub const QUEUE_OTHER_LENGTH: &str = "kvgate.queue.other.length";

// Admission outcomes (`admission::admit`).
pub const ADMISSION_ADMITTED: &str = "kvgate.admission.admitted";
pub const ADMISSION_QUEUED: &str = "kvgate.admission.queued";
pub const ADMISSION_BOOSTED: &str = "kvgate.admission.boosted";
pub const ADMISSION_SHED: &str = "kvgate.admission.shed";
pub const ADMISSION_QUEUE_FULL: &str = "kvgate.admission.queue_full";
pub const ADMISSION_TIMED_OUT: &str = "kvgate.admission.timed_out";
pub const ADMISSION_ABANDONED: &str = "kvgate.admission.abandoned";
pub const ADMISSION_WAIT_MS: &str = "kvgate.admission.wait_ms";
pub const ADMISSION_WAKE_LATENCY_MS: &str = "kvgate.admission.wake_latency_ms";
/// The histogram's sum as a counter, so a mean is readable without Prometheus.
pub const ADMISSION_WAKE_LATENCY_MS_TOTAL: &str = "kvgate.admission.wake_latency_ms_total";
pub const ADMISSION_WAKES: &str = "kvgate.admission.wakes";
// The line's cache-friendly order (`drive::run_line`).
pub const ADMISSION_CACHE_FIRST: &str = "kvgate.admission.cache_first";
pub const ADMISSION_UNCACHED: &str = "kvgate.admission.uncached";

// The estimator against the engine's `usage` (`flow`).
pub const ESTIMATE_PROMPT_TOKENS: &str = "kvgate.estimate.prompt_tokens";
pub const ESTIMATE_OUTPUT_TOKENS: &str = "kvgate.estimate.output_tokens";
pub const ESTIMATE_COST_TOKENS: &str = "kvgate.estimate.cost_tokens";
pub const USAGE_PROMPT_TOKENS: &str = "kvgate.usage.prompt_tokens";
pub const USAGE_COMPLETION_TOKENS: &str = "kvgate.usage.completion_tokens";
pub const USAGE_TOTAL_TOKENS: &str = "kvgate.usage.total_tokens";

// Models and adapters (`flow`, `pods::scrape`, `routing::router`).
/// Requests for a model no pod serves, answered 404 by kvgate.
pub const MODELS_NOT_FOUND: &str = "kvgate.models.not_found";
/// Requests whose model was rewritten to a target (`models.routes`).
pub const MODELS_REWRITTEN: &str = "kvgate.models.rewritten";
/// Model lists (`/v1/models`) read, and fetches or bodies that failed (the pod keeps its last).
pub const MODELS_LIST_OK: &str = "kvgate.models.list_ok";
pub const MODELS_LIST_ERRORS: &str = "kvgate.models.list_errors";
/// Picks that send a request's adapter to a pod where it is not resident (it is loaded there).
pub const ADAPTER_LOADS: &str = "kvgate.adapter.loads";
// Replicas sharing budgets through etcd (`replicas::sync`, `gate`).
/// Syncs whose txn etcd applied.
pub const REPLICAS_SYNCS: &str = "kvgate.replicas.syncs";
/// Txns that lost a race for a pod's free credit (read again on the next tick).
pub const REPLICAS_CONFLICTS: &str = "kvgate.replicas.conflicts";
/// etcd calls that failed or timed out (the replica keeps admitting, within its fallback).
pub const REPLICAS_ERRORS: &str = "kvgate.replicas.errors";
/// Lapsed replicas whose grants this replica reclaimed.
pub const REPLICAS_RECLAIMED: &str = "kvgate.replicas.reclaimed";
/// Replicas whose lease etcd holds, as of the last sync.
pub const REPLICAS_LIVE: &str = "kvgate.replicas.live";
/// 1 while this replica reaches etcd, 0 while it admits within its fallback.
pub const REPLICAS_IN_CONTACT: &str = "kvgate.replicas.in_contact";
// What a request costs the proxy (`shell::http`).
/// Host calls a request's own callbacks made (headers to done), one sample per request.
pub const REQUEST_HOST_CALLS: &str = "kvgate.request.host_calls";

/// Every fixed name, for the test against docs/operations.md.
pub const FIXED: &[&str] = &[
    ROUTED,
    ROUTE_ERRORS,
    ROUTE_REROUTED,
    PREFIX_BLOCKS_TOTAL,
    PREFIX_BLOCKS_MATCHED,
    OBSERVE_WOULD_WAIT,
    OBSERVE_WOULD_SHED,
    OBSERVE_ROUTING_SAME,
    OBSERVE_ROUTING_OTHER,
    SCRAPE_OK,
    SCRAPE_ERRORS,
    DISCOVERY_ERRORS,
    PODS_TOTAL,
    PODS_STALE,
    PODS_UNHEALTHY,
    QUEUE_LENGTH,
    QUEUE_OTHER_LENGTH,
    ADMISSION_ADMITTED,
    ADMISSION_QUEUED,
    ADMISSION_BOOSTED,
    ADMISSION_SHED,
    ADMISSION_QUEUE_FULL,
    ADMISSION_TIMED_OUT,
    ADMISSION_ABANDONED,
    ADMISSION_WAIT_MS,
    ADMISSION_WAKE_LATENCY_MS,
    ADMISSION_WAKE_LATENCY_MS_TOTAL,
    ADMISSION_WAKES,
    ADMISSION_CACHE_FIRST,
    ADMISSION_UNCACHED,
    ESTIMATE_PROMPT_TOKENS,
    ESTIMATE_OUTPUT_TOKENS,
    ESTIMATE_COST_TOKENS,
    USAGE_PROMPT_TOKENS,
    USAGE_COMPLETION_TOKENS,
    USAGE_TOTAL_TOKENS,
    MODELS_NOT_FOUND,
    MODELS_REWRITTEN,
    MODELS_LIST_OK,
    MODELS_LIST_ERRORS,
    ADAPTER_LOADS,
    REPLICAS_SYNCS,
    REPLICAS_CONFLICTS,
    REPLICAS_ERRORS,
    REPLICAS_RECLAIMED,
    REPLICAS_LIVE,
    REPLICAS_IN_CONTACT,
    REQUEST_HOST_CALLS,
];

/// The last segment of a per-pod name, `kvgate.pod.<ip_port>.<segment>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodStat(&'static str);

pub const POD_PICKS: PodStat = PodStat("picks");
pub const POD_SCRAPE_ERRORS: PodStat = PodStat("scrape_errors");
pub const POD_ACTIVE_BLOCKS: PodStat = PodStat("active_blocks");
pub const POD_IN_FLIGHT: PodStat = PodStat("in_flight");
pub const POD_RESERVED_TOKENS: PodStat = PodStat("reserved_tokens");
pub const POD_HELD_TOKENS: PodStat = PodStat("held_tokens");
pub const POD_UNEXPLAINED_TOKENS: PodStat = PodStat("unexplained_tokens");
pub const POD_BACKOFF_PERCENT: PodStat = PodStat("backoff_percent");
pub const POD_RELIEF_PERCENT: PodStat = PodStat("relief_percent");
pub const POD_BUDGET_TOKENS: PodStat = PodStat("budget_tokens");
pub const POD_HEALTHY: PodStat = PodStat("healthy");
/// With several replicas: what this one may reserve on the pod now (`replicas::split::admit_cap`).
pub const POD_GRANT_TOKENS: PodStat = PodStat("grant_tokens");
/// With several replicas: the KV the other replicas' requests hold on the pod.
pub const POD_REMOTE_TOKENS: PodStat = PodStat("remote_tokens");
/// The engine's own KV in use at the last scrape, in blocks: against `active_blocks`, how right
/// kvgate's prediction is.
pub const POD_ENGINE_BLOCKS: PodStat = PodStat("engine_blocks");
/// The engine's prefix-cache counters at the last scrape (`vllm:prefix_cache_hits_total`,
/// `vllm:prefix_cache_queries_total`, tokens since it started), as gauges.
pub const POD_ENGINE_PREFIX_HITS: PodStat = PodStat("engine_prefix_hit_tokens");
pub const POD_ENGINE_PREFIX_QUERIES: PodStat = PodStat("engine_prefix_query_tokens");
/// Prompt blocks of requests routed to the pod, and of those the blocks kvgate believed it
/// cached: against the engine's counters, how right the prefix index is.
pub const POD_PREFIX_BLOCKS_TOTAL: PodStat = PodStat("prefix_blocks_total");
pub const POD_PREFIX_BLOCKS_MATCHED: PodStat = PodStat("prefix_blocks_matched");
/// The factor the pick scales the pod's time costs by, learned from its inter-token latency
/// against the pool's (`pods::pace`), in percent: 100 is the pool's pace or unknown.
pub const POD_COST_FACTOR_PERCENT: PodStat = PodStat("cost_factor_percent");

/// Every per-pod name, for the test against docs/operations.md.
pub const PER_POD: &[PodStat] = &[
    POD_PICKS,
    POD_SCRAPE_ERRORS,
    POD_ACTIVE_BLOCKS,
    POD_IN_FLIGHT,
    POD_RESERVED_TOKENS,
    POD_HELD_TOKENS,
    POD_UNEXPLAINED_TOKENS,
    POD_BACKOFF_PERCENT,
    POD_RELIEF_PERCENT,
    POD_BUDGET_TOKENS,
    POD_HEALTHY,
    POD_GRANT_TOKENS,
    POD_REMOTE_TOKENS,
    POD_ENGINE_BLOCKS,
    POD_ENGINE_PREFIX_HITS,
    POD_ENGINE_PREFIX_QUERIES,
    POD_PREFIX_BLOCKS_TOTAL,
    POD_PREFIX_BLOCKS_MATCHED,
    POD_COST_FACTOR_PERCENT,
];

/// A pod's stat: `kvgate.pod.<ip_port>.<stat>`, the address made one segment by [`pod_segment`].
pub fn pod_stat(pod: &str, stat: PodStat) -> String {
    named(("pod", stat.0), pod, || {
        format!("kvgate.pod.{}.{}", pod_segment(pod), stat.0)
    })
}

/// Names built once per pod or model and segment: per-request stats reuse them rather than
/// sanitize and format a name each time.
const NAMES_MAX: usize = 4096;

/// (kind, segment) → (pod or model → full name).
type Names = hashbrown::HashMap<(&'static str, &'static str), hashbrown::HashMap<String, String>>;

thread_local! {
    /// One VM is one thread.
    static NAMES: std::cell::RefCell<Names> = Default::default();
}

fn named(
    kind: (&'static str, &'static str),
    subject: &str,
    build: impl FnOnce() -> String,
) -> String {
    NAMES.with(|names| {
        let mut names = names.borrow_mut();
        let by_subject = names.entry(kind).or_default();
        if let Some(name) = by_subject.get(subject) {
            return name.clone();
        }
        // Subjects are pods and served models, a bounded set; a stream of new ones starts over.
        if by_subject.len() >= NAMES_MAX {
            by_subject.clear();
        }
        let name = build();
        by_subject.insert(subject.to_string(), name.clone());
        name
    })
}

// Per model: the last segment of `kvgate.model.<model>.<segment>` ([`model_stat`]).
/// Requests for the model (as sent, after any rename) that kvgate decided on.
pub const MODEL_REQUESTS: &str = "requests";
/// Of those, requests routed to a pod kvgate picked.
pub const MODEL_PICKS: &str = "picks";
/// A histogram of the waits in the line of requests admitted after waiting.
pub const MODEL_QUEUE_WAIT_MS: &str = "queue_wait_ms";
/// Tokens the engines reported in `usage`.
pub const MODEL_PROMPT_TOKENS: &str = "prompt_tokens";
pub const MODEL_COMPLETION_TOKENS: &str = "completion_tokens";
/// Histograms of each answer's estimate error against its `usage`, in percent of what the
/// engine counted: the prompt estimate, and the expected output (`estimate::reservation`).
pub const MODEL_PROMPT_ERROR_PCT: &str = "prompt_error_pct";
pub const MODEL_OUTPUT_ERROR_PCT: &str = "output_error_pct";

/// Every per-model segment, for the test against docs/operations.md.
pub const PER_MODEL: [&str; 7] = [
    MODEL_REQUESTS,
    MODEL_PICKS,
    MODEL_QUEUE_WAIT_MS,
    MODEL_PROMPT_TOKENS,
    MODEL_COMPLETION_TOKENS,
    MODEL_PROMPT_ERROR_PCT,
    MODEL_OUTPUT_ERROR_PCT,
];

/// Stands for every model without stats of its own (neither configured nor listed by a pod),
/// so client-chosen names cannot grow the stat set.
pub const OTHER_MODEL: &str = "other";
/// Characters of a model name kept in its stat segment.
const MODEL_SEGMENT_CHARS: usize = 64;

/// A model's stat: `kvgate.model.<model>.<stat>`, the name made one bounded segment (characters
/// other than ASCII letters and digits become `_`).
pub fn model_stat(model: &str, stat: &'static str) -> String {
    named(("model", stat), model, || {
        let segment: String = pod_segment(model)
            .chars()
            .take(MODEL_SEGMENT_CHARS)
            .collect();
        format!("kvgate.model.{segment}.{stat}")
    })
}

/// Tickets waiting in one configured priority band: `kvgate.queue.priority_<band>.length`, a
/// negative band spelt `minus_<n>` (Envoy stat names have no `-`).
pub fn queue_band_length(band: i32) -> String {
    format!("kvgate.queue.priority_{band}.length").replace('-', "minus_")
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stat {
    Counter(String, u64),
    Gauge(String, u64),
    Histogram(String, u64),
}

/// Envoy stat names use dots as separators; a pod's `ip:port` becomes `ip_port` with dots kept
/// out, so it stays one segment.
pub fn pod_segment(pod: &str) -> String {
    pod.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[derive(Debug, Default)]
pub struct Stats {
    pending: Vec<Stat>,
}

impl Stats {
    pub fn count(&mut self, name: impl Into<String>, by: u64) {
        if by > 0 {
            self.pending.push(Stat::Counter(name.into(), by));
        }
    }

    pub fn gauge(&mut self, name: impl Into<String>, value: u64) {
        self.pending.push(Stat::Gauge(name.into(), value));
    }

    pub fn histogram(&mut self, name: impl Into<String>, value: u64) {
        self.pending.push(Stat::Histogram(name.into(), value));
    }

    /// Stats waiting to be sent: one host call each.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    pub fn drain(&mut self) -> std::vec::Drain<'_, Stat> {
        self.pending.drain(..)
    }

    /// Sends nothing: drains the pending stats, summing what was counted under `name` (tests).
    #[cfg(test)]
    pub fn take_count(&mut self, name: &str) -> u64 {
        self.drain()
            .filter_map(|s| match s {
                Stat::Counter(n, by) if n == name => Some(by),
                _ => None,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn pod_names_become_one_segment_and_zero_counts_are_dropped() {
        assert_eq!(pod_segment("10.0.0.1:8000"), "10_0_0_1_8000");
        let mut s = Stats::default();
        s.count("a", 0);
        s.count("b", 2);
        s.gauge("g", 0);
        let out: Vec<Stat> = s.drain().collect();
        assert_eq!(
            out,
            vec![Stat::Counter("b".into(), 2), Stat::Gauge("g".into(), 0)]
        );
    }

    /// The first column of docs/operations.md's stats table: every name in backticks, with
    /// `<ip_port>` and `<p>` standing for the pod and the band.
    fn documented() -> Vec<String> {
        let doc = include_str!("../docs/operations.md");
        let table = doc
            .split("## Stats")
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .unwrap_or("");
        table
            .lines()
            .filter(|l| l.starts_with("| `kvgate."))
            .flat_map(|l| {
                let first = l.split('|').nth(1).unwrap_or("");
                first
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// docs/operations.md lists every stat name in the catalog, and no other.
    #[test]
    fn the_stats_table_in_docs_matches_the_catalog() {
        let mut catalog: Vec<String> = FIXED.iter().map(|s| s.to_string()).collect();
        catalog.extend(
            PER_POD
                .iter()
                .map(|s| pod_stat("<ip_port>", *s).replace("_ip_port_", "<ip_port>")),
        );
        catalog.push(queue_band_length(0).replace("priority_0", "priority_<p>"));
        catalog.extend(
            PER_MODEL
                .iter()
                .map(|s| model_stat("MODEL", s).replace("MODEL", "<model>")),
        );
        let mut documented = documented();
        catalog.sort();
        documented.sort();
        assert_eq!(
            documented, catalog,
            "docs/operations.md's stats table vs src/stats.rs"
        );
    }

    #[test]
    fn model_names_become_one_bounded_segment() {
        assert_eq!(
            model_stat("meta-llama/Llama-3.1-8B", MODEL_PICKS),
            "kvgate.model.meta_llama_Llama_3_1_8B.picks"
        );
        assert_eq!(model_stat(&"é".repeat(500), MODEL_PICKS).len(), 83);
    }

    #[test]
    fn band_and_pod_names_are_bounded_segments() {
        assert_eq!(
            queue_band_length(-1),
            "kvgate.queue.priority_minus_1.length"
        );
        assert_eq!(
            pod_stat("10.0.0.1:8000", POD_PICKS),
            "kvgate.pod.10_0_0_1_8000.picks"
        );
    }
}
