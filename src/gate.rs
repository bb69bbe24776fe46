//! One VM's state and periodic work: the parsed configuration, the router's replicas, admission's
//! parked tickets, caches of shared data, the scraper (active only while this VM holds the lease)
//! and the stats waiting to be flushed. Requests (`flow`) borrow it; the shell's root context
//! drives its tick, callouts and wake-ups.

use crate::admission::admit::Admission;
use crate::config::Config;
use crate::estimate::calibration::Calibration;
use crate::models::split::Split;
use crate::pods::record::At;
use crate::pods::scrape::{Call, Scraper, Target};
use crate::replicas::sync::{PodView, Sync};
use crate::routing::router::Router;
use crate::stats::{self, Stats};
use crate::store::interface::{Store, StoreError};
use crate::store::lease;
use std::cell::OnceCell;

/// How long the scraper's lease lasts without renewal; renewed every tick.
const LEASE_MS: u64 = 1_500;
/// The root context's tick: lease renewal, scrapes and discovery fall due on it.
pub const TICK_MS: u64 = 250;
/// The tick while requests wait for the first discovery (`Router::discovering`), so that the
/// pool is known a few milliseconds after the gateway starts, not a whole tick later, or for a
/// pod's first model list (`Router::awaits_lists`); and while the head of the line waits for
/// room where its prefix is cached, so that it goes elsewhere as its `admission.cacheWaitMs` ends
/// even when no release wakes the line. Only the first two run the periodic work at this pace
/// (`Gate::on_tick`).
pub const QUICK_TICK_MS: u64 = 20;

/// Per-VM state: the parsed config, the router's replicas, caches of shared data, the scraper
/// (active only while this VM holds the lease) and the stats waiting to be flushed.
pub struct Gate {
    pub config: Config,
    pub(crate) calibration: Calibration,
    pub(crate) router: Router,
    pub(crate) admission: Admission,
    /// Public model names' round-robin credits (`models.routes`).
    pub(crate) split: Split,
    scraper: Scraper,
    /// When the tick's periodic work last ran.
    upkept_ms: Option<u64>,
    /// Whether this VM held the scrape lease at that run: it alone syncs with etcd, at the
    /// sync's own pace (`etcd.syncIntervalMs` may be shorter than the tick).
    leads: bool,
    /// The tick period last asked of the host (`retick`).
    asked_tick_ms: Option<u64>,
    /// The replicas' etcd sync, run alongside the scraper by the same elected VM.
    sync: Sync,
    /// Until when a request of this VM's may be held for another replica's note of a stored
    /// response (`Flow::sought`, asked on each tick).
    seeking_until_ms: Option<u64>,
    /// This VM's admitted answers that do not stream, not done yet: their entries grow on the
    /// tick (`Flow::on_tick`), which is quick while there are any.
    pub(crate) unseen_answers: usize,
    /// Whether this VM has logged that responses reach it encoded (`Flow::on_response_encoded`).
    pub(crate) told_encoded: bool,
    /// What this VM's decoders of compressed answers hold (`flow::decode`).
    pub(crate) decoders: crate::flow::decode::Room,
    /// This VM's requests held while the pods are asked for a stored response
    /// (`routing::stored_ask`), at most `stored_ask::MAX_ASKING`.
    pub(crate) asking: usize,
    /// The turn of this VM's requests on other paths among the pods serving their model
    /// (`flow::other_path`).
    pub(crate) other_turn: u64,
    pub stats: Stats,
}

impl Gate {
    pub fn new(config: Config, store: &dyn Store) -> Result<Self, StoreError> {
        let router = Router::start(store, &config)?;
        Ok(Self {
            admission: Admission::start(store, router.vm())?,
            router,
            config,
            calibration: Calibration::default(),
            split: Split::default(),
            scraper: Scraper::default(),
            upkept_ms: None,
            leads: false,
            asked_tick_ms: None,
            sync: Sync::default(),
            seeking_until_ms: None,
            unseen_answers: 0,
            told_encoded: false,
            decoders: Default::default(),
            asking: 0,
            other_turn: 0,
            stats: Stats::default(),
        })
    }

