//! What kvgate counts, as the core reports it: named counters, gauges and histograms buffered in
//! the VM ([`Stats`]: counters summed per name as they are counted) and sent to Envoy's stats by
//! the shell (they appear under the `wasmcustom.` prefix in Envoy's admin `/stats`). Names are
//! bounded: fixed ones plus one set per pod, per model and per configured priority band.
//!
//! This module is the catalog: every `kvgate.*` stat name is a constant here (or, for the per-pod,
//! per-model and per-band names, named by [`pod_stat`], [`model_stat`] and [`queue_band_length`]),
//! so a name is spelt once and docs/operations.md's stats table is checked against this list by a
//! test.

/// Declares a table of stat names: the type `$ty` (an enum whose value is a name's index in
/// `$table`, so counting a name needs no hashing of it), one documented constant of it per name,
/// and `$table`, every name in order.
macro_rules! catalog {
    (
        $(#[$ty_doc:meta])* $ty:ident;
        $(#[$table_doc:meta])* $table:ident;
        $($(#[$doc:meta])* $id:ident = $name:literal;)*
    ) => {
        $(#[$ty_doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        pub enum $ty {
            $($id,)*
        }

        impl $ty {
            pub fn name(self) -> &'static str {
                $table.get(self as usize).copied().unwrap_or_default()
            }
        }

        $($(#[$doc])* pub const $id: $ty = $ty::$id;)*

        $(#[$table_doc])*
        pub const $table: &[&str] = &[$($name,)*];
    };
}

catalog! {
    /// A fixed stat name.
    Fixed;
    /// Every fixed name, for the test against docs/operations.md.
    FIXED;
    // Routing (`flow`, `routing::router`).
    /// Requests kvgate sent to a pod it picked.
    ROUTED = "kvgate.routed";
    /// Decisions that failed on shared data (the request went to Envoy's fallback balancing).
    ROUTE_ERRORS = "kvgate.route.errors";
    /// Picks Envoy could not use; its retry served the request elsewhere.
    ROUTE_REROUTED = "kvgate.route.rerouted";
    /// Requests sent on without a pick because no pod was known: Envoy's balancing chose, and
    /// no budget held them.
    ROUTE_UNROUTED = "kvgate.route.unrouted";
    /// The delay from a pick to the engine's scheduler, in µs, as a routing worker learned it
    /// from its first tokens (`routing::step_phase`).
    ROUTING_DISPATCH_DELAY_US = "kvgate.routing.dispatch_delay_us";
    /// Responses API follow-ups sent to the pod that stored the response they name
    /// (`routing::stored`; `/v1/responses/{id}` calls go there too, uncounted).
    STORED_FOLLOWED = "kvgate.stored.followed";
    /// Those naming a response this Envoy did not see stored, nor heard of from another replica
    /// (before it started, or forgotten past 4,096), nor found by asking the pods: routed as
    /// any request, the engine answers.
    STORED_UNKNOWN = "kvgate.stored.unknown";
    /// Requests naming a stored response this replica had not heard of, held for another
    /// replica's note of it (`etcd.followUpWaitMs`), found or not.
    STORED_WAITED = "kvgate.stored.waited";
    /// Requests naming a stored response no note here names, held while the pods that may store
    /// it were asked for it (`routing.storedLookupMs`), found or not.
    STORED_ASKED = "kvgate.stored.asked";
    /// Of those, the ones a pod answered it stores: sent there.
    STORED_FOUND = "kvgate.stored.found";
    /// Prompt blocks of routed requests.
    PREFIX_BLOCKS_TOTAL = "kvgate.prefix.blocks_total";
    /// Of those, blocks the chosen pod was believed to cache.
    PREFIX_BLOCKS_MATCHED = "kvgate.prefix.blocks_matched";

    // The safe rollout, `routing.mode` / `admission.mode` `observe` (`observe`).
    /// Requests admission would have parked in the line (no pod had room), sent past the budget.
    OBSERVE_WOULD_WAIT = "kvgate.observe.would_wait";
    /// Sheddable requests admission would have refused with 429, sent past the budget.
    OBSERVE_WOULD_SHED = "kvgate.observe.would_shed";
    /// Responses from the host kvgate picked, while Envoy's load balancer chooses.
    OBSERVE_ROUTING_SAME = "kvgate.observe.routing_same";
    /// Responses from another host than kvgate's pick, while Envoy's load balancer chooses.
    OBSERVE_ROUTING_OTHER = "kvgate.observe.routing_other";

    // Pods (`pods::scrape`, `gate`).
    SCRAPE_OK = "kvgate.scrape.ok";
    SCRAPE_ERRORS = "kvgate.scrape.errors";
    DISCOVERY_ERRORS = "kvgate.discovery.errors";
    PODS_TOTAL = "kvgate.pods.total";
    PODS_STALE = "kvgate.pods.stale";
    PODS_UNHEALTHY = "kvgate.pods.unhealthy";

    // The line (`gate`).
    QUEUE_LENGTH = "kvgate.queue.length";
    /// Tickets whose priority is no configured band, so the per-band names stay bounded.
    QUEUE_OTHER_LENGTH = "kvgate.queue.other.length";

    // Admission outcomes (`admission::admit`).
    ADMISSION_ADMITTED = "kvgate.admission.admitted";
    ADMISSION_QUEUED = "kvgate.admission.queued";
    ADMISSION_BOOSTED = "kvgate.admission.boosted";
    ADMISSION_SHED = "kvgate.admission.shed";
    ADMISSION_QUEUE_FULL = "kvgate.admission.queue_full";
    ADMISSION_TIMED_OUT = "kvgate.admission.timed_out";
    ADMISSION_ABANDONED = "kvgate.admission.abandoned";
    /// Requests that waited in a full line until one of higher precedence took their place
    /// (`line::enqueue`), then answered 429.
    ADMISSION_DISPLACED = "kvgate.admission.displaced";
    /// Parked tickets whose stream their VM no longer held, taken out of the line when met at
    /// its head (`drive::retry`): no path is known to leave one, so anything here is a bug.
    ADMISSION_LOST = "kvgate.admission.lost";
    /// Picks, on arrival or from the line, that lost every compare-and-swap to other workers'
    /// writes: the request waited for the next pass rather than pass the budget.
    ADMISSION_CONTENDED = "kvgate.admission.contended";
    ADMISSION_WAIT_MS = "kvgate.admission.wait_ms";
    ADMISSION_WAKE_LATENCY_MS = "kvgate.admission.wake_latency_ms";
    /// The histogram's sum as a counter, so a mean is readable without Prometheus.
    ADMISSION_WAKE_LATENCY_MS_TOTAL = "kvgate.admission.wake_latency_ms_total";
    ADMISSION_WAKES = "kvgate.admission.wakes";
    // The line's cache-friendly order (`drive::run_line`).
    ADMISSION_CACHE_FIRST = "kvgate.admission.cache_first";
    ADMISSION_UNCACHED = "kvgate.admission.uncached";
    ADMISSION_CACHE_WAITS = "kvgate.admission.cache_waits";

    // The estimator against the engine's `usage` (`flow`).
    ESTIMATE_PROMPT_TOKENS = "kvgate.estimate.prompt_tokens";
    ESTIMATE_OUTPUT_TOKENS = "kvgate.estimate.output_tokens";
    ESTIMATE_COST_TOKENS = "kvgate.estimate.cost_tokens";
    USAGE_PROMPT_TOKENS = "kvgate.usage.prompt_tokens";
    USAGE_COMPLETION_TOKENS = "kvgate.usage.completion_tokens";
    USAGE_TOTAL_TOKENS = "kvgate.usage.total_tokens";

    // Models and adapters (`flow`, `pods::scrape`, `routing::router`).
    /// Requests for a model no pod serves, answered 404 by kvgate.
    MODELS_NOT_FOUND = "kvgate.models.not_found";
    /// Requests whose model was rewritten to a target (`models.routes`).
    MODELS_REWRITTEN = "kvgate.models.rewritten";
    /// Requests on paths kvgate does not read whose model it read, to name it in the model
    /// header and send them to a pod listing it (`flow::other_path`).
    OTHER_PATHS_ROUTED = "kvgate.models.other_paths_routed";
    /// Model lists (`/v1/models`) read, and fetches or bodies that failed (the pod keeps its last).
    MODELS_LIST_OK = "kvgate.models.list_ok";
    MODELS_LIST_ERRORS = "kvgate.models.list_errors";
    /// Picks that send a request's adapter to a pod where it is not resident (it is loaded there).
    ADAPTER_LOADS = "kvgate.adapter.loads";
    // The pick (`routing::router`).
    /// Picks that held a hot prefix to the pods caching it, as the pool's KV read as about to run
    /// short (`routing::demand`).
    ROUTING_HOT_PREFIX_HELD = "kvgate.routing.hot_prefix_held";
    // Replicas sharing budgets through etcd (`replicas::sync`, `gate`).
    /// Syncs whose txn etcd applied.
    REPLICAS_SYNCS = "kvgate.replicas.syncs";
    /// Txns that lost a race for a pod's free credit (read again on the next tick).
    REPLICAS_CONFLICTS = "kvgate.replicas.conflicts";
    /// etcd calls that failed or timed out (the replica keeps admitting, within its fallback).
    REPLICAS_ERRORS = "kvgate.replicas.errors";
    /// Prompts the other replicas sent the pods, applied to this replica's prefix index.
    REPLICAS_PLACEMENTS = "kvgate.replicas.placements";
    /// Responses the other replicas' pods stored, noted here for their follow-ups
    /// (`routing::stored`).
    REPLICAS_STORED = "kvgate.replicas.stored";
    /// Compactions of etcd's history this replica made (`etcd.compactionIntervalMs`).
    REPLICAS_COMPACTIONS = "kvgate.replicas.compactions";
    /// Lapsed replicas whose grants this replica reclaimed.
    REPLICAS_RECLAIMED = "kvgate.replicas.reclaimed";
    /// Replicas whose lease etcd holds, as of the last sync.
    REPLICAS_LIVE = "kvgate.replicas.live";
    /// 1 while this replica reaches etcd, 0 while it admits within its fallback.
    REPLICAS_IN_CONTACT = "kvgate.replicas.in_contact";
    /// Answers whose body came encoded (`content-encoding`) in a way kvgate does not decode, so
    /// not metered and not read for usage: their entries grew at the pod's pace
    /// (`Flow::unmetered`).
    RESPONSE_ENCODED = "kvgate.response.encoded";
    /// Answers that came in gzip or brotli and were decoded as they streamed to their end,
    /// metered as plain ones (`flow::decode`).
    RESPONSE_DECODED = "kvgate.response.decoded";
    // What a request costs the proxy (`shell::http`).
    /// Host calls a request's own callbacks made (headers to done), one sample per request.
    REQUEST_HOST_CALLS = "kvgate.request.host_calls";
}

catalog! {
    /// The last segment of a per-pod name, `kvgate.pod.<ip_port>.<segment>` ([`pod_stat`]).
    PodStat;
    /// Every per-pod segment, for the test against docs/operations.md.
    PER_POD;
    POD_PICKS = "picks";
    POD_SCRAPE_ERRORS = "scrape_errors";
    POD_ACTIVE_BLOCKS = "active_blocks";
    POD_IN_FLIGHT = "in_flight";
    POD_RESERVED_TOKENS = "reserved_tokens";
    POD_HELD_TOKENS = "held_tokens";
    POD_UNEXPLAINED_TOKENS = "unexplained_tokens";
    POD_BACKOFF_PERCENT = "backoff_percent";
    POD_RELIEF_PERCENT = "relief_percent";
    POD_BUDGET_TOKENS = "budget_tokens";
    POD_HEALTHY = "healthy";
    /// With several replicas: what this one may reserve on the pod now (`replicas::split::admit_cap`).
    POD_GRANT_TOKENS = "grant_tokens";
    /// With several replicas: the KV the other replicas' requests hold on the pod.
    POD_REMOTE_TOKENS = "remote_tokens";
    /// With several replicas: lapsed replicas' reclaimed grants held out of the pod's split
    /// (`replicas::sync::Ghost`).
    POD_GHOST_TOKENS = "ghost_tokens";
    /// The engine's own KV in use at the last scrape, in blocks: against `active_blocks`, how right
    /// kvgate's prediction is.
    POD_ENGINE_BLOCKS = "engine_blocks";
    /// The engine's prefix-cache counters at the last scrape (`vllm:prefix_cache_hits_total`,
    /// `vllm:prefix_cache_queries_total`, tokens since it started), as gauges.
    POD_ENGINE_PREFIX_HITS = "engine_prefix_hit_tokens";
    POD_ENGINE_PREFIX_QUERIES = "engine_prefix_query_tokens";
    /// Prompt blocks of requests routed to the pod, and of those the blocks kvgate believed it
    /// cached: against the engine's counters, how right the prefix index is.
    POD_PREFIX_BLOCKS_TOTAL = "prefix_blocks_total";
    POD_PREFIX_BLOCKS_MATCHED = "prefix_blocks_matched";
    /// The share of the pod's capacity its prefix index holds, in percent, and the engine
    /// restarts seen, both from the engine's prefix-cache counters (`pods::index_check`).
    POD_INDEX_CAPACITY_PERCENT = "index_capacity_percent";
    POD_ENGINE_RESTARTS = "engine_restarts";
    /// How many requests the engine runs at once, configured or learned from its queue
    /// (`pods::seats`): 0 while unknown.
    POD_ENGINE_SEATS = "engine_seats";
    /// The factor the pick scales the pod's time costs by, learned from its inter-token latency
    /// against the pool's (`pods::pace`), in percent: 100 is the pool's pace or unknown.
    POD_COST_FACTOR_PERCENT = "cost_factor_percent";
}

/// A pod's stat: `kvgate.pod.<ip_port>.<stat>`, the address made one segment by [`pod_segment`].
pub fn pod_stat(pod: &str, stat: PodStat) -> Name<'_> {
    Name::Pod(pod, stat)
}

catalog! {
    /// The last segment of a per-model name, `kvgate.model.<model>.<segment>` ([`model_stat`]).
    ModelStat;
    /// Every per-model segment, for the test against docs/operations.md.
    PER_MODEL;
    /// Requests for the model (as sent, after any rename) that kvgate decided on.
    MODEL_REQUESTS = "requests";
    /// Of those, requests routed to a pod kvgate picked.
    MODEL_PICKS = "picks";
    /// A histogram of the waits in the line of requests admitted after waiting.
    MODEL_QUEUE_WAIT_MS = "queue_wait_ms";
    /// Tokens the engines reported in `usage`.
    MODEL_PROMPT_TOKENS = "prompt_tokens";
    MODEL_COMPLETION_TOKENS = "completion_tokens";
    /// Histograms of each answer's estimate error against its `usage`, in percent of what the
    /// engine counted: the prompt estimate, and the expected output (`estimate::reservation`).
    MODEL_PROMPT_ERROR_PCT = "prompt_error_pct";
    MODEL_OUTPUT_ERROR_PCT = "output_error_pct";
    /// A gauge, for each base model the pods list: the mean answer a request without an output
    /// limit is expected to run until kvgate has learned the model's lengths
    /// (`calibration::output_prior`).
    MODEL_OUTPUT_PRIOR_TOKENS = "output_prior_tokens";
}

/// Stands for every model without stats of its own (neither configured nor listed by a pod),
/// so client-chosen names cannot grow the stat set.
pub const OTHER_MODEL: &str = "other";
/// Characters of a model name kept in its stat segment.
const MODEL_SEGMENT_CHARS: usize = 64;

/// A model's stat: `kvgate.model.<model>.<stat>`, the name made one bounded segment (characters
/// other than ASCII letters and digits become `_`).
pub fn model_stat(model: &str, stat: ModelStat) -> Name<'_> {
    Name::Model(model, stat)
}

/// Tickets waiting in one configured priority band: `kvgate.queue.priority_<band>.length`, a
/// negative band spelt `minus_<n>` (Envoy stat names have no `-`).
pub fn queue_band_length(band: i32) -> Name<'static> {
    Name::Band(band)
}

/// Envoy stat names use dots as separators; a pod's `ip:port` becomes `ip_port` with dots kept
/// out, so it stays one segment.
pub fn pod_segment(pod: &str) -> String {
    pod.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// A stat as the code names it: a fixed name, or the parts of a per-pod, per-model or per-band
/// one. Its full name (`Display`) is built once, the first time [`Stats`] sees it, so the stats a
/// request counts neither format nor allocate a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Name<'a> {
    Fixed(Fixed),
    Pod(&'a str, PodStat),
    Model(&'a str, ModelStat),
    Band(i32),
}

impl From<Fixed> for Name<'static> {
    fn from(name: Fixed) -> Self {
        Name::Fixed(name)
    }
}

impl std::fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Name::Fixed(name) => f.write_str(name.name()),
            Name::Pod(pod, stat) => {
                write!(f, "kvgate.pod.{}.{}", pod_segment(pod), stat.name())
            }
            Name::Model(model, stat) => {
                let segment: String = pod_segment(model)
                    .chars()
                    .take(MODEL_SEGMENT_CHARS)
                    .collect();
                write!(f, "kvgate.model.{segment}.{}", stat.name())
            }
            Name::Band(band) => {
                f.write_str(&format!("kvgate.queue.priority_{band}.length").replace('-', "minus_"))
            }
        }
    }
}

/// Slots by a table's index (`None` until the name is first counted).
type BySegment = Vec<Option<usize>>;

/// The slot of the name at `index`, the table grown to hold it.
fn at(slots: &mut BySegment, index: usize) -> &mut Option<usize> {
    if slots.len() <= index {
        slots.resize(index + 1, None);
    }
    &mut slots[index]
}

/// Names the registry holds before it starts over (at a send, when nothing waits): names are
/// bounded (fixed ones, a set per pod, model and band) but pods come and go over a long life.
/// Room for about 3,000 pods' names; Envoy keeps every stat it was given either way.
const NAMES_MAX: usize = 1 << 16;

/// One name this VM has counted: its full name, what waits to be sent under it, and the id the
/// host gave it.
#[derive(Debug)]
struct Slot {
    name: String,
    /// Counted since the last send.
    count: u64,
    /// Set since the last send: the last value.
    gauge: Option<u64>,
    host_id: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A value [`Stats::send`] hands over.
pub struct Sent<'a> {
    pub name: &'a str,
    pub kind: Kind,
    pub value: u64,
    /// The host's id for the name, kept from the send that defined it (`None` before): a metric
    /// is defined once, not looked up by name on every send.
    pub host_id: &'a mut Option<u32>,
}

/// The stats counted since the last send, kept as the host takes them: counters summed and gauges
/// at their last value per name as they are counted, every histogram sample in order. Each name
/// is registered once (its full name built then); counting it again is a lookup by its parts.
#[derive(Debug, Default)]
pub struct Stats {
    /// Where each name's slot is: a fixed one by its index, a pod's or a model's by the subject
    /// (one lookup of its name) then the segment's index, a band's by the band.
    fixed: BySegment,
    pods: hashbrown::HashMap<Box<str>, BySegment>,
    models: hashbrown::HashMap<Box<str>, BySegment>,
    bands: hashbrown::HashMap<i32, Option<usize>>,
    slots: Vec<Slot>,
    /// Slots with a count or a gauge to send, each once, in the order first touched.
    touched: Vec<usize>,
    histograms: Vec<(usize, u64)>,
}

impl Stats {
    fn slot(&mut self, name: Name) -> usize {
        let Stats {
            fixed,
            pods,
            models,
            bands,
            slots,
            ..
        } = self;
        let at = match name {
            Name::Fixed(stat) => at(fixed, stat as usize),
            Name::Pod(pod, stat) => at(pods.entry_ref(pod).or_default(), stat as usize),
            Name::Model(model, stat) => at(models.entry_ref(model).or_default(), stat as usize),
            Name::Band(band) => bands.entry(band).or_default(),
        };
        if let Some(id) = *at {
            return id;
        }
        let id = slots.len();
        *at = Some(id);
        slots.push(Slot {
            name: name.to_string(),
            count: 0,
            gauge: None,
            host_id: None,
        });
        id
    }

    /// The slot of `name`, noted as touched the first time since the last send.
    fn touch(&mut self, name: Name) -> Option<&mut Slot> {
        let id = self.slot(name);
        let slot = self.slots.get_mut(id)?;
        if slot.count == 0 && slot.gauge.is_none() {
            self.touched.push(id);
        }
        Some(slot)
    }

    pub fn count<'a>(&mut self, name: impl Into<Name<'a>>, by: u64) {
        if by == 0 {
            return;
        }
        if let Some(slot) = self.touch(name.into()) {
            slot.count = slot.count.saturating_add(by);
        }
    }

    pub fn gauge<'a>(&mut self, name: impl Into<Name<'a>>, value: u64) {
        if let Some(slot) = self.touch(name.into()) {
            slot.gauge = Some(value);
        }
    }

    pub fn histogram<'a>(&mut self, name: impl Into<Name<'a>>, value: u64) {
        let id = self.slot(name.into());
        self.histograms.push((id, value));
    }

    /// Values waiting to be sent: one host call each.
    pub fn len(&self) -> usize {
        self.touched.len() + self.histograms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hands every waiting value to `send` and forgets it: each counter's sum since the last
    /// send, each gauge's last value, every histogram sample.
    pub fn send(&mut self, mut send: impl FnMut(Sent<'_>)) {
        for id in self.touched.drain(..) {
            let Some(slot) = self.slots.get_mut(id) else {
                continue;
            };
            if slot.count > 0 {
                send(Sent {
                    name: &slot.name,
                    kind: Kind::Counter,
                    value: std::mem::take(&mut slot.count),
                    host_id: &mut slot.host_id,
                });
            }
            if let Some(value) = slot.gauge.take() {
                send(Sent {
                    name: &slot.name,
                    kind: Kind::Gauge,
                    value,
                    host_id: &mut slot.host_id,
                });
            }
        }
        for (id, value) in self.histograms.drain(..) {
            if let Some(slot) = self.slots.get_mut(id) {
                send(Sent {
                    name: &slot.name,
                    kind: Kind::Histogram,
                    value,
                    host_id: &mut slot.host_id,
                });
            }
        }
        if self.slots.len() > NAMES_MAX {
            *self = Stats::default();
        }
    }

    /// Sends nothing: takes what waits, as `send` hands it over (tests).
    #[cfg(test)]
    pub fn drain(&mut self) -> std::vec::IntoIter<Stat> {
        let mut out = Vec::new();
        self.send(|s| {
            let name = s.name.to_string();
            out.push(match s.kind {
                Kind::Counter => Stat::Counter(name, s.value),
                Kind::Gauge => Stat::Gauge(name, s.value),
                Kind::Histogram => Stat::Histogram(name, s.value),
            });
        });
        out.into_iter()
    }

    /// Sends nothing: takes what waits, returning what was counted under `name` (tests).
    #[cfg(test)]
    pub fn take_count<'a>(&mut self, name: impl Into<Name<'a>>) -> u64 {
        let name = name.into().to_string();
        self.drain()
            .filter_map(|s| match s {
                Stat::Counter(n, by) if n == name => Some(by),
                _ => None,
            })
            .sum()
    }
}

