//! The one scraper across all workers: a lease in shared data (`store::lease`) decides which VM
//! scrapes; the holder renews it every tick and another VM takes over once it lapses. The holder
//! discovers pods from Envoy's admin `/clusters`, scrapes each pod's Prometheus metrics on its
//! interval, writing results into the pods' shared records, and each pod's model list on a slower
//! one (with the adapter state from its metrics, into `models::served`); the answers each pod's
//! engines report having finished are pooled per model for the output prior
//! (`estimate::engine_lengths`). This module plans the calls and reads their answers; the shell
//! only sends them.

use crate::config::Config;
use crate::estimate::engine_lengths::EngineLengths;
use crate::gate::TICK_MS;
use crate::models::served::{self, LoraState};
use crate::pods::index_check::HitTotals;
use crate::pods::metrics;
use crate::pods::pool::{decode_pods, encode_pods, PODS_KEY};
use crate::pods::record::{self, Snapshot, Tally};
use crate::stats::{self, Stats};
use crate::store::interface::{Store, StoreError};
use hashbrown::{HashMap, HashSet};
use serde::Deserialize;

/// A call for the shell to send with `dispatch_http_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub target: Target,
    pub cluster: String,
    pub path: String,
    /// Headers besides :method and :path (authority, original-destination host).
    pub headers: Vec<(String, String)>,
    /// A POST's body; `None` sends a GET.
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    Pod(String),
    /// A pod's model list (`models.path`).
    Models(String),
    Discovery,
    /// etcd's JSON gateway, for the replicas' sync (`replicas::sync`: one call at a time).
    Etcd,
    /// A pod asked whether it stores a response a request names (`routing::stored_ask`): sent
    /// and answered in that request's own context, never the gate's.
    Stored(String),
}

/// How long after a VM starts its requests may wait for the first discovery while no pod is
/// known (`Router::discovering`): the first tick, the admin call's timeout, and the tick of one
/// more try (while no pod is known discovery is asked at every tick, not an interval later).
pub fn first_discovery_ms(cfg: &Config) -> u64 {
    2 * TICK_MS + cfg.discovery.timeout_ms
}

/// How long after a VM first sees a pod a request for a model no list names waits for the pod's
/// first list (`models::served`): the lease holder's next tick, the list call's timeout, and a
/// tick to spare; 0 while lists are not fetched (no `models.path` or `metrics.cluster`), when
/// nothing is awaited.
pub fn first_list_ms(cfg: &Config) -> u64 {
    if cfg.models.path.is_empty() || cfg.metrics.cluster.is_empty() {
        0
    } else {
        2 * TICK_MS + cfg.models.timeout_ms
    }
}

/// The most discovery waits while requests wait in the line (`Scraper::due`).
pub const WAITING_DISCOVERY_MS: u64 = 1_000;

/// Scrapes in a row that a pod answered without metrics kvgate can read (an error status, a page
/// of no known series, garbage) before it is admitted to without its capacity
/// (`Scraper::unreadable`).
pub const UNREADABLE_SCRAPES: u32 = 3;

#[derive(Default)]
pub struct Scraper {
    next_scrape: HashMap<String, u64>,
    next_models: HashMap<String, u64>,
    next_discovery: u64,
    /// When discovery was last sent: an ask (`pool::ask_discovery`) since then sends it again.
    discovery_sent: u64,
    /// Pods the last discovery found gone, until one finds them again: not scraped meanwhile (a
    /// scrape would mark them up again in the records of VMs whose pool is a second old).
    departed: HashSet<String>,
    /// Each target's call outstanding: when it was sent, and its deadline.
    in_flight: HashMap<Target, Outstanding>,
    /// Pod → scrapes in a row it answered without readable metrics.
    unreadable: HashMap<String, u32>,
    /// Each pod's finished answers, pooled per model for the output prior.
    lengths: EngineLengths,
}

/// A call sent and not yet answered.
#[derive(Debug, Clone, Copy)]
struct Outstanding {
    sent_ms: u64,
    deadline_ms: u64,
}

impl Outstanding {
    fn from(now: u64, timeout_ms: u64) -> Outstanding {
        Outstanding {
            sent_ms: now,
            deadline_ms: now.saturating_add(timeout_ms),
        }
    }
}