    /// Replays the other workers' picks and finishes into this VM's replicas, as its next pick
    /// does first: what every other worker pays for each request one worker routes
    /// (`examples/request_cost`'s `replay`).
    pub fn catch_up(&mut self, store: &dyn Store) -> Result<(), StoreError> {
        self.router.sync(store, &self.config)
    }

    /// Periodic work: whichever VM holds the lease plans the scrapes and discovery calls due.
    pub fn on_tick(&mut self, store: &dyn Store) -> Vec<Call> {
        let now = store.now_ms();
        // A quicker tick is for the line (`QUICK_TICK_MS`) or the replicas' sync: the rest keeps
        // its pace, on the tick nearest to it.
        let half_period = self.asked_tick_ms.unwrap_or(TICK_MS) / 2;
        if !self.router.awaits_pool(&self.config, now)
            && !self.router.awaits_lists(now)
            && self
                .upkept_ms
                .is_some_and(|t| now + half_period < t + TICK_MS)
        {
            return if self.leads {
                self.sync_due(store, || crate::admission::line::waits(store))
            } else {
                Vec::new()
            };
        }
        self.upkept_ms = Some(now);
        if let Err(e) = self.calibration.flush(store, &self.config.estimator) {
            log::debug!("calibration flush failed: {e:?}");
        }
        if let Err(e) = self.router.tend(store, &self.config) {
            log::debug!("router upkeep failed: {e:?}");
        }
        // Each routing worker learns its own; they differ little (one Envoy, one network).
        if let Some(us) = self.router.dispatch_delay_us() {
            self.stats.gauge(stats::ROUTING_DISPATCH_DELAY_US, us);
        }
        self.leads = match lease::hold_lease(store, self.router.vm(), now, LEASE_MS) {
            Ok(leads) => leads,
            Err(e) => {
                log::debug!("lease: {e:?}");
                false
            }
        };
        if !self.leads {
            return Vec::new();
        }
        self.scraper.expire(now);
        let pods = self.router.pods().to_vec();
        // Every kvgate filter in one Envoy writes the same pool gauges (`wasmcustom.kvgate.*`):
        // one without a pool would overwrite the others' with zeros now and then.
        if self.config.has_pool() {
            self.report_pods(store, &pods);
        }
        let discovers = !self.config.discovery.admin_cluster.is_empty();
        let asked = discovers
            .then(|| crate::pods::pool::discovery_asked(store))
            .flatten();
        // Read once a tick, by discovery and the replicas' sync alike, and only if one asks.
        let line = OnceCell::new();
        let waiting = || *line.get_or_init(|| crate::admission::line::waits(store));
        let mut calls = self
            .scraper
            .due(&self.config, &pods, now, asked, discovers && waiting());
        calls.extend(self.sync_due(store, waiting));
        calls
    }

    /// The replicas' sync, when it is due (the lease holder's ticks only); `busy_here`: whether
    /// requests wait in this replica's line.
    fn sync_due(&mut self, store: &dyn Store, busy_here: impl Fn() -> bool) -> Vec<Call> {
        if !self.config.etcd.enabled() {
            return Vec::new();
        }
        self.sync
            .due(store, &self.config, busy_here)
            .unwrap_or_else(|e| {
                log::debug!("replicas sync: {e:?}");
                Vec::new()
            })
    }

