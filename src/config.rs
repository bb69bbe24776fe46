//! The plugin configuration: the JSON an operator writes (camelCase, unknown keys rejected), its
//! defaults, and its validation. Parsed once in `on_configure`; the request path only reads the
//! resulting structs. Every key and default is listed in docs/configuration.md, and a test keeps
//! that page in step with the `Default` impls below.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

mod etcd;
mod models;
pub use etcd::EtcdConfig;
pub use models::{ModelRoute, ModelTarget, ModelsConfig};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Config {
    /// Requests that are not JSON or not on a known OpenAI path go upstream untouched; when false
    /// they are refused with 404.
    pub passthrough_unknown: bool,
    /// The largest request body kvgate reads; above it the answer is 413.
    pub max_body_bytes: u64,
    /// Adds `x-kvgate-*` response headers that explain each decision.
    pub debug_headers: bool,
    /// Keeps the same report, as one `key=value` line, in Envoy's filter state for access logs
    /// (`wasm.kvgate`), where clients do not see it.
    pub access_log: bool,
    /// Model-server pods as `ip:port`, in addition to any discovered ones.
    pub pods: Vec<String>,
    /// A path kvgate answers itself with the pool's state (src/status.rs); empty turns it off.
    pub status_path: String,
    pub discovery: DiscoveryConfig,
    pub metrics: MetricsConfig,
    pub routing: RoutingConfig,
    pub admission: AdmissionConfig,
    pub estimator: EstimatorConfig,
    pub models: ModelsConfig,
    pub etcd: EtcdConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            passthrough_unknown: true,
            max_body_bytes: 1024 * 1024,
            debug_headers: false,
            access_log: true,
            pods: Vec::new(),
            status_path: String::new(),
            discovery: DiscoveryConfig::default(),
            metrics: MetricsConfig::default(),
            routing: RoutingConfig::default(),
            admission: AdmissionConfig::default(),
            estimator: EstimatorConfig::default(),
            models: ModelsConfig::default(),
            etcd: EtcdConfig::default(),
        }
    }
}

/// Whether a part of kvgate acts on its decisions or only reports them: the safe rollout
/// (switch kvgate on in `observe`, compare its decisions with what happens, then `enforce`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    Enforce,
    Observe,
}

/// Cost-aware admission: per-pod token budgets and the queue in front of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct AdmissionConfig {
    pub enabled: bool,
    /// `enforce`: requests wait or are shed when no pod has room. `observe`: kvgate decides as
    /// it would but forwards at once, counting and reporting what enforcement would have done.
    pub mode: Mode,
    /// Fraction of a pod's KV capacity (from its metrics) that reservations may fill.
    pub utilization: f64,
    /// A fixed budget per pod in tokens; 0 derives it from the pod's metrics.
    pub budget_tokens: u64,
    /// How many requests each pod's engine runs at once (vLLM's `--max-num-seqs`, SGLang's
    /// `--max-running-requests`); admission sends a pod at most that many and one more
    /// (`pods::seats`). 0 learns each engine's from its queue.
    pub engine_seats: u32,
    /// Requests waiting at most; a full queue answers 429.
    pub max_queue: u32,
    /// How many requests of its band may be admitted past the head of the line into room the
    /// head does not fit, while it waits; 0 keeps the line strictly in order.
    pub backfill_passes: u32,
    /// How many more times a head whose only room would compute its prompt's prefix again may be
    /// passed by requests of its band whose prefix is cached where that room is.
    pub cache_first_passes: u32,
    /// How long a request waits for room on a pod caching its prompt's prefix, when few
    /// in-flight requests share that prefix, before it takes room where the prefix would be
    /// computed again; 0 routes it by cost alone.
    pub cache_wait_ms: u64,
    /// Longest wait before 503 with Retry-After.
    pub max_wait_ms: u64,
    /// Refuses at arrival (429 with Retry-After) a request that the requests ahead of it would
    /// keep in the line past `max_wait_ms`, at the pace the line drains, instead of letting it
    /// wait for a 503 (`QueueRecord::late`).
    pub refuse_late: bool,
    /// Header carrying the request's own time-to-first-token objective in milliseconds (the
    /// Gateway API Inference Extension's `x-slo-ttft-ms`): it bounds the request's wait in the
    /// line below `max_wait_ms`. Empty (the default) reads none.
    pub ttft_objective_header: String,
    /// Header naming the GIE inference objective, mapped to a priority by `objectives`.
    pub objective_header: String,
    pub objectives: BTreeMap<String, i32>,
    /// Header carrying an integer priority directly; empty ignores it (clients are not trusted).
    pub priority_header: String,
    pub default_priority: i32,
    /// Header naming the tenant for fairness within a priority band.
    pub tenant_header: String,
    /// Header naming the conversation, for the session boost.
    pub session_header: String,
    /// How long after a session's turn finishes its next turn is boosted; 0 turns the boost off.
    pub session_boost_ms: u64,
    /// Virtual-time credit of a boosted request, in tokens (how far ahead of its band it may go).
    pub session_boost_tokens: u64,
    /// Standard deviations of headroom in a pod's KV forecast: admission keeps the expected KV
    /// plus this many sigmas within the budget at every horizon. For requests without an output
    /// limit, which the engine's feedback may relieve (`admission::feedback`).
    pub headroom_sigmas: f64,
    /// The same for requests with `max_tokens`: a client's bound, for which kvgate keeps the pod
    /// from preempting (`forecast::Headroom`).
    pub bounded_headroom_sigmas: f64,
    /// The most of a pod's budget its engine's preemptions take back (`admission::feedback`'s
    /// backoff); 0 leaves the budget where it is, for traffic whose preemptions cost little.
    pub preemption_backoff: f64,
}