/// A value as sent, with its full name (tests).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stat {
    Counter(String, u64),
    Gauge(String, u64),
    Histogram(String, u64),
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
        s.count(ROUTED, 0);
        s.count(ROUTE_ERRORS, 2);
        s.gauge(PODS_TOTAL, 0);
        let out: Vec<Stat> = s.drain().collect();
        assert_eq!(
            out,
            vec![
                Stat::Counter("kvgate.route.errors".into(), 2),
                Stat::Gauge("kvgate.pods.total".into(), 0)
            ]
        );
    }

    #[test]
    fn a_send_carries_each_counters_sum_each_gauges_last_value_and_every_sample() {
        let mut s = Stats::default();
        for pod in ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.1:80"] {
            s.count(pod_stat(pod, POD_PICKS), 1);
            s.gauge(pod_stat(pod, POD_IN_FLIGHT), pod.len() as u64);
            s.histogram(model_stat("m", MODEL_QUEUE_WAIT_MS), 5);
        }
        s.count(ROUTED, u64::MAX);
        s.count(ROUTED, 1);
        s.gauge(pod_stat("10.0.0.1:80", POD_IN_FLIGHT), 7);
        assert_eq!(s.len(), 5 + 3);
        let out: Vec<Stat> = s.drain().collect();
        let wait = || Stat::Histogram("kvgate.model.m.queue_wait_ms".into(), 5);
        assert_eq!(
            out,
            vec![
                Stat::Counter("kvgate.pod.10_0_0_1_80.picks".into(), 2),
                Stat::Gauge("kvgate.pod.10_0_0_1_80.in_flight".into(), 7),
                Stat::Counter("kvgate.pod.10_0_0_2_80.picks".into(), 1),
                Stat::Gauge("kvgate.pod.10_0_0_2_80.in_flight".into(), 11),
                Stat::Counter("kvgate.routed".into(), u64::MAX),
                wait(),
                wait(),
                wait(),
            ]
        );
        assert!(s.is_empty());
        assert_eq!(s.drain().count(), 0, "nothing waits after a send");
    }

    #[test]
    fn the_hosts_id_for_a_name_is_kept_from_send_to_send() {
        let mut s = Stats::default();
        let mut defined = Vec::new();
        for round in 0..3 {
            s.count(ROUTED, 1);
            s.histogram(REQUEST_HOST_CALLS, round);
            s.send(|sent| {
                if sent.host_id.is_none() {
                    defined.push(sent.name.to_string());
                    *sent.host_id = Some(defined.len() as u32);
                }
            });
        }
        assert_eq!(defined, ["kvgate.routed", "kvgate.request.host_calls"]);
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
        catalog.extend(PER_POD.iter().map(|s| format!("kvgate.pod.<ip_port>.{s}")));
        catalog.push(
            queue_band_length(0)
                .to_string()
                .replace("priority_0", "priority_<p>"),
        );
        catalog.extend(
            PER_MODEL
                .iter()
                .map(|s| format!("kvgate.model.<model>.{s}")),
        );
        let mut documented = documented();
        catalog.sort();
        documented.sort();
        assert_eq!(
            documented, catalog,
            "docs/operations.md's stats table vs src/stats.rs"
        );
    }

    /// monitoring/prometheus.yml turns every per-pod and per-model stat, and no other, into one
    /// series with a `pod` or `model` label: its relabelling names each stat of the catalog.
    #[test]
    fn the_prometheus_relabelling_names_every_per_pod_and_per_model_stat() {
        let job = include_str!("../monitoring/prometheus.yml");
        let named = |prefix: &str| -> Vec<Vec<String>> {
            job.lines()
                .filter_map(|l| l.trim().strip_prefix("regex: "))
                .filter_map(|r| r.strip_prefix(prefix))
                .filter_map(|r| r.split_once('(').map(|(_, rest)| rest))
                .filter_map(|r| r.split_once(')').map(|(alternatives, _)| alternatives))
                .map(|a| {
                    let mut names: Vec<String> = a.split('|').map(str::to_string).collect();
                    names.sort();
                    names
                })
                .collect()
        };
        for (prefix, table) in [
            ("kvgate_pod_(.+)_", PER_POD),
            ("kvgate_model_(.+)_", PER_MODEL),
        ] {
            let mut catalog: Vec<String> = table.iter().map(|s| s.to_string()).collect();
            catalog.sort();
            let rules = named(prefix);
            assert_eq!(rules.len(), 2, "{prefix}: a label rule and a name rule");
            for names in rules {
                assert_eq!(names, catalog, "monitoring/prometheus.yml's {prefix} rules");
            }
        }
    }

    #[test]
    fn model_names_become_one_bounded_segment() {
        assert_eq!(
            model_stat("meta-llama/Llama-3.1-8B", MODEL_PICKS).to_string(),
            "kvgate.model.meta_llama_Llama_3_1_8B.picks"
        );
        assert_eq!(
            model_stat(&"é".repeat(500), MODEL_PICKS).to_string().len(),
            83
        );
    }

    #[test]
    fn band_and_pod_names_are_bounded_segments() {
        assert_eq!(
            queue_band_length(-1).to_string(),
            "kvgate.queue.priority_minus_1.length"
        );
        assert_eq!(
            pod_stat("10.0.0.1:8000", POD_PICKS).to_string(),
            "kvgate.pod.10_0_0_1_8000.picks"
        );
    }
}