impl Scraper {
    /// The calls due now; `asked`: when a worker last asked for discovery (`pool::discovery_asked`);
    /// `waiting`: whether requests wait in the line. A target with a call still outstanding is
    /// skipped.
    pub fn due(
        &mut self,
        cfg: &Config,
        pods: &[String],
        now: u64,
        asked: Option<u64>,
        waiting: bool,
    ) -> Vec<Call> {
        // Kept while this VM's pool still lists the pod or a call to it is out: rollouts leave
        // a new address behind each time, and only those can mark a departed pod up again.
        let in_flight = &self.in_flight;
        self.departed.retain(|p| {
            pods.contains(p)
                || in_flight.contains_key(&Target::Pod(p.clone()))
                || in_flight.contains_key(&Target::Models(p.clone()))
        });
        let mut calls = Vec::new();
        let d = &cfg.discovery;
        let asked = asked.is_some_and(|at| at >= self.discovery_sent);
        // While requests wait, at least every `WAITING_DISCOVERY_MS`, whatever was planned: a
        // pool is scaled out when it is full, and each second a new pod goes unseen its room
        // goes unused.
        let waited = waiting
            && now
                >= self
                    .discovery_sent
                    .saturating_add(d.interval_ms.min(WAITING_DISCOVERY_MS));
        if !d.admin_cluster.is_empty()
            && (now >= self.next_discovery || asked || waited)
            && !self.in_flight.contains_key(&Target::Discovery)
        {
            self.discovery_sent = now;
            // While no pod is known (the gateway starting, its cluster not yet populated or
            // empty), discovery is asked again at every tick, not an interval later.
            let every = if pods.is_empty() { 0 } else { d.interval_ms };
            self.next_discovery = now.saturating_add(every);
            self.in_flight
                .insert(Target::Discovery, Outstanding::from(now, d.timeout_ms));
            calls.push(Call {
                target: Target::Discovery,
                cluster: d.admin_cluster.clone(),
                path: "/clusters?format=json".into(),
                headers: vec![(":authority".into(), "envoy-admin".into())],
                body: None,
                timeout_ms: d.timeout_ms,
            });
        }
        let m = &cfg.metrics;
        if m.cluster.is_empty() {
            return calls;
        }
        self.next_scrape.retain(|p, _| pods.contains(p));
        self.next_models.retain(|p, _| pods.contains(p));
        self.unreadable.retain(|p, _| pods.contains(p));
        let md = &cfg.models;
        for pod in pods.iter().filter(|p| !self.departed.contains(*p)) {
            let metrics = (
                Target::Pod(pod.clone()),
                &m.path,
                m.interval_ms,
                m.timeout_ms,
            );
            let models = (
                Target::Models(pod.clone()),
                &md.path,
                md.interval_ms,
                md.timeout_ms,
            );
            for (target, path, interval, timeout) in [metrics, models] {
                let next = match target {
                    Target::Models(_) => &mut self.next_models,
                    _ => &mut self.next_scrape,
                };
                let due = next.get(pod).copied().unwrap_or(0);
                if path.is_empty() || now < due || self.in_flight.contains_key(&target) {
                    continue;
                }
                next.insert(pod.clone(), now.saturating_add(interval));
                self.in_flight
                    .insert(target.clone(), Outstanding::from(now, timeout));
                calls.push(Call {
                    target,
                    cluster: m.cluster.clone(),
                    path: path.clone(),
                    headers: vec![
                        (":authority".into(), pod.clone()),
                        ("x-envoy-original-dst-host".into(), pod.clone()),
                    ],
                    body: None,
                    timeout_ms: timeout,
                });
            }
        }
        calls
    }

    /// A call could not be sent at all. A pod's scrape that cannot be sent (no such cluster in
    /// Envoy: `metrics.cluster` names none) reads nothing, as an unreadable page does; returns
    /// whether that opened the pod (`unreadable`). A model list that cannot be sent failed.
    pub fn abandon(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        target: &Target,
    ) -> Result<bool, StoreError> {
        self.in_flight.remove(target);
        match target {
            Target::Pod(pod) => self.unreadable(store, cfg, pod, None, store.now_ms()),
            Target::Models(pod) => {
                served::write_failure(store, pod, store.now_ms()).map(|()| false)
            }
            _ => Ok(false),
        }
    }

    /// Reads an answer (`status` None when Envoy had no response: reset, timeout, no host);
    /// returns whether it opened pods to more requests (discovered ones, a pod's first healthy
    /// scrape or first model list), for which waiting requests need not wait for the next tick.
    pub fn on_response(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        stats: &mut Stats,
        target: &Target,
        status: Option<u32>,
        body: &[u8],
    ) -> Result<bool, StoreError> {
        let sent = self.in_flight.remove(target).map(|call| call.sent_ms);
        let now = store.now_ms();
        match target {
            Target::Discovery => {
                let Some(pods) = (status == Some(200))
                    .then(|| parse_clusters(body, &cfg.discovery.model_cluster))
                    .flatten()
                else {
                    stats.count(stats::DISCOVERY_ERRORS, 1);
                    return Ok(false);
                };
                self.departed.retain(|p| !pods.contains(p));
                let (opened, departed) = publish_pods(store, &pods, now)?;
                self.departed.extend(departed);
                Ok(opened)
            }
            Target::Models(pod) | Target::Pod(pod) if self.departed.contains(pod) => Ok(false),
            Target::Models(pod) => {
                let parsed = match status {
                    Some(200) => served::parse_list(body).map_err(|e| e.0),
                    other => Err(format!("status {other:?}")),
                };
                match parsed {
                    // A pod's first list opens it to the requests waiting for it.
                    Ok(models) => {
                        stats.count(stats::MODELS_LIST_OK, 1);
                        served::write_list(store, pod, &models, now)
                    }
                    Err(e) => {
                        // The pod keeps its last known models: a failed list is not an empty one.
                        log::debug!("model list of {pod}: {e}");
                        stats.count(stats::MODELS_LIST_ERRORS, 1);
                        served::write_failure(store, pod, now).map(|()| false)
                    }
                }
            }
            Target::Pod(pod) => {
                // The pod as it was when asked (`Snapshot::at_ms`). An answer to a call this VM
                // no longer awaits (forgotten past its timeout: one sent since may have been
                // answered already) says nothing newer than what the record holds.
                let Some(at) = sent else {
                    log::debug!("pod {pod}: an answer to a scrape no longer awaited, dropped");
                    return Ok(false);
                };
                let parsed = (status == Some(200)).then(|| metrics::parse_bytes(body));
                match parsed {
                    Some(Ok(m)) => {
                        stats.count(stats::SCRAPE_OK, 1);
                        self.unreadable.remove(pod);
                        if let Some(l) = metrics::lora_info(body) {
                            let lora = LoraState {
                                at_ms: now,
                                max_lora: l.max_lora,
                                running: served::adapter_ids(&l.running),
                                waiting: served::adapter_ids(&l.waiting),
                            };
                            served::write_lora(store, pod, lora)?;
                        }
                        engine_gauges(stats, pod, &m);
                        if let Some(answers) = m.answers {
                            self.lengths.note(store, pod, answers, now)?;
                        }
                        let snapshot = Snapshot {
                            at_ms: at,
                            healthy: true,
                            running: m.running.unwrap_or(0.0),
                            waiting: m.waiting.unwrap_or(0.0),
                            kv_usage: m.kv_usage.unwrap_or(f64::NAN),
                            capacity_tokens: m.capacity_tokens.unwrap_or(0),
                            block_size: m.block_size.unwrap_or(0) as u32,
                            no_prefix_caching: m.no_prefix_caching,
                            preemptions: m.preemptions.unwrap_or(f64::NAN),
                            itl_totals: m.itl,
                            hit_totals: hit_totals(&m),
                            ..Snapshot::default()
                        };
                        record::write_snapshot(
                            store,
                            pod,
                            snapshot,
                            cfg.metrics.waiting_grace_ms,
                            cfg,
                        )
                    }
                    _ => {
                        stats.count(stats::SCRAPE_ERRORS, 1);
                        stats.count(stats::pod_stat(pod, stats::POD_SCRAPE_ERRORS), 1);
                        if refused(status, body) {
                            // Down, not merely slow: avoid it until a scrape succeeds again.
                            self.unreadable.remove(pod);
                            let down = Snapshot {
                                at_ms: at,
                                healthy: false,
                                kv_usage: f64::NAN,
                                ..Snapshot::default()
                            };
                            record::write_snapshot(store, pod, down, 0, cfg)?;
                            return Ok(false);
                        }
                        self.unreadable(store, cfg, pod, status, at)
                    }
                }
            }
            // The gate hands etcd's answers to the replicas' sync; a pod asked for a stored
            // response answers the request that asked.
            Target::Etcd | Target::Stored(_) => Ok(false),
        }
    }