impl AdmissionConfig {
    /// The forecast's headroom, by kind of request.
    pub fn headroom(&self) -> crate::admission::forecast::Headroom {
        crate::admission::forecast::Headroom {
            bounded: self.bounded_headroom_sigmas,
            unbounded: self.headroom_sigmas,
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: Mode::Enforce,
            utilization: 1.0,
            budget_tokens: 0,
            engine_seats: 0,
            max_queue: 1_000,
            backfill_passes: 4,
            cache_first_passes: 16,
            cache_wait_ms: 100,
            max_wait_ms: 30_000,
            refuse_late: true,
            ttft_objective_header: String::new(),
            objective_header: "x-gateway-inference-objective".into(),
            objectives: BTreeMap::new(),
            priority_header: String::new(),
            default_priority: 0,
            tenant_header: "x-gateway-inference-fairness-id".into(),
            session_header: "x-session-id".into(),
            session_boost_ms: 60_000,
            session_boost_tokens: 65_536,
            headroom_sigmas: 2.5,
            bounded_headroom_sigmas: 3.0,
            preemption_backoff: 0.3,
        }
    }
}

/// Discovery of pods from Envoy's own admin `/clusters`, so kvgate's pods are exactly the hosts
/// the override-host policy accepts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// The Envoy cluster that reaches the admin interface; empty turns discovery off.
    pub admin_cluster: String,
    /// The cluster whose hosts are the model-server pods.
    pub model_cluster: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            admin_cluster: String::new(),
            model_cluster: "models".into(),
            interval_ms: 5_000,
            timeout_ms: 1_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StalePolicy {
    /// Route as if nothing were known of the pod's queue and cache usage.
    Ignore,
    /// Avoid the pod while any pod has fresh metrics.
    Saturated,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// An ORIGINAL_DST cluster honouring `x-envoy-original-dst-host`; empty turns scraping off.
    pub cluster: String,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Metrics older than this are stale.
    pub stale_after_ms: u64,
    pub stale_policy: StalePolicy,
    /// kvgate's own requests dispatched this soon before a scrape are not counted in its waiting
    /// queue: they had not reached the engine's next step yet, which is not congestion.
    pub waiting_grace_ms: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            cluster: String::new(),
            path: "/metrics".into(),
            interval_ms: 1_000,
            timeout_ms: 500,
            stale_after_ms: 5_000,
            stale_policy: StalePolicy::Ignore,
            waiting_grace_ms: 250,
        }
    }
}

