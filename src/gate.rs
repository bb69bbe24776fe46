//! One VM's state and periodic work: the parsed configuration, the router's replicas, admission's
//! parked tickets, caches of shared data, the scraper (active only while this VM holds the lease)
//! and the stats waiting to be flushed. Requests (`flow`) borrow it; the shell's root context
//! drives its tick, callouts and wake-ups.

use crate::admission::admit::Admission;
use crate::config::Config;
use crate::estimate::calibration::Calibration;
use crate::models::split::Split;
use crate::pods::scrape::{self, Call, Scraper, Target};
use crate::routing::router::Router;
use crate::stats::{self, Stats};
use crate::store::interface::{Store, StoreError};

/// How long the scraper's lease lasts without renewal; renewed every tick.
const LEASE_MS: u64 = 1_500;
/// The root context's tick: lease renewal, scrapes and discovery fall due on it.
pub const TICK_MS: u64 = 250;

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
            stats: Stats::default(),
        })
    }

    /// Periodic work: whichever VM holds the lease plans the scrapes and discovery calls due.
    pub fn on_tick(&mut self, store: &dyn Store) -> Vec<Call> {
        let now = store.now_ms();
        if let Err(e) = self.calibration.flush(store, &self.config.estimator) {
            log::debug!("kvgate: calibration flush failed: {e:?}");
        }
        if let Err(e) = self.router.sync(store, &self.config) {
            log::debug!("kvgate: sync failed: {e:?}");
        }
        match scrape::hold_lease(store, self.router.vm(), now, LEASE_MS) {
            Ok(true) => {}
            Ok(false) => return Vec::new(),
            Err(e) => {
                log::debug!("kvgate: lease: {e:?}");
                return Vec::new();
            }
        }
        self.scraper.expire(now);
        let pods = self.router.pods().to_vec();
        self.report_pods(store, &pods);
        self.scraper.due(&self.config, &pods, now)
    }

    /// Gauges of the pool, written by the lease holder only so they are not multiplied.
    fn report_pods(&mut self, store: &dyn Store, pods: &[String]) {
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
        for pod in pods {
            if let Ok(rec) = crate::pods::record::read(store, pod) {
                stale += u64::from(rec.is_stale(now, &self.config.metrics));
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_ACTIVE_BLOCKS),
                    rec.active_blocks(),
                );
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_IN_FLIGHT),
                    rec.entries.len() as u64,
                );
                let block = u64::from(self.router.block_tokens(&self.config.routing));
                let z = self.config.admission.headroom_sigmas;
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_RESERVED_TOKENS),
                    rec.forecast(None, z, block),
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
                }
                let budget =
                    crate::admission::budget::budget_tokens(&self.config, rec.snapshot.as_ref());
                self.stats.gauge(
                    stats::pod_stat(pod, stats::POD_BUDGET_TOKENS),
                    budget.unwrap_or(0),
                );
                let healthy = !rec.is_down();
                unhealthy += u64::from(!healthy);
                self.stats
                    .gauge(stats::pod_stat(pod, stats::POD_HEALTHY), u64::from(healthy));
            }
        }
        self.stats.gauge(stats::PODS_TOTAL, pods.len() as u64);
        self.stats.gauge(stats::PODS_STALE, stale);
        self.stats.gauge(stats::PODS_UNHEALTHY, unhealthy);
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

    /// Woken (or ticking): empties the wake queue and returns the head of the line if this VM
    /// holds it. The shell retries that request and asks again until `None`.
    pub fn next_parked(&mut self, store: &dyn Store) -> Option<u64> {
        self.admission.drain_wakes(store);
        if self.admission.parked() == 0 {
            return None;
        }
        self.admission.next_head(store).unwrap_or_else(|e| {
            log::debug!("kvgate: reading the queue failed: {e:?}");
            None
        })
    }

    /// Parked requests past their deadline; the shell retries each, which answers 503.
    /// This VM's parked requests that may be admitted past the head of the line now.
    pub fn backfill(&self, store: &dyn Store) -> Vec<u64> {
        self.admission.backfill(store, &self.config.admission)
    }

    pub fn expired(&self, store: &dyn Store) -> Vec<u64> {
        self.admission.expired(store.now_ms())
    }

    pub fn on_call_failed(&mut self, target: &Target) {
        self.scraper.abandon(target);
    }

    pub fn on_call_response(
        &mut self,
        store: &dyn Store,
        target: &Target,
        status: Option<u32>,
        body: &[u8],
    ) {
        if let Err(e) =
            self.scraper
                .on_response(store, &self.config, &mut self.stats, target, status, body)
        {
            log::warn!("kvgate: recording {target:?} failed: {e:?}");
        }
    }
}