    /// What the replicas' sync needs of each pod, from this replica's records and line.
    fn pod_views(&self, store: &dyn Store) -> Result<Vec<PodView>, StoreError> {
        let pods = self.router.pods();
        let line = crate::admission::line::read(store)?;
        // A waiting request asks for credit on the pod it would take first (where its prefix is
        // cached, its group's home, the cheapest); one no pick has named yet asks every pod it
        // may go to (its model's: `Ticket::reach`) for an even part. Spread evenly, the requests
        // waiting for a group's pod asked it for an eighth of what they needed at eight pods,
        // and the credit they waited for came from wherever the split found it (docs/design.md,
        // *The split*).
        let keys: Vec<u64> = pods
            .iter()
            .map(|p| crate::admission::line::pod_key(p))
            .collect();
        let bits = self.router.pod_bits();
        let mut wanted = vec![0u64; pods.len()];
        for t in &line.tickets {
            if let Some(i) = keys.iter().position(|&k| k == t.wants) {
                wanted[i] += t.asks();
                continue;
            }
            // Every pod, when none of this pool's is in its reach.
            let reach = if bits.iter().any(|&b| b & t.reach != 0) {
                t.reach
            } else {
                crate::admission::line::ANYWHERE
            };
            let part = t.asks() / bits.iter().filter(|&&b| b & reach != 0).count().max(1) as u64;
            for (w, &b) in wanted.iter_mut().zip(bits) {
                if b & reach != 0 {
                    *w += part;
                }
            }
        }
        let first = line
            .tickets
            .iter()
            .min_by(|a, b| crate::admission::line::order(a, b));
        let head = first.map_or(0, |t| t.asks());
        // Once the head has waited past its patience for the pod it names (`cacheWaitMs`), any
        // pod with room will do: it asks for its first request on each pod of its reach where
        // this replica holds nothing, so that the split can give it one there when the others
        // leave it none (`split::fair_split`, a replica owed a request). Asking only where it
        // waits, a replica holding one 1,400-token request on a pod had its second wait there
        // 10.7 s, the other pod kept full by two replicas of short requests (docs/design.md,
        // *The split*).
        let now = store.now_ms();
        let anywhere = first
            .filter(|t| now.saturating_sub(t.enqueued_ms) >= self.config.cache_wait_ms())
            .map_or(0, |t| {
                if bits.iter().any(|&b| b & t.reach != 0) {
                    t.reach
                } else {
                    crate::admission::line::ANYWHERE
                }
            });
        let block = u64::from(self.router.block_tokens(&self.config.routing));
        let headroom = self.config.admission.headroom();
        let at = At::of(&self.config, now);
        let mut views = Vec::with_capacity(pods.len());
        for ((pod, wanted), &bit) in pods.iter().zip(wanted).zip(bits) {
            let rec = crate::pods::record::read(store, pod)?;
            let in_use = rec.forecast(None, headroom, block, at);
            let wanted = if in_use == 0 && bit & anywhere != 0 {
                wanted.max(head)
            } else {
                wanted
            };
            let block_size = rec.snapshot.map_or(0, |s| s.block_size);
            views.push(PodView {
                pod: pod.clone(),
                budget: crate::admission::budget::budget_tokens(
                    &self.config,
                    rec.snapshot.as_ref(),
                ),
                in_use,
                block_tokens: block,
                demand: in_use + wanted,
                unit: head,
                explained: crate::admission::feedback::explained(&rec, block_size),
                kv_read_ms: rec
                    .snapshot
                    .filter(|s| s.healthy && s.kv_usage.is_finite() && s.capacity_tokens > 0)
                    .map(|s| s.at_ms),
            });
        }
        Ok(views)
    }