/// How the pod is picked: prefix affinity blended with load. See docs/design.md for the formula.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `enforce`: the pick is sent to Envoy as the override host. `observe`: kvgate picks and
    /// accounts as usual but Envoy's load balancer chooses the host; the request's accounting
    /// then moves to the host Envoy used.
    pub mode: Mode,
    /// Tokens per KV block; 0 derives it from the pods' reported block size.
    pub block_tokens: u32,
    /// Characters per token used to cut prompt text into blocks.
    pub chars_per_block_token: f64,
    /// Blocks a pod's prefix cache is assumed to hold when its metrics do not say.
    pub pod_capacity_blocks: u64,
    pub prefix_ttl_ms: u64,
    /// Correct what the prefix index believes each pod caches from the engine's own prefix-cache
    /// counters (`pods::index_check`): its share of the pod's capacity, and a restart's empty
    /// cache.
    pub index_check: bool,
    /// Prompt blocks hashed per request at most.
    pub max_prompt_blocks: u32,
    /// Cost of each prompt block the pod would have to compute.
    pub prefill_weight: f64,
    /// Cost of each block the pod's in-flight sequences read per decode step, this request's
    /// included (a shared prefix once per sequence).
    pub decode_weight: f64,
    /// Scale each pod's prefill, decode and queue costs by its pace against the other pods',
    /// learned from its engine's inter-token latency (`pods::pace`); off, every pod is costed
    /// alike.
    pub learn_decode_cost: bool,
    /// Cost of each KV block active on the pod, this request's included (a shared prefix once).
    pub active_weight: f64,
    /// Cost of each scraped waiting request, in units of this request's blocks.
    pub queue_weight: f64,
    /// Cost of the scraped KV-cache usage, as a fraction of the pod's capacity in blocks.
    pub kv_usage_weight: f64,
    /// Among pods loaded alike that mostly cache the prompt, send it where the engine step under
    /// way ends first (`routing::step_phase`).
    pub step_phase: bool,
    /// How long a request takes from the pick to the engine's scheduler at most (Envoy's
    /// upstream, the network, the engine's HTTP server), in ms: the step phase is judged at its
    /// arrival.
    pub dispatch_delay_ms: f64,
    /// Softmax temperature over normalised costs; 0 picks the lowest cost (ties at random).
    pub temperature: f64,
    /// Further pods listed after the pick, for retries.
    pub fallback_pods: u32,
    /// Also write the pick to `x-envoy-original-dst-host`, for an ORIGINAL_DST model cluster.
    pub set_original_dst_header: bool,
    /// An in-flight entry lives this long without news of its stream.
    pub request_ttl_ms: u64,
    /// The request header whose value the engines take as the prompt's cache salt over the
    /// body's `cache_salt` (vLLM's `X-Cache-Salt`); empty: none is read.
    pub cache_salt_header: String,
    /// How long a request naming a stored response no note here names is held while the pods
    /// that may store it are asked (`routing::stored_ask`, through `metrics.cluster`); 0: never
    /// asked, such a request is routed by cost.
    pub stored_lookup_ms: u64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Enforce,
            block_tokens: 0,
            chars_per_block_token: 4.0,
            pod_capacity_blocks: 8_192,
            prefix_ttl_ms: 600_000,
            index_check: true,
            max_prompt_blocks: 2_048,
            prefill_weight: 2.0,
            decode_weight: 0.2,
            learn_decode_cost: true,
            active_weight: 0.05,
            queue_weight: 1.0,
            kv_usage_weight: 0.0,
            step_phase: true,
            dispatch_delay_ms: 1.0,
            temperature: 0.0,
            fallback_pods: 2,
            set_original_dst_header: false,
            request_ttl_ms: 660_000,
            cache_salt_header: "x-cache-salt".into(),
            stored_lookup_ms: 500,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct EstimatorConfig {
    /// Tokens charged for each non-text content part (image, audio, file).
    pub non_text_part_tokens: u64,
    /// Mean output length of the prior (an exponential distribution) used until a model's own
    /// lengths are learned.
    pub default_output_tokens: u64,
    /// Expected output is never below this.
    pub output_floor_tokens: u64,
    /// Expected output is never above this, whatever max_tokens says.
    pub output_cap_tokens: u64,
    /// Multiplies the estimated prompt tokens: a deliberate margin on top of the forecast's own
    /// (the prompt estimate's measured spread, `prompt_spread`, and the output's uncertainty are
    /// already its headroom, `admission.headroomSigmas`). 1.0: none.
    pub safety_factor: f64,
    /// The relative error (one standard deviation) of a prompt estimate until calibration has
    /// measured the model's own (`min_samples` answers): it sizes the forecast's headroom for
    /// prompts, where a fixed multiplier on every prompt would leave that much KV idle.
    pub prompt_spread: f64,
    /// The relative error (one standard deviation) of `default_output_tokens` as a model's mean
    /// answer, while nothing has measured it (neither the model's own answers nor its engines'
    /// count): one error every request forecast on the prior shares, so a pod's forecast pays
    /// it in proportion to how many such requests it holds (`admission::forecast`).
    pub output_prior_spread: f64,
    /// A reservation is never smaller than this.
    pub min_reservation_tokens: u64,
    /// A reservation is never larger than this.
    pub max_reservation_tokens: u64,
    /// Learn characters-per-token and output lengths per model from responses' `usage`.
    pub calibrate: bool,
    /// Learn each prompt template's answer lengths beside its model's (`estimate::templates`).
    pub template_lengths: bool,
    /// Weight of each new sample in the learned averages (exponential moving average).
    pub calibration_weight: f64,
    /// Samples needed before learned values replace the static rule.
    pub min_samples: u32,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        Self {
            non_text_part_tokens: 512,
            default_output_tokens: 256,
            output_floor_tokens: 16,
            output_cap_tokens: 8192,
            safety_factor: 1.0,
            prompt_spread: 0.1,
            output_prior_spread: 0.5,
            min_reservation_tokens: 64,
            max_reservation_tokens: 131_072,
            calibrate: true,
            template_lengths: true,
            calibration_weight: 0.05,
            min_samples: 20,
        }
    }
}