    /// A pod answered its scrape without metrics kvgate can read. Until a pod's first scrape
    /// says how large it is, it takes one request at a time (`admission::budget`); a pod whose
    /// metrics never come (SGLang started without `--enable-metrics` answers 404, a page behind
    /// an auth proxy, an exporter kvgate does not know) would take one for good, a pool of such
    /// pods running a request per pod. After `UNREADABLE_SCRAPES` in a row it is taken as
    /// healthy with its size unknown, which admission does not bound (`admission.budgetTokens`
    /// still does), routed on kvgate's own accounting, once; a pod back from down keeps the
    /// size an earlier scrape said (`record::write_snapshot`). A pod whose last snapshot is
    /// healthy is left to it (stale, `metrics.stalePolicy`). Returns whether that opened the pod.
    fn unreadable(
        &mut self,
        store: &dyn Store,
        cfg: &Config,
        pod: &str,
        status: Option<u32>,
        now: u64,
    ) -> Result<bool, StoreError> {
        let n = self.unreadable.entry_ref(pod).or_insert(0);
        *n = n.saturating_add(1);
        if *n != UNREADABLE_SCRAPES
            || record::read(store, pod)?
                .snapshot
                .is_some_and(|s| s.healthy)
        {
            return Ok(false);
        }
        log::warn!(
            "pod {pod}: {UNREADABLE_SCRAPES} scrapes of {} in a row without metrics kvgate reads (last status {status:?}); \
             admitting to it without its KV capacity: enable the engine's metrics (SGLang: --enable-metrics) or set admission.budgetTokens",
            cfg.metrics.path
        );
        let unknown = Snapshot {
            at_ms: now,
            healthy: true,
            kv_usage: f64::NAN,
            preemptions: f64::NAN,
            ..Snapshot::default()
        };
        record::write_snapshot(store, pod, unknown, 0, cfg)
    }

    /// Calls outstanding past their timeout (the host never answered) are forgotten.
    pub fn expire(&mut self, now: u64) {
        self.in_flight
            .retain(|_, call| call.deadline_ms.saturating_add(1_000) > now);
        self.lengths.expire(now);
    }
}

/// The engine's own view of the pod, beside kvgate's (`active_blocks`, the per-pod prefix
/// counters): KV in use in blocks, and its prefix-cache counters, as far as the page says.
fn engine_gauges(stats: &mut Stats, pod: &str, m: &metrics::PodMetrics) {
    if let (Some(usage), Some(capacity), Some(block)) =
        (m.kv_usage, m.capacity_tokens, m.block_size)
    {
        if usage.is_finite() && block > 0 {
            let blocks = usage.clamp(0.0, 1.0) * capacity as f64 / block as f64;
            stats.gauge(
                stats::pod_stat(pod, stats::POD_ENGINE_BLOCKS),
                blocks.round() as u64,
            );
        }
    }
    for (stat, value) in [
        (stats::POD_ENGINE_PREFIX_HITS, m.prefix_cache_hits),
        (stats::POD_ENGINE_PREFIX_QUERIES, m.prefix_cache_queries),
    ] {
        if let Some(v) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            stats.gauge(stats::pod_stat(pod, stat), v.round() as u64);
        }
    }
}

/// The engine's prefix-cache counters, when the page has both (`index_check` completes the
/// baseline with the record's tally).
fn hit_totals(m: &metrics::PodMetrics) -> Option<HitTotals> {
    match (m.prefix_cache_hits, m.prefix_cache_queries) {
        (Some(hits), Some(queries))
            if hits.is_finite() && queries.is_finite() && hits >= 0.0 && queries >= 0.0 =>
        {
            Some(HitTotals {
                hits,
                queries,
                tally: Tally::default(),
            })
        }
        _ => None,
    }
}