    /// Gauges of the pool, written by the lease holder only so they are not multiplied.
    fn report_pods(&mut self, store: &dyn Store, pods: &[String]) {
        for model in self.router.base_models(store, &self.config) {
            let prior =
                crate::estimate::calibration::output_prior(store, &model, &self.config.estimator);
            self.stats.gauge(
                stats::model_stat(&model, stats::MODEL_OUTPUT_PRIOR_TOKENS),
                prior.tokens,
            );
        }
        if let Ok(line) = crate::admission::line::read(store) {
            // Bands named by configuration (and the default) are reported; any other priority a
            // client sent is counted under `other`, so the stat names stay bounded.
            let a = &self.config.admission;
            let mut bands: Vec<i32> = a.objectives.values().copied().collect();
            bands.push(a.default_priority);
            bands.sort_unstable();
            bands.dedup();
            let mut other = 0;
            for &band in &bands {
                let n = line.tickets.iter().filter(|t| t.priority == band).count();
                self.stats.gauge(stats::queue_band_length(band), n as u64);
            }
            other += line
                .tickets
                .iter()
                .filter(|t| !bands.contains(&t.priority))
                .count();
            self.stats.gauge(stats::QUEUE_OTHER_LENGTH, other as u64);
            self.stats
                .gauge(stats::QUEUE_LENGTH, line.tickets.len() as u64);
        }
        let now = store.now_ms();
        let (mut stale, mut unhealthy) = (0, 0);
        let records: Vec<_> = pods
            .iter()
            .filter_map(|pod| Some((pod, crate::pods::record::read(store, pod).ok()?)))
            .collect();
        // Against the whole pool: a pick compares only the pods serving its model.
        let paces: Vec<_> = records.iter().map(|(_, rec)| rec.pace()).collect();
        let factors = crate::pods::pace::cost_factors(&paces, now, self.config.metrics.interval_ms);
        for ((pod, rec), factor) in records.into_iter().zip(factors) {
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_COST_FACTOR_PERCENT),
                (factor * 100.0).round() as u64,
            );
            stale += u64::from(rec.is_stale(now, &self.config.metrics));
            let block = u64::from(self.router.block_tokens(&self.config.routing));
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_ACTIVE_BLOCKS),
                rec.active_blocks(block),
            );
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_IN_FLIGHT),
                rec.entries.len() as u64,
            );
            let headroom = self.config.admission.headroom();
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_RESERVED_TOKENS),
                rec.forecast(None, headroom, block, At::of(&self.config, now)),
            );
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_HELD_TOKENS),
                rec.held_tokens(),
            );
            if let Some(s) = rec.snapshot {
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_UNEXPLAINED_TOKENS),
                    s.unexplained_tokens,
                );
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_BACKOFF_PERCENT),
                    (s.backoff * 100.0).round() as u64,
                );
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_RELIEF_PERCENT),
                    (s.relief * 100.0).round() as u64,
                );
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_INDEX_CAPACITY_PERCENT),
                    (s.index_share() * 100.0).round() as u64,
                );
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_ENGINE_RESTARTS),
                    u64::from(s.engine_restarts),
                );
            }
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_ENGINE_SEATS),
                u64::from(crate::pods::seats::in_force(
                    &self.config,
                    rec.snapshot.as_ref(),
                )),
            );
            let budget =
                crate::admission::budget::budget_tokens(&self.config, rec.snapshot.as_ref());
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_BUDGET_TOKENS),
                budget.unwrap_or(0),
            );
            if self.config.etcd.enabled() {
                self.report_share(store, pod, budget);
            }
            let healthy = !rec.is_down();
            unhealthy += u64::from(!healthy);
            self.stats
                .gauge(stats::pod_stat(pod, stats::POD_HEALTHY), u64::from(healthy));
        }
        self.stats.gauge(stats::PODS_TOTAL, pods.len() as u64);
        self.stats.gauge(stats::PODS_STALE, stale);
        self.stats.gauge(stats::PODS_UNHEALTHY, unhealthy);
    }

    /// A pod's grant gauges, with several replicas: what this one may reserve there now, what
    /// the others hold, and what lapsed replicas' reclaimed grants hold out of the split.
    fn report_share(&mut self, store: &dyn Store, pod: &str, budget: Option<u64>) {
        let cap = crate::replicas::share::cap(store, &self.config, pod, budget);
        self.stats.gauge(
            stats::pod_stat(pod, stats::POD_GRANT_TOKENS),
            cap.unwrap_or(0),
        );
        if let Ok(Some(share)) = crate::replicas::share::read(store, pod) {
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_REMOTE_TOKENS),
                share.remote_tokens,
            );
            self.stats.gauge(
                stats::pod_stat(pod, stats::POD_GHOST_TOKENS),
                share.ghost_tokens,
            );
            self.stats.gauge(
                stats::REPLICAS_IN_CONTACT,
                u64::from(share.in_contact(store.now_ms(), &self.config)),
            );
        }
    }

    /// The tick this VM wants now: short while no pod is known and the first discovery is
    /// awaited, or a pod's first model list, while the head of the line waits for its prefix's
    /// pods or a pick lost its races on shared data (`Admission::runs_again_soon`), while a
    /// request waits for another replica's note, or while an answer that does not stream is in
    /// flight (its entry grows on the tick, at its pod's pace: every 250 ms, a pool of such
    /// answers ran a tick's tokens of each past its records, and preempted 26–43 times in 20 s
    /// where round robin did 1,029, 2 at the quick tick); otherwise `TICK_MS`.
    pub(crate) fn tick_ms(&self, store: &dyn Store) -> u64 {
        let now = store.now_ms();
        if self.router.awaits_pool(&self.config, now)
            || self.router.awaits_lists(now)
            || self.admission.runs_again_soon()
            || self.seeking_until_ms.is_some_and(|until| now <= until)
            || self.unseen_answers > 0
        {
            QUICK_TICK_MS
        } else if self.leads && self.config.etcd.enabled() {
            // Credit moves between replicas at the sync's pace, which the 250 ms tick held to
            // 250 ms however short the interval configured.
            let e = &self.config.etcd;
            let quickest = match e.busy_sync_interval_ms {
                0 => e.sync_interval_ms,
                busy => busy,
            };
            TICK_MS.min(quickest.max(QUICK_TICK_MS))
        } else {
            TICK_MS
        }
    }

    /// A request of this VM's is held for a stored response's place (another replica's note, the
    /// pods' answers) until `until_ms` at most: the quick tick looks for it meanwhile.
    pub(crate) fn seeking_until(&mut self, until_ms: u64) {
        self.seeking_until_ms = Some(self.seeking_until_ms.unwrap_or(0).max(until_ms));
    }

    /// The tick period to ask of the host now, when it differs from the one last asked: after
    /// configuring, after each tick, and whenever the line moves or a request parks (a head that
    /// starts waiting for its prefix's pod needs the quick tick at once, not at the next tick).
    pub fn retick(&mut self, store: &dyn Store) -> Option<u64> {
        let want = self.tick_ms(store);
        (self.asked_tick_ms != Some(want)).then(|| {
            self.asked_tick_ms = Some(want);
            want
        })
    }

    /// This VM's number among the plugin's VMs (unique: it names its wake queue and its requests).
    pub fn vm(&self) -> u32 {
        self.router.vm()
    }

    /// The pods this VM routes to, as of its last sync: a destination names these only.
    pub fn pods(&self) -> &[String] {
        self.router.pods()
    }

    /// This VM's wake queue: the shell calls `next_parked` when it is notified.
    pub fn wake_queue(&self) -> u32 {
        self.admission.wake_queue()
    }

    /// Woken (or ticking): the first ticket heading the line on some pods that this VM holds and
    /// has not `tried` in this pass, and those pods (`Admission::next_head`), having emptied the
    /// wake queue. The shell retries that request and asks again until `None`.
    pub fn next_parked(&mut self, store: &dyn Store, tried: &[u64]) -> Option<(u64, u64)> {
        self.admission.drain_wakes(store);
        if self.admission.parked() == 0 {
            return None;
        }
        self.admission.next_head(store, tried).unwrap_or_else(|e| {
            log::debug!("reading the queue failed: {e:?}");
            None
        })
    }

    /// This VM's parked requests that may be admitted past their heads now
    /// (`cache_first`: into room where their prefix is, which the head would copy its own to;
    /// `behind`: those behind that head only).
    pub fn backfill(&self, store: &dyn Store, cache_first: bool, behind: Option<u64>) -> Vec<u64> {
        self.admission
            .backfill(store, &self.config.admission, cache_first, behind)
    }

    /// Whether `ticket`'s heads may all still be passed (`Admission::may_pass`).
    pub fn may_pass(&self, store: &dyn Store, cache_first: bool, ticket: u64) -> bool {
        self.admission
            .may_pass(store, &self.config.admission, cache_first, ticket)
    }

    /// Parked requests a request of higher precedence displaced from the full line; the shell
    /// retries each, which answers 429.
    pub fn displaced(&mut self, store: &dyn Store) -> Vec<u64> {
        self.admission.displaced(store)
    }

    /// Parked requests past their deadline; the shell retries each, which answers 503.
    pub fn expired(&self, store: &dyn Store) -> Vec<u64> {
        self.admission.expired(store.now_ms())
    }

    /// A response stored on `pod` (`routing::stored`; `id`: its id's hash), with the
    /// conversation's `tokens` so far, as this replica learned it (an answer it carried, or a pod
    /// that said so when asked): noted for this Envoy's workers and, with gateway replicas,
    /// logged for the others, through which a follow-up may come.
    pub fn note_stored(&mut self, store: &dyn Store, id: u64, pod: &str, tokens: u64) {
        if let Err(e) = crate::routing::stored::remember(store, id, pod, tokens) {
            log::debug!("stored response not noted: {e:?}");
        }
        if self.config.etcd.enabled() {
            if let Err(e) = self.router.stored(store, pod, id, tokens) {
                log::debug!("stored response not logged: {e:?}");
            }
        }
    }

    pub fn on_call_failed(&mut self, store: &dyn Store, target: &Target) {
        match target {
            Target::Etcd => self.sync.abandon(),
            _ => {
                let opened = self.scraper.abandon(store, &self.config, target);
                self.opened(store, target, opened);
            }
        }
    }

    /// Reads a callout's answer; returns the calls that follow from it (the next step of a
    /// replicas' sync), for the shell to send at once.
    pub fn on_call_response(
        &mut self,
        store: &dyn Store,
        target: &Target,
        status: Option<u32>,
        body: &[u8],
    ) -> Vec<Call> {
        if *target == Target::Etcd {
            let next = self.pod_views(store).and_then(|views| {
                self.sync
                    .on_response(store, &self.config, &mut self.stats, &views, status, body)
            });
            if self.sync.take_grew() {
                if let Err(e) = self.admission.wake_head(store) {
                    log::debug!("waking the line after a grant grew: {e:?}");
                }
            }
            let received = self.sync.take_received();
            if !received.placed.is_empty() {
                self.stats
                    .count(stats::REPLICAS_PLACEMENTS, received.placed.len() as u64);
                if let Err(e) = self.router.import(store, &self.config, received.placed) {
                    log::debug!("the other replicas' placements: {e:?}");
                }
            }
            if !received.stored.is_empty() {
                self.stats
                    .count(stats::REPLICAS_STORED, received.stored.len() as u64);
            }
            for n in received.stored {
                if let Err(e) = crate::routing::stored::remember(store, n.id, &n.pod, n.tokens) {
                    log::debug!("another replica's stored response: {e:?}");
                }
            }
            return next.unwrap_or_else(|e| {
                log::warn!("replicas sync failed: {e:?}");
                Vec::new()
            });
        }
        let opened =
            self.scraper
                .on_response(store, &self.config, &mut self.stats, target, status, body);
        self.opened(store, target, opened);
        Vec::new()
    }

    /// What a scrape's answer (or its failure to go out) did to the pool.
    fn opened(&mut self, store: &dyn Store, target: &Target, opened: Result<bool, StoreError>) {
        match opened {
            // A pod discovered, or scraped healthy for the first time (the gateway just started,
            // the pool grew, a pod came back), or opened unbounded: the head of the line tries
            // now, not at its VM's tick. Other scrapes leave the line to its tick.
            Ok(true) => {
                if let Err(e) = self.admission.wake_head(store) {
                    log::debug!("waking the line after {target:?}: {e:?}");
                }
            }
            Ok(false) => {}
            Err(e) => log::warn!("recording {target:?} failed: {e:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::replicas::gateway;
    use crate::stats::Stat;
    use crate::store::fake_host::FakeHost;

    /// The pool gauges `config` (JSON) has a tick write.
    fn pool_gauges(config: &str) -> Vec<Stat> {
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        let mut gate = Gate::new(Config::parse(config.as_bytes()).unwrap(), &vm).unwrap();
        gate.on_tick(&vm);
        gate.stats
            .drain()
            .filter(|s| matches!(s, Stat::Gauge(name, _) if name.starts_with("kvgate.pods.")))
            .collect()
    }

    /// The tick period a gate asks for and the etcd calls it sends over `ms` of ticks at that
    /// period, every call answered at once by a failure (so each sync is one call).
    fn etcd_calls(sync_interval_ms: u64, busy_ms: u64, ms: u64) -> (u64, usize) {
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        let config = format!(
            r#"{{"pods":["10.0.0.1:8000"],"etcd":{{"cluster":"etcd","maxReplicas":2,
                "syncIntervalMs":{sync_interval_ms},"busySyncIntervalMs":{busy_ms}}}}}"#
        );
        let mut gate = Gate::new(Config::parse(config.as_bytes()).unwrap(), &vm).unwrap();
        let (mut calls, mut period) = (0, TICK_MS);
        let end = 1_000_000 + ms;
        // Each tick a millisecond early, as the wall clock read in whole milliseconds may have
        // it against Envoy's monotonic timer.
        let mut now = 1_000_000;
        while now < end {
            host.set_now_ms(now);
            for call in gate.on_tick(&vm) {
                if call.target == Target::Etcd {
                    calls += 1;
                    assert!(gate
                        .on_call_response(&vm, &call.target, None, b"")
                        .is_empty());
                }
            }
            period = gate.tick_ms(&vm);
            now += period - 1;
        }
        (period, calls)
    }

    #[test]
    fn the_lease_holder_ticks_at_the_syncs_pace_when_it_is_shorter_than_the_tick() {
        let (period, calls) = etcd_calls(100, 0, 2_000);
        assert_eq!(period, 100);
        assert!(calls >= 19, "{calls} syncs in 2 s at 100 ms");
        // A 500 ms interval on the 250 ms tick: each sync on time, not a tick late (750 ms).
        let (period, calls) = etcd_calls(500, 0, 5_000);
        assert_eq!(period, TICK_MS);
        assert!(calls >= 10, "{calls} syncs in 5 s at 500 ms");
        // Ready for the busy pace, whose syncs come only while credit must move: none here.
        let (period, calls) = etcd_calls(500, 100, 5_000);
        assert_eq!(period, 100);
        assert!(
            (10..=11).contains(&calls),
            "{calls} syncs in 5 s, nothing waiting"
        );
    }

    /// A request of `gate`'s VM waiting in the line since t = 1,000 s, for a minute at most.
    fn waiting(gate: &Gate, id: u64, cost: u64, wants: u64) -> crate::admission::line::Ticket {
        crate::admission::line::Ticket {
            id,
            vm: gate.vm(),
            priority: 0,
            boosted: false,
            start_tag: 0.0,
            enqueued_ms: 1_000_000,
            deadline_ms: 1_060_000,
            cost,
            wants,
            reach: crate::admission::line::ANYWHERE,
            need: 0,
        }
    }

    #[test]
    fn a_grant_that_grows_wakes_the_line() {
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        let config = r#"{"pods":["10.0.0.1:8000"],"admission":{"budgetTokens":1000},
            "etcd":{"cluster":"etcd","maxReplicas":2,"replicaId":"r0"}}"#;
        let mut gate = Gate::new(Config::parse(config.as_bytes()).unwrap(), &vm).unwrap();
        // A request waits: before its first sync the replica may reserve nothing.
        crate::admission::line::enqueue(&vm, waiting(&gate, 1, 100, 0), 0, 0.0, 10)
            .unwrap()
            .unwrap();
        // etcd answers a lone replica: its grant grows from nothing to the whole budget.
        let answer = |path: &str| match path {
            gateway::LEASE_GRANT => r#"{"header":{},"ID":"7","TTL":"10"}"#,
            gateway::RANGE => r#"{"header":{"revision":"5"}}"#,
            _ => r#"{"header":{},"succeeded":true}"#,
        };
        let mut woken = false;
        for k in 0..20 {
            host.set_now_ms(1_000_000 + k * TICK_MS);
            let mut calls = gate.on_tick(&vm);
            while let Some(call) = calls.pop() {
                let body = answer(&call.path).as_bytes();
                calls.extend(gate.on_call_response(&vm, &call.target, Some(200), body));
                woken |= vm.dequeue(gate.wake_queue()).unwrap().is_some();
            }
        }
        assert!(
            crate::replicas::share::read(&vm, "10.0.0.1:8000")
                .unwrap()
                .is_some_and(|s| s.grant > 0),
            "the grant grew"
        );
        assert!(woken, "the line was not woken");
    }

    #[test]
    fn a_request_waiting_for_its_prefixs_pod_asks_the_replicas_for_credit_there() {
        use crate::admission::line::{enqueue, pod_key};
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        let config = r#"{"pods":["10.0.0.1:8000","10.0.0.2:8000"],
            "admission":{"budgetTokens":1000},
            "etcd":{"cluster":"etcd","maxReplicas":2,"replicaId":"r0"}}"#;
        let gate = Gate::new(Config::parse(config.as_bytes()).unwrap(), &vm).unwrap();
        // One waits for the first pod, where its prefix is; one may go anywhere; one waits for
        // a pod that has left the pool, and may now go anywhere too; one's model is served by
        // the second pod alone.
        let second = gate.router.pod_bits()[1];
        assert_ne!(second, gate.router.pod_bits()[0]);
        for t in [
            // It costs 250, and needs 300 of a pod (what admission checks: its `max_tokens`).
            crate::admission::line::Ticket {
                need: 300,
                ..waiting(&gate, 1, 250, pod_key("10.0.0.1:8000"))
            },
            waiting(&gate, 2, 100, 0),
            waiting(&gate, 3, 60, pod_key("10.0.0.9:8000")),
            crate::admission::line::Ticket {
                reach: second,
                ..waiting(&gate, 4, 40, 0)
            },
        ] {
            enqueue(&vm, t, t.id, 0.0, 10).unwrap().unwrap();
        }
        let views = gate.pod_views(&vm).unwrap();
        // Credit is asked in steps of the head's need.
        assert!(views.iter().all(|v| v.unit == 300));
        let demand: Vec<(String, u64)> = views.into_iter().map(|v| (v.pod, v.demand)).collect();
        assert_eq!(
            demand,
            vec![
                ("10.0.0.1:8000".to_string(), 300 + 80),
                ("10.0.0.2:8000".to_string(), 80 + 40)
            ]
        );
        // Its patience for its pod over (twice `cacheWaitMs` with etcd on), the head asks for
        // its first request on every pod of its reach where this replica holds nothing.
        host.set_now_ms(1_000_000 + gate.config.cache_wait_ms() - 1);
        assert_eq!(gate.pod_views(&vm).unwrap()[1].demand, 80 + 40);
        host.set_now_ms(1_000_000 + gate.config.cache_wait_ms());
        let demand: Vec<u64> = gate
            .pod_views(&vm)
            .unwrap()
            .into_iter()
            .map(|v| v.demand)
            .collect();
        assert_eq!(demand, vec![300 + 80, 300]);
    }

    #[test]
    fn a_filter_without_a_pool_writes_none_of_the_pools_gauges() {
        // envoy/envoy-models.yaml's kvgate-models beside the pool filters, which share the names.
        let split = r#"{"admission":{"enabled":false},"models":{"path":"",
            "routes":{"llama":{"targets":[{"model":"llama-3.1-8b","weight":1}]}}}}"#;
        assert_eq!(pool_gauges(split), vec![]);
        let pool = pool_gauges(r#"{"pods":["10.0.0.1:8000","10.0.0.2:8000"]}"#);
        assert!(
            pool.contains(&Stat::Gauge("kvgate.pods.total".into(), 2)),
            "{pool:?}"
        );
        let discovered = pool_gauges(r#"{"discovery":{"adminCluster":"admin"}}"#);
        assert!(
            discovered.contains(&Stat::Gauge("kvgate.pods.total".into(), 0)),
            "{discovered:?}"
        );
    }
}