/// A configuration that cannot be used: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid kvgate config: field `{}`: {}",
            self.field, self.reason
        )
    }
}

/// Durations above a week are configuration mistakes (and would overflow clock arithmetic).
const MAX_DURATION_MS: u64 = 7 * 24 * 3_600_000;

/// More running requests than this per engine is a configuration mistake (vLLM's largest default
/// is 1,024).
const MAX_ENGINE_SEATS: u32 = 1 << 20;

fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        reason: reason.into(),
    }
}

impl Config {
    /// How long a request waits for room where its prompt's prefix is cached
    /// (`admission.cacheWaitMs`). Through several replicas sharing budgets (`etcd` on) it waits
    /// twice that: the room is often credit another replica holds on that pod, which comes only
    /// after that replica's sync and this one's (about 70 ms at the default busy pace), on top of
    /// the releases one gateway waits for. Measured under cache pressure through two and three
    /// replicas, 200 ms against 100: hits +3.5 and +5.5 points at the same TTFT (BENCHMARKS.md,
    /// *Credit at the quickest tick*); through one gateway a longer wait only added TTFT.
    pub fn cache_wait_ms(&self) -> u64 {
        let wait = self.admission.cache_wait_ms;
        if self.etcd.enabled() {
            wait.saturating_mul(2)
        } else {
            wait
        }
    }

    /// Whether this filter has a pool of its own to route: static pods or discovery. A filter
    /// that only splits models between clusters (`kvgate-models` in envoy/envoy-models.yaml)
    /// has none.
    pub fn has_pool(&self) -> bool {
        !self.pods.is_empty() || !self.discovery.admin_cluster.is_empty()
    }