/// Envoy answers a callout to a host that refuses connections, or does not accept them in time,
/// with its own 503 ("upstream connect error or disconnect/reset before headers. reset reason:
/// remote connection failure ... Connection refused", or "... connection timeout"). Other resets
/// before headers ("connection termination": a pooled connection closed under the request;
/// "overflow": a circuit breaker) say nothing of the pod's health: an error, not a refusal.
fn refused(status: Option<u32>, body: &[u8]) -> bool {
    status.is_none()
        || (status == Some(503)
            && std::str::from_utf8(body).is_ok_and(|b| {
                b.contains("connection failure")
                    || b.contains("connection timeout")
                    || b.contains("Connection refused")
            }))
}

#[derive(Deserialize)]
struct Clusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    address: Address,
}

#[derive(Deserialize)]
struct Address {
    socket_address: SocketAddress,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    port_value: u16,
}

/// The hosts of `cluster` in Envoy's admin `/clusters?format=json`, as `ip:port`. `None` when the
/// document is not that, or does not list the cluster (a missing cluster must not empty the pool).
pub fn parse_clusters(body: &[u8], cluster: &str) -> Option<Vec<String>> {
    let doc: Clusters = serde_json::from_slice(body).ok()?;
    let c = doc
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)?;
    let mut pods: Vec<String> = c
        .host_statuses
        .into_iter()
        .map(|h| {
            let a = h.address.socket_address;
            if a.address.contains(':') {
                format!("[{}]:{}", a.address, a.port_value)
            } else {
                format!("{}:{}", a.address, a.port_value)
            }
        })
        .collect();
    pods.sort();
    pods.dedup();
    Some(pods)
}