    /// Parses the plugin configuration; empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let config: Config = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." {
                "(top level)".to_string()
            } else {
                path
            };
            let inner = e.into_inner();
            // serde_json appends " at line L column C"; the field path says more.
            let text = inner.to_string();
            let reason = match text.rfind(" at line ") {
                Some(i) if inner.line() > 0 => text[..i].to_string(),
                _ => text,
            };
            invalid(&field, reason)
        })?;
        de.end()
            .map_err(|e| invalid("(top level)", format!("trailing characters: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (field, ms) in [
            ("discovery.intervalMs", self.discovery.interval_ms),
            ("discovery.timeoutMs", self.discovery.timeout_ms),
            ("metrics.intervalMs", self.metrics.interval_ms),
            ("metrics.timeoutMs", self.metrics.timeout_ms),
            ("metrics.staleAfterMs", self.metrics.stale_after_ms),
            ("metrics.waitingGraceMs", self.metrics.waiting_grace_ms),
            ("routing.prefixTtlMs", self.routing.prefix_ttl_ms),
            ("routing.requestTtlMs", self.routing.request_ttl_ms),
            ("admission.maxWaitMs", self.admission.max_wait_ms),
            ("admission.sessionBoostMs", self.admission.session_boost_ms),
            ("etcd.reclaimGraceMs", self.etcd.reclaim_grace_ms),
            ("etcd.syncIntervalMs", self.etcd.sync_interval_ms),
            ("etcd.timeoutMs", self.etcd.timeout_ms),
        ] {
            if ms > MAX_DURATION_MS {
                return Err(invalid(field, "must be at most 604800000 (7 days)"));
            }
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("maxBodyBytes", "must be greater than 0"));
        }
        for (i, pod) in self.pods.iter().enumerate() {
            if !is_host_port(pod) {
                return Err(invalid(
                    &format!("pods[{i}]"),
                    format!("`{pod}` is not ip:port"),
                ));
            }
        }
        let d = &self.discovery;
        if !d.admin_cluster.is_empty() && (d.interval_ms == 0 || d.model_cluster.is_empty()) {
            return Err(invalid(
                "discovery.intervalMs",
                "must be > 0, with modelCluster set",
            ));
        }
        if self.metrics.interval_ms == 0 || self.metrics.timeout_ms == 0 {
            return Err(invalid(
                "metrics.intervalMs",
                "intervals and timeouts must be > 0",
            ));
        }
        // Matched against `:path` before the query, so it must look like one path and no more.
        let s = &self.status_path;
        if !s.is_empty()
            && (!s.starts_with('/') || s.bytes().any(|b| b == b'?' || !b.is_ascii_graphic()))
        {
            return Err(invalid(
                "statusPath",
                "must be empty or a path starting with / (no query, no spaces)",
            ));
        }
        if !self.metrics.path.starts_with('/') {
            return Err(invalid("metrics.path", "must start with /"));
        }
        self.routing.validate()?;
        self.admission.validate()?;
        self.etcd.validate()?;
        self.estimator.validate()?;
        self.models.validate()
    }
}

fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

impl AdmissionConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let e = |field: &str, reason: &str| Err(invalid(&format!("admission.{field}"), reason));
        if !(self.utilization > 0.0 && self.utilization <= 1.0) {
            return e("utilization", "must be in (0, 1]");
        }
        if self.engine_seats > MAX_ENGINE_SEATS {
            return e("engineSeats", "must be at most 1048576");
        }
        if self.max_queue > 100_000 {
            return e(
                "maxQueue",
                "must be at most 100000 (the queue lives in one shared record)",
            );
        }
        if self.max_wait_ms == 0 {
            return e("maxWaitMs", "must be > 0");
        }
        if self.backfill_passes > 1_000 {
            return e("backfillPasses", "must be at most 1000");
        }
        if self.cache_first_passes > 1_000 {
            return e("cacheFirstPasses", "must be at most 1000");
        }
        if self.cache_wait_ms > 60_000 {
            return e("cacheWaitMs", "must be at most 60000");
        }
        if !(0.0..=10.0).contains(&self.headroom_sigmas) {
            return e("headroomSigmas", "must be in [0, 10]");
        }
        if !(0.0..=10.0).contains(&self.bounded_headroom_sigmas) {
            return e("boundedHeadroomSigmas", "must be in [0, 10]");
        }
        if !(0.0..=0.9).contains(&self.preemption_backoff) {
            return e("preemptionBackoff", "must be in [0, 0.9]");
        }
        for (name, header) in [
            ("ttftObjectiveHeader", &self.ttft_objective_header),
            ("objectiveHeader", &self.objective_header),
            ("priorityHeader", &self.priority_header),
            ("tenantHeader", &self.tenant_header),
            ("sessionHeader", &self.session_header),
        ] {
            if !header_name(header) {
                return e(name, HEADER_NAME);
            }
        }
        Ok(())
    }
}

/// Whether `name` is a header name as Envoy's header map holds it (HTTP/2 and Envoy lower-case
/// every name, so a name with capitals would never match); empty reads none.
fn header_name(name: &str) -> bool {
    !name.bytes().any(|b| b.is_ascii_uppercase() || b == b' ')
}

const HEADER_NAME: &str = "header names must be lower case without spaces";

/// The largest block size kvgate hashes by, configured or reported by a pod.
pub const MAX_BLOCK_TOKENS: u32 = 1024;

impl RoutingConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let e = |field: &str, reason: &str| Err(invalid(&format!("routing.{field}"), reason));
        if self.block_tokens > MAX_BLOCK_TOKENS {
            return e(
                "blockTokens",
                "must be at most 1024 (0 derives it from the pods)",
            );
        }
        if !(self.chars_per_block_token > 0.0 && self.chars_per_block_token < 100.0) {
            return e("charsPerBlockToken", "must be in (0, 100)");
        }
        for (name, w) in [
            ("prefillWeight", self.prefill_weight),
            ("decodeWeight", self.decode_weight),
            ("activeWeight", self.active_weight),
            ("queueWeight", self.queue_weight),
            ("kvUsageWeight", self.kv_usage_weight),
            ("dispatchDelayMs", self.dispatch_delay_ms),
            ("temperature", self.temperature),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return e(name, "must be a finite number >= 0");
            }
        }
        if self.stored_lookup_ms > 10_000 {
            return e("storedLookupMs", "must be at most 10000");
        }
        if !header_name(&self.cache_salt_header) {
            return e("cacheSaltHeader", HEADER_NAME);
        }
        if self.max_prompt_blocks == 0 || self.pod_capacity_blocks == 0 {
            return e("maxPromptBlocks", "block limits must be > 0");
        }
        if self.max_prompt_blocks > 4096 {
            return e(
                "maxPromptBlocks",
                "must be at most 4096 (every worker replays each block)",
            );
        }
        if self.mode == Mode::Observe && self.set_original_dst_header {
            return e(
                "mode",
                "observe lets Envoy's load balancer choose, which an ORIGINAL_DST cluster \
                 (setOriginalDstHeader) cannot: it would have no destination",
            );
        }
        Ok(())
    }

    /// Characters per prompt block of `block_tokens` tokens.
    pub fn block_chars(&self, block_tokens: u32) -> usize {
        ((f64::from(block_tokens) * self.chars_per_block_token).round() as usize).max(1)
    }
}