/// Writes the discovered pod set: new pods' records are created first (so no request can race
/// their creation), departed pods' records are marked down (`record::depart`). Returns whether
/// pods joined (they open the line) and the pods that left. An empty set is never the first one
/// written: a cluster not populated yet (EDS at start) is not a pool, and the gateway's first
/// requests wait for the first that has pods (`Router::discovering`, bounded).
pub fn publish_pods(
    store: &dyn Store,
    pods: &[String],
    now: u64,
) -> Result<(bool, Vec<String>), StoreError> {
    let old = store
        .get(PODS_KEY)?
        .value
        .and_then(|b| decode_pods(&b))
        .unwrap_or_default();
    if old == pods {
        return Ok((false, Vec::new()));
    }
    for p in pods.iter().filter(|p| !old.contains(p)) {
        record::ensure(store, p)?;
    }
    store.set(PODS_KEY, &encode_pods(pods), None)?;
    let joined = pods.iter().any(|p| !old.contains(p));
    let departed: Vec<String> = old.into_iter().filter(|p| !pods.contains(p)).collect();
    for p in &departed {
        record::depart(store, p, now)?;
    }
    Ok((joined, departed))
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::pods::pace;
    use crate::store::fake_host::FakeHost;
    use crate::test_support::clusters_json;

    impl Scraper {
        /// A call to `target` sent now and answered at once.
        fn answer(
            &mut self,
            store: &dyn Store,
            cfg: &Config,
            stats: &mut Stats,
            target: &Target,
            status: Option<u32>,
            body: &[u8],
        ) -> Result<bool, StoreError> {
            let timeout = cfg.metrics.timeout_ms;
            self.in_flight
                .insert(target.clone(), Outstanding::from(store.now_ms(), timeout));
            self.on_response(store, cfg, stats, target, status, body)
        }
    }

    fn cfg() -> Config {
        let mut c = crate::test_support::with_pods(&["a:1", "b:1"]);
        c.metrics.cluster = "kvgate_metrics".into();
        c.discovery.admin_cluster = "kvgate_admin".into();
        c
    }

    #[test]
    fn scrapes_each_pod_once_per_interval() {
        let c = cfg();
        let mut s = Scraper::default();
        let first = s.due(&c, &c.pods, 0, None, false);
        assert_eq!(
            first.len(),
            5,
            "discovery, and each pod's metrics and model list"
        );
        let pod_call = first
            .iter()
            .find(|c| c.target == Target::Pod("a:1".into()))
            .unwrap();
        assert!(pod_call
            .headers
            .contains(&("x-envoy-original-dst-host".into(), "a:1".into())));
        assert!(s.due(&c, &c.pods, 10, None, false).is_empty(), "in flight");
        let host = FakeHost::new();
        let vm = host.vm();
        let mut stats = Stats::default();
        for call in &first {
            s.answer(&vm, &c, &mut stats, &call.target, Some(500), b"")
                .unwrap();
        }
        assert!(
            s.due(&c, &c.pods, 999, None, false).is_empty(),
            "not due yet"
        );
        assert_eq!(
            s.due(&c, &c.pods, 1_000, None, false).len(),
            2,
            "metrics again, not the lists"
        );
        let later: Vec<Target> = s
            .due(&c, &c.pods, 10_000, None, false)
            .into_iter()
            .map(|c| c.target)
            .collect();
        assert!(
            later.contains(&Target::Models("a:1".into())) && later.len() == 3,
            "{later:?}"
        );
    }

    #[test]
    fn a_pods_first_healthy_scrape_or_list_and_pods_discovered_open_the_line_and_nothing_else_does()
    {
        let c = cfg();
        let vm = FakeHost::new().vm();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let mut answer = |target: Target, status, body: &[u8]| {
            s.answer(&vm, &c, &mut stats, &target, status, body)
                .unwrap()
        };
        let pod = || Target::Pod("a:1".into());
        let page = b"vllm:num_requests_running{model_name=\"m\"} 1\n";
        assert!(answer(pod(), Some(200), page), "its first scrape");
        assert!(!answer(pod(), Some(200), page), "a later one");
        assert!(!answer(pod(), None, b""), "refused: down");
        assert!(answer(pod(), Some(200), page), "back up");
        let (one, two) = (clusters_json(&["a:1"]), clusters_json(&["a:1", "b:1"]));
        assert!(answer(Target::Discovery, Some(200), &one));
        assert!(!answer(Target::Discovery, Some(200), &one), "no change");
        assert!(answer(Target::Discovery, Some(200), &two), "b joined");
        assert!(!answer(Target::Discovery, Some(200), &one), "b left");
        // A pod's first model list opens it to requests waiting to learn who serves their model;
        // a failed one records the failure (nobody waits for that pod's list), and is no list.
        let models = || Target::Models("a:1".into());
        let list = br#"{"data":[{"id":"m"}]}"#;
        assert!(!answer(models(), Some(200), br#"{"data":[]}"#));
        assert!(served::read(&vm, "a:1").unwrap().failed_ms.is_some());
        assert!(answer(models(), Some(200), list), "its first list");
        assert!(!answer(models(), Some(200), list), "a later one");
        assert!(s.abandon(&vm, &c, &Target::Models("b:1".into())).is_ok());
        let never_sent = served::read(&vm, "b:1").unwrap();
        assert!(never_sent.failed_ms.is_some() && never_sent.listed_ms.is_none());
    }

    #[test]
    fn a_pod_whose_metrics_cannot_be_read_is_admitted_to_unbounded_after_a_few_scrapes() {
        use crate::admission::budget::budget_tokens;
        let c = cfg();
        let vm = FakeHost::new().vm();
        let (mut s, mut stats) = (Scraper::default(), Stats::default());
        let mut answer = |pod: &str, status, body: &[u8]| {
            s.answer(&vm, &c, &mut stats, &Target::Pod(pod.into()), status, body)
                .unwrap()
        };
        let budget =
            |pod: &str| budget_tokens(&c, record::read(&vm, pod).unwrap().snapshot.as_ref());
        assert_eq!(
            budget("a:1"),
            Some(0),
            "not scraped yet: one request at a time"
        );
        assert!(!answer("a:1", Some(404), b"Not Found"));
        assert!(!answer("a:1", Some(200), b"garbage"));
        assert_eq!(budget("a:1"), Some(0));
        assert!(answer("a:1", Some(504), b""), "the third in a row opens it");
        let snap = record::read(&vm, "a:1").unwrap().snapshot.unwrap();
        assert!(snap.healthy && snap.capacity_tokens == 0 && snap.kv_usage.is_nan());
        assert_eq!(budget("a:1"), None, "its size unknown: not bounded");
        assert!(!answer("a:1", Some(404), b""), "opened once");
        // A refusal in between starts the count again, and a pod back from down keeps the size
        // a scrape said before.
        let page = b"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n";
        assert!(answer("b:1", Some(200), page));
        assert!(!answer("b:1", Some(404), b""));
        assert!(!answer("b:1", None, b""), "refused: down");
        assert!(!answer("b:1", Some(404), b""));
        assert!(!answer("b:1", Some(404), b""));
        assert!(
            answer("b:1", Some(404), b""),
            "the third since it answered again"
        );
        assert_eq!(budget("b:1"), Some(1_600));
        // A healthy pod whose page turns unreadable keeps its last snapshot, stale.
        let (mut s2, before) = (
            Scraper::default(),
            record::read(&vm, "b:1").unwrap().snapshot,
        );
        for _ in 0..4 {
            s2.answer(
                &vm,
                &c,
                &mut stats,
                &Target::Pod("b:1".into()),
                Some(500),
                b"",
            )
            .unwrap();
        }
        assert_eq!(
            record::read(&vm, "b:1").unwrap().snapshot.map(|s| s.at_ms),
            before.map(|s| s.at_ms)
        );
        // A scrape that cannot be sent at all (`metrics.cluster` names no cluster) reads nothing
        // either.
        let pod = Target::Pod("c:1".into());
        let opened: Vec<bool> = (0..4).map(|_| s2.abandon(&vm, &c, &pod).unwrap()).collect();
        assert_eq!(opened, [false, false, true, false]);
        assert_eq!(
            budget_tokens(&c, record::read(&vm, "c:1").unwrap().snapshot.as_ref()),
            None
        );
    }

    #[test]
    fn metrics_land_in_the_pod_record_and_refusal_marks_unhealthy() {
        let c = cfg();
        let host = FakeHost::new();
        let vm = host.vm();
        host.set_now_ms(42);
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let text = b"vllm:num_requests_running{model_name=\"m\"} 3\nvllm:num_requests_waiting{model_name=\"m\"} 2\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n";
        s.answer(
            &vm,
            &c,
            &mut stats,
            &Target::Pod("a:1".into()),
            Some(200),
            text,
        )
        .unwrap();
        let snap = record::read(&vm, "a:1").unwrap().snapshot.unwrap();
        assert_eq!(
            (
                snap.at_ms,
                snap.healthy,
                snap.running,
                snap.waiting,
                snap.kv_usage
            ),
            (42, true, 3.0, 2.0, 0.5)
        );
        // Answers the scrape of a:1 with `status` and `body`; says whether a:1 is healthy after.
        let mut answer = |status, body: &[u8]| {
            s.answer(
                &vm,
                &c,
                &mut stats,
                &Target::Pod("a:1".into()),
                status,
                body,
            )
            .unwrap();
            record::read(&vm, "a:1").unwrap().snapshot.unwrap().healthy
        };
        assert!(answer(Some(200), b"garbage"), "garbage is not a refusal");
        let reset = "upstream connect error or disconnect/reset before headers. reset reason:";
        assert!(
            answer(
                Some(503),
                format!("{reset} connection termination").as_bytes()
            ),
            "a connection closed under the request is not a refusal"
        );
        assert!(!answer(
            Some(503),
            format!("{reset} remote connection failure, transport failure reason: delayed connect error: Connection refused").as_bytes()
        ));
        // The garbage page and both 503s: errors all, only one a refusal.
        assert_eq!(stats.take_count(crate::stats::SCRAPE_ERRORS), 3);
    }

    /// Two pods of one model report the answers they finished: the model's prior reads their
    /// pooled mean (`engine_lengths`), whichever worker asks.
    #[test]
    fn the_engines_finished_answers_are_pooled_for_their_model() {
        let c = cfg();
        let host = FakeHost::new();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        for (pod, tokens, count) in [("a:1", 30_000, 50), ("b:1", 10_000, 30)] {
            let text = format!(
                "vllm:num_requests_running{{model_name=\"m\"}} 0\n\
                 vllm:request_generation_tokens_sum{{model_name=\"m\",engine=\"0\"}} {tokens}\n\
                 vllm:request_generation_tokens_count{{model_name=\"m\",engine=\"0\"}} {count}\n"
            );
            s.answer(
                &host.vm(),
                &c,
                &mut stats,
                &Target::Pod(pod.into()),
                Some(200),
                text.as_bytes(),
            )
            .unwrap();
        }
        let mean = crate::estimate::engine_lengths::mean(&host.vm(), "m", 20.0);
        assert_eq!(mean, Some(500.0));
    }

    #[test]
    fn the_engines_own_kv_and_prefix_counters_are_reported_beside_kvgates() {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut stats = Stats::default();
        let page = include_bytes!("../../fuzz/seeds/metrics/vllm_v1_single_engine.prom");
        let pod = Target::Pod("a:1".into());
        Scraper::default()
            .answer(&vm, &cfg(), &mut stats, &pod, Some(200), page)
            .unwrap();
        let gauges: Vec<_> = stats.drain().collect();
        for (name, value) in [
            // 0.418 of 27,000 blocks in use.
            ("kvgate.pod.a_1.engine_blocks", 11_294),
            ("kvgate.pod.a_1.engine_prefix_hit_tokens", 987_648),
            ("kvgate.pod.a_1.engine_prefix_query_tokens", 1_234_567),
        ] {
            assert!(
                gauges.contains(&crate::stats::Stat::Gauge(name.into(), value)),
                "{name}: {gauges:?}"
            );
        }
        // And into the record, the baseline `index_check` compares the next scrape's with.
        let totals = record::read(&vm, "a:1")
            .unwrap()
            .snapshot
            .and_then(|s| s.hit_totals)
            .map(|t| (t.hits, t.queries));
        assert_eq!(totals, Some((987_648.0, 1_234_567.0)));
    }

    #[test]
    fn an_answer_asked_before_the_records_is_not_written_over_it() {
        let c = cfg();
        let host = FakeHost::new();
        let (a, b) = (host.vm(), host.vm());
        let (mut on_a, mut on_b, mut stats) =
            (Scraper::default(), Scraper::default(), Stats::default());
        let pod = Target::Pod("a:1".into());
        let page = |hits: u64, queries: u64| {
            format!(
                "vllm:num_requests_running{{engine=\"0\"}} 3\n\
                 vllm:prefix_cache_hits_total{{engine=\"0\"}} {hits}\n\
                 vllm:prefix_cache_queries_total{{engine=\"0\"}} {queries}\n"
            )
        };
        let snapshot = || record::read(&a, "a:1").unwrap().snapshot.unwrap();
        host.set_now_ms(1_000);
        on_a.answer(
            &a,
            &c,
            &mut stats,
            &pod,
            Some(200),
            page(100, 200).as_bytes(),
        )
        .unwrap();
        // A asks again, and stalls; the lease moves to B, which asks later and is answered
        // first.
        host.set_now_ms(2_000);
        assert!(on_a
            .due(&c, &c.pods, 2_000, None, false)
            .iter()
            .any(|call| call.target == pod));
        host.set_now_ms(3_600);
        on_b.answer(
            &b,
            &c,
            &mut stats,
            &pod,
            Some(200),
            page(150, 300).as_bytes(),
        )
        .unwrap();
        host.set_now_ms(3_700);
        on_a.on_response(
            &a,
            &c,
            &mut stats,
            &pod,
            Some(200),
            page(140, 280).as_bytes(),
        )
        .unwrap();
        let kept = snapshot();
        assert_eq!(kept.at_ms, 3_600, "B's answer stays");
        assert_eq!(kept.engine_restarts, 0, "counters that never ran backwards");
        assert_eq!(kept.hit_counts, Some((150.0, 300.0)));
        // An answer to a call forgotten past its timeout: another may have been sent and answered
        // since, so it is dropped.
        host.set_now_ms(5_000);
        assert!(!on_b.due(&c, &c.pods, 5_000, None, false).is_empty());
        on_b.expire(9_000);
        on_b.on_response(&b, &c, &mut stats, &pod, Some(200), page(10, 20).as_bytes())
            .unwrap();
        assert_eq!(snapshot().at_ms, 3_600);
        assert_eq!(snapshot().engine_restarts, 0);
        // A restarted engine's counters, asked for in order, still read as a restart.
        host.set_now_ms(10_000);
        on_b.answer(&b, &c, &mut stats, &pod, Some(200), page(10, 20).as_bytes())
            .unwrap();
        assert_eq!(snapshot().engine_restarts, 1);
    }

    #[test]
    fn a_model_list_is_kept_through_failures_and_adapter_state_comes_with_metrics() {
        let (c, host) = (cfg(), FakeHost::new());
        let (vm, mut s, mut stats) = (host.vm(), Scraper::default(), Stats::default());
        let models = Target::Models("a:1".into());
        let answers: [(&Target, Option<u32>, &[u8]); 6] = [
            (&models, Some(200), br#"{"data":[{"id":"base"},{"id":"sql","parent":"base"}]}"#),
            (&models, Some(200), b"<html>oops</html>"),
            (&models, Some(500), b""),
            (&models, None, b""),
            (&models, Some(200), br#"{"data":[]}"#),
            (
                &Target::Pod("a:1".into()),
                Some(200),
                concat!(
                    "vllm:num_requests_running 1\n",
                    "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"sql\"} 20\n",
                    "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 10\n"
                )
                .as_bytes(),
            ),
        ];
        for (target, status, body) in answers {
            s.answer(&vm, &c, &mut stats, target, status, body).unwrap();
        }
        let served = served::read(&vm, "a:1").unwrap();
        assert!(
            served.serves("base") && served.is_adapter("sql"),
            "{served:?}"
        );
        let lora = served.lora.unwrap();
        assert_eq!(
            (lora.max_lora, lora.running),
            (2, vec![served::adapter_id("sql")]),
            "the newest series"
        );
        assert_eq!(stats.take_count(crate::stats::MODELS_LIST_ERRORS), 4);
    }

    #[test]
    fn a_pods_pace_is_learned_across_scrapes_and_kept_while_it_is_down() {
        let (c, host) = (cfg(), FakeHost::new());
        let (vm, mut s, mut stats) = (host.vm(), Scraper::default(), Stats::default());
        let page = |sum: f64, count: u32| {
            format!(
                "vllm:num_requests_running 1\n\
                 vllm:inter_token_latency_seconds_sum {sum}\n\
                 vllm:inter_token_latency_seconds_count {count}\n"
            )
        };
        let refused = "upstream connect error or disconnect/reset before headers. reset reason: \
                       remote connection failure, transport failure reason: Connection refused";
        let pod = Target::Pod("a:1".into());
        // 10 ms a token; down for a scrape; then 2,000 tokens at 20 ms since the last page.
        for (status, body, pace) in [
            (Some(200), page(50.0, 10_000), 0.0),
            (Some(200), page(60.0, 11_000), 0.010),
            (Some(503), refused.to_string(), 0.010),
            (
                Some(200),
                page(100.0, 13_000),
                0.010 * 2f64.powf(pace::WEIGHT),
            ),
        ] {
            host.advance_ms(1_000);
            s.answer(&vm, &c, &mut stats, &pod, status, body.as_bytes())
                .unwrap();
            let snap = record::read(&vm, "a:1").unwrap().snapshot.unwrap();
            assert!((snap.itl_s - pace).abs() < 1e-12, "{status:?}: {snap:?}");
        }
    }

    #[test]
    fn while_no_pod_is_known_discovery_is_asked_at_every_tick() {
        let c = cfg();
        let vm = FakeHost::new().vm();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let discovery = |calls: Vec<Call>| calls.iter().any(|c| c.target == Target::Discovery);
        assert!(discovery(s.due(&c, &[], 0, None, false)));
        s.answer(&vm, &c, &mut stats, &Target::Discovery, None, b"")
            .unwrap();
        assert!(
            discovery(s.due(&c, &[], 20, None, false)),
            "failed: asked again"
        );
        let none = clusters_json(&[]);
        s.answer(&vm, &c, &mut stats, &Target::Discovery, Some(200), &none)
            .unwrap();
        assert_eq!(
            vm.get(PODS_KEY).unwrap().value,
            None,
            "a cluster not populated yet is no pool"
        );
        assert!(
            discovery(s.due(&c, &[], 40, None, false)),
            "empty: asked again"
        );
        let one = clusters_json(&["a:1"]);
        s.answer(&vm, &c, &mut stats, &Target::Discovery, Some(200), &one)
            .unwrap();
        let pods = vec!["a:1".to_string()];
        // Once pods are known, every interval, failed or not.
        assert!(
            discovery(s.due(&c, &pods, 60, None, false)),
            "planned while none was"
        );
        s.answer(&vm, &c, &mut stats, &Target::Discovery, Some(200), &one)
            .unwrap();
        assert!(!discovery(s.due(&c, &pods, 80, None, false)));
        let next = 60 + c.discovery.interval_ms;
        assert!(discovery(s.due(&c, &pods, next, None, false)));
        s.answer(&vm, &c, &mut stats, &Target::Discovery, None, b"")
            .unwrap();
        assert!(!discovery(s.due(&c, &pods, next + 20, None, false)));
        assert_eq!(stats.take_count(stats::DISCOVERY_ERRORS), 2);
    }

    #[test]
    fn a_pod_that_leaves_is_down_at_once_and_not_scraped_until_it_comes_back() {
        // Discovered, and configured in `pods` too: a configured pod is in every VM's pool
        // whatever discovery finds, so only its record and the scraper keep it out.
        let mut discovered_only = cfg();
        discovered_only.pods.clear();
        for c in [discovered_only, cfg()] {
            leaves_and_comes_back(&c);
        }
    }

    fn leaves_and_comes_back(c: &Config) {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let page = b"vllm:num_requests_running{model_name=\"m\"} 1\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n";
        let (two, one) = (clusters_json(&["a:1", "b:1"]), clusters_json(&["b:1"]));
        let mut answer = |s: &mut Scraper, target: Target, body: &[u8]| {
            s.answer(&vm, c, &mut stats, &target, Some(200), body)
                .unwrap()
        };
        answer(&mut s, Target::Discovery, &two);
        answer(&mut s, Target::Pod("a:1".into()), page);
        assert!(!record::read(&vm, "a:1").unwrap().is_down());
        host.set_now_ms(100);
        answer(&mut s, Target::Discovery, &one);
        let gone = record::read(&vm, "a:1").unwrap();
        assert!(
            gone.is_down(),
            "a VM whose pool is older ranks a:1 on its record alone"
        );
        // A scrape sent before it left, answered after, and the VMs' pool still naming it: it
        // stays down and is not scraped.
        answer(&mut s, Target::Pod("a:1".into()), page);
        assert!(record::read(&vm, "a:1").unwrap().is_down());
        let pods = ["a:1".to_string(), "b:1".to_string()];
        let scraped: Vec<Target> = s
            .due(c, &pods, 200, None, false)
            .into_iter()
            .map(|c| c.target)
            .collect();
        assert!(
            !scraped.contains(&Target::Pod("a:1".into()))
                && scraped.contains(&Target::Pod("b:1".into())),
            "{scraped:?}"
        );
        // Back at the same address: scraped again, and up at its first scrape.
        answer(&mut s, Target::Discovery, &two);
        assert!(s
            .due(c, &pods, 300, None, false)
            .iter()
            .any(|c| c.target == Target::Pod("a:1".into())));
        assert!(record::read(&vm, "a:1").unwrap().is_down(), "until scraped");
        assert!(
            answer(&mut s, Target::Pod("a:1".into()), page),
            "its first scrape opens it to the line"
        );
        assert!(!record::read(&vm, "a:1").unwrap().is_down());
    }

    #[test]
    fn while_requests_wait_discovery_is_asked_every_second_at_most() {
        let c = cfg();
        assert!(c.discovery.interval_ms > WAITING_DISCOVERY_MS);
        let vm = FakeHost::new().vm();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let mut discovers = |s: &mut Scraper, now, waiting| {
            let sent = s
                .due(&c, &c.pods, now, None, waiting)
                .iter()
                .any(|c| c.target == Target::Discovery);
            s.answer(&vm, &c, &mut stats, &Target::Discovery, None, b"")
                .unwrap();
            sent
        };
        assert!(discovers(&mut s, 0, false));
        assert!(!discovers(&mut s, WAITING_DISCOVERY_MS - 1, true));
        assert!(
            discovers(&mut s, WAITING_DISCOVERY_MS, true),
            "a second after the last, though planned for the interval"
        );
        assert!(discovers(&mut s, 2 * WAITING_DISCOVERY_MS, true));
        assert!(
            !discovers(&mut s, 3 * WAITING_DISCOVERY_MS, false),
            "the line empty: its interval again"
        );
        assert!(discovers(
            &mut s,
            2 * WAITING_DISCOVERY_MS + c.discovery.interval_ms,
            false
        ));
    }

    #[test]
    fn a_worker_asking_for_discovery_has_it_at_the_next_tick_once() {
        let c = cfg();
        let vm = FakeHost::new().vm();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let discovery = |calls: Vec<Call>| calls.iter().any(|c| c.target == Target::Discovery);
        assert!(discovery(s.due(&c, &c.pods, 100, None, false)));
        s.answer(&vm, &c, &mut stats, &Target::Discovery, None, b"")
            .unwrap();
        assert!(
            !discovery(s.due(&c, &c.pods, 350, None, false)),
            "its interval"
        );
        assert!(
            !discovery(s.due(&c, &c.pods, 500, Some(50), false)),
            "an ask the last discovery already answered"
        );
        crate::pods::pool::ask_discovery(&vm, 600).unwrap();
        let asked = crate::pods::pool::discovery_asked(&vm);
        assert_eq!(asked, Some(600));
        assert!(discovery(s.due(&c, &c.pods, 750, asked, false)));
        s.answer(&vm, &c, &mut stats, &Target::Discovery, None, b"")
            .unwrap();
        assert!(!discovery(s.due(&c, &c.pods, 1_000, asked, false)), "once");
        assert!(
            discovery(s.due(&c, &c.pods, 750 + c.discovery.interval_ms, asked, false)),
            "and its interval from then"
        );
    }

    #[test]
    fn discovery_publishes_the_model_cluster_hosts() {
        let c = cfg();
        let host = FakeHost::new();
        let vm = host.vm();
        let mut s = Scraper::default();
        let mut stats = Stats::default();
        let doc = br#"{"cluster_statuses":[{"name":"other","host_statuses":[]},
            {"name":"models","host_statuses":[
              {"address":{"socket_address":{"address":"10.0.0.2","port_value":8000}}},
              {"address":{"socket_address":{"address":"10.0.0.1","port_value":8000}}}]}]}"#;
        s.answer(&vm, &c, &mut stats, &Target::Discovery, Some(200), doc)
            .unwrap();
        let pods = decode_pods(&vm.get(PODS_KEY).unwrap().value.unwrap()).unwrap();
        assert_eq!(
            pods,
            vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()]
        );
        assert!(vm
            .get(&record::key("10.0.0.1:8000"))
            .unwrap()
            .value
            .is_some());
        // A document without the cluster leaves the pool as it was.
        s.answer(
            &vm,
            &c,
            &mut stats,
            &Target::Discovery,
            Some(200),
            br#"{"cluster_statuses":[]}"#,
        )
        .unwrap();
        assert_eq!(
            decode_pods(&vm.get(PODS_KEY).unwrap().value.unwrap())
                .unwrap()
                .len(),
            2
        );
        assert_eq!(parse_clusters(b"not json", "models"), None);
    }
}