impl EstimatorConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let e = |field: &str, reason: &str| Err(invalid(&format!("estimator.{field}"), reason));
        if !(self.safety_factor >= 1.0 && self.safety_factor <= 10.0) {
            return e("safetyFactor", "must be between 1.0 and 10.0");
        }
        if !(0.0..=1.0).contains(&self.prompt_spread) {
            return e("promptSpread", "must be in [0, 1]");
        }
        if !(0.0..=2.0).contains(&self.output_prior_spread) {
            return e("outputPriorSpread", "must be in [0, 2]");
        }
        if self.output_floor_tokens > self.output_cap_tokens {
            return e("outputFloorTokens", "must not exceed outputCapTokens");
        }
        if self.min_reservation_tokens > self.max_reservation_tokens {
            return e(
                "minReservationTokens",
                "must not exceed maxReservationTokens",
            );
        }
        if !(self.calibration_weight > 0.0 && self.calibration_weight <= 1.0) {
            return e("calibrationWeight", "must be in (0, 1]");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn empty_config_means_defaults() {
        assert_eq!(Config::parse(b"").unwrap(), Config::default());
        assert_eq!(Config::parse(b"  \n").unwrap(), Config::default());
        assert_eq!(Config::parse(b"{}").unwrap(), Config::default());
    }

    #[test]
    fn through_several_replicas_a_request_waits_twice_as_long_for_its_prefixs_pod() {
        let one = Config::parse(br#"{"admission":{"cacheWaitMs":120}}"#).unwrap();
        assert_eq!(one.cache_wait_ms(), 120);
        let shared = Config::parse(
            br#"{"admission":{"cacheWaitMs":120},"etcd":{"cluster":"etcd","maxReplicas":3}}"#,
        )
        .unwrap();
        assert_eq!(shared.cache_wait_ms(), 240);
        let off = Config::parse(
            br#"{"admission":{"cacheWaitMs":0},"etcd":{"cluster":"etcd","maxReplicas":3}}"#,
        )
        .unwrap();
        assert_eq!(off.cache_wait_ms(), 0, "0 still routes by cost alone");
    }

    #[test]
    fn keys_are_camel_case_and_partial_sections_keep_defaults() {
        let c =
            Config::parse(br#"{"debugHeaders":true,"estimator":{"safetyFactor":1.5}}"#).unwrap();
        assert!(c.debug_headers);
        assert_eq!(c.estimator.safety_factor, 1.5);
        assert_eq!(c.estimator.default_output_tokens, 256);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::parse(br#"{"estimator":{"safetyFactr":1.5}}"#).unwrap_err();
        assert_eq!(err.field, "estimator.safetyFactr");
        assert!(err.reason.contains("unknown field"), "{err}");
    }

    #[test]
    fn wrong_type_is_named() {
        let err = Config::parse(br#"{"maxBodyBytes":"big"}"#).unwrap_err();
        assert_eq!(err.field, "maxBodyBytes");
        assert!(err.reason.contains("invalid type"), "{err}");
    }

    #[test]
    fn a_status_path_is_one_plain_path_or_nothing() {
        for bad in ["status", "/s?x=1", "/a b", "/é"] {
            let json = format!(r#"{{"statusPath":"{bad}"}}"#);
            let err = Config::parse(json.as_bytes()).unwrap_err();
            assert_eq!(err.field, "statusPath", "{bad}");
        }
        let c = Config::parse(br#"{"statusPath":"/kvgate/status"}"#).unwrap();
        assert_eq!(c.status_path, "/kvgate/status");
        assert_eq!(Config::default().status_path, "", "off by default");
    }

    #[test]
    fn bad_values_are_named() {
        let err = Config::parse(br#"{"estimator":{"safetyFactor":0.5}}"#).unwrap_err();
        assert_eq!(err.field, "estimator.safetyFactor");
        let err =
            Config::parse(br#"{"estimator":{"minReservationTokens":10,"maxReservationTokens":5}}"#)
                .unwrap_err();
        assert_eq!(err.field, "estimator.minReservationTokens");
        let err =
            Config::parse(br#"{"routing":{"requestTtlMs":18446744073709551615}}"#).unwrap_err();
        assert_eq!(err.field, "routing.requestTtlMs");
        let err = Config::parse(br#"{"admission":{"boundedHeadroomSigmas":-1}}"#).unwrap_err();
        assert_eq!(err.field, "admission.boundedHeadroomSigmas");
        let err = Config::parse(br#"{"admission":{"preemptionBackoff":1}}"#).unwrap_err();
        assert_eq!(err.field, "admission.preemptionBackoff");
        let err = Config::parse(br#"{"admission":{"engineSeats":2000000}}"#).unwrap_err();
        assert_eq!(err.field, "admission.engineSeats");
        let again =
            Config::parse(br#"{"estimator":{"safetyFactor":1.333333333333333333332}}"#).unwrap();
        assert_eq!(
            Config::parse(&serde_json::to_vec(&again).unwrap()).unwrap(),
            again,
            "floats round-trip"
        );
        let err = Config::parse(b"{not json").unwrap_err();
        assert!(err.to_string().contains("invalid kvgate config"));
    }

    /// Every key of the default config, with its default, appears in docs/configuration.md.
    #[test]
    fn every_key_is_documented() {
        fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
            match v {
                serde_json::Value::Object(map) => {
                    for (k, v) in map {
                        let key = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        walk(&key, v, out);
                    }
                }
                other => out.push((prefix.to_string(), other.to_string())),
            }
        }
        let doc = include_str!("../docs/configuration.md");
        let mut keys = Vec::new();
        walk(
            "",
            &serde_json::to_value(Config::default()).unwrap(),
            &mut keys,
        );
        for (key, default) in keys {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{key}` |")))
                .unwrap_or_else(|| panic!("docs/configuration.md has no row for `{key}`"));
            assert!(
                row.contains(&format!("| `{default}` |")),
                "docs/configuration.md: `{key}` should show default `{default}`: {row}"
            );
        }
    }
}
